"""The coordinator: performs what the planner decides and tells it what happened.

Decisions live in :mod:`ssh_scheduler.planner.plan` (pure); the coordinator does the I/O: choose
which jobs of the batch file still need running (``job_results/`` and its journal), connect to
every host, probe them, re-probe, revive lost hosts (:mod:`ssh_scheduler.coordinator.hosts`), run
each placed job (:mod:`ssh_scheduler.coordinator.job_task`), and publish every event on the event
stream, to which the journal and the terminal lines subscribe.  This module is the batch itself:
its set-up, its main loop, and the one place the planner's actions are carried out; a dry run is
:mod:`ssh_scheduler.coordinator.dry_run`.

Every task has a parent (one TaskGroup); nothing sleeps and polls: the main loop waits on an
event set whenever the planner's state changes, timers wait for the planner's next deadline.

A batch is a fixed list of jobs, or ``open``: jobs join it while it runs (:meth:`Batch.add`,
chosen and refused by the same rules as the first ones) and it ends only once its owner has
closed it (:meth:`Batch.close`) and what it holds has ended (``ssh_scheduler.Executor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from ssh_scheduler.coordinator.batch_run import BatchOptions, Selector
from ssh_scheduler.coordinator.control import ControlServer, batch_requests
from ssh_scheduler.coordinator.dry_run import plan_dry_run
from ssh_scheduler.coordinator.early_hosts import EarlyHosts
from ssh_scheduler.coordinator.hosts import PRESTAGE_BYTES, Hosts, first_error
from ssh_scheduler.coordinator.job_task import JobTasks
from ssh_scheduler.coordinator.open_files import raise_open_files_limit
from ssh_scheduler.errors import BatchError, SchedulerError
from ssh_scheduler.events import BatchFinished, EventBus, Notice
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.forward import check_forward_size, check_job_copies, describe_forward
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.planner.actions import (
    Action,
    Cleanup,
    Commit,
    Discard,
    KillJob,
    PlanOptions,
    Reprobe,
    Revive,
    Say,
    StartJob,
    StopBatch,
)
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.results.journal import Journal, JournalWriter, batch_token
from ssh_scheduler.results.results_folder import hold_results_folder, refuse_planted_links
from ssh_scheduler.results.summary import BatchSummary, JobOutcome
from ssh_scheduler.view.terminal import Printer, TerminalLines

__all__ = ["Batch", "BatchOptions", "BatchSummary", "JobOutcome", "SchedulerError", "run_batch"]


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
        open: bool = False,
    ) -> None:
        self.jobs = list(jobs)
        _check_commands(self.jobs)
        self.open = open
        """Jobs may join while it runs (:meth:`add`) until :meth:`close`."""
        self.under_way = asyncio.Event()
        """Set once the batch is set up and runs (its results folder held, its journal open):
        what goes wrong before it is an error of :meth:`run`, after it an event."""
        self._closed = not open
        self._selector: Selector | None = None
        self.machines = {m.name: m for m in machines}
        self.options = options
        self.bus = bus or EventBus()
        if out is not None or err is not None:
            self.bus.subscribe(TerminalLines(out or (lambda _: None), err or (lambda _: None)))
        self.summary = BatchSummary()
        self.bus.subscribe(self.summary)
        self.planner: Planner | None = None
        self.token = ""
        self._changed = asyncio.Event()
        self._wake_timer = asyncio.Event()
        self._early = early  # hosts already connecting (early_hosts.py), taken as they are needed
        self._connecting = early.connecting if early is not None else asyncio.Semaphore(max(1, options.max_connecting))
        self.hosts = Hosts(
            self.machines, options, self.bus, self.summary, self._connecting, perform=self._perform, helper=self._helper
        )
        self.job_tasks: JobTasks | None = None  # once the planner is made
        self._folder: int | None = None  # the results folder's verified descriptor, while held
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._helpers: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[object] | None = None
        self._stop_requested = 0
        self._started = time.monotonic()

    # -- public --------------------------------------------------------------------------------

    async def run(self) -> BatchSummary:
        # One run per results folder: two would both run every job and fail each other's results.
        try:
            with hold_results_folder(self.options.results_dir, create=not self.options.dry_run) as folder:
                self._folder = folder
                return await self._run()
        finally:
            if self._early is not None:  # refused, or done before every host was needed
                await self._early.close()

    async def _run(self) -> BatchSummary:
        self._main = asyncio.current_task()
        options = self.options
        check_job_copies(self.jobs, options.base_dir, options.forward)
        self._selector = Selector(options, self.bus)
        selection = self._selector.select(self.jobs)
        if self._early is not None:
            if batch_token(options.results_dir) is None:  # still fresh: the early agents' token it is
                selection.token = self._early.token
            else:  # another run wrote here since the hosts were started: reattach as usual
                await self._early.close()
                self._early = None
        self.token = selection.token
        if not selection.pending and not self.open:
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
            resumable={**self._selector.left_running(), **selection.resumable} if self.open else selection.resumable,
            already_done=selection.already_done,
            open=not self._closed,
        )
        self.hosts.use(planner, self.token, self._early)
        job_tasks = self.job_tasks = JobTasks(
            planner, self.hosts.executors, self.machines, options, token=self.token, bus=self.bus, perform=self._perform,
            folder=self._folder,
        )
        forward = await asyncio.to_thread(job_tasks.forward, options.copy_forwards)
        if options.dry_run:
            self.bus.publish(Notice(level="info", message=describe_forward(forward, options.copy_forwards, options.forward)))
        else:
            check_forward_size(forward, options.copy_forwards, options.forward)
            if forward.total_bytes <= PRESTAGE_BYTES and len(selection.pending) >= len(self.machines):
                self.hosts.prestage = forward  # every host should take a job: send it ahead
        raise_open_files_limit(len(self.machines))
        # What was hashed, kept for the next command, beside the hosts' start (not before it).
        saving = asyncio.ensure_future(asyncio.to_thread(job_tasks.hasher.save))
        try:
            if options.dry_run:
                await plan_dry_run(
                    planner, list(self.machines.values()), options, token=self.token, bus=self.bus,
                    connecting=self._connecting, perform=self._perform,
                )
                return self.summary
            options.results_dir.mkdir(parents=True, exist_ok=True)
            with Journal.open(options.results_dir, folder=self._folder, on_failure=job_tasks.local_failure) as journal:
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
            await self.hosts.close_all(keep=job_tasks.kept)
            await saving
            await asyncio.to_thread(job_tasks.hasher.save)  # what jobs' own copies hashed since
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

    def add(self, jobs: Sequence[Job]) -> None:
        """Jobs join an open batch (call it on the batch's event loop).  Those with results are
        skipped (``JobSkipped``), the rest run like the first jobs.  Raises :class:`BatchError`
        when the batch is not open, closed or over, or a name is already in it; ``ConfigError``
        or ``TransferError`` as the first jobs would (a changed command, a planted link)."""
        if self._closed:
            raise BatchError("jobs cannot join this batch: it is not open, or was closed")
        _check_commands(jobs)
        planner, selector = self.planner, self._selector
        if planner is None or selector is None:  # not set up yet: chosen with the first jobs
            self.jobs.extend(jobs)
            return
        if planner.began and self._tg is None:
            raise BatchError("jobs cannot join this batch: it is over")
        check_job_copies(jobs, self.options.base_dir, self.options.forward)
        selection = selector.select(jobs)
        refuse_planted_links(self.options.results_dir, (job.name for job in selection.pending))
        if selection.pending:
            self._perform(planner.jobs_added(selection.pending))

    def close(self) -> None:
        """No more jobs join: an open batch ends once what it holds has ended."""
        self._closed = True
        if self.planner is not None:
            self._perform(self.planner.close())

    def perform(self, actions: Sequence[Action]) -> None:
        """Perform what the planner answered to an event from outside the loop (pause, cancel)."""
        self._perform(actions)

    # -- the loop ------------------------------------------------------------------------------

    async def _drive(self) -> None:
        assert self.planner is not None
        planner = self.planner
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self.under_way.set()
                helpers = [tg.create_task(self._timer())]
                began = time.monotonic()
                self._perform(planner.begin(self.token))
                starting = self.hosts.start_all(tg, began)
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
            raise first_error(self.bus, _leaves(group)) from None

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
                    assert self.job_tasks is not None
                    self._spawn(action.job.name, self.job_tasks.run(action))
                case KillJob(job=name, reason="timeout"):
                    run = self.job_tasks.runs.get(name) if self.job_tasks is not None else None
                    if run is not None:
                        self._spawn(None, run.stop("timeout"))
                case KillJob(job=name):
                    task = self._tasks.get(name)
                    if task is not None:
                        task.cancel()
                case Reprobe(host=host):
                    self._helper(self.hosts.probe(host))
                case Revive(host=host):
                    self._helper(self.hosts.revive(host))
                case Cleanup(host=host, job=name):
                    assert self.job_tasks is not None
                    self._spawn(None, self.job_tasks.cleanup(host, name))
                case StopBatch():
                    self.summary.cancelled = True
                    if self._main is not None:
                        self._main.cancel()
                case Commit() | Discard():
                    raise AssertionError(f"{action} is handled by the job's own task")
        self._changed.set()
        self._wake_timer.set()

    def _helper(self, coro: Coroutine[Any, Any, None]) -> None:
        """A task the batch does not wait for at its end (a probe, a reviver, a timer); none once
        it has ended (a host whose connection completed as the batch ended asks for its inputs)."""
        if self._tg is None:
            coro.close()
            return
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
                    if self.job_tasks is not None:
                        self.job_tasks.runs.pop(name, None)
                self._changed.set()

            task.add_done_callback(done)

    def _finish(self, planner: Planner | None) -> BatchSummary:
        summary = self.summary
        for executor in self.hosts.executors.values():
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


def _check_commands(jobs: Sequence[Job]) -> None:
    for job in jobs:
        if "\x00" in job.command:  # the CLI cannot carry one, the Python API can
            raise BatchError(f"job {job.name}: the command contains a NUL byte; remove it")


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
