"""``Include`` patterns matched as ssh matches them: ssh hands them to glibc's ``glob(3)``
(``GLOB_TILDE``), so glibc itself, called here through ctypes, is the reference.

Four hundred and eighty bracket expressions, generated from a fixed seed over the forms glob reads inside
``[...]`` -- negation (``!``, ``^``), a ``]`` first, ranges (reversed, with ``-`` at either end),
backslash escapes, character classes (known and unknown), ``[=x=]`` and ``[.x.]``, unclosed sets
-- each in six patterns (in a name, first, between ``*`` and ``?``, after an escape) matched
against a folder holding a file for every printable character, with and without a leading dot
(a wildcard or set never matches a leading ``.``).  ``include_glob`` must
return glibc's list, in glibc's order, for every one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import random
import string
import sys
from pathlib import Path

import pytest

from ssh_scheduler.machines.ssh_include import include_glob

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's glob(3) is the reference")

GLOB_TILDE = 1 << 11  # glibc's value (glob.h)
GLOB_NOMATCH = 3


class GlobT(ctypes.Structure):
    """glibc's ``glob_t``."""

    _fields_ = [
        ("gl_pathc", ctypes.c_size_t),
        ("gl_pathv", ctypes.POINTER(ctypes.c_char_p)),
        ("gl_offs", ctypes.c_size_t),
        ("gl_flags", ctypes.c_int),
        ("gl_closedir", ctypes.c_void_p),
        ("gl_readdir", ctypes.c_void_p),
        ("gl_opendir", ctypes.c_void_p),
        ("gl_lstat", ctypes.c_void_p),
        ("gl_stat", ctypes.c_void_p),
    ]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.glob.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(GlobT)]
_libc.glob.restype = ctypes.c_int
_libc.globfree.argtypes = [ctypes.POINTER(GlobT)]


def glibc_glob(pattern: str) -> list[str]:
    found = GlobT()
    status = _libc.glob(pattern.encode("utf-8", "surrogateescape"), GLOB_TILDE, None, ctypes.byref(found))
    try:
        if status == GLOB_NOMATCH:
            return []
        assert status == 0, f"glob({pattern!r}) failed: {status}"
        return [found.gl_pathv[i].decode("utf-8", "surrogateescape") for i in range(found.gl_pathc)]
    finally:
        _libc.globfree(ctypes.byref(found))


# Every printable character but '/' (no file name holds one).
CHARACTERS = [c for c in string.printable if c not in "/\t\n\r\x0b\x0c"]
PIECES = [
    *"abcxyzAZ09.-!^]\\[*?:=",
    "[:alpha:]", "[:digit:]", "[:upper:]", "[:lower:]", "[:alnum:]", "[:punct:]", "[:space:]",
    "[:xdigit:]", "[:print:]", "[:graph:]", "[:cntrl:]", "[:blank:]", "[:bogus:]", "[:alpha",
    "[=a=]", "[=]=]", "[=ab=]", "[=", "[.a.]", "[.-.]", "[.ab.]", "[.", "[.a.]-c", "a-[.c.]", "[.a.]-]",
    "a-c", "c-a", "--/", "!-#", "0-9", "A-z", "a-\\]", "\\]", "\\-", "\\\\", "\\", "-]", "[:", ":]",
]


def bracket(rng: random.Random) -> str:
    inner = rng.choice(["", "", "!", "^"]) + rng.choice(["", "", "", "]", "-"])
    inner += "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))
    return "[" + inner + ("" if rng.random() < 0.08 else "]")


def expressions(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [bracket(rng) for _ in range(count)]


def families(folder: str, expression: str) -> list[str]:
    """The set in the middle of a name, first (never a leading dot), between wildcards."""
    return [
        f"{folder}/x{expression}.c", f"{folder}/{expression}y.c", f"{folder}/*{expression}*",
        f"{folder}/?{expression}*", f"{folder}/x*{expression}?c", f"{folder}/\\x{expression}\\.c",
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("globs")
    for ch in CHARACTERS:
        (base / f"x{ch}.c").touch()  # a set in the middle of a name
        (base / f"{ch}y.c").touch()  # a set first: never a leading '.'
    return base


@pytest.mark.parametrize("block", range(4))
def test_bracket_expressions_match_what_glibc_matches(folder: Path, block: int) -> None:
    differ = []
    for expression in expressions(120, seed=block):
        for pattern in families(str(folder), expression):
            expected, got = glibc_glob(pattern), include_glob(pattern, None)
            if got != expected:
                differ.append(f"{pattern[len(str(folder)) + 1:]!r}: glibc {len(expected)}, ours {len(got)}")
    assert differ == []


def test_the_reference_is_glibc_as_ssh_reads_it(folder: Path) -> None:
    """The forms the generator leans on, said plainly (and a check that the reference works)."""
    names = lambda paths: sorted(Path(p).name for p in paths)  # noqa: E731
    assert names(glibc_glob(f"{folder}/x[]a].c")) == ["x].c", "xa.c"]
    assert names(glibc_glob(f"{folder}/x[!a-y].c")) == names(include_glob(f"{folder}/x[!a-y].c", None))
    assert ".y.c" not in names(glibc_glob(f"{folder}/[.]y.c"))  # a set never matches a leading dot
    assert names(glibc_glob(f"{folder}/x[[:digit:]].c")) == [f"x{d}.c" for d in "0123456789"]
