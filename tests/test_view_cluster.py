"""What a user sees and controls, through the real CLI on the SSH test cluster: ``--json``
against the README's schema, the live view in a real pseudo-terminal, ``status`` / ``jobs``,
``pause`` / ``resume`` / ``cancel``, and errors that name their cause."""

from __future__ import annotations

import json
import os
import pty
import select
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import Cluster
from tests.event_schema import load_schema, problems

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "ssh_scheduler"]
NO_GPU = ["--no-gpu-required", "--memory-required", "100"]


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), **extra)


def cli(cwd: Path, *args: str, timeout: float = 120, **popen: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout, **popen)


def start(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "execute_batch", *args], cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )


def machines(cluster: Cluster, count: int) -> list[str]:
    return ["--machines", *(str(p) for p in cluster.machine_files[:count])]


class Output:
    """A running batch's stdout lines, read by a thread (a wait can time out; readline cannot)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # EOF
            self._changed.notify_all()

    def until(self, wanted: Any, timeout: float = 60) -> list[str]:
        with self._changed:
            ok = self._changed.wait_for(lambda: wanted(self.lines) or self.lines[-1:] == [""], timeout)
            assert ok and wanted(self.lines), f"not seen: {self.lines}"
            return list(self.lines)

    def finish(self, timeout: float = 180) -> tuple[str, str]:
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        self.proc.wait(timeout=timeout)
        self.close()
        return "\n".join(self.lines), err

    def close(self) -> None:
        """After the process ended: the reader is done, and both pipes are closed."""
        self._thread.join(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def journal_states(results: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (results / ".journal.jsonl").read_text().splitlines() if line.strip()]


def status_json(cwd: Path) -> dict[str, Any]:
    done = cli(cwd, "status", "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_json_events_with_a_failure_and_a_requeue_match_the_readme(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("exit 3\n" + "sleep 2\n" * 12)
    proc = start(tmp_path, "b.sh", *machines(cluster4, 2), *NO_GPU, "--json")
    crashed = cluster4.hosts[1]

    def started_on_crashed(lines: list[str]) -> bool:
        return any(
            line and json.loads(line)["event"] == "job_started" and crashed.name in json.loads(line)["host"]
            for line in lines
        )

    output = Output(proc)
    output.until(started_on_crashed)
    crashed.crash()
    out, err = output.finish()
    assert proc.returncode == 1, err  # the failed job
    events = [json.loads(line) for line in out.splitlines() if line]  # stdout: JSON only
    schema = load_schema()
    assert [p for e in events for p in problems(e, schema)] == []
    kinds = [e["event"] for e in events]
    for kind in ("host_probed", "batch_started", "job_placed", "job_started", "job_failed",
                 "job_requeued", "host_down", "job_finished"):
        assert kind in kinds, kind
    assert kinds[-1] == "batch_finished"
    assert {e["job"] for e in events if e["event"] == "job_failed"} == {"b.sh.1"}
    assert events[-1]["failed"] == ["b.sh.1"] and events[-1]["finished"] == 12
    probes = [e for e in events if e["event"] == "host_probed"]
    assert all(len(p["gpus"]) == 2 and p["gpus"][0]["memory_total_mb"] == 16000 for p in probes)
    assert "failed: b.sh.1 (exit 3 on " in err and str(Path("job_results") / "b.sh.1.err") in err


def run_in_pty(cwd: Path, args: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as its stdout and stderr; everything it drew."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, *args], cwd=cwd, env=env(TERM="xterm-256color", COLUMNS="160", LINES="50"),
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


def test_live_view_on_a_terminal_and_plain_lines_when_piped(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("sleep 2; echo a\nsleep 2; echo b\nexit 4\n")
    args = ["execute_batch", "b.sh", *machines(cluster4, 2), *NO_GPU]
    code, drawn = run_in_pty(tmp_path, args)
    assert code == 1, drawn
    assert "\x1b[" in drawn  # rich drew (cursor movement, colours)
    assert "━" in drawn  # the progress bar
    for header in ("host", "state", "load", "free mem", "GPUs (used/total MB, util)", "our jobs"):
        assert header in drawn, header
    assert "done 2" in drawn and "failed 1" in drawn and "ETA" in drawn
    assert "0:0/16000 0% 1:0/16000 0%" in drawn  # a host's GPUs in the table: idle cards
    assert "started: b.sh.1;" in drawn and "failed: b.sh.3; exit 4" in drawn  # lines above the area

    piped = cli(tmp_path, *args, "--results-dir", "again")
    assert piped.returncode == 1
    assert "\x1b" not in piped.stdout + piped.stderr
    assert "━" not in piped.stdout
    lines = piped.stdout.splitlines()
    assert lines[0].startswith("machine limits:")
    assert all(line.startswith(("machine ", "started: ", "finished: ", "failed: ")) for line in lines), lines

    # --plain and NO_COLOR on a terminal: the plain lines too.
    for extra, variables in ((["--plain"], {}), ([], {"NO_COLOR": "1"})):
        os.environ.update(variables)
        try:
            code, drawn = run_in_pty(tmp_path, [*args, *extra, "--results-dir", f"plain{len(extra)}"])
        finally:
            for name in variables:
                del os.environ[name]
        assert code == 1 and "━" not in drawn and "\x1b[" not in drawn, drawn
        assert "started: b.sh.1;" in drawn


def test_quiet_prints_only_failures_and_verbose_shows_the_wire(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("echo a > a.txt\nexit 5\n")
    args = ["execute_batch", "b.sh", *machines(cluster4, 1), *NO_GPU]
    quiet = cli(tmp_path, *args, "-q")
    assert quiet.returncode == 1
    assert quiet.stdout.splitlines() == ["failed: b.sh.2; exit 5  (exit 5 on " + cluster4.hosts[0].name + ")"]
    assert quiet.stderr.startswith("done: 1 finished, 1 failed")
    verbose = cli(tmp_path, *args, "-v", "--results-dir", "v")
    assert verbose.returncode == 1
    assert "started: b.sh.1;" in verbose.stdout
    wire = verbose.stderr.splitlines()
    assert wire.count(f"coordinator.hosts: connected to {cluster4.hosts[0].name}") == 1
    assert not [line for line in wire if line.startswith("info: ")]  # each line once, not again as info:
    assert any(line.startswith(f"probed: {cluster4.hosts[0].name} load ") and "gpu1 " in line for line in wire)
    assert any(line.startswith("coordinator.job_task: sent: b.sh.1's inputs are on ") for line in wire)
    assert any(line.startswith("coordinator.job_task: received: b.sh.1, ") for line in wire)


def test_status_on_a_running_batch_and_after_its_coordinator_was_killed(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("sleep 4\n" * 10)
    # One host with 4 CPUs at 2 per job: 2 run at once, 8 wait.
    proc = start(tmp_path, "b.sh", *machines(cluster4, 1), *NO_GPU, "--num-cpus", "2", "--lease", "5")
    output = Output(proc)
    output.until(lambda lines: sum(line.startswith("started:") for line in lines) >= 2)
    running = status_json(tmp_path)
    assert running["coordinator"] == "running"
    assert running["counts"]["running"] == 2 and running["counts"]["waiting"] == 8
    assert {r["host"] for r in running["running"]} == {cluster4.hosts[0].name}
    text = cli(tmp_path, "status")
    assert text.returncode == 0 and "running: b.sh.1 on " in text.stdout

    os.kill(proc.pid, signal.SIGKILL)  # the coordinator dies; the host keeps its jobs for the lease
    proc.wait(timeout=30)
    output.close()
    gone = status_json(tmp_path)
    assert gone["coordinator"] == "stopped"
    in_flight = {e["job"] for e in journal_states(tmp_path / "job_results")} - {""}
    ended = {e["job"] for e in journal_states(tmp_path / "job_results") if e["state"] in ("finished", "failed")}
    assert gone["counts"]["running"] == len(in_flight - ended) >= 1
    assert sum(gone["counts"].values()) == 10
    assert "rerun the same execute_batch to reattach" in cli(tmp_path, "status").stdout

    joblog = cli(tmp_path, "jobs")
    assert joblog.returncode == 0
    assert joblog.stdout.splitlines()[0].split("\t")[:3] == ["Job", "Host", "Starttime"]


def test_pause_cancel_and_resume_a_running_batch(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("sleep 60; echo woke\necho second\necho third\n")
    proc = start(tmp_path, "b.sh", *machines(cluster4, 1), *NO_GPU, "--num-cpus", "4")  # one at a time
    output = Output(proc)
    output.until(lambda lines: any(line.startswith("started: b.sh.1;") for line in lines))
    sock = tmp_path / "job_results" / ".control.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600

    paused = cli(tmp_path, "pause")
    assert paused.returncode == 0 and paused.stdout.startswith("paused (1 jobs still running)"), paused.stderr
    cancelled = cli(tmp_path, "cancel", "b.sh.1")
    assert cancelled.returncode == 0, cancelled.stderr
    lines = output.until(lambda lines: any(line.startswith("cancelled: b.sh.1 on ") for line in lines))
    assert not any(line.startswith("started: b.sh.2") for line in lines)
    # Paused: the room b.sh.1 left stays empty (the journal records the cancel just after the line).
    deadline = time.monotonic() + 30
    while (state := status_json(tmp_path))["counts"]["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state["coordinator"] == "paused" and state["counts"]["running"] == 0 and state["counts"]["waiting"] == 2
    assert state["counts"]["cancelled"] == 1
    assert not [e for e in journal_states(tmp_path / "job_results") if e["job"] == "b.sh.2"]  # not even placed
    unknown = cli(tmp_path, "cancel", "nope")
    assert unknown.returncode == 2 and "not jobs of this batch: nope" in unknown.stderr

    assert cli(tmp_path, "resume").returncode == 0
    out, err = output.finish()
    assert proc.returncode == 1, err  # a cancelled job means not everything ran
    assert "finished: b.sh.2; echo second" in out and "finished: b.sh.3; echo third" in out
    assert "  cancelled: b.sh.1" in err
    results = tmp_path / "job_results"
    states = journal_states(results)
    assert [e["state"] for e in states if e["job"] == "b.sh.1"][-1] == "cancelled"
    printed = results / "b.sh.1.out"  # there only if the job printed before it was killed
    assert "woke" not in (printed.read_text() if printed.exists() else "")  # really killed, not waited for
    assert not sock.exists()
    gone = cli(tmp_path, "pause")
    assert gone.returncode == 2 and "no batch is running in job_results" in gone.stderr


def test_errors_name_the_cause_before_connecting(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("echo hi\n")
    base = ["execute_batch", "b.sh", *machines(cluster4, 1), *NO_GPU]
    for flags, message in (
        (["--keepalive", "-1"], "error: --keepalive must be a positive number of seconds, not -1"),
        (["--timeout", "0"], "error: --timeout must be a positive number of seconds, not 0"),
        (["--timeout", "-3"], "error: --timeout must be a positive number of seconds, not -3"),
        (["--retries", "-1"], "error: --retries must be 0 or more, not -1"),
    ):
        done = cli(tmp_path, *base, *flags)
        assert (done.returncode, done.stderr.strip(), done.stdout) == (2, message, ""), flags
    (tmp_path / "job_results").write_text("not a folder")
    done = cli(tmp_path, *base)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: job_results is a file, not a folder; remove it or pass another --results-dir"

    # A key that is not there: the error names the machine it belongs to.
    broken = tmp_path / "broken.yaml"
    text = cluster4.machine_files[0].read_text()
    broken.write_text("\n".join(
        "ssh_key_path: /nonexistent/key" if line.startswith("ssh_key_path") else line for line in text.splitlines()
    ) + "\n")
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(broken), *NO_GPU, "--results-dir", "r2")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith(f"error: {cluster4.hosts[0].name}: cannot read ssh key /nonexistent/key")


@pytest.mark.namespaces
def test_read_only_working_folder_is_caught_before_connecting(cluster4: Cluster, tmp_path: Path) -> None:
    # Root writes anywhere (mode bits do not stop it), so the working folder is made read-only
    # the way a read-only mount is: a read-only bind mount in a private mount namespace.
    work = tmp_path / "ro"
    work.mkdir()
    (work / "b.sh").write_text("echo hi\n")
    argv = " ".join(shlex.quote(a) for a in [*CLI, "execute_batch", "b.sh", *machines(cluster4, 1), *NO_GPU])
    script = f'mount --bind "$W" "$W" && mount -o remount,bind,ro "$W" && cd "$W" && exec {argv}'
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=env(W=str(work)), capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.strip() == (
        "error: cannot write results into job_results: the working folder is not writable "
        "(Read-only file system); run from a folder you can write to or pass --results-dir"
    )
    assert sorted(os.listdir(work)) == ["b.sh"]  # nothing made


def machine_variant(cluster: Cluster, index: int, path: Path, **changes: str) -> Path:
    """A copy of a host's machine file with some keys changed."""
    lines = cluster.machine_files[index].read_text().splitlines()
    kept = [line for line in lines if line.split(":", 1)[0] not in changes]
    path.write_text("\n".join([*kept, *(f"{k}: {v}" for k, v in changes.items())]) + "\n")
    return path


def test_doctor_reports_exactly_the_problems_with_their_fixes(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "empty_known_hosts").write_text("")
    good = cluster4.machine_files[0]
    unknown = machine_variant(cluster4, 1, tmp_path / "unknown.yaml", name="unknown", known_hosts=str(tmp_path / "empty_known_hosts"))
    down = machine_variant(cluster4, 2, tmp_path / "down.yaml", name="down", port="1")
    done = cli(tmp_path, "doctor", "--machines", str(good), str(unknown), str(down))
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["host", "reachable", "key", "login", "python3", "disk", "free", "cpus", "mem", "free", "GPUs", "CUDA", "setup", "latency"]
    row = {line.split()[0]: line.split() for line in lines[1:4]}
    good_name = cluster4.hosts[0].name
    assert row[good_name][1:4] == ["yes", "yes", "yes"] and row[good_name][4].startswith("3.")
    assert row[good_name][10] == "2"  # GPUs seen through nvidia-smi
    assert row["unknown"][1:4] == ["yes", "NO", "NO"]
    assert row["down"][1:4] == ["NO", "NO", "NO"]
    problems = lines[4:]
    assert [p.split(":", 1)[0] for p in problems] == ["unknown", "down"]  # the good host has none
    assert "unknown host key" in problems[0] and "--accept-new" in problems[0]
    assert problems[1].startswith("down: unreachable: ") and "fix: check ip, port" in problems[1]

    alone = cli(tmp_path, "doctor", "--machines", str(good), "--json")
    assert alone.returncode == 0, alone.stdout
    [report] = json.loads(alone.stdout)
    assert report["ok"] and report["problems"] == [] and report["cpus"] == 4 and len(report["gpus"]) == 2
    assert report["memory_free_mb"] > 0 and report["disk_free_mb"] > 0 and report["latency_ms"] >= 0


CONDA_STUB = """#!/bin/sh
# A stand-in for conda: only what activation in a non-interactive shell needs.
if [ "$1" = shell.bash ] && [ "$2" = hook ]; then
  echo 'conda() { if [ "$1" = activate ]; then export CONDA_DEFAULT_ENV="$2"; else command conda "$@"; fi; }'
  exit 0
fi
echo "CommandNotFoundError: Your shell has not been properly configured to use 'conda activate'." >&2
echo "To initialize your shell, run: conda init" >&2
exit 1
"""


def test_machine_env_and_setup_with_conda_and_a_broken_setup(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[3]
    stub = host.home / "stubconda"
    stub.mkdir(exist_ok=True)
    (stub / "conda").write_text(CONDA_STUB)
    os.chmod(stub / "conda", 0o755)
    os.chmod(stub, 0o755)
    os.chown(stub, host.uid, -1)
    good = machine_variant(
        cluster4, 3, tmp_path / "envhost.yaml", name="envhost",
        env="{GREETING: hello, THREADS: 4}", setup='["export PATH=$HOME/stubconda:$PATH", "conda activate exp"]',
    )
    broken = machine_variant(cluster4, 3, tmp_path / "broken.yaml", name="broken", setup="source /nonexistent/venv/bin/activate")
    (tmp_path / "b.sh").write_text('echo "$GREETING $THREADS $CONDA_DEFAULT_ENV"\n')
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(good), *NO_GPU)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "job_results" / "b.sh.1.out").read_text() == "hello 4 exp\n"
    assert "started: b.sh.1;  export CUDA_VISIBLE_DEVICES= && echo" in done.stdout  # the command as written

    failed = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(broken), *NO_GPU, "--results-dir", "r2")
    assert failed.returncode == 1
    assert "failed: b.sh.1;" in failed.stdout and "(exit 126 on broken)" in failed.stdout
    err = (tmp_path / "r2" / "b.sh.1.err").read_text()
    assert "setup line failed (exit code follows): source /nonexistent/venv/bin/activate 1" in err

    fine = cli(tmp_path, "doctor", "--machines", str(good))  # one host: two files may not name it
    assert fine.returncode == 0, fine.stdout
    assert fine.stdout.splitlines()[1].split()[-3] == "ok" and len(fine.stdout.splitlines()) == 2
    doctor = cli(tmp_path, "doctor", "--machines", str(broken))
    assert doctor.returncode == 1
    assert doctor.stdout.splitlines()[1].split()[-3] == "failed"
    problems = doctor.stdout.splitlines()[2:]
    assert len(problems) == 1 and problems[0].startswith("broken: setup failed: ")
    assert "/nonexistent/venv/bin/activate" in problems[0] and "fix: correct the machine's setup: lines" in problems[0]
