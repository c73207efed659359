"""THE per-job pipeline: stage inputs, run, stream output home, fetch results, commit, clean up.

``execute_batch`` (through the coordinator), ``execute_remote`` and ``execute_to`` with
copy-forwards all run a job through :class:`JobRun`, so a job behaves the same whichever command
started it: the same environment (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``,
``SSH_SCHEDULER_JOB``), output kept on the host for a reattaching coordinator, inputs staged
in the run request itself (one round trip), a timeout that kills the whole process tree,
results brought home atomically, and the host folder removed once they are (when they do not
all come home, nothing is removed there: they stay on the host).  Each caller describes the job
in one :class:`~ssh_scheduler.executors.base.RunRequest`, which the pipeline hands to the
executor whatever its backend.

Cancellation kills, waits, re-raises (trio's ``run_process``): cancelling :meth:`JobRun.run`
kills the job's process tree on its host, waits for it to be gone, removes its folder, and
re-raises.  Expected failures are data: a lost host ends the run with ``Ended(host_lost=True)``.
A write that fails here (a full disk) is never the host's: the output files say it as their
``failure`` and the commit as its ``batch_failure``, and the batch decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from ssh_scheduler.errors import LocalWriteError, SchedulerError, TransferError, TransportError
from ssh_scheduler.events import TIMED_OUT, Ended
from ssh_scheduler.executors.base import Executor, RunRequest
from ssh_scheduler.executors.transfer import BudgetSpent, CopyBackReport, CopyBudget, Destination
from ssh_scheduler.results.local_folder import local_write_error, open_results_folder
from ssh_scheduler.transport.base import bounded

__all__ = ["Committed", "JobRun", "Output", "OutputFiles", "job_environment"]

log = logging.getLogger(__name__)


def job_environment(job: str, gpus: str | Sequence[int] | None) -> dict[str, str]:
    """What every job finds in its environment.  ``gpus=None`` leaves CUDA_VISIBLE_DEVICES as
    the host has it (execute_remote without --gpus); ``()`` hides every GPU; a string is used as
    written (``execute_remote --gpus GPU-uuid``)."""
    env = {"SSH_SCHEDULER_JOB": job}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus if isinstance(gpus, str) else ",".join(str(g) for g in gpus)
        # nvidia-smi numbers GPUs in PCI order; CUDA's default order may differ.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


class Output(Protocol):
    """Where a job's output goes as it arrives (fd 1 or 2)."""

    @property
    def offsets(self) -> tuple[int, int]:
        """Bytes of stdout and stderr already received (a resumed job continues after them)."""

    def write(self, fd: int, data: bytes) -> None: ...


@dataclass(slots=True)
class OutputFiles:
    """``job_results/<job>.out`` / ``.err``, plus any live sinks (execute_remote's terminal).

    A file is created at the stream's first byte, and the one a job never wrote to at its end
    (:meth:`complete`): most jobs of a big batch print nothing, and two file creations before
    each job were the coordinator's largest per-job cost (event loop blocked in open(2) on a
    busy disk), while every job that ended must have both (GNU parallel's ``--results`` and
    Slurm make both).  An earlier attempt's file is emptied at :meth:`open`, so what is there is
    this attempt's.  Every file is created relative to ``folder``, the results folder's verified
    descriptor (opened here when None), and never through a link.

    Writing never raises: an exception would end the host's reader and every job there would
    look lost.  A write that fails (a full disk here) is :attr:`failure`, said once through
    ``on_failure``; that stream's later output is dropped here, the terminal mirror still gets
    it, and the host keeps its own copy.
    """

    results_dir: Path
    name: str
    append: bool = False
    mirror: dict[int, list[int]] = field(default_factory=dict)
    folder: int | None = None
    on_failure: Callable[[str], None] | None = None
    failure: str | None = None
    """The first write here that failed, as one line (None: everything was written)."""
    opened: bool = False
    """:meth:`open` found no link in the way."""
    _fds: dict[int, int] = field(default_factory=dict)
    _have: set[int] = field(default_factory=set)  # streams whose file is there (this attempt's)
    _dropped: set[int] = field(default_factory=set)  # streams no longer written here

    def open(self) -> None:
        """Check both files now (a link in the way fails the job before it runs) and empty an
        earlier attempt's; creating a missing one waits for its first byte (:meth:`write`)."""
        for fd in (1, 2):
            try:
                self._open(fd, create=self.append)
            except FileNotFoundError:
                pass  # nothing there: created on the first byte
            except OSError as exc:
                self.close()
                raise self._refused(fd, exc) from None
        self.opened = True

    def _file(self, fd: int) -> str:
        return f"{self.name}{'.out' if fd == 1 else '.err'}"

    def _open(self, fd: int, *, create: bool) -> None:
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if self.append else os.O_TRUNC)
        folder = self.folder if self.folder is not None else open_results_folder(self.results_dir, create=False)
        try:
            self._fds[fd] = os.open(self._file(fd), flags | (os.O_CREAT if create else 0), 0o644, dir_fd=folder)
            self._have.add(fd)
        finally:
            if folder != self.folder:
                os.close(folder)

    def _refused(self, fd: int, exc: OSError) -> LocalWriteError:
        return local_write_error(exc, self.results_dir, f"writing {self._file(fd)}")

    @property
    def offsets(self) -> tuple[int, int]:
        return self._size(1), self._size(2)

    def _size(self, fd: int) -> int:
        if fd in self._fds:
            return os.fstat(self._fds[fd]).st_size
        return 0  # open() found no file (the append mode creates both): nothing received yet

    def write(self, fd: int, data: bytes) -> None:
        if fd not in self._have and fd not in self._dropped:
            try:
                self._open(fd, create=True)
            except (OSError, SchedulerError) as exc:
                self._fail(fd, exc)
        if fd in self._fds:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fds[fd], view) :]
            except OSError as exc:
                self._fail(fd, exc)
        for target in self.mirror.get(fd, ()):
            try:
                os.write(target, data)
            except OSError as exc:  # a closed terminal or pipe: the files still get everything
                log.info("%s: output to fd %d stopped: %s", self.name, target, exc.strerror or exc)
                self.mirror[fd] = [t for t in self.mirror[fd] if t != target]

    def _fail(self, fd: int, exc: OSError | SchedulerError) -> None:
        """This stream is no longer written here (said once per stream; the first is the
        :attr:`failure`)."""
        line = str(self._refused(fd, exc) if isinstance(exc, OSError) else exc)
        self._dropped.add(fd)
        if fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(self._fds.pop(fd))
        log.info("%s: %s; the rest of this output stays on the host", self.name, line)
        if self.failure is None:
            self.failure = line
            if self.on_failure is not None:
                self.on_failure(line)

    def complete(self) -> str | None:
        """The job ended: create (empty) whichever file it never wrote, so every job that ended
        has both.  Returns why that failed (also :attr:`failure`), or None."""
        for fd in (1, 2):
            if fd not in self._have and fd not in self._dropped:
                try:
                    self._open(fd, create=True)
                except (OSError, SchedulerError) as exc:
                    self._fail(fd, exc)
                else:
                    os.close(self._fds.pop(fd))
        return self.failure

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True, slots=True)
class Committed:
    """What :meth:`JobRun.commit` did: the copy-back's ``report``, or why the results did not
    come home (``problem``); then they stay on the host at ``kept_at``, and ``batch_failure``
    says the cause is here (a full disk, the batch's copy-back budget spent), not the host."""

    report: CopyBackReport | None
    problem: str | None = None
    kept_at: str = ""
    batch_failure: bool = False


class JobRun:
    """One attempt of one job on one executor: ``request`` is what the executor runs (the
    pipeline adds the staging), ``output`` where its output goes as it arrives, ``results_dir``
    where :meth:`commit` brings its results (``<results_dir>/<job>``).

    ``request.timeout`` is enforced here, counted from the request's started hook, unless
    ``enforce_timeout`` is False (the batch: its planner counts it and calls :meth:`stop`).
    ``folder``: ``results_dir``'s verified descriptor (opened for the commit when None);
    ``budget``: the batch's copy-back budget, shared by its jobs."""

    def __init__(
        self,
        executor: Executor,
        request: RunRequest,
        output: Output,
        results_dir: Path,
        *,
        enforce_timeout: bool = True,
        folder: int | None = None,
        budget: CopyBudget | None = None,
    ) -> None:
        self.executor = executor
        self.request = request
        self.output = output
        self.results_dir = results_dir
        self.enforce_timeout = enforce_timeout
        self.folder = folder
        self.budget = budget
        self._stop_reason: str | None = None
        self._entries: object = None

    async def run(self, *, resume: bool = False, on_staged: Callable[[], None] = lambda: None) -> Ended:
        """Stage, run and stream the job to its end (``on_staged``: the inputs are on the host).
        Never raises for the job's own failure or a lost host; cancelling it kills the job's
        processes, removes its folder, re-raises."""
        request, executor = self.request, self.executor
        try:
            if resume:
                exit_ = await executor.resume(request, self.output.offsets, self.output.write)
            else:
                try:
                    staged = await executor.stage(request.forward)
                except TransportError as exc:
                    return Ended(None, host_lost=True, message=str(exc))
                on_staged()
                request = replace(request, staged=staged)
                seconds = request.timeout if self.enforce_timeout else None
                if seconds is None:
                    exit_ = await executor.run(request, self.output.write)
                else:
                    # Armed when the job really starts (a queue before it does not count).
                    deadline = asyncio.timeout(None)
                    loop = asyncio.get_running_loop()
                    announce = request.on_started

                    def started(name_there: str) -> None:
                        deadline.reschedule(loop.time() + seconds)
                        announce(name_there)

                    try:
                        async with deadline:
                            exit_ = await executor.run(replace(request, on_started=started), self.output.write)
                    except TimeoutError:  # the run was cancelled: its processes are killed
                        if not deadline.expired():
                            raise
                        self._stop_reason = "timeout"
                        return self.ended_by_timeout(seconds)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(bounded(executor.remove(request.jobdir, request.name), 10))
            raise
        if exit_.host_lost:
            return Ended(None, host_lost=True, message=exit_.message or "connection lost")
        self._entries = exit_.entries
        if self._stop_reason == "timeout":
            return self.ended_by_timeout(None)
        return Ended(exit_.code, message=exit_.message)

    def ended_by_timeout(self, seconds: float | None) -> Ended:
        what = f"timed out after {seconds:g} s" if seconds is not None else "timed out"
        return Ended(TIMED_OUT, timed_out=True, message=what)

    async def stop(self, reason: str) -> None:
        """Kill the job's process tree now (``--timeout`` from the planner); :meth:`run` then
        returns how it ended."""
        self._stop_reason = reason
        with contextlib.suppress(TransportError):
            await self.executor.kill(self.request.name)

    @property
    def kept_at(self) -> str:
        """Where the attempt's results and output stay on its host (``host:/folder``) when they
        do not come home: its folder, with the output beside it (``.out``, ``.err``)."""
        return f"{self.executor.name}:{self.request.jobdir}"

    async def commit(self) -> Committed:
        """Bring the results home into ``<results_dir>/<job>/`` (atomically) and remove the
        job's folder on the host.  When that fails nothing is left here, nothing is removed
        there: the results stay on the host (:attr:`kept_at`)."""
        request = self.request
        folder = self.folder
        try:
            if folder is None:
                folder = open_results_folder(self.results_dir, create=False)
            dest = Destination(folder, request.name, self.results_dir, self.budget)
            report = await self.executor.fetch(
                request.name, request.jobdir, dest, request.copy_backwards, request.limits, self._entries
            )
        except (LocalWriteError, BudgetSpent) as exc:
            return Committed(None, str(exc), self.kept_at, batch_failure=True)
        except (TransferError, TransportError) as exc:
            return Committed(None, str(exc), self.kept_at)
        except SchedulerError as exc:  # the results folder is no longer a folder of ours
            return Committed(None, str(exc), self.kept_at, batch_failure=True)
        finally:
            if folder is not None and folder != self.folder:
                os.close(folder)
        with contextlib.suppress(TransportError):
            await self.executor.remove(request.jobdir, request.name, wait=False)
        return Committed(report)

    async def discard(self) -> None:
        """Remove the attempt's folder on the host, bringing nothing home (a retry)."""
        with contextlib.suppress(TransportError):
            await self.executor.remove(self.request.jobdir, self.request.name)
