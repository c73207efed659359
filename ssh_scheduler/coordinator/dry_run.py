"""``execute_batch --dry-run``: what the batch would do, from one look at every machine.

Nothing is started anywhere: each machine is seen as
:func:`~ssh_scheduler.executors.backends.dry_run_state` sees it (a host: one probe without an
agent; Slurm: its queue as configured), every machine before the plan, and the planner's plan
is published line by line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.hosts import first_error, host_named
from ssh_scheduler.errors import AuthenticationError, HostKeyError, TransportError
from ssh_scheduler.events import EventBus
from ssh_scheduler.executors.backends import dry_run_state
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.planner.actions import Action, Say
from ssh_scheduler.planner.plan import Planner

__all__ = ["plan_dry_run"]


async def plan_dry_run(
    planner: Planner,
    machines: Sequence[Machine],
    options: BatchOptions,
    *,
    token: str,
    bus: EventBus,
    connecting: asyncio.Semaphore,
    perform: Callable[[Sequence[Action]], None],
) -> None:
    """Look at every machine (at most ``connecting`` connect at once), then publish the plan.
    A host we cannot trust or log into ends it with that error (the others' are published)."""

    async def one(machine: Machine) -> None:
        try:
            state = await dry_run_state(
                machine, accept_new=options.accept_new, keepalive=options.keepalive, connecting=connecting
            )
        except (HostKeyError, AuthenticationError) as exc:
            raise host_named(machine.name, exc) from None
        except TransportError as exc:
            perform(planner.host_unreachable(machine.name, str(exc)))
            return
        perform(planner.probe_landed(machine.name, state))

    results = await asyncio.gather(*(one(m) for m in machines), return_exceptions=True)
    fatal = [r for r in results if isinstance(r, BaseException)]
    if fatal:
        raise first_error(bus, fatal)
    perform([a for a in planner.begin(token) if isinstance(a, Say)])
    for line in planner.dry_run():
        bus.publish(line)
