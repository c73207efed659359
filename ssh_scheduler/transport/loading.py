"""Importing asyncssh without its slowest step: the search for liboqs.

``asyncssh.crypto.pq`` looks for liboqs (the sntrup761 key exchange) with
``ctypes.util.find_library``, which on Linux, when the dynamic loader's cache has no liboqs,
links a probe program with gcc and runs ld -- for 'oqs' and again for 'liboqs': five processes
and ~20 ms of CPU at every start on a machine with a compiler, before the first connection.
What ``ctypes`` then loads, the dynamic loader finds only through ``LD_LIBRARY_PATH``, its
cache (ldconfig) and its default folders; :func:`import_asyncssh` answers asyncssh's question
from exactly those, so liboqs is found wherever it could be loaded from.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import sys

# The loader's own folders, searched after LD_LIBRARY_PATH and its cache (ld.so(8)).
_DEFAULT_FOLDERS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib")


def import_asyncssh() -> None:
    """Import asyncssh once, looking up its optional native libraries the loader's way, and
    without its X.509 certificates (RFC 6187; ``x509v3-*`` keys).  OpenSSH, whose configuration
    and keys we follow (``ssh -G``), has none; loading cryptography's X.509 support for them was
    12 ms of every connecting process's start (the hub's, on a cold command's path)."""
    if "asyncssh" in sys.modules:
        return
    sys.modules.setdefault("asyncssh.crypto.x509", None)  # type: ignore[arg-type]  # (None: ImportError, which asyncssh treats as absent)
    by_cache = getattr(ctypes.util, "_findSoname_ldconfig", None)
    if sys.platform != "linux" or by_cache is None:
        import asyncssh  # elsewhere find_library is cheap, or its own

        return
    original = ctypes.util.find_library
    ctypes.util.find_library = lambda name: loadable_library(name, by_cache)
    try:
        import asyncssh  # noqa: F401
    finally:
        ctypes.util.find_library = original


def loadable_library(name: str, by_cache: object = None) -> str | None:
    """The file name ``ctypes.CDLL`` can load for ``lib<name>``, or None: what
    ``ctypes.util.find_library`` answers, without compiling anything."""
    lookup = by_cache or getattr(ctypes.util, "_findSoname_ldconfig", None)
    for folder in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if folder and (found := _in_folder(folder, name)):
            return found
    cached = lookup(name) if callable(lookup) else None
    if isinstance(cached, str):
        return cached
    for folder in _DEFAULT_FOLDERS:
        if found := _in_folder(folder, name):
            return found
    return None


def _in_folder(folder: str, name: str) -> str | None:
    found = sorted(glob.glob(os.path.join(glob.escape(folder), f"lib{glob.escape(name)}.so*")))
    return os.path.basename(found[0]) if found else None
