"""A Python of another minor version than the suite's, for the claim that a call pickled here
as code is refused there before anything is unpickled.

Preferably a real one (``pyenv``'s, or a Debian ``python3.X``): its bytecode really differs, so
the tests can also show that without the check the call fails deep inside pickle.  Where none is
installed, the fallback is this Python told to report another version (``sys.version_info``
replaced before the runner starts): that exercises the check alone, and the tests say so.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.cluster import Host

FAKE = Path(__file__).with_name("fake_version.py")
"""The fallback: a Python that reports another minor version, then runs the script it is given."""


@dataclass(frozen=True)
class OtherPython:
    command: Path
    """What runs it: the interpreter, or a wrapper around it."""
    minor: int
    real: bool
    """Really another version (its bytecode differs), not one told to say so."""


def _minor(python: str) -> int | None:
    try:
        done = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except OSError:
        return None
    major, _, minor = done.stdout.strip().partition(" ")
    return int(minor) if done.returncode == 0 and major == "3" and minor.isdigit() else None


def find_other_python() -> tuple[Path, int] | None:
    """An installed python3 of another minor version (3.8 or newer, which cloudpickle needs),
    the nearest to ours first."""
    here = sys.version_info[1]
    found = []
    for candidate in sorted(
        {*glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3.*")), *glob.glob("/usr/bin/python3.*")}
    ):
        if candidate.endswith("-config") or not os.access(candidate, os.X_OK):
            continue
        minor = _minor(candidate)
        if minor is not None and minor != here and minor >= 8:
            found.append((abs(minor - here), -minor, Path(candidate), minor))
    if not found:
        return None
    _, _, path, minor = min(found)
    return path, minor


def other_python(folder: Path, base: str = sys.executable) -> OtherPython:
    """A Python of another minor version, runnable by anyone who can read ``folder`` (made
    there: a copy of the real one's installation with a wrapper that finds its library, or the
    fallback around ``base``).  ``folder`` must not exist yet."""
    folder.mkdir(parents=True)
    found = find_other_python()
    wrapper = folder / "bin" / "python3"
    wrapper.parent.mkdir()
    if found is None:
        minor = (_minor(base) or sys.version_info[1]) + 1
        shutil.copy(FAKE, folder / FAKE.name)
        wrapper.write_text(f'#!/bin/sh\nexec {base} {folder / FAKE.name} {minor} "$@"\n')
        wrapper.chmod(0o755)
        return OtherPython(wrapper, minor, real=False)
    python, minor = found
    prefix = python.resolve().parent.parent
    if prefix == Path("/usr"):  # a system Python: anyone may run it where it is
        wrapper.write_text(f'#!/bin/sh\nexec {python} "$@"\n')
    else:  # pyenv's, in a home others cannot enter: a copy (hard links) of what it needs
        skip = shutil.ignore_patterns("test", "tests", "site-packages", "idlelib", "tkinter", "turtledemo", "__pycache__", "*.a")

        def link(source: str, target: str) -> None:
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)

        shutil.copytree(prefix / "lib", folder / "lib", ignore=skip, copy_function=link)
        link(str(python.resolve()), str(folder / "bin" / "python"))
        wrapper.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH={folder / "lib"} exec {folder / "bin" / "python"} "$@"\n')
    wrapper.chmod(0o755)
    return OtherPython(wrapper, minor, real=True)


def other_python_on(host: Host) -> OtherPython:
    """:func:`other_python` in ``host``'s home, where its login user runs it (the files stay
    root's, readable by all: hard links share their owner with the originals)."""
    return other_python(host.home / "otherpy", base="/usr/bin/python3")
