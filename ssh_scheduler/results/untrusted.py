"""A results folder's files read as untrusted input: ``status``, ``jobs``, ``attach`` and
``results`` may be pointed at a folder someone else wrote (a copy, a shared disk).

Whatever stands at a file's name, reading it can neither hang nor exhaust memory nor follow a
link elsewhere: it is opened without following a symbolic link and without blocking (a FIFO in
its place would wait for a writer forever), it must be a regular file, and at most a bound is
read.  JSON from it may nest deeper than Python's recursion limit: :func:`parse_json` makes that
a ``ValueError`` like any other bad JSON.  What is wrong is one :class:`ConfigError` line that
names the file and the fix.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import IO, Any

from ssh_scheduler.errors import ConfigError, plain_text

__all__ = ["open_untrusted", "parse_json", "read_untrusted"]


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def open_untrusted(path: Path, what: str) -> IO[bytes] | None:
    """``path`` open for reading (binary, blocking reads from here on), or None when there is
    nothing there.  ``what`` names the file in the message (``the batch journal``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{plain_text(path)} ({what}) is a symbolic link; ssh_scheduler never writes one there, so "
                "it is not followed: remove it, or use another results folder"
            ) from None
        if exc.errno == errno.ENXIO:  # a socket: open(2) cannot open one
            raise ConfigError(f"{plain_text(path)} ({what}) is a socket, not a file: remove it") from None
        raise ConfigError(f"cannot read {plain_text(path)} ({what}): {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{plain_text(path)} ({what}) is {_kind(mode)}, not a file ssh_scheduler wrote: remove it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_untrusted(path: Path, what: str, limit: int) -> bytes | None:
    """The whole of ``path`` (at most ``limit`` bytes, else one error line), or None when absent."""
    stream = open_untrusted(path, what)
    if stream is None:
        return None
    with stream:
        try:  # the size first: a huge file is refused without reading it
            size = os.fstat(stream.fileno()).st_size
            data = stream.read(limit + 1) if size <= limit else b""
        except OSError as exc:
            raise ConfigError(f"cannot read {plain_text(path)} ({what}): {exc.strerror or exc}") from None
    if size > limit or len(data) > limit:
        raise ConfigError(
            f"{plain_text(path)} ({what}) is larger than {limit} bytes, more than ssh_scheduler writes there: "
            "not read (remove it, or use another results folder)"
        )
    return data


def parse_json(data: bytes | str) -> Any:
    """``json.loads``, with nesting too deep to parse a ``ValueError`` as well."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None
