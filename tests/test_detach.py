"""``execute_batch --detach`` on this machine (jobs without SSH), and its parts: the event file's
records back into events, the log's bound, ``attach`` / ``status`` / ``cancel --all`` from
separate processes."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.detach import (
    LOG_NAME,
    CoordinatorSession,
    event_from_json,
    follow_events,
)
from ssh_scheduler.errors import BatchError
from ssh_scheduler.events import (
    BatchFinished,
    BatchStarted,
    GpuReading,
    HostProbed,
    JobFailed,
    JobStarted,
)
from ssh_scheduler.jobs.job_names import validate_job_name
from ssh_scheduler.results.event_log import EVENTS_NAME
from ssh_scheduler.view import live
from ssh_scheduler.view.live import BoardState

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "ssh_scheduler"]
LOCAL = ["--no-gpu-required", "--num-cpus", "0", "--memory-required", "0", "--copy-forwards", "empty"]


def env(tmp: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp / "home"))


def cli_run(tmp: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=tmp, env=env(tmp), capture_output=True, text=True, timeout=timeout)


def batch_dir(tmp: Path, lines: list[str]) -> None:
    (tmp / "empty").mkdir()
    (tmp / "b.sh").write_text("".join(line + "\n" for line in lines))


def coordinator_pid(tmp: Path) -> int:
    return int(json.loads((tmp / "job_results" / ".lock").read_text())["pid"])


def proc_stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # state ppid pgrp session tty_nr ...


def gone(pid: int, limit: float = 60) -> bool:
    deadline = time.monotonic() + limit
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


class Viewer:
    """An ``attach`` process whose stdout lines a thread collects."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "attach", *args], cwd=tmp, env=env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()

    def until(self, prefix: str, timeout: float = 60) -> None:
        with self._seen:
            assert self._seen.wait_for(lambda: any(x.startswith(prefix) for x in self.lines), timeout), self.lines

    def finish(self) -> tuple[int, str]:
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        code = self.proc.wait(timeout=120)
        self._thread.join(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return code, err


# --- the parts ------------------------------------------------------------------------------


def test_event_records_become_the_same_events_again() -> None:
    samples = [
        BatchStarted(token="t", jobs=3, hosts=("h1", "h2"), limits=(("a.yaml", 2),), gpu_choices=((0, 1), (2,))),
        HostProbed(host="h1", cpus=4, load=0.5, memory_free_mb=10, memory_total_mb=20, gpus=(GpuReading(0, 1, 2, 0.5),)),
        JobStarted(job="b.sh.1", host="h1", gpus=(0,), command="echo x"),
        JobFailed(job="b.sh.2", host="h2", command="false", code=1, reason="exit 1", seconds=0.25),
        BatchFinished(finished=1, failed=("b.sh.2",), skipped=0, not_run=(), cancelled=False, halted=False,
                      seconds=1.0, bytes_sent=5, files_sent=1, bytes_received=2),
    ]
    for event in samples:
        again = event_from_json(json.loads(json.dumps(event.to_json())))
        assert again == dataclasses.replace(event, t=round(event.t, 3))  # the wire keeps ms
    assert event_from_json({"event": "from_a_newer_version", "t": 1.0}) is None


def test_the_log_is_rotated_at_its_bound_and_the_parent_learns_once_the_batch_is_under_way(tmp_path: Path) -> None:
    early = os.open(tmp_path / "early", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(early, b"connecting\n")
    out = os.dup(early)
    status_read, status_write = os.pipe()
    session = CoordinatorSession(tmp_path, status_write, log_max_bytes=2000, out_fds=(early, out))
    session(JobStarted(job="j", host="h", gpus=(), command="c"))  # before: kept in memory
    assert not (tmp_path / EVENTS_NAME).exists()
    session(BatchStarted(token="t", jobs=1, hosts=("h",)))
    assert os.read(status_read, 100) == b"ready\n" and os.read(status_read, 100) == b""  # and closed
    records = [json.loads(line) for line in (tmp_path / EVENTS_NAME).read_text().splitlines()]
    assert [r["event"] for r in records] == ["coordinator", "job_started", "batch_started"]
    assert records[0]["pid"] == os.getpid()
    assert (tmp_path / LOG_NAME).read_text() == "connecting\n"  # what was written before moved in

    write = session.printer(lambda line: os.write(early, (line + "\n").encode()) and None)
    for n in range(100):
        write(f"line {n:03d} " + "x" * 40)
    assert (tmp_path / f"{LOG_NAME}.1").stat().st_size > 2000  # the full one kept once
    assert (tmp_path / LOG_NAME).stat().st_size <= 2000
    assert (tmp_path / LOG_NAME).read_text().splitlines()[-1].startswith("line 099")
    session.finish(3, ["done: ..."])
    last = json.loads((tmp_path / EVENTS_NAME).read_text().splitlines()[-1])
    assert (last["event"], last["code"], last["lines"]) == ("coordinator_exit", 3, ["done: ..."])
    assert [r["event"] for r in follow_events(tmp_path)][-1] == "coordinator_exit"
    for fd in (early, out, status_read):
        os.close(fd)


def test_a_live_view_attached_later_counts_elapsed_time_from_the_batch_s_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both clocks fixed: the board's start is the batch's age before "now", exactly.
    monkeypatch.setattr(live.time, "monotonic", lambda: 500.0)
    monkeypatch.setattr(live.time, "time", lambda: 10_000.0)
    board = BoardState()
    board.apply(BatchStarted(token="t", jobs=1, hosts=("h",), t=9_900.0))
    assert board.started_at == 400.0
    board.apply(BatchStarted(token="t", jobs=1, hosts=("h",), t=10_005.0))  # a clock ahead of ours
    assert board.started_at == 500.0


def test_an_exported_variable_does_not_make_a_command_the_detached_coordinator(tmp_path: Path) -> None:
    # The variable an earlier version read; now only the hidden --detached-status-fd, which
    # --detach puts on the coordinator's own command line, is that way in.
    batch_dir(tmp_path, ["echo x"])
    result = subprocess.run(
        [*CLI, "execute_batch", "b.sh", *LOCAL], cwd=tmp_path, env=dict(env(tmp_path), SSH_SCHEDULER_DETACHED="1"),
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "finished: b.sh.1; echo x" in result.stdout.splitlines()  # in the foreground, on our stdout
    assert not (tmp_path / "job_results" / LOG_NAME).exists()
    # Every run keeps the event file; a foreground one's ends like a detached one's.
    last = json.loads((tmp_path / "job_results" / EVENTS_NAME).read_text().splitlines()[-1])
    assert (last["event"], last["code"]) == ("coordinator_exit", 0)


def test_the_coordinator_s_way_in_is_hidden_and_takes_only_a_pipe(tmp_path: Path) -> None:
    batch_dir(tmp_path, ["echo x"])
    assert "--detached-status-fd" not in cli_run(tmp_path, "execute_batch", "--help").stdout
    refused = cli_run(tmp_path, "execute_batch", "b.sh", "--detached-status-fd", "99", *LOCAL)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --detached-status-fd 99 is not a pipe")
    assert len(refused.stderr.splitlines()) == 1 and not (tmp_path / "job_results").exists()


# --- the whole thing, from separate processes --------------------------------------------------


@pytest.mark.slow
def test_detach_returns_while_jobs_run_and_attach_status_follow_it(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    batch_dir(tmp_path, [f"while [ ! -e {gate} ]; do sleep 0.1; done; echo passed", "echo second"])
    started = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", *LOCAL)
    assert started.returncode == 0, started.stderr
    assert "detached: the batch runs on in the background (pid " in started.stderr
    results = tmp_path / "job_results"
    pid = coordinator_pid(tmp_path)  # the lock is the coordinator's, not the parent's
    assert f"(pid {pid})" in started.stderr
    # Its own session, no terminal, stdin from /dev/null.
    state = proc_stat(pid)
    assert state[3] == str(pid) and state[4] == "0"
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    # Under way but not done: the first job waits for the gate, which does not exist yet.
    assert not (results / "b.sh.1").exists()
    status = cli_run(tmp_path, "status", "--json")
    assert json.loads(status.stdout)["coordinator"] == "running", status.stderr
    text = cli_run(tmp_path, "status").stdout
    assert f"running (pid {pid} on " in text and "detached: its log is job_results/.coordinator.log" in text

    again = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", *LOCAL)  # the folder is taken
    assert again.returncode == 2 and again.stderr.startswith("error: job_results/ is in use by another run (pid ")
    assert f"(pid {pid} on host" in again.stderr and len(again.stderr.splitlines()) == 1
    assert "is in use" not in (results / LOG_NAME).read_text()  # the refused run never wrote the log

    first, second = Viewer(tmp_path), Viewer(tmp_path)
    for viewer in (first, second):
        viewer.until("started: b.sh.1;")  # caught up on what happened before it attached
    quitter = Viewer(tmp_path)
    quitter.until("started: b.sh.1;")
    quitter.proc.send_signal(signal.SIGINT)  # leaves the viewer, not the batch
    code, err = quitter.finish()
    assert code == 130 and "the batch goes on" in err
    os.kill(pid, signal.SIGHUP)  # what the old terminal's hangup would send: ignored
    assert cli_run(tmp_path, "status", "--json").stdout.count('"running"') >= 1
    assert not (results / "b.sh.1").exists()

    gate.touch()
    for viewer in (first, second):
        code, err = viewer.finish()
        assert code == 0, err
        assert "finished: b.sh.1; " in "\n".join(viewer.lines) and "finished: b.sh.2; echo second" in viewer.lines
        assert err.splitlines()[0].startswith("done: 2 finished, 0 failed")
    assert first.lines == second.lines
    assert gone(pid)
    assert (results / "b.sh.1.out").read_text() == "passed\n"
    assert "finished: b.sh.2; echo second" in (results / LOG_NAME).read_text()

    replay = cli_run(tmp_path, "attach")  # a finished batch: its story and its exit status
    assert replay.returncode == 0 and replay.stdout.splitlines() == first.lines
    as_json = cli_run(tmp_path, "attach", "--json")
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert records[0]["event"] == "coordinator" and records[-1] == {**records[-1], "event": "coordinator_exit", "code": 0}


@pytest.mark.slow
def test_detach_with_json_prints_the_records_up_to_the_batch_s_start(tmp_path: Path) -> None:
    batch_dir(tmp_path, ["echo one", "echo two"])
    started = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", "--json", "-q", *LOCAL)
    assert started.returncode == 0, started.stderr
    records = [json.loads(line) for line in started.stdout.splitlines()]  # stdout: JSON records only
    assert records[0]["event"] == "coordinator" and f"(pid {records[0]['pid']})" in started.stderr
    assert records[-1]["event"] == "batch_started" and records[-1]["jobs"] == 2
    assert gone(records[0]["pid"])
    replayed = cli_run(tmp_path, "attach", "--json").stdout.splitlines()
    assert replayed[: len(records)] == started.stdout.splitlines()  # the same records attach begins with


def test_a_refused_detach_prints_one_line_and_leaves_nothing_behind(tmp_path: Path) -> None:
    batch_dir(tmp_path, ["echo x"])
    (tmp_path / "bad.yaml").write_text("host: [unclosed\n")
    refused = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", "--machines", "bad.yaml", *LOCAL)
    assert refused.returncode == 2
    assert len(refused.stderr.splitlines()) == 1 and refused.stderr.startswith("error: "), refused.stderr
    assert not (tmp_path / "job_results").exists()
    mine = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cwd(p) == tmp_path]
    assert mine == []  # no coordinator left running in the batch's folder

    huge = ["--no-gpu-required", "--num-cpus", "0", "--memory-required", str(1 << 40), "--copy-forwards", "empty"]
    never = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", *huge)
    assert never.returncode != 0 and never.stderr.startswith("error: ") and len(never.stderr.splitlines()) == 1
    both = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", "--dry-run", *LOCAL)
    assert both.returncode == 2 and "--dry-run runs nothing" in both.stderr
    nothing = cli_run(tmp_path, "attach")
    assert nothing.returncode == 2 and nothing.stderr == "error: nothing to attach to in job_results: no batch ran there with --detach\n"
    (tmp_path / "job_results").mkdir()
    (tmp_path / "job_results" / ".journal.jsonl").write_text("")  # what a foreground run leaves
    foreground = cli_run(tmp_path, "attach")
    assert foreground.returncode == 2 and "its batch was not started with --detach" in foreground.stderr


def _cwd(proc: Path) -> Path | None:
    try:
        return Path(os.readlink(proc / "cwd"))
    except OSError:
        return None


@pytest.mark.slow
def test_cancel_all_stops_a_detached_batch_like_two_ctrl_c(tmp_path: Path) -> None:
    batch_dir(tmp_path, [f"echo $$ > {tmp_path}/pid.tmp && mv {tmp_path}/pid.tmp {tmp_path}/pid; exec sleep 300", "echo never"])
    started = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", "--num-cpus", "0", "--no-gpu-required",
                      "--memory-required", "0", "--copy-forwards", "empty", "--reserve")
    assert started.returncode == 0, started.stderr
    pid = coordinator_pid(tmp_path)
    viewer = Viewer(tmp_path)
    viewer.until("started: b.sh.1;")
    job_pid = _wait_for_pid_file(tmp_path)
    os.kill(job_pid, 0)  # the job really runs

    stopped = cli_run(tmp_path, "cancel", "--all")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.splitlines() == [
        f"stopping the batch (pid {pid}): killing 1 running jobs, cleaning its hosts", "stopped",
    ]
    assert gone(pid, 0)  # cancel returned once the coordinator had ended
    assert gone(job_pid, 10)
    code, err = viewer.finish()
    assert code == 130 and err.splitlines()[-1] == "cancelled: running jobs were killed"
    journal = [json.loads(x) for x in (tmp_path / "job_results" / ".journal.jsonl").read_text().splitlines()]
    assert [e["state"] for e in journal if e.get("job") == "b.sh.1"][-1] == "cancelled"
    assert not any(e.get("job") == "b.sh.2" and e["state"] == "finished" for e in journal)
    gone_now = cli_run(tmp_path, "cancel", "--all")
    assert gone_now.returncode == 2 and "no batch is running in job_results" in gone_now.stderr


def _wait_for_pid_file(tmp: Path) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (tmp / "pid").exists():
            return int((tmp / "pid").read_text())
        time.sleep(0.1)
    raise AssertionError("the job never wrote its pid")


def _read_until(master: int, wanted: bytes, limit: float = 60) -> bytes:
    seen = b""
    deadline = time.monotonic() + limit
    while wanted not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                seen += os.read(master, 65536)
            except OSError:  # EIO: the other side closed
                break
    return seen


def _controlling_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # after setsid: the pty on stdin becomes our terminal
    # A login's shell has SIGHUP's default action, whatever this test runs under (nohup, a CI
    # runner that ignores it): the hang-up below must end the terminal's session as it would.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.slow
def test_the_batch_outlives_the_terminal_session_that_started_it(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    batch_dir(tmp_path, [f"while [ ! -e {gate} ]; do sleep 0.1; done; echo passed"])
    command = " ".join([*CLI, "execute_batch", "b.sh", "--detach", *LOCAL]) + "; echo returned $?; exec sleep 300"
    master, slave = pty.openpty()
    shell = subprocess.Popen(
        ["bash", "-c", command], cwd=tmp_path, env=env(tmp_path), stdin=slave, stdout=slave, stderr=slave,
        start_new_session=True, preexec_fn=_controlling_terminal,
    )
    os.close(slave)
    try:
        seen = _read_until(master, b"returned")
        assert b"returned 0" in seen, seen
        pid = coordinator_pid(tmp_path)
        assert proc_stat(pid)[3] != str(shell.pid)  # not in the terminal's session
        os.close(master)  # the SSH session ends: the terminal hangs up, its session gets SIGHUP
        assert shell.wait(timeout=30) == -signal.SIGHUP
        os.kill(pid, 0)  # the coordinator did not go with it
    finally:
        gate.touch()  # the job ends whatever failed above: nothing polls on after the test
        if shell.poll() is None:
            shell.kill()
            shell.wait()
    assert gone(pid)
    assert (tmp_path / "job_results" / "b.sh.1.out").read_text() == "passed\n"

    # A finished batch in the live view: its lines above the drawing, its exit status.
    master, slave = pty.openpty()
    viewer = subprocess.Popen(
        [*CLI, "attach", "--live"], cwd=tmp_path, env=dict(env(tmp_path), TERM="xterm-256color", COLUMNS="120"),
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True,
    )
    os.close(slave)
    drawn = _read_until(master, b"report: ssh-scheduler report").decode(errors="replace")  # its last line
    os.close(master)
    assert viewer.wait(timeout=30) == 0
    assert "finished: b.sh.1; " in drawn and "done: 1 finished, 0 failed" in drawn
    assert "1/1" in drawn  # the progress the live view draws from the replayed events


@pytest.mark.slow
def test_attach_to_a_coordinator_that_was_killed_says_so(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    batch_dir(tmp_path, [f"while [ ! -e {gate} ]; do sleep 0.1; done"])
    started = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", "--lease", "5", *LOCAL)
    assert started.returncode == 0, started.stderr
    pid = coordinator_pid(tmp_path)
    viewer = Viewer(tmp_path)
    viewer.until("started: b.sh.1;")
    os.kill(pid, signal.SIGKILL)
    code, err = viewer.finish()
    assert code == 1
    assert err == (
        f"error: the coordinator (pid {pid}) ended without finishing the batch; ssh-scheduler status shows "
        "what it left, and the same execute_batch again goes on with it\n"
    )
    assert json.loads(cli_run(tmp_path, "status", "--json").stdout)["coordinator"] == "stopped"
    gate.touch()  # the job the host kept for its lease may end


def test_no_job_may_take_the_name_of_a_detached_run_s_files() -> None:
    for name in (".events.jsonl", ".coordinator.log", ".coordinator.log.1", ".control.sock"):
        with pytest.raises(BatchError, match="reserved for the scheduler's own files"):
            validate_job_name(name)
