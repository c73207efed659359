"""``ProxyJump`` values (and ``-J``, and machine YAML ``proxy_jump``) read as OpenSSH 9.2 reads
them: ``parse_jump`` of ``readconf.c`` with ``parse_ssh_uri``, ``parse_user_host_port``,
``hpdelim2``, ``urldecode`` and ``valid_domain`` of ``misc.c``, as Debian ships them (with the
2026 fix that takes the earlier hops from the trimmed value).

Two forms per hop: ``[user@]host[:port]`` (the user up to the *last* ``@``, an IPv6 address in
brackets, no further check of the host) and ``ssh://[user[;params]@]host[:port][/]`` (the
scheme in lower case only, the user up to the *first* ``@``, ``%XX`` and ``+`` decoded in it;
the host a domain name or IPv4 address: letters, digits, ``-``, ``_`` and single dots, one
trailing dot dropped; no path).  Errors raise :class:`ValueError` with a short reason; the caller
adds the file, line and keyword.
"""

from __future__ import annotations

from dataclasses import dataclass

from ssh_scheduler.machines.ssh_tokens import a2port, ascii_lower

__all__ = ["JumpHop", "jump_text", "parse_jump", "trim_jump"]

_C_SPACE = " \t\n\v\f\r"
"""C's ``isspace`` in the C locale."""
_HEX = "0123456789abcdefABCDEF"


@dataclass(frozen=True, slots=True)
class JumpHop:
    user: str | None
    host: str
    port: int | None
    text: str
    """The hop as written (for messages, and ``-J`` for the hops before it)."""


def _hpdelim2(text: str) -> tuple[str, str, str | None]:
    """``hpdelim2``: (host field, the delimiter after it, the rest or None at the end)."""
    if text.startswith("["):
        close = text.find("]")
        if close == -1:
            raise ValueError("'[' without ']'")
        cut = close + 1
    else:
        cut = min((i for i in (text.find(":"), text.find("/")) if i != -1), default=len(text))
    if cut == len(text):
        return text, "", None
    if text[cut] not in ":/":
        raise ValueError(f"unexpected {text[cut:]!r} after ']'")
    return text[:cut], text[cut], text[cut + 1 :]


def _cleanhostname(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _urldecode(text: str) -> str:
    """``urldecode``: ``+`` is a space, ``%XX`` a byte, ``%00`` refused (ssh 9.2 as Debian
    ships it refuses it: a NUL would end the C string there)."""
    out = bytearray()
    i = 0
    raw = text.encode("utf-8", "surrogateescape")
    while i < len(raw):
        ch = raw[i]
        if ch == ord("+"):
            out.append(ord(" "))
        elif ch == ord("%"):
            pair = raw[i + 1 : i + 3].decode("ascii", "replace")
            if len(pair) != 2 or any(c not in _HEX for c in pair):
                raise ValueError(f"bad %-escape in {text!r}")
            if pair == "00":
                raise ValueError(f"a NUL byte (%00) in {text!r}")
            out.append(int(pair, 16))
            i += 2
        else:
            out.append(ch)
        i += 1
    return bytes(out).decode("utf-8", "surrogateescape")


def _valid_domain(host: str) -> str:
    """``valid_domain``: the host without its one trailing dot; ValueError when not a name."""
    if not host:
        raise ValueError("no host")
    if not (host[0].isascii() and host[0].isalnum()):
        raise ValueError(f"host {host!r} does not start with a letter or digit")
    if ".." in host:
        raise ValueError(f"host {host!r} has two dots in a row")
    if any(not (ch.isascii() and (ch.isalnum() or ch in ".-_")) for ch in host):
        raise ValueError(f"host {host!r} has characters other than letters, digits, '.-_'")
    return host[:-1] if host.endswith(".") else host


def _parse_ssh_uri(text: str) -> JumpHop | None:
    """``parse_ssh_uri``; None when ``text`` is not an ``ssh://`` address (case matters)."""
    if not text.startswith("ssh://"):
        return None
    rest = text[6:]
    user = None
    at = rest.find("@")
    if at != -1:
        info = rest[:at].split(";", 1)[0]  # ";fingerprint=..." parameters are ignored
        if not info:
            raise ValueError("empty user name in the ssh:// address")
        user = _urldecode(info)
        rest = rest[at + 1 :]
    field, delim, tail = _hpdelim2(rest)
    if not field:
        raise ValueError("no host")
    host = _valid_domain(_cleanhostname(field))
    port = None
    if tail and delim == ":":
        port_text, slash, after = tail.partition("/")
        port = a2port(port_text)
        if port <= 0:
            raise ValueError(f"bad port {port_text!r}")
        tail = after if slash else None
    if tail:
        raise ValueError("an ssh:// address has no path")
    return JumpHop(user, host, port, text)


def _parse_user_host_port(text: str) -> JumpHop:
    user, at, hostport = text.rpartition("@")
    if at and not user:
        raise ValueError("empty user name before '@'")
    field, delim, tail = _hpdelim2(hostport)
    if delim == "/":
        raise ValueError("'/' after the host (write host:port)")
    if not field:
        raise ValueError("no host")
    port = None
    if tail:  # "jump:" is the host without a port, as in ssh
        port = a2port(tail)
        if port <= 0:
            raise ValueError(f"bad port {tail!r}")
    return JumpHop(user if at else None, _cleanhostname(field), port, text)


def trim_jump(text: str) -> str:
    """What ``parse_jump`` reads of a value: up to a ``#``, then cut by ``rtrim``, which (in
    this version) ends the value at its first white space after the first character."""
    value = text.split("#", 1)[0]
    cut = next((i for i, ch in enumerate(value) if i and ch in _C_SPACE), len(value))
    return value[:cut]


def parse_jump(text: str) -> tuple[JumpHop, ...]:
    """``parse_jump``: ``none`` (the whole value, any case) -> ``()``; else comma-separated
    hops, first hop first.  Every hop is checked, the last one first, as ssh does."""
    if ascii_lower(text) == "none":  # before the comment is cut: "none # x" is a host "none"
        return ()
    parts = trim_jump(text).split(",")
    hops: list[JumpHop] = []
    for part in reversed(parts):
        try:
            hop = _parse_ssh_uri(part)
            hops.append(hop if hop is not None else _parse_user_host_port(part))
        except ValueError as err:
            raise ValueError(f"hop {part!r}: {err}") from None
    return tuple(reversed(hops))


def jump_text(value: str, last: JumpHop) -> str:
    """ProxyJump as ``ssh -G`` shows it: the earlier hops as written, the last one rebuilt
    (a host of only digits and dots, or with a ``:``, in brackets)."""
    extra = trim_jump(value).rpartition(",")[0]
    numeric = ":" in last.host or not last.host.strip("0123456789.")
    text = (f"{last.user}@" if last.user is not None else "") + (
        f"[{last.host}]" if numeric else last.host
    )
    if last.port is not None:
        text += f":{last.port}"
    return f"{extra},{text}" if extra else text
