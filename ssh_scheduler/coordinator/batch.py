"""The coordinator: performs what the planner decides and tells it what happened.

Decisions live in :mod:`ssh_scheduler.planner.plan` (pure); this module does the I/O: choose which jobs
of the batch file still need running (``job_results/`` and its journal), connect to every host
(:mod:`ssh_scheduler.executors.host`), probe them, run each placed job through the one per-job
pipeline (:mod:`ssh_scheduler.coordinator.jobrun`), re-probe, revive lost hosts, and publish every event on
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
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from ssh_scheduler.coordinator.batch_run import BatchOptions, BatchSummary, JobOutcome, select_jobs
from ssh_scheduler.coordinator.control import ControlServer, batch_requests
from ssh_scheduler.coordinator.early_hosts import EarlyHosts
from ssh_scheduler.coordinator.jobrun import JobRun, JobSpec, OutputFiles, job_environment
from ssh_scheduler.coordinator.open_files import raise_open_files_limit
from ssh_scheduler.errors import (
    AgentStartError,
    AuthenticationError,
    BatchError,
    HostKeyError,
    NoUsableHostError,
    ProbeError,
    SchedulerError,
    TransportError,
)
from ssh_scheduler.events import (
    BatchFinished,
    Ended,
    EventBus,
    HostDown,
    HostProbed,
    Notice,
)
from ssh_scheduler.executors.host import Executor, open_executor, probe_only
from ssh_scheduler.executors.slurm import SlurmExecutor, open_slurm_executor
from ssh_scheduler.executors.transfer import ForwardSet, Hasher, collect_forward
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.forward import check_forward_size, check_job_copies, describe_forward
from ssh_scheduler.machines.config import Machine
from ssh_scheduler.machines.machine_env import with_setup
from ssh_scheduler.machines.slurm import queue_state
from ssh_scheduler.planner.plan import (
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
from ssh_scheduler.results.journal import Journal, JournalWriter, batch_token
from ssh_scheduler.results.results_folder import hold_results_folder, refuse_planted_links
from ssh_scheduler.view.terminal import Printer, TerminalLines

__all__ = ["Batch", "BatchOptions", "BatchSummary", "JobOutcome", "SchedulerError", "run_batch"]

log = logging.getLogger(__name__)

REVIVE_MAX_DELAY = 30.0
PROBE_TIMEOUT = 30.0
# How long the batch waits for every host's first probe before it opens with those that
# answered: as long again as the first answer took, at least this.  Slow hosts then take
# jobs as they answer; a short wait keeps the "machine limits" header whole on small fleets.
PROBE_GRACE = 1.0


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
        early: EarlyHosts | None = None,
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
        self._wake_timer = asyncio.Event()
        self._early = early  # hosts already connecting (early_hosts.py), taken as they are needed
        self._connecting = early.connecting if early is not None else asyncio.Semaphore(max(1, options.max_connecting))
        self._first_answer: float | None = None
        self._hosts_started = time.monotonic()
        self._unusable: dict[str, str] = {}  # host -> why, for hosts reached whose agent did not start
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._helpers: set[asyncio.Task[None]] = set()
        self._runs: dict[str, JobRun] = {}
        self._main: asyncio.Task[object] | None = None
        self._stop_requested = 0
        self._started = time.monotonic()

    # -- public --------------------------------------------------------------------------------

    async def run(self) -> BatchSummary:
        # One run per results folder: two would both run every job and fail each other's results.
        try:
            with hold_results_folder(self.options.results_dir, create=not self.options.dry_run):
                return await self._run()
        finally:
            if self._early is not None:  # refused, or done before every host was needed
                await self._early.close()

    async def _run(self) -> BatchSummary:
        self._main = asyncio.current_task()
        options = self.options
        check_job_copies(self.jobs, options.base_dir, options.forward)
        selection = select_jobs(self.jobs, options, self.bus)
        if self._early is not None:
            if batch_token(options.results_dir) is None:  # still fresh: the early agents' token it is
                selection.token = self._early.token
            else:  # another run wrote here since the hosts were started: reattach as usual
                await self._early.close()
                self._early = None
        self.token = selection.token
        if not selection.pending:
            self.bus.publish(Notice(level="info", message="nothing to do: every job already has results"))
            return self._finish(None)
        refuse_planted_links(options.results_dir, (job.name for job in selection.pending))
        planner = self.planner = Planner(
            selection.pending,
            [(m.name, m.source or m.name) for m in self.machines.values()],
            PlanOptions(
                options.needs, options.gpus_explicit, options.retries, options.timeout, options.halt,
                options.quarantine_after, options.probe_interval,
            ),
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
        raise_open_files_limit(len(self.machines))
        try:
            if options.dry_run:
                await self._probe_all_dry()
                self._perform([a for a in planner.begin(self.token) if isinstance(a, Say)])
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
                    await self._drive()
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

    async def _probe_all_dry(self) -> None:
        """--dry-run: one probe per host without an agent, every host before the plan."""
        assert self.planner is not None
        planner = self.planner

        async def one(machine: Machine) -> None:
            try:
                if machine.slurm is not None:  # a dry run plans into the queue without connecting
                    state = queue_state(machine.slurm)
                else:
                    async with self._connecting:
                        state = await probe_only(machine, accept_new=self.options.accept_new, keepalive=self.options.keepalive)
            except (HostKeyError, AuthenticationError) as exc:
                raise _named(machine.name, exc) from None
            except TransportError as exc:
                self._perform(planner.host_unreachable(machine.name, str(exc)))
                return
            self._perform(planner.probe_landed(machine.name, state))

        results = await asyncio.gather(*(one(m) for m in self.machines.values()), return_exceptions=True)
        fatal = [r for r in results if isinstance(r, BaseException)]
        if fatal:
            raise self._report_rest(fatal)

    async def _start_host(self, machine: Machine) -> None:
        """Connect (at most ``max_connecting`` hosts at once: sshd's ``MaxStartups`` drops a
        flood of unauthenticated connections), start the agent and probe; the planner places
        jobs there as soon as the probe lands, whatever the other hosts do.  A host we cannot
        trust or log into is a configuration error that ends the batch; an unreachable one is
        retried later."""
        assert self.planner is not None
        planner, name = self.planner, machine.name
        early = self._early.take(name) if self._early is not None else None
        try:
            if early is not None:
                executor = await early
            else:
                async with self._connecting:
                    executor = await self._open(machine)
        except (HostKeyError, AuthenticationError) as exc:
            raise _named(name, exc) from None
        except TransportError as exc:
            why = str(exc)
            if isinstance(exc, AgentStartError):
                self._unusable[name] = why
            self._answer(name, lambda: planner.host_unreachable(name, why))
            return
        self.executors[name] = executor
        log.info("connected to %s", name)
        found = {n: bool(s.get("running")) for n, s in executor.agent_jobs.items()}
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                state, own = await executor.probe()
        except (ProbeError, TransportError, TimeoutError) as exc:
            reason = f"{executor.name}: probe failed: {exc or f'no answer in {PROBE_TIMEOUT:g} s'}"
            self._answer(name, lambda: planner.probe_failed(name, reason))
            return
        self.bus.publish(HostProbed.of(name, state))
        if self._first_answer is None:
            self._first_answer = time.monotonic()
            self._helper(self._grace(self._first_answer - self._hosts_started))
        self._answer(name, lambda: planner.probe_landed(name, state, own, agent_jobs=found, now=time.time()))

    async def _grace(self, first: float) -> None:
        await asyncio.sleep(max(PROBE_GRACE, first))
        assert self.planner is not None
        self._perform(self.planner.probes_overdue())

    def _answer(self, host: str, event: Callable[[], list[Action]]) -> None:
        """Tell the planner how a host's start went.  The last host's answer may refuse the
        batch (no usable host, a job no host fits): the host's own warning is still said, and
        with no usable host the causes of hosts reached but unusable, not "unreachable"."""
        assert self.planner is not None
        try:
            self._perform(event())
        except SchedulerError as exc:
            down = self.planner.hosts[host].down
            if down is not None:
                self.bus.publish(HostDown(host=host, reason=down, at_start=True))
            if not isinstance(exc, NoUsableHostError):
                raise
            if self._unusable:
                raise NoUsableHostError(f"no host could be used, nothing was run: {'; '.join(self._unusable.values())}") from None
            if not self.executors:
                raise NoUsableHostError("no host could be reached; nothing was run") from None
            raise exc from None

    def _report_rest(self, errors: Sequence[BaseException]) -> BaseException:
        """The first of several errors, to raise; the others are published."""
        for exc in errors[1:]:
            self.bus.publish(Notice(level="error", message=str(exc)))
        return errors[0]

    async def _open(self, machine: Machine) -> Executor:
        """Connect to a host: through our agent, or to Slurm through a login node's agent."""
        # The agent starts the probe with its hello (_start_host and _revive probe right after
        # this).  That probe lands with generation None ("taken just now", every ghost cleared),
        # which is right: it was requested before any job was placed on this connection, so no
        # release precedes it (allocate.py probe_started()).
        opener = (
            partial(open_executor, probe_first=True)
            if machine.slurm is None
            else partial(open_slurm_executor, settings=machine.slurm)
        )
        return await opener(
            machine, accept_new=self.options.accept_new, keepalive=self.options.keepalive,
            lease=self.options.lease, token=self.token,
        )

    async def _probe(self, host: str) -> None:
        """One re-probe the planner asked for (it keeps them coalesced and rate-limited)."""
        assert self.planner is not None
        executor = self.executors.get(host)
        if executor is None or executor.lost is not None:  # lost before any job of ours noticed
            why = executor.lost if executor is not None else None
            self._perform(self.planner.probe_failed(host, f"{host}: connection lost ({why or 'closed'})"))
            return
        resources = self.planner.resources(host)
        generation = resources.probe_started() if resources is not None else None
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                state, own = await executor.probe()
        except (ProbeError, TransportError, TimeoutError) as exc:
            reason = f"{executor.name}: probe failed: {exc or f'no answer in {PROBE_TIMEOUT:g} s'}"
            self._perform(self.planner.probe_failed(host, reason))
            return
        self.bus.publish(HostProbed.of(host, state))
        self._perform(self.planner.probe_landed(host, state, own, generation, now=time.time()))

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
                async with self._connecting:
                    executor = await self._open(self.machines[host])
            except TransportError:
                continue
            try:
                async with asyncio.timeout(PROBE_TIMEOUT):
                    state, own = await executor.probe()
            except (ProbeError, TransportError, TimeoutError):
                with contextlib.suppress(Exception):
                    await executor.close()
                continue
            self.executors[host] = executor
            self.bus.publish(HostProbed.of(host, state))
            found = {n: bool(s.get("running")) for n, s in executor.agent_jobs.items()}
            self._perform(planner.host_back(host, state, own, found, now=time.time()))
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

    async def _drive(self) -> None:
        assert self.planner is not None
        planner = self.planner
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                helpers = [tg.create_task(self._timer())]
                self._hosts_started = time.monotonic()
                self._perform(planner.begin(self.token))
                starting = [tg.create_task(self._start_host(m)) for m in self.machines.values()]
                if self._stop_requested:
                    self._perform(planner.stop())
                # Hosts still connecting when everything is done are not needed.
                while not (planner.done and not self._tasks and (planner.began or planner.draining)):
                    self._changed.clear()
                    await self._changed.wait()
                for task in [*helpers, *starting, *self._helpers]:
                    task.cancel()
                self._tg = None
        except BaseExceptionGroup as group:
            raise self._report_rest(_leaves(group)) from None

    async def _timer(self) -> None:
        """Wakes the planner at its next deadline (``--timeout``, a host's next probe)."""
        assert self.planner is not None
        while True:
            self._wake_timer.clear()
            deadline = self.planner.next_deadline()
            delay = None if deadline is None else deadline - time.time()
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake_timer.wait()
                continue
            self._perform(self.planner.tick(time.time()))
            await asyncio.sleep(0)

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
                case Reprobe(host=host):
                    self._helper(self._probe(host))
                case Revive(host=host):
                    self._helper(self._revive(host))
                case Cleanup(host=host, job=name):
                    self._spawn(None, self._cleanup(host, name))
                case StopBatch():
                    self.summary.cancelled = True
                    if self._main is not None:
                        self._main.cancel()
                case Commit() | Discard():
                    raise AssertionError(f"{action} is handled by the job's own task")
        self._changed.set()
        self._wake_timer.set()

    def _helper(self, coro: Coroutine[Any, Any, None]) -> None:
        """A task the batch does not wait for at its end (a probe, a reviver, a timer)."""
        assert self._tg is not None
        task = self._tg.create_task(coro)
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    def _spawn(self, name: str | None, coro: Coroutine[Any, Any, None]) -> None:
        assert self._tg is not None
        task = self._tg.create_task(coro)
        if name is not None:
            self._tasks[name] = task

            def done(_: object) -> None:
                # A retry may be placed (a new task under this name) while this attempt still
                # discards its folder: leave the newer attempt's task and run where they are.
                if self._tasks.get(name) is task:
                    del self._tasks[name]
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
                            executor.on_running[name] = lambda: self._perform(
                                planner.job_started(name, time.time(), executor.submitted.get(name, ""))
                            )
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


def _named(host: str, exc: HostKeyError | AuthenticationError) -> BaseException:
    """Which of many hosts: name it."""
    return exc if host in str(exc) else type(exc)(f"{host}: {exc}")


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


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
