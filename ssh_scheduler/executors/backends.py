"""Which executor runs a machine's jobs: the one place that looks at the machine's kind.

The coordinator opens every machine with :func:`open_backend` and plans a dry run with
:func:`dry_run_state`, whatever the machine is; a new kind of backend is a branch in each (and
its settings in the machine YAML), never a coordinator change.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from ssh_scheduler.executors.base import Executor
from ssh_scheduler.executors.host import open_executor, probe_only
from ssh_scheduler.executors.session import DEFAULT_LEASE
from ssh_scheduler.executors.slurm import open_slurm_executor
from ssh_scheduler.machines.host_state import HostState
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.machines.slurm import queue_state

__all__ = ["dry_run_state", "open_backend"]


async def open_backend(
    machine: Machine,
    *,
    accept_new: bool = False,
    keepalive: float | None = None,
    lease: float = DEFAULT_LEASE,
    token: str = "",
    probe_first: bool = False,
    on_hello_sent: Callable[[], None] | None = None,
    connecting: AbstractAsyncContextManager[Any] | None = None,
) -> Executor:
    """Connect to the machine and start what runs its jobs: our agent on a host, or on a Slurm
    login node (jobs then go to Slurm, and the batch's jobs an earlier coordinator left there are
    looked up).  Raises what :func:`~ssh_scheduler.executors.host.open_executor` raises.
    ``probe_first``: the first :meth:`~ssh_scheduler.executors.base.Executor.probe` comes at once
    (a host's agent starts it with its hello; Slurm's probe is its queue, asked separately).
    ``on_hello_sent``: called once the agent was started and its hello sent.  ``connecting``:
    held while connecting only (see open_executor)."""
    if machine.slurm is not None:
        return await open_slurm_executor(
            machine, settings=machine.slurm, token=token, accept_new=accept_new, keepalive=keepalive,
            lease=lease, on_hello_sent=on_hello_sent, connecting=connecting,
        )
    return await open_executor(
        machine, accept_new=accept_new, keepalive=keepalive, lease=lease, token=token,
        probe_first=probe_first, on_hello_sent=on_hello_sent, connecting=connecting,
    )


async def dry_run_state(
    machine: Machine,
    *,
    accept_new: bool = False,
    keepalive: float | None = None,
    connecting: AbstractAsyncContextManager[Any] | None = None,
) -> HostState:
    """What the planner sees of the machine for a dry run, starting nothing there: one probe
    without an agent (``connecting`` held while it connects: it limits connections at once), or
    for a Slurm machine its queue as configured (no connection at all).  Raises TransportError."""
    if machine.slurm is not None:
        return queue_state(machine.slurm)
    return await probe_only(machine, accept_new=accept_new, keepalive=keepalive, connecting=connecting)
