"""A journal is input like any other: a planted or hand-edited entry is one error line, never a
path on a host (the batch token names sockets and folders there)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.results.journal import (
    JOURNAL_NAME,
    MAX_TEXT,
    Journal,
    batch_token,
    entry_problem,
    last_states,
    read_journal,
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


# ---------------------------------------------------------------- each check at its edge


def started(**fields: object) -> dict[str, object]:
    return {"t": 1.5, "job": "a", "state": "started", **fields}


EDGES_ACCEPTED = {
    "256 GPUs in one list": started(gpus=list(range(256))),
    "the last GPU index": started(gpus=[255]),
    "a one-character host name": started(host="h"),
    "a 255-character host name": started(host="h" * 255),
    "a command of MAX_TEXT characters": started(command="x" * MAX_TEXT),
    "a whole number of seconds as the time": {"t": 2, "job": "a", "state": "placed"},
}

# What the user reads for each refusal, after "<file> line N": the field, what it must be, and
# the value as it stands (cut after 60 characters, the unknown state after 40).
EDGES_REFUSED = {
    "257 GPUs in one list": (started(gpus=list(range(257))), "'gpus' must be a list of GPU indices from 0 to 255, got "),
    "GPU index 256": (started(gpus=[0, 256]), "'gpus' must be a list of GPU indices from 0 to 255, got [0, 256]"),
    "a 256-character host name": (started(host="h" * 256), "'host' must be a machine name, got '" + "h" * 55 + "...'"),
    "true as the time": ({"t": True, "job": "a", "state": "placed"}, "'t' must be a time in seconds, got True"),
    "infinity as the time": ({"t": math.inf, "job": "a", "state": "placed"}, "'t' must be a time in seconds, got inf"),
    "text as the time": ({"t": "1", "job": "a", "state": "placed"}, "'t' must be a time in seconds, got '1'"),
    "a NUL byte in a command": (started(command="echo a\x00b"), "'command' must be a command, got 'echo a\\x00b'"),
    "a command over MAX_TEXT characters": (started(command="x" * (MAX_TEXT + 1)), "'command' must be a command, got '" + "x" * 55 + "...'"),
    "a command that is not text": (started(command=["echo", "a"]), "'command' must be a command, got ['echo', 'a']"),
    "a job name that is not text": ({"job": 7, "state": "placed"}, "has no job name"),
    "no job name": ({"state": "finished"}, "has no job name"),
    "a list": ([1, 2], "is not a JSON object"),
    "a batch without its token": ({"job": "", "state": "batch"}, "records a batch without its token"),
    "a long unknown state": ({"job": "a", "state": "s" * 100}, "has the unknown state '" + "s" * 35 + "...'"),
    "an unknown state that is not text": ({"job": "a", "state": 3}, "has the unknown state 3"),
}  # fmt: skip


@pytest.mark.parametrize("case", EDGES_ACCEPTED)
def test_each_check_lets_its_largest_and_smallest_good_value_pass(case: str) -> None:
    assert entry_problem(EDGES_ACCEPTED[case]) is None


@pytest.mark.parametrize("case", EDGES_REFUSED)
def test_each_refusal_says_what_the_value_must_be_and_shows_it(case: str) -> None:
    entry, expected = EDGES_REFUSED[case]
    problem = entry_problem(entry)
    if case == "257 GPUs in one list":  # (the list itself, cut: the words before it are the rule)
        assert problem is not None and problem.startswith(expected) and problem.endswith("...'")
        assert len(problem) == len(expected) + 60
    else:
        assert problem == expected


def test_an_empty_line_in_the_middle_is_skipped_not_the_end(tmp_path: Path) -> None:
    lines = [
        json.dumps({"t": 1, "job": "", "state": "batch", "token": TOKEN}),
        "",
        json.dumps({"t": 2, "job": "a", "state": "placed", "host": "h1"}),
    ]
    (tmp_path / JOURNAL_NAME).write_text("\n".join(lines) + "\n")
    assert [entry["state"] for entry in read_journal(tmp_path)] == ["batch", "placed"]


def test_the_batch_token_is_only_a_batch_line_s(tmp_path: Path) -> None:
    """A token on another line (a hand-edited journal) names nothing: the batch's own line does."""
    lines = [
        {"t": 1, "job": "a", "state": "placed", "host": "h1", "token": "fedcba9876543210"},
        {"t": 2, "job": "", "state": "batch", "token": TOKEN},
    ]
    (tmp_path / JOURNAL_NAME).write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert batch_token(tmp_path) == TOKEN
    (tmp_path / JOURNAL_NAME).write_text(json.dumps(lines[0]) + "\n")
    assert batch_token(tmp_path) is None


def test_a_link_at_the_journal_s_name_is_refused_as_the_batch_journal(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / JOURNAL_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError) as err:
        read_journal(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / JOURNAL_NAME} (the batch journal) is a symbolic link; ssh_scheduler never writes "
        "one there, so it is not followed: remove it, or use another results folder"
    )
