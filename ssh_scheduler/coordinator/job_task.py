"""Each placed job's task in a batch: from the planner's StartJob to its commit (or discard).

The job is described once, as the :class:`~ssh_scheduler.executors.base.RunRequest` every
backend gets, and run through the one per-job pipeline
(:class:`~ssh_scheduler.coordinator.jobrun.JobRun`); the planner hears when it really started
(the request's started hook: on a Slurm machine, once Slurm runs it), how it ended, and what
came home.  Nothing here knows which backend runs the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.jobrun import JobRun, OutputFiles, job_environment
from ssh_scheduler.errors import SchedulerError, TransferError, TransportError
from ssh_scheduler.events import Ended, EventBus, Notice
from ssh_scheduler.executors.base import Executor, RunRequest, ShellCommand
from ssh_scheduler.executors.transfer import CopyBudget
from ssh_scheduler.jobs.forward import ForwardSet, Hasher, collect_forward
from ssh_scheduler.jobs.hash_memo import HashMemo
from ssh_scheduler.jobs.hash_memo import default_path as default_memo_path
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.planner.actions import Action, Commit, Discard, StartJob
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.transport.base import bounded

__all__ = ["JobTasks"]

log = logging.getLogger(__name__)


class JobTasks:
    """The batch's job attempts: :meth:`run` is one attempt's task (the batch spawns it),
    :attr:`runs` the attempts running now (a ``--timeout`` kill stops one), :meth:`forward` the
    copy-forward sets, hashed once per batch."""

    def __init__(
        self,
        planner: Planner,
        executors: dict[str, Executor],
        machines: dict[str, Machine],
        options: BatchOptions,
        *,
        token: str,
        bus: EventBus,
        perform: Callable[[Sequence[Action]], None],
        folder: int | None = None,
    ) -> None:
        """``folder``: the results folder's verified descriptor, held by the batch (every job's
        files are created relative to it; opened per use when None)."""
        self.planner = planner
        self.executors = executors  # the hosts' (hosts.py), as they are now
        self.machines = machines
        self.options = options
        self.token = token
        self.bus = bus
        self._perform = perform
        self.folder = folder
        self.budget = CopyBudget(options.limits)
        self.kept: dict[str, set[str]] = {}
        """Per host, the jobs whose results stay there (they did not all come home)."""
        self.runs: dict[str, JobRun] = {}
        self.hasher = Hasher(HashMemo(default_memo_path()))
        self.forward_sets: dict[tuple[str, ...], ForwardSet] = {}

    def forward(self, paths: tuple[str, ...]) -> ForwardSet:
        """The copy-forward set of these paths, walked and hashed the first time (blocking: call
        it off the event loop unless it is known)."""
        found = self.forward_sets.get(paths)
        if found is None:
            found = collect_forward(paths, self.options.base_dir, self.hasher, policy=self.options.forward)
            self.forward_sets[paths] = found
        return found

    async def cleanup(self, host: str, name: str) -> None:
        executor = self.executors.get(host)
        if name in self.kept.get(host, ()):
            return  # what did not come home stays there
        if executor is not None:
            with contextlib.suppress(TransportError):
                await executor.remove(executor.jobdir(self.token, name), name)

    def request(self, start: StartJob, executor: Executor, forward: ForwardSet) -> RunRequest:
        """What the job's backend gets, whatever it is."""
        planner, job, options = self.planner, start.job, self.options
        name = job.name
        machine = self.machines[start.placement.machine]

        def started(name_there: str) -> None:
            # The planner's --timeout counts from here; on Slurm it names the Slurm job.
            self._perform(planner.job_started(name, time.time(), name_there))

        return RunRequest(
            name=name,
            work=job.call if job.call is not None else ShellCommand(job.command),
            jobdir=executor.jobdir(self.token, name),
            env={**dict(machine.env), **job_environment(name, start.placement.gpu_indices)},
            setup=machine.setup,
            needs=planner.jobs[name].needs,
            gpus=start.placement.gpu_indices,
            timeout=options.timeout,
            forward=forward,
            copy_backwards=job.copy_backwards if job.copy_backwards is not None else options.copy_backwards,
            limits=options.limits,
            on_started=started,
        )

    def local_failure(self, reason: str) -> None:
        """A write here failed (a full disk) or the batch's copy-back budget is spent: the
        batch's failure, never a host's (no requeue, no quarantine): nothing new starts."""
        self._perform(self.planner.local_failure(reason))

    async def run(self, start: StartJob) -> None:
        """One attempt of one job, from staging to its final state."""
        planner, job, options = self.planner, start.job, self.options
        name = job.name
        executor = self.executors[start.placement.machine]
        key = job.copy_forwards if job.copy_forwards is not None else options.copy_forwards
        forward = self.forward_sets.get(key)
        refused = None
        if forward is None:  # hashing new inputs: off the event loop
            try:
                forward = await asyncio.to_thread(self.forward, key)
            except TransferError as exc:
                # A --commands line's own inputs, walked only now, cannot be read (a colleague's
                # file, one gone since the check): that job fails with the reason, as a command
                # that could not start; the batch and the jobs running go on.  (The batch's own
                # --copy-forwards were walked before any job started.)
                forward, refused = ForwardSet((), ()), str(exc)
        request = self.request(start, executor, forward)
        output = OutputFiles(
            options.results_dir, name, append=start.resume, mirror={1: [1], 2: [2]} if options.echo_output else {},
            folder=self.folder, on_failure=self.local_failure,
        )
        # The planner kills on --timeout (KillJob, then run.stop), counting from the started hook.
        run = self.runs[name] = JobRun(
            executor, request, output, options.results_dir, enforce_timeout=False, folder=self.folder, budget=self.budget
        )
        try:
            # (A refusal is said once, in the job's failed line.)
            ended = Ended(None, message=refused) if refused is not None else await self._attempt(run, output, start.resume)
            if planner.killed_for(name) == "timeout" and not ended.host_lost:
                ended = planner.timed_out(name)
            actions = planner.job_exited(name, ended)
            self._perform([a for a in actions if not isinstance(a, Commit | Discard)])
            if any(isinstance(a, Discard) for a in actions):
                await run.discard()
                return
            if not any(isinstance(a, Commit) for a in actions):
                return
            ended, received = await self._commit(run, output, ended)
            self._perform(planner.job_committed(name, ended, received, time.time()))
        except asyncio.CancelledError:
            self._perform(planner.job_cancelled(name))
            with contextlib.suppress(Exception):
                await asyncio.shield(bounded(executor.remove(request.jobdir, name), 10))
            raise

    async def _attempt(self, run: JobRun, output: OutputFiles, resume: bool) -> Ended:
        """The job's files here opened, its command run there: how it ended."""
        name, executor = run.request.name, run.executor
        try:
            output.open()
        except SchedulerError as exc:
            self.local_failure(str(exc))
            return Ended(None, message=str(exc))
        try:

            def staged() -> None:
                log.info("sent: %s's inputs are on %s (%d bytes sent there so far)", name, executor.name, executor.bytes_sent)

            return await run.run(resume=resume, on_staged=staged)
        finally:
            output.close()

    async def _commit(self, run: JobRun, output: OutputFiles, ended: Ended) -> tuple[Ended, int]:
        """The job ended: both its files here, its results home.  What did not all come home
        stays on the host, and the job fails with its own exit status and that reason."""
        name, host = run.request.name, run.executor.name
        if output.opened:
            output.complete()  # every job that ended has both files; a failure is handled below
        if output.failure is not None:
            self._keep(host, name)
            self.bus.publish(Notice(level="error", message=f"{name}: {output.failure}; its output and results stay on the host, at {run.kept_at}", job=name))
            return replace(ended, message=output.failure, kept_at=run.kept_at), 0
        if ended.code is None:
            return ended, 0
        committed = await run.commit()
        report = committed.report
        if report is not None:
            log.info("received: %s, %d bytes from %s", name, report.bytes, host)
            for warning in report.warnings:
                self.bus.publish(Notice(level="warning", message=f"{name}: {warning}", job=name))
            return ended, report.bytes
        problem = committed.problem or "no report"
        self._keep(host, name)
        if committed.batch_failure:
            self.local_failure(problem)
        self.bus.publish(Notice(level="error", message=f"{name}: copy back failed: {problem}; its results stay on the host, at {committed.kept_at}", job=name))
        return replace(ended, message=problem, kept_at=committed.kept_at), 0

    def _keep(self, host: str, name: str) -> None:
        """This job's folder stays on ``host``: no sweep or cleanup may remove it."""
        self.kept.setdefault(host, set()).add(name)
