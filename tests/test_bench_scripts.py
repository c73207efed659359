"""The benchmark driver's modules (scripts/bench_run.py, the scripts/bench_driver/ package and the
helper scripts scripts/bench_*.py): each one imports on its own, none is over 500 lines, and no
import circle joins any two modules of scripts/ -- every import counts, inside a function or
under TYPE_CHECKING too.  And the driver's fairness rules, on made-up runs: every tool runs in
every round, a target is judged round by round on its worst round, and the agent floor's host
program spawns job lines without a shell.  No cluster.

Run as a script, this file is its own helper, in a fresh interpreter:
``test_bench_scripts.py graph SCRIPTS`` prints the import graph of SCRIPTS' modules as JSON (CPython
3.11's ast can trip over the recursion depth a long pytest session leaves behind, "AST constructor
recursion depth mismatch"), and ``test_bench_scripts.py import MODULE`` imports one module.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
MAX_LINES = 500


def module_files(scripts: Path) -> dict[str, Path]:
    """Every Python module under ``scripts`` by the name it is imported as, scripts/ being on
    sys.path as it is for the driver (``bench_run``, ``bench_driver.scenarios.files``, ...).
    Files without the .py suffix (scripts/bench, scripts/test) are programs, not modules."""
    found = {}
    for path in sorted(scripts.rglob("*.py")):
        parts = list(path.relative_to(scripts).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(scripts: Path) -> dict[str, list[str]]:
    """Module -> the modules of ``scripts`` it imports anywhere in its text."""
    files = module_files(scripts)
    graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".") if package else []
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                # ``from package import module`` imports the module; ``from module import name``
                # the module the name is in.
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.add(sub if sub in files else base)
        graph[name] = sorted(t for t in targets if t in files and t != name)
    return graph


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if not state.get(dep):
                found = visit(dep, [*path, dep])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if not state.get(start):
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def helper(*args: str) -> subprocess.CompletedProcess[str]:
    """This file as a script in a fresh interpreter, with the driver's sys.path: scripts/ (where
    bench_run.py runs from) and the repository (bench_run adds it for tests.cluster).  ``-P``:
    not tests/ first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-P", str(Path(__file__).resolve()), *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )  # fmt: skip


def scripts_graph(scripts: Path) -> dict[str, list[str]]:
    found = helper("graph", str(scripts))
    assert found.returncode == 0, found.stderr
    graph: dict[str, list[str]] = json.loads(found.stdout)
    return graph


def test_every_bench_module_imports_on_its_own() -> None:
    names = sorted(module_files(SCRIPTS))
    assert {"bench_run", "bench_driver", "bench_floor"} <= set(names), names
    failed = {}
    for name in names:
        done = helper("import", name)
        if done.returncode != 0:
            failed[name] = done.stderr.strip().splitlines()[-1:]
    assert failed == {}


def test_no_bench_module_is_over_500_lines() -> None:
    lines = {name: len(path.read_text().splitlines()) for name, path in module_files(SCRIPTS).items()}
    assert {name: n for name, n in lines.items() if n > MAX_LINES} == {}


def test_no_import_circle_among_the_scripts() -> None:
    graph = scripts_graph(SCRIPTS)
    assert "bench_driver.records" in graph["bench_driver.scenarios.files"]  # the graph sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_circle_check_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """A circle made only of a function-level import and a TYPE_CHECKING one is still a circle,
    and relative imports and ``from package import module`` resolve to the module."""
    (tmp_path / "top.py").write_text("def main():\n    from pkg import low\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "low.py").write_text("from .mid import x\n")
    (tmp_path / "pkg" / "mid.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import top\nx = 1\n"
    )
    graph = scripts_graph(tmp_path)
    assert graph == {"pkg": [], "pkg.low": ["pkg.mid"], "pkg.mid": ["top"], "top": ["pkg.low"]}
    assert find_cycle(graph) == ["pkg.low", "pkg.mid", "top", "pkg.low"]
    (tmp_path / "pkg" / "mid.py").write_text("x = 1\n")
    assert find_cycle(scripts_graph(tmp_path)) is None


def driver(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    """bench_driver.records and bench_driver.runner, imported as the driver imports them."""
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("bench_driver.records"), importlib.import_module("bench_driver.runner")


def test_every_tool_runs_in_every_round_peers_included(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    records, runner = driver(monkeypatch)
    Cmd = importlib.import_module("bench_driver.measure").Cmd
    tools = [
        records.Tool(name, lambda cwd: Cmd(["true"], cwd), kind=kind)
        for name, kind in (("ours", "ssh_scheduler"), ("pdsh", "peer"), ("floor", "floor"))
    ]
    scenario = records.Scenario("x", "made up", [records.Group([t]) for t in tools])
    settled: list[int] = []
    bench = SimpleNamespace(
        args=SimpleNamespace(rounds=3, profile=False), cluster=None, gpu_cluster=None,
        rundir=lambda sid, tool: Path(tempfile.mkdtemp(dir=tmp_path)),
        settle=lambda: settled.append(len(settled)) or 0.25,
    )  # fmt: skip
    runner.run_scenario(bench, scenario)
    assert {t.name: [r.round_no for r in t.runs] for t in tools} == {
        "ours": [0, 1, 2], "pdsh": [0, 1, 2], "floor": [0, 1, 2]
    }  # fmt: skip
    # Each run is followed by a wait for the hub's spares: none lands in the next tool's time.
    assert len(settled) == 9 and all(r.extra["hub_settled_after_s"] == 0.25 for t in tools for r in t.runs)


def test_a_target_holds_only_if_its_worst_round_does(monkeypatch: pytest.MonkeyPatch) -> None:
    records, _runner = driver(monkeypatch)
    Run = importlib.import_module("bench_driver.measure").Run

    def tool(name: str, walls: list[float | None]) -> object:
        t = records.Tool(name, lambda cwd: None)
        for n, wall in enumerate(walls):
            # listed out of round order: rounds pair by their number, not by position
            t.runs.insert(0, Run(wall or 9.0, 0, 0.0, 0.0, 0.0, 0.0, ok=wall is not None, round_no=n))
        return t

    ours, peer = tool("ours", [1.0, 1.1, 2.0]), tool("peer", [1.0, 1.0, 1.0])
    slower = records.slower_target("ours <= 1.5 x peer", ours, peer, 1.5)
    assert slower.values == [1.0, 1.1, 2.0] and slower.median == 1.1
    assert slower.worst == 2.0 and slower.met is False  # the median would have said yes
    faster = records.faster_target("ours >= 0.8 x peer's jobs/s", ours, peer, 0.8)
    assert faster.worst == 0.5 and faster.met is False
    assert records.slower_target("t", ours, peer, 2.0).met is True
    flaky = records.slower_target("t", tool("ours", [1.0, None, 1.2]), peer, 1.5)
    assert flaky.values == [1.0, None, 1.2] and flaky.met is True
    assert flaky.shown() == "yes (2 of 3 rounds)"
    assert flaky.to_json()["per_round"] == [1.0, None, 1.2]
    one_round = records.slower_target("t", tool("ours", [1.0]), tool("peer", [1.0]), 1.5)
    assert "indicative" in one_round.shown()


def test_the_agent_floor_host_spawns_each_line_without_a_shell(tmp_path: Path) -> None:
    """Its jobs are programs: a shell word is not run by a shell (127), quotes are words, and
    at most SLOTS run at once."""
    marker = tmp_path / "ran"
    lines = [
        f"1\t/bin/sh -c 'echo $$ >> {marker}'",  # quoted: one word for sh -c
        "2\t/bin/false",
        "3\ttrue && false",  # '&&' is a word here: true ignores its arguments
        "4\tcd /",  # a shell builtin, not a program
        "5\t/bin/sleep 0.2",
        "6\t/bin/sleep 0.2",
    ]
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", (SCRIPTS / "bench_agent_floor_host.py").read_text(), "1"],
        input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert dict(ln.split() for ln in done.stdout.splitlines()) == {
        "1": "0", "2": "1", "3": "0", "4": "127", "5": "0", "6": "0"
    }  # fmt: skip
    assert len(marker.read_text().split()) == 1
    # one slot: the answers come in the order the lines were given
    assert [ln.split()[0] for ln in done.stdout.splitlines()] == ["1", "2", "3", "4", "5", "6"]


if __name__ == "__main__":
    command, argument = sys.argv[1:3]
    if command == "graph":
        print(json.dumps(import_graph(Path(argument))))
    else:
        importlib.import_module(argument)


def test_the_functions_scenario_judges_every_round_and_renders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Its targets are per-round ratios against Dask (a single median ratio crashed the table at
    the end of a whole run, after every round had been measured, and lost the run)."""
    driver(monkeypatch)  # scripts/ on sys.path, as the driver has it
    Run = importlib.import_module("bench_driver.measure").Run
    functions = importlib.import_module("bench_driver.scenarios.functions")
    render_table = importlib.import_module("bench_driver.table").render_table
    bench = SimpleNamespace(quick=True, root=tmp_path, machines=lambda names: [f"{n}.yaml" for n in names], env={})
    scenario = functions.scenario_functions(bench)
    walls = {functions.DASK: [2.5, 2.4, 2.9], functions.EXECUTOR: [26.0, 26.2, 27.1]}
    for tool in scenario.tools:
        for n, wall in enumerate(walls.get(tool.name, [1.0, 1.2, 1.1])):
            tool.runs.append(Run(wall, 0, 0.0, 0.0, 0.0, 0.0, ok=True, round_no=n))
    targets = scenario.targets(scenario)
    by_row = {t.row: t for t in targets}
    assert by_row[functions.EXECUTOR].values == pytest.approx([2.5 / 26.0, 2.4 / 26.2, 2.9 / 27.1])
    assert by_row[functions.EXECUTOR].met is False
    assert by_row[functions.CHUNKED].worst == pytest.approx(2.4 / 1.2) and by_row[functions.CHUNKED].met is True
    assert functions.CHUNKED in render_table([scenario], {scenario.sid: targets})
