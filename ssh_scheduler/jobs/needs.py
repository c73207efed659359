"""What a job needs: plain values shared by the planner and the core.

See :mod:`ssh_scheduler.planner.allocate` for how needs are counted against a host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.jobs.options import need_options

__all__ = [
    "DEFAULT_CPU_OVERLOAD",
    "EPS",
    "GPU_UTILIZATION_TOLERANCE",
    "NO_OVERRIDE",
    "Needs",
    "NeedsOverride",
    "cpus_text",
    "flag_message",
    "flag_needs",
    "plural",
]

DEFAULT_CPU_OVERLOAD = 1.25
"""CPUs are over-committed by this factor: hosts run well a little over capacity (as the ancestor
tolerated a small overload)."""

GPU_UTILIZATION_TOLERANCE = 0.05
"""Utilization may add up to this much over a whole GPU: probes are noisy and two jobs at 0.5 on
a GPU that shows 3 % from a monitoring process should still share it."""

EPS = 1e-9
"""Slack for float comparisons of CPUs and utilization."""


@dataclass(frozen=True, slots=True)
class Needs:
    """What one job needs, from the ``execute_batch`` flags.

    ``cpus`` (``--num-cpus``, cores), ``memory_mb`` (``--memory-required``, MiB), ``gpus``
    (``--gpus-per-job``; 0 for ``--no-gpu-required``), ``gpu_memory_mb``
    (``--gpu-memory-required``, MiB on *each* GPU), ``gpu_utilization`` (``--gpu-utilization``,
    fraction of *each* GPU), ``reserve_machine`` (``--reserve``), ``reserve_gpu`` (False for
    ``--no-reserve-gpu``).  The GPU fields mean nothing when ``gpus`` is 0.
    """

    cpus: float = 1.0
    memory_mb: int = 1000
    gpus: int = 1
    gpu_memory_mb: int = 1000
    gpu_utilization: float = 0.0
    reserve_machine: bool = False
    reserve_gpu: bool = True

    def __post_init__(self) -> None:
        for name in ("cpus", "gpu_utilization"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, not {value!r}")
        for name in ("memory_mb", "gpus", "gpu_memory_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a whole number >= 0, not {value!r}")


@dataclass(frozen=True, slots=True)
class NeedsOverride:
    """The needs one job sets for itself (a ``--commands`` line with ``--num-cpus`` etc.); ``None``
    fields take the batch's value.  ``gpus=0`` is ``--no-gpu-required``."""

    cpus: float | None = None
    memory_mb: int | None = None
    gpus: int | None = None
    gpu_memory_mb: int | None = None
    gpu_utilization: float | None = None
    reserve_machine: bool | None = None
    reserve_gpu: bool | None = None

    @property
    def empty(self) -> bool:
        # Asked once per job of the batch: a comparison, not a walk over fields(); most jobs
        # carry the default itself (NO_OVERRIDE), which needs not even that.
        return self is NO_OVERRIDE or self == NO_OVERRIDE

    def apply(self, base: Needs) -> Needs:
        """``base`` with this job's own values put in (validated by :class:`Needs`)."""
        values = {f.name: getattr(base, f.name) for f in fields(base)}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                values[f.name] = value
        needs = Needs(**values)
        if needs.gpus == 0:  # GPU fields mean nothing then; keep equal needs equal
            needs = Needs(needs.cpus, needs.memory_mb, 0, 0, 0.0, needs.reserve_machine, False)
        return needs


def flag_needs(values: Mapping[str, Any]) -> tuple[Needs, bool]:
    """The needs flags' values (by option name, see :mod:`ssh_scheduler.jobs.options`) as one
    :class:`Needs`, and whether GPUs were asked for explicitly (``--gpus-per-job``,
    ``--no-gpu-required``): if not, a job wants a GPU only where some host has one."""
    given: dict[str, Any] = {}
    # Values first, then switches: --no-gpu-required wins over --gpus-per-job.
    for option in sorted(need_options(), key=lambda o: o.switch):
        value = values.get(option.name, option.default)
        field = option.to.partition(".")[2]
        if option.switch:
            if value:
                given[field] = option.sets
        elif value is not None:
            given[field] = value
    try:
        needs = Needs(**given)
    except ConfigError as err:
        raise ConfigError(flag_message(str(err))) from None
    if needs.gpus == 0:  # the GPU fields mean nothing then; keep equal needs equal
        needs = replace(needs, gpu_memory_mb=0, gpu_utilization=0.0)
    return needs, "gpus" in given


def flag_message(message: str) -> str:
    """A :class:`Needs` range error in the words of its flag: ``cpus must be...`` ->
    ``--num-cpus must be...``."""
    for option in need_options():
        field = option.to.partition(".")[2]
        if not option.switch and message.startswith(field + " "):
            return option.flag + message[len(field) :]
    return message


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def cpus_text(count: float) -> str:
    return "1 cpu" if count == 1 else f"{count:g} cpus"


NO_OVERRIDE = NeedsOverride()
"""No needs of the job's own: the default of every job and line that sets none."""
