"""Choosing among machines, and saying why a job fits none: functions over
:class:`~ssh_scheduler.planner.allocate.MachineResources` (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ssh_scheduler.jobs.needs import EPS, GPU_UTILIZATION_TOLERANCE, Needs, cpus_text, plural

if TYPE_CHECKING:
    from ssh_scheduler.planner.allocate import MachineResources

__all__ = ["choose", "explain_unfit", "gpu_needs_text", "max_concurrent"]


def gpu_needs_text(needs: Needs) -> str:
    text = plural(needs.gpus, "GPU")
    if needs.gpu_memory_mb > 0:
        text += f" with {needs.gpu_memory_mb} MiB" + (" each" if needs.gpus > 1 else "")
    return text


def choose(machines: Sequence[MachineResources], needs: Needs) -> MachineResources | None:
    """The machine with the best :meth:`~MachineResources.score` for the job, or ``None`` when
    it fits nowhere now.  Ties go to the machine running fewest of our jobs (jobs that need
    nothing measurable would otherwise all land on one host), then to the smallest name, so
    plans are reproducible."""
    best: MachineResources | None = None
    best_score = -math.inf
    for machine in machines:
        # Runs once per placed job over every machine, so the cache check is inlined: only the
        # machines that changed since their last score (usually one or two) are evaluated.
        score = machine._cache_score if needs is machine._cache_needs else machine.score(needs)
        # -inf never beats best_score (which starts at -inf), so misfits need no test of their own.
        if score > best_score or (
            score == best_score
            and best is not None
            and (len(machine._running), machine.name) < (len(best._running), best.name)
        ):
            best, best_score = machine, score
    return best


def max_concurrent(machine: MachineResources, needs: Needs, *, limit: int = 1024) -> int:
    """How many such jobs fit on the machine at once now, counting what already runs there
    (for the "machine limits:" header line).  Found by placing jobs until one does not fit, then
    releasing them: the machine is left as it was.  Jobs that need nothing are capped at
    ``limit``."""
    placed: list[str] = []
    try:
        while len(placed) < limit and machine.score(needs) > -math.inf:
            job_id = f"\x00max_concurrent:{len(placed)}"
            machine.allocate(job_id, needs)
            placed.append(job_id)
    finally:
        for job_id in placed:
            machine.release(job_id)
    return len(placed)


def _unfit_dimensions(machine: MachineResources, needs: Needs) -> list[tuple[str, float]]:
    """The needs the machine could never meet, each with capacity/need (how close it comes)."""
    state = machine.state
    capacity = state.cpu_count * machine.cpu_overload
    failed: list[tuple[str, float]] = []
    if needs.cpus > capacity + EPS:
        failed.append(("cpus", capacity / needs.cpus))
    if needs.memory_mb > state.mem_total_mb:
        failed.append(("memory", state.mem_total_mb / needs.memory_mb))
    if needs.gpus > 0:
        big_enough = sum(1 for gpu in state.gpus if gpu.memory_total_mb >= needs.gpu_memory_mb)
        if big_enough < needs.gpus:
            largest = max((gpu.memory_total_mb for gpu in state.gpus), default=0)
            closeness = min(len(state.gpus) / needs.gpus, 1.0) * min(
                largest / needs.gpu_memory_mb if needs.gpu_memory_mb else 1.0, 1.0
            )
            failed.append(("gpus", closeness))
    return failed


def _has(machine: MachineResources, dimension: str, needs: Needs) -> str:
    state = machine.state
    if dimension == "cpus":
        capacity = state.cpu_count * machine.cpu_overload
        return f"{state.cpu_count} cpus ({capacity:g} with overload {machine.cpu_overload:g})"
    if dimension == "memory":
        return f"{state.mem_total_mb} MiB RAM"
    if not state.gpus:
        return "no GPUs" + (f" ({state.gpu_error})" if state.gpu_error else "")
    sizes = sorted({gpu.memory_total_mb for gpu in state.gpus}, reverse=True)
    text = f"{plural(len(state.gpus), 'GPU')} with "
    if len(sizes) == 1:
        return text + f"{sizes[0]} MiB"
    big_enough = sum(1 for gpu in state.gpus if gpu.memory_total_mb >= needs.gpu_memory_mb)
    return text + f"{'/'.join(map(str, sizes))} MiB ({big_enough} with enough memory)"


def _wants(dimension: str, needs: Needs) -> str:
    if dimension == "cpus":
        return cpus_text(needs.cpus)
    if dimension == "memory":
        return f"{needs.memory_mb} MiB RAM"
    return gpu_needs_text(needs)


def explain_unfit(machines: Sequence[MachineResources], needs: Needs) -> str:
    """One line saying why no machine could *ever* fit the job, naming the largest host, e.g.
    ``needs 2 GPUs with 90000 MiB each; the largest host gpu1 has 2 GPUs with 81559 MiB``.

    "Largest" is the host that fails the fewest needs and comes closest on those.  If some
    machine could fit the job the line says which (the job only has to wait).
    """
    if not machines:
        return "there are no machines to run on"
    for machine in sorted(machines, key=lambda m: m.name):
        if machine.could_ever_fit(needs):
            return f"{machine.name} could fit it once it has room"
    if needs.gpus > 0 and needs.gpu_utilization > 1.0 + GPU_UTILIZATION_TOLERANCE + EPS:
        return (
            f"needs GPU utilization {needs.gpu_utilization:g} of each GPU, more than a whole GPU "
            "(ask for more GPUs per job instead)"
        )

    def closeness(machine: MachineResources) -> tuple[int, float, str]:
        failed = _unfit_dimensions(machine, needs)
        return len(failed), -math.prod(ratio for _, ratio in failed), machine.name

    largest = min(machines, key=closeness)
    dimensions = [dimension for dimension, _ in _unfit_dimensions(largest, needs)]
    line = (
        f"needs {', '.join(_wants(d, needs) for d in dimensions)}; the largest host "
        f"{largest.name} has {', '.join(_has(largest, d, needs) for d in dimensions)}"
    )
    if "gpus" in dimensions and not any(machine.state.gpus for machine in machines):
        line += " (no host has a usable GPU: use --no-gpu-required for CPU-only jobs)"
    return line
