"""execute_to against the SSH test cluster, through the real command line (a subprocess)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ssh_scheduler.machines.hostlist import expand
from tests.cluster import Unsupported, skip_or_fail

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent


def execute_to(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "execute_to"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "ssh_scheduler", "execute_to"]
    return subprocess.run(
        [*argv, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def machines_range(cluster: Any, hosts: str) -> str:
    """``h[1-8]`` -> ``<machines dir>/h[1-8].yaml``: a folded range of machine files."""
    return str(cluster.machines_dir / f"{hosts}.yaml")


@pytest.mark.namespaces  # cut_network
def test_eight_hosts_one_cut_one_frozen(make_cluster: Callable[[int], Any]) -> None:
    cluster = make_cluster(8)
    try:
        cluster["h7"].cut_network()
    except Unsupported as exc:
        skip_or_fail(str(exc))
    cluster["h8"].freeze()

    proc = execute_to(
        "--machines", machines_range(cluster, "h[1-8]"),
        "--connect-timeout", "3", "--timeout", "5",
        'echo "$(hostname) says hi"; echo "on stderr" >&2',
    )  # fmt: skip

    assert proc.returncode == 255, proc.stdout + proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"h{i}: h{i} says hi" for i in range(1, 7)]
    err = proc.stderr.splitlines()
    assert sorted(line for line in err if line.endswith(": on stderr")) == [
        f"h{i}: on stderr" for i in range(1, 7)
    ]
    summary = [line for line in err if not line.endswith(": on stderr")]
    assert summary[0] == "exit 0: h[1-6]"
    # both are named (folded together when their reason reads the same)
    named: list[str] = []
    for line in summary[1:]:
        label, _, rest = line.partition(": ")
        assert label == "unreachable" and "no answer within 3 s" in rest
        named += expand(rest.split(" (")[0])
    assert sorted(named) == ["h7", "h8"]


def test_gather_prints_two_blocks(make_cluster: Callable[[int], Any]) -> None:
    cluster = make_cluster(5)
    flag = cluster["h3"].home / "flag"
    flag.write_text("special\n")
    os.chmod(flag, 0o644)
    proc = execute_to(
        "-b", "--machines", machines_range(cluster, "h[1-5]"),
        "if [ -e ~/flag ]; then cat ~/flag; else echo common; uname -s; fi",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "---------------", "h[1-2,4-5] (4)", "---------------", "common", "Linux",
        "---------------", "h3 (1)", "---------------", "special",
    ]  # fmt: skip
    assert proc.stderr == "exit 0: h[1-5]\n"


def test_json_lines_and_exit_codes(make_cluster: Callable[[int], Any]) -> None:
    cluster = make_cluster(4)
    proc = execute_to(
        "--json", "--machines", *map(str, cluster.machine_files),
        'echo "out $(hostname)"; echo "err" >&2; [ "$(hostname)" != h2 ] || exit 3',
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sorted(r["host"] for r in rows) == ["h1", "h2", "h3", "h4"]
    for r in rows:
        assert r["stdout"] == f"out {r['host']}\n"
        assert r["stderr"] == "err\n"
        assert r["exit_code"] == (3 if r["host"] == "h2" else 0)
        assert r["error"] is None and r["seconds"] >= 0
    assert proc.stderr.splitlines() == ["exit 0: h[1,3-4]", "exit 3: h2"]


def test_copy_forwards_then_cat(make_cluster: Callable[[int], Any], tmp_path: Path) -> None:
    cluster = make_cluster(3)
    (tmp_path / "pkg.txt").write_text("payload 42\n")
    proc = execute_to(
        "--machines", machines_range(cluster, "h[1-3]"), "--copy-forwards", "pkg.txt",
        "cat pkg.txt",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"h{i}: payload 42" for i in (1, 2, 3)]
    assert proc.stderr == "exit 0: h[1-3]\n"
    for host in cluster:
        jobs = host.workdir / "jobs"
        assert not jobs.exists() or not list(jobs.iterdir())  # the job folder is removed


def test_timeout_and_exclude(make_cluster: Callable[[int], Any]) -> None:
    cluster = make_cluster(3)
    proc = execute_to(
        "--timeout", "2", "--machines", machines_range(cluster, "h[1-3]"), "-x", "h3",
        '[ "$(hostname)" = h1 ] && sleep 30; echo done',
    )  # fmt: skip
    assert proc.returncode == 124, proc.stderr
    assert proc.stdout == "h2: done\n"
    assert proc.stderr.splitlines() == ["exit 0: h2", "timed out: h1 (exit 124, killed after 2 s)"]
    wait_until_gone(cluster["h1"], "sleep 30")


def remote_commands(host: Any) -> list[str]:
    found = []
    for pid, _ in host.processes():
        with contextlib.suppress(OSError):
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
    return found


def wait_until_gone(host: Any, command: str, within: float = 30) -> None:
    """The remote command was killed, not left running behind a closed channel (``within`` only
    stops a hung test)."""
    end = time.monotonic() + within
    while command in remote_commands(host):
        assert time.monotonic() < end, f"{command!r} still runs on {host.name}: {remote_commands(host)}"
        time.sleep(0.1)


def test_ctrl_c_kills_remote_commands(make_cluster: Callable[[int], Any]) -> None:
    cluster = make_cluster(2)
    script = Path(sys.executable).parent / "execute_to"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "ssh_scheduler", "execute_to"]
    # stdin is /dev/null for the command: ``cat`` ends at once instead of waiting for input
    proc = subprocess.Popen(
        [*argv, "--machines", machines_range(cluster, "h[1-2]"), "cat; echo ready; sleep 33"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        end = time.monotonic() + 20
        while not all("sleep 33" in remote_commands(h) for h in cluster):
            assert time.monotonic() < end and proc.poll() is None, "the commands never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert sorted(out.splitlines()) == ["h1: ready", "h2: ready"]
    assert "cancelled" in err
    for host in cluster:
        wait_until_gone(host, "sleep 33")


def test_what_a_command_leaves_running_on_purpose_outlives_it(make_cluster: Callable[[int], Any]) -> None:
    """``nohup server &`` through execute_to, as through plain ssh: the command ends, its channel
    closes, and the watchdog, which kills a command whose channel closed first, leaves the
    server alone."""
    cluster = make_cluster(1)
    host = cluster["h1"]
    proc = execute_to("--machines", machines_range(cluster, "h1"), "nohup sleep 41.5 >/dev/null 2>&1 & echo started")
    assert (proc.returncode, proc.stdout) == (0, "h1: started\n"), proc.stderr
    end = time.monotonic() + 30  # the watcher sees the channel end and decides (30 s: a hung test)
    while any("while read -r _" in c for c in remote_commands(host)):
        assert time.monotonic() < end, remote_commands(host)
        time.sleep(0.1)
    try:
        assert any("sleep 41.5" in c for c in remote_commands(host)), remote_commands(host)
    finally:
        host.run("pkill -f 'sleep 41.5'")


def test_unknown_host_key_is_one_unreachable_host(make_cluster: Callable[[int], Any], tmp_path: Path) -> None:
    cluster = make_cluster(3)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    spec = yaml.safe_load(cluster["h2"].machine_file.read_text())
    spec["known_hosts"] = str(empty)
    stranger = tmp_path / "h2.yaml"
    stranger.write_text(yaml.safe_dump(spec))
    files = [str(cluster["h1"].machine_file), str(stranger), str(cluster["h3"].machine_file)]

    proc = execute_to("--machines", *files, "echo fine")
    assert proc.returncode == 255
    assert sorted(proc.stdout.splitlines()) == ["h1: fine", "h3: fine"]
    lines = proc.stderr.splitlines()
    assert lines[0] == "exit 0: h[1,3]"
    assert lines[1].startswith("unreachable: h2 (unknown host key SHA256:")
    assert "--accept-new" in lines[1] and len(lines) == 2

    proc = execute_to("--accept-new", "--machines", *files, "echo fine")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "exit 0: h[1-3]\n"
    assert cluster["h2"].ip in empty.read_text()
