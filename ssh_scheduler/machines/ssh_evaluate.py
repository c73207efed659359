"""Which lines of the ssh config apply to one host, and the values they give, as ``readconf.c``
of OpenSSH 9.2 decides (the lines themselves come from :mod:`ssh_scheduler.machines.ssh_config`).

Every line is processed in order; ``Host`` and ``Match`` switch the following lines on or off;
the first value obtained for a keyword wins, except ``IdentityFile``/``CertificateFile`` which
accumulate (distinct ones, at most 100).  Patterns match the bytes of the UTF-8 text, as ssh
matches its C strings; ``Host`` patterns are matched case-sensitively against the name as typed;
``Match host``/``originalhost`` lower-case both sides, ``Match user``/``localuser`` do not; all
lower-casing is ASCII only.  Every line is checked whether it applies or not: an unknown keyword
is an error unless it matches ``IgnoreUnknown``, and the keywords used here have their values
checked as ssh does (a missing or empty value, extra values, at most 32 known-hosts files).

A value we use must be UTF-8 text without control characters: ssh would take such bytes as they
are, we refuse them in one line (elsewhere in the file, in comments or in lines that do not
apply, they are left alone, as ssh leaves them).

Refused with one line naming the file, line and keyword, because ``ssh`` would need something we
cannot reproduce exactly: ``Match exec`` (when it would run), ``Match canonical``/``final`` and
``CanonicalizeHostname yes|always`` (DNS canonicalization, a second pass).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ssh_scheduler.errors import ConfigError, show_value
from ssh_scheduler.machines.ssh_config import KEYWORDS, WHITESPACE, ConfigFile, SshLine, strdelim
from ssh_scheduler.machines.ssh_jump import JumpHop, parse_jump, trim_jump
from ssh_scheduler.machines.ssh_tokens import a2port, ascii_lower, convtime, percent_dollar_expand

__all__ = ["Evaluated", "evaluate", "jump_hops", "match_pattern", "match_pattern_list"]

_ALIASES = {"identityfile2": "identityfile"}
_STRINGS = frozenset({"hostname", "user", "hostkeyalias", "ignoreunknown"})
"""``parse_string``: one value, not empty."""
_FILE_LISTS = frozenset({"userknownhostsfile", "globalknownhostsfile"})
_ACCUMULATE = frozenset({"identityfile", "certificatefile"})
_MULTISTATE = {
    "canonicalizehostname": ("yes", "no", "true", "false", "always"),
    "addressfamily": ("any", "inet", "inet6"),
}
_ONE_VALUE = _STRINGS | _ACCUMULATE | {"port", "connecttimeout", "forwardagent"} | set(_MULTISTATE)
_CANONICALIZE_ON = ("yes", "true", "always")
MAX_FILES = 100
"""``SSH_MAX_IDENTITY_FILES`` and ``SSH_MAX_CERTIFICATE_FILES``."""
MAX_HOSTS_FILES = 32
"""``SSH_MAX_HOSTS_FILES``: entries of one ``UserKnownHostsFile``/``GlobalKnownHostsFile``."""
MAX_SUBPATTERN = 1023
"""Bytes of one pattern of a list; a longer one makes ``match_pattern_list`` say no match."""
_CONTROL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_NOT_UTF8_RE = re.compile(r"[\udc80-\udcff]")
"""A byte that was not UTF-8, as ``surrogateescape`` decoding keeps it."""


@functools.lru_cache(maxsize=4096)
def _pattern_regex(pattern: bytes) -> re.Pattern[bytes]:
    parts = [b"(?s)"]
    for byte in pattern:
        char = bytes([byte])
        parts.append(b".*" if char == b"*" else b"." if char == b"?" else re.escape(char))
    return re.compile(b"".join(parts))


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def match_pattern(text: str, pattern: str) -> bool:
    """``match_pattern``: ``*`` and ``?`` only, case-sensitive, over bytes (``?`` is one byte)."""
    return _pattern_regex(_bytes(pattern)).fullmatch(_bytes(text)) is not None


def match_pattern_list(text: str, patterns: str, lower: bool) -> int:
    """``match_pattern_list``: 1 matched, -1 matched a negated pattern, 0 no match (also when a
    pattern is longer than ``MAX_SUBPATTERN`` bytes); ``lower`` folds the patterns (ASCII)."""
    subject, raw = _bytes(text), _bytes(patterns)
    found = 0
    i = 0
    while i < len(raw):
        negated = raw[i : i + 1] == b"!"
        i += negated
        end = raw.find(b",", i)
        end = len(raw) if end == -1 else end
        sub = raw[i:end]
        if len(sub) >= MAX_SUBPATTERN:
            return 0
        i = end + 1
        if _pattern_regex(sub.lower() if lower else sub).fullmatch(subject) is not None:
            if negated:
                return -1
            found = 1
    return found


@dataclass
class Evaluated:
    """The values obtained for one host: keyword -> the line that set it (first wins)."""

    first: dict[str, SshLine] = field(default_factory=dict)
    identity_files: list[SshLine] = field(default_factory=list)
    """Distinct ones, in order (the same text from a user and a system file counts twice)."""
    jump: tuple[str, SshLine] | None = None
    """The ProxyJump value (``none`` included) and its line."""
    proxy_command: tuple[str, SshLine] | None = None
    matched_literal: bool = False
    """A ``Host`` pattern with a literal character, or a ``Match`` other than ``all``, applied."""

    def value(self, keyword: str) -> str | None:
        line = self.first.get(keyword)
        return line.args[0] if line is not None else None


@dataclass
class _State:
    host_arg: str
    local_user: str
    result: Evaluated
    preset_user: str | None
    preset_port: int | None
    ignore_unknown: str | None = None
    seen_files: dict[str, set[tuple[bool, str]]] = field(default_factory=dict)


def _refuse(line: SshLine, what: str) -> ConfigError:
    return ConfigError(f"{line.where}: {what}")


def _current_host(state: _State) -> str:
    hostname = state.result.value("hostname")
    if hostname is None:
        return state.host_arg
    try:
        return percent_dollar_expand(hostname, {"h": state.host_arg})
    except ValueError as err:
        raise _refuse(state.result.first["hostname"], f"HostName: {err}") from None


def _match(line: SshLine, state: _State) -> bool:
    """``match_cfg_line`` for the criteria we can evaluate exactly."""
    rest = line.rest
    result = True
    attributes = 0
    while rest:
        word = strdelim(rest)
        if word is None:
            raise _refuse(line, 'unbalanced " quote in Match (close it)')
        attrib, rest = word
        if not attrib or attrib.startswith("#"):
            break
        negate = attrib.startswith("!")
        name = ascii_lower(attrib[1:] if negate else attrib)
        if name == "all":
            after = strdelim(rest) if rest else None
            if attributes > 1 or (after is not None and after[0] and not after[0].startswith("#")):
                raise _refuse(line, "Match 'all' cannot be combined with other criteria")
            return result and not negate
        attributes += 1
        if name in ("canonical", "final"):
            raise _refuse(
                line,
                f"Match {name} is not supported (it needs ssh's DNS canonicalization and "
                "second pass; use Match host or originalhost)",
            )
        nxt = strdelim(rest) if rest else None
        if nxt is None or not nxt[0] or nxt[0].startswith("#"):
            raise _refuse(line, f"Match {name} needs an argument")
        arg, rest = nxt
        if name == "exec":
            if result:
                raise _refuse(
                    line,
                    "Match exec is not supported (we do not run commands from the ssh config; "
                    "use Match host, originalhost, user or localuser)",
                )
            continue
        if name == "host":  # match_hostname: the host lower-cased, the patterns too
            hit = match_pattern_list(ascii_lower(_current_host(state)), arg, True) == 1
        elif name == "originalhost":
            hit = match_pattern_list(ascii_lower(state.host_arg), arg, True) == 1
        elif name == "user":
            user = state.result.value("user") or state.local_user
            hit = match_pattern_list(user, arg, False) == 1
        elif name == "localuser":
            hit = match_pattern_list(state.local_user, arg, False) == 1
        else:
            raise _refuse(line, f"unsupported Match criterion {show_value(attrib)}")
        if hit == negate:
            result = False
    if attributes == 0:
        raise _refuse(line, "Match needs at least one criterion")
    return result


def _host_line(line: SshLine, host: str) -> tuple[bool, bool]:
    """(active, matched through a pattern with a literal character)."""
    active = literal = False
    for arg in line.args:
        if not arg:
            raise _refuse(line, "Host has an empty pattern")
        negated = arg.startswith("!")
        body = arg[1:] if negated else arg
        if match_pattern(host, body):
            if negated:
                return False, False
            active = True
            literal = literal or bool(body.strip("*?"))
    return active, literal


def _check_values(line: SshLine, keyword: str) -> None:
    """The value checks ssh makes on every line, applied or not, for the keywords we use."""
    args = line.args
    name = line.spelled
    if keyword in _ONE_VALUE and (not args or not args[0]):
        # "User # nobody" and User "" alike: ssh says "Missing argument"
        raise _refuse(
            line,
            f"{name} has no value (ssh refuses this too; give one, and quote a value that "
            "starts with '#')",
        )
    if keyword in _ONE_VALUE and len(args) > 1:
        raise _refuse(
            line,
            f"{keyword} takes one value, got {len(args)} (ssh refuses this too; quote a value "
            "with spaces)",
        )
    if keyword == "port" and a2port(args[0]) <= 0:
        raise _refuse(line, f"Port {show_value(args[0])} is not a port number or service name")
    if keyword in _FILE_LISTS:
        if any(not a for a in args):
            raise _refuse(line, f"{keyword} has an empty argument")
        if any(ascii_lower(a) == "none" for a in args) and len(args) > 1:
            raise _refuse(line, f"{keyword} 'none' must appear alone")
    if keyword == "connecttimeout" and args[0] != "none" and convtime(args[0]) < 0:
        raise _refuse(line, f"ConnectTimeout {show_value(args[0])} is not a time (like 10 or 1m)")
    if keyword in _MULTISTATE and ascii_lower(args[0]) not in _MULTISTATE[keyword]:
        allowed = ", ".join(_MULTISTATE[keyword])
        raise _refuse(line, f"{name} {show_value(args[0])} is not one of {allowed}")
    if keyword == "proxyjump":
        try:
            parse_jump(line.rest.lstrip(WHITESPACE + "="))
        except ValueError as err:
            raise _refuse(
                line,
                f"invalid ProxyJump: {err} (ssh refuses it too; write [user@]host[:port] or "
                "ssh://[user@]host[:port], hops separated by commas)",
            ) from None


def _check_usable(line: SshLine, values: Sequence[str]) -> None:
    """A value we use: UTF-8 text without control characters (ssh would use the bytes)."""
    for value in values:
        if _NOT_UTF8_RE.search(value):
            raise _refuse(
                line,
                f"{line.spelled}: a value with bytes that are not UTF-8 is not supported "
                "(save the file as UTF-8)",
            )
        if _CONTROL_RE.search(value):
            raise _refuse(
                line,
                f"{line.spelled}: a control character in the value is not supported (remove it)",
            )


def _add_file(line: SshLine, keyword: str, state: _State) -> None:
    """``add_identity_file``/``add_certificate_file``: distinct ones only (per user or system
    file), and an error once 100 are there, even for a repeated one."""
    seen = state.seen_files.setdefault(keyword, set())
    if len(seen) >= MAX_FILES:
        raise _refuse(
            line,
            f"more than {MAX_FILES} {line.spelled} lines apply (ssh refuses this too; "
            "remove some)",
        )
    key = (line.user_config, line.args[0])
    if key in seen:
        return
    seen.add(key)
    if keyword == "identityfile":  # certificates are only counted: we do not use them
        _check_usable(line, line.args)
        state.result.identity_files.append(line)


def _unknown_keyword(spelled: str) -> str:
    if spelled.startswith("\ufeff"):
        return (
            f"unknown keyword {show_value(spelled)}: the file starts with a UTF-8 byte order "
            "mark, which ssh refuses too (save the file without it)"
        )
    odd = next((ch for ch in spelled if not ch.isascii()), None)
    if odd is not None:
        return (
            f"unknown keyword {show_value(spelled)}: it has the non-ASCII character "
            f"{show_value(odd)} (U+{ord(odd):04X}), which ssh refuses too (type it in ASCII)"
        )
    return (
        f"unknown keyword {show_value(spelled)} (ssh refuses it too; fix the spelling, or list "
        "it in IgnoreUnknown)"
    )


def _apply(line: SshLine, state: _State, active: bool) -> None:
    keyword = _ALIASES.get(line.keyword, line.keyword)
    if keyword not in KEYWORDS:
        ignored = state.ignore_unknown
        if ignored is not None and match_pattern_list(keyword, ignored, True) == 1:
            return
        raise _refuse(line, _unknown_keyword(line.spelled))
    _check_values(line, keyword)
    if not active:
        return
    result = state.result
    if keyword == "ignoreunknown" and state.ignore_unknown is None:
        state.ignore_unknown = line.args[0]
    if keyword in _ACCUMULATE:
        _add_file(line, keyword, state)
        return
    if keyword == "proxyjump":
        value = line.rest.lstrip(WHITESPACE + "=")
        if result.proxy_command is None and result.jump is None:
            _check_usable(line, [trim_jump(value)])
            result.jump = (value, line)
        return
    if keyword == "proxycommand":
        jump_real = result.jump is not None and ascii_lower(result.jump[0]) != "none"
        if result.proxy_command is None and not jump_real:
            value = line.rest.lstrip(WHITESPACE + "=")
            _check_usable(line, [value])
            result.proxy_command = (value, line)
        return
    if keyword == "user" and state.preset_user is not None:
        return
    if keyword == "port" and state.preset_port is not None:
        return
    if keyword in _FILE_LISTS:
        if not line.args or keyword in result.first:
            return  # "UserKnownHostsFile # later" sets nothing
        if len(line.args) > MAX_HOSTS_FILES:
            raise _refuse(
                line,
                f"{line.spelled} names {len(line.args)} files, more than ssh's limit of "
                f"{MAX_HOSTS_FILES} (ssh refuses this too; remove some)",
            )
    if keyword not in result.first:
        _check_usable(line, line.args)
        result.first[keyword] = line


def _walk(config: ConfigFile, state: _State, active: list[bool], never: bool) -> None:
    for line in config.lines:
        if line.keyword == "host":
            hit, literal = _host_line(line, state.host_arg)
            active[0] = hit and not never
            state.result.matched_literal |= active[0] and literal
        elif line.keyword == "match":
            hit = _match(line, state)
            active[0] = hit and not never
            state.result.matched_literal |= active[0] and [
                ascii_lower(a) for a in line.args
            ] != ["all"]
        elif line.keyword == "include":
            outer = active[0]
            for sub in line.includes:
                _walk(sub, state, active, never or not outer)
                active[0] = outer
        else:
            _apply(line, state, active[0])


def evaluate(
    host_arg: str,
    configs: Sequence[ConfigFile],
    *,
    local_user: str,
    preset_user: str | None = None,
    preset_port: int | None = None,
    preset_jump: str | None = None,
) -> Evaluated:
    """Process the config files for ``host_arg`` as ``ssh [-l user] [-p port] [-J jump] host``.

    A preset user/port/jump (from the command line in ssh) wins over the files, as in ssh.
    """
    result = Evaluated()
    state = _State(host_arg, local_user, result, preset_user, preset_port)
    if preset_user is not None:
        result.first["user"] = SshLine("user", (preset_user,), preset_user, "command line", 0)
    if preset_port is not None:
        text = str(preset_port)
        result.first["port"] = SshLine("port", (text,), text, "command line", 0)
    if preset_jump is not None:
        result.jump = (preset_jump, SshLine("proxyjump", (preset_jump,), preset_jump, "-J", 0))
    for config in configs:
        _walk(config, state, [True], False)
    line = result.first.get("canonicalizehostname")
    if line is not None and ascii_lower(line.args[0]) in _CANONICALIZE_ON:
        raise _refuse(
            line,
            "CanonicalizeHostname is not supported (it rewrites host names through DNS; write "
            "the full name in HostName instead)",
        )
    return result


def jump_hops(evaluated: Evaluated) -> tuple[tuple[JumpHop, ...], SshLine | None]:
    if evaluated.jump is None:
        return (), None
    value, line = evaluated.jump
    return parse_jump(value), line
