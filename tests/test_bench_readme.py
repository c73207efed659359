"""README.md's benchmark table is what scripts/bench_readme.py makes of the stored result it
names, and that result is fit to be quoted: a full run (>= 3 rounds) of a commit.  No cluster,
no timing: the numbers are only read from the stored JSON."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_readme.py"


def bench_readme() -> ModuleType:
    if str(SCRIPT.parent) not in sys.path:  # as when it runs: scripts/ first (bench_driver)
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_readme", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def named_result() -> tuple[str, dict[str, Any]]:
    _start, _end, name = bench_readme().table_span((REPO / "README.md").read_text())
    return name, json.loads((REPO / name).read_text())


def test_the_readme_table_is_what_the_script_makes_of_the_result_it_names() -> None:
    br = bench_readme()
    text = (REPO / "README.md").read_text()
    start, end, name = br.table_span(text)
    assert name.startswith("bench/results/") and (REPO / name).is_file(), name
    result = json.loads((REPO / name).read_text())
    assert text[start:end] == br.render(result, name)
    assert br.check(REPO / "README.md") is None
    # every target of the result is a row, with its verdict
    targets = [t for s in result["scenarios"].values() for t in s["targets"]]
    assert targets and all(f"| {t['target']} |" in text[start:end] for t in targets)


def test_the_named_result_measured_a_commit_fully() -> None:
    name, result = named_result()
    assert bench_readme().refusal(result) is None
    assert result["mode"] == "full" and result["rounds"] >= 3
    assert result["measured_commit"] and name.endswith(f"-{result['measured_commit']}.json")
    assert result["environment"]["ssh_scheduler_uncommitted_changes"] == []
    # every tool ran every round: each target has a value (or a failed round's None) per round
    for scenario in result["scenarios"].values():
        for target in scenario["targets"]:
            assert len(target["per_round"]) == result["rounds"], target


def test_the_check_catches_a_table_edited_by_hand(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    start, end, _name = bench_readme().table_span(text)
    readme.write_text(text)

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SCRIPT), "--check", "--readme", str(readme)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip

    assert check().returncode == 0, check().stderr
    table = text[start:end]
    edited = table.replace("| yes |", "| **NO** |", 1) if "| yes |" in table else table.replace("| **NO** |", "| yes |", 1)
    assert edited != table
    readme.write_text(text[:start] + edited + text[end:])
    done = check()
    assert done.returncode == 1
    assert "is not what bench/results/" in done.stderr and "Traceback" not in done.stderr


def test_a_quick_dirty_or_short_run_is_refused() -> None:
    br = bench_readme()
    _name, result = named_result()
    for change, why in (
        ({"mode": "quick"}, "a quick run"),
        ({"rounds": 2}, "a verdict needs at least 3"),
        ({"measured_commit": None, "measured": "the working tree: git abc plus uncommitted changes"}, "commit the package"),
        ({"schema": 1}, "schema 1"),
    ):
        bad = copy.deepcopy(result)
        bad.update(change)
        assert why in (br.refusal(bad) or ""), change


def test_a_verdict_is_the_worst_round() -> None:
    """The row shows every round and the worst; one round missing the bar is a NO whatever the
    median (or a verdict stored with the result) says."""
    br = bench_readme()
    _name, result = named_result()
    result = copy.deepcopy(result)
    scenario = next(iter(result["scenarios"].values()))
    scenario["targets"] = [
        {"target": "wall <= 1.0 x peer's", "row": "ours", "per_round": [0.5, 0.6, 1.2], "worst": 1.2,
         "median": 0.6, "limit": 1.0, "higher_is_better": False, "unit": "x", "met": True},
    ]  # fmt: skip
    rows = [ln for ln in br.render(result, "bench/results/x.json").splitlines() if "wall <= 1.0 x peer's" in ln]
    assert rows == [f"| {next(iter(result['scenarios']))} | ours | wall <= 1.0 x peer's | 0.500 0.600 1.20 | 1.20x | **NO** |"]


def test_the_table_says_what_a_warm_row_measured() -> None:
    """A warm call that logged in as often as its cold one is called a second cold call; one
    that logged in less reused what the cold call left (a hub's connections)."""
    br = bench_readme()
    run = {"ok": True, "ssh_logins": 16}
    result = {"scenarios": {"4": {"tools": {
        "ours cold, 16 hosts": {"runs": [run, run, run]},
        "ours warm (2nd call), 16 hosts": {"runs": [run, {"ok": True, "ssh_logins": 0}, run]},
        "remote cold": {"runs": [run]},
        "remote warm (2nd call)": {"runs": [run]},
    }}}}  # fmt: skip
    assert br.warm_lines(result) == [
        "- 4, ours warm (2nd call), 16 hosts: SSH logins per call [16, 0, 16] (cold [16, 16, 16]): "
        "it reused connections the cold call left.",
        "- 4, remote warm (2nd call): SSH logins per call [16] (cold [16]): a second cold call: it "
        "logged in as often as the cold one (nothing kept its connections).",
    ]
