"""The coordinator: probe every host, place each job where it fits, run it, bring results home.

Event-driven throughout: a job waits on ``capacity`` (set when a job ends, a probe lands or a host
comes back), never on a sleep-and-poll loop.  Re-probes run on a timer and after each job's end so
GPUs freed or taken by other people are noticed during the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .allocate import (
    MachineResources,
    Needs,
    OwnUsage,
    Placement,
    choose,
    explain_unfit,
    max_concurrent,
)
from .batch import Job
from .config import Machine
from .errors import (
    AuthenticationError,
    HostKeyError,
    ProbeError,
    SchedulerError,
    TransferError,
    TransportError,
    UnsatisfiableError,
)
from .journal import Journal
from .probe import PROBE_COMMAND, HostState, parse_probe_output
from .runner import DEFAULT_LEASE, HostSession
from .transfer import (
    CopyLimits,
    ForwardSet,
    Hasher,
    HostCache,
    collect_forward,
    fetch_back,
    send_forward,
)
from .transport import Transport, connect, describe

Printer = Callable[[str], None]
MIN_PROBE_GAP = 1.0


@dataclass(frozen=True, slots=True)
class BatchOptions:
    needs: Needs = Needs()
    gpus_explicit: bool = False  # False: a GPU is wanted only if some host has one
    copy_forwards: tuple[str, ...] = (".",)
    copy_backwards: tuple[str, ...] | None = None
    results_dir: Path = Path("job_results")
    base_dir: Path = Path(".")
    dry_run: bool = False
    accept_new: bool = False
    probe_interval: float = 15.0
    lease: float = DEFAULT_LEASE
    limits: CopyLimits = CopyLimits()
    retries: int = 0
    host_failures_before_quarantine: int = 3


@dataclass(slots=True)
class JobOutcome:
    job: str
    exit_code: int | None
    host: str | None
    gpus: tuple[int, ...] = ()
    started: float = 0.0
    ended: float = 0.0
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(slots=True)
class BatchSummary:
    outcomes: dict[str, JobOutcome] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0
    files_uploaded: int = 0
    bytes_downloaded: int = 0
    cancelled: bool = False

    @property
    def failed(self) -> list[str]:
        return [name for name, o in self.outcomes.items() if not o.ok]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed or self.cancelled else 0

    def describe(self) -> str:
        finished = len(self.outcomes) - len(self.failed)
        return (
            f"done: {finished} finished, {len(self.failed)} failed, {len(self.skipped)} skipped; "
            f"sent {self.bytes_uploaded} bytes in {self.files_uploaded} files, "
            f"received {self.bytes_downloaded} bytes"
        )


@dataclass(slots=True)
class Host:
    machine: Machine
    transport: Transport | None = None
    session: HostSession | None = None
    resources: MachineResources | None = None
    cache: HostCache | None = None
    down: str | None = None  # why the host is not usable now
    failures: int = 0

    @property
    def usable(self) -> bool:
        return self.down is None and self.resources is not None


def job_needs(options: BatchOptions, states: Sequence[HostState]) -> Needs:
    """The ancestor requires a GPU by default; on a fleet with no GPU at all that default could
    never be met, so unless the user asked for GPUs explicitly it quietly becomes 'no GPU'."""
    needs = options.needs
    if needs.gpus and not options.gpus_explicit and not any(s.gpus for s in states):
        from dataclasses import replace

        return replace(needs, gpus=0, gpu_memory_mb=0, gpu_utilization=0.0, reserve_gpu=False)
    return needs


def cuda_visible_devices(placement: Placement) -> str:
    return ",".join(str(i) for i in placement.gpu_indices)


def skip_existing(jobs: Sequence[Job], results: Path, out: Printer) -> tuple[list[Job], list[str]]:
    runnable: list[Job] = []
    skipped: list[str] = []
    for job in jobs:
        if (results / job.name).exists():
            out(
                f"WARNING: job results already exists for line {job.line_number}, "
                f"skipping evaluation: delete if you wish to rerun"
            )
            skipped.append(job.name)
        else:
            runnable.append(job)
    return runnable, skipped


class Batch:
    """One run of a batch.  ``await Batch(...).run()``; ``request_stop`` drains or kills."""

    def __init__(
        self,
        jobs: Sequence[Job],
        machines: Sequence[Machine],
        options: BatchOptions,
        *,
        out: Printer = print,
        err: Printer = print,
    ) -> None:
        self.jobs = list(jobs)
        self.hosts = {m.name: Host(m) for m in machines}
        self.options = options
        self.out = out
        self.err = err
        self.summary = BatchSummary()
        self.capacity = asyncio.Event()
        self.reprobe_now = asyncio.Event()
        self.draining = False
        self.token = secrets.token_hex(4)
        self.hasher = Hasher()
        self.forward_sets: dict[tuple[str, ...], ForwardSet] = {}
        self.attempts: dict[str, list[str]] = {}
        self.needs = options.needs
        self.journal: Journal | None = None
        self._main: asyncio.Task[BatchSummary] | None = None
        self._last_wait_reason = ""

    # -- public -----------------------------------------------------------------------------------
    async def run(self) -> BatchSummary:
        self._main = asyncio.current_task()  # type: ignore[assignment]
        results = self.options.results_dir
        pending, self.summary.skipped = skip_existing(self.jobs, results, self.out)
        if not pending:
            self.out("nothing to do: every job already has results")
            return self.summary
        self.forward_sets[self.options.copy_forwards] = await asyncio.to_thread(
            collect_forward, self.options.copy_forwards, self.options.base_dir, self.hasher
        )
        try:
            await self._connect_all()
            await self._probe_all(initial=True)
            self._check_fit(pending)
            self._print_header()
            if self.options.dry_run:
                self._print_plan(pending)
                return self.summary
            results.mkdir(parents=True, exist_ok=True)
            with Journal.open(results) as journal:
                self.journal = journal
                await self._dispatch(deque(pending))
        finally:
            await self._close_all()
        self._tally_transfers()
        return self.summary

    def request_stop(self) -> None:
        """First call: start no new jobs and let the running ones finish.  Second: kill them."""
        if not self.draining:
            self.draining = True
            self.capacity.set()
            self.err("stopping: no new jobs will start; running jobs finish (Ctrl-C again to kill them)")
        elif self._main is not None:
            self.err("killing running jobs")
            self.summary.cancelled = True
            self._main.cancel()

    # -- hosts ------------------------------------------------------------------------------------
    async def _connect_all(self) -> None:
        async def one(host: Host) -> None:
            try:
                host.transport = await connect(host.machine, accept_new=self.options.accept_new)
                host.session = HostSession(host.transport, lease=self.options.lease)
                await host.session.__aenter__()
                host.cache = HostCache(host.session)
            except (HostKeyError, AuthenticationError):
                raise
            except TransportError as exc:
                host.down = str(exc)

        results = await asyncio.gather(*(one(h) for h in self.hosts.values()), return_exceptions=True)
        fatal = [r for r in results if isinstance(r, BaseException)]
        if fatal:
            # A host we cannot trust or log into is a configuration error: stop before dispatch.
            for exc in fatal[1:]:
                self.err(f"error: {exc}")
            raise fatal[0]
        for host in self.hosts.values():
            if host.down:
                self.err(f"warning: {host.down}")
        if not any(h.session for h in self.hosts.values()):
            raise TransportError("no host could be reached; nothing was run")

    async def _close_all(self) -> None:
        async def one(host: Host) -> None:
            if host.session is not None:
                await host.session.close()
            if host.transport is not None:
                await host.transport.close()

        await asyncio.gather(*(one(h) for h in self.hosts.values()), return_exceptions=True)

    async def _probe_all(self, initial: bool = False) -> None:
        hosts = [h for h in self.hosts.values() if h.session is not None and h.session.lost is None]
        await asyncio.gather(*(self._probe(h, initial) for h in hosts))
        if initial:
            states = [h.resources.state for h in self.hosts.values() if h.resources is not None]
            if not states:
                reasons = "; ".join(f"{h.machine.name}: {h.down}" for h in self.hosts.values())
                raise TransportError(f"no usable host ({reasons})")
            self.needs = job_needs(self.options, states)
        self.capacity.set()

    async def _probe(self, host: Host, initial: bool) -> None:
        assert host.session is not None
        try:
            text, _rc, own = await host.session.probe(PROBE_COMMAND)
            state = parse_probe_output(text)
        except (ProbeError, TransportError) as exc:
            host.down = f"{describe(host.machine)}: probe failed: {exc}"
            if initial:
                self.err(f"warning: {host.down}")
            return
        usage = {
            name: OwnUsage(pids=frozenset(int(p) for p in u.get("pids", ())), rss_mb=int(u.get("rss_mb", 0)))
            for name, u in own.items()
        }
        if host.resources is None:
            host.resources = MachineResources(host.machine.name, state)
        else:
            host.resources.update(state, usage)

    async def _reprobe_loop(self) -> None:
        """Re-probe on a timer and when a job ends, at most once per ``MIN_PROBE_GAP`` seconds
        (ends during a probe fold into the next one), so a burst of short jobs cannot keep the
        hosts busy probing."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.probe_interval):
                    await self.reprobe_now.wait()
            self.reprobe_now.clear()
            await self._probe_all()
            await asyncio.sleep(MIN_PROBE_GAP)

    # -- planning ---------------------------------------------------------------------------------
    def _usable(self) -> list[MachineResources]:
        return [h.resources for h in self.hosts.values() if h.usable and h.resources is not None]

    def _check_fit(self, jobs: Sequence[Job]) -> None:
        machines = self._usable()
        if not any(m.could_ever_fit(self.needs) for m in machines):
            first = jobs[0].name
            raise UnsatisfiableError(
                f"job {first} (and every job of this batch) can never run: "
                f"{explain_unfit(machines, self.needs)}; lower the job's needs or add a bigger machine"
            )

    def _print_header(self) -> None:
        limits = {
            h.machine.source or h.machine.name: max_concurrent(h.resources, self.needs)
            for h in self.hosts.values()
            if h.resources is not None and h.usable
        }
        self.out(f"machine limits:  {limits}")
        choices = [
            [g.index for g in h.resources.state.gpus]
            for h in self.hosts.values()
            if h.resources is not None and h.usable
        ]
        self.out(f"machine gpu choices: {choices}")

    def _print_plan(self, jobs: Sequence[Job]) -> None:
        """Simulate the schedule, assuming jobs end in the order they started."""
        running: deque[tuple[MachineResources, str]] = deque()
        machines = self._usable()
        for job in jobs:
            while True:
                target = choose(machines, self.needs)
                if target is not None:
                    placement = target.allocate(job.name, self.needs)
                    running.append((target, job.name))
                    gpus = cuda_visible_devices(placement)
                    self.out(f"plan: {job.name} -> {target.name} CUDA_VISIBLE_DEVICES={gpus}")
                    break
                if not running:
                    raise UnsatisfiableError(f"job {job.name} fits on no host")
                done_on, done_job = running.popleft()
                done_on.release(done_job)
        for machine, name in running:
            machine.release(name)

    # -- running ----------------------------------------------------------------------------------
    async def _dispatch(self, pending: deque[Job]) -> None:
        async with asyncio.TaskGroup() as tg:
            prober = tg.create_task(self._reprobe_loop())
            running: set[asyncio.Task[None]] = set()
            while pending and not self.draining:
                placed = self._place(pending[0])
                if placed is None:
                    if not running and not any(h.usable for h in self.hosts.values()):
                        raise TransportError("every host is down; the remaining jobs were not run")
                    if not running:
                        self._say_waiting(pending[0])
                    self.capacity.clear()
                    await self.capacity.wait()
                    continue
                job = pending.popleft()
                task = tg.create_task(self._run_job(job, placed, pending))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:
                await asyncio.wait(set(running))
                # A requeued job (its host was lost) goes round again.
                while pending and not self.draining:
                    placed = self._place(pending[0])
                    if placed is None:
                        if not running:
                            self.capacity.clear()
                            await self.capacity.wait()
                            continue
                        break
                    job = pending.popleft()
                    task = tg.create_task(self._run_job(job, placed, pending))
                    running.add(task)
                    task.add_done_callback(running.discard)
            prober.cancel()

    def _say_waiting(self, job: Job) -> None:
        """Nothing of ours runs and still nothing fits: other users hold the room.  Say so once
        per change of reason, rather than sitting silent."""
        reason = "; ".join(
            f"{h.machine.name}: {h.resources.capacity_summary()}"
            for h in self.hosts.values()
            if h.usable and h.resources is not None
        )
        if reason != self._last_wait_reason:
            self._last_wait_reason = reason
            self.err(f"waiting: no host has room for {job.name} now ({reason})")

    def _place(self, job: Job) -> Placement | None:
        avoid = set(self.attempts.get(job.name, ()))
        machines = [m for m in self._usable() if m.name not in avoid] or self._usable()
        target = choose(machines, self.needs)
        if target is None:
            return None
        return target.allocate(job.name, self.needs)

    def _forward_for(self, job: Job) -> ForwardSet:
        key = job.copy_forwards if job.copy_forwards is not None else self.options.copy_forwards
        found = self.forward_sets.get(key)
        if found is None:
            found = collect_forward(key, self.options.base_dir, self.hasher)
            self.forward_sets[key] = found
        return found

    async def _run_job(self, job: Job, placement: Placement, pending: deque[Job]) -> None:
        host = self.hosts[placement.machine]
        assert host.session is not None and host.cache is not None and host.resources is not None
        session = host.session
        results = self.options.results_dir
        jobdir = f"{session.root}/jobs/{self.token}-{job.name}"
        gpus = cuda_visible_devices(placement)
        outcome = JobOutcome(job.name, None, host.machine.name, placement.gpu_indices)
        out_fd = os.open(results / f"{job.name}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        err_fd = os.open(results / f"{job.name}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        fds = {1: out_fd, 2: err_fd}
        assert self.journal is not None
        self.journal.record(job.name, "placed", host=host.machine.name, gpus=list(placement.gpu_indices), command=job.command)
        try:
            try:
                await send_forward(host.cache, await asyncio.to_thread(self._forward_for, job), jobdir)
            except TransportError as exc:
                self._host_failed(host, str(exc))
                self._requeue(job, host, pending)
                return
            self.out(f"started: {job.name};  export CUDA_VISIBLE_DEVICES={gpus} && {job.command}")
            outcome.started = time.time()
            self.journal.record(job.name, "started", host=host.machine.name)
            ended = await session.run(
                job.name,
                job.command,
                cwd=jobdir,
                # nvidia-smi numbers GPUs in PCI order; CUDA's default order may differ.
                env={
                    "CUDA_VISIBLE_DEVICES": gpus,
                    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                    "SSH_SCHEDULER_JOB": job.name,
                },
                out_path=None,
                err_path=None,
                on_output=lambda fd, data: os.write(fds[fd], data),
            )
            outcome.ended = time.time()
            if ended.host_lost:
                self._host_failed(host, ended.message or "connection lost")
                self._requeue(job, host, pending)
                return
            outcome.exit_code = ended.code
            try:
                got = await fetch_back(
                    session,
                    jobdir,
                    results / job.name,
                    paths=job.copy_backwards if job.copy_backwards is not None else self.options.copy_backwards,
                    limits=self.options.limits,
                )
                self.summary.bytes_downloaded += got.bytes
                for warning in got.warnings:
                    self.err(f"warning: {job.name}: {warning}")
                await session.remove(jobdir)
            except (TransferError, TransportError) as exc:
                outcome.message = str(exc)
                outcome.exit_code = outcome.exit_code or 1
                self.err(f"error: {job.name}: copy back failed: {exc}")
            self.summary.outcomes[job.name] = outcome
            self.journal.record(job.name, "finished" if outcome.ok else "failed", code=outcome.exit_code, host=host.machine.name)
            if outcome.ok:
                self.out(f"finished: {job.name}; {job.command}")
            else:
                self.out(f"failed: {job.name}; {job.command}  (exit {outcome.exit_code} on {host.machine.name})")
            host.failures = 0
        finally:
            os.close(out_fd)
            os.close(err_fd)
            host.resources.release(job.name)
            self.capacity.set()
            self.reprobe_now.set()

    def _host_failed(self, host: Host, reason: str) -> None:
        host.failures += 1
        if host.down is None:
            host.down = reason
            self.err(f"warning: host {host.machine.name} lost: {reason}")

    def _requeue(self, job: Job, host: Host, pending: deque[Job]) -> None:
        self.attempts.setdefault(job.name, []).append(host.machine.name)
        assert self.journal is not None
        self.journal.record(job.name, "requeued", host=host.machine.name)
        self.out(f"requeued: {job.name}; host {host.machine.name} was lost")
        pending.appendleft(job)

    def _tally_transfers(self) -> None:
        for host in self.hosts.values():
            if host.cache is not None:
                self.summary.bytes_uploaded += host.cache.bytes_uploaded
                self.summary.files_uploaded += host.cache.files_uploaded


async def run_batch(
    jobs: Sequence[Job],
    machines: Sequence[Machine],
    options: BatchOptions,
    *,
    out: Printer = print,
    err: Printer = print,
) -> BatchSummary:
    """The Python API behind ``execute_batch``."""
    return await Batch(jobs, machines, options, out=out, err=err).run()


__all__ = ["Batch", "BatchOptions", "BatchSummary", "JobOutcome", "SchedulerError", "run_batch"]
