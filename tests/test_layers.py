"""The house rules: layers import only what comes before them (every import counts), no circles,
names come from the module that defines them, no module over 500 lines, no program in a string,
and docs/design.md describes the package as it is.  Each rule is also shown to catch a planted
fault in a copy of the package."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ssh_scheduler
from tests.layer_rules import (
    LAYERS,
    PURE,
    ROOT,
    VOCABULARY,
    defined_names,
    module_names,
    name_findings,
    violations,
)

PACKAGE = Path(ssh_scheduler.__file__).parent
REPO = PACKAGE.parent
MAX_LINES = 500


def test_the_import_rules_hold() -> None:
    assert violations(PACKAGE) == []


def planted(tmp_path: Path, module: str, text: str) -> Path:
    """A copy of the package with ``text`` appended to ``module`` (dotted, e.g. jobs.needs)."""
    copy = tmp_path / "ssh_scheduler"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n\n" + text)
    return copy


def test_an_upward_import_inside_a_function_is_caught(tmp_path: Path) -> None:
    copy = planted(tmp_path, "jobs.needs", "def later():\n    from ssh_scheduler.coordinator.batch import Batch\n    return Batch\n")
    assert any(
        v.startswith("jobs.needs:") and "imports coordinator.batch" in v for v in violations(copy)
    ), violations(copy)


def test_an_upward_import_under_type_checking_is_caught(tmp_path: Path) -> None:
    copy = planted(
        tmp_path, "planner.explain", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ssh_scheduler.results import journal\n"
    )
    assert any(v.startswith("planner.explain:") and "imports results.journal" in v for v in violations(copy))


def test_a_planted_circle_is_caught(tmp_path: Path) -> None:
    # hostlist is imported by config; a function-level import back closes a circle inside one
    # layer, which the order of layers alone would not see.
    copy = planted(tmp_path, "machines.hostlist", "def later():\n    import ssh_scheduler.machines.config\n")
    assert any(v.startswith("import circle:") and "machines.hostlist" in v for v in violations(copy))


def test_third_party_packages_stay_in_their_room(tmp_path: Path) -> None:
    copy = planted(tmp_path, "view.terminal", "def later():\n    import typer\n    import asyncssh\n")
    found = violations(copy)
    assert any("view.terminal" in v and "imports typer" in v for v in found)
    assert any("view.terminal" in v and "imports asyncssh" in v for v in found)
    copy = planted(tmp_path / "2", "planner.explain", "import asyncio\n")
    assert any("planner.explain" in v and "imports asyncio" in v for v in violations(copy))


def test_the_agent_imports_only_the_agent(tmp_path: Path) -> None:
    copy = planted(tmp_path, "agent.protocol", "def later():\n    from ssh_scheduler import errors\n")
    assert any(v.startswith("agent.protocol:") and "imports errors" in v for v in violations(copy))


def test_names_come_from_the_module_that_defines_them_and_no_private_name_crosses() -> None:
    assert name_findings(PACKAGE) == []


def test_a_re_export_and_a_private_name_are_caught(tmp_path: Path) -> None:
    copy = planted(
        tmp_path, "view.terminal",
        "def later():\n    from ssh_scheduler.coordinator.fleet import Machine\n"
        "    from ssh_scheduler.results import combine_plan as cp\n    return cp._private, Machine\n",
    )
    found = name_findings(copy)
    assert any("imports Machine from coordinator.fleet, which does not define it" in v for v in found), found
    assert any("uses the private name _private of results.combine_plan" in v for v in found), found


def test_each_layer_says_what_it_is_and_what_it_may_import() -> None:
    rooms = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == sorted(LAYERS)
    for layer in LAYERS:
        init = PACKAGE / layer / "__init__.py"
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree) or ""
        assert "May import" in doc, f"{layer}/__init__.py: say what the layer may import"
        # the package is a room, not an API: its __init__ holds only its docstring
        assert len(tree.body) == 1, f"{layer}/__init__.py holds more than its docstring"
    root_modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert root_modules == sorted((*ROOT, *VOCABULARY))


def python_files() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(REPO / "scripts").rglob("*.py")])


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in python_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


SHELL_OPENS = re.compile(r"^\s*(if|for|while|case)\s", re.M)
SHELL_CLOSES = re.compile(r"^\s*(fi|done|esac)\b", re.M)


def program_strings(path: Path) -> list[str]:
    """String literals (docstrings aside) that are programs: several lines that parse as Python
    and define, import or loop, or shell text with a compound command (``if ... fi``, a loop)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
            continue
        text = node.value
        if text.count("\n") < 2:
            continue
        if SHELL_OPENS.search(text) and SHELL_CLOSES.search(text):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}")
            continue
        try:
            program = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        kinds = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.For, ast.While, ast.With, ast.Try)
        if any(isinstance(n, kinds) for n in ast.walk(program)):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_no_program_travels_as_a_string() -> None:
    assert [hit for path in python_files() for hit in program_strings(path)] == []


def test_a_program_in_a_string_is_caught(tmp_path: Path) -> None:
    path = REPO / "tests" / "_planted_program.py"
    try:
        path.write_text(
            '"""Doc."""\nX = """\nimport os\nfor x in os.listdir():\n    print(x)\n"""\n'
            'Y = """\necho start\nif command -v python3; then\n  echo yes\nfi\n"""\n'
        )
        assert program_strings(path) == ["tests/_planted_program.py:2", "tests/_planted_program.py:7"]
    finally:
        path.unlink()


def test_the_shell_programs_the_package_ships_pass_shellcheck() -> None:
    scripts = sorted(PACKAGE.rglob("*.sh"))
    assert scripts, "the package ships its shell programs as .sh files"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/test installs it)")
    found = subprocess.run(["shellcheck", "--shell=sh", *map(str, scripts)], capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


PURE_MODULES = sorted(m for m in module_names(PACKAGE) if m.split(".")[0] in PURE)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_load_neither_asyncio_nor_asyncssh(module: str) -> None:
    code = (
        f"import sys, ssh_scheduler.{module}; "
        "bad = sorted(m for m in ('asyncio', 'asyncssh', 'typer', 'rich') if m in sys.modules); "
        "print(','.join(bad))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "", f"ssh_scheduler.{module} loads {found.stdout.strip()}"


def test_the_public_api_names_where_each_name_is_defined() -> None:
    assert isinstance(ssh_scheduler.__all__, tuple)
    modules = module_names(PACKAGE)
    for name, module in ssh_scheduler._API.items():  # the map itself is the thing under test
        assert name in defined_names(modules[module]), f"{name} is not defined in ssh_scheduler.{module}"
    for name in ssh_scheduler.__all__:
        assert getattr(ssh_scheduler, name) is not None, name


def design_modules() -> list[str]:
    """The modules docs/design.md describes: its module table's first column, ``a.b`` names."""
    text = (REPO / "docs" / "design.md").read_text()
    return re.findall(r"^\| `([a-z_.]+)` \|", text, flags=re.M)


def test_the_design_notes_describe_every_module_once() -> None:
    listed = design_modules()
    assert len(listed) == len(set(listed)), sorted(m for m in listed if listed.count(m) > 1)
    actual = {m for m in module_names(PACKAGE) if m not in LAYERS}
    assert set(listed) == actual, (sorted(actual - set(listed)), sorted(set(listed) - actual))


def test_the_design_notes_state_the_import_rules_this_test_checks() -> None:
    text = (REPO / "docs" / "design.md").read_text()
    assert " -> ".join(LAYERS) in text
    for package, rooms in (("asyncssh", "transport"), ("typer", "cli"), ("rich", "view")):
        assert f"`{package}` only in `{rooms}`" in text
