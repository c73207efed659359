"""A Python function call as a job's work: what travels, and where it lies in the job's folder.

``ssh_scheduler.Executor`` (:mod:`ssh_scheduler.functions`) pickles a call into a local file; the
call is a job like any other whose work is a :class:`PythonCall` instead of a shell line.  The
executors stage the file into the job's folder with the call runner and cloudpickle's sources
(:mod:`ssh_scheduler.executors.python_call`), the machine's Python runs the runner there
(``agent/call_runner.py``), and the runner leaves the return value, or the exception, in
:data:`RESULT` and how it ended in :data:`INFO`; both come home with the job's other results.
Everything of ours lies under :data:`CALL_FOLDER`, out of the way of the copied-forward files.
Pure: names and one value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["CALL_FOLDER", "CLOUDPICKLE_FOLDER", "INFO", "PAYLOAD", "RESULT", "RUNNER", "WARM_RUNNER", "PythonCall"]

CALL_FOLDER = ".ssh_scheduler_call"
"""Our folder in a call's job folder (and so in its results folder)."""
PAYLOAD = f"{CALL_FOLDER}/call.pickle"
"""The pickled call: a header line, then the function and its arguments (functions/payload.py)."""
RESULT = f"{CALL_FOLDER}/result.pickle"
"""What the call left: its return value or exception, pickled (the runner writes it)."""
INFO = f"{CALL_FOLDER}/result.json"
"""How the call ended (JSON, written last: its presence means :data:`RESULT` is whole)."""
RUNNER = f"{CALL_FOLDER}/call_runner.py"
"""The runner (``agent/call_runner.py``), run by the machine's Python in the job's folder."""
WARM_RUNNER = f"{CALL_FOLDER}/ssh_scheduler_call_warm.py"
"""Beside it, what a warm interpreter runs (``agent/call_warm.py``), imported by this name (one
no user's module has: the interpreter keeps it loaded while it imports the calls' modules)."""
CLOUDPICKLE_FOLDER = f"{CALL_FOLDER}/lib"
"""Where cloudpickle's own sources lie for the runner (first on its ``sys.path``)."""


@dataclass(frozen=True, slots=True)
class PythonCall:
    """A job's work when it is a Python call: the pickled call, a local file staged into the
    job's folder as :data:`PAYLOAD` (through the host's content-addressed cache, like any input).
    The job's ``command`` only describes the call (for lines, the journal and status)."""

    path: Path
    """The pickled call, here."""
    key: str
    """Its cache key on the hosts: its sha256 and ``-r`` (as ``jobs.forward`` keys a file)."""
    size: int
