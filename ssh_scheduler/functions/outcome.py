"""What a call gave: its value, the exception it raised, or why it gave neither.

Read from the call's results folder (``job_results/<job>/``), where its result came home with
the job's other results: ``INFO`` says how it ended (``agent/call_runner.py`` wrote it), ``RESULT``
holds the pickled value or exception.  The value is read straight from the file (a 50 MB value is
held once, as the value).  An exception is re-raised here as itself, with the remote traceback as
its ``__cause__`` (a :class:`RemoteTraceback`, as ``concurrent.futures`` does for a process
pool's) and a note naming the host; one that does not unpickle here becomes a
:class:`RemoteError` with its type, message and traceback.  Anything else that kept a call from
its value (it could not load on its host, timed out, lost its result, never ran) is a
:class:`CallError`: one line, naming the call, the host and the fix.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ssh_scheduler.errors import ConfigError, SchedulerError
from ssh_scheduler.jobs.python_call import INFO, RESULT
from ssh_scheduler.results.untrusted import open_untrusted, parse_json, read_untrusted

__all__ = ["CallError", "Outcome", "RemoteError", "RemoteTraceback", "read_outcome"]

INFO_LIMIT = 1 << 20
"""The most of ``INFO`` read: the runner writes a few kB (its traceback is cut at 20,000
characters); anything larger is not what it wrote."""


class CallError(SchedulerError):
    """A call did not give a value or an exception of its own: ``str(err)`` says why, on which
    host, and the fix.  ``job`` is the call's job name (its results folder)."""

    def __init__(self, message: str, *, job: str = "", host: str = "") -> None:
        super().__init__(message)
        self.job = job
        self.host = host


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a host, as text: the ``__cause__`` of that
    exception re-raised here, so a printed traceback shows where it was raised there."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


class RemoteError(CallError):
    """Stands in for an exception raised on a host that does not unpickle here (its class is
    not importable here, say): ``type_name``, ``remote_message`` and ``traceback`` are its."""

    def __init__(self, type_name: str, message: str, traceback: str, *, job: str, host: str, why: str) -> None:
        super().__init__(
            f"{type_name}: {message} (raised by call {job} on {host}; the exception itself "
            f"does not unpickle here: {why})",
            job=job,
            host=host,
        )
        self.type_name = type_name
        self.remote_message = message
        self.traceback = traceback


@dataclass(frozen=True, slots=True)
class Outcome:
    """A call's end: its ``value``, or the ``error`` to raise from its future."""

    value: Any = None
    error: BaseException | None = None


def _version(info: dict[str, Any]) -> tuple[int, ...]:
    python = info.get("python")
    return tuple(int(n) for n in python) if isinstance(python, list) and python else (0, 0)


def _loads_here(info: dict[str, Any]) -> bool:
    """Can this Python load the pickle?  Code (a function in the value) only on its minor version."""
    return not info.get("code") or _version(info)[:2] == sys.version_info[:2]


def _shown_version(info: dict[str, Any]) -> str:
    return ".".join(str(n) for n in _version(info))


def read_outcome(results_dir: Path, job: str, host: str, failure: str | None = None) -> Outcome:
    """The outcome of call ``job`` from its results folder.  ``failure``: why the job failed
    when it did (timed out, its result could not be copied home...), for a call that left no
    result."""
    folder = results_dir / job
    # Read as main reads any results folder (results/untrusted): no link followed, no FIFO
    # waited on, nothing unbounded; what is wrong there is the call's error, in one line.
    try:
        data = read_untrusted(folder / INFO, "a call's result", INFO_LIMIT)
        info = None if data is None else parse_json(data)
        if data is not None and not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except ConfigError as exc:
        return Outcome(error=CallError(f"call {job}: {exc}", job=job, host=host))
    except ValueError as exc:
        return Outcome(error=CallError(f"call {job}: its result {folder / INFO} is unreadable ({exc})", job=job, host=host))
    if info is None:
        why = failure or "it ended without writing one"
        return Outcome(error=CallError(
            f"call {job} on {host} left no result ({why}); its output is in "
            f"{results_dir / job}.out and .err", job=job, host=host,
        ))  # fmt: skip
    kind = info.get("kind")
    if kind == "refused":
        return Outcome(error=CallError(f"{host}: {info.get('message', 'the call did not load')}", job=job, host=host))
    if kind == "raised":
        return Outcome(error=_raised(folder, info, job, host))
    if kind != "value":
        return Outcome(error=CallError(f"call {job}: its result says {kind!r}, not how a call ends", job=job, host=host))
    if not _loads_here(info):
        return Outcome(error=CallError(
            f"the value of call {job} holds code pickled by Python {_shown_version(info)} on "
            f"{host}; this Python is {sys.version.split()[0]} and cannot load it; fix: return "
            f"plain data, or run the script with a Python {_version(info)[0]}.{_version(info)[1]}",
            job=job, host=host,
        ))  # fmt: skip
    try:
        with _result_file(folder) as f:
            return Outcome(value=pickle.load(f))
    except ConfigError as exc:
        return Outcome(error=CallError(f"call {job}: {exc}", job=job, host=host))
    except Exception as exc:  # (unpickling runs any class's code)
        return Outcome(error=CallError(
            f"the value of call {job} from {host} does not unpickle here ({type(exc).__name__}: "
            f"{str(exc)[:200]}); fix: return values whose classes this script can import",
            job=job, host=host,
        ))  # fmt: skip


def _result_file(folder: Path) -> IO[bytes]:
    """``RESULT``, open: a regular file, no link followed (read as a stream, so a 50 MB value is
    held once, as the value)."""
    stream = open_untrusted(folder / RESULT, "a call's pickled result")
    if stream is None:
        raise ConfigError(f"{folder / RESULT} is missing, though {INFO} says the call wrote it")
    return stream


def _raised(folder: Path, info: dict[str, Any], job: str, host: str) -> BaseException:
    """The exception the call raised, as itself where it unpickles, else a :class:`RemoteError`;
    either way carrying the remote traceback."""
    text = str(info.get("traceback", ""))
    why = str(info.get("unpickled") or "")
    exc: object = None
    if info.get("pickled") and _loads_here(info):
        try:
            with _result_file(folder) as f:
                exc = pickle.load(f)
        except ConfigError as problem:
            why = str(problem)
        except Exception as problem:
            why = f"{type(problem).__name__}: {str(problem)[:200]}"
    elif info.get("pickled"):
        why = f"it holds code of Python {_shown_version(info)}"
    if not isinstance(exc, BaseException):
        type_name = str(info.get("type", "Exception"))
        exc = RemoteError(type_name, str(info.get("message", "")), text, job=job, host=host, why=why or "unknown")
    assert isinstance(exc, BaseException)
    exc.__cause__ = RemoteTraceback(text)
    exc.add_note(f"(raised by call {job} on {host}; its traceback there is above)")
    return exc
