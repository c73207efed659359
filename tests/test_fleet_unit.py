"""execute_to without the SSH cluster: the pure parts, and whole runs on local "hosts"
(``LocalTransport``: same code path minus SSH) plus a refused loopback port."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.fleet import (
    FleetOptions,
    execute_to,
    killable,
    take_trailing_command,
)
from ssh_scheduler.coordinator.fleet_output import (
    HostResult,
    fleet_exit_status,
    gather_blocks,
    gather_outputs,
    json_line,
    summarize_exit_codes,
)
from ssh_scheduler.errors import ConfigError, TransferError
from ssh_scheduler.machines.hostlist import expand
from ssh_scheduler.machines.machine import Machine, local_machine
from tests.live_batch import alive, wait_until

REPO = Path(__file__).resolve().parent.parent


def ok(host: str, out: bytes = b"", code: int = 0, err: bytes = b"") -> HostResult:
    return HostResult(host, code, out, err, 0.1)


def down(host: str, why: str = "no answer within 3 s") -> HostResult:
    return HostResult(host, None, b"", b"", 3.0, error=f"{host} (ben@10.0.0.9): {why}", reached=False)


# --- gather ----------------------------------------------------------------------------------


def test_gather_two_outputs_over_five_hosts() -> None:
    results = [
        ok("gpu1", b"ok\n"),
        ok("gpu2", b"ok\n"),
        ok("gpu5", b"different\nlines\n"),
        ok("gpu3", b"ok\n"),
        ok("gpu12", b"different\nlines\n"),
    ]
    blocks = gather_outputs(results)
    assert blocks == [("gpu[1-3]", b"ok\n"), ("gpu[5,12]", b"different\nlines\n")]
    assert sorted(n for hosts, _ in blocks for n in expand(hosts)) == sorted(r.host for r in results)

    lines = gather_blocks(results)
    assert lines == [
        "---------------", "gpu[1-3] (3)", "---------------", "ok",
        "---------------", "gpu[5,12] (2)", "---------------", "different", "lines",
    ]


def test_gather_skips_empty_and_unreachable_and_keeps_streams_apart() -> None:
    results = [ok("a1", b"x\n", err=b"warn\n"), ok("a2", b""), down("a3"), ok("a4", b"x\n")]
    assert gather_outputs(results) == [("a[1,4]", b"x\n")]
    assert gather_outputs(results, "stderr") == [("a1", b"warn\n")]


def test_gather_output_without_final_newline_and_long_header() -> None:
    names = [f"node-{c}" for c in "abcdefgh"]
    lines = gather_blocks([ok(n, b"no newline") for n in names])
    header = "node-a,node-b,node-c,node-d,node-e,node-f,node-g,node-h (8)"
    assert lines == ["-" * len(header), header, "-" * len(header), "no newline"]


def test_gather_keeps_undecodable_bytes() -> None:
    (line,) = gather_blocks([ok("h1", b"\xff\xfe\n")])[3:]
    assert line.encode("utf-8", "surrogateescape") == b"\xff\xfe"


# --- summary and exit status -----------------------------------------------------------------


def test_summary_groups_hosts_by_outcome() -> None:
    results = [ok(f"h{i}") for i in range(1, 7)]
    results += [ok("h7", code=3), down("h8"), down("h9", "Connection refused")]
    results.append(
        HostResult("h10", 124, b"", b"", 5.0, error="killed after 5 s", timed_out=True)
    )
    results.append(
        HostResult("h11", None, b"", b"", 1.0, error="h11 (10.0.0.11): connection lost", reached=True)
    )
    assert summarize_exit_codes(results) == [
        "exit 0: h[1-6]",
        "exit 3: h7",
        "timed out: h10 (exit 124, killed after 5 s)",
        "failed: h11 (connection lost)",
        "unreachable: h8 (no answer within 3 s)",
        "unreachable: h9 (Connection refused)",
    ]


def test_summary_folds_unreachable_hosts_with_the_same_reason() -> None:
    assert summarize_exit_codes([down("n1"), down("n2"), down("n3"), ok("n4")]) == [
        "exit 0: n4",
        "unreachable: n[1-3] (no answer within 3 s)",
    ]


@pytest.mark.parametrize(
    ("codes", "status"),
    [
        ([0, 0, 0], 0),
        ([0, 3, 1], 3),
        ([0, 124, 2], 124),
        ([0, 130], 130),
        ([0, None], 255),
        ([7, None, 3], 255),
        ([], 0),
    ],
)
def test_exit_status_rule(codes: list[int | None], status: int) -> None:
    results = [HostResult(f"h{i}", c, b"", b"", 0.0) for i, c in enumerate(codes)]
    assert fleet_exit_status(results) == status


def test_json_line_format() -> None:
    line = json_line(HostResult("h1", 0, b"hello\n", b"\xffwarn\n", 1.23456))
    assert "\n" not in line
    assert json.loads(line) == {
        "host": "h1", "exit_code": 0, "stdout": "hello\n", "stderr": "\ufffdwarn\n",
        "seconds": 1.235, "error": None, "timed_out": False,
    }
    bad = json.loads(json_line(down("h8")))
    assert bad["exit_code"] is None and "no answer" in bad["error"]


# --- the command given last ------------------------------------------------------------------


def test_trailing_command_taken_from_machines() -> None:
    machines = ["a", "b", "uptime"]
    assert take_trailing_command(machines, [], [], ["--machines", "a", "b", "uptime"]) == "uptime"
    assert machines == ["a", "b"]


def test_trailing_command_follows_the_last_multi_value_flag() -> None:
    argv = ["--machines", "h[1-8]", "-x", "h3", "hostname"]
    machines, exclude = ["h[1-8]"], ["h3", "hostname"]
    assert take_trailing_command(machines, exclude, [], argv) == "hostname"
    assert exclude == ["h3"] and machines == ["h[1-8]"]

    argv = ["--copy-forwards", "w.whl", "--machines", "a", "pip install w.whl"]
    machines, fwd = ["a", "pip install w.whl"], ["w.whl"]
    assert take_trailing_command(machines, [], fwd, argv) == "pip install w.whl"
    assert machines == ["a"] and fwd == ["w.whl"]


def test_trailing_command_without_argv_hint() -> None:
    # argv that says nothing useful (an API caller's sys.argv): only an unambiguous list is used
    assert take_trailing_command(["a", "cmd"], [], [], ["pytest", "-x"]) == "cmd"
    assert take_trailing_command(["a"], [], [], []) is None
    assert take_trailing_command(["a", "b"], ["c"], [], []) is None


# --- whole runs on local hosts ---------------------------------------------------------------


def local_hosts(tmp_path: Path, n: int, prefix: str = "h") -> list[Machine]:
    return [
        dataclasses.replace(local_machine(), name=f"{prefix}{i}", workdir=str(tmp_path / "work"))
        for i in range(1, n + 1)
    ]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


async def test_prefixed_streaming_and_summary(tmp_path: Path) -> None:
    out, err = Lines(), Lines()
    machines = local_hosts(tmp_path, 3)
    machines.append(Machine(name="dead", host="127.0.0.1", port=closed_port(), connect_timeout=3))
    result = await execute_to(
        machines, "echo one; echo two >&2; printf 'no newline'; exit 4", FleetOptions(), out=out, err=err
    )
    assert result.exit_status == 255
    for h in ("h1", "h2", "h3"):
        assert [x for x in out.lines if x.startswith(f"{h}:")] == [f"{h}: one", f"{h}: no newline"]
        assert f"{h}: two" in err.lines
    assert err.lines[-2:] == ["exit 4: h[1-3]", err.lines[-1]]
    assert err.lines[-1].startswith("unreachable: dead (")
    assert [r.host for r in result.results] == ["h1", "h2", "h3", "dead"]
    assert result.results[0].stdout == b"one\nno newline"
    assert result.results[0].stderr == b"two\n"
    assert result.results[3].exit_code is None and not result.results[3].reached


async def test_gather_mode_prints_blocks_once(tmp_path: Path) -> None:
    out, err = Lines(), Lines()
    result = await execute_to(
        local_hosts(tmp_path, 5), "echo same; echo warn >&2", FleetOptions(gather=True), out=out, err=err
    )
    assert result.exit_status == 0
    assert out.lines == ["---------------", "h[1-5] (5)", "---------------", "same"]
    assert err.lines == ["---------------", "h[1-5] (5)", "---------------", "warn", "exit 0: h[1-5]"]


async def test_json_mode(tmp_path: Path) -> None:
    out, err = Lines(), Lines()
    machines = local_hosts(tmp_path, 2)
    machines.append(Machine(name="dead", host="127.0.0.1", port=closed_port(), connect_timeout=3))
    result = await execute_to(machines, "echo hi", FleetOptions(json=True), out=out, err=err)
    rows = {row["host"]: row for row in map(json.loads, out.lines)}
    assert set(rows) == {"h1", "h2", "dead"}
    assert rows["h1"]["stdout"] == "hi\n" and rows["h1"]["exit_code"] == 0
    assert rows["dead"]["exit_code"] is None and rows["dead"]["error"]
    assert result.exit_status == 255


async def test_timeout_kills_and_reports_124(tmp_path: Path) -> None:
    out, err = Lines(), Lines()
    machines = local_hosts(tmp_path, 3)
    pids = tmp_path / "pids"
    pids.mkdir()
    result = await execute_to(
        machines, f"echo started; echo $$ > {pids}/$$; exec sleep 30", FleetOptions(timeout=0.5),
        out=out, err=err,
    )
    assert result.exit_status == 124
    assert all(r.timed_out and r.exit_code == 124 for r in result.results)
    assert all(r.stdout == b"started\n" for r in result.results)  # partial output kept
    assert err.lines == ["timed out: h[1-3] (exit 124, killed after 0.5 s)"]
    # killed, not waited for: the sleeps are gone although they had 30 s to go
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 3
    await wait_all_gone(started)


# Each job of the concurrency tests joins a rendezvous: it puts its shell's PID in a shared
# folder, waits (at most ~10 s, then fails) until ``need`` jobs are in it at once, and prints how
# many it saw there; a job removes itself when it ends.  The jobs' own view proves what ran side by
# side, whatever the machine's load.
def rendezvous(folder: Path, need: int) -> str:
    return (
        f"cd {folder} && touch $$ && n=0; "
        f"until [ $(ls | wc -l) -ge {need} ]; do n=$((n+1)); [ $n -lt 500 ] || exit 9; sleep 0.02; done; "
        "sleep 0.1; ls | wc -l; rm $$"
    )


async def test_max_connections_bounds_concurrency(tmp_path: Path) -> None:
    machines = local_hosts(tmp_path, 6)
    (tmp_path / "pairs").mkdir()
    result = await execute_to(
        machines, rendezvous(tmp_path / "pairs", 2), FleetOptions(max_connections=2),
        out=Lines(), err=Lines(),
    )
    assert result.exit_status == 0, [r.stderr for r in result.results]  # pairs did meet
    seen = [int(r.stdout) for r in result.results]
    assert max(seen) <= 2, seen  # and never more than two ran at once

    (tmp_path / "all").mkdir()
    result = await execute_to(machines, rendezvous(tmp_path / "all", 6), FleetOptions(), out=Lines(), err=Lines())
    assert result.exit_status == 0, [r.stderr for r in result.results]  # all six at once


async def test_copy_forwards_into_the_working_directory(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "payload.txt").write_text("the payload\n")
    out = Lines()
    result = await execute_to(
        local_hosts(tmp_path, 2),
        "cat payload.txt",
        FleetOptions(copy_forwards=("payload.txt",), base_dir=src),
        out=out,
        err=Lines(),
    )
    assert result.exit_status == 0
    assert sorted(out.lines) == ["h1: the payload", "h2: the payload"]
    assert not list((tmp_path / "work" / "jobs").iterdir())  # job folders removed


async def test_copy_forwards_missing_file_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(TransferError, match="does not exist"):
        await execute_to(
            local_hosts(tmp_path, 1), "true",
            FleetOptions(copy_forwards=("nope.whl",), base_dir=tmp_path),
        )


async def test_bad_options_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max-connections"):
        await execute_to(local_hosts(tmp_path, 1), "true", FleetOptions(max_connections=0))
    with pytest.raises(ConfigError, match="--timeout"):
        await execute_to(local_hosts(tmp_path, 1), "true", FleetOptions(timeout=0))


# --- CLI -------------------------------------------------------------------------------------


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ssh_scheduler", "execute_to", *args],
        capture_output=True, text=True, timeout=60, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_cli_without_machines_is_one_line_exit_2() -> None:
    proc = run_cli("uptime")
    assert proc.returncode == 2
    assert proc.stderr == "error: execute_to needs --machines\n"


def test_cli_unreachable_machine_file(tmp_path: Path) -> None:
    port = closed_port()
    for i in (1, 2):
        (tmp_path / f"dead{i}.yaml").write_text(f"ip: 127.0.0.{i}\nport: {port}\nusername: nobody\n")
    # the command last, after the --machines values (swallowed by them, then taken back)
    proc = run_cli("--connect-timeout", "2", "--machines", "dead1.yaml", "dead2.yaml", "true", cwd=tmp_path)
    assert proc.returncode == 255, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["unreachable: dead1", "unreachable: dead2"]


def test_cli_command_after_exclude(tmp_path: Path) -> None:
    port = closed_port()
    for i in (1, 2, 3):
        (tmp_path / f"dead{i}.yaml").write_text(f"ip: 127.0.0.{i}\nport: {port}\n")
    proc = run_cli("--machines", "dead[1-3].yaml", "-x", "dead2.yaml", "true", cwd=tmp_path)
    assert proc.returncode == 255, proc.stderr
    assert [line.split(" (")[0] for line in proc.stderr.splitlines()] == [
        "unreachable: dead1", "unreachable: dead3"
    ]


async def test_cancel_stops_every_host(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    task = asyncio.create_task(
        execute_to(
            local_hosts(tmp_path, 4), f"echo $$ > {pids}/$$; exec sleep 30",
            FleetOptions(), out=Lines(), err=Lines(),
        )
    )
    for _ in range(100):
        if len(list(pids.iterdir())) == 4:
            break
        await asyncio.sleep(0.05)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 4 and all(alive(pid) for pid in started)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_all_gone(started)


async def wait_all_gone(pids: list[int]) -> None:
    """The processes end (a kill may take a moment to land); 10 s only stops a hung test."""
    for _ in range(200):
        if not any(alive(pid) for pid in pids):
            return
        await asyncio.sleep(0.05)
    assert [pid for pid in pids if alive(pid)] == []


# --- the remote watchdog (run here with a local shell, as sshd would run it) ------------------


def start_killable(command: str, grace: float = 2.0, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["/bin/sh", "-c", killable(command, grace)],
        stdin=subprocess.PIPE,  # the channel: open until it closes
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "SHELL": "/bin/sh", **env},
        start_new_session=True,  # as sshd starts a session's command: the leader of its group
    )


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, bytes, bytes]:
    """Read to the end, keeping stdin (the channel) open: communicate() would close it."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    return proc.wait(timeout=10), out, err


def test_killable_passes_output_and_exit_status_through() -> None:
    # cat ends at once: the command's stdin is /dev/null, not the channel
    with start_killable("cat; echo out; echo err >&2; exit 3") as proc:
        assert finish(proc) == (3, b"out\n", b"err\n")
    # A signal is the command's own (sshd says exit-signal; transport.exec makes it 128+n), and
    # no shell waits on it to print "Killed".
    with start_killable("kill -9 $$") as proc:
        assert finish(proc) == (-signal.SIGKILL, b"", b"")


def test_killable_leaves_the_command_no_child_and_no_descriptor_of_its_own() -> None:
    """The watcher is detached: a command that waits for any child of its own (a supervisor,
    ``os.wait()``) finds none it did not start, and only stdin, stdout and stderr are open."""
    probe = (
        f"exec {sys.executable} -c 'import os; print(sorted(os.listdir(\"/proc/self/fd\"))); "
        "print(os.waitpid(-1, os.WNOHANG))'"
    )
    with start_killable(probe) as proc:
        code, out, err = finish(proc)
    assert code == 1 and b"ChildProcessError" in err, (code, out, err)  # no child at all
    assert out == b"['0', '1', '2', '3']\n"  # 3: the listing's own


def test_killable_kills_the_whole_command_when_the_channel_closes() -> None:
    with start_killable("sleep 29 & echo $!; sleep 30; echo never") as proc:
        assert proc.stdout is not None and proc.stdin is not None
        background = int(proc.stdout.readline())
        assert alive(background)
        proc.stdin.close()
        code, out, _ = finish(proc)
    assert (code, out) == (-signal.SIGTERM, b"")  # the command died of the TERM
    asyncio.run(wait_all_gone([background]))


def test_killable_kills_what_ignores_sigterm() -> None:
    with start_killable("trap '' TERM; echo $$; sleep 30", grace=0.5) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        shell = int(proc.stdout.readline())
        proc.stdin.close()
        code, _, _ = finish(proc)
    assert code == -signal.SIGKILL  # TERM was ignored; the KILL after the grace ended it
    asyncio.run(wait_all_gone([shell]))


def test_killable_kills_nothing_after_a_command_that_ended_by_itself() -> None:
    """``nohup server &`` is meant to outlive the command, as with plain ssh: the channel's end
    after the command ended kills nothing."""
    with start_killable("nohup sleep 28.3 >/dev/null 2>&1 & echo $!") as proc:
        assert proc.stdout is not None and proc.stdin is not None
        server = int(proc.stdout.readline())
        assert finish(proc)[0] == 0  # ended, and reaped (as sshd reaps it)
        proc.stdin.close()  # then the channel closes
    try:
        # the watcher (in the command's group, as the server) reads the end, and goes alone
        wait_until(lambda: group_members(proc.pid) == [server], "only the server is left in the command's group")
    finally:
        os.kill(server, signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """The live processes of a process group (from /proc: stat's 5th field is the group)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def test_killable_without_python3_is_watched_all_the_same() -> None:
    with start_killable("echo plain; exit 4", PATH="/nonexistent") as proc:
        assert finish(proc) == (4, b"plain\n", b"")
    with start_killable("echo $$; /bin/sleep 30", PATH="/nonexistent") as proc:
        assert proc.stdout is not None and proc.stdin is not None
        shell = int(proc.stdout.readline())
        proc.stdin.close()
        assert finish(proc)[0] == -signal.SIGTERM
    asyncio.run(wait_all_gone([shell]))


