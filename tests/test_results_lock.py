"""One results folder, one run: the lock in job_results/, planted output links, reserved names.

The lock is a local matter (no SSH): the CLI runs here on this machine, as execute_batch without
--machines does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ssh_scheduler.errors import BatchError, ConfigError, TransferError
from ssh_scheduler.jobs.batch_file import parse_batch
from ssh_scheduler.jobs.job_names import RESERVED_NAMES
from ssh_scheduler.results.journal import JOURNAL_NAME
from ssh_scheduler.results.results_folder import (
    LOCK_NAME,
    hold_results_folder,
    refuse_planted_links,
)

REPO = Path(__file__).resolve().parents[1]
HOLDER = """
import fcntl, json, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"pid": os.getpid(), "host": "elsewhere", "started": 0}).encode())
print("held", flush=True)
sys.stdin.read()
"""


def _lock_text(results: Path) -> dict[str, object]:
    return json.loads((results / LOCK_NAME).read_text())  # type: ignore[no-any-return]


def test_a_second_run_is_refused_while_the_first_holds_the_folder(tmp_path: Path) -> None:
    results = tmp_path / "job_results"
    with hold_results_folder(results):
        assert _lock_text(results)["pid"] == os.getpid()
        with pytest.raises(ConfigError) as err, hold_results_folder(results):
            pass
        message = str(err.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert "in use by another run" in message and "--results-dir" in message
    with hold_results_folder(results):  # released: the next run gets it
        pass


def test_a_lock_of_another_process_is_refused_until_that_process_dies(tmp_path: Path) -> None:
    results = tmp_path / "job_results"
    results.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(results / LOCK_NAME)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on host elsewhere"), hold_results_folder(results):
            pass
    finally:
        holder.kill()
        holder.communicate()  # reaps it and closes its pipes
    # Killed, its lock went with it; the file still names it, and is taken over.
    assert _lock_text(results)["pid"] == holder.pid
    with hold_results_folder(results):
        assert _lock_text(results)["pid"] == os.getpid()


def test_a_stale_or_garbled_lock_file_is_taken_over(tmp_path: Path) -> None:
    results = tmp_path / "job_results"
    results.mkdir()
    for stale in (b'{"pid": 4194303, "host": "gone", "started": 1}', b"\x00garbage", b""):
        (results / LOCK_NAME).write_bytes(stale)
        with hold_results_folder(results):
            assert _lock_text(results)["host"] == socket.gethostname()


def test_a_symlinked_lock_file_is_one_error_line(tmp_path: Path) -> None:
    results = tmp_path / "job_results"
    results.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me")
    (results / LOCK_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="it is a symlink") as err, hold_results_folder(results):
        pass
    assert "\n" not in str(err.value)
    assert target.read_text() == "keep me"


def test_a_folder_made_for_nothing_is_removed_again(tmp_path: Path) -> None:
    results = tmp_path / "job_results"
    with pytest.raises(RuntimeError), hold_results_folder(results):
        raise RuntimeError("the run stopped before its first job")
    assert not results.exists()
    with hold_results_folder(results):  # a batch refused once its hosts answered
        (results / JOURNAL_NAME).write_text("")
    assert not results.exists()
    with hold_results_folder(results):
        (results / JOURNAL_NAME).write_text('{"job": "b.sh.1", "state": "queued"}\n')
    assert sorted(os.listdir(results)) == [JOURNAL_NAME, LOCK_NAME]
    with hold_results_folder(tmp_path / "dry", create=False):
        pass
    assert not (tmp_path / "dry").exists()


def test_planted_output_links_are_refused(tmp_path: Path) -> None:
    results = tmp_path / "job_results"
    results.mkdir()
    (results / "b.sh.1.err").symlink_to(tmp_path / "bashrc")
    refuse_planted_links(results, ["b.sh.2"])
    with pytest.raises(TransferError, match=r"b\.sh\.1\.err is a symlink") as err:
        refuse_planted_links(results, ["b.sh.2", "b.sh.1"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", [".failed", ".lock", ".LOCK", ".journal.jsonl", ".partial-x"])
def test_our_own_names_are_no_job_names(name: str) -> None:
    with pytest.raises(BatchError, match="reserved"):
        parse_batch(f"--job-name {name} 'true'\n".encode(), "b.sh", commands_mode=True)


def test_reserved_names_cover_every_name_we_use() -> None:
    assert {JOURNAL_NAME, LOCK_NAME, ".failed"} <= RESERVED_NAMES


# --- the command line ------------------------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "home"))


def _batch_cli(tmp_path: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "ssh_scheduler", "execute_batch", *args, "--no-gpu-required",
        "--num-cpus", "0", "--memory-required", "0",
    ]  # fmt: skip


def test_two_runs_on_one_results_folder(tmp_path: Path) -> None:
    """The second run is refused naming the first; the first finishes undisturbed."""
    go = tmp_path / "go"
    (tmp_path / "b.sh").write_text(
        f"touch {tmp_path}/started; while [ ! -e {go} ]; do sleep 0.05; done; echo done > r.txt\n"
    )
    first = subprocess.Popen(
        _batch_cli(tmp_path, "b.sh", "--copy-forwards", "b.sh"), cwd=tmp_path, env=_env(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while not (tmp_path / "started").exists():  # the job runs: the first run holds the folder
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        second = subprocess.run(
            _batch_cli(tmp_path, "b.sh", "--copy-forwards", "b.sh"), cwd=tmp_path,
            env=_env(tmp_path), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert f"pid {first.pid} on host {socket.gethostname()}" in lines[0]
        go.touch()
        _out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
            first.wait()
    assert first.returncode == 0, err
    results = tmp_path / "job_results"
    assert (results / "b.sh.1" / "r.txt").read_text() == "done\n"
    states = [json.loads(line)["state"] for line in (results / JOURNAL_NAME).read_text().splitlines()]
    assert states == ["batch", "placed", "started", "finished"]  # the second run wrote nothing


def test_a_planted_output_link_is_one_error_line_and_stays_untouched(tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("echo pwned\n")
    results = tmp_path / "job_results"
    results.mkdir()
    target = tmp_path / "bashrc"
    target.write_text("# mine\n")
    (results / "b.sh.1.out").symlink_to(target)
    result = subprocess.run(
        _batch_cli(tmp_path, "b.sh", "--copy-forwards", "b.sh"), cwd=tmp_path, env=_env(tmp_path),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "is a symlink" in lines[0], result.stderr
    assert target.read_text() == "# mine\n"
    assert not (tmp_path / "home" / ".ssh_scheduler" / "jobs").exists() or not os.listdir(
        tmp_path / "home" / ".ssh_scheduler" / "jobs"
    )
