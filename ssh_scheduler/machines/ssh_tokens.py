"""The small value languages of ``ssh_config``, written to give what OpenSSH 9.2 gives.

Each function mirrors one OpenSSH helper (named in its docstring) so that a value means the same
here as in ``ssh``: ``~`` and ``%``/``${}`` expansion, ports (numbers or service names), time
values, and ``ProxyJump`` hops.  Errors raise :class:`ValueError` with a short reason; the
caller adds the file, line and keyword.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import pwd
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "JumpHop",
    "LocalAccount",
    "a2port",
    "convtime",
    "current_account",
    "is_address",
    "parse_jump",
    "percent_dollar_expand",
    "tilde_expand",
]


@dataclass(frozen=True, slots=True)
class LocalAccount:
    """The local account ``ssh`` runs as: it takes these from the password database, never from
    ``$USER``/``$HOME`` (after ``su`` or ``sudo -E`` those name somebody else)."""

    user: str
    home: str
    uid: int
    hostname: str
    """The local host name, for ``%l``/``%L``/``%C``."""


def current_account() -> LocalAccount:
    entry = pwd.getpwuid(os.getuid())
    return LocalAccount(entry.pw_name, entry.pw_dir, entry.pw_uid, socket.gethostname())


def tilde_expand(path: str, account: LocalAccount) -> str:
    """``tilde_expand_filename``: ``~`` and ``~/x`` use the account's home, ``~user/x`` that
    user's home from the password database."""
    if not path.startswith("~"):
        return path
    name, slash, rest = path[1:].partition("/")
    if not name or name == account.user:
        home = account.home
    else:
        try:
            home = pwd.getpwnam(name).pw_dir
        except KeyError:
            raise ValueError(f"no such user {name!r} for '~{name}'") from None
    if not slash:
        return home
    return home.rstrip("/") + "/" + rest


def connection_tokens(
    account: LocalAccount,
    *,
    host: str,
    original_host: str,
    port: int,
    user: str,
    key_alias: str | None,
) -> dict[str, str]:
    """``DEFAULT_CLIENT_PERCENT_EXPAND_ARGS`` of OpenSSH 9.2 (no ``%j`` yet)."""
    thishost = account.hostname
    conn_hash = hashlib.sha1(f"{thishost}{host}{port}{user}".encode()).hexdigest()
    return {
        "C": conn_hash,
        "L": thishost.split(".", 1)[0],
        "i": str(account.uid),
        "k": key_alias if key_alias is not None else original_host,
        "l": thishost,
        "n": original_host,
        "p": str(port),
        "d": account.home,
        "h": host,
        "r": user,
        "u": account.user,
    }


def percent_dollar_expand(
    text: str, tokens: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> str:
    """``percent_dollar_expand`` (or ``percent_expand`` when ``environ`` is None): ``%x`` from
    ``tokens``, ``%%``, and ``${NAME}`` from the environment, in one pass."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if environ is not None and text.startswith("${", i):
            end = text.find("}", i + 2)
            if end == -1:
                raise ValueError("'${' without '}'")
            name = text[i + 2 : end]
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"invalid environment variable name ${{{name}}}")
            if environ.get(name) is None:
                raise ValueError(f"environment variable ${{{name}}} is not set")
            out.append(environ[name])
            i = end + 1
        elif ch == "%":
            if i + 1 >= len(text):
                raise ValueError("a lone '%' at the end (write '%%' for a percent sign)")
            key = text[i + 1]
            if key == "%":
                out.append("%")
            elif key in tokens:
                out.append(tokens[key])
            else:
                allowed = " ".join("%" + k for k in sorted(tokens))
                raise ValueError(f"unknown token '%{key}' (known here: {allowed} %%)")
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


_NUMBER = re.compile(r"[ \t]*[+-]?[0-9]+")


def a2port(text: str) -> int:
    """``a2port``: a number from 0 to 65535 or a TCP service name; -1 when neither."""
    if _NUMBER.fullmatch(text):
        value = int(text)
        return value if 0 <= value <= 65535 else -1
    try:
        return socket.getservbyname(text, "tcp")
    except (OSError, UnicodeError):
        return -1


_TIME_PART = re.compile(r"([0-9]+)([sSmMhHdDwW]?)")
_TIME_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def convtime(text: str) -> int:
    """``convtime``: ``90``, ``1m30s``, ``2h``... in seconds; -1 when malformed."""
    if not text:
        return -1
    total = 0
    pos = 0
    while pos < len(text):
        m = _TIME_PART.match(text, pos)
        if m is None:
            return -1
        total += int(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
        if total > 2**31 - 1:
            return -1
        pos = m.end()
    return total


def is_address(host: str) -> bool:
    """An IPv4/IPv6 literal, which ``ssh`` leaves as written instead of lower-casing it."""
    try:
        ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class JumpHop:
    user: str | None
    host: str
    port: int | None
    text: str
    """The hop as written (for messages)."""


def _host_and_port(text: str) -> tuple[str, int | None]:
    """``hpdelim`` + ``cleanhostname`` + ``a2port``."""
    if text.startswith("["):
        close = text.find("]")
        if close == -1:
            raise ValueError("'[' without ']'")
        host, tail = text[1:close], text[close + 1 :]
        if tail and tail[0] not in ":/":
            raise ValueError(f"unexpected {tail!r} after ']'")
        rest = tail[1:] if tail else None
    else:
        cut = min((i for i in (text.find(":"), text.find("/")) if i != -1), default=-1)
        host, rest = (text, None) if cut == -1 else (text[:cut], text[cut + 1 :])
    if not host:
        raise ValueError("no host")
    if not rest:  # "jump:" is the host without a port, as in ssh
        return host, None
    port = a2port(rest)
    if port <= 0:
        raise ValueError(f"bad port {rest!r}")
    return host, port


def _parse_hop(text: str) -> JumpHop:
    """``parse_ssh_uri`` then ``parse_user_host_port``."""
    body = text
    if text[:6].lower() == "ssh://":
        body = text[6:]
        if body.endswith("/"):
            body = body[:-1]
        if "/" in body:
            raise ValueError("an ssh:// address has no path")
        user, at, hostport = body.rpartition("@")
        if at and (not user or ";" in user):
            raise ValueError("bad user in the ssh:// address")
        host, port = _host_and_port(hostport)
        return JumpHop(user if at else None, host, port, text)
    user, at, hostport = body.rpartition("@")
    host, port = _host_and_port(hostport)
    return JumpHop(user if at else None, host, port, text)


def parse_jump(text: str) -> tuple[JumpHop, ...]:
    """``parse_jump``: ``none`` -> ``()``; else comma-separated ``[user@]host[:port]`` or
    ``ssh://[user@]host[:port]`` hops, first hop first.  A ``#`` starts a comment."""
    if text.lower() == "none":  # before the comment is cut: "none # x" is a host "none"
        return ()
    value = text.split("#", 1)[0].rstrip()
    hops = []
    for part in value.split(","):
        try:
            hops.append(_parse_hop(part))
        except ValueError as err:
            raise ValueError(f"hop {part!r}: {err}") from None
    return tuple(hops)


def environment() -> Mapping[str, str]:
    return os.environ
