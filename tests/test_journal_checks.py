"""A journal is input like any other: a planted or hand-edited entry is one error line, never a
path on a host (the batch token names sockets and folders there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.results.journal import (
    JOURNAL_NAME,
    Journal,
    batch_token,
    entry_problem,
    last_states,
)

REPO = Path(__file__).resolve().parents[1]
TOKEN = "0123456789abcdef"

BAD_ENTRIES = {
    "token with a path": ({"job": "", "state": "batch", "token": "../../../../tmp/evil"}, "'token' must be 16 lowercase hex digits"),
    "short token": ({"job": "", "state": "batch", "token": "abc"}, "'token'"),
    "upper-case token": ({"job": "", "state": "batch", "token": TOKEN.upper()}, "'token'"),
    "batch without token": ({"job": "", "state": "batch"}, "without its token"),
    "negative gpu": ({"job": "a", "state": "started", "host": "h1", "gpus": [-1]}, "'gpus'"),
    "huge gpu": ({"job": "a", "state": "started", "host": "h1", "gpus": [10**9]}, "'gpus'"),
    "gpu as text": ({"job": "a", "state": "started", "host": "h1", "gpus": ["0"]}, "'gpus'"),
    "gpu as bool": ({"job": "a", "state": "started", "host": "h1", "gpus": [True]}, "'gpus'"),
    "gpus not a list": ({"job": "a", "state": "started", "host": "h1", "gpus": "0,1"}, "'gpus'"),
    "host with a newline": ({"job": "a", "state": "started", "host": "h1\nh2"}, "'host'"),
    "empty host": ({"job": "a", "state": "started", "host": ""}, "'host'"),
    "host not text": ({"job": "a", "state": "placed", "host": ["h1"]}, "'host'"),
    "unknown state": ({"job": "a", "state": "pwned"}, "unknown state 'pwned'"),
    "no job": ({"state": "finished"}, "no job name"),
    "code as text": ({"job": "a", "state": "failed", "code": "1"}, "'code'"),
    "not an object": ([1, 2], "not a JSON object"),
}


@pytest.mark.parametrize("case", BAD_ENTRIES)
def test_bad_entries_are_named(case: str) -> None:
    entry, expected = BAD_ENTRIES[case]
    problem = entry_problem(entry)
    assert problem is not None and expected in problem


def test_what_the_journal_writes_passes(tmp_path: Path) -> None:
    with Journal.open(tmp_path) as journal:
        journal.record("", "batch", token=TOKEN)
        journal.record("a", "placed", host="gpu1.yaml", gpus=[0, 7], command="echo a")
        journal.record("a", "started", host="gpu1.yaml", gpus=[0, 7], command="echo a")
        journal.record("a", "retry", host="gpu1.yaml", code=1)
        journal.record("a", "requeued", host="gpu1.yaml")
        journal.record("a", "cancelled", host="gpu1.yaml")
        journal.record("a", "failed", code=None, host="gpu1.yaml", timed_out=True)
        journal.record("b", "finished", code=0, host="localhost", timed_out=False)
    assert batch_token(tmp_path) == TOKEN
    assert last_states(tmp_path)["a"]["state"] == "failed"


def test_a_bad_line_names_the_file_and_line(tmp_path: Path) -> None:
    lines = [
        json.dumps({"t": 1, "job": "", "state": "batch", "token": TOKEN}),
        '{"t": 2, "job": "a", "sta',  # torn by a crash: skipped, as before
        json.dumps({"t": 3, "job": "a", "state": "started", "host": "h1", "gpus": [0, -3]}),
    ]
    (tmp_path / JOURNAL_NAME).write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        last_states(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / JOURNAL_NAME} line 3 'gpus' must be a list of GPU indices")
    assert "\n" not in message


def test_a_planted_token_stops_the_run_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "b.sh").write_text("touch ran\n")
    results = tmp_path / "job_results"
    results.mkdir()
    planted = {"t": 1, "job": "", "state": "batch", "token": "../../../../tmp/evil"}
    (results / JOURNAL_NAME).write_text(json.dumps(planted) + "\n")
    evil_before = os.path.lexists("/tmp/evil.sock")
    result = subprocess.run(
        [
            sys.executable, "-m", "ssh_scheduler", "execute_batch", "b.sh", "--no-gpu-required",
            "--num-cpus", "0", "--memory-required", "0", "--copy-forwards", "b.sh",
        ],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "home")),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and f"{JOURNAL_NAME} line 1 'token' must be" in lines[0]
    assert not (tmp_path / "home" / ".ssh_scheduler").exists()  # no agent ever started
    assert os.path.lexists("/tmp/evil.sock") == evil_before
