"""The coordinator: probe every host, place each job where it fits, run it, bring results home.

Event-driven throughout: the dispatcher waits on ``capacity`` (set when a job ends, a probe lands
or a host comes back), never on a sleep-and-poll loop.  Re-probes run on a timer and after job
ends so GPUs freed or taken by other people are noticed during the batch.

Faults are data: a lost host requeues its jobs elsewhere and is revived in the background; a
restarted coordinator reads the journal, reattaches to jobs the hosts kept running (their agents
hold them for the lease), reruns what was lost, and never commits a result twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import shutil
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

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
    BatchError,
    ConfigError,
    HostKeyError,
    ProbeError,
    SchedulerError,
    TransferError,
    TransportError,
    UnsatisfiableError,
)
from .journal import Journal, batch_token, last_states
from .policy import HaltPolicy, Resumable, changed_commands, in_flight
from .probe import PROBE_COMMAND, HostState, parse_probe_output
from .runner import DEFAULT_LEASE, HostSession, JobExit
from .transfer import (
    CopyLimits,
    ForwardSet,
    Hasher,
    HostCache,
    collect_forward,
    fetch_back,
    prepare_forward,
)
from .transport import Transport, connect, describe

Printer = Callable[[str], None]
MIN_PROBE_GAP = 1.0
REVIVE_MAX_DELAY = 30.0
TIMED_OUT = 124
DISPATCH_SLICE = 32


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
    keepalive: float | None = None
    limits: CopyLimits = CopyLimits()
    retries: int = 0
    retry_failed: bool = False
    allow_changed: bool = False
    timeout: float | None = None
    halt: HaltPolicy = HaltPolicy()
    quarantine_after: int = 3


@dataclass(slots=True)
class JobOutcome:
    job: str
    exit_code: int | None
    host: str | None
    gpus: tuple[int, ...] = ()
    started: float = 0.0
    ended: float = 0.0
    message: str | None = None
    timed_out: bool = False

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
    halted: bool = False
    not_run: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[str]:
        return [name for name, o in self.outcomes.items() if not o.ok]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed or self.cancelled or self.not_run else 0

    def describe(self) -> str:
        finished = len(self.outcomes) - len(self.failed)
        left = f", {len(self.not_run)} not run" if self.not_run else ""
        return (
            f"done: {finished} finished, {len(self.failed)} failed, {len(self.skipped)} skipped{left}; "
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
    failures: int = 0  # infrastructure failures in a row
    quarantined: bool = False
    reviving: bool = False

    @property
    def usable(self) -> bool:
        return self.down is None and self.resources is not None and not self.quarantined


def job_needs(options: BatchOptions, states: Sequence[HostState]) -> Needs:
    """The ancestor requires a GPU by default; on a fleet with no GPU at all that default could
    never be met, so unless the user asked for GPUs explicitly it quietly becomes 'no GPU'."""
    needs = options.needs
    if needs.gpus and not options.gpus_explicit and not any(s.gpus for s in states):
        return replace(needs, gpus=0, gpu_memory_mb=0, gpu_utilization=0.0, reserve_gpu=False)
    return needs


def cuda_visible_devices(placement: Placement) -> str:
    return ",".join(str(i) for i in placement.gpu_indices)


class Batch:
    """One run of a batch.  ``await Batch(...).run()``; ``request_stop`` drains, then kills."""

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
        for job in self.jobs:
            if "\x00" in job.command:  # the CLI cannot carry one, the Python API can
                raise BatchError(f"job {job.name}: the command contains a NUL byte; remove it")
        self.hosts = {m.name: Host(m) for m in machines}
        self.options = options
        self.out = out
        self.err = err
        self.summary = BatchSummary()
        self.capacity = asyncio.Event()
        self.reprobe_now = asyncio.Event()
        self.draining = False
        self.token = ""
        self.hasher = Hasher()
        self.forward_sets: dict[tuple[str, ...], ForwardSet] = {}
        self.failed_on: dict[str, list[str]] = {}
        self.needs = options.needs
        self.journal: Journal | None = None
        self.pending: deque[Job] = deque()
        self.resumable: dict[str, Resumable] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        self._revivers: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[Any] | None = None
        self._last_wait_reason = ""
        self._total = 0

    # -- public -----------------------------------------------------------------------------------
    async def run(self) -> BatchSummary:
        self._main = asyncio.current_task()
        results = self.options.results_dir
        pending = self._select_jobs(results)
        if not pending:
            self.out("nothing to do: every job already has results")
            return self.summary
        self._total = len(pending)
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
                journal.record("", "batch", token=self.token)
                self.pending = deque(pending)
                await self._dispatch()
        finally:
            await self._close_all()
        self._tally_transfers()
        self.summary.not_run = [job.name for job in self.pending]
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

    # -- which jobs -------------------------------------------------------------------------------
    def _select_jobs(self, results: Path) -> list[Job]:
        """Skip jobs with results, set the batch token, and learn from an earlier run's journal."""
        if results.is_dir():
            for partial in results.glob(".partial-*"):
                shutil.rmtree(partial, ignore_errors=True)  # a copy cut short by a crash
        last = last_states(results)
        self.token = batch_token(results) or secrets.token_hex(8)
        # One listing instead of a stat per job (a 100,000-line batch).
        existing = set(os.listdir(results)) if results.is_dir() else set()
        pending: list[Job] = []
        for job in self.jobs:
            if job.name in existing:
                if self.options.retry_failed and last.get(job.name, {}).get("state") == "failed":
                    self._set_aside(results, job.name)
                    pending.append(job)
                    continue
                self.out(
                    f"WARNING: job results already exists for line {job.line_number}, "
                    f"skipping evaluation: delete if you wish to rerun"
                )
                self.summary.skipped.append(job.name)
            else:
                pending.append(job)
        changed = changed_commands(pending, last)
        if changed and not self.options.allow_changed:
            raise ConfigError(
                f"the command of {changed[0]}"
                + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
                + f" changed since {results}/.journal.jsonl recorded it; rerun with "
                f"--allow-changed to run the new commands, or use another --results-dir"
            )
        self.resumable = in_flight(pending, last)
        return pending

    @staticmethod
    def _set_aside(results: Path, name: str) -> None:
        """--retry-failed keeps the failed attempt's results, under .failed/ (never deleted)."""
        aside = results / ".failed"
        aside.mkdir(exist_ok=True)
        n = 1
        while (aside / f"{name}.{n}").exists():
            n += 1
        target = aside / f"{name}.{n}"
        target.mkdir()
        os.rename(results / name, target / name)
        for suffix in (".out", ".err"):
            if (results / f"{name}{suffix}").exists():
                os.rename(results / f"{name}{suffix}", target / f"{name}{suffix}")

    # -- hosts ------------------------------------------------------------------------------------
    async def _open(self, host: Host) -> None:
        transport = await connect(
            host.machine, accept_new=self.options.accept_new, keepalive=self.options.keepalive
        )
        if self.options.dry_run:
            host.transport = transport  # a plan needs one probe, not an agent
            return
        session = HostSession(transport, lease=self.options.lease, token=self.token)
        try:
            await session.__aenter__()
        except BaseException:
            await transport.close()
            raise
        host.transport, host.session = transport, session
        host.cache = HostCache(session)

    async def _connect_all(self) -> None:
        async def one(host: Host) -> None:
            try:
                await self._open(host)
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
        if not any(h.transport for h in self.hosts.values()):
            raise TransportError("no host could be reached; nothing was run")

    async def _close_all(self) -> None:
        async def one(host: Host) -> None:
            if host.session is not None and host.session.lost is None and not self.options.dry_run:
                with contextlib.suppress(TransportError, TimeoutError):
                    async with asyncio.timeout(30):
                        await host.session.sweep(f"{self.token}-")
            if host.session is not None:
                # "bye" even after a cancel: the jobs are killed by then, and the agent should
                # exit now rather than linger for its lease.
                await host.session.close()
            if host.transport is not None:
                await host.transport.close()

        await asyncio.gather(*(one(h) for h in self.hosts.values()), return_exceptions=True)

    async def _probe_all(self, initial: bool = False) -> None:
        hosts = [
            h
            for h in self.hosts.values()
            if (h.session is not None and h.session.lost is None)
            or (self.options.dry_run and h.transport is not None)
        ]
        await asyncio.gather(*(self._probe(h, initial) for h in hosts))
        if initial:
            states = [h.resources.state for h in self.hosts.values() if h.resources is not None]
            if not states:
                reasons = "; ".join(f"{h.machine.name}: {h.down}" for h in self.hosts.values())
                raise TransportError(f"no usable host ({reasons})")
            self.needs = job_needs(self.options, states)
        self.capacity.set()

    async def _probe(self, host: Host, initial: bool) -> None:
        try:
            if host.session is not None:
                text, _rc, own = await host.session.probe(PROBE_COMMAND)
            else:
                assert host.transport is not None
                async with asyncio.timeout(30):
                    text = (await host.transport.exec(PROBE_COMMAND)).stdout.decode(errors="replace")
                own = {}
            state = parse_probe_output(text)
        except (ProbeError, TransportError, TimeoutError) as exc:
            reason = f"{describe(host.machine)}: probe failed: {exc or 'no answer in 30 s'}"
            if initial:
                host.down = reason
                self.err(f"warning: {reason}")
            else:
                self._host_failed(host, reason)
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

    def _host_failed(self, host: Host, reason: str) -> None:
        if host.down is None:
            # One outage counts once, however many of our jobs it took down with it.
            host.failures += 1
            host.down = reason
            self.err(f"warning: host {host.machine.name} lost: {reason}")
        if host.failures >= self.options.quarantine_after and not host.quarantined:
            host.quarantined = True
            self.err(
                f"warning: host {host.machine.name} failed {host.failures} times in a row; "
                f"not using it again in this batch"
            )
        self._revive_later(host)

    def _revive_later(self, host: Host) -> None:
        if not host.quarantined and not host.reviving and self._tg is not None:
            host.reviving = True
            task = self._tg.create_task(self._revive(host))
            self._revivers.add(task)
            task.add_done_callback(self._revivers.discard)

    async def _revive(self, host: Host) -> None:
        """Reconnect a lost host with backoff; when it answers, end what it still runs for us
        (those jobs were requeued elsewhere) and use it again."""
        delay = 1.0
        try:
            old = host.session
            host.session = None
            if old is not None:
                await old.close(orderly=False)
            if host.transport is not None:
                await host.transport.close()
            while not host.quarantined:
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, REVIVE_MAX_DELAY)
                try:
                    await self._open(host)
                    assert host.session is not None
                    for stale in host.session.agent_jobs:
                        if stale not in self._running or self._running_on(stale) != host.machine.name:
                            await host.session.remove(self._jobdir(host.session, stale), stale)
                    host.resources = None
                    host.down = None
                    await self._probe(host, initial=False)
                except (TransportError, ProbeError) as exc:
                    host.down = str(exc)
                    continue
                if host.resources is not None and host.down is None:
                    self.err(f"host {host.machine.name} is back")
                    self.capacity.set()
                    return
        finally:
            host.reviving = False

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
        usable = [h for h in self.hosts.values() if h.resources is not None and h.usable]
        limits = {
            h.machine.source or h.machine.name: max_concurrent(h.resources, self.needs)  # type: ignore[arg-type]
            for h in usable
        }
        self.out(f"machine limits:  {limits}")
        choices = [[g.index for g in h.resources.state.gpus] for h in usable]  # type: ignore[union-attr]
        self.out(f"machine gpu choices: {choices}")

    def _print_plan(self, jobs: Sequence[Job]) -> None:
        """Simulate the schedule, assuming jobs end in the order they started."""
        running: deque[tuple[MachineResources, str]] = deque()
        machines = self._usable()
        lines: list[str] = []
        for job in jobs:
            while True:
                target = choose(machines, self.needs)
                if target is not None:
                    placement = target.allocate(job.name, self.needs)
                    running.append((target, job.name))
                    gpus = cuda_visible_devices(placement)
                    lines.append(f"plan: {job.name} -> {target.name} CUDA_VISIBLE_DEVICES={gpus}")
                    break
                if not running:
                    raise UnsatisfiableError(f"job {job.name} fits on no host")
                done_on, done_job = running.popleft()
                done_on.release(done_job)
        for machine, name in running:
            machine.release(name)
        self.out("\n".join(lines))

    def _say_waiting(self, job: Job) -> None:
        """Nothing of ours runs and still nothing fits: other users hold the room.  Say so once
        per change of reason, rather than sitting silent."""
        reason = "; ".join(
            f"{h.machine.name}: {h.resources.capacity_summary()}"
            for h in self.hosts.values()
            if h.usable and h.resources is not None
        ) or "; ".join(f"{h.machine.name}: down" for h in self.hosts.values())
        if reason != self._last_wait_reason:
            self._last_wait_reason = reason
            self.err(f"waiting: no host has room for {job.name} now ({reason})")

    def _place(self, job: Job) -> Placement | None:
        avoid = set(self.failed_on.get(job.name, ()))
        machines = [m for m in self._usable() if m.name not in avoid] or self._usable()
        target = choose(machines, self.needs)
        if target is None:
            return None
        return target.allocate(job.name, self.needs)

    # -- running ----------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            prober = tg.create_task(self._reprobe_loop())
            self._reattach_all()
            for host in self.hosts.values():
                if host.down is not None:  # unreachable at the start: keep trying in the background
                    self._revive_later(host)
            started = 0
            while not self.draining and (self.pending or self._running):
                placed = self._place(self.pending[0]) if self.pending else None
                if placed is None:
                    if self.pending and not self._running:
                        if not any(h.usable or h.reviving for h in self.hosts.values()):
                            self.err("error: every host is down or quarantined; the remaining jobs were not run")
                            break
                        self._say_waiting(self.pending[0])
                    self.capacity.clear()
                    await self.capacity.wait()
                    continue
                job = self.pending.popleft()
                self._start(job, self._run_job(job, placed))
                started += 1
                if started % DISPATCH_SLICE == 0:
                    # Let the jobs placed so far go out to their hosts while we place the rest.
                    await asyncio.sleep(0)
            while self._running:
                await asyncio.wait(set(self._running.values()))
            prober.cancel()
            self._tg = None
            for task in self._revivers:  # hosts still being revived are not needed any more
                task.cancel()

    def _start(self, job: Job, coro: Coroutine[Any, Any, None]) -> None:
        assert self._tg is not None
        task = self._tg.create_task(coro)
        self._running[job.name] = task

        def done(_: object) -> None:
            self._running.pop(job.name, None)
            self.capacity.set()

        task.add_done_callback(done)

    def _running_on(self, job: str) -> str | None:
        for host in self.hosts.values():
            if host.resources is not None and job in host.resources.running:
                return host.machine.name
        return None

    def _reattach_all(self) -> None:
        """Jobs an earlier coordinator left running whose host's agent still holds them."""
        by_name = {job.name: job for job in self.pending}
        for host in self.hosts.values():
            if host.session is None or host.resources is None:
                continue
            for name, state in host.session.agent_jobs.items():
                entry = self.resumable.get(name)
                job = by_name.get(name)
                if job is None or entry is None or entry.host != host.machine.name:
                    # Not ours to resume (finished, moved, or from elsewhere): end it.
                    self._start_cleanup(host, name)
                    continue
                placement = host.resources.adopt(name, self.needs, entry.gpus)
                self.pending.remove(job)
                self.out(f"reattached: {name} on {host.machine.name} ({'running' if state.get('running') else 'ended'})")
                self._start(job, self._run_job(job, placement, resume=True))

    def _start_cleanup(self, host: Host, name: str) -> None:
        assert self._tg is not None and host.session is not None
        session = host.session

        async def clean() -> None:
            with contextlib.suppress(TransportError):
                await session.remove(self._jobdir(session, name), name)

        self._tg.create_task(clean())

    def _jobdir(self, session: HostSession, name: str) -> str:
        return f"{session.root}/jobs/{self.token}-{name}"

    def _cached_forward(self, job: Job) -> ForwardSet | None:
        key = job.copy_forwards if job.copy_forwards is not None else self.options.copy_forwards
        return self.forward_sets.get(key)

    def _forward_for(self, job: Job) -> ForwardSet:
        key = job.copy_forwards if job.copy_forwards is not None else self.options.copy_forwards
        found = self.forward_sets.get(key)
        if found is None:
            found = collect_forward(key, self.options.base_dir, self.hasher)
            self.forward_sets[key] = found
        return found

    async def _run_job(self, job: Job, placement: Placement, resume: bool = False) -> None:
        host = self.hosts[placement.machine]
        assert host.session is not None and host.cache is not None and host.resources is not None
        session = host.session
        results = self.options.results_dir
        jobdir = self._jobdir(session, job.name)
        gpus = cuda_visible_devices(placement)
        outcome = JobOutcome(job.name, None, host.machine.name, placement.gpu_indices)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if resume else os.O_TRUNC)
        out_fd = os.open(results / f"{job.name}.out", flags, 0o644)
        err_fd = os.open(results / f"{job.name}.err", flags, 0o644)
        fds = {1: out_fd, 2: err_fd}

        def write(fd: int, data: bytes) -> None:
            os.write(fds[fd], data)

        journal = self.journal
        assert journal is not None
        requeue = False
        try:
            if resume:
                offsets = (os.fstat(out_fd).st_size, os.fstat(err_fd).st_size)
                ended = await self._with_timeout(session.resume(job.name, offsets, write), outcome)
            else:
                journal.record(job.name, "placed", host=host.machine.name, gpus=list(placement.gpu_indices), command=job.command)
                try:
                    forward = self._cached_forward(job)
                    if forward is None:  # hashing new inputs: off the event loop
                        forward = await asyncio.to_thread(self._forward_for, job)
                    staging = await prepare_forward(host.cache, forward)
                except TransportError as exc:
                    self._host_failed(host, str(exc))
                    requeue = True
                    return
                self.out(f"started: {job.name};  export CUDA_VISIBLE_DEVICES={gpus} && {job.command}")
                outcome.started = time.time()
                journal.record(job.name, "started", host=host.machine.name, gpus=list(placement.gpu_indices), command=job.command)
                run = session.run(
                    job.name,
                    job.command,
                    cwd=jobdir,
                    # nvidia-smi numbers GPUs in PCI order; CUDA's default order may differ.
                    env={
                        "CUDA_VISIBLE_DEVICES": gpus,
                        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                        "SSH_SCHEDULER_JOB": job.name,
                    },
                    out_path=f"{jobdir}.out",
                    err_path=f"{jobdir}.err",
                    on_output=write,
                    stage=staging,
                    results=list(self._copy_backwards(job) or ()) or None,
                    max_output=self.options.limits.max_output_bytes,
                )
                ended = await self._with_timeout(run, outcome)
            outcome.ended = time.time()
            if ended.host_lost:
                self._host_failed(host, ended.message or "connection lost")
                requeue = True
                return
            host.failures = 0
            outcome.exit_code = ended.code
            if not outcome.ok and self._retry(job, host, outcome):
                await self._quietly_remove(session, jobdir, job.name)
                return
            # The job's processes are gone: its CPUs, memory and GPUs are free for the next job
            # while its results travel home.
            if host.resources is not None:
                host.resources.release(job.name)
            self.capacity.set()
            await self._commit(job, session, jobdir, outcome, ended.entries)
        except asyncio.CancelledError:
            journal.record(job.name, "cancelled", host=host.machine.name)
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.wait_for(session.remove(jobdir, job.name), 10))
            raise
        finally:
            os.close(out_fd)
            os.close(err_fd)
            if host.resources is not None:
                host.resources.release(job.name)
            if requeue:
                self._requeue(job, host)
            self.capacity.set()
            self.reprobe_now.set()

    async def _with_timeout(self, run: Awaitable[JobExit], outcome: JobOutcome) -> JobExit:
        if self.options.timeout is None:
            return await run
        try:
            async with asyncio.timeout(self.options.timeout):
                return await run
        except TimeoutError:
            outcome.timed_out = True
            return JobExit(TIMED_OUT, message=f"timed out after {self.options.timeout:g} s")

    def _retry(self, job: Job, host: Host, outcome: JobOutcome) -> bool:
        """--retries: a failed job runs again, preferably on a host where it has not failed."""
        tries = self.failed_on.setdefault(job.name, [])
        tries.append(host.machine.name)
        if len(tries) > self.options.retries or self.draining:
            return False
        assert self.journal is not None
        self.journal.record(job.name, "retry", host=host.machine.name, code=outcome.exit_code)
        self.out(f"retrying: {job.name}; exit {outcome.exit_code} on {host.machine.name} (attempt {len(tries) + 1} of {self.options.retries + 1})")
        self.pending.appendleft(job)
        return True

    def _copy_backwards(self, job: Job) -> tuple[str, ...] | None:
        return job.copy_backwards if job.copy_backwards is not None else self.options.copy_backwards

    async def _commit(
        self, job: Job, session: HostSession, jobdir: str, outcome: JobOutcome, entries: object = None
    ) -> None:
        """Bring results home (atomically), record the end, print the ancestor's line."""
        assert self.journal is not None
        results = self.options.results_dir
        try:
            got = await fetch_back(
                session,
                jobdir,
                results / job.name,
                paths=self._copy_backwards(job),
                limits=self.options.limits,
                entries=entries,
            )
            self.summary.bytes_downloaded += got.bytes
            for warning in got.warnings:
                self.err(f"warning: {job.name}: {warning}")
            with contextlib.suppress(TransportError):
                await session.remove_soon(jobdir, job.name)
        except (TransferError, TransportError) as exc:
            outcome.message = str(exc)
            outcome.exit_code = outcome.exit_code or 1
            self.err(f"error: {job.name}: copy back failed: {exc}")
        self.summary.outcomes[job.name] = outcome
        self.journal.record(
            job.name, "finished" if outcome.ok else "failed", code=outcome.exit_code, host=outcome.host,
            timed_out=outcome.timed_out,
        )
        if outcome.ok:
            self.out(f"finished: {job.name}; {job.command}")
            return
        why = f"timed out after {self.options.timeout:g} s" if outcome.timed_out else f"exit {outcome.exit_code}"
        self.out(f"failed: {job.name}; {job.command}  ({why} on {outcome.host})")
        if self.options.halt.reached(len(self.summary.failed), self._total) and not self.draining:
            self.summary.halted = True
            self.draining = True
            self.err(f"halting: {len(self.summary.failed)} jobs failed (--halt {self.options.halt.when})")
            if self.options.halt.when == "now":
                for name, task in list(self._running.items()):
                    if name != job.name:
                        task.cancel()

    async def _quietly_remove(self, session: HostSession, jobdir: str, name: str) -> None:
        with contextlib.suppress(TransportError):
            await session.remove(jobdir, name)

    def _requeue(self, job: Job, host: Host) -> None:
        assert self.journal is not None
        self.journal.record(job.name, "requeued", host=host.machine.name)
        self.out(f"requeued: {job.name}; host {host.machine.name} was lost")
        self.pending.appendleft(job)

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
