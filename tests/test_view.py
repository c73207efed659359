"""What a user sees, with plain values: status and joblog from a journal, the summary, the live
board's counts and ETA, the plain line filters, and the checks made before connecting."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from ssh_scheduler.coordinator.preflight import check_numbers, check_results_dir
from ssh_scheduler.errors import ConfigError
from ssh_scheduler.events import (
    BatchStarted,
    Ended,
    GpuReading,
    HostDown,
    HostProbed,
    JobFailed,
    JobFinished,
    JobRequeued,
    JobSkipped,
    JobStarted,
)
from ssh_scheduler.results.status import fold_journal, joblog_lines, status_json, status_lines
from ssh_scheduler.results.summary import BatchSummary, JobOutcome
from ssh_scheduler.view.display import plain_subscriber, summary_lines
from ssh_scheduler.view.live import BoardState, estimate_left, render

JOURNAL = [
    {"t": 100.0, "job": "", "state": "batch", "token": "abc", "jobs": 5},
    {"t": 100.1, "job": "b.1", "state": "placed", "host": "h1", "gpus": [0], "command": "echo 1"},
    {"t": 100.2, "job": "b.1", "state": "started", "host": "h1", "gpus": [0], "command": "echo 1"},
    {"t": 100.3, "job": "b.2", "state": "started", "host": "h2", "gpus": [1], "command": "exit 3"},
    {"t": 101.2, "job": "b.1", "state": "finished", "host": "h1", "code": 0, "seconds": 1.0, "bytes": 42},
    {"t": 102.3, "job": "b.2", "state": "failed", "host": "h2", "code": 137, "seconds": 2.0, "bytes": 0},
    {"t": 102.5, "job": "b.3", "state": "started", "host": "h1", "gpus": [0, 1], "command": "sleep\t9"},
    {"t": 103.0, "job": "b.4", "state": "started", "host": "h2", "gpus": [], "command": "x"},
    {"t": 104.0, "job": "b.4", "state": "requeued", "host": "h2"},
    {"t": 105.0, "job": "b.5", "state": "a state of a newer version"},
]


def test_status_counts_running_and_failures_from_the_journal() -> None:
    status = fold_journal(JOURNAL)
    # b.4 was requeued (waits again); b.5's state is unknown to us and it counts as waiting.
    assert status.counts() == {"finished": 1, "failed": 1, "running": 1, "waiting": 2, "cancelled": 0}
    data = status_json(status, Path("job_results"), None)
    assert data["coordinator"] == "stopped"  # nothing answers, jobs left: it died
    assert data["running"] == [{"job": "b.3", "host": "h1", "gpus": [0, 1], "since": 102.5, "command": "sleep\t9"}]
    assert data["failed"] == [
        {"job": "b.2", "host": "h2", "code": 137, "timed_out": False, "err": "job_results/b.2.err"}
    ]
    lines = status_lines(status, Path("job_results"), None, now=112.5)
    assert lines[0] == "job_results: stopped; 1 finished, 1 failed, 1 running, 2 waiting, 0 cancelled"
    assert "rerun the same execute_batch to reattach" in lines[1]
    assert "  running: b.3 on h1 GPUs 0,1 for 10 s; sleep\t9" in lines
    assert "  failed: b.2 (exit 137 on h2): job_results/b.2.err" in lines
    live = status_lines(status, Path("job_results"), {"pid": 7, "paused": True}, now=112.5)
    assert live[0].startswith("job_results: paused (pid 7); ")


def test_joblog_is_gnu_parallel_tsv() -> None:
    rows = [line.split("\t") for line in joblog_lines(fold_journal(JOURNAL))]
    assert rows[0] == ["Job", "Host", "Starttime", "JobRuntime", "Send", "Receive", "Exitval", "Signal", "Command"]
    assert rows[1] == ["b.1", "h1", "100.200", "1.000", "0", "42", "0", "0", "echo 1"]
    assert rows[2] == ["b.2", "h2", "100.300", "2.000", "0", "0", "137", "9", "exit 3"]
    assert len(rows) == 3  # only ended jobs; a tab in a command would not break the columns


def test_summary_names_failures_with_their_err_and_skipped_failures(tmp_path: Path) -> None:
    summary = BatchSummary(seconds=75.4, bytes_uploaded=3 * 1024 * 1024, files_uploaded=2, bytes_downloaded=10)
    summary.outcomes["ok"] = JobOutcome("ok", "h1", Ended(0))
    summary.outcomes["bad"] = JobOutcome("bad", "h2", Ended(3))
    summary(JobSkipped(job="old", line=3, failed=True))
    summary(JobSkipped(job="fine", line=4))
    (tmp_path / "bad.err").write_text("")
    lines = summary_lines(summary, tmp_path)
    assert lines[0] == "done: 1 finished, 1 failed, 2 skipped in 1m15s; sent 3145728 bytes (3.0 MB) in 2 files, received 10 bytes"
    assert lines[1] == f"  failed: bad (exit 3 on h2): {tmp_path}/bad.err"
    assert lines[2] == "1 jobs failed in an earlier run and were skipped: old; rerun with --retry-failed to run them again"
    assert summary.exit_code == 1
    only_skipped = BatchSummary()
    only_skipped(JobSkipped(job="fine", line=1))
    assert only_skipped.exit_code == 0


def test_board_counts_hosts_and_eta() -> None:
    board = BoardState()
    board.apply(BatchStarted(token="t", jobs=6, hosts=("h1", "h2")))
    board.apply(HostProbed(host="h1", cpus=4, load=0.5, memory_free_mb=8192, memory_total_mb=16384, gpus=(GpuReading(0, 480, 16000, 0.3),)))
    board.apply(JobStarted(job="a", host="h1", gpus=(0,), command="x"))
    board.apply(JobStarted(job="b", host="h2", gpus=(), command="y"))
    assert (board.waiting, len(board.running), board.eta()) == (4, 2, None)
    board.apply(JobFinished(job="a", host="h1", command="x", code=0, seconds=10.0))
    board.apply(JobRequeued(job="b", host="h2", reason="lost"))
    board.apply(HostDown(host="h2", reason="cut"))
    board.apply(JobStarted(job="c", host="h1", gpus=(0,), command="z"))
    board.apply(JobFailed(job="c", host="h1", command="z", code=1, reason="exit 1", seconds=1.0))
    assert (board.finished, board.failed, board.waiting, board.running) == (1, 1, 4, {})
    assert board.hosts["h2"].state == "down" and board.hosts["h1"].state == "up"
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(render(board))
    drawn = console.file.getvalue()  # type: ignore[attr-defined]
    assert "2/6" in drawn and "failed 1" in drawn and "waiting 4" in drawn
    assert "0:480/16000 30%" in drawn and "down" in drawn


def test_eta_from_finished_runtimes() -> None:
    assert estimate_left([], 10, 2) is None
    assert estimate_left([10.0, 20.0], waiting=4, running=2) == pytest.approx(45.0)  # 6 jobs, 2 at a time
    assert estimate_left([5.0], waiting=3, running=0) == pytest.approx(15.0)


def test_quiet_shows_only_failures_and_verbose_adds_probes() -> None:
    sample = [
        JobStarted(job="a", host="h1", gpus=(), command="x"),
        JobFailed(job="a", host="h1", command="x", code=2, reason="exit 2", seconds=1.0),
        HostProbed(host="h1", cpus=2, load=0.25, memory_free_mb=100, memory_total_mb=200),
    ]
    for verbosity, expected in (
        (-1, ["failed: a; x  (exit 2 on h1)"]),
        (0, ["started: a;  export CUDA_VISIBLE_DEVICES= && x", "failed: a; x  (exit 2 on h1)"]),
        (1, ["started: a;  export CUDA_VISIBLE_DEVICES= && x", "failed: a; x  (exit 2 on h1)",
             "probed: h1 load 0.25/2 cpus, 100/200 MB free"]),
    ):
        printed: list[str] = []
        subscriber = plain_subscriber(printed.append, printed.append, verbosity)
        for event in sample:
            subscriber(event)
        assert printed == expected, verbosity


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keepalive": -1.0}, "--keepalive must be a positive number of seconds, not -1"),
        ({"timeout": 0.0}, "--timeout must be a positive number of seconds, not 0"),
        ({"timeout": -3.0}, "--timeout must be a positive number of seconds, not -3"),
        ({"timeout": float("nan")}, "--timeout must be a positive number of seconds, not nan"),
        ({"retries": -1}, "--retries must be 0 or more, not -1"),
    ],
)
def test_numbers_that_make_no_sense_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_numbers(**kwargs)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_results_dir_must_be_a_writable_folder(tmp_path: Path) -> None:
    check_results_dir(tmp_path / "job_results")  # absent is fine: it will be made
    assert not (tmp_path / "job_results").exists()  # and the check leaves nothing behind
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_results_dir(tmp_path / "file")
    with pytest.raises(ConfigError, match="is a file"):
        check_results_dir(tmp_path / "file" / "job_results")


@pytest.mark.parametrize("module", ["results.status", "view.display", "coordinator.preflight"])
def test_the_pure_view_modules_load_no_asyncio(module: str) -> None:
    code = f"import sys, ssh_scheduler.{module}; print(sorted(m for m in ('asyncio', 'asyncssh', 'rich') if m in sys.modules))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"


def test_doctor_reads_the_check_output_and_names_each_fix() -> None:
    from ssh_scheduler.coordinator.doctor import HostReport, parse_report, report_lines

    good = HostReport("g", reachable=True, host_key=True, login=True)
    parse_report(good, "shell=bash\npython=3.11\ndisk_free_kb=20971520\ncpus=8\nmem_free_kb=4194304\n"
                       "gpu=0, NVIDIA H100, 81559, 550.54\ncuda=12.4\n")
    assert good.ok and (good.python, good.disk_free_mb, good.cpus, good.memory_free_mb, good.cuda) == ("3.11", 20480, 8, 4096, "12.4")
    bad = HostReport("b", reachable=True, host_key=True, login=True)
    parse_report(bad, "shell=sh\npython_error=sh: 1: python3: not found\ndisk_free_kb=1000\ncpus=2\n")
    assert bad.problems == [
        "python3 does not run (sh: 1: python3: not found); fix: install it (Debian/Ubuntu: apt install python3), "
        "the agent that runs the jobs needs it",
        "only 0 MB free in the work root; fix: free space or set workdir to a bigger disk",
    ]
    lines = report_lines([good, bad])
    assert lines[1].split()[:5] == ["g", "yes", "yes", "yes", "3.11"]
    assert lines[2].split()[4] == "NO"
    assert lines[3].startswith("b: python3 does not run")


def test_the_new_commands_are_listed_in_the_help() -> None:
    shown = subprocess.run([sys.executable, "-m", "ssh_scheduler", "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"})
    assert shown.returncode == 0
    listed = {line.split()[1] for line in shown.stdout.splitlines() if line.startswith("│ ") and len(line.split()) > 2}
    assert {"status", "jobs", "pause", "resume", "cancel", "doctor", "execute_batch"} <= listed
