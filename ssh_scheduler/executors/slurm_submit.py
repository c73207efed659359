"""Submitting jobs to Slurm: those placed together go in one round trip to the login node, and
those that ask Slurm for the same things in one ``sbatch --array`` (slurm_array), as a user
would by hand.  Used by :class:`~ssh_scheduler.executors.slurm.SlurmExecutor`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os.path
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ssh_scheduler.errors import TransportError
from ssh_scheduler.executors import slurm_jobs as S
from ssh_scheduler.executors.slurm_array import (
    ARRAY_MARK,
    MAX_COMMAND,
    array_submit_command,
    shared_options,
    task_output,
)
from ssh_scheduler.machines.slurm import SlurmSettings
from ssh_scheduler.transport.base import stopped

__all__ = ["Submitted", "Submitter"]

log = logging.getLogger(__name__)

SUBMIT_WINDOW = 0.05
"""Seconds the first job to submit waits for others: jobs placed together share one sbatch."""


@dataclass(frozen=True, slots=True)
class Submitted:
    """What became of a job given to :meth:`Submitter.submit`."""

    slurm_id: str | None  # ``A_i`` for task i of array A; None: sbatch refused it, or ``lost``
    said: str  # what sbatch said of a refusal
    lost: bool  # the login node was lost
    output: str = ""  # where Slurm writes its output (the path before ``.out``/``.err``)


@dataclass(slots=True)
class _Submission:
    """A job waiting to be submitted; ``done`` gets what became of it."""

    job: str
    jobdir: str
    argv: list[str]
    script: str
    done: asyncio.Future[Submitted]
    abandoned: bool = False  # its run was cancelled


def _chunks(
    group: list[_Submission], command: Callable[[list[_Submission]], str]
) -> list[tuple[list[_Submission], str]]:
    """The group in runs whose submission line (``command``) stays under :data:`MAX_COMMAND`,
    halved until it does, each with its line.  Only a single job's line may be longer: its
    script carries the user's own command."""
    line = command(group)
    if len(group) <= 1 or len(line.encode()) <= MAX_COMMAND:
        return [(group, line)]
    half = len(group) // 2
    return _chunks(group[:half], command) + _chunks(group[half:], command)


class Submitter:
    """Collects jobs to submit for :data:`SUBMIT_WINDOW`, then submits them in groups.
    ``run`` runs a shell line on the login node (output, status); ``cancel`` scancels ids;
    ``jobdir`` is the executor's (token, job) -> the job's folder path there."""

    def __init__(
        self,
        name: str,
        settings: SlurmSettings,
        token: str,
        run: Callable[[str], Awaitable[tuple[str, int]]],
        cancel: Callable[[list[str]], Awaitable[None]],
        jobdir: Callable[[str, str], str],
    ) -> None:
        self.name, self.settings, self.token = name, settings, token
        self._run, self._cancel, self._jobdir = run, cancel, jobdir
        self._submissions: list[_Submission] = []
        self._task: asyncio.Task[None] | None = None
        self._arrays: dict[str, int] = {}  # first job -> arrays submitted under its name

    async def close(self) -> None:
        if self._task is not None:
            await stopped(self._task)

    async def submit(self, job: str, jobdir: str, argv: list[str], script: str) -> Submitted:
        """Submit the job (with others placed with it); a cancelled caller's job is scancelled
        once submitted."""
        loop = asyncio.get_running_loop()
        submission = _Submission(job, jobdir, argv, script, loop.create_future())
        self._submissions.append(submission)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._submit_soon())
        try:
            return await asyncio.shield(submission.done)
        except asyncio.CancelledError:
            submission.abandoned = True
            if submission.done.done() and (slurm_id := submission.done.result().slurm_id) is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._cancel([slurm_id]))
            raise

    async def _submit_soon(self) -> None:
        await asyncio.sleep(SUBMIT_WINDOW)
        while self._submissions:
            batch, self._submissions = [s for s in self._submissions if not s.abandoned], []
            groups: dict[tuple[str, ...], list[_Submission]] = {}
            for submission in batch:
                key = shared_options(submission.argv) if self.settings.arrays else (submission.job,)
                groups.setdefault(key, []).append(submission)
            for options, group in groups.items():
                for chunk, command in _chunks(group, functools.partial(self._command, options)):
                    try:
                        await self._submit_chunk(command, chunk)
                    except Exception as exc:  # no job may wait forever for its submission
                        log.exception("%s: submitting to Slurm failed", self.name)
                        for waiting in chunk:
                            if not waiting.done.done():
                                waiting.done.set_result(Submitted(None, f"submitting failed: {exc}", False))

    def _command(self, options: tuple[str, ...], chunk: list[_Submission]) -> str:
        """The shell line that submits these jobs: one sbatch, or one array of them."""
        first = chunk[0]
        if len(chunk) == 1:
            return S.submit_command(self.settings, first.argv, first.script)
        return array_submit_command(
            self.settings, options, name=S.job_name(self.token, self._label(chunk)),
            workdir=os.path.dirname(first.jobdir), stem=self._stem(chunk),
            jobs=[(s.jobdir, s.script) for s in chunk],
        )  # fmt: skip

    def _label(self, chunk: list[_Submission]) -> str:
        """The array's name after the token: ``@<first job>``, or ``@<first job>@<n>`` for the
        n-th array a job sent again leads (no job name holds ``@``): each array's files are its
        own, never another's task outputs appended to."""
        n = self._arrays.get(chunk[0].job, 0)
        return f"{ARRAY_MARK}{chunk[0].job}" + (f"{ARRAY_MARK}{n + 1}" if n else "")

    def _stem(self, chunk: list[_Submission]) -> str:
        """An array's files' path before ``.array`` (its tasks' outputs: ``task_outputs``): the
        folder path of a job named as the array (:meth:`_label`), where a rerun looks for it too."""
        return self._jobdir(self.token, self._label(chunk))

    async def _submit_chunk(self, command: str, chunk: list[_Submission]) -> None:
        stem = self._stem(chunk)
        if len(chunk) > 1:  # its name is taken, whatever sbatch answers
            self._arrays[chunk[0].job] = self._arrays.get(chunk[0].job, 0) + 1
        try:
            out, rc = await self._run(command)
        except TransportError as exc:
            for s in chunk:
                s.done.set_result(Submitted(None, str(exc), True))
            return
        slurm_id = S.parse_submitted(out) if rc == 0 else None
        said = out if slurm_id is None else ""
        if slurm_id is not None and len(chunk) > 1:
            log.info("submitted: %d jobs as Slurm array %s on %s", len(chunk), slurm_id, self.name)
        if len(chunk) == 1:
            ids, outputs = [slurm_id], [chunk[0].jobdir]
        else:
            ids = [f"{slurm_id}_{i}" if slurm_id else None for i in range(len(chunk))]
            outputs = [task_output(stem, i) for i in range(len(chunk))]
        for s, job_id, output in zip(chunk, ids, outputs, strict=True):
            s.done.set_result(Submitted(job_id, said or f"exit status {rc}", False, output))
        gone = [
            job_id
            for s, job_id in zip(chunk, ids, strict=True)
            if s.abandoned and job_id is not None
        ]
        if gone:  # their runs were cancelled while sbatch ran
            with contextlib.suppress(TransportError):
                await self._cancel(gone)
