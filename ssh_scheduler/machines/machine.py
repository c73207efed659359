"""The :class:`Machine` every machine spec turns into (a machine YAML, an ``~/.ssh/config``
alias, ``user@host:port``, a host range), this coordinator's own machine, and the checks every
way in shares: user names, host names, jump hosts, a bounded read of a local file.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.machines.slurm import SlurmSettings

DEFAULT_WORKDIR = "~/.ssh_scheduler"
DEFAULT_PORT = 22
DEFAULT_MAX_SESSIONS = 10
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_KEEP_WARM = 60.0
"""Seconds of idleness the hub keeps a host's connection (and agent) for the next command."""
DEFAULT_PYTHON = "python3"

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
    python: str = DEFAULT_PYTHON
    """``python:``: the interpreter that runs ``Executor`` calls there (a shell word, run after
    ``setup:``: a venv's ``python``, or ``python3`` on the PATH)."""
    legacy_algorithms: bool = False
    """Also offer SHA-1 key exchange, ``ssh-rsa`` signatures, ``hmac-sha1`` and ``umac-64``
    (an old host that speaks nothing newer)."""
    is_local: bool = False
    """The coordinator's own machine, run without SSH."""
    slurm: SlurmSettings | None = None
    """``slurm:``: the host is a Slurm login node; jobs go to Slurm through it (executor_slurm)."""
    keep_warm: float | None = None
    """``keep_warm:``: seconds of idleness the hub keeps its connection for the next command
    (0: none, connect directly); ``None``: the default (transport/hub_client.keep_warm_of)."""
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


def check_keep_warm(value: object, what: str) -> float:
    """A ``keep_warm`` value (``what``: the YAML key where it is, or ``--keep-warm``): seconds,
    0 or more."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"{what} must be a number of seconds, 0 or more (0: no warm connection), got {show_value(value)}"
        )
    return float(value)


def with_keep_warm(machines: list[Machine], seconds: float | None) -> list[Machine]:
    """The machines with ``--keep-warm`` applied (``None``: not given, each keeps its own)."""
    if seconds is None:
        return machines
    value = check_keep_warm(seconds, "--keep-warm")
    return [dataclasses.replace(m, keep_warm=value) for m in machines]


# --------------------------------------------------------------------------------------------
# small helpers




def tilde_path(path: Path | str) -> str:
    """Show a path with the home directory written as ``~``."""
    text = str(path)
    home = os.path.expanduser("~")
    if home not in ("", "/", "~") and (text == home or text.startswith(home.rstrip("/") + "/")):
        text = "~" + text[len(home.rstrip("/")) :]
    return plain_text(text)



_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,255}\$?")
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_SCOPE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_PROXY_JUMP_RE = re.compile(r"[A-Za-z0-9_.@:,\[\]%-]+")


def check_user(value: str) -> str | None:
    """None if fine, else why not."""
    if _USER_RE.fullmatch(value):
        return None
    return (
        f"user name {show_value(value)} is not a valid user name (letters, digits, '_', '.', '-', '@'; "
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
        f"host {show_value(value)} is not a valid host ({hint}; no spaces, '/', or shell characters, "
        "not starting with '-')"
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
            f"{show_value(value)} (no spaces or shell characters)"
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
