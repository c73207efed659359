"""The coordinator behind an ``Executor``: one open batch, in an event loop of its own thread.

Calls join the batch as jobs (:meth:`CallBatch.add`, from any thread; those added in one turn of
the loop join together), and each call's future is resolved from the batch's event stream: its
job finished, failed, was skipped (its result is already in the results folder: the resume),
cancelled or not run.  Exactly one event ends a job, so a future is resolved once, also when
the call was requeued from a lost host or retried.  The result is read off the event loop (a
large value must not stall the batch).  If the batch itself ends or fails (every host gone, the
executor stopped), every future still open gets the reason.

Cancelling a future cancels its job: taken out of the queue, or killed on its host (its
processes are gone before the job counts as cancelled).  :meth:`CallBatch.stop` kills
everything: stop, then kill, as a second Ctrl-C does to ``execute_batch``.

The batch keeps its event file (``job_results/.events.jsonl``, :mod:`ssh_scheduler.results.event_log`)
as a batch of the command line does: ``ssh-scheduler attach`` and ``report`` show a script's calls,
their hosts, GPUs and probes, like any batch's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ssh_scheduler.coordinator.batch import Batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.errors import SchedulerError
from ssh_scheduler.events import (
    BatchFinished,
    Event,
    EventBus,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobNotRun,
    JobRequeued,
    JobRetrying,
    JobSkipped,
    JobStarted,
)
from ssh_scheduler.functions.outcome import CallError, Outcome, read_outcome
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.planner.phases import JobPhase
from ssh_scheduler.results.event_log import EventLog
from ssh_scheduler.view.display import summary_lines

__all__ = ["CallBatch", "CallFuture"]

log = logging.getLogger(__name__)


class CallFuture(concurrent.futures.Future[Any]):
    """A call's future.  It stays pending while the call runs (so :meth:`cancel` still works:
    it kills the call on its host), :meth:`running` says whether the call runs now, and
    ``job`` names its job (its results are ``job_results/<job>/``)."""

    def __init__(self, job: str, cancel_job: Callable[[str], None]) -> None:
        super().__init__()
        self.job = job
        self._cancel_job = cancel_job
        self.host: str | None = None
        """Where the call runs or ran (None before it started)."""

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._cancel_job(self.job)
        return True

    def running(self) -> bool:
        return self.host is not None and not self.done()

    def settle(self, outcome: Outcome) -> None:
        """Resolve it (once; a future the user cancelled meanwhile stays cancelled)."""
        if self.done() or not self.set_running_or_notify_cancel():
            return
        if outcome.error is not None:
            self.set_exception(outcome.error)
        else:
            self.set_result(outcome.value)


class CallBatch:
    """One open :class:`~ssh_scheduler.coordinator.batch.Batch` in a thread of its own (see
    the module docstring).  :meth:`start` returns once the batch is under way (its results
    folder held, its journal open) or raises why it could not start."""

    def __init__(self, machines: Sequence[Machine], options: BatchOptions, bus: EventBus, payloads: Path) -> None:
        """``payloads``: the folder of the calls' pickles here, removed when the batch is over."""
        self.machines = list(machines)
        self.payload_folder = payloads
        self.options = options
        self.bus = bus
        self.failure: BaseException | None = None
        """Why the batch ended before its owner closed it, or could not start."""
        self.over = threading.Event()
        self._under_way = threading.Event()
        self._lock = threading.Lock()
        self._futures: dict[str, CallFuture] = {}  # open futures, by job
        self._payloads: dict[str, Path] = {}  # each open call's pickle here, removed at its end
        self._incoming: list[tuple[Job, CallFuture]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch: Batch | None = None
        self._thread = threading.Thread(target=self._main, name="ssh_scheduler.Executor", daemon=True)

    # -- from any thread -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._under_way.wait()
        if self.failure is not None:
            raise self.failure

    def add(self, job: Job, future: CallFuture, payload: Path) -> None:
        """The call joins the batch (on the loop's next turn, with the others added meanwhile)."""
        with self._lock:
            if self.over.is_set():
                raise self.ended()
            self._futures[job.name] = future
            self._payloads[job.name] = payload
            self._incoming.append((job, future))
            first = len(self._incoming) == 1
        if first:
            self._call(self._flush)

    def cancel(self, job: str) -> None:
        """Take the job out of the queue, or kill it where it runs."""
        self._call(lambda: self._cancel(job))

    def close(self) -> None:
        """No more calls: the batch ends once its calls have ended."""
        self._call(lambda: self._batch.close() if self._batch is not None else None)

    def stop(self) -> None:
        """Kill every call now (its processes on its host first), end the batch."""

        def stop() -> None:
            if self._batch is not None:
                self._batch.request_stop()
                self._batch.request_stop()

        self._call(stop)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def open_futures(self) -> list[CallFuture]:
        """The futures of the calls that did not end yet."""
        with self._lock:
            return list(self._futures.values())

    # -- on the loop ------------------------------------------------------------------------------

    def _call(self, callback: Callable[[], object]) -> None:
        loop = self._loop
        if loop is None or self.over.is_set():
            return
        with contextlib.suppress(RuntimeError):  # the loop just closed: the batch is over
            loop.call_soon_threadsafe(callback)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            shutil.rmtree(self.payload_folder, ignore_errors=True)
            self._under_way.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        batch = self._batch = Batch([], self.machines, self.options, bus=self.bus, open=True)
        results = self.options.results_dir
        kept = EventLog(results, lambda: (batch.summary.exit_code, summary_lines(batch.summary, results)))
        self.bus.subscribe(kept)
        self.bus.subscribe(self._on_event)
        ended: BaseException | None = None
        try:
            ended = await self._run(batch)
        finally:
            # The exit record: the summary's, or what ended the batch (stopped: as by Ctrl-C).
            kept.__exit__(type(ended) if ended is not None else None, ended, None)

    async def _run(self, batch: Batch) -> BaseException | None:
        """Run the batch to its end; what ended it when it did not end by closing."""
        run = asyncio.ensure_future(batch.run())
        under_way = asyncio.ensure_future(batch.under_way.wait())
        await asyncio.wait({run, under_way}, return_when=asyncio.FIRST_COMPLETED)
        under_way.cancel()
        if not run.done():  # else start() learns why it ended, once that is set (_main)
            self._under_way.set()
        try:
            await run
        except asyncio.CancelledError as exc:  # stopped (request_stop twice): every call was killed
            self.failure = CallError("the executor was stopped: its calls were killed")
            return exc
        except BaseException as exc:  # (any failure is every open call's)
            self.failure = exc
            return exc
        finally:
            with self._lock:
                self.over.set()
                left = list(self._futures.items())
                self._futures.clear()
                self._incoming.clear()
            for job, future in left:
                future.settle(Outcome(error=self.ended(job)))
                self._drop_payload(job)
            if self.failure is not None and not isinstance(self.failure, SchedulerError):
                log.error("the executor's batch failed", exc_info=self.failure)
        return None

    def ended(self, job: str = "") -> BaseException:
        """Why the batch takes no more calls (and ``job`` will not run)."""
        if isinstance(self.failure, SchedulerError):
            return self.failure
        what = f"call {job} did not run" if job else "the executor takes no more calls"
        why = "it failed" if self.failure is not None else "it was shut down or stopped"
        return CallError(f"{what}: the executor's batch is over ({why})", job=job)

    def _flush(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
        if not incoming or self._batch is None:
            return
        try:
            self._batch.add([job for job, _ in incoming])
        except SchedulerError as exc:  # a changed result, a planted link, the batch over
            for job, _ in incoming:
                self._end(job.name, Outcome(error=exc))

    def _cancel(self, job: str) -> None:
        batch = self._batch
        planner = batch.planner if batch is not None else None
        if batch is None or planner is None or job not in planner.jobs:
            return
        if planner.phase(job) in (JobPhase.QUEUED, JobPhase.BLOCKED, JobPhase.RUNNING):
            batch.perform(planner.cancel(job))

    def _on_event(self, event: Event) -> None:
        match event:
            case JobStarted():
                future = self._futures.get(event.job)
                if future is not None:
                    future.host = event.host
            case JobRequeued() | JobRetrying():
                future = self._futures.get(event.job)
                if future is not None:
                    future.host = None
            case JobFinished():
                self._settle_from_results(event.job, event.host, None)
            case JobFailed():
                self._settle_from_results(event.job, event.host, event.message or event.reason)
            case JobSkipped():
                self._settle_from_results(event.job, "an earlier run", None)
            case JobCancelled():
                future = self._take(event.job)
                if future is not None:
                    future.cancel()  # (a no-op when the user cancelled it: that is why it ended)
                    self._drop_payload(event.job)
            case JobNotRun():
                self._end(event.job, Outcome(error=CallError(f"call {event.job} was not run: {event.reason}", job=event.job)))
            case BatchFinished():
                pass  # what is still open is told when run() returns (above)

    def _take(self, job: str) -> CallFuture | None:
        with self._lock:
            return self._futures.pop(job, None)

    def _end(self, job: str, outcome: Outcome) -> None:
        future = self._take(job)
        if future is not None:
            future.settle(outcome)
            self._drop_payload(job)

    def _settle_from_results(self, job: str, host: str, failure: str | None) -> None:
        future = self._take(job)
        if future is None:
            return
        self._drop_payload(job)
        results = self.options.results_dir

        def settle() -> None:
            try:
                outcome = read_outcome(results, job, host, failure)
            except Exception as exc:  # a bug of ours must not leave the future open forever
                log.exception("reading the result of call %s failed", job)
                outcome = Outcome(error=CallError(f"call {job}: its result could not be read ({exc})", job=job, host=host))
            future.settle(outcome)

        assert self._loop is not None
        self._loop.run_in_executor(None, settle)

    def _drop_payload(self, job: str) -> None:
        with self._lock:
            path = self._payloads.pop(job, None)
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()
