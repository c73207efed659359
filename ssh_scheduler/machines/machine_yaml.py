"""Machine YAML files, read into the :class:`~ssh_scheduler.machines.machine.Machine` record.

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
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.machines.machine import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_KEEP_WARM,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_PORT,
    DEFAULT_PYTHON,
    DEFAULT_WORKDIR,
    Machine,
    check_keep_warm,
    check_proxy_jump,
    check_user,
    normalize_host,
)
from ssh_scheduler.machines.machine_env import parse_env, parse_python, parse_setup
from ssh_scheduler.machines.slurm import parse_slurm_section

__all__ = ["MACHINE_KEYS", "parse_machine_yaml"]

_show = show_value
_plain = plain_text
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


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
    "python": "the Python that runs Executor calls, like ~/venvs/exp/bin/python, default python3",
    "proxy_jump": "a jump host, like user@bastion:22",
    "slurm": "this host is a Slurm login node: {partition: gpu, max_queued: 64, ...}",
    "keep_warm": f"seconds the hub keeps the connection warm after a command, 0 = off, default {DEFAULT_KEEP_WARM:g}",
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


_FAST_LOADER = getattr(yaml, "CSafeLoader", None)
"""libyaml's parser, where PyYAML has it: 0.05 ms a machine file against 0.8 ms in Python (a
64-host command reads 64 of them before it connects)."""


def _read(how: Any, text: str) -> Any:
    """``yaml.compose`` or ``yaml.load`` of ``text`` with the safe loader: libyaml's where it
    reads the file, else Python's, whose answer (the value, or the error and its message) is the
    one every machine file always got."""
    if _FAST_LOADER is not None:
        try:
            return how(text, Loader=_FAST_LOADER)
        except (yaml.YAMLError, ValueError, OverflowError, RecursionError):
            pass  # said (or read) as Python's parser says it
    return how(text, Loader=yaml.SafeLoader)


def parse_machine_yaml(text: str, *, source: str, base_dir: Path | None = None) -> Machine:
    """Parse one machine YAML document.

    ``source`` names the file in messages and becomes ``Machine.source``; the file stem is the
    default display name.  Relative ``ssh_key_path``/``known_hosts`` entries are resolved
    against ``base_dir`` (default: the directory of ``source``).
    """
    base = base_dir if base_dir is not None else Path(source).parent
    shown = _plain(source)
    try:
        node = _read(yaml.compose, text)
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
        data = _read(yaml.load, text)
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
    python = parse_python(given("python"), at("python")) if given("python") is not None else DEFAULT_PYTHON

    proxy_jump: str | None = None
    raw_jump = given("proxy_jump")
    if raw_jump is not None:
        proxy_jump = check_proxy_jump(raw_jump, at("proxy_jump"), "'proxy_jump'")

    slurm = parse_slurm_section(given("slurm"), at("slurm")) if "slurm" in data else None
    keep_warm = check_keep_warm(given("keep_warm"), f"{at('keep_warm')}: 'keep_warm'") if given("keep_warm") is not None else None

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
        python=python,
        slurm=slurm,
        keep_warm=keep_warm,
        source=source,
    )

