"""The coordinator: performs what the planner decides and tells it what happened.

Decisions live in :mod:`ssh_scheduler.plan` (pure); this module does the I/O: choose which jobs
of the batch file still need running (``job_results/`` and its journal), connect to every host
(:mod:`ssh_scheduler.executors`), probe them, run each placed job through the one per-job
pipeline (:mod:`ssh_scheduler.jobrun`), re-probe, revive lost hosts, and publish every event on
the event stream, to which the journal and the terminal lines subscribe.

Every task has a parent (one TaskGroup); nothing sleeps and polls: the main loop waits on an
event set whenever the planner's state changes, timers wait for the planner's next deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from .batch import Job
from .batch_run import BatchOptions, BatchSummary, JobOutcome, select_jobs
from .config import Machine
from .control import ControlServer, batch_requests
from .errors import (
    AgentStartError,
    AuthenticationError,
    BatchError,
    HostKeyError,
    ProbeError,
    SchedulerError,
    TransportError,
)
from .events import (
    BatchFinished,
    Ended,
    EventBus,
    HostProbed,
    Notice,
)
from .executor_slurm import SlurmExecutor, open_slurm_executor
from .executors import Executor, open_executor, probe_only
from .forward import check_forward_size, check_job_copies, describe_forward
from .jobrun import JobRun, JobSpec, OutputFiles, job_environment
from .journal import Journal, JournalWriter
from .machine_env import with_setup
from .plan import (
    Action,
    Cleanup,
    Commit,
    Discard,
    KillJob,
    Planner,
    PlanOptions,
    Reprobe,
    Revive,
    Say,
    StartJob,
    StopBatch,
)
from .results_folder import hold_results_folder, refuse_planted_links
from .slurm import queue_state
from .terminal import Printer, TerminalLines
from .transfer import ForwardSet, Hasher, collect_forward

__all__ = ["Batch", "BatchOptions", "BatchSummary", "JobOutcome", "SchedulerError", "run_batch"]

log = logging.getLogger(__name__)

MIN_PROBE_GAP = 1.0
REVIVE_MAX_DELAY = 30.0


class Batch:
    """One run of a batch.  ``await Batch(...).run()``; ``request_stop`` drains, then kills."""

    def __init__(
        self,
        jobs: Sequence[Job],
        machines: Sequence[Machine],
        options: BatchOptions,
        *,
        out: Printer | None = None,
        err: Printer | None = None,
        bus: EventBus | None = None,
    ) -> None:
        self.jobs = list(jobs)
        for job in self.jobs:
            if "\x00" in job.command:  # the CLI cannot carry one, the Python API can
                raise BatchError(f"job {job.name}: the command contains a NUL byte; remove it")
        self.machines = {m.name: m for m in machines}
        self.options = options
        self.bus = bus or EventBus()
        if out is not None or err is not None:
            self.bus.subscribe(TerminalLines(out or (lambda _: None), err or (lambda _: None)))
        self.summary = BatchSummary()
        self.bus.subscribe(self.summary)
        self.planner: Planner | None = None
        self.executors: dict[str, Executor] = {}
        self.token = ""
        self.hasher = Hasher()
        self.forward_sets: dict[tuple[str, ...], ForwardSet] = {}
        self._changed = asyncio.Event()
        self._reprobe = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._revivers: set[asyncio.Task[None]] = set()
        self._runs: dict[str, JobRun] = {}
        self._main: asyncio.Task[object] | None = None
        self._stop_requested = 0
        self._started = time.monotonic()

    # -- public --------------------------------------------------------------------------------

    async def run(self) -> BatchSummary:
        # One run per results folder: two would both run every job and fail each other's results.
        with hold_results_folder(self.options.results_dir, create=not self.options.dry_run):
            return await self._run()

    async def _run(self) -> BatchSummary:
        self._main = asyncio.current_task()
        options = self.options
        check_job_copies(self.jobs, options.base_dir, options.forward)
        selection = select_jobs(self.jobs, options, self.bus)
        self.token = selection.token
        if not selection.pending:
            self.bus.publish(Notice(level="info", message="nothing to do: every job already has results"))
            return self._finish(None)
        refuse_planted_links(options.results_dir, (job.name for job in selection.pending))
        planner = self.planner = Planner(
            selection.pending,
            [(m.name, m.source or m.name) for m in self.machines.values()],
            PlanOptions(options.needs, options.gpus_explicit, options.retries, options.timeout, options.halt, options.quarantine_after),
            resumable=selection.resumable,
            already_done=selection.already_done,
        )
        forward = self.forward_sets[options.copy_forwards] = await asyncio.to_thread(
            self._collect, options.copy_forwards
        )
        if options.dry_run:
            self.bus.publish(Notice(level="info", message=describe_forward(forward, options.copy_forwards, options.forward)))
        else:
            check_forward_size(forward, options.copy_forwards, options.forward)
        try:
            await self._start_hosts()
            actions = planner.begin(self.token)
            if options.dry_run:
                self._perform([a for a in actions if isinstance(a, Say)])
                for line in planner.dry_run():
                    self.bus.publish(line)
                return self.summary
            options.results_dir.mkdir(parents=True, exist_ok=True)
            with Journal.open(options.results_dir) as journal:
                writer = JournalWriter(journal)
                self.bus.subscribe(writer, first=True)
                control = ControlServer(options.results_dir, batch_requests(self))
                await control.start()
                try:
                    await self._drive(actions)
                finally:
                    await control.close()
                    self.bus.unsubscribe(writer)
        finally:
            await self._close_all()
        return self._finish(planner)

    def request_stop(self) -> None:
        """First call: start no new jobs and let the running ones finish.  Second: kill them."""
        self._stop_requested += 1
        if self.planner is None or self._tg is None:
            if self._stop_requested > 1 and self._main is not None:
                self.summary.cancelled = True
                self._main.cancel()
            return
        self._perform(self.planner.stop())

    def perform(self, actions: Sequence[Action]) -> None:
        """Perform what the planner answered to an event from outside the loop (pause, cancel)."""
        self._perform(actions)

    # -- hosts ---------------------------------------------------------------------------------

    async def _start_hosts(self) -> None:
        """Connect to every host at once and probe each; a host we cannot trust or log into is
        a configuration error before anything runs, an unreachable one is retried later."""
        assert self.planner is not None
        planner = self.planner
        unusable: dict[str, str] = {}  # host -> why, for hosts reached whose agent did not start

        async def one(machine: Machine) -> None:
            try:
                if self.options.dry_run:
                    state = (
                        queue_state(machine.slurm) if machine.slurm is not None
                        else await probe_only(machine, accept_new=self.options.accept_new, keepalive=self.options.keepalive)
                    )  # fmt: skip
                    self._perform(planner.probe_landed(machine.name, state))
                    return
                executor = await self._open(machine)
                self.executors[machine.name] = executor
                log.info("connected to %s", machine.name)
            except (HostKeyError, AuthenticationError) as exc:
                if machine.name not in str(exc):  # which of many hosts: name it
                    raise type(exc)(f"{machine.name}: {exc}") from None
                raise
            except TransportError as exc:
                if isinstance(exc, AgentStartError):
                    unusable[machine.name] = str(exc)
                self._perform(planner.host_unreachable(machine.name, str(exc)))
                return
            await self._probe(machine.name)

        results = await asyncio.gather(*(one(m) for m in self.machines.values()), return_exceptions=True)
        fatal = [r for r in results if isinstance(r, BaseException)]
        if fatal:
            for exc in fatal[1:]:
                self.bus.publish(Notice(level="error", message=str(exc)))
            raise fatal[0]
        if not self.executors and not self.options.dry_run:
            if unusable:  # reached, but unusable: the causes, not "unreachable"
                raise TransportError(f"no host could be used, nothing was run: {'; '.join(unusable.values())}")
            raise TransportError("no host could be reached; nothing was run")

    async def _open(self, machine: Machine) -> Executor:
        """Connect to a host: through our agent, or to Slurm through a login node's agent."""
        opener = open_executor if machine.slurm is None else partial(open_slurm_executor, settings=machine.slurm)
        return await opener(
            machine, accept_new=self.options.accept_new, keepalive=self.options.keepalive,
            lease=self.options.lease, token=self.token,
        )

    async def _probe(self, host: str) -> None:
        assert self.planner is not None
        executor = self.executors[host]
        resources = self.planner.resources(host)
        generation = resources.probe_started() if resources is not None else None
        try:
            async with asyncio.timeout(30):
                state, own = await executor.probe()
        except (ProbeError, TransportError, TimeoutError) as exc:
            reason = f"{executor.name}: probe failed: {exc or 'no answer in 30 s'}"
            self._perform(self.planner.probe_failed(host, reason))
            return
        self.bus.publish(HostProbed.of(host, state))
        self._perform(self.planner.probe_landed(host, state, own, generation))

    async def _reprobe_loop(self) -> None:
        """Re-probe on a timer and when the planner asks (after job ends), at most once per
        ``MIN_PROBE_GAP`` seconds, so a burst of short jobs cannot keep the hosts busy probing."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.probe_interval):
                    await self._reprobe.wait()
            self._reprobe.clear()
            hosts = [name for name, ex in self.executors.items() if ex.lost is None and self._host_up(name)]
            await asyncio.gather(*(self._probe(h) for h in hosts))
            await asyncio.sleep(MIN_PROBE_GAP)

    def _host_up(self, host: str) -> bool:
        assert self.planner is not None
        slot = self.planner.hosts[host]
        return slot.down is None and not slot.quarantined

    async def _revive(self, host: str) -> None:
        """Reconnect a lost host with backoff; when it answers, tell the planner (which ends what
        the host still runs for us: those jobs were requeued elsewhere)."""
        assert self.planner is not None
        planner = self.planner
        delay = 1.0
        old = self.executors.pop(host, None)
        if old is not None:
            self.summary.bytes_uploaded += old.bytes_sent
            self.summary.files_uploaded += old.files_sent
            with contextlib.suppress(Exception):
                await old.close()
        while not planner.hosts[host].quarantined:
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, REVIVE_MAX_DELAY)
            try:
                executor = await self._open(self.machines[host])
            except TransportError:
                continue
            try:
                async with asyncio.timeout(30):
                    state, own = await executor.probe()
            except (ProbeError, TransportError, TimeoutError):
                with contextlib.suppress(Exception):
                    await executor.close()
                continue
            self.executors[host] = executor
            self.bus.publish(HostProbed.of(host, state))
            self._perform(planner.host_back(host, state, own, {n: bool(s.get("running")) for n, s in executor.agent_jobs.items()}))
            return
        planner.revive_gave_up(host)

    async def _close_all(self) -> None:
        async def one(executor: Executor) -> None:
            if executor.lost is None and not self.options.dry_run:
                with contextlib.suppress(TransportError, TimeoutError):
                    async with asyncio.timeout(30):
                        await executor.sweep(f"{self.token}-")
            # "bye" even after a cancel: the jobs are killed by then, and the agent should exit
            # now rather than linger for its lease.
            await executor.close()

        await asyncio.gather(*(one(e) for e in self.executors.values()), return_exceptions=True)

    # -- the loop ------------------------------------------------------------------------------

    async def _drive(self, first: list[Action]) -> None:
        assert self.planner is not None
        planner = self.planner
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            helpers = [tg.create_task(self._reprobe_loop()), tg.create_task(self._timer())]
            self._perform(first)
            for host, executor in list(self.executors.items()):
                found = {n: bool(s.get("running")) for n, s in executor.agent_jobs.items()}
                if found:
                    self._perform(planner.agent_jobs_found(host, found))
            self._perform(planner.kick())
            if self._stop_requested:
                self._perform(planner.stop())
            while not (planner.done and not self._tasks):
                self._changed.clear()
                await self._changed.wait()
            for task in [*helpers, *self._revivers]:  # hosts still being revived are not needed
                task.cancel()
            self._tg = None

    async def _timer(self) -> None:
        """Wakes the planner at its next deadline (``--timeout``)."""
        assert self.planner is not None
        while True:
            deadline = self.planner.next_deadline()
            if deadline is None:
                self._changed.clear()
                await self._changed.wait()
                continue
            await asyncio.sleep(max(0.0, deadline - time.time()))
            self._perform(self.planner.tick(time.time()))

    def _perform(self, actions: Sequence[Action]) -> None:
        for action in actions:
            match action:
                case Say(event=event):
                    self.bus.publish(event)
                case StartJob():
                    self._spawn(action.job.name, self._job(action))
                case KillJob(job=name, reason="timeout"):
                    run = self._runs.get(name)
                    if run is not None:
                        self._spawn(None, run.stop("timeout"))
                case KillJob(job=name):
                    task = self._tasks.get(name)
                    if task is not None:
                        task.cancel()
                case Reprobe():
                    self._reprobe.set()
                case Revive(host=host):
                    assert self._tg is not None
                    reviver = self._tg.create_task(self._revive(host))
                    self._revivers.add(reviver)
                    reviver.add_done_callback(self._revivers.discard)
                case Cleanup(host=host, job=name):
                    self._spawn(None, self._cleanup(host, name))
                case StopBatch():
                    self.summary.cancelled = True
                    if self._main is not None:
                        self._main.cancel()
                case Commit() | Discard():
                    raise AssertionError(f"{action} is handled by the job's own task")
        self._changed.set()

    def _spawn(self, name: str | None, coro: Coroutine[Any, Any, None]) -> None:
        assert self._tg is not None
        task = self._tg.create_task(coro)
        if name is not None:
            self._tasks[name] = task

            def done(_: object) -> None:
                self._tasks.pop(name, None)
                self._runs.pop(name, None)
                self._changed.set()

            task.add_done_callback(done)

    async def _cleanup(self, host: str, name: str) -> None:
        executor = self.executors.get(host)
        if executor is not None:
            with contextlib.suppress(TransportError):
                await executor.remove(executor.jobdir(self.token, name), name)

    def _forward_for(self, job: Job) -> ForwardSet:
        key = job.copy_forwards if job.copy_forwards is not None else self.options.copy_forwards
        found = self.forward_sets.get(key)
        if found is None:
            found = self._collect(key)
            self.forward_sets[key] = found
        return found

    def _collect(self, paths: tuple[str, ...]) -> ForwardSet:
        return collect_forward(paths, self.options.base_dir, self.hasher, policy=self.options.forward)

    async def _job(self, start: StartJob) -> None:
        """One attempt of one job, from staging to its final state."""
        assert self.planner is not None
        planner, job, options = self.planner, start.job, self.options
        name = job.name
        executor = self.executors[start.placement.machine]
        key = job.copy_forwards if job.copy_forwards is not None else options.copy_forwards
        forward = self.forward_sets.get(key)
        if forward is None:  # hashing new inputs: off the event loop
            forward = await asyncio.to_thread(self._forward_for, job)
        machine = self.machines[start.placement.machine]
        spec = JobSpec(
            name,
            with_setup(job.command, machine.setup),
            executor.jobdir(self.token, name),
            {**dict(machine.env), **job_environment(name, start.placement.gpu_indices)},
            forward,
            options.results_dir,
            job.copy_backwards if job.copy_backwards is not None else options.copy_backwards,
            options.limits,
        )
        output = OutputFiles(
            options.results_dir, name, append=start.resume, mirror={1: [1], 2: [2]} if options.echo_output else {}
        )
        if isinstance(executor, SlurmExecutor):  # sbatch asks for the job's needs and --time
            executor.needs[name], executor.timeouts[name] = planner.jobs[name].needs, options.timeout
        run = self._runs[name] = JobRun(executor, spec, output)
        try:
            try:
                output.open()
            except SchedulerError as exc:
                ended = Ended(None, message=str(exc))
            else:
                try:

                    def started() -> None:
                        log.info("sent: %s's inputs are on %s (%d bytes sent there so far)", name, executor.name, executor.bytes_sent)
                        if isinstance(executor, SlurmExecutor):  # started = Slurm runs it (--timeout counts from there)
                            executor.on_running[name] = lambda: self._perform(planner.job_started(name, time.time()))
                            return
                        self._perform(planner.job_started(name, time.time()))

                    ended = await run.run(resume=start.resume, on_started=started)
                finally:
                    output.close()
            if planner.killed_for(name) == "timeout" and not ended.host_lost:
                ended = planner.timed_out(name)
            actions = planner.job_exited(name, ended)
            self._perform([a for a in actions if not isinstance(a, Commit | Discard)])
            if any(isinstance(a, Discard) for a in actions):
                await run.discard()
                return
            if not any(isinstance(a, Commit) for a in actions):
                return
            received = 0
            if ended.code is not None:
                report, problem = await run.commit()
                if report is not None:
                    received = report.bytes
                    log.info("received: %s, %d bytes from %s", name, received, executor.name)
                    for warning in report.warnings:
                        self.bus.publish(Notice(level="warning", message=f"{name}: {warning}", job=name))
                if problem is not None:
                    self.bus.publish(Notice(level="error", message=f"{name}: copy back failed: {problem}", job=name))
                    ended = replace(ended, code=ended.code or 1, message=problem)
            self._perform(planner.job_committed(name, ended, received, time.time()))
        except asyncio.CancelledError:
            self._perform(planner.job_cancelled(name))
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.wait_for(executor.remove(spec.jobdir, name), 10))
            raise

    def _finish(self, planner: Planner | None) -> BatchSummary:
        summary = self.summary
        for executor in self.executors.values():
            summary.bytes_uploaded += executor.bytes_sent
            summary.files_uploaded += executor.files_sent
        if planner is not None:
            summary.halted = planner.halted
            summary.not_run = planner.unfinished()
        summary.seconds = time.monotonic() - self._started
        self.bus.publish(
            BatchFinished(
                finished=len(summary.outcomes) - len(summary.failed),
                failed=tuple(summary.failed),
                skipped=len(summary.skipped),
                not_run=tuple(summary.not_run),
                cancelled=summary.cancelled,
                halted=summary.halted,
                seconds=summary.seconds,
                bytes_sent=summary.bytes_uploaded,
                files_sent=summary.files_uploaded,
                bytes_received=summary.bytes_downloaded,
            )
        )
        return summary


async def run_batch(
    jobs: Sequence[Job],
    machines: Sequence[Machine],
    options: BatchOptions,
    *,
    out: Printer | None = print,
    err: Printer | None = print,
    bus: EventBus | None = None,
) -> BatchSummary:
    """The Python API behind ``execute_batch``."""
    return await Batch(jobs, machines, options, out=out, err=err, bus=bus).run()
