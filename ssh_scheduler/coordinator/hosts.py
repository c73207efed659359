"""The batch's hosts: connect (or take those started early), first probe, re-probe, revive, close.

Every machine is opened through :func:`~ssh_scheduler.executors.backends.open_backend`, whatever
runs its jobs (our agent on a host, Slurm through a login node): nothing here knows the kind.
What the hosts answer goes to the planner; what it decides comes back through the batch's
``perform`` (:class:`~ssh_scheduler.coordinator.batch.Batch`), which owns the tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any

from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.early_hosts import EarlyHosts
from ssh_scheduler.errors import (
    AgentStartError,
    AuthenticationError,
    HostKeyError,
    NoUsableHostError,
    ProbeError,
    SchedulerError,
    TransportError,
)
from ssh_scheduler.events import EventBus, HostDown, Notice
from ssh_scheduler.executors.backends import open_backend
from ssh_scheduler.executors.base import Executor
from ssh_scheduler.jobs.forward import ForwardSet
from ssh_scheduler.machines.host_state import probed
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.planner.actions import Action
from ssh_scheduler.planner.plan import Planner
from ssh_scheduler.results.summary import BatchSummary

__all__ = ["PRESTAGE_BYTES", "PROBE_GRACE", "PROBE_TIMEOUT", "REVIVE_MAX_DELAY", "Hosts", "first_error", "host_named"]

log = logging.getLogger(__name__)

REVIVE_MAX_DELAY = 30.0
PROBE_TIMEOUT = 30.0
# How long the batch waits for every host's first probe before it opens with those that
# answered: as long again as the first answer took, at least this.  Slow hosts then take
# jobs as they answer; a short wait keeps the "machine limits" header whole on small fleets.
PROBE_GRACE = 1.0
PRESTAGE_BYTES = 1 << 20
"""The largest copy-forward set sent to every host as it connects, before any job is placed
there (:attr:`Hosts.prestage`): its first job then starts without the two round trips of its
staging (asked what the host's cache lacks, sent it), hidden behind the first probe."""

Perform = Callable[[Sequence[Action]], None]
"""The batch's: carry out what the planner answered."""
Helper = Callable[[Coroutine[Any, Any, None]], None]
"""The batch's: run a task it does not wait for at its end (a probe, a reviver, a timer)."""


class Hosts:
    """Every machine of one batch and its executor while it is open (:attr:`executors`).
    :meth:`use` before the first :meth:`start`."""

    def __init__(
        self,
        machines: dict[str, Machine],
        options: BatchOptions,
        bus: EventBus,
        summary: BatchSummary,
        connecting: asyncio.Semaphore,
        *,
        perform: Perform,
        helper: Helper,
    ) -> None:
        self.machines = machines
        self.options = options
        self.bus = bus
        self.summary = summary  # a replaced executor's bytes are counted there
        self.connecting = connecting
        self.executors: dict[str, Executor] = {}
        self.planner: Planner | None = None
        self.token = ""
        self._early: EarlyHosts | None = None
        self._perform = perform
        self._helper = helper
        self._first_answer: float | None = None
        self._since = time.monotonic()
        self._unusable: dict[str, str] = {}  # host -> why, for hosts reached whose agent did not start
        self.prestage: ForwardSet | None = None
        """The batch's inputs, sent to each host as it connects, while its first probe runs
        (the batch sets it where every host should get a job and the set is small)."""

    def use(self, planner: Planner, token: str, early: EarlyHosts | None) -> None:
        """The batch's planner and token, and the hosts already connecting (early_hosts.py),
        taken as they are needed."""
        self.planner, self.token, self._early = planner, token, early

    def start_all(self, tg: asyncio.TaskGroup, since: float) -> list[asyncio.Task[None]]:
        """Start every host in ``tg``; ``since``: when the batch began starting them (the
        first probe's grace counts from there)."""
        self._since = since
        return [tg.create_task(self.start(m)) for m in self.machines.values()]

    async def start(self, machine: Machine) -> None:
        """Connect (at most ``max_connecting`` hosts logging in at once: sshd's ``MaxStartups``
        drops a flood of unauthenticated connections; a host logged into starts its agent
        without holding that room), start the agent and probe; the planner places
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
                executor = await self.open(machine)
        except (HostKeyError, AuthenticationError) as exc:
            raise host_named(name, exc) from None
        except TransportError as exc:
            why = str(exc)
            if isinstance(exc, AgentStartError):
                self._unusable[name] = why
            self._answer(name, lambda: planner.host_unreachable(name, why))
            return
        self.executors[name] = executor
        log.info("connected to %s", name)
        if self.prestage is not None:
            self._helper(self._prestage(executor, self.prestage))
        found = {n: bool(s.get("running")) for n, s in executor.agent_jobs.items()}
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                state, own = await executor.probe()
        except (ProbeError, TransportError, TimeoutError) as exc:
            reason = f"{executor.name}: probe failed: {exc or f'no answer in {PROBE_TIMEOUT:g} s'}"
            self._answer(name, lambda: planner.probe_failed(name, reason))
            return
        self.bus.publish(probed(name, state, own))
        if self._first_answer is None:
            self._first_answer = time.monotonic()
            self._helper(self._grace(self._first_answer - self._since))
        self._answer(name, lambda: planner.probe_landed(name, state, own, agent_jobs=found, now=time.time()))

    async def _prestage(self, executor: Executor, forward: ForwardSet) -> None:
        """The inputs into the host's cache beside its first probe; a job placed meanwhile waits
        for the same upload (the cache sends each file once).  A failure is said by the first
        job, whose staging meets it again or tries afresh."""
        try:
            await executor.stage(forward)
        except TransportError as exc:
            log.debug("%s: inputs not sent ahead: %s", executor.name, exc)

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

    async def open(self, machine: Machine) -> Executor:
        """Connect to a machine and start what runs its jobs (executors.backends chooses)."""
        # The agent starts the probe with its hello (start and revive probe right after this).
        # That probe lands with generation None ("taken just now", every ghost cleared), which
        # is right: it was requested before any job was placed on this connection, so no
        # release precedes it (allocate.py probe_started()).
        return await open_backend(
            machine, accept_new=self.options.accept_new, keepalive=self.options.keepalive,
            lease=self.options.lease, token=self.token, probe_first=True, connecting=self.connecting,
        )

    async def probe(self, host: str) -> None:
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
        self.bus.publish(probed(host, state, own))
        self._perform(self.planner.probe_landed(host, state, own, generation, now=time.time()))

    async def revive(self, host: str) -> None:
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
                executor = await self.open(self.machines[host])
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
            self.bus.publish(probed(host, state, own))
            found = {n: bool(s.get("running")) for n, s in executor.agent_jobs.items()}
            self._perform(planner.host_back(host, state, own, found, now=time.time()))
            return
        planner.revive_gave_up(host)

    async def close_all(self, keep: Mapping[str, Collection[str]] | None = None) -> None:
        """Sweep what the batch left on each host, and close them; a host in ``keep`` holds
        results that did not come home (job names): nothing is swept there."""

        async def one(host: str, executor: Executor) -> None:
            if keep and keep.get(host):
                log.info("%s: not swept: it keeps the results of %s", host, ", ".join(sorted(keep[host])))
            elif executor.lost is None and not self.options.dry_run:
                with contextlib.suppress(TransportError, TimeoutError):
                    async with asyncio.timeout(30):
                        await executor.sweep(f"{self.token}-")
            # "bye" even after a cancel: the jobs are killed by then, and the agent should exit
            # now rather than linger for its lease.
            await executor.close()

        await asyncio.gather(*(one(h, e) for h, e in self.executors.items()), return_exceptions=True)


def host_named(host: str, exc: HostKeyError | AuthenticationError) -> BaseException:
    """Which of many hosts: name it."""
    return exc if host in str(exc) else type(exc)(f"{host}: {exc}")


def first_error(bus: EventBus, errors: Sequence[BaseException]) -> BaseException:
    """The first of several errors (of several hosts), to raise; the others are published."""
    for exc in errors[1:]:
        bus.publish(Notice(level="error", message=str(exc)))
    return errors[0]
