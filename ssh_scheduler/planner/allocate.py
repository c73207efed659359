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

  ``observed(j, g)`` (what job j's processes use on g) and ``others(g)`` (everyone else's, and
  what no listed process accounts for) are read from each probe by
  :func:`~ssh_scheduler.planner.observed.observe`, which says why they are counted as they are.
  ``free`` is what is left of capacity.  A released job's observed memory stays charged as a
  *ghost* until a probe requested after the release lands
  (:meth:`MachineResources.probe_started`): a probe already on its way may have read the memory
  while the job still held it.  (A job that frees memory while a probe reads it is handled by the
  probe itself: :func:`ssh_scheduler.machines.probe.listed_throughout` counts each process at the
  smaller of the figures its two process lists show.)  GPUs of different sizes are compared in MiB, never as
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

The GPU rules are kept per GPU by :class:`~ssh_scheduler.planner.gpus.Gpus`; what a probe says
is used, and by whom, is read by :func:`~ssh_scheduler.planner.observed.observe`.

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
from ssh_scheduler.jobs.needs import DEFAULT_CPU_OVERLOAD, EPS, Needs, NeedsOverride, cpus_text
from ssh_scheduler.machines.host_state import HostState, OwnUsage
from ssh_scheduler.planner.explain import explain_unfit
from ssh_scheduler.planner.gpus import Gpus
from ssh_scheduler.planner.observed import Held, observe
from ssh_scheduler.planner.placement import NoFit, Placement

# Needs and NeedsOverride are defined in ssh_scheduler.jobs.needs; they are still named here for
# the importers outside the planner that take them from this module.
__all__ = ["MachineResources", "Needs", "NeedsOverride", "choose", "max_concurrent"]

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
        "_gpus",
        "_held",
        "_holder",
        "_mem_available",
        "_mem_charge",
        "_mem_seen",
        "_mem_total",
        "_others_load",
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
        self._held: dict[str, Held] = {}
        self._holder: str | None = None
        self._gpus = Gpus()
        # The last evaluation, valid while _cache_needs is set: every change of state resets it.
        self._cache_needs: Needs | None = None
        self._cache_score = -math.inf
        self._cache_gpus: tuple[int, ...] = ()
        self.update(state)

    # ---------------------------------------------------------------- probe

    def probe_started(self) -> int:
        """Call when a probe of this host is requested; pass the number to :meth:`update` when
        it lands.  Ghosts of jobs released before the request are cleared by that update."""
        return self._gpus.probe_started()

    def update(
        self,
        state: HostState,
        own: Mapping[str, OwnUsage] = _NO_USAGE,
        generation: int | None = None,
    ) -> None:
        """Take a fresh probe while jobs run.

        ``own`` maps job ids to what our agent observed for them (see
        :func:`~ssh_scheduler.planner.observed.observe` for how it is counted).  ``generation``
        is what :meth:`probe_started` returned for this probe (``None``: a probe taken just now).
        """
        self._state = state
        self._cpu_capacity = state.cpu_count * self._cpu_overload
        self._mem_total = state.mem_total_mb
        self._mem_available = state.mem_available_mb
        observed = observe(state, own, self._running)
        self._held = observed.held
        self._gpus.read(state, observed, generation)
        self._recount()
        # The load average lags and counts everything runnable; capping other users' share at
        # cpu_count - 1 keeps at least one core's room on a busy host instead of starving the
        # batch forever (the ancestor's "small overload is tolerated").
        self._others_load = min(
            max(0.0, state.load_1m - self._cpu_reserved_milli / 1000),
            max(0.0, state.cpu_count - 1.0),
        )
        self._gpus.settle(state)
        self._cache_needs = None

    def _recount(self) -> None:
        """Rebuild every sum from the running jobs (only after a probe; O(jobs))."""
        self._cpu_reserved_milli = 0
        self._mem_charge = 0
        self._mem_seen = 0
        self._gpus.clear()
        for job_id, placement in self._running.items():
            self._charge(placement.needs, self._held[job_id], +1)

    def _charge(self, needs: Needs, held: Held, sign: int) -> None:
        """Add (+1) or remove (-1) one running job's share of every sum."""
        _positions, rss, _seen = held
        # CPUs are summed as integer thousandths so that allocate + release restores the totals
        # exactly (float sums drift, and could flip a later fit decision).
        self._cpu_reserved_milli += sign * round(needs.cpus * 1000)
        # Observed use is already missing from MemAvailable: charge only what the reservation
        # adds on top of it (nothing once the job uses more than it reserved).
        self._mem_charge += sign * max(needs.memory_mb, rss)
        self._mem_seen += sign * rss
        if held[0]:
            self._gpus.charge(needs, held, sign)

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
        return self._gpus.promises(
            [(p.needs.gpu_memory_mb, self._held[job_id]) for job_id, p in self._running.items()]
        )

    @property
    def gpus_held_by_others(self) -> tuple[int, ...]:
        """The indices of the GPUs other users held at the last probe (a process on it, or
        memory none of our running jobs accounts for): what a later probe may find freed."""
        gpus = self._state.gpus
        return tuple(gpus[position].index for position in self._gpus.held_by_others)

    @property
    def gpu_free_memory_mb(self) -> tuple[int, ...]:
        """GPU memory left for new jobs on each GPU, in MiB, in ``state.gpus`` order."""
        return self._gpus.free_memory_mb

    def capacity_summary(self) -> str:
        """One line for the run header, e.g.
        ``16 cpus (load 0.52), 128398/128887 MiB free, GPUs 0:81079/81559 MiB``."""
        state = self._state
        parts = [
            f"{state.cpu_count} cpus (load {state.load_1m:.2f})",
            f"{self.free_memory_mb}/{state.mem_total_mb} MiB free",
            self._gpus.summary(state),
        ]
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
        return needs.gpus == 0 or self._gpus.could_ever_fit(needs)

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
            positions = tuple(range(self._gpus.count)) if needs.gpus else ()
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
        headroom = min(
            (free_cpus - cpus) / capacity if capacity > 0 else 0.0,
            (free_memory - memory) / total_memory if total_memory > 0 else 0.0,
        )
        if needs.gpus == 0:
            return headroom, ()
        chosen = self._gpus.choose(needs)
        if chosen is None:
            return _NO_FIT
        load, positions = chosen
        return min(headroom, 1.0 - load), positions

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
            position = self._gpus.over_committed(positions)
            if position is not None:  # the invariant in the module docstring
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
        if held[0]:
            self._gpus.released(job_id, held)
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
        return self._gpus.why_not(self._state, needs)


def choose(machines: Sequence[MachineResources], needs: Needs) -> MachineResources | None:
    """The machine with the best :meth:`~MachineResources.score` for the job, or ``None`` when
    it fits nowhere now.  Ties go to the machine running fewest of our jobs (jobs that need
    nothing measurable would otherwise all land on one host), then to the smallest name, so
    plans are reproducible."""
    best: MachineResources | None = None
    best_score = -math.inf
    for machine in machines:
        # Runs once per placed job over every machine, so the cache check is inlined (this
        # module owns the cache): only the machines that changed since their last score
        # (usually one or two) are evaluated.
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
