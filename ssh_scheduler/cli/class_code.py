"""The code ``dataclasses`` writes for this package's classes, compiled once and kept.

A part of our own processes' start (the console scripts, ``python -m ssh_scheduler``, the
launcher); never of a user's process that imports the package (an ``Executor`` in a notebook).
Every ``@dataclass`` makes its methods (``__init__``, ``__repr__``, ``__eq__``, a frozen one's
``__setattr__`` and ``__delattr__``, ``__hash__``) by compiling their text with ``exec``: about
1 ms of CPU per class on Python 3.11 and 3.12, and a batch's command imports about 90 of ours,
a third of its modules' whole import time.  That text depends only on a class's fields and
options, and the same text compiles to the same code, so the code is kept in the user's cache
folder (``$XDG_CACHE_HOME/ssh_scheduler/dataclass-code/<python tag>-<build>.bin``, else under
``~/.cache``), read once as the process starts and written back when some text was new (the
first command after an install or an upgrade, or ``python -m ssh_scheduler.cli.class_code``).

``dataclasses`` looks ``exec`` up among its module's globals: :func:`install` puts one there
that takes the kept code for the text of a class of a module named ``ssh_scheduler...``, and
compiles any other text as ``exec`` would.  A file not this user's alone, damaged, or written by
another Python build is not used: every class is then compiled, as without it.  Only standard
library modules here (the console scripts' thin start imports this).
"""

from __future__ import annotations

import atexit
import binascii
import contextlib
import marshal
import os
import stat
import sys
import types

TYPE_CHECKING = False  # (typing's own import costs the thin start 2 ms)
if TYPE_CHECKING:
    from typing import Any

FOLDER = "dataclass-code"
PACKAGE = "ssh_scheduler"
LIMIT = 5000
"""Texts a file may keep: above it, only those this process used are written (old versions'
classes go)."""

_kept: dict[str, bytes] = {}  # text -> its code, marshalled (read only when used: 60 us each)
_made: dict[str, types.CodeType] = {}  # text -> its code, as this process has used it
_used: set[str] = set()
_new = False
_installed = False
counts = {"kept": 0, "compiled": 0}
"""Texts of our classes this process took from the file, and those it compiled (tests)."""


def folder() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, PACKAGE, FOLDER)


def _header() -> bytes:
    """What must match for the kept code to be this interpreter's: code objects are only
    readable by the build that wrote them (and -O changes what compiles)."""
    return f"{sys.version}|{sys.implementation.cache_tag}|{sys.flags.optimize}\n".encode()


def _path() -> str:
    # One file per build (the header's checksum in its name): two builds sharing a home (NFS)
    # would otherwise each find the other's file and write their own over it, every command.
    return os.path.join(folder(), f"{sys.implementation.cache_tag or 'python'}-{binascii.crc32(_header()):08x}.bin")


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _exec(source: Any, globals: Any = None, locals: Any = None, /) -> None:
    """``exec`` as ``dataclasses`` calls it, from kept code for our own classes."""
    if isinstance(source, str) and isinstance(globals, dict) and str(globals.get("__name__", "")).startswith(PACKAGE + "."):
        code = _made.get(source)
        kept = _kept.get(source) if code is None else None
        if kept is not None:
            with contextlib.suppress(EOFError, ValueError, TypeError):
                code = marshal.loads(kept)
            if type(code) is types.CodeType:
                counts["kept"] += 1
            else:
                code = None
        if code is None:
            global _new
            # dont_inherit: the flags of dataclasses.py, which has no __future__ imports, not this file's
            code = compile(source, "<string>", "exec", dont_inherit=True)
            _kept[source] = marshal.dumps(code)
            _new = True
            counts["compiled"] += 1
        _made[source] = code
        _used.add(source)
        source = code
    exec(source, globals, locals)


def install() -> None:
    """Read the kept code and have ``dataclasses`` use it; write it back at exit if it grew."""
    global _installed
    if _installed:
        return
    _installed = True
    _kept.update(_read())
    import dataclasses

    dataclasses.exec = _exec  # type: ignore[attr-defined]
    atexit.register(save)


def _read() -> dict[str, bytes]:
    try:
        fd = os.open(_path(), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO: refused, not waited on)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            if not _ours(os.fstat(f.fileno())) or f.readline() != _header():
                return {}
            kept = marshal.load(f)
    except (OSError, EOFError, ValueError, TypeError):
        return {}
    if not isinstance(kept, dict):
        return {}
    return {text: code for text, code in kept.items() if isinstance(text, str) and isinstance(code, bytes)}


def save() -> None:
    """Write what was compiled, when something was new (never the command's failure)."""
    global _new
    if not _new:
        return
    _new = False
    keep = _kept if len(_kept) <= LIMIT else {text: _kept[text] for text in _used}
    try:
        where = folder()
        os.makedirs(where, mode=0o700, exist_ok=True)
        target = _path()
        tmp = f"{target}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_header())
                marshal.dump(keep, f)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except (OSError, ValueError):  # a full disk or a read-only home: compiled again next time
        pass


def load_all(skipped: tuple[str, ...]) -> list[tuple[str, Exception]]:
    """Every module of the package but those ``skipped`` names begin with, loaded with the kept
    code, which is then written (what the launcher loads, and ``python -m`` this module does);
    the modules that did not load, with why."""
    import importlib
    import pkgutil

    install()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    failed: list[tuple[str, Exception]] = []
    for module in pkgutil.walk_packages([package], PACKAGE + "."):
        if not module.name.startswith(skipped):
            try:
                importlib.import_module(module.name)
            except Exception as exc:
                failed.append((module.name, exc))
    save()
    return failed


if __name__ == "__main__":  # python -m ssh_scheduler.cli.class_code: keep every class's code now
    load_all((f"{PACKAGE}.agent", f"{PACKAGE}.__main__"))  # (the hosts' files; the program)
