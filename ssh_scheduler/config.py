"""Machine definitions: machine YAML files, ``~/.ssh/config`` aliases and ``user@host`` specs.

Everything here turns into a frozen :class:`Machine`.  Every problem a user can cause raises
:class:`~ssh_scheduler.errors.ConfigError` whose message is one line naming the file (and line
when known), what is wrong and how to fix it.

Machine YAML (ancestor-compatible keys ``username``, ``ip``, ``port``, ``ssh_key_path``; ours,
optional: ``name``, ``workdir``, ``known_hosts``, ``max_sessions``, ``connect_timeout``,
``forward_agent``, ``proxy_jump``)::

    username: ben       # optional: default = the local user name, as OpenSSH does
    ip: 105.29.123.241  # required: host name, IPv4 or IPv6 address
    port: 22            # optional, default 22
    ssh_key_path: ~/.ssh/id_ssh_key   # optional; a string or a list; default = agent/default keys

Choices made here:

* Only ``ip`` is required.  A key given with an empty value (``port:``) means its default.
* ``ssh_key_path`` and ``known_hosts`` entries are *local* paths: ``~`` is expanded and a
  relative path is taken relative to the directory of the YAML file (not the current directory),
  then made absolute.  ``workdir`` is a *remote* path and is kept as written (``~`` included).
* YAML is read with the safe loader only; tags such as ``!!python/object`` are refused.  Unknown
  keys, repeated keys and values of the wrong type are errors (typos must not pass silently).

Spec lookup (:func:`load_machine`), first hit wins:

1. ``spec`` is a file (``~`` expanded); 2. ``spec + ".yaml"`` is a file;
3. ``<dir>/spec`` then ``<dir>/spec.yaml`` for each search dir (default ``~/.local/var``);
4. ``spec`` is a ``Host`` in ``~/.ssh/config`` matched by a pattern that has at least one literal
   character (``gpu1``, ``gpu*``, ``*.lan``); a match through all-wildcard patterns only
   (``Host *``) does not count, so a typo is an error rather than a connection attempt to a
   random name.  All matching blocks, ``Host *`` included, then apply (first value wins);
5. ``user@host``, ``user@host:port``, ``user@[v6addr]:port``: used as a plain host, with the
   ssh config for ``host`` applied (wildcards included, as ``ssh user@host`` would) and the
   user/port of the spec taking precedence.

A bare name found nowhere is an error whose message suggests ``user@name``.

``~/.ssh/config`` support: ``Host`` patterns with ``*``, ``?`` and ``!`` negation
(case-insensitive), first obtained value wins, keywords case-insensitive, ``Key value`` and
``Key=value``, quoted arguments, ``Include`` (globs; relative paths relative to the config file's
directory; nested up to 16 deep).  ``Match`` blocks are not evaluated: ``Match all`` applies to
every host, any other ``Match`` block is skipped.  Used keywords: HostName (``%h``, ``%%``), User,
Port, IdentityFile (several; ``~`` and ``%d %h %n %p %r %u %%``), ProxyJump, ProxyCommand
(only ``none``; anything else is an error since we cannot run it), UserKnownHostsFile,
ForwardAgent, ConnectTimeout.
"""

from __future__ import annotations

import difflib
import functools
import glob
import ipaddress
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from ssh_scheduler import hostlist
from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.machine_env import parse_env, parse_setup

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_PORT",
    "DEFAULT_WORKDIR",
    "MACHINE_KEYS",
    "Machine",
    "SshConfigBlock",
    "SshOption",
    "SshOptions",
    "load_machine",
    "load_machines",
    "local_machine",
    "parse_machine_yaml",
    "parse_ssh_config",
    "resolve_ssh_alias",
]

DEFAULT_WORKDIR = "~/.ssh_scheduler"
DEFAULT_PORT = 22
DEFAULT_MAX_SESSIONS = 10
DEFAULT_CONNECT_TIMEOUT = 10.0

MAX_MACHINE_FILE_BYTES = 1 << 20
MAX_INCLUDE_DEPTH = 16


@dataclass(frozen=True, slots=True)
class Machine:
    """One machine to run jobs on."""

    name: str
    """Display name: YAML ``name``, else the file stem, else the ssh alias / the spec."""
    host: str
    """Address to connect to (host name, IPv4 or IPv6 literal without brackets)."""
    port: int = DEFAULT_PORT
    user: str | None = None
    """``None``: the current local user, as OpenSSH does."""
    key_paths: tuple[str, ...] = ()
    """Absolute, ``~``-expanded local paths; empty: the agent and default keys."""
    known_hosts: tuple[str, ...] | None = None
    """``None``: default (``~/.ssh/known_hosts`` + the ssh config's UserKnownHostsFile);
    ``()``: no known_hosts file at all (ssh config ``UserKnownHostsFile none``)."""
    proxy_jump: str | None = None
    workdir: str = DEFAULT_WORKDIR
    """Remote work root, as written (``~`` is the remote home)."""
    max_sessions: int = DEFAULT_MAX_SESSIONS
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    forward_agent: bool = False
    env: tuple[tuple[str, str], ...] = ()
    """``env:``: variables every job on it gets."""
    setup: tuple[str, ...] = ()
    """``setup:``: shell lines run before every job on it (see machine_env)."""
    is_local: bool = False
    """The coordinator's own machine, run without SSH."""
    source: str = ""
    """Where it came from, for messages: the YAML path, ``<ssh config> (Host x)`` or the spec."""


def local_machine() -> Machine:
    """The coordinator's own machine (jobs run without SSH)."""
    return Machine(
        name="localhost",
        host="localhost",
        workdir=DEFAULT_WORKDIR,
        is_local=True,
        source="local machine",
    )


# --------------------------------------------------------------------------------------------
# small helpers


_show = show_value
_plain = plain_text


def _tilde(path: Path | str) -> str:
    """Show a path with the home directory written as ``~``."""
    text = str(path)
    home = os.path.expanduser("~")
    if home not in ("", "/", "~") and (text == home or text.startswith(home.rstrip("/") + "/")):
        text = "~" + text[len(home.rstrip("/")) :]
    return _plain(text)


def _local_user() -> str:
    for var in ("USER", "LOGNAME"):
        value = os.environ.get(var)
        if value:
            return value
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError, OSError):
        return ""


_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,255}\$?")
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_SCOPE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_PROXY_JUMP_RE = re.compile(r"[A-Za-z0-9_.@:,\[\]%-]+")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def _check_user(value: str) -> str | None:
    """None if fine, else why not."""
    if _USER_RE.fullmatch(value):
        return None
    return (
        f"user name {_show(value)} is not a valid user name (letters, digits, '_', '.', '-'; "
        "not starting with '-'; no spaces or shell characters)"
    )


def _normalize_host(value: str) -> tuple[str | None, str | None]:
    """``(host, None)`` if usable (IPv6 brackets removed), else ``(None, why)``."""
    host = value
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        addr, _, scope = host.partition("%")
        try:
            ipaddress.IPv6Address(addr)
        except ValueError:
            pass
        else:
            if not scope or _SCOPE_RE.fullmatch(scope):
                return host, None
    elif _HOSTNAME_RE.fullmatch(host) and not host.startswith("-"):
        return host, None
    hint = "a host name, IPv4 or IPv6 address"
    if "@" in value:
        hint += "; put the user name in its own setting"
    elif value.count(":") == 1:
        hint += "; put the port in its own setting"
    return None, (
        f"host {_show(value)} is not a valid host ({hint}; no spaces, '/', or shell characters, "
        "not starting with '-')"
    )


# --------------------------------------------------------------------------------------------
# machine YAML

MACHINE_KEYS: dict[str, str] = {
    "ip": "the host name or address to ssh to",
    "username": "the user to log in as",
    "port": "the ssh port, default 22",
    "ssh_key_path": "a private key file or a list of them",
    "name": "the display name",
    "workdir": f"the remote work folder, default {DEFAULT_WORKDIR}",
    "known_hosts": "a known_hosts file or a list of them",
    "max_sessions": f"most ssh sessions at once, default {DEFAULT_MAX_SESSIONS}",
    "connect_timeout": f"seconds to wait for a connection, default {DEFAULT_CONNECT_TIMEOUT:g}",
    "forward_agent": "true to forward the ssh agent, default false",
    "proxy_jump": "a jump host, like user@bastion:22",
    "env": "variables every job gets, like {OMP_NUM_THREADS: 4}",
    "setup": "shell lines run before every job, like 'conda activate exp'",
}
"""Every key a machine YAML may have, with a short description (used in messages)."""

_REQUIRED_KEYS = ("ip",)


def _yaml_error_message(source: str, err: yaml.YAMLError, text: str) -> str:
    shown = _plain(source)
    if isinstance(err, yaml.reader.ReaderError):
        position = int(err.position) if isinstance(err.position, int) else 0
        line = text.count("\n", 0, position) + 1
        column = position - (text.rfind("\n", 0, position) + 1) + 1
        char = err.character
        what = _show(chr(char) if isinstance(char, int) else char)
        return (
            f"{shown} line {line}, column {column}: the character {what} is not allowed in "
            "YAML (remove it; is this a text file?)"
        )
    if not isinstance(err, yaml.MarkedYAMLError):
        return f"{shown}: invalid YAML: {' '.join(str(err).split())} (fix the syntax)"
    where = ""
    mark = err.problem_mark or err.context_mark
    if mark is not None:
        where = f" line {mark.line + 1}, column {mark.column + 1}"
    problem = err.problem or ""
    if isinstance(err, yaml.constructor.ConstructorError) and "tag" in problem:
        tag = re.search(r"'([^']*)'", problem)
        return (
            f"{shown}{where}: YAML tag {_show(tag.group(1) if tag else '?')} is not allowed "
            "(a machine file holds plain keys and values only; remove the tag)"
        )
    if err.context and problem:
        joiner = " " if problem.startswith("but ") else ": "
        problem = f"{err.context}{joiner}{problem}"
    problem = " ".join((problem or err.context or "invalid YAML").split())
    return (
        f"{shown}{where}: invalid YAML: {problem} (fix the syntax there; each line is 'key: value')"
    )


def _where(source: str, lines: dict[str, int], key: str) -> str:
    line = lines.get(key)
    return f"{_plain(source)} line {line}" if line else _plain(source)


def _strings(value: object, key: str, at: str) -> tuple[str, ...]:
    """A string or a non-empty list of strings."""
    items: list[object] = list(value) if isinstance(value, list) else [value]
    if not items:
        raise ConfigError(
            f"{at}: '{key}' is an empty list (give at least one path, or remove '{key}' "
            "for the default)"
        )
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(
                f"{at}: '{key}' must be a path or a list of paths, got {_show(item)} "
                f"({MACHINE_KEYS[key]})"
            )
        if _CONTROL_RE.search(item):
            raise ConfigError(
                f"{at}: '{key}' path {_show(item)} contains a control character (remove it)"
            )
        out.append(item)
    return tuple(out)


def _local_path(path: str, base_dir: Path) -> str:
    expanded = os.path.expanduser(path)
    if not os.path.isabs(expanded):
        expanded = os.path.join(base_dir, expanded)
    return os.path.abspath(expanded)


def _int_value(value: object, key: str, at: str, low: int, high: int | None) -> int:
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= low
        and (high is None or value <= high)
    ):
        return value
    limit = f"from {low} to {high}" if high is not None else f"of at least {low}"
    raise ConfigError(
        f"{at}: '{key}' must be a whole number {limit}, got {_show(value)} ({MACHINE_KEYS[key]})"
    )


def _top_level_lines(node: yaml.MappingNode, source: str) -> dict[str, int]:
    """Line number of each top-level key; repeated keys are an error."""
    lines: dict[str, int] = {}
    for key_node, _value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        key = str(key_node.value)
        line = key_node.start_mark.line + 1 if key_node.start_mark is not None else 0
        if key in lines:
            raise ConfigError(
                f"{_plain(source)} line {line}: key {_show(key)} is given twice "
                f"(also on line {lines[key]}; keep one)"
            )
        lines[key] = line
    return lines


def parse_machine_yaml(text: str, *, source: str, base_dir: Path | None = None) -> Machine:
    """Parse one machine YAML document.

    ``source`` names the file in messages and becomes ``Machine.source``; the file stem is the
    default display name.  Relative ``ssh_key_path``/``known_hosts`` entries are resolved
    against ``base_dir`` (default: the directory of ``source``).
    """
    base = base_dir if base_dir is not None else Path(source).parent
    shown = _plain(source)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error_message(source, err, text)) from None
    except RecursionError:
        raise ConfigError(
            f"{shown}: values are nested too deeply (a machine file holds plain keys and values)"
        ) from None
    if node is None:
        raise ConfigError(
            f"{shown}: the file is empty (write at least 'ip: <host>', and usually "
            "'username: <user>')"
        )
    if not isinstance(node, yaml.MappingNode):
        kind = "a list" if isinstance(node, yaml.SequenceNode) else "a single value"
        raise ConfigError(
            f"{shown}: expected 'key: value' lines, got {kind} (write e.g. 'ip: <host>' on "
            "its own line)"
        )
    lines = _top_level_lines(node, source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error_message(source, err, text)) from None
    except (ValueError, OverflowError, RecursionError) as err:  # odd scalars, deep nesting
        raise ConfigError(
            f"{shown}: a value could not be read: {_show(str(err))} (write plain values)"
        ) from None
    if not isinstance(data, dict):  # pragma: no cover - the node was a mapping
        raise ConfigError(f"{shown}: expected 'key: value' lines (write e.g. 'ip: <host>')")

    valid = ", ".join(MACHINE_KEYS)
    for key in data:
        if not isinstance(key, str) or key not in MACHINE_KEYS:
            close = difflib.get_close_matches(str(key), list(MACHINE_KEYS), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            where = _where(source, lines, key) if isinstance(key, str) else shown
            raise ConfigError(f"{where}: unknown key {_show(key)} ({hint}valid keys: {valid})")
    for key in _REQUIRED_KEYS:
        if data.get(key) is None:
            problem = f"key '{key}' is empty" if key in data else f"missing key '{key}'"
            raise ConfigError(f"{_where(source, lines, key)}: {problem} ({MACHINE_KEYS[key]})")

    def at(key: str) -> str:
        return _where(source, lines, key)

    def given(key: str) -> object:
        return data.get(key)

    raw_ip = given("ip")
    if not isinstance(raw_ip, str):
        raise ConfigError(
            f"{at('ip')}: 'ip' must be a host name or address, got {_show(raw_ip)} "
            '(put it in quotes, like ip: "10.0.0.5")'
        )
    host, why = _normalize_host(raw_ip.strip())
    if host is None:
        raise ConfigError(f"{at('ip')}: {why}")

    user: str | None = None
    raw_user = given("username")
    if raw_user is not None:
        if not isinstance(raw_user, str):
            raise ConfigError(
                f"{at('username')}: 'username' must be text, got {_show(raw_user)} "
                "(put it in quotes)"
            )
        bad_user = _check_user(raw_user)
        if bad_user:
            raise ConfigError(f"{at('username')}: {bad_user}")
        user = raw_user

    port = DEFAULT_PORT
    if given("port") is not None:
        port = _int_value(given("port"), "port", at("port"), 1, 65535)

    key_paths: tuple[str, ...] = ()
    if given("ssh_key_path") is not None:
        raw_keys = _strings(given("ssh_key_path"), "ssh_key_path", at("ssh_key_path"))
        key_paths = tuple(_local_path(p, base) for p in raw_keys)

    known_hosts: tuple[str, ...] | None = None
    if given("known_hosts") is not None:
        raw_known = _strings(given("known_hosts"), "known_hosts", at("known_hosts"))
        known_hosts = tuple(_local_path(p, base) for p in raw_known)

    name = Path(source).stem or host
    if given("name") is not None:
        raw_name = given("name")
        if (
            not isinstance(raw_name, str)
            or not raw_name.strip()
            or raw_name != raw_name.strip()
            or not raw_name.isprintable()
            or "/" in raw_name
            or "\\" in raw_name
            or len(raw_name) > 200
        ):
            raise ConfigError(
                f"{at('name')}: 'name' must be printable text of at most 200 characters "
                f"without '/', '\\' or surrounding spaces, got {_show(raw_name)}"
            )
        name = raw_name

    workdir = DEFAULT_WORKDIR
    if given("workdir") is not None:
        raw_workdir = given("workdir")
        if not isinstance(raw_workdir, str) or not raw_workdir.strip():
            raise ConfigError(
                f"{at('workdir')}: 'workdir' must be a remote folder path, got "
                f"{_show(raw_workdir)} (default {DEFAULT_WORKDIR})"
            )
        if _CONTROL_RE.search(raw_workdir):
            raise ConfigError(
                f"{at('workdir')}: 'workdir' {_show(raw_workdir)} contains a NUL, newline or "
                "other control character (remove it)"
            )
        workdir = raw_workdir

    max_sessions = DEFAULT_MAX_SESSIONS
    if given("max_sessions") is not None:
        max_sessions = _int_value(
            given("max_sessions"), "max_sessions", at("max_sessions"), 1, None
        )

    connect_timeout = DEFAULT_CONNECT_TIMEOUT
    raw_timeout = given("connect_timeout")
    if raw_timeout is not None:
        if (
            isinstance(raw_timeout, bool)
            or not isinstance(raw_timeout, int | float)
            or not math.isfinite(raw_timeout)
            or raw_timeout <= 0
        ):
            raise ConfigError(
                f"{at('connect_timeout')}: 'connect_timeout' must be a number of seconds "
                f"greater than 0, got {_show(raw_timeout)}"
            )
        connect_timeout = float(raw_timeout)

    forward_agent = False
    raw_forward = given("forward_agent")
    if raw_forward is not None:
        if not isinstance(raw_forward, bool):
            raise ConfigError(
                f"{at('forward_agent')}: 'forward_agent' must be true or false, got "
                f"{_show(raw_forward)}"
            )
        forward_agent = raw_forward

    proxy_jump: str | None = None
    raw_jump = given("proxy_jump")
    if raw_jump is not None:
        proxy_jump = _check_proxy_jump(raw_jump, at("proxy_jump"), "'proxy_jump'")

    env = parse_env(given("env"), at("env")) if given("env") is not None else ()
    setup = parse_setup(given("setup"), at("setup")) if given("setup") is not None else ()

    return Machine(
        name=name,
        host=host,
        port=port,
        user=user,
        key_paths=key_paths,
        known_hosts=known_hosts,
        proxy_jump=proxy_jump,
        workdir=workdir,
        max_sessions=max_sessions,
        connect_timeout=connect_timeout,
        forward_agent=forward_agent,
        env=env,
        setup=setup,
        source=source,
    )


def _check_proxy_jump(value: object, at: str, what: str) -> str | None:
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    if (
        not isinstance(value, str)
        or not _PROXY_JUMP_RE.fullmatch(value)
        or value.startswith("-")
        or any(part.startswith("-") or not part for part in value.split(","))
    ):
        raise ConfigError(
            f"{at}: {what} must be [user@]host[:port] (several joined with ','), got "
            f"{_show(value)} (no spaces or shell characters)"
        )
    return value


# --------------------------------------------------------------------------------------------
# ~/.ssh/config


@dataclass(frozen=True, slots=True)
class SshOption:
    """One ``Keyword args...`` line of an ssh config file."""

    keyword: str
    """Lower-cased keyword."""
    args: tuple[str, ...]
    line: int
    source: str


@dataclass(frozen=True, slots=True)
class SshConfigBlock:
    """Options that apply to a host when every condition matches.

    ``conditions`` holds one pattern tuple per enclosing ``Host`` line (an ``Include`` inside a
    ``Host`` block nests); an empty tuple applies to every host (options before the first
    ``Host``).  ``never`` marks ``Match`` blocks we cannot evaluate.
    """

    conditions: tuple[tuple[str, ...], ...]
    options: tuple[SshOption, ...]
    line: int = 0
    source: str = ""
    never: bool = False


SshOptions = dict[str, str | tuple[str, ...]]
"""Resolved options: lower-case keyword -> value; multi-valued keywords -> tuple of values."""

_MULTI_KEYWORDS = frozenset(
    {
        "identityfile",
        "certificatefile",
        "localforward",
        "remoteforward",
        "dynamicforward",
        "sendenv",
        "setenv",
    }
)
_KEYWORD_LINE = re.compile(r"([A-Za-z][A-Za-z0-9]*)(?:\s*=\s*|\s+|$)(.*)", re.DOTALL)

IncludeReader = Callable[[str], Sequence[tuple[str, str]]]
"""``Include`` argument -> ``[(source name, text), ...]`` of the files it names."""


def _split_args(text: str, where: str) -> tuple[str, ...]:
    """Split an ssh config argument string: whitespace, quotes, backslash escapes, ``#``."""
    args: list[str] = []
    current: list[str] = []
    have = False
    quote = ""
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == quote:
                quote = ""
            elif ch == "\\" and quote == '"' and i + 1 < len(text) and text[i + 1] in '\\"':
                i += 1
                current.append(text[i])
            else:
                current.append(ch)
        elif ch in "\"'":
            quote = ch
            have = True
        elif ch == "\\" and i + 1 < len(text) and text[i + 1] in "\\\"' ":
            i += 1
            current.append(text[i])
            have = True
        elif ch in " \t":
            if have:
                args.append("".join(current))
                current, have = [], False
        elif ch == "#" and not have:
            break
        else:
            current.append(ch)
            have = True
        i += 1
    if quote:
        raise ConfigError(f"{where}: unbalanced {quote} quote (close it)")
    if have:
        args.append("".join(current))
    return tuple(args)


def parse_ssh_config(
    text: str,
    *,
    source: str = "~/.ssh/config",
    read_include: IncludeReader | None = None,
    _conditions: tuple[tuple[str, ...], ...] = (),
    _never: bool = False,
    _depth: int = 0,
) -> list[SshConfigBlock]:
    """Parse ssh config text into blocks, in file order (``Include`` is inlined when
    ``read_include`` is given, ignored otherwise)."""
    if _depth > MAX_INCLUDE_DEPTH:
        raise ConfigError(
            f"{_plain(source)}: Include nested more than {MAX_INCLUDE_DEPTH} deep "
            "(an Include loop? remove it)"
        )
    blocks: list[SshConfigBlock] = []
    conditions, never, start = _conditions, _never, 0
    options: list[SshOption] = []

    def close_block() -> None:
        if options:
            blocks.append(SshConfigBlock(conditions, tuple(options), start, source, never))

    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{_plain(source)} line {number}"
        if _CONTROL_RE.search(line.replace("\t", " ")):
            raise ConfigError(f"{where}: the line contains a control character (remove it)")
        m = _KEYWORD_LINE.fullmatch(line)
        if m is None:
            raise ConfigError(
                f"{where}: cannot read {_show(line)} (write 'Keyword value' or 'Keyword=value')"
            )
        keyword = m.group(1).lower()
        args = _split_args(m.group(2), where)
        if not args:
            raise ConfigError(f"{where}: '{m.group(1)}' has no value (give one or remove the line)")
        if keyword in ("host", "match"):
            close_block()
            options = []
            start = number
            if keyword == "host":
                conditions, never = (*_conditions, args), _never
            elif [a.lower() for a in args] == ["all"]:
                conditions, never = _conditions, _never
            else:
                conditions, never = _conditions, True
            continue
        if keyword == "include":
            if read_include is None:
                continue
            close_block()
            options = []
            for pattern in args:
                for sub_source, sub_text in read_include(pattern):
                    blocks.extend(
                        parse_ssh_config(
                            sub_text,
                            source=sub_source,
                            read_include=read_include,
                            _conditions=conditions,
                            _never=never,
                            _depth=_depth + 1,
                        )
                    )
            start = number
            continue
        options.append(SshOption(keyword, args, number, source))
    close_block()
    return blocks


@functools.lru_cache(maxsize=1024)
def _glob_to_regex(pattern: str) -> re.Pattern[str]:
    parts = ["(?s)"]
    for ch in pattern:
        if ch == "*":
            parts.append(".*")
        elif ch == "?":
            parts.append(".")
        else:
            parts.append(re.escape(ch))
    return re.compile("".join(parts), re.IGNORECASE)


def _pattern_match(host: str, patterns: tuple[str, ...]) -> tuple[bool, bool]:
    """``(matches, matched by a pattern with a literal character)`` for one Host line."""
    matched = literal = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        if not _glob_to_regex(body).fullmatch(host):
            continue
        if negated:
            return False, False
        matched = True
        if body.strip("*?"):
            literal = True
    return matched, literal


def _expand_tokens(value: str, tokens: dict[str, str], where: str, keyword: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(value):
        ch = value[i]
        if ch == "%" and i + 1 < len(value):
            token = value[i + 1]
            if token not in tokens:
                raise ConfigError(
                    f"{where}: {keyword} uses token '%{token}', which is not supported here "
                    f"(use one of {' '.join('%' + t for t in sorted(tokens))})"
                )
            out.append(tokens[token])
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def resolve_ssh_alias(
    alias: str,
    config_text: str | Sequence[SshConfigBlock],
    *,
    source: str = "~/.ssh/config",
    read_include: IncludeReader | None = None,
    require_literal: bool = True,
    user: str | None = None,
) -> SshOptions | None:
    """The options ``ssh alias`` would use, or ``None`` if ``alias`` is not a ``Host``.

    With ``require_literal`` (the default) a host matched only by all-wildcard patterns
    (``Host *``) counts as not found.  The result always has ``hostname`` (``%h`` expanded;
    default: ``alias``); ``identityfile`` and the other multi-valued keywords are tuples;
    ``identityfile`` and ``userknownhostsfile`` are ``~``/token expanded (``userknownhostsfile``
    is a tuple of files; ``user`` overrides the config's User for the ``%r`` token); of
    ``proxyjump``/``proxycommand`` only the first given is kept, as OpenSSH does.  Other
    keywords map to their arguments joined with a space.  ``config_text`` may also be the blocks
    :func:`parse_ssh_config` returned (to parse once for many hosts).
    """
    blocks = (
        parse_ssh_config(config_text, source=source, read_include=read_include)
        if isinstance(config_text, str)
        else config_text
    )
    found = False
    first: dict[str, SshOption] = {}
    multi: dict[str, list[SshOption]] = {}
    for block in blocks:
        if block.never:
            continue
        literal = False
        ok = True
        for patterns in block.conditions:
            matched, literal = _pattern_match(alias, patterns)
            if not matched:
                ok = False
                break
        if not ok:
            continue
        if block.conditions and literal:
            found = True
        for option in block.options:
            if option.keyword in _MULTI_KEYWORDS:
                multi.setdefault(option.keyword, []).append(option)
            elif option.keyword in ("proxyjump", "proxycommand"):
                if "proxyjump" not in first and "proxycommand" not in first:
                    first[option.keyword] = option
            elif option.keyword not in first:
                first[option.keyword] = option
    if require_literal and not found:
        return None

    def where(option: SshOption) -> str:
        return f"{_plain(option.source)} line {option.line}"

    result: SshOptions = {}
    for keyword, option in first.items():
        result[keyword] = " ".join(option.args)
    hostname = alias
    if "hostname" in first:
        option = first["hostname"]
        hostname = _expand_tokens(option.args[0], {"h": alias, "%": "%"}, where(option), "HostName")
    result["hostname"] = hostname
    home = os.path.expanduser("~")
    local_user = _local_user()
    tokens = {
        "%": "%",
        "d": home,
        "h": hostname,
        "n": alias,
        "p": str(result.get("port", DEFAULT_PORT)),
        "r": user if user is not None else str(result.get("user", local_user)),
        "u": local_user,
    }
    for keyword, options in multi.items():
        values: list[str] = []
        for option in options:
            if keyword == "identityfile":
                if option.args[0].lower() == "none":
                    continue
                expanded = _expand_tokens(option.args[0], tokens, where(option), "IdentityFile")
                values.append(os.path.expanduser(expanded))
            else:
                values.append(" ".join(option.args))
        result[keyword] = tuple(values)
    if "userknownhostsfile" in first:
        option = first["userknownhostsfile"]
        files = [
            os.path.expanduser(_expand_tokens(arg, tokens, where(option), "UserKnownHostsFile"))
            for arg in option.args
        ]
        if [f.lower() for f in files] == ["none"]:
            files = []
        result["userknownhostsfile"] = tuple(files)
    return result


def _default_ssh_config() -> Path:
    return Path(os.path.expanduser("~")) / ".ssh" / "config"


def _include_reader(config_path: Path) -> IncludeReader:
    base = config_path.parent

    def read(pattern: str) -> list[tuple[str, str]]:
        expanded = os.path.expanduser(pattern)
        if not os.path.isabs(expanded):
            expanded = str(base / expanded)
        out: list[tuple[str, str]] = []
        for path in sorted(glob.glob(expanded)):
            if not os.path.isfile(path):
                continue
            out.append((path, _read_text(Path(path), "ssh config")))
        return out

    return read


def _read_text(path: Path, what: str) -> str:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_MACHINE_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError(
            f"cannot read {what} {_tilde(path)}: {err.strerror or err} (check it exists and "
            "is readable)"
        ) from None
    if len(data) > MAX_MACHINE_FILE_BYTES:
        raise ConfigError(
            f"{_tilde(path)}: larger than {MAX_MACHINE_FILE_BYTES} bytes, not a {what} "
            "(check the path)"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{_tilde(path)}: not valid UTF-8 at byte {err.start} (save the {what} as UTF-8)"
        ) from None


def _machine_from_ssh(
    alias: str,
    options: SshOptions,
    *,
    name: str,
    source: str,
    user_override: str | None = None,
    port_override: int | None = None,
) -> Machine:
    def text(keyword: str) -> str | None:
        value = options.get(keyword)
        return value if isinstance(value, str) else None

    def files(keyword: str) -> tuple[str, ...]:
        value = options.get(keyword)
        return value if isinstance(value, tuple) else ()

    at = f"{_plain(source)}"
    host, why = _normalize_host(text("hostname") or alias)
    if host is None:
        raise ConfigError(f"{at}: HostName: {why} (fix it in the ssh config or the spec)")

    user = user_override if user_override is not None else text("user")
    if user is not None:
        problem = _check_user(user)
        if problem:
            raise ConfigError(f"{at}: User: {problem}")

    port = DEFAULT_PORT
    if port_override is not None:
        port = port_override
    elif text("port") is not None:
        raw = text("port") or ""
        if not raw.isdigit() or not 1 <= int(raw) <= 65535:
            raise ConfigError(
                f"{at}: Port {_show(raw)} is not a number from 1 to 65535 (fix the ssh config)"
            )
        port = int(raw)

    proxy_command = text("proxycommand")
    if proxy_command is not None and proxy_command.lower() != "none":
        raise ConfigError(
            f"{at}: ProxyCommand is not supported (use 'ProxyJump host' or a machine YAML "
            "with proxy_jump instead)"
        )
    proxy_jump: str | None = None
    if text("proxyjump") is not None:
        proxy_jump = _check_proxy_jump(text("proxyjump"), at, "ProxyJump")

    forward_agent = False
    if text("forwardagent") is not None:
        forward_agent = (text("forwardagent") or "").lower() not in ("no", "false")

    connect_timeout = DEFAULT_CONNECT_TIMEOUT
    raw_timeout = text("connecttimeout")
    if raw_timeout is not None and raw_timeout.lower() != "none":
        if not raw_timeout.isdigit():
            raise ConfigError(
                f"{at}: ConnectTimeout {_show(raw_timeout)} is not a whole number of seconds "
                "(fix the ssh config)"
            )
        if int(raw_timeout) > 0:
            connect_timeout = float(raw_timeout)

    known_hosts: tuple[str, ...] | None = None
    if "userknownhostsfile" in options:
        known_hosts = tuple(os.path.abspath(p) for p in files("userknownhostsfile"))

    return Machine(
        name=name,
        host=host,
        port=port,
        user=user,
        key_paths=tuple(os.path.abspath(p) for p in files("identityfile")),
        known_hosts=known_hosts,
        proxy_jump=proxy_jump,
        connect_timeout=connect_timeout,
        forward_agent=forward_agent,
        source=source,
    )


def _parse_user_at_host(spec: str) -> tuple[str, str, int | None]:
    """``user@host[:port]`` -> (user, host, port); ConfigError when malformed."""
    user, _, rest = spec.partition("@")
    problem = _check_user(user) if user else "the user name before '@' is empty"
    if problem:
        raise ConfigError(f"machine {_show(spec)}: {problem} (write user@host or user@host:port)")
    port_text: str | None = None
    if rest.startswith("["):
        close = rest.find("]")
        if close == -1:
            raise ConfigError(
                f"machine {_show(spec)}: '[' without ']' (write IPv6 as user@[addr]:port)"
            )
        host_text, tail = rest[: close + 1], rest[close + 1 :]
        if tail:
            if not tail.startswith(":"):
                raise ConfigError(
                    f"machine {_show(spec)}: unexpected {_show(tail)} after ']' "
                    "(write user@[addr]:port)"
                )
            port_text = tail[1:]
    elif rest.count(":") == 1:
        host_text, _, port_text = rest.partition(":")
    else:
        host_text = rest
    host, why = _normalize_host(host_text)
    if host is None:
        raise ConfigError(f"machine {_show(spec)}: {why}")
    port: int | None = None
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ConfigError(
                f"machine {_show(spec)}: port {_show(port_text)} is not a number from 1 to 65535 "
                "(write user@host:port)"
            )
        port = int(port_text)
    return user, host, port


def _default_search_dirs() -> list[Path]:
    return [Path(os.path.expanduser("~")) / ".local" / "var"]


SshConfigLoader = Callable[[], tuple[list[SshConfigBlock], str]]


def _ssh_config_loader(ssh_config: Path | None) -> SshConfigLoader:
    """Read and parse the ssh config on first use only, then reuse it."""
    config_path = ssh_config if ssh_config is not None else _default_ssh_config()
    shown = _tilde(config_path)
    cache: list[list[SshConfigBlock]] = []

    def load() -> tuple[list[SshConfigBlock], str]:
        if not cache:
            text = ""
            try:
                exists = config_path.is_file()
            except OSError:
                exists = False
            if exists:
                text = _read_text(config_path, "ssh config")
            reader = _include_reader(config_path)
            cache.append(parse_ssh_config(text, source=shown, read_include=reader))
        return cache[0], shown

    return load


def load_machine(
    spec: str,
    *,
    search_dirs: Sequence[Path] | None = None,
    ssh_config: Path | None = None,
) -> Machine:
    """Find and load one machine by spec (lookup order in the module docstring)."""
    dirs = list(search_dirs) if search_dirs is not None else _default_search_dirs()
    return _load_machine(spec, dirs, _ssh_config_loader(ssh_config))


def _load_machine(spec: str, dirs: Sequence[Path], ssh_blocks: SshConfigLoader) -> Machine:
    if not spec.strip():
        raise ConfigError(
            "empty machine name (give a machine YAML file, a Host from ~/.ssh/config, or user@host)"
        )
    if _CONTROL_RE.search(spec):
        raise ConfigError(
            f"machine {_show(spec)} contains a control character (remove it; a machine is a "
            "YAML file, a Host from ~/.ssh/config or user@host)"
        )
    expanded = os.path.expanduser(spec)
    candidates = [Path(expanded), Path(expanded + ".yaml")]
    for directory in dirs:
        candidates += [directory / spec, directory / (spec + ".yaml")]
    for candidate in candidates:
        try:
            is_file = candidate.is_file()
        except (OSError, ValueError):  # name too long, NUL byte...
            is_file = False
        if is_file:
            source = str(candidate)
            return parse_machine_yaml(_read_text(candidate, "machine file"), source=source)

    blocks, config_shown = ssh_blocks()
    if "@" not in spec:
        options = resolve_ssh_alias(spec, blocks)
        if options is not None:
            return _machine_from_ssh(
                spec, options, name=spec, source=f"{config_shown} (Host {_plain(spec)})"
            )
        places = " or ".join(_tilde(d).rstrip("/") + "/" for d in dirs) or "no search folder"
        raise ConfigError(
            f"no machine {_show(spec)}: not a file ({_plain(spec)}, {_plain(spec)}.yaml), "
            f"not in {places}, and not a Host in {config_shown} "
            f"(to ssh to it directly, write user@{_plain(spec)})"
        )

    user, host, port = _parse_user_at_host(spec)
    options = resolve_ssh_alias(host, blocks, require_literal=False, user=user)
    assert options is not None
    return _machine_from_ssh(
        host,
        options,
        name=spec,
        source=spec,
        user_override=user,
        port_override=port,
    )


_IPV6_BRACKETS = re.compile(r"\[[^\]]*:[^\]]*\]")


def _expand_spec(spec: str) -> list[str]:
    """Expand a host range in a spec, unless it is an existing file or an ``[IPv6]`` literal."""
    if ("[" not in spec and "," not in spec) or _IPV6_BRACKETS.search(spec):
        return [spec]
    try:
        if Path(os.path.expanduser(spec)).is_file():
            return [spec]
    except (OSError, ValueError):
        pass
    return hostlist.expand(spec)


def load_machines(
    specs: Sequence[str],
    *,
    exclude: Sequence[str] = (),
    ssh_config: Path | None = None,
    search_dirs: Sequence[Path] | None = None,
) -> list[Machine]:
    """Load every machine named by ``specs`` (host ranges expanded), minus ``exclude``.

    ``exclude`` entries (ranges allowed) remove machines whose expanded spec, display name or
    source (the YAML path as found) equals them; excluded specs are not even loaded; an exclude entry that removes nothing is an error (likely a typo).  Two specs
    that reach the same user@host:port, or two machines with the same display name, are an
    error; so is an empty result.  Order follows ``specs``.
    """
    if not specs:
        raise ConfigError("no machines given (name at least one machine file, Host or user@host)")
    excluded: dict[str, str] = {}
    for pattern in exclude:
        for name in _expand_spec(pattern):
            excluded.setdefault(name, pattern)
    used: set[str] = set()
    dirs = list(search_dirs) if search_dirs is not None else _default_search_dirs()
    ssh_blocks = _ssh_config_loader(ssh_config)

    machines: list[tuple[str, Machine]] = []
    for spec in specs:
        for one in _expand_spec(spec):
            if one in excluded:
                used.add(excluded[one])
                continue
            machine = _load_machine(one, dirs, ssh_blocks)
            hit = next((k for k in (machine.name, machine.source) if k in excluded), None)
            if hit is not None:
                used.add(excluded[hit])
                continue
            machines.append((one, machine))

    unused = [p for p in dict.fromkeys(excluded.values()) if p not in used]
    if unused:
        names = hostlist.fold(m.name for _, m in machines) or "none"
        raise ConfigError(
            f"exclude {_show(unused[0])} matches no machine (the machines are {_plain(names)}; "
            "check the spelling)"
        )
    if not machines:
        raise ConfigError("every machine was excluded (remove an --exclude or add machines)")

    local = _local_user()
    by_address: dict[tuple[str, int, str, bool], str] = {}
    by_name: dict[str, str] = {}
    for one, machine in machines:
        address = (machine.host.lower(), machine.port, machine.user or local, machine.is_local)
        if address in by_address:
            raise ConfigError(
                f"machines {_show(by_address[address])} and {_show(one)} both connect to "
                f"{_plain(machine.user or local)}@{_plain(machine.host)}:{machine.port} "
                "(list each machine once)"
            )
        by_address[address] = one
        if machine.name in by_name:
            raise ConfigError(
                f"machines {_show(by_name[machine.name])} and {_show(one)} have the same name "
                f"{_show(machine.name)} (set a different 'name:' in one of the YAML files)"
            )
        by_name[machine.name] = one
    return [machine for _, machine in machines]
