"""What a probe says a host has: its CPUs, load, memory, GPUs and the processes on them (everyone's,
not only ours), and what our own jobs there were seen to use.  Frozen records, read by the
planner; :mod:`ssh_scheduler.machines.probe` makes them from a probe's output."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

TYPE_CHECKING = False  # the hub loads this module (a Machine's slurm settings name HostState)
if TYPE_CHECKING:
    from ssh_scheduler.events import HostProbed

__all__ = ["GpuProcess", "GpuState", "HostState", "OwnUsage", "probed"]


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as ``nvidia-smi --query-gpu`` saw it.

    ``utilization`` is a fraction of the whole GPU (0.0..1.0).  Values ``nvidia-smi`` cannot
    report (``[N/A]``, ``[Not Supported]``, ...) are read as 0 % utilization and 0 MiB of memory
    free/total, so such a GPU only ever takes jobs that need no GPU memory.
    """

    index: int
    uuid: str
    name: str
    memory_total_mb: int
    memory_used_mb: int
    memory_free_mb: int
    utilization: float


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One compute process on a GPU, as ``nvidia-smi --query-compute-apps`` saw it.

    ``process_name`` is only known from the header form of the query (the probe does not ask
    for it).  ``used_memory_mb`` is 0 when the driver cannot report it (``[N/A]``).
    """

    pid: int
    gpu_uuid: str
    used_memory_mb: int
    process_name: str | None = None


@dataclass(frozen=True, slots=True)
class HostState:
    """A host's resources at probe time.

    ``mem_available_mb`` is the kernel's MemAvailable (what can be allocated without swapping).
    ``user`` is the remote login name, ``None`` if the probe could not tell.  When ``gpu_error``
    is set, ``nvidia-smi`` exists but failed, and ``gpus`` / ``gpu_processes`` are empty.
    """

    cpu_count: int
    load_1m: float
    mem_total_mb: int
    mem_available_mb: int
    gpus: tuple[GpuState, ...] = ()
    gpu_processes: tuple[GpuProcess, ...] = ()
    user: str | None = None
    gpu_error: str | None = None
    job_slots: int | None = None
    """Set for a batch system's queue (a Slurm login node): at most this many of our jobs at
    once, whatever the resources say (they are placeholders: the batch system places jobs)."""


@dataclass(frozen=True, slots=True)
class OwnUsage:
    """What one of our running jobs is observed to use on a host, as our agent reports it beside
    the probe: its process ids (to recognise its GPU processes) and its total RSS in MiB."""

    pids: frozenset[int]
    rss_mb: int = 0


def probed(host: str, state: HostState, own: Mapping[str, OwnUsage] | None = None) -> HostProbed:
    """The event that says a probe of ``host`` landed with ``state``; ``own`` (what our agent
    reported for our jobs: their pids) splits each GPU's memory into ours and everyone else's."""
    # Here, not at the top: the hub, which connects and never reads a probe, loads this module,
    # and the event stream's import was 10 ms of its start, on a cold command's path.
    from ssh_scheduler.events import GpuReading, HostProbed

    ours_pids = {pid for usage in (own or {}).values() for pid in usage.pids}
    ours: dict[str, int] = {}
    for process in state.gpu_processes:
        if process.pid in ours_pids:
            ours[process.gpu_uuid] = ours.get(process.gpu_uuid, 0) + process.used_memory_mb
    return HostProbed(
        host=host,
        cpus=state.cpu_count,
        load=state.load_1m,
        memory_free_mb=state.mem_available_mb,
        memory_total_mb=state.mem_total_mb,
        gpus=tuple(
            GpuReading(g.index, g.memory_used_mb, g.memory_total_mb, g.utilization, min(ours.get(g.uuid, 0), g.memory_used_mb))
            for g in state.gpus
        ),
    )
