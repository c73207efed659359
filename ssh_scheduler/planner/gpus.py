"""One host's GPUs as the scheduler counts them (pure; each
:class:`~ssh_scheduler.planner.allocate.MachineResources` owns one): GPU memory against the
invariant, utilization, GPUs reserved by one job, and the *ghosts* of released jobs, under the
GPU rules stated in :mod:`ssh_scheduler.planner.allocate`.

Per-GPU figures are lists in ``state.gpus`` order (a GPU's "position"); utilization is summed in
integer thousandths so that a charge and its removal restore the sums exactly.  What a probe says
is used on each GPU, and by whom, comes from :func:`~ssh_scheduler.planner.observed.observe`.
"""

from __future__ import annotations

from ssh_scheduler.jobs.needs import EPS, GPU_UTILIZATION_TOLERANCE, Needs
from ssh_scheduler.machines.host_state import HostState
from ssh_scheduler.planner.explain import gpu_needs_text
from ssh_scheduler.planner.observed import Held, Observed

__all__ = ["Gpus"]


class Gpus:
    """The GPUs of one host: the last probe's figures, what our jobs hold, and ghosts."""

    __slots__ = (
        "_avail",
        "_base",
        "_busy",
        "_capacity",
        "_ghosts",
        "_held_by_others",
        "_holds",
        "_idle",
        "_jobs",
        "_others",
        "_others_util",
        "_probe_generation",
        "_total",
        "_util_milli",
    )

    def __init__(self) -> None:
        # Released jobs' observed GPU memory, kept charged until a probe requested after the
        # release lands: job -> (probe generation at release, positions, MiB on each).
        self._ghosts: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
        self._probe_generation = 0

    def probe_started(self) -> int:
        """A probe of the host was requested: its number, for :meth:`read` when it lands."""
        self._probe_generation += 1
        return self._probe_generation

    def read(self, state: HostState, observed: Observed, generation: int | None) -> None:
        """Take a probe's figures; the ghosts of jobs released before probe ``generation`` was
        requested are gone now (``None``: a probe taken just now, every ghost is gone).  Our
        jobs are charged again next (:meth:`clear`, :meth:`charge`, then :meth:`settle`)."""
        if generation is None:
            self._ghosts.clear()
        else:
            for job_id, ghost in list(self._ghosts.items()):
                if ghost[0] < generation:
                    del self._ghosts[job_id]
        self._total = [gpu.memory_total_mb for gpu in state.gpus]
        self._capacity = observed.capacity
        self._others = observed.others
        base = observed.base
        # Before the ghosts are taken off: what other users hold, not what we still count.
        self._held_by_others = tuple(
            position
            for position, (other, capacity, room) in enumerate(zip(observed.others, observed.capacity, base, strict=True))
            if other or room < capacity
        )
        for _generation, ghost_positions, ghost_mb in self._ghosts.values():
            for position, mb in zip(ghost_positions, ghost_mb, strict=True):
                base[position] -= mb
        self._base = base

    def clear(self) -> None:
        """No job of ours charged (before they are charged again, after a probe)."""
        count = len(self._total)
        self._avail = list(self._base)
        self._util_milli = [0] * count
        self._jobs = [0] * count
        self._holds = [0] * count
        self._idle = self._others.count(False)
        # Placeholders until settle() can split utilization into ours and others'.
        self._others_util = [0.0] * count
        self._busy = [0.0] * count

    def settle(self, state: HostState) -> None:
        """Split the probed utilization into ours and others' (once our jobs are charged)."""
        util_milli = self._util_milli
        self._others_util = [
            max(0.0, gpu.utilization - util_milli[position] / 1000) if self._others[position] else 0.0
            for position, gpu in enumerate(state.gpus)
        ]
        self._busy = [
            other + own / 1000 for other, own in zip(self._others_util, util_milli, strict=True)
        ]

    def charge(self, needs: Needs, held: Held, sign: int) -> None:
        """Add (+1) or remove (-1) one running job's share of every GPU it holds."""
        positions, _rss, seen_gpu = held
        gpu_memory = needs.gpu_memory_mb
        util = sign * round(needs.gpu_utilization * 1000)
        hold = sign if needs.reserve_gpu else 0
        avail = self._avail
        util_milli = self._util_milli
        busy = self._busy
        others_util = self._others_util
        jobs = self._jobs
        for position, seen in zip(positions, seen_gpu, strict=True):
            avail[position] -= sign * max(gpu_memory, seen)
            util_milli[position] += util
            busy[position] = others_util[position] + util_milli[position] / 1000
            before = jobs[position]
            jobs[position] = before + sign
            self._holds[position] += hold
            # _idle counts GPUs with no job of ours and no other user: what reserving jobs can
            # take, so a host whose GPUs are all taken answers them in O(1).
            if not self._others[position] and (before == 0 or before + sign == 0):
                self._idle -= sign

    def released(self, job_id: str, held: Held) -> None:
        """A job gave its GPUs back (after :meth:`charge` with -1): its processes are gone, but
        the last probe still counts their memory as ours: keep it charged as a ghost until a
        probe requested from now on shows the GPU again."""
        positions, _rss, seen = held
        if any(seen):
            self._ghosts[job_id] = (self._probe_generation, positions, seen)
            for position, mb in zip(positions, seen, strict=True):
                self._base[position] -= mb
                self._avail[position] -= mb

    # ---------------------------------------------------------------- fitting

    @property
    def count(self) -> int:
        return len(self._total)

    def could_ever_fit(self, needs: Needs) -> bool:
        """Whether ``needs.gpus`` GPUs of this host could hold the job, empty and free of other
        users (``needs.gpus`` > 0)."""
        if needs.gpu_utilization > 1.0 + GPU_UTILIZATION_TOLERANCE + EPS:
            return False
        big_enough = sum(1 for total in self._total if total >= needs.gpu_memory_mb)
        return big_enough >= needs.gpus

    def choose(self, needs: Needs) -> tuple[float, tuple[int, ...]] | None:
        """The least loaded GPUs that fit the job now (``needs.gpus`` > 0): the load of the most
        loaded of them and their positions, or ``None``.  A GPU's load is the larger of its
        memory fraction in use (after the job) and its utilization (ours reserved plus others',
        with the job's)."""
        wanted = needs.gpus
        reserve = needs.reserve_gpu
        if wanted > (self._idle if reserve else len(self._total)):
            return None
        gpu_memory = needs.gpu_memory_mb
        utilization = needs.gpu_utilization
        limit = 1.0 + GPU_UTILIZATION_TOLERANCE + EPS - utilization
        totals = self._total
        avail = self._avail
        busy = self._busy
        jobs = self._jobs
        others = self._others
        candidates: list[tuple[float, int]] = []
        for position, holds in enumerate(self._holds):
            if holds or (reserve and (jobs[position] or others[position])):
                continue
            free = avail[position]
            if gpu_memory > 0 and gpu_memory > free:
                continue
            used = busy[position]
            if utilization > 0 and used > limit:
                continue
            total = totals[position]
            memory_load = 1.0 - (free - gpu_memory) / total if total > 0 else 1.0
            load = used + utilization
            candidates.append((memory_load if memory_load > load else load, position))
        if len(candidates) < wanted:
            return None
        if wanted == 1:
            load, position = min(candidates)
            return load, (position,)
        chosen = sorted(candidates)[:wanted]
        return chosen[-1][0], tuple(sorted(p for _, p in chosen))

    def over_committed(self, positions: tuple[int, ...]) -> int | None:
        """The first of ``positions`` whose GPU is promised more memory than it has (a bug)."""
        return next((position for position in positions if self._avail[position] < 0), None)

    # ---------------------------------------------------------------- views

    def promises(self, jobs: list[tuple[int, Held]]) -> tuple[tuple[int, int, int], ...]:
        """Per GPU: ``(capacity, others + ghosts, ours)`` in MiB, with ours the sum over our
        ``jobs`` (reservation, what they hold) on it of max(reservation, observed)."""
        ours = [0] * len(self._base)
        for reservation, (positions, _rss, seen) in jobs:
            for position, mb in zip(positions, seen, strict=True):
                ours[position] += max(reservation, mb)
        return tuple(
            (capacity, capacity - base, mine)
            for capacity, base, mine in zip(self._capacity, self._base, ours, strict=True)
        )

    @property
    def free_memory_mb(self) -> tuple[int, ...]:
        return tuple(self._avail)

    @property
    def held_by_others(self) -> tuple[int, ...]:
        """The positions of the GPUs that, at the last probe, another user's process was on
        or held memory no process of our running jobs accounts for."""
        return self._held_by_others

    def summary(self, state: HostState) -> str:
        """The GPUs for a host's one-line summary: ``GPUs 0:81079/81559 MiB ...``."""
        if not state.gpus:
            return f"no GPUs ({state.gpu_error})" if state.gpu_error else "no GPUs"
        gpus = " ".join(
            f"{gpu.index}:{free}/{gpu.memory_total_mb} MiB" + (" (other users)" if other else "")
            for gpu, free, other in zip(state.gpus, self._avail, self._others, strict=True)
        )
        return f"GPUs {gpus}"

    def why_not(self, state: HostState, needs: Needs) -> str:
        """Why no ``needs.gpus`` GPUs fit the job now, GPU by GPU (for messages only)."""
        reasons = []
        for position, gpu in enumerate(state.gpus):
            free = self._avail[position]
            busy = self._busy[position]
            if self._holds[position]:
                reason = "reserved by our job"
            elif needs.reserve_gpu and self._jobs[position]:
                reason = "shared by our jobs"
            elif needs.reserve_gpu and self._others[position]:
                reason = "in use by another user"
            elif needs.gpu_memory_mb > 0 and needs.gpu_memory_mb > free:
                reason = f"{max(0, free)} MiB free"
            elif needs.gpu_utilization > 0 and (
                busy + needs.gpu_utilization > 1.0 + GPU_UTILIZATION_TOLERANCE + EPS
            ):
                reason = f"{busy:.0%} busy"
            else:
                reason = "fits"
            reasons.append(f"{gpu.index}: {reason}")
        reserved = " (reserved)" if needs.reserve_gpu else ""
        return f"needs {gpu_needs_text(needs)}{reserved}; GPUs " + ", ".join(reasons)
