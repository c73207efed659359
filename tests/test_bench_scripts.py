"""The benchmark driver's modules (scripts/bench_run.py, the scripts/bench_driver/ package and the
helper scripts scripts/bench_*.py): each one imports on its own, none is over 500 lines, and no
import circle joins any two modules of scripts/ -- every import counts, inside a function or
under TYPE_CHECKING too.  No cluster: nothing is run, only imported and parsed.

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
from pathlib import Path

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


if __name__ == "__main__":
    command, argument = sys.argv[1:3]
    if command == "graph":
        print(json.dumps(import_graph(Path(argument))))
    else:
        importlib.import_module(argument)
