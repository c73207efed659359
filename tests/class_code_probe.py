"""Run by test_class_code.py as a program: import every module of the package, as a command
or the launcher would, and print (JSON) what each of our dataclasses' made methods compiled to,
how many texts came from the kept file and how many were compiled, and whether ``dataclasses``
was given another ``exec``.

    python tests/class_code_probe.py plain   # no kept code: dataclasses as Python has it
    python tests/class_code_probe.py kept    # as our processes start (cli/class_code.install)
    python tests/class_code_probe.py user    # as a user's program imports the package
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MADE = ("__init__", "__repr__", "__eq__", "__setattr__", "__delattr__", "__hash__", "__lt__", "__le__", "__gt__", "__ge__")
SKIPPED = ("ssh_scheduler.agent", "ssh_scheduler.__main__")  # (the hosts' files; the program itself)


def fingerprint(code: types.CodeType) -> list[object]:
    """What a function does: its bytecode, constants (nested code too), names, arguments."""
    consts = [fingerprint(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return [code.co_code.hex(), consts, list(code.co_names), list(code.co_varnames), list(code.co_freevars), code.co_argcount, code.co_kwonlyargcount, code.co_flags]


def made_methods() -> dict[str, list[object]]:
    found: dict[str, list[object]] = {}
    for module in sorted(name for name in sys.modules if name.startswith("ssh_scheduler.")):
        for name, cls in sorted(vars(sys.modules[module]).items()):
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == module):
                continue
            for method in MADE:
                function = cls.__dict__.get(method)
                if isinstance(function, types.FunctionType) and function.__code__.co_filename == "<string>":
                    found[f"{module}.{name}.{method}"] = fingerprint(function.__code__)
            found[f"{module}.{name}.__doc__"] = [cls.__doc__]
    return found


def main(mode: str) -> None:
    sys.path.insert(0, str(ROOT))
    from ssh_scheduler.cli import class_code

    if mode == "kept":
        class_code.install()
    if mode == "user":
        importlib.import_module("ssh_scheduler").Executor  # noqa: B018 (what a notebook does)
    else:
        for module in pkgutil.walk_packages([str(ROOT / "ssh_scheduler")], "ssh_scheduler."):
            if not module.name.startswith(SKIPPED):
                importlib.import_module(module.name)

    @dataclasses.dataclass(frozen=True)
    class Users:  # a class of a module not ours: compiled as Python does, never kept
        zz_users_own_field: int = 0

    print(json.dumps({
        "methods": made_methods(),
        "counts": class_code.counts,
        "exec_replaced": "exec" in vars(dataclasses),
        "users_class_works": Users(3) == Users(3) and repr(Users(3)) == "main.<locals>.Users(zz_users_own_field=3)",
    }))


if __name__ == "__main__":
    main(sys.argv[1])
