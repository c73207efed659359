"""Which files an ssh config ``Include`` reads, and which config files ssh trusts.

``Include`` hands its pattern to ``glob(GLOB_TILDE)``, OpenSSH's bundled OpenBSD one
(machines/ssh_glob.py), not Python's: a leading ``~`` is ``$HOME`` (the password database only
when ``$HOME`` is unset or empty, which differs under ``sudo`` without ``-H``), ``~user`` that
user's home (left as written for an unknown user); ``*``, ``?`` and ``[...]`` match within one path component, never
a leading dot; a backslash makes the next character literal (``x\\*.conf`` is the file named
``x*.conf``); the names come sorted by their bytes.

The trust check is ``secure_permissions`` as Debian's OpenSSH patches it ("Allow harmless
group-writability"): the file belongs to root or to us, nobody else may write it, and its group
may write it only when that group holds us alone (the private group of Debian and Ubuntu, where
the default umask leaves files group-writable).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
from collections.abc import Mapping

from ssh_scheduler.machines.ssh_glob import UnendedSet, compile_component, matches

__all__ = ["glob_home", "include_glob", "secure_permissions"]


def glob_home(environ: Mapping[str, str]) -> str | None:
    """The directory glibc's ``GLOB_TILDE`` puts for ``~``: ``$HOME``, else the home of the
    login name; None when neither is known (``~`` then stays as written)."""
    home = environ.get("HOME")
    if home:
        return home
    try:
        return pwd.getpwnam(os.getlogin()).pw_dir or None
    except (OSError, KeyError):
        return None


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text, flags=re.DOTALL)


def _expand_tilde(pattern: str, home: str | None) -> str:
    """``GLOB_TILDE`` on the directory part (all of it when there is no ``/``)."""
    if not pattern.startswith("~"):
        return pattern
    slash = pattern.find("/")
    name, rest = (pattern[1:], "") if slash == -1 else (pattern[1:slash], pattern[slash:])
    if name in ("", "\\"):
        return pattern if home is None else home + rest
    try:
        return pwd.getpwnam(_unescape(name)).pw_dir + rest
    except (KeyError, ValueError, UnicodeError):
        return pattern


def _entries(directory: str) -> list[str]:
    try:
        with os.scandir(directory or ".") as it:
            # readdir lists '.' and '..' too ('.*' matches them in ssh's glob)
            return [".", "..", *(entry.name for entry in it)]
    except OSError:
        return []


def include_glob(pattern: str, home: str | None) -> list[str]:
    """The paths ``glob(pattern, GLOB_TILDE)`` returns, sorted by bytes; ``[]`` for none."""
    pattern = _expand_tilde(pattern, home)
    if "/" not in pattern:  # "~" or "~user" alone: that directory, if it is one
        return [pattern] if pattern != "~" and os.path.isdir(pattern) else []
    parts = pattern.split("/")
    found = [""]  # relative: from the working directory, as glob(3)
    if not parts[0]:
        found, parts = ["/"], parts[1:]
    try:
        components = [compile_component(part) for part in parts]
    except UnendedSet:  # a set with a '/' in it (the last component's is refused when read)
        return []
    if None in components:  # an unknown [:class:]: the pattern matches nothing
        return []
    for index, (part, component) in enumerate(zip(parts, components, strict=True)):
        assert component is not None
        last = index == len(parts) - 1 or component.last
        nxt: list[str] = []
        for base in found:
            prefix = base if base in ("", "/") else base + "/"
            if not part:  # "a//b" or a trailing '/': the directory itself
                if os.path.isdir(base or "."):
                    nxt.append(base)
                continue
            if component.literal is not None:  # no wildcard: that name, if it is there
                path = prefix + component.literal
                if os.path.lexists(path) if last else os.path.isdir(path):
                    nxt.append(path)
                continue
            for name in _entries(base):
                path = prefix + name
                if matches(component, name) and (last or os.path.isdir(path)):
                    nxt.append(path)
        found = nxt
        if component.last:  # the pattern ends here (ssh_glob.Component.last)
            break
    return sorted(found, key=lambda p: p.encode("utf-8", "surrogateescape"))


def secure_permissions(info: os.stat_result, uid: int) -> bool:
    """Debian's ``secure_permissions``: owned by root or ``uid``, not world-writable, and
    group-writable only when the group's one member is the owner (as its primary group, or
    as the only listed member; a group nobody is in does not count)."""
    if info.st_uid not in (0, uid) or info.st_mode & 0o002:
        return False
    if not info.st_mode & 0o020:
        return True
    try:
        group = grp.getgrgid(info.st_gid)
    except KeyError:
        return False
    members = 0
    for entry in pwd.getpwall():
        if entry.pw_gid == group.gr_gid:
            members += 1
            if entry.pw_uid != uid:
                return False
    try:
        owner = pwd.getpwuid(info.st_uid)
    except KeyError:
        return False
    if group.gr_mem:
        members += 1
        if group.gr_mem[0] != owner.pw_name or len(group.gr_mem) > 1:
            return False
    return members > 0
