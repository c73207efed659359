"""Where the package tests an object against an executor class, outside ``executors/``.

Run as a script in a fresh interpreter (as test_layers parses: CPython 3.11's ast can trip over
the recursion depth a long pytest session leaves behind): ``python tests/executor_scan.py
PACKAGE_DIR`` prints JSON ``{"classes": [...], "found": [[path, line, code], ...]}``.

An executor class is one of ``executors/`` that has every method of the ``Executor`` protocol
(``executors/base.py``), itself or through its bases there (SlurmExecutor gets ``stage`` from
AgentExecutor), and the protocol itself.  Found: every ``isinstance`` or ``issubclass`` whose
second argument names one of them (bare, as ``module.Class``, or in a tuple).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def _classes(package: Path) -> dict[str, tuple[set[str], list[str]]]:
    """Every class of executors/: its own methods and its bases' names."""
    classes: dict[str, tuple[set[str], list[str]]] = {}
    for path in sorted((package / "executors").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases]
                classes[node.name] = (methods, bases)
    return classes


def executor_classes(package: Path) -> set[str]:
    classes = _classes(package)

    def methods(name: str) -> set[str]:
        own, bases = classes[name]
        return own.union(*(methods(base) for base in bases if base in classes))

    protocol = classes["Executor"][0]
    return {name for name in classes if protocol <= methods(name)}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def isinstance_uses(package: Path, classes: set[str]) -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "executors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
                and _names(node.args[1]) & classes
            ):
                found.append((str(rel), node.lineno, ast.unparse(node)))
    return found


if __name__ == "__main__":
    package = Path(sys.argv[1])
    classes = executor_classes(package)
    print(json.dumps({"classes": sorted(classes), "found": isinstance_uses(package, classes)}))
