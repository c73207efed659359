"""THE per-job pipeline: stage inputs, run, stream output home, fetch results, commit, clean up.

``execute_batch`` (through the coordinator), ``execute_remote`` and ``execute_to`` with
copy-forwards all run a job through :class:`JobRun`, so a job behaves the same whichever command
started it: the same environment (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``,
``SSH_SCHEDULER_JOB``), output kept on the host for a reattaching coordinator, inputs staged
in the run request itself (one round trip), a timeout that kills the whole process tree,
results brought home atomically, and the host folder removed.  Each caller describes the job
in one :class:`~ssh_scheduler.executors.base.RunRequest`, which the pipeline hands to the
executor whatever its backend.

Cancellation kills, waits, re-raises (trio's ``run_process``): cancelling :meth:`JobRun.run`
kills the job's process tree on its host, waits for it to be gone, removes its folder, and
re-raises.  Expected failures are data: a lost host ends the run with ``Ended(host_lost=True)``.
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

from ssh_scheduler.errors import TransferError, TransportError
from ssh_scheduler.events import TIMED_OUT, Ended
from ssh_scheduler.executors.base import Executor, RunRequest
from ssh_scheduler.executors.transfer import CopyBackReport

__all__ = ["JobRun", "Output", "OutputFiles", "job_environment"]

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

    A file is created at the stream's first byte: most jobs of a big batch print nothing, and
    two file creations per job were the coordinator's largest per-job cost (event loop blocked in
    open(2) on a busy disk).  A job that printed nothing on a stream leaves no file for it; an
    earlier attempt's file is still emptied at :meth:`open`, so what is there is this attempt's.
    Opened without following links: a planted symlink is refused, never written through.
    """

    results_dir: Path
    name: str
    append: bool = False
    mirror: dict[int, list[int]] = field(default_factory=dict)
    _fds: dict[int, int] = field(default_factory=dict)
    _refusals: dict[int, str] = field(default_factory=dict)

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

    def _path(self, fd: int) -> Path:
        return self.results_dir / f"{self.name}{'.out' if fd == 1 else '.err'}"

    def _open(self, fd: int, *, create: bool) -> None:
        flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_APPEND if self.append else os.O_TRUNC)
        self._fds[fd] = os.open(self._path(fd), flags | (os.O_CREAT if create else 0), 0o644)

    def _refused(self, fd: int, exc: OSError) -> TransferError:
        path = self._path(fd)
        return TransferError(
            f"cannot write {path}: {exc.strerror}"
            + (" (a symbolic link is in the way: remove it)" if path.is_symlink() else "")
        )

    @property
    def offsets(self) -> tuple[int, int]:
        return self._size(1), self._size(2)

    def _size(self, fd: int) -> int:
        if fd in self._fds:
            return os.fstat(self._fds[fd]).st_size
        return 0  # open() found no file (the append mode creates both): nothing received yet

    def write(self, fd: int, data: bytes) -> None:
        if fd not in self._fds and fd not in self._refusals:
            try:
                self._open(fd, create=True)
            except OSError as exc:
                # Raising here would end the host's reader (every job on it "lost"): this
                # stream's file is dropped, said once; the terminal mirror still gets it all.
                self._refusals[fd] = str(self._refused(fd, exc))
                log.warning("%s: %s; this output is not kept", self.name, self._refusals[fd])
        if fd in self._fds:
            os.write(self._fds[fd], data)
        for target in self.mirror.get(fd, ()):
            os.write(target, data)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class JobRun:
    """One attempt of one job on one executor: ``request`` is what the executor runs (the
    pipeline adds the staging), ``output`` where its output goes as it arrives, ``results_dir``
    where :meth:`commit` brings its results (``<results_dir>/<job>``).

    ``request.timeout`` is enforced here, counted from the request's started hook, unless
    ``enforce_timeout`` is False (the batch: its planner counts it and calls :meth:`stop`)."""

    def __init__(
        self, executor: Executor, request: RunRequest, output: Output, results_dir: Path, *, enforce_timeout: bool = True
    ) -> None:
        self.executor = executor
        self.request = request
        self.output = output
        self.results_dir = results_dir
        self.enforce_timeout = enforce_timeout
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
                await asyncio.shield(asyncio.wait_for(executor.remove(request.jobdir, request.name), 10))
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

    async def commit(self) -> tuple[CopyBackReport | None, str | None]:
        """Bring the results home into ``<results_dir>/<job>/`` (atomically) and remove the
        job's folder on the host.  Returns the report, or the reason it failed (then nothing is
        left here and the results stay on the host)."""
        request = self.request
        try:
            report = await self.executor.fetch(
                request.name, request.jobdir, self.results_dir / request.name, request.copy_backwards, request.limits,
                self._entries,
            )
        except (TransferError, TransportError) as exc:
            return None, str(exc)
        with contextlib.suppress(TransportError):
            await self.executor.remove(request.jobdir, request.name, wait=False)
        return report, None

    async def discard(self) -> None:
        """Remove the attempt's folder on the host, bringing nothing home (a retry)."""
        with contextlib.suppress(TransportError):
            await self.executor.remove(self.request.jobdir, self.request.name)
