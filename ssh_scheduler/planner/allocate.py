"""Machine virtual resources: pure scoring, placement and reservation on a probed :class:`HostState`.

One :class:`MachineResources` per host keeps what the last probe saw plus what *our* jobs hold.
A job's :class:`Needs` are reserved by :meth:`MachineResources.allocate` and held until
:meth:`MachineResources.release`, so two jobs placed back to back never both count the same free
memory, even before the host is probed again.  :meth:`MachineResources.update` takes a fresh probe
while jobs run, together with what each of our jobs is observed to use (:class:`OwnUsage`, pids
and RSS reported by our agent), and counts each job once: its reservation or its observed use,
whichever is larger.

Accounting rules (all memory in MiB, as ``nvidia-smi`` reports it):

* **RAM**: ``free = MemAvailable + observed_own - sum(max(reservation, observed))`` over our
  running jobs.  After a re-probe a running job's real use is already missing from MemAvailable,
  so it is added back and the larger of reservation and use is charged instead.  Before any
  re-probe (nothing observed) this is ``MemAvailable - sum(reservations)``.  When a job is
  released its memory is not credited back until the next probe shows it free: conservative.
* **CPUs**: ``free = cpu_count * cpu_overload - others_load - sum(reserved cpus)``.  The 1-minute
  load at probe time includes our jobs then running, so ``others_load = load - min(load,
  cpus reserved by our jobs at probe time)``, capped at ``cpu_count - 1`` (a busy host keeps at
  least one core's room, so a lagging load average cannot starve a batch), fixed until the next
  probe.
* **GPU memory** on GPU g, the invariant (checked on every placement, see
  :meth:`MachineResources.gpu_promises`)::

      others(g) + ghosts(g) + sum over our jobs j on g of max(reservation(j), observed(j, g))
          <= capacity(g) = min(memory.total, memory.used + memory.free)

  ``observed(j, g)`` is the ``used_memory`` of g's compute processes whose pid belongs to job j
  (placed on g).  ``others(g)`` is every other process on g (anyone else's, a finished job's, our
  job's process on a GPU it was not placed on) plus the memory no listed process accounts for:
  ``memory.used - sum(listed processes)``, at least 0.  ``free`` is what is left of capacity.
  Why not ``memory.free + observed``: the process list and ``memory.free`` come from two
  ``nvidia-smi`` calls, and a job that started between them was added back as observed to a free
  figure that never subtracted it (three 6500 MiB jobs on one 16384 MiB GPU).  The probe lists
  processes first: a process that starts between the two calls is then in ``memory.used`` but not
  in the list, so it counts as someone else's until the next probe: never too little.  A process
  that ends between them can make the unaccounted part look smaller; so a released job's observed
  memory stays charged as a *ghost* until a probe requested after the release lands
  (:meth:`MachineResources.probe_started`).  GPUs of different sizes are compared in MiB, never as
  a fraction of a GPU.
* **GPU utilization** on g: a job asking ``u`` fits if ``others_util(g) + sum(u of our jobs on g)
  + u <= 1 + GPU_UTILIZATION_TOLERANCE``.  ``nvidia-smi`` cannot split utilization by process,
  so ``others_util(g)`` is the probed utilization minus what our jobs then on g reserved, and
  0 when no process of another user is on g (then the load is ours, already reserved).
* **reserve_gpu** (default): a GPU takes one reserving job and nothing else, and a GPU that any
  other user's process is on is never given to a reserving job.  With ``reserve_gpu=False`` jobs
  share GPUs subject to memory and utilization, but never a GPU one of our jobs reserved.
* **reserve_machine**: the job runs alone: it fits when none of our jobs runs on the machine and
  the machine could ever fit it (:meth:`MachineResources.could_ever_fit`); current use by other
  users is *not* checked, and while it runs nothing else is placed there.  A GPU job gets every
  GPU in ``gpu_indices``.
* A zero need never blocks: ``cpus=0`` fits an overloaded host, ``gpu_memory_mb=0`` a full GPU,
  ``gpu_utilization=0`` a busy one.  ``gpus=0`` means no GPU at all (``gpu_indices=()``).

Cost: ``score``/``allocate``/``release`` are O(#GPUs) with no copying (O(1) when a reserving
job meets a host whose GPUs are all taken), and the last score per machine is cached until its
state changes, so :func:`choose` over many machines re-evaluates only those that changed since
the previous call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.jobs.needs import (
    DEFAULT_CPU_OVERLOAD,
    EPS,
    GPU_UTILIZATION_TOLERANCE,
    Needs,
    NeedsOverride,
    NoFit,
    OwnUsage,
    Placement,
    cpus_text,
)
from ssh_scheduler.machines.probe import HostState
from ssh_scheduler.planner.fit import choose, explain_unfit, gpu_needs_text, max_concurrent

__all__ = [
    "DEFAULT_CPU_OVERLOAD",
    "GPU_UTILIZATION_TOLERANCE",
    "MachineResources",
    "Needs",
    "NeedsOverride",
    "NoFit",
    "OwnUsage",
    "Placement",
    "choose",
    "explain_unfit",
    "max_concurrent",
]

_NO_USAGE: Mapping[str, OwnUsage] = MappingProxyType({})
_NO_FIT: tuple[float, tuple[int, ...]] = (-math.inf, ())
QUEUE_SCORE = -10.0
"""Where a queue's scores start (``HostState.job_slots``): below any host's, whose headroom
fractions stay above -1 even overloaded."""


class MachineResources:
    """One host's resources as the scheduler sees them: the last probe plus our reservations.

    See the module docstring for how free CPUs, RAM, GPU memory and utilization are counted.
    """

    __slots__ = (
        "_cache_gpus",
        "_cache_needs",
        "_cache_score",
        "_cpu_capacity",
        "_cpu_overload",
        "_cpu_reserved_milli",
        "_g_avail",
        "_g_base",
        "_g_busy",
        "_g_capacity",
        "_g_ghosts",
        "_g_holds",
        "_g_idle",
        "_g_jobs",
        "_g_others",
        "_g_others_util",
        "_g_total",
        "_g_util_milli",
        "_held",
        "_holder",
        "_mem_available",
        "_mem_charge",
        "_mem_seen",
        "_mem_total",
        "_others_load",
        "_probe_generation",
        "_running",
        "_running_view",
        "_state",
        "name",
    )

    def __init__(
        self, name: str, state: HostState, *, cpu_overload: float = DEFAULT_CPU_OVERLOAD
    ) -> None:
        if not math.isfinite(cpu_overload) or cpu_overload <= 0:
            raise ConfigError(f"cpu_overload must be a number > 0, not {cpu_overload!r}")
        self.name = name
        self._cpu_overload = cpu_overload
        self._running: dict[str, Placement] = {}
        self._running_view: Mapping[str, Placement] = MappingProxyType(self._running)
        # Per running job: (positions of its GPUs in state.gpus, observed RSS, observed memory
        # on each of those GPUs).
        self._held: dict[str, tuple[tuple[int, ...], int, tuple[int, ...]]] = {}
        self._holder: str | None = None
        # Released jobs' observed GPU memory, kept charged until a probe requested after the
        # release lands: job -> (probe generation at release, positions, MiB on each).
        self._g_ghosts: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
        self._probe_generation = 0
        # The last evaluation, valid while _cache_needs is set: every change of state resets it.
        self._cache_needs: Needs | None = None
        self._cache_score = -math.inf
        self._cache_gpus: tuple[int, ...] = ()
        self.update(state)

    # ---------------------------------------------------------------- probe

    def probe_started(self) -> int:
        """Call when a probe of this host is requested; pass the number to :meth:`update` when
        it lands.  Ghosts of jobs released before the request are cleared by that update."""
        self._probe_generation += 1
        return self._probe_generation

    def update(
        self,
        state: HostState,
        own: Mapping[str, OwnUsage] = _NO_USAGE,
        generation: int | None = None,
    ) -> None:
        """Take a fresh probe while jobs run.

        ``own`` maps job ids to what our agent observed for them; a running job missing from it
        counts as using exactly its reservation.  Entries for jobs no longer running still mark
        their pids as ours (a finished job's process may linger in the probe: it does not make
        the GPU someone else's for ``reserve_gpu``), but their memory counts as used.  Running
        jobs keep their GPUs, found again by UUID.  ``generation`` is what
        :meth:`probe_started` returned for this probe (``None``: a probe taken just now).
        """
        if generation is None:
            self._g_ghosts.clear()
        else:
            for job_id, ghost in list(self._g_ghosts.items()):
                if ghost[0] < generation:
                    del self._g_ghosts[job_id]
        gpus = state.gpus
        self._state = state
        self._cpu_capacity = state.cpu_count * self._cpu_overload
        self._mem_total = state.mem_total_mb
        self._mem_available = state.mem_available_mb
        self._g_total = [gpu.memory_total_mb for gpu in gpus]
        self._g_capacity = [
            min(gpu.memory_total_mb, gpu.memory_used_mb + gpu.memory_free_mb) for gpu in gpus
        ]
        position_of = {gpu.uuid: position for position, gpu in enumerate(gpus)}

        own_pids: set[int] = set()
        for usage in own.values():
            own_pids.update(usage.pids)
        # Which running job a pid belongs to, so its memory counts as that job's only on the
        # GPUs the job was placed on.
        running_pid: dict[int, str] = {}
        for job_id in self._running:
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
        self._g_others = others

        # GPUs are found again by UUID, which survives renumbering; should a probe ever show
        # UUIDs that are not unique (a driver that cannot read them), fall back to the index.
        by_uuid = len(position_of) == len(gpus)
        position_of_index = {gpu.index: position for position, gpu in enumerate(gpus)}
        self._held.clear()
        for job_id, placement in self._running.items():
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
            self._held[job_id] = (positions, observed.rss_mb if observed is not None else 0, seen)
        # What is left in used_by_pid: our running jobs' processes on GPUs they were not placed
        # on; they count as anyone else's memory there.
        attributed = [0] * len(gpus)
        for held_positions, _rss, held_seen in self._held.values():
            for position, seen_mb in zip(held_positions, held_seen, strict=True):
                attributed[position] += seen_mb
        # capacity - others(g), with others = (listed - attributed) + max(0, used - listed).
        base = [
            capacity - (gpu.memory_used_mb if gpu.memory_used_mb > listed[p] else listed[p])
            + attributed[p]
            for p, (gpu, capacity) in enumerate(zip(gpus, self._g_capacity, strict=True))
        ]
        for _generation, ghost_positions, ghost_mb in self._g_ghosts.values():
            for position, mb in zip(ghost_positions, ghost_mb, strict=True):
                base[position] -= mb
        self._g_base = base
        self._recount()

        # The load average lags and counts everything runnable; capping other users' share at
        # cpu_count - 1 keeps at least one core's room on a busy host instead of starving the
        # batch forever (the ancestor's "small overload is tolerated").
        self._others_load = min(
            max(0.0, state.load_1m - self._cpu_reserved_milli / 1000),
            max(0.0, state.cpu_count - 1.0),
        )
        self._g_others_util = [
            max(0.0, gpu.utilization - self._g_util_milli[position] / 1000)
            if others[position]
            else 0.0
            for position, gpu in enumerate(gpus)
        ]
        self._g_busy = [
            other + own / 1000
            for other, own in zip(self._g_others_util, self._g_util_milli, strict=True)
        ]
        self._cache_needs = None

    def _recount(self) -> None:
        """Rebuild every sum from the running jobs (only after a probe; O(jobs))."""
        count = len(self._state.gpus)
        self._cpu_reserved_milli = 0
        self._mem_charge = 0
        self._mem_seen = 0
        self._g_avail = list(self._g_base)
        self._g_util_milli = [0] * count
        self._g_jobs = [0] * count
        self._g_holds = [0] * count
        self._g_idle = self._g_others.count(False)
        # Placeholders until update() can split utilization into ours and others'.
        self._g_others_util = [0.0] * count
        self._g_busy = [0.0] * count
        for job_id, placement in self._running.items():
            self._charge(placement.needs, self._held[job_id], +1)

    def _charge(
        self, needs: Needs, held: tuple[tuple[int, ...], int, tuple[int, ...]], sign: int
    ) -> None:
        """Add (+1) or remove (-1) one running job's share of every sum."""
        positions, rss, seen_gpu = held
        # CPUs and utilization are summed as integer thousandths so that allocate + release
        # restores the totals exactly (float sums drift, and could flip a later fit decision).
        self._cpu_reserved_milli += sign * round(needs.cpus * 1000)
        # Observed use is already missing from MemAvailable: charge only what the reservation
        # adds on top of it (nothing once the job uses more than it reserved).
        self._mem_charge += sign * max(needs.memory_mb, rss)
        self._mem_seen += sign * rss
        if not positions:
            return
        gpu_memory = needs.gpu_memory_mb
        util = sign * round(needs.gpu_utilization * 1000)
        hold = sign if needs.reserve_gpu else 0
        avail = self._g_avail
        util_milli = self._g_util_milli
        busy = self._g_busy
        others_util = self._g_others_util
        jobs = self._g_jobs
        for position, seen in zip(positions, seen_gpu, strict=True):
            avail[position] -= sign * max(gpu_memory, seen)
            util_milli[position] += util
            busy[position] = others_util[position] + util_milli[position] / 1000
            before = jobs[position]
            jobs[position] = before + sign
            self._g_holds[position] += hold
            # _g_idle counts GPUs with no job of ours and no other user: what reserving jobs
            # can take, so a host whose GPUs are all taken answers them in O(1).
            if not self._g_others[position] and (before == 0 or before + sign == 0):
                self._g_idle -= sign

    # ---------------------------------------------------------------- views

    @property
    def state(self) -> HostState:
        """The latest probe."""
        return self._state

    @property
    def cpu_overload(self) -> float:
        """The factor CPUs are over-committed by."""
        return self._cpu_overload

    @property
    def running(self) -> Mapping[str, Placement]:
        """Our jobs holding resources here, by job id (a read-only live view)."""
        return self._running_view

    @property
    def free_cpus(self) -> float:
        """CPUs left for new jobs (may be negative when other users overload the host)."""
        return self._cpu_capacity - self._others_load - self._cpu_reserved_milli / 1000

    @property
    def free_memory_mb(self) -> int:
        """RAM left for new jobs, in MiB."""
        return self._mem_available + self._mem_seen - self._mem_charge

    def gpu_promises(self) -> tuple[tuple[int, int, int], ...]:
        """Per GPU (in ``state.gpus`` order): ``(capacity, others + ghosts, ours)`` in MiB, where
        ours is the sum over our jobs on it of max(reservation, observed).  The invariant is
        ``others + ghosts + ours <= capacity`` after each placement (other users may of course
        take more later; then nothing new is placed there)."""
        ours = [0] * len(self._g_base)
        for job_id, placement in self._running.items():
            positions, _rss, seen = self._held[job_id]
            for position, mb in zip(positions, seen, strict=True):
                ours[position] += max(placement.needs.gpu_memory_mb, mb)
        return tuple(
            (capacity, capacity - base, mine)
            for capacity, base, mine in zip(self._g_capacity, self._g_base, ours, strict=True)
        )

    @property
    def gpu_free_memory_mb(self) -> tuple[int, ...]:
        """GPU memory left for new jobs on each GPU, in MiB, in ``state.gpus`` order."""
        return tuple(self._g_avail)

    def capacity_summary(self) -> str:
        """One line for the run header, e.g.
        ``16 cpus (load 0.52), 128398/128887 MiB free, GPUs 0:81079/81559 MiB``."""
        state = self._state
        parts = [
            f"{state.cpu_count} cpus (load {state.load_1m:.2f})",
            f"{self.free_memory_mb}/{state.mem_total_mb} MiB free",
        ]
        if state.gpus:
            gpus = " ".join(
                f"{gpu.index}:{free}/{gpu.memory_total_mb} MiB"
                + (" (other users)" if other else "")
                for gpu, free, other in zip(state.gpus, self._g_avail, self._g_others, strict=True)
            )
            parts.append(f"GPUs {gpus}")
        elif state.gpu_error:
            parts.append(f"no GPUs ({state.gpu_error})")
        else:
            parts.append("no GPUs")
        if self._holder is not None:
            parts.append(f"reserved by {self._holder}")
        return ", ".join(parts)

    # ---------------------------------------------------------------- fitting

    def could_ever_fit(self, needs: Needs) -> bool:
        """Whether the job fits this machine empty and free of other users: against
        ``cpu_count * cpu_overload``, ``mem_total_mb``, each GPU's ``memory.total`` and the
        number of GPUs.  Used to reject impossible jobs before anything runs.  A batch
        system's queue takes any job: it refuses at submission what it could never run."""
        if self._state.job_slots is not None:
            return True
        if needs.cpus > self._cpu_capacity + EPS or needs.memory_mb > self._mem_total:
            return False
        if needs.gpus == 0:
            return True
        if needs.gpu_utilization > 1.0 + GPU_UTILIZATION_TOLERANCE + EPS:
            return False
        big_enough = sum(1 for total in self._g_total if total >= needs.gpu_memory_mb)
        return big_enough >= needs.gpus

    def score(self, needs: Needs) -> float:
        """How good a place this machine is for the job *now*: ``-math.inf`` if it does not fit,
        otherwise higher is better.

        The score is the fraction of the bottleneck resource left after placing the job: the
        least of free CPUs / capacity, free RAM / total, and for GPU jobs 1 - the load of the
        most loaded chosen GPU, where a GPU's load is the larger of its memory fraction in use
        and its utilization (ours reserved plus others').  Preferring most headroom spreads jobs
        evenly over hosts, and choosing the least loaded GPUs spreads them over GPUs.
        """
        if needs is not self._cache_needs:
            self._cache_score, self._cache_gpus = self._evaluate(needs)
            self._cache_needs = needs
        return self._cache_score

    def _evaluate(self, needs: Needs) -> tuple[float, tuple[int, ...]]:
        """The score and the chosen GPU positions (in ``state.gpus``), or :data:`_NO_FIT`."""
        slots = self._state.job_slots
        if slots is not None:
            # A batch system's queue (Slurm): it places jobs and judges fit itself; we keep at
            # most `slots` jobs there, and only after every host with room (below their scores).
            free = slots - len(self._running)
            return (QUEUE_SCORE + (free - 1) / slots, ()) if free > 0 else _NO_FIT
        if self._holder is not None:
            return _NO_FIT
        capacity = self._cpu_capacity
        total_memory = self._mem_total
        free_cpus = capacity - self._others_load - self._cpu_reserved_milli / 1000
        free_memory = self._mem_available + self._mem_seen - self._mem_charge
        if needs.reserve_machine:
            if self._running or not self.could_ever_fit(needs):
                return _NO_FIT
            positions = tuple(range(len(self._g_total))) if needs.gpus else ()
            # Nothing is enforced beyond "alone", so prefer the host others use least.
            headroom = min(
                free_cpus / capacity if capacity > 0 else 0.0,
                free_memory / total_memory if total_memory > 0 else 0.0,
            )
            return headroom, positions

        cpus = needs.cpus
        if cpus > 0 and cpus > free_cpus + EPS:
            return _NO_FIT
        memory = needs.memory_mb
        if memory > 0 and memory > free_memory:
            return _NO_FIT
        wanted = needs.gpus
        reserve = needs.reserve_gpu
        if wanted > (self._g_idle if reserve else len(self._g_total)):
            return _NO_FIT
        headroom = min(
            (free_cpus - cpus) / capacity if capacity > 0 else 0.0,
            (free_memory - memory) / total_memory if total_memory > 0 else 0.0,
        )
        if wanted == 0:
            return headroom, ()

        gpu_memory = needs.gpu_memory_mb
        utilization = needs.gpu_utilization
        limit = 1.0 + GPU_UTILIZATION_TOLERANCE + EPS - utilization
        totals = self._g_total
        avail = self._g_avail
        busy = self._g_busy
        jobs = self._g_jobs
        others = self._g_others
        candidates: list[tuple[float, int]] = []
        for position, holds in enumerate(self._g_holds):
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
            return _NO_FIT
        if wanted == 1:
            load, position = min(candidates)
            return min(headroom, 1.0 - load), (position,)
        chosen = sorted(candidates)[:wanted]
        return min(headroom, 1.0 - chosen[-1][0]), tuple(sorted(p for _, p in chosen))

    def allocate(self, job_id: str, needs: Needs) -> Placement:
        """Reserve the job's needs here, from now until :meth:`release`, and say where it runs.

        Raises :class:`NoFit` (with the reason) when it does not fit now, and ``ValueError``
        when ``job_id`` already holds resources here.
        """
        if job_id in self._running:
            raise ValueError(f"job {job_id!r} already holds resources on {self.name}")
        if needs is not self._cache_needs:
            self._cache_score, self._cache_gpus = self._evaluate(needs)
            self._cache_needs = needs
        if self._cache_score == -math.inf:
            raise NoFit(f"{job_id} does not fit on {self.name} now: {self._why_not(needs)}")
        positions = self._cache_gpus
        gpus = self._state.gpus
        indices: tuple[int, ...]
        uuids: tuple[str, ...]
        if len(positions) == 1:
            gpu = gpus[positions[0]]
            indices, uuids = (gpu.index,), (gpu.uuid,)
        else:
            indices = tuple(gpus[position].index for position in positions)
            uuids = tuple(gpus[position].uuid for position in positions)
        return self._hold(Placement(self.name, job_id, indices, needs, uuids), positions)

    def _hold(
        self, placement: Placement, positions: tuple[int, ...], check: bool = True
    ) -> Placement:
        held = (positions, 0, (0,) * len(positions))
        self._running[placement.job_id] = placement
        self._held[placement.job_id] = held
        self._charge(placement.needs, held, +1)
        if check and placement.needs.gpu_memory_mb and not placement.needs.reserve_machine:
            for position in positions:
                if self._g_avail[position] < 0:  # the invariant in the module docstring
                    raise RuntimeError(
                        f"bug: {placement.job_id} over-commits GPU {placement.gpu_indices} on "
                        f"{self.name}: {self.gpu_promises()[position]}"
                    )
        if placement.needs.reserve_machine:
            self._holder = placement.job_id
        self._cache_needs = None
        return placement

    def adopt(self, job_id: str, needs: Needs, gpu_indices: Sequence[int]) -> Placement:
        """Charge a job that is ALREADY running here on the given GPUs (a coordinator that
        restarted and reattached to it), whether or not it would fit now: it is using the room
        either way, and new jobs must see it as taken."""
        if job_id in self._running:
            raise ValueError(f"job {job_id!r} already holds resources on {self.name}")
        gpus = self._state.gpus
        by_index = {gpu.index: position for position, gpu in enumerate(gpus)}
        positions = tuple(by_index[i] for i in gpu_indices if i in by_index)
        placement = Placement(
            self.name,
            job_id,
            tuple(gpus[p].index for p in positions),
            needs,
            tuple(gpus[p].uuid for p in positions),
        )
        return self._hold(placement, positions, check=False)

    def release(self, job_id: str) -> None:
        """Give back what the job held; releasing an unknown or released job does nothing."""
        placement = self._running.pop(job_id, None)
        if placement is None:
            return
        held = self._held.pop(job_id)
        self._charge(placement.needs, held, -1)
        positions, _rss, seen = held
        if any(seen):
            # Its processes are gone, but the last probe still counts their memory as ours: keep
            # it charged until a probe requested from now on shows the GPU again.
            self._g_ghosts[job_id] = (self._probe_generation, positions, seen)
            for position, mb in zip(positions, seen, strict=True):
                self._g_base[position] -= mb
                self._g_avail[position] -= mb
        if self._holder == job_id:
            self._holder = None
        self._cache_needs = None

    def _why_not(self, needs: Needs) -> str:
        """Why the job does not fit now (slow path, for messages only)."""
        if self._holder is not None:
            return f"the machine is reserved by {self._holder}"
        if not self.could_ever_fit(needs):
            return "it never could: " + explain_unfit([self], needs)
        if needs.reserve_machine:
            return f"it must run alone but {len(self._running)} of our jobs hold resources here"
        if needs.cpus > 0 and needs.cpus > self.free_cpus + EPS:
            return f"needs {cpus_text(needs.cpus)}, {max(0.0, self.free_cpus):.2f} free"
        if needs.memory_mb > 0 and needs.memory_mb > self.free_memory_mb:
            return f"needs {needs.memory_mb} MiB RAM, {max(0, self.free_memory_mb)} MiB free"
        reasons = []
        for position, gpu in enumerate(self._state.gpus):
            free = self._g_avail[position]
            busy = self._g_busy[position]
            if self._g_holds[position]:
                reason = "reserved by our job"
            elif needs.reserve_gpu and self._g_jobs[position]:
                reason = "shared by our jobs"
            elif needs.reserve_gpu and self._g_others[position]:
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
