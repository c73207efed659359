"""A Python call pickled for a host, and the name it runs under.

The payload file (``jobs.python_call.PAYLOAD`` on the host) is one JSON header line, then two
pickles (cloudpickle, protocol 5): the function, then its ``(args, kwargs)``.  The header says
what the host must check before it unpickles anything (``agent/call_runner.py``): the Python that
pickled it, whether the pickles hold code (a lambda, a closure or a function of ``__main__``
travels as bytecode, which only the same minor version loads), the function's name for messages,
and the folders of this script's ``sys.path`` inside the copied-forward folder (where the host
finds the user's own modules, which travel by name); ``cwd``, when set, the folder (relative to
the job's) the call runs in (a function sweep's combination folder).

A call's job name is its resume key: the function's identity (its module and qualified name
when it travels by name; the hash of its pickle when it travels as code, or is not a plain
function) and the hash of its pickled arguments.  The same call in a rerun of the script gets
the same name, so its result is found in the results folder instead of run again.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

from ssh_scheduler.errors import SchedulerError
from ssh_scheduler.jobs.python_call import PythonCall

__all__ = ["RUN_BATCH", "Call", "CodePickler", "PickledCall", "import_folders", "pickle_call"]

Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
"""One call of a batch: the function, its positional and its keyword arguments."""


def _batch_runner() -> Callable[[list[Call]], list[Any]]:
    def run_batch(items: list[Call]) -> list[Any]:
        return [function(*args, **kwargs) for function, args, kwargs in items]

    return run_batch


RUN_BATCH = _batch_runner()
"""Several calls as one call, one job, one process on the host (``Executor.map``'s
``chunksize``, a joblib batch): defined in a function, so cloudpickle sends it by value (the
hosts need no ssh_scheduler); like any by-value code it runs only on the same minor version of
Python.  The first call that raises ends the batch with its exception."""

NAME_LABEL_CHARS = 60
"""The readable part of a call's job name (its function's name), at most."""
DESCRIBED_CHARS = 160
"""A call's description (its job's command, shown in lines and the journal), at most."""


class CodePickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle's pickler, noting whether what it pickles holds code: bytecode loads only on
    the minor version of Python that made it."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=5)
        self.holds_code = False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            self.holds_code = True
        return super().reducer_override(obj)


def _dumps(obj: object) -> tuple[bytes, bool]:
    buffer = io.BytesIO()
    pickler = CodePickler(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.holds_code


@dataclass(frozen=True, slots=True)
class PickledCall:
    """One call, ready to run: its job's ``name`` (the resume key, see the module docstring),
    ``description`` (the job's command) and ``work`` (its payload file, here)."""

    name: str
    description: str
    work: PythonCall
    holds_code: bool


def _label(function: object) -> str:
    """The function's name as part of a job name: ``train``, ``Model.fit``, ``lambda``."""
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    name = str(name).replace("<locals>.", "").replace("<lambda>", "lambda")
    parts = [p for p in re.sub(r"[^A-Za-z0-9_.]+", "_", name).split(".") if p.strip("_")]
    label = parts.pop() if parts else "call"  # the innermost name, then its outer ones that fit
    while parts and len(parts[-1]) + 1 + len(label) <= NAME_LABEL_CHARS:
        label = f"{parts.pop()}.{label}"
    return label[:NAME_LABEL_CHARS]


def _shown(value: object) -> str:
    """An argument as the description shows it: short plain values as written, else its type
    (never ``repr`` of an object: that may be long, slow, or differ from run to run)."""
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, str) and len(value) <= 30 and value.isprintable():
        return repr(value)
    return f"<{type(value).__name__}>"


def _describe(function: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    shown = [_shown(a) for a in args] + [f"{k}={_shown(v)}" for k, v in kwargs.items()]
    text = f"python {module + '.' if isinstance(module, str) else ''}{name}({', '.join(shown)})"
    return text if len(text) <= DESCRIBED_CHARS else text[: DESCRIBED_CHARS - 4] + "...)"


def _identity(function: object, pickled: bytes, holds_code: bool) -> str:
    """Module and qualified name for a plain function that travels by name (its code may change
    without changing its results' names); the pickle's hash for anything else (a lambda, a
    closure, a bound method with its object's state, a ``functools.partial``)."""
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None)
    plain = isinstance(function, types.FunctionType | types.BuiltinFunctionType)
    if plain and not holds_code and isinstance(module, str) and isinstance(qualname, str):
        return f"{module}:{qualname}"
    return "pickle:" + hashlib.sha256(pickled).hexdigest()


def import_folders(base_dir: Path) -> list[str]:
    """The folders of this script's ``sys.path`` that lie in the copied-forward folder, relative
    to it (``.``: the folder itself): the host puts them on its own ``sys.path``."""
    return list(_import_folders(base_dir, tuple(sys.path), os.getcwd()))


@functools.lru_cache(maxsize=8)  # asked once per call: 100,000 calls, one walk while sys.path stays
def _import_folders(base_dir: Path, path: tuple[str, ...], cwd: str) -> tuple[str, ...]:
    base = base_dir.resolve()
    found: list[str] = []
    for entry in path:
        try:
            folder = Path(entry or cwd).resolve()
        except OSError:
            continue
        # Only what is there: a path hook's made-up entry (an editable install's finder puts
        # "__editable__...__path_hook__" on sys.path) resolves into the folder and is nothing.
        if not folder.exists():
            continue
        if folder == base or base in folder.parents:
            rel = folder.relative_to(base).as_posix() or "."
            if rel not in found:
                found.append(rel)
    return tuple(found) or (".",)


def pickle_call(
    function: object, args: tuple[Any, ...], kwargs: dict[str, Any], folder: Path, base_dir: Path, salt: str = "",
    cwd: str | None = None,
) -> PickledCall:
    """Pickle the call into a new file in ``folder``.  ``salt``: makes the name differ from an
    earlier run's (no resume); ``cwd``: the folder, relative to the job's, the call runs in
    (made if missing).  Raises :class:`SchedulerError` when it does not pickle."""
    label = _label(function)
    try:
        function_pickle, function_code = _dumps(function)
        arguments_pickle, arguments_code = _dumps((args, kwargs))
    except Exception as exc:  # (any object's __reduce__ may raise anything)
        raise SchedulerError(
            f"cannot send {_describe(function, args, kwargs)} to a host: it does not pickle "
            f"({type(exc).__name__}: {str(exc)[:200]}); fix: pass values that pickle, or make "
            f"the object inside the function"
        ) from None
    identity = _identity(function, function_pickle, function_code)
    key = hashlib.sha256(
        f"{identity}\0{hashlib.sha256(arguments_pickle).hexdigest()}\0{salt}".encode()
    ).hexdigest()
    holds_code = function_code or arguments_code
    header = {
        "python": list(sys.version_info[:3]),
        "code": holds_code,
        "function": _describe(function, (), {}).removeprefix("python ").removesuffix("()"),
        "path": import_folders(base_dir),
        "cloudpickle": cloudpickle.__version__,
    }
    if cwd is not None:
        header["cwd"] = cwd
    head = (json.dumps(header) + "\n").encode()
    content = hashlib.sha256(head)
    content.update(function_pickle)
    content.update(arguments_pickle)
    fd, path = tempfile.mkstemp(prefix=f"{key[:16]}-", suffix=".pickle", dir=folder)
    with os.fdopen(fd, "wb") as out:
        out.writelines((head, function_pickle, arguments_pickle))
    size = len(head) + len(function_pickle) + len(arguments_pickle)
    work = PythonCall(Path(path), f"{content.hexdigest()}-r", size)
    return PickledCall(f"{label}-{key[:16]}", _describe(function, args, kwargs), work, holds_code)
