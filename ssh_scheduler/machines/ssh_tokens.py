"""The small value languages of ``ssh_config``, written to give what OpenSSH 9.2 gives.

Each function mirrors one OpenSSH helper (named in its docstring) so that a value means the same
here as in ``ssh``: ``~`` and ``%``/``${}`` expansion, ports (numbers or service names), time
values, ASCII-only case folding and the address forms ``ssh`` rewrites (``ProxyJump`` hops are
:mod:`ssh_scheduler.machines.ssh_jump`).  Errors raise :class:`ValueError` with a short reason; the
caller adds the file, line and keyword.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import socket
import string
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LocalAccount",
    "a2port",
    "ascii_lower",
    "canonical_host",
    "connection_tokens",
    "convtime",
    "current_account",
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


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def ascii_lower(text: str) -> str:
    """``lowercase``/``strcasecmp`` as ssh runs them (C's ``tolower``): A-Z only, so ``Ä`` and
    the Kelvin sign stay as they are, where ``str.lower`` would fold them."""
    return text.translate(_ASCII_LOWER)


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


_NUMBER = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")
"""What ``strtonum`` takes: ``strtoll``'s leading white space and sign, then decimal digits."""


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


_ADDRESS_FAMILIES = {"inet": socket.AF_INET, "inet6": socket.AF_INET6}


def _numeric_address(name: str, family: int) -> str | None:
    """``resolve_addr``: ``name`` as ``getnameinfo(NI_NUMERICHOST)`` writes it when
    ``getaddrinfo(AI_NUMERICHOST)`` reads it as exactly one address, else None.  The C library
    decides, as in ssh: ``10.1`` is 10.0.0.1, ``010`` is octal, ``fe80::1%1`` names lo."""
    try:
        # bytes, so that Python does not IDNA-encode the name on the way
        infos = socket.getaddrinfo(
            name.encode("utf-8", "surrogateescape"),
            "22",
            family,
            socket.SOCK_STREAM,
            0,
            socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
        )
        if len(infos) != 1:
            return None
        address, _ = socket.getnameinfo(
            infos[0][4], socket.NI_NUMERICHOST | socket.NI_NUMERICSERV
        )
    except (OSError, UnicodeError, ValueError):
        return None
    return address


def canonical_host(host: str, address_family: str | None) -> str:
    """The host name ``ssh`` connects to and shows after ``HostName`` (``ssh.c`` main):
    names are lower-cased (ASCII only, as C's ``tolower``); what ``is_addr`` takes for an
    address is kept as written, or rewritten the way ``resolve_canonicalize`` writes it
    (``2001:db8:0:0:0:0:0:1`` -> ``2001:db8::1``, ``192.168.001.010`` -> ``192.168.1.8``)
    unless that differs only in case.  ``address_family`` is the ``AddressFamily`` value."""
    family = _ADDRESS_FAMILIES.get(ascii_lower(address_family or ""), socket.AF_UNSPEC)
    # is_addr_fast: anything with '%' or ':', or only digits and dots, counts as an address
    looks_numeric = "%" in host or ":" in host or not host.strip("0123456789.")
    numeric = _numeric_address(host, family)
    if not looks_numeric and numeric is None:
        return ascii_lower(host)
    if numeric is not None and ascii_lower(numeric) != ascii_lower(host):
        return numeric
    return host


def environment() -> Mapping[str, str]:
    return os.environ
