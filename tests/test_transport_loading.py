"""asyncssh is imported with its native-library lookup answered the dynamic loader's way
(transport/loading.py): the same answers as ctypes.util.find_library, nothing compiled."""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.transport.loading import loadable_library
from tests.cluster import skip_or_fail


@pytest.mark.parametrize("name", ["c", "m", "z", "ssl", "crypto", "oqs", "liboqs", "no_such_library_here"])
def test_the_loaders_answer_is_find_librarys(name: str) -> None:
    assert loadable_library(name) == ctypes.util.find_library(name)


def test_a_library_on_ld_library_path_is_found_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "libsshs_probe.so.3").write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/nonexistent::{tmp_path}")
    assert loadable_library("sshs_probe") == "libsshs_probe.so.3"


IMPORT_ASYNCSSH = (
    "import ctypes.util; before = ctypes.util.find_library\n"
    "from ssh_scheduler.transport.loading import import_asyncssh; import_asyncssh()\n"
    "import sys; assert 'asyncssh' in sys.modules\n"
    "assert ctypes.util.find_library is before\n"
)


def test_importing_asyncssh_restores_find_library() -> None:
    done = subprocess.run([sys.executable, "-c", IMPORT_ASYNCSSH], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_importing_asyncssh_runs_no_compiler() -> None:
    """In a fresh interpreter under strace: no gcc, collect2 or ld.  Without strace the check
    cannot run: it skips (a failure under CI, and once scripts/test installed strace)."""
    strace = shutil.which("strace")
    if strace is None:
        skip_or_fail("strace is not installed (scripts/test installs it)")
    done = subprocess.run(
        [strace, "-f", "-qq", "-e", "trace=execve", sys.executable, "-c", IMPORT_ASYNCSSH],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    started = [line for line in done.stderr.splitlines() if "execve(" in line]
    assert started  # strace saw the interpreter itself: the check below is real
    assert not [line for line in started if any(tool in line for tool in ("gcc", "collect2", "/ld\"", "\"ld\""))]


def test_asyncssh_is_imported_without_x509_certificates() -> None:
    """OpenSSH has no X.509 certificates (RFC 6187), so neither do our connections: their
    support (cryptography's x509, 12 ms of a connecting process's start) is never loaded."""
    check = IMPORT_ASYNCSSH + (
        "assert 'cryptography.x509' not in sys.modules\n"
        "import asyncssh.public_key\n"
        "assert not any(alg.startswith(b'x509v3-') for alg in asyncssh.public_key.get_public_key_algs())\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
