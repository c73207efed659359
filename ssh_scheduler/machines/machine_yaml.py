"""Machine YAML files and the :class:`Machine` every machine spec turns into.

Every problem a user can cause raises :class:`~ssh_scheduler.errors.ConfigError` whose message
is one line naming the file (and line when known), what is wrong and how to fix it.

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
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.machines.machine_env import parse_env, parse_setup
from ssh_scheduler.machines.slurm import SlurmSettings, parse_slurm_section

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_PORT",
    "DEFAULT_WORKDIR",
    "MACHINE_KEYS",
    "Machine",
    "check_proxy_jump",
    "check_user",
    "local_machine",
    "normalize_host",
    "parse_machine_yaml",
    "read_text",
    "tilde_path",
]

DEFAULT_WORKDIR = "~/.ssh_scheduler"
DEFAULT_PORT = 22
DEFAULT_MAX_SESSIONS = 10
DEFAULT_CONNECT_TIMEOUT = 10.0

MAX_MACHINE_FILE_BYTES = 1 << 20

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
    """The ProxyJump hops as written (``[user@]host[:port]``, joined with ``,``)."""
    jump_host: Machine | None = None
    """The last hop, resolved through the ssh config as ``ssh -J`` does (its own ``jump_host``
    leads back to the first hop); ``None`` with ``proxy_jump`` set: hops are used as written."""
    proxy_command: str | None = None
    """``exec <ProxyCommand>`` with its tokens expanded, run with ``$SHELL -c`` as ssh does."""
    workdir: str = DEFAULT_WORKDIR
    """Remote work root, as written (``~`` is the remote home)."""
    max_sessions: int = DEFAULT_MAX_SESSIONS
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    forward_agent: bool = False
    env: tuple[tuple[str, str], ...] = ()
    """``env:``: variables every job on it gets."""
    setup: tuple[str, ...] = ()
    """``setup:``: shell lines run before every job on it (see machine_env)."""
    legacy_algorithms: bool = False
    """Also offer SHA-1 key exchange, ``ssh-rsa`` signatures, ``hmac-sha1`` and ``umac-64``
    (an old host that speaks nothing newer)."""
    is_local: bool = False
    """The coordinator's own machine, run without SSH."""
    slurm: SlurmSettings | None = None
    """``slurm:``: the host is a Slurm login node; jobs go to Slurm through it (executor_slurm)."""
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


def tilde_path(path: Path | str) -> str:
    """Show a path with the home directory written as ``~``."""
    text = str(path)
    home = os.path.expanduser("~")
    if home not in ("", "/", "~") and (text == home or text.startswith(home.rstrip("/") + "/")):
        text = "~" + text[len(home.rstrip("/")) :]
    return _plain(text)



_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,255}\$?")
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_SCOPE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_PROXY_JUMP_RE = re.compile(r"[A-Za-z0-9_.@:,\[\]%-]+")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def check_user(value: str) -> str | None:
    """None if fine, else why not."""
    if _USER_RE.fullmatch(value):
        return None
    return (
        f"user name {_show(value)} is not a valid user name (letters, digits, '_', '.', '-', '@'; "
        "not starting with '-'; no spaces or shell characters)"
    )


def normalize_host(value: str) -> tuple[str | None, str | None]:
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
    "legacy_algorithms": "true to allow SHA-1 and other legacy SSH algorithms, default false",
    "env": "variables every job gets, like {OMP_NUM_THREADS: 4}",
    "setup": "shell lines run before every job, like 'conda activate exp'",
    "proxy_jump": "a jump host, like user@bastion:22",
    "slurm": "this host is a Slurm login node: {partition: gpu, max_queued: 64, ...}",
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
    host, why = normalize_host(raw_ip.strip())
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
        bad_user = check_user(raw_user)
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

    def flag(key: str) -> bool:
        raw = given(key)
        if raw is not None and not isinstance(raw, bool):
            raise ConfigError(f"{at(key)}: '{key}' must be true or false, got {_show(raw)}")
        return bool(raw)

    forward_agent = flag("forward_agent")
    legacy_algorithms = flag("legacy_algorithms")
    env = parse_env(given("env"), at("env")) if given("env") is not None else ()
    setup = parse_setup(given("setup"), at("setup")) if given("setup") is not None else ()

    proxy_jump: str | None = None
    raw_jump = given("proxy_jump")
    if raw_jump is not None:
        proxy_jump = check_proxy_jump(raw_jump, at("proxy_jump"), "'proxy_jump'")

    slurm = parse_slurm_section(given("slurm"), at("slurm")) if "slurm" in data else None

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
        legacy_algorithms=legacy_algorithms,
        env=env,
        setup=setup,
        slurm=slurm,
        source=source,
    )


def check_proxy_jump(value: object, at: str, what: str) -> str | None:
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



def read_text(path: Path, what: str) -> str:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_MACHINE_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError(
            f"cannot read {what} {tilde_path(path)}: {err.strerror or err} (check it exists and "
            "is readable)"
        ) from None
    if len(data) > MAX_MACHINE_FILE_BYTES:
        raise ConfigError(
            f"{tilde_path(path)}: larger than {MAX_MACHINE_FILE_BYTES} bytes, not a {what} "
            "(check the path)"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{tilde_path(path)}: not valid UTF-8 at byte {err.start} (save the {what} as UTF-8)"
        ) from None


