"""Why a job could never fit any machine, in one line for the user (pure).

Works on anything that has a name, a probed state, a CPU overload factor and
``could_ever_fit`` (:class:`Sized`: a :class:`~ssh_scheduler.planner.allocate.Sized`,
which uses these words in its own messages; so this module does not import it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from ssh_scheduler.jobs.needs import EPS, GPU_UTILIZATION_TOLERANCE, Needs, cpus_text, plural
from ssh_scheduler.machines.host_state import HostState

__all__ = ["Sized", "explain_unfit", "gpu_needs_text"]


class Sized(Protocol):
    """A machine as :func:`explain_unfit` sees it."""

    @property
    def name(self) -> str: ...

    @property
    def state(self) -> HostState: ...

    @property
    def cpu_overload(self) -> float: ...

    def could_ever_fit(self, needs: Needs) -> bool: ...


def gpu_needs_text(needs: Needs) -> str:
    text = plural(needs.gpus, "GPU")
    if needs.gpu_memory_mb > 0:
        text += f" with {needs.gpu_memory_mb} MiB" + (" each" if needs.gpus > 1 else "")
    return text


def _unfit_dimensions(machine: Sized, needs: Needs) -> list[tuple[str, float]]:
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


def _has(machine: Sized, dimension: str, needs: Needs) -> str:
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


def explain_unfit(machines: Sequence[Sized], needs: Needs) -> str:
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

    def closeness(machine: Sized) -> tuple[int, float, str]:
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
