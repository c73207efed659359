"""Where jobs run: the one interface every backend implements, and the one request it runs.

An :class:`Executor` is one place jobs can run (a host reached over SSH or this machine, both
driven through our stdlib agent; a Slurm cluster through its login node).  The coordinator and
the per-job pipeline speak only to this interface: open it (``executors.backends``), probe it,
stage inputs and run a job there, bring results back, close it.

A run is one :class:`RunRequest`: everything any backend needs to run one attempt of one job
(what to run, the job's needs and timeout, its environment and folder, the inputs, what to bring
back, the limits) and a hook it calls when the job really runs.  The coordinator fills it in
the same way whatever the backend; a backend takes what it needs from it (Slurm: the needs and
timeout for ``sbatch``) and ignores the rest.  A new backend is a class here in ``executors/``
and a line in ``executors.backends``; it never needs a coordinator change.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, assert_never

from ssh_scheduler.executors.job_events import JobExit
from ssh_scheduler.executors.stage_plan import StagePlan
from ssh_scheduler.executors.transfer import CopyBackReport, CopyLimits
from ssh_scheduler.jobs.forward import ForwardSet
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.jobs.python_call import INFO, PAYLOAD, RESULT, RUNNER, PythonCall
from ssh_scheduler.machines.host_state import HostState, OwnUsage
from ssh_scheduler.machines.machine import DEFAULT_PYTHON, Machine
from ssh_scheduler.machines.machine_env import PYTHON_WORD, with_setup

__all__ = ["Executor", "OutputSink", "RunRequest", "ShellCommand", "StartedHook", "Work", "python_word", "shell_line"]

OutputSink = Callable[[int, bytes], None]
"""Where a job's output goes as it arrives: (fd 1 or 2, bytes)."""

StartedHook = Callable[[str], None]
"""Called once when the job really runs, with what names it there: its Slurm job id on a Slurm
machine, ``""`` where the backend gives it no name of its own (a host)."""


@dataclass(frozen=True, slots=True)
class ShellCommand:
    """A command line, run by the host's ``bash --norc -c`` in the job's folder."""

    line: str


Work = ShellCommand | PythonCall
"""What a job runs: one class per kind of work, each handled in :func:`shell_line`, the
executors (:mod:`ssh_scheduler.executors.python_call` stages a call's inputs) and the agent; the
coordinator only passes it through.  A :class:`PythonCall` is a pickled function call that the
machine's Python runs through ``agent/call_runner.py``."""


def _no_hook(_name_there: str) -> None:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRequest:
    """One attempt of one job, as every backend gets it (see the module docstring).  Built by
    the coordinator (``execute_batch``), ``execute_remote`` and ``execute_to``; the per-job
    pipeline (``coordinator.jobrun``) adds :attr:`staged` and hands it to the executor."""

    name: str
    """The job's name (unique in its batch): how the host's agent and Slurm know the run."""
    work: Work
    """What to run."""
    jobdir: str
    """The job's private folder there (see :meth:`Executor.jobdir`); the work runs in it."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables the work gets, beyond the host's own (the job's and the machine's ``env:``)."""
    setup: tuple[str, ...] = ()
    """The machine's ``setup:`` lines, run first in the same shell (``execute_batch`` only)."""
    needs: Needs | None = None
    """What the job needs (the planner's), or None where nothing was placed (``execute_remote``,
    ``execute_to``).  Slurm asks for it; a host was placed on by the planner already."""
    gpus: tuple[int, ...] | None = None
    """The GPUs the planner placed it on (indices on the host; also in ``env`` as
    ``CUDA_VISIBLE_DEVICES``), or None where we did not place it."""
    timeout: float | None = None
    """Seconds the job may run once started (``--timeout``), or None.  Who kills on it is the
    caller's (the batch's planner, or the pipeline); Slurm also gets it as ``--time``."""
    forward: ForwardSet = ForwardSet((), ())
    """What to copy forward (:meth:`Executor.stage` puts it in the host's cache)."""
    staged: StagePlan | None = None
    """What :meth:`Executor.stage` returned for :attr:`forward`: linked into :attr:`jobdir` as
    the job starts (None: nothing to link)."""
    copy_backwards: tuple[str, ...] | None = None
    """What to bring back: None is what the job created or changed; ``()`` nothing."""
    limits: CopyLimits = CopyLimits()
    """Bytes and files the results may have, and bytes of output it may print."""
    keep_output: bool = True
    """Keep its output on the host too, so a coordinator that reattaches catches up."""
    on_started: StartedHook = _no_hook
    """Called once when the job really runs there (see :data:`StartedHook`); not for a job
    taken up again with :meth:`Executor.resume` (it started under an earlier coordinator)."""


def shell_line(request: RunRequest, python: str = DEFAULT_PYTHON) -> str:
    """The shell text that runs the request's work there: the machine's setup lines, then the
    work (for a backend that runs shell text: an agent's host, a Slurm batch script).  A Python
    call is the runner, run by the machine's ``python`` in the job's folder (its inputs, the
    runner among them, staged there: ``executors.python_call``); ``-B``: the user's modules
    leave no ``__pycache__`` among the results, ``-u``: what the call prints streams home."""
    work = request.work
    match work:
        case ShellCommand(line=line):
            return with_setup(line, request.setup)
        case PythonCall():
            return with_setup(f"exec {python_word(python)} -B -u {RUNNER} {PAYLOAD} {RESULT} {INFO}", request.setup)
    assert_never(work)


def python_word(python: str) -> str:
    """The machine's Python as shell text: a path as the YAML allows it is one shell word (its
    ~ expands); anything else set through the Python API is quoted whole."""
    return python if PYTHON_WORD.fullmatch(python) else shlex.quote(python)


class Executor(Protocol):
    """One place to run jobs.  Every method reports expected failures as data where it can
    (a lost host ends a run with ``JobExit(host_lost=True)``) and raises
    :class:`~ssh_scheduler.errors.TransportError` otherwise."""

    machine: Machine

    @property
    def name(self) -> str: ...

    @property
    def lost(self) -> str | None:
        """Why the link to it is gone, or None while it is up."""

    @property
    def agent_jobs(self) -> dict[str, dict[str, Any]]:
        """Jobs an earlier coordinator left there: job -> {"running": bool, ...}."""

    @property
    def bytes_sent(self) -> int: ...

    @property
    def files_sent(self) -> int: ...

    def jobdir(self, token: str, job: str) -> str:
        """The job's private folder there."""

    async def probe(self) -> tuple[HostState, dict[str, OwnUsage]]: ...

    async def stage(self, forward: ForwardSet) -> StagePlan:
        """Make sure the inputs are there; returns what the run links into the job's folder
        (for :attr:`RunRequest.staged`)."""

    async def run(self, request: RunRequest, on_output: OutputSink) -> JobExit:
        """Run the request's work to its end, its output streamed to ``on_output``; call
        ``request.on_started`` once when it really runs.  Cancelling this kills it there."""

    async def resume(self, request: RunRequest, offsets: tuple[int, int], on_output: OutputSink) -> JobExit:
        """Follow the job an earlier coordinator started (see :attr:`agent_jobs`) to its end:
        its output after ``offsets`` (bytes of stdout, stderr already received) first."""

    async def kill(self, job: str) -> None: ...

    async def fetch(
        self, job: str, jobdir: str, dest: Any, paths: tuple[str, ...] | None, limits: CopyLimits, entries: object
    ) -> CopyBackReport: ...

    async def remove(self, jobdir: str, job: str | None = None, *, wait: bool = True) -> None: ...

    async def sweep(self, prefix: str) -> None: ...

    async def close(self) -> None: ...
