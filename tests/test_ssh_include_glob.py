"""``Include`` patterns matched as ssh matches them, the live ``ssh -G`` the reference.

ssh globs with its bundled copy of OpenBSD's ``glob(3)``, not glibc's (they differ on ``[^a]``,
``[=a=]``, ``[.a.]``, an unknown ``[:class:]``, a ``[`` with no ``]``): machines/ssh_glob.py.
Here a few hundred bracket expressions, generated from fixed seeds over the forms a set may hold
-- ``!`` and ``^`` first, a ``]`` first, ranges (reversed, with ``-`` at either end), backslash
escapes, classes known and unknown, ``[=x=]`` and ``[.x.]``, sets with no end -- each in six
patterns (in a name, first, between ``*`` and ``?``, after an escape), are matched against a
folder that holds a file for each of 45 characters, with and without a leading dot.  Each file
adds its own ``IdentityFile``, so ``ssh -G`` lists exactly the files its ``Include`` read, in
its order; ours must list the same.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError, show_value
from ssh_scheduler.machines.ssh_config import read_config_file
from ssh_scheduler.machines.ssh_resolve import resolve_host
from tests.ssh_reference import Reference, make_reference

CHARACTERS = [*"]![^-\\*?:=.abcxyzAZ09 #$%&()+,;<>@_{|}~'\"`", "\u00e9"]
"""File names hold each (and é, two bytes: ``?`` is one byte for ssh); 2 files each and the
:data:`EXTRA`, under ssh's limit of 100 identity files however many a pattern matches."""
EXTRA = ["zz\\", os.fsdecode(b"l\xe9")]
"""A name that ends in a backslash, and one that is not UTF-8 (Latin-1 ``é``)."""
PIECES = [
    *"abcxyzAZ09.-!^]\\[*?:=",
    "[:alpha:]", "[:digit:]", "[:upper:]", "[:lower:]", "[:alnum:]", "[:punct:]", "[:space:]",
    "[:xdigit:]", "[:print:]", "[:graph:]", "[:cntrl:]", "[:blank:]", "[:bogus:]", "[:alpha", "[:",
    ":]", "[=a=]", "[=]=]", "[.a.]", "[.-.]", "a-c", "c-a", "--.", "!-#", "0-9", "A-z", "a-\\]",
    "\\]", "\\-", "\\\\", "-]", ":digit:]", "a:alpha:]",
]


def bracket(rng: random.Random) -> str:
    inner = rng.choice(["", "", "!", "^"]) + rng.choice(["", "", "", "]", "-"])
    inner += "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))
    return "[" + inner + ("" if rng.random() < 0.08 else "]")


def expressions(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [bracket(rng) for _ in range(count)]


def families(folder: str, expression: str) -> list[str]:
    """The set in a name, first, between wildcards, after an escape, last, before an escaped
    last character, before a trailing backslash."""
    return [
        f"{folder}/x{expression}.c", f"{folder}/{expression}y.c", f"{folder}/*{expression}*",
        f"{folder}/?{expression}*", f"{folder}/x*{expression}?c", f"{folder}/\\x{expression}\\.c",
        f"{folder}/x{expression}", f"{folder}/{expression}y.\\c", f"{folder}/x{expression}.c\\",
    ]


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    assert shutil.which("ssh"), "openssh-client is installed by scripts/test"
    return make_reference(tmp_path_factory.mktemp("sshref"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("globs")
    for name in [*(f"x{ch}.c" for ch in CHARACTERS), *(f"{ch}y.c" for ch in CHARACTERS), *EXTRA]:
        (base / name).write_text(f"IdentityFile /k/{os.fsencode(name).hex()}\n")
    return base


def read_by_ssh(ref: Reference, config: Path) -> list[str] | None:
    """The files ssh read, in order; None when ssh crashed (OpenSSH 9.2's glob reads a set whose
    ']' a class took past the pattern's end)."""
    status, values, stderr = ref.run("gpu1", config)
    if status < 0:
        return None
    assert status == 0, stderr
    return [v for v in values.get("identityfile", []) if v.startswith("/k/")]


def read_by_us(ref: Reference, config: Path) -> list[str]:
    parsed = read_config_file(config, environ=ref.env)
    assert parsed is not None
    host = resolve_host("gpu1", [parsed], ref.account, environ=ref.env)
    return [f for f in host.identity_files if f.startswith("/k/")]


@pytest.mark.parametrize("block", range(4))
def test_bracket_expressions_match_what_ssh_matches(ref: Reference, folder: Path, tmp_path: Path, block: int) -> None:
    config = tmp_path / "config"
    differ, crashed = [], 0
    for expression in expressions(30, seed=block):
        for pattern in families(str(folder), expression):
            config.write_bytes(b"Include " + os.fsencode(pattern) + b"\n")
            theirs = read_by_ssh(ref, config)
            if theirs is None:  # ssh crashed: we refuse it, in one line that says why
                crashed += 1
                with pytest.raises(ConfigError, match=r"^[^\n]*ssh itself crashes reading it"):
                    read_by_us(ref, config)
                continue
            ours = read_by_us(ref, config)
            if ours != theirs:
                differ.append(f"{pattern[len(str(folder)) + 1:]!r}: ssh {len(theirs)} files, ours {len(ours)}")
    assert differ == []
    assert crashed < 40  # (the seeds' 42 in all: most patterns are read)


def test_a_set_ssh_crashes_on_is_refused_in_one_line(folder: Path, tmp_path: Path) -> None:
    config = tmp_path / "config"
    pattern = f"{folder}/x[!][:punct:]\\].c"
    config.write_text(f"Include {pattern}\n")
    with pytest.raises(ConfigError) as refused:
        read_config_file(config, environ={"HOME": str(tmp_path)})
    assert str(refused.value) == (
        f"{config} line 1: Include {show_value(pattern)}: a [:class:] takes the ']' that would end its [...] "
        "set, so the set never ends (ssh itself crashes reading it); end the set with one more ']'"
    )


def test_a_set_runs_on_across_a_slash_as_in_ssh(ref: Reference, folder: Path, tmp_path: Path) -> None:
    """ssh parses the whole pattern before it cuts it at '/': a set whose ']' a class took ends
    at a ']' in a later component (ssh reads on), or nowhere (ssh crashes: refused here too)."""
    config = tmp_path / "config"
    for pattern, crashes in ((f"{folder}/q[!][:punct:]\\]x/*.c", True), (f"{folder}/q[!][:punct:]\\]x/*].c", False)):
        config.write_text(f"Include {pattern}\n")
        theirs = read_by_ssh(ref, config)
        assert (theirs is None) == crashes, pattern
        if crashes:
            with pytest.raises(ConfigError, match="ssh itself crashes reading it"):
                read_by_us(ref, config)
        else:
            assert read_by_us(ref, config) == theirs == [], pattern


def test_the_forms_where_ssh_is_not_glibc(ref: Reference, folder: Path, tmp_path: Path) -> None:
    """Said plainly: only ``!`` negates, no ``[=x=]``, an unknown class matches nothing, a
    ``?`` is one byte, ``[:alnum:]`` ends the pattern after its set."""
    config = tmp_path / "config"
    hexes = lambda names: [f"/k/{os.fsencode(n).hex()}" for n in names]  # noqa: E731
    for pattern, names in [
        ("x[^b].c", ["x^.c", "xb.c"]),
        # x*[[:alnum:]] and no more: every x file (each ends in 'c'), the rest never read
        ("x*[[:alnum:]].nothing/at/all", sorted(f"x{ch}.c" for ch in CHARACTERS)),
        (".*[[:alnum:]]", [".y.c"]),  # (cut short, it still starts with a dot)
        ("zz\\", ["zz\\"]),  # a trailing backslash is itself
        ("z?\\", ["zz\\"]),
        (os.fsdecode(b"l\xe9"), EXTRA[1:]),  # a name that is not UTF-8, written so
        ("x[a:digit:]].c", None),  # a class needs its '['
        ("x[!]", []),
        ("x[", []),  # a '[' last is itself
        ("x[!b-z].c", None),
        ("x[[=a=]].c", []),
        ("x[[:bogus:]a].c", []),
        ("x?.c", None),
        ("x??.c", ["x\u00e9.c"]),
    ]:
        config.write_bytes(b"Include " + os.fsencode(f"{folder}/{pattern}") + b"\n")
        theirs = read_by_ssh(ref, config)
        assert read_by_us(ref, config) == theirs, pattern
        if names is not None:
            assert theirs == hexes(sorted(names, key=os.fsencode)), pattern
