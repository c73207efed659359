"""Where a job was placed, and that it does not fit somewhere now: the planner's vocabulary of
placement (plain values; see :mod:`ssh_scheduler.planner.allocate` for how they are made)."""

from __future__ import annotations

from dataclasses import dataclass

from ssh_scheduler.jobs.needs import Needs

__all__ = ["NoFit", "Placement"]


class NoFit(Exception):
    """A job does not fit on a machine *now*: an expected scheduling outcome, not a user error.

    Deliberately not a :class:`~ssh_scheduler.errors.SchedulerError`; a job that can *never*
    fit is reported through :func:`~ssh_scheduler.planner.explain.explain_unfit` /
    ``UnsatisfiableError`` instead.
    """


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a job runs: ``gpu_indices`` are ``nvidia-smi`` indices in the probe's order (empty
    for a job without GPUs); ``gpu_uuids`` are the same GPUs' UUIDs, which also suit
    ``CUDA_VISIBLE_DEVICES`` and, unlike indices, do not depend on ``CUDA_DEVICE_ORDER``."""

    machine: str
    job_id: str
    gpu_indices: tuple[int, ...]
    needs: Needs
    gpu_uuids: tuple[str, ...] = ()
