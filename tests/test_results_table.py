"""``ssh-scheduler results``: rows from a sweep's folders, as a table, CSV, TSV and JSON."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.results.results_table import (
    format_delimited,
    format_json,
    format_text,
    read_results,
    table,
)

REPO = Path(__file__).resolve().parents[1]


def _combo(results: Path, name: str, index: int, params: dict[str, object], stat: dict[str, object],
           metrics: object = None, commands: tuple[str, ...] = ("train", "test")) -> None:
    folder = results / name
    folder.mkdir(parents=True)
    param = {"_name": name, "_index": index, "_varying": ["lr", "seed"],
             "_commands": {c: f"run {c}" for c in commands}, **params}
    (folder / "param.json").write_text(json.dumps(param))
    (folder / "stat.json").write_text(json.dumps(stat))
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))


@pytest.fixture
def results(tmp_path: Path) -> Path:
    ok = {"train": {"code": 0}, "test": {"code": 0}}
    root = tmp_path / "job_results"
    _combo(root, "lr_0.1-seed_1", 1, {"lr": 0.1, "seed": 1, "epochs": 10}, ok, {"acc": 0.5, "loss": {"final": 1.25}})
    _combo(root, "lr_0.01-seed_1", 2, {"lr": 0.01, "seed": 1, "epochs": 10}, {"train": {"code": 0}, "test": {"code": 3}})
    _combo(root, "lr_0.001-seed_2", 3, {"lr": 0.001, "seed": 2, "epochs": 10}, {"train": {"code": 0}},
           {"acc": 0.75, "seed": "metric named like a parameter", "note": "a, \"quoted\"\ttext"})
    _combo(root, "lr_1-seed_2", 4, {"lr": 1, "seed": 2, "epochs": 10}, {})
    (root / ".jobs").mkdir()
    (root / ".jobs" / ".journal.jsonl").write_text(
        json.dumps({"t": 1, "job": "lr_0.001-seed_2.test", "state": "started", "host": "h1"}) + "\n"
    )
    (root / "stray.txt").write_text("not a combination")
    return root


def test_rows_states_and_columns(results: Path) -> None:
    rows = read_results(results)
    assert [r.name for r in rows] == ["lr_0.1-seed_1", "lr_0.01-seed_1", "lr_0.001-seed_2", "lr_1-seed_2"]
    assert [r.state for r in rows] == ["done", "failed: test (exit 3)", "running: test", "not run: train"]
    columns, body = table(rows)
    assert columns == ["name", "lr", "seed", "state", "acc", "loss.final", "metrics.seed", "note"]
    assert body[0] == ["lr_0.1-seed_1", 0.1, 1, "done", 0.5, 1.25, None, None]
    assert body[2][6] == "metric named like a parameter"


def test_terminal_table_is_aligned(results: Path) -> None:
    text = format_text(*table(read_results(results)))
    lines = text.splitlines()
    assert lines[0].split() == ["name", "lr", "seed", "state", "acc", "loss.final", "metrics.seed", "note"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].startswith("lr_0.1-seed_1      0.1     1  done")
    # Numbers are right-aligned under their header.
    assert lines[3].index(" 0.01 ") + len(" 0.01") == lines[0].index(" lr ") + len(" lr")


@pytest.mark.parametrize("delimiter", [",", "\t"])
def test_csv_and_tsv_read_back(results: Path, delimiter: str) -> None:
    columns, body = table(read_results(results))
    read = list(csv.DictReader(io.StringIO(format_delimited(columns, body, delimiter)), delimiter=delimiter))
    assert [r["name"] for r in read] == ["lr_0.1-seed_1", "lr_0.01-seed_1", "lr_0.001-seed_2", "lr_1-seed_2"]
    assert read[0]["lr"] == "0.1" and read[0]["acc"] == "0.5" and read[0]["metrics.seed"] == ""
    assert read[2]["note"] == "a, \"quoted\"\ttext"
    assert read[1]["state"] == "failed: test (exit 3)"


def test_json_records_keep_types(results: Path) -> None:
    records = json.loads(format_json(*table(read_results(results))))
    assert records[0] == {"name": "lr_0.1-seed_1", "lr": 0.1, "seed": 1, "state": "done", "acc": 0.5,
                          "loss.final": 1.25, "metrics.seed": None, "note": None}


def test_no_param_dir_files_and_empty_folders(tmp_path: Path) -> None:
    root = tmp_path / "out"
    root.mkdir()
    (root / "file_a.param.json").write_text(json.dumps(
        {"_name": "file_a", "_index": 1, "_varying": ["file"], "_commands": {"run": "x"}, "file": "a"}))
    (root / "file_a.stat.json").write_text(json.dumps({"run": {"code": 0}}))
    (root / "file_a.metrics.json").write_text(json.dumps({"lines": 3}))
    assert table(read_results(root)) == (["name", "file", "state", "lines"], [["file_a", "a", "done", 3]])
    with pytest.raises(ConfigError, match="holds no sweep results"):
        read_results(tmp_path)
    with pytest.raises(ConfigError, match="is not a folder"):
        read_results(tmp_path / "missing")


def test_results_command_prints_csv(results: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "ssh_scheduler", "results", str(results), "--csv"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert next(csv.reader(io.StringIO(run.stdout))) == [
        "name", "lr", "seed", "state", "acc", "loss.final", "metrics.seed", "note",
    ]
    both = subprocess.run([sys.executable, "-m", "ssh_scheduler", "results", str(results), "--csv", "--json"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "choose one of" in both.stderr
