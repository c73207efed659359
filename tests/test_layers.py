"""The layering rules: the pure core loads neither asyncio nor asyncssh; the API is exported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ssh_scheduler

PACKAGE = Path(ssh_scheduler.__file__).parent
PURE = ("planner.actions", "planner.allocate", "jobs.batch_file", "planner.deadlines", "planner.dispatch", "planner.explain", "planner.gpus", "planner.observed", "planner.phases", "planner.placement", "planner.state", "results.resume", "jobs.needs", "results.combine", "machines.config", "events", "machines.hostlist", "results.journal", "planner.plan", "planner.plan_start", "planner.policy", "machines.probe", "planner.probe_schedule", "machines.slurm", "executors.slurm_array", "view.terminal")


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_load_neither_asyncio_nor_asyncssh(module: str) -> None:
    code = (
        f"import sys, ssh_scheduler.{module}; "
        "bad = sorted(m for m in ('asyncio', 'asyncssh', 'typer') if m in sys.modules); "
        "print(','.join(bad))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "", f"ssh_scheduler.{module} loads {found.stdout.strip()}"


# Imports per module, top-level ones apart (a local import inside a function is lazy).  Parsed
# in a fresh interpreter: CPython 3.11's ast can trip over the recursion depth a long pytest
# session leaves behind ("AST constructor recursion depth mismatch").
_IMPORTS = """
import ast, json, pathlib, sys
root = pathlib.Path(sys.argv[1])
out = {}
for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    if parts[-1] == "__init__":
        parts = parts[:-1] or ["__init__"]
    name = ".".join(parts)
    tree = ast.parse(path.read_text())
    every, top = set(), set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                names = ["ssh_scheduler." + ".".join([*base, *([node.module] if node.module else [])])]
            else:
                names = [node.module or ""]
        every.update(names)
        if node in tree.body:
            top.update(names)
    out[name] = [sorted(every), sorted(top)]
print(json.dumps(out))
"""


def imports() -> dict[str, tuple[set[str], set[str]]]:
    found = subprocess.run([sys.executable, "-c", _IMPORTS, str(PACKAGE)], capture_output=True, text=True, check=True)
    return {module: (set(every), set(top)) for module, (every, top) in json.loads(found.stdout).items()}


def test_only_transport_imports_asyncssh_and_only_cli_imports_typer() -> None:
    for module, (every, _top) in imports().items():
        roots = {name.split(".")[0] for name in every}
        if "asyncssh" in roots:
            assert module.split(".")[0] == "transport", module
        if "typer" in roots:
            assert module.startswith("cli"), module


def test_the_python_api_is_exported() -> None:
    assert isinstance(ssh_scheduler.__all__, tuple)
    for name in ssh_scheduler.__all__:
        assert getattr(ssh_scheduler, name) is not None, name


def test_no_import_cycles_between_modules() -> None:
    """Module A imports B at top level and B imports A: a cycle the package must not have."""
    found = imports()
    graph = {
        module: {
            name.removeprefix("ssh_scheduler.").rstrip(".")
            for name in top
            if name.startswith("ssh_scheduler.") and name.removeprefix("ssh_scheduler.").rstrip(".") in found
        }
        for module, (_every, top) in found.items()
    }
    seen: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for dep in sorted(graph.get(node, ())):
            if seen.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*path, node, dep])}")
            if not seen.get(dep):
                visit(dep, [*path, node])
        seen[node] = 2

    for module in sorted(graph):
        if not seen.get(module):
            visit(module, [])
