"""Starting the agent on a host: a small first stage on the command line, the agent on its stdin.

The command line carries only the first stage (agent/boot.py, its text as one line) and four
short arguments, so it keeps its size however large the agent grows: Linux refuses one argument
over 128 KiB (MAX_ARG_STRLEN), and the agent itself, sent as an argument, had reached 32 KB.
The agent's modules follow on the process's stdin, compressed, before the protocol begins; the
first stage reads exactly that many bytes (the way mitogen boots its children).  Every transport
(SSH, this machine, the hostile test server) starts agents this way: :func:`agent_start`.
"""

from __future__ import annotations

import functools
import hashlib
import shlex
import zlib
from dataclasses import dataclass
from pathlib import Path

from ssh_scheduler.agent import boot

AGENT_FOLDER = Path(boot.__file__).parent
"""Where the agent's modules are: their files are what travels."""


@dataclass(frozen=True, slots=True)
class AgentStart:
    """How to start the agent: run ``command`` in a shell on the host, then write ``payload``
    on its stdin (before any request)."""

    command: str
    payload: bytes


@functools.cache
def first_stage() -> str:
    """The first stage as one line: ``exec`` of its text as a string literal (tcsh and fish, as
    login shells, refuse a newline inside quotes; ``repr`` escapes every one)."""
    text = (AGENT_FOLDER / "boot.py").read_text()
    return f"exec({text!r})"


@functools.cache
def agent_code() -> tuple[bytes, str]:
    """The agent's modules (boot.MODULES, in order), their sources joined by NUL and compressed,
    and the key naming them: the sha256 of exactly those bytes, which the first stage checks."""
    sources = b"\0".join((AGENT_FOLDER / f"{name}.py").read_bytes() for name in boot.MODULES)
    payload = zlib.compress(sources, 9)
    return payload, hashlib.sha256(payload).hexdigest()


def agent_start(python: str, root: str, token: str = "") -> AgentStart:
    """The agent's start for a host: ``python`` (a shell word), its work root, and a batch
    ``token`` (with one, a still-running agent of that batch is reattached to: see relay.py)."""
    payload, key = agent_code()
    # -I -S: no site packages or PYTHON* variables to read, half the start-up time; the agent
    # needs only the standard library.  -u: every answer leaves at once.
    command = (
        f"exec {python} -u -I -S -c {shlex.quote(first_stage())} {shlex.quote(root)} "
        f"{shlex.quote(token)} {key} {len(payload)}"
    )
    return AgentStart(command, payload)
