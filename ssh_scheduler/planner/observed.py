"""What a probe says is used on a host's GPUs, and by whom: ours (per running job) or others'.

:class:`~ssh_scheduler.planner.allocate.MachineResources` keeps the GPU memory invariant
(``others(g) + ghosts(g) + sum over our jobs j on g of max(reservation(j), observed(j, g)) <=
capacity(g)``); this module reads its terms from one probe (pure, no state of its own):

* ``capacity(g) = min(memory.total, memory.used + memory.free)`` (the driver keeps some).
* ``observed(j, g)`` is the ``used_memory`` of g's compute processes whose pid belongs to our
  running job j (what our agent reported, :class:`~ssh_scheduler.machines.probe.OwnUsage`), on a
  GPU j was placed on.
* ``others(g)`` is every other process on g (anyone else's, a finished job's, our job's process
  on a GPU it was not placed on) plus the memory no listed process accounts for:
  ``memory.used - sum(listed processes)``, at least 0.

Why not ``memory.free + observed``: the process list and ``memory.free`` come from separate
``nvidia-smi`` calls, and a job that started between them was added back as observed to a free
figure that never subtracted it (three 6500 MiB jobs on one 16384 MiB GPU).  The probe lists
the processes before and after it reads the memory, and counts each at the smaller of its two
figures (:func:`~ssh_scheduler.machines.probe.listed_throughout`): a process that starts
between the calls is in ``memory.used`` but at 0 in the list, and one that frees its memory or
ends between them is no longer counted at its old figure, so what they hold or held counts as
someone else's until the next probe: never too little.  (A probe that lands after its job was
released can still list that job's memory, which the ledger then no longer charges: it keeps a
released job's observed memory charged as a *ghost* for that.)

While no job of ours runs on the host from a probe's start to its end (``own`` is empty), every
listed process is someone else's and ``others(g) = max(memory.used, listed)``, at least what was
in use at the read whatever the order of the calls: the probe then lists the processes once,
beside the read (:data:`~ssh_scheduler.machines.probe.ALONE`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ssh_scheduler.machines.host_state import HostState, OwnUsage
from ssh_scheduler.planner.placement import Placement

__all__ = ["Held", "Observed", "observe"]

Held = tuple[tuple[int, ...], int, tuple[int, ...]]
"""One running job's share of a host: the positions of its GPUs in ``state.gpus``, its observed
RSS (MiB) and its observed memory on each of those GPUs (MiB)."""


@dataclass(frozen=True, slots=True)
class Observed:
    """One probe's GPU figures, per GPU in ``state.gpus`` order, and per running job of ours."""

    capacity: list[int]
    others: list[bool]
    """A process of anyone else (or not attributable to a running job of ours) is on the GPU."""
    base: list[int]
    """``capacity(g) - others(g)``: what our running jobs and new ones may have (before ghosts)."""
    held: dict[str, Held]


def observe(state: HostState, own: Mapping[str, OwnUsage], running: Mapping[str, Placement]) -> Observed:
    """Split what ``state`` shows on each GPU into our running jobs' use and everyone else's.

    ``own`` maps job ids to what our agent observed for them; a running job missing from it
    uses nothing observed (it counts as exactly its reservation).  Entries for jobs no longer
    running still mark their pids as ours (a finished job's process may linger in the probe: it
    does not make the GPU someone else's for ``reserve_gpu``), but their memory counts as used.
    Running jobs keep their GPUs, found again by UUID.
    """
    gpus = state.gpus
    capacity = [min(gpu.memory_total_mb, gpu.memory_used_mb + gpu.memory_free_mb) for gpu in gpus]
    position_of = {gpu.uuid: position for position, gpu in enumerate(gpus)}

    own_pids: set[int] = set()
    for usage in own.values():
        own_pids.update(usage.pids)
    # Which running job a pid belongs to, so its memory counts as that job's only on the GPUs
    # the job was placed on.
    running_pid: dict[int, str] = {}
    for job_id in running:
        observed_usage = own.get(job_id)
        if observed_usage is not None:
            for pid in observed_usage.pids:
                running_pid[pid] = job_id
    others = [False] * len(gpus)
    listed = [0] * len(gpus)
    used_by_pid: dict[tuple[int, int], int] = {}
    for process in state.gpu_processes:
        position = position_of.get(process.gpu_uuid)
        if position is None:
            continue
        listed[position] += process.used_memory_mb
        if process.pid not in own_pids:
            others[position] = True
        if process.pid in running_pid:
            key = (process.pid, position)
            used_by_pid[key] = used_by_pid.get(key, 0) + process.used_memory_mb

    # GPUs are found again by UUID, which survives renumbering; should a probe ever show UUIDs
    # that are not unique (a driver that cannot read them), fall back to the index.
    by_uuid = len(position_of) == len(gpus)
    position_of_index = {gpu.index: position for position, gpu in enumerate(gpus)}
    held: dict[str, Held] = {}
    for job_id, placement in running.items():
        if by_uuid:
            found = [position_of.get(uuid) for uuid in placement.gpu_uuids]
        else:
            found = [position_of_index.get(index) for index in placement.gpu_indices]
        positions = tuple(position for position in found if position is not None)
        observed = own.get(job_id)
        pids = observed.pids if observed is not None else frozenset()
        seen = tuple(
            sum(used_by_pid.pop((pid, position), 0) for pid in pids) for position in positions
        )
        held[job_id] = (positions, observed.rss_mb if observed is not None else 0, seen)
    # What is left in used_by_pid: our running jobs' processes on GPUs they were not placed on;
    # they count as anyone else's memory there.
    attributed = [0] * len(gpus)
    for held_positions, _rss, held_seen in held.values():
        for position, seen_mb in zip(held_positions, held_seen, strict=True):
            attributed[position] += seen_mb
    # capacity - others(g), with others = (listed - attributed) + max(0, used - listed).
    base = [
        total - (gpu.memory_used_mb if gpu.memory_used_mb > listed[p] else listed[p]) + attributed[p]
        for p, (gpu, total) in enumerate(zip(gpus, capacity, strict=True))
    ]
    return Observed(capacity, others, base, held)
