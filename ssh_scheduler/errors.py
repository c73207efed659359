"""The project's own small exception tree.

Every error a user can cause (bad YAML, an unknown host key, a job that can never fit) is one of
these, carries a one-line message that says what is wrong and how to fix it, and maps to an exit
status in the CLI.  Expected failures while a batch runs (a job's non-zero exit, a host that drops)
are *data* (results, events), not exceptions.
"""

from __future__ import annotations


def plain_text(text: object, limit: int | None = None, *, tabs: bool = False) -> str:
    """THE sanitizer: text from outside (a host, a job, a file, a socket, a command line) as
    it may reach a terminal.  Every character a terminal could act on is written as its escape:
    C0 and C1 controls (ESC, CSI, BEL, a carriage return, a newline), DEL, bidi overrides and
    other format characters, line and paragraph separators, lone surrogates (undecodable bytes).
    So no text shown can retitle a window, clear the screen, move the cursor or start a line of
    its own (a fake ``done:``).  Printable text, backslashes included, is left as it is.  Cut
    to ``limit`` characters (ending ``...``) when given.  ``tabs``: a tab is kept (a line of
    tab-separated values; a tab cannot move back over text).  Every printer of the CLI, the live
    view and the library's log lines go through it; fields are also passed through it where the
    layout must be measured (tables)."""
    shown = text if isinstance(text, str) else "" if text is None else str(text)
    if not shown.isprintable():
        shown = "".join(c if c.isprintable() or (tabs and c == "\t") else _escape(c) for c in shown)
    if limit is not None and len(shown) > limit:
        shown = shown[: max(limit - 3, 0)] + "..."
    return shown


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def show_value(value: object, limit: int = 80) -> str:
    """A user value for a one-line message: its repr (quoted, escaped), cut if long."""
    text = plain_text(repr(value))
    if len(text) > limit:
        text = text[: limit - 4] + "...'"
    return text


class SchedulerError(Exception):
    """Base class: ``str(err)`` is the one line shown to the user."""

    exit_code: int = 2


class ConfigError(SchedulerError):
    """A machine file, ssh config entry or command-line value is unusable."""


class BatchError(SchedulerError):
    """A batch file line or job name is unusable."""


class UnsatisfiableError(SchedulerError):
    """A job asks for more than any machine could ever give it."""


class NoUsableHostError(SchedulerError):
    """No host of the batch can run anything (each is unreachable, quarantined or unusable):
    nothing was run.  Decided by the planner, which knows nothing of transports; it exits like
    a connection error (255, as ``ssh`` does when it cannot reach its host)."""

    exit_code = 255


class ProbeError(SchedulerError):
    """A host's probe output could not be understood."""


class TransportError(SchedulerError):
    """Talking to a host failed (base of the connection errors)."""

    exit_code = 255


class HostUnreachableError(TransportError):
    """The host did not answer within its connect timeout, or refused the connection."""


class HostKeyError(TransportError):
    """The host's key is unknown or changed; nothing was sent to it."""


class AuthenticationError(TransportError):
    """The host rejected every key we offered."""


class ConnectionLostError(TransportError):
    """An established connection dropped."""


class AgentStartError(ConnectionLostError):
    """The host was reached and logged into, but our agent could not start there (no python3,
    an unwritable work root...): the message names the cause and its fix."""


class TransferError(SchedulerError):
    """A copy forward or back was refused or failed (unsafe name, limit exceeded, I/O error)."""


class LocalWriteError(TransferError):
    """Writing on this machine failed (a full disk, a quota, an unwritable results folder): the
    batch's failure, never a host's.  Nothing new starts; what could not come home stays on its
    host."""


class ConflictError(SchedulerError):
    """combine_folders found the same path with different content."""
