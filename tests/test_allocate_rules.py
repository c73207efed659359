"""The resource accounting's rules that the mutation run (scripts/mutation resources) found
untested: why a job does not fit, word for word and at each need's exact boundary; a zero need
is never the reason; a batch system's queue takes any job; a job adopted after a restart is
charged where it runs, fitting or not; a released job's memory stays charged as a ghost until a
probe requested after the release lands; utilization that adds up to exactly a whole GPU plus
the tolerance fits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ssh_scheduler.jobs.needs import GPU_UTILIZATION_TOLERANCE, Needs
from ssh_scheduler.machines.host_state import GpuProcess, HostState, OwnUsage
from ssh_scheduler.planner.allocate import MachineResources
from ssh_scheduler.planner.placement import NoFit, Placement
from tests.test_allocate import fits, gpu, host, machine

SHARED = Needs(reserve_gpu=False)
OTHER = 9  # a pid no job of ours has


def why(m: MachineResources, needs: Needs) -> str:
    """What the job's NoFit says after "now: "."""
    with pytest.raises(NoFit) as info:
        m.allocate("j", needs)
    message = str(info.value)
    assert message.startswith(f"j does not fit on {m.name} now: "), message
    return message.split(" now: ", 1)[1]


def full_gpu(index: int) -> HostState:
    """A host whose GPU ``index`` another user fills (and whose GPU 0..index-1 are idle)."""
    gpus = (*(gpu(i) for i in range(index)), gpu(index, free=0))
    return host(gpus=gpus, processes=(GpuProcess(OTHER, f"GPU-{index}", 16000),))


# ---------------------------------------------------------------- why a job does not fit, GPU by GPU


def test_a_reserving_job_is_told_whose_gpu_it_is() -> None:
    m = machine(gpus=(gpu(0), gpu(1), gpu(2)), processes=(GpuProcess(OTHER, "GPU-2", 100),))
    m.allocate("reserving", Needs())
    m.allocate("sharing", SHARED)  # GPU 1, the only one left for it that is not reserved
    assert why(m, Needs()) == (
        "needs 1 GPU with 1000 MiB (reserved); GPUs 0: reserved by our job, "
        "1: shared by our jobs, 2: in use by another user"
    )


@pytest.mark.parametrize(
    ("state", "needs", "reason"),
    [
        # The smallest need is a need: 1 MiB on a GPU with nothing free.
        (full_gpu(0), Needs(gpu_memory_mb=1, reserve_gpu=False), "needs 1 GPU with 1 MiB; GPUs 0: 0 MiB free"),
        # Exactly the free memory fits.
        (
            host(gpus=(gpu(0, free=6000), gpu(1, free=5999))),
            Needs(gpus=2, gpu_memory_mb=6000, reserve_gpu=False),
            "needs 2 GPUs with 6000 MiB each; GPUs 0: fits, 1: 5999 MiB free",
        ),
        # Utilization: another user's 60 % and the job's 0.5 are more than 1 + the tolerance;
        # 55 % and 0.5 are exactly that, and fit.
        (
            host(
                gpus=(gpu(0, util=0.55), gpu(1, util=0.6)),
                processes=(GpuProcess(OTHER, "GPU-0", 1), GpuProcess(OTHER, "GPU-1", 1)),
            ),
            Needs(gpus=2, gpu_memory_mb=0, gpu_utilization=0.5, reserve_gpu=False),
            "needs 2 GPUs; GPUs 0: fits, 1: 60% busy",
        ),
        # A whole GPU's utilization does not fit next to another user's 10 %.
        (
            host(gpus=(gpu(0, util=0.1),), processes=(GpuProcess(OTHER, "GPU-0", 1),)),
            Needs(gpu_memory_mb=0, gpu_utilization=1.0, reserve_gpu=False),
            "needs 1 GPU; GPUs 0: 10% busy",
        ),
    ],
)
def test_a_gpu_job_is_told_what_each_gpu_lacks_at_the_exact_boundary(state: HostState, needs: Needs, reason: str) -> None:
    assert why(MachineResources("m", state), needs) == reason


def test_a_zero_gpu_need_is_never_the_reason() -> None:
    """GPU 0 is over-committed (memory and utilization) by jobs adopted after a restart, GPU 1
    reserved by one: a job that asks for neither memory nor utilization is told GPU 0 fits."""
    m = machine(gpus=(gpu(0), gpu(1)))
    for job in ("a", "b"):
        m.adopt(job, Needs(gpu_memory_mb=9000, gpu_utilization=0.6, reserve_gpu=False), [0])
    m.adopt("r", Needs(), [1])
    assert fits(m, Needs(gpu_memory_mb=0, reserve_gpu=False))
    two = Needs(gpus=2, gpu_memory_mb=0, reserve_gpu=False)
    assert why(m, two) == "needs 2 GPUs; GPUs 0: fits, 1: reserved by our job"
    # ... and one that needs a little of either is told what GPU 0 lacks, the memory first.
    assert why(m, Needs(gpus=2, gpu_memory_mb=1, gpu_utilization=0.01, reserve_gpu=False)) == (
        "needs 2 GPUs with 1 MiB each; GPUs 0: 0 MiB free, 1: reserved by our job"
    )
    assert why(m, Needs(gpus=2, gpu_memory_mb=0, gpu_utilization=0.01, reserve_gpu=False)) == (
        "needs 2 GPUs; GPUs 0: 120% busy, 1: reserved by our job"
    )


# ---------------------------------------------------------------- why a job does not fit: CPUs and RAM


def loaded(*, cpus: float = 0.0, memory_mb: int = 0) -> MachineResources:
    """4 cpus (5 with the overload), 2000 MiB RAM available, an idle GPU 0 and a GPU 1 another
    user fills, and a job of ours adopted after a restart holding ``cpus`` and ``memory_mb``
    (no GPU)."""
    state = full_gpu(1)
    m = MachineResources("m", HostState(4, 0.0, 64000, 2000, gpus=state.gpus, gpu_processes=state.gpu_processes))
    m.adopt("held", Needs(gpus=0, cpus=cpus, memory_mb=memory_mb), [])
    return m


@pytest.mark.parametrize(
    ("m", "needs", "reason"),
    [
        (loaded(cpus=4.5), Needs(gpus=0, cpus=1), "needs 1 cpu, 0.50 free"),
        # Over-committed: nothing is free, not less than nothing.
        (loaded(cpus=6), Needs(gpus=0, cpus=1), "needs 1 cpu, 0.00 free"),
        (loaded(memory_mb=2000), Needs(gpus=0, cpus=0, memory_mb=1), "needs 1 MiB RAM, 0 MiB free"),
        (loaded(memory_mb=3000), Needs(gpus=0, cpus=0, memory_mb=1), "needs 1 MiB RAM, 0 MiB free"),
        # Exactly the free CPUs and RAM fit: the reason is the next need.
        (loaded(cpus=4), Needs(gpus=0, cpus=1, memory_mb=2001), "needs 2001 MiB RAM, 2000 MiB free"),
        (
            loaded(),
            Needs(gpus=2, cpus=5, memory_mb=2000, gpu_memory_mb=0),
            "needs 2 GPUs (reserved); GPUs 0: fits, 1: in use by another user",
        ),
        # A zero need is never the reason, however over-committed the host.
        (loaded(cpus=6), Needs(gpus=0, cpus=0, memory_mb=2001), "needs 2001 MiB RAM, 2000 MiB free"),
        (
            loaded(memory_mb=3000),
            Needs(gpus=2, cpus=0, memory_mb=0),
            "needs 2 GPUs with 1000 MiB each (reserved); GPUs 0: fits, 1: in use by another user",
        ),
    ],
)
def test_a_job_is_told_the_first_need_that_does_not_fit_at_its_exact_boundary(
    m: MachineResources, needs: Needs, reason: str
) -> None:
    assert why(m, needs) == reason


# ---------------------------------------------------------------- could it ever fit


def test_a_batch_systems_queue_takes_any_job() -> None:
    """It refuses at submission what it could never run (its own judgement, not ours)."""
    queue = MachineResources("slurm", HostState(1, 0.0, 100, 100, job_slots=4))
    assert queue.could_ever_fit(Needs(cpus=10_000, memory_mb=10**9, gpus=64, gpu_memory_mb=10**6))


def test_a_whole_gpu_plus_the_tolerance_could_fit_and_no_more() -> None:
    m = machine(gpus=(gpu(0),))
    assert m.could_ever_fit(Needs(gpu_utilization=1.0 + GPU_UTILIZATION_TOLERANCE))
    assert not m.could_ever_fit(Needs(gpu_utilization=1.0 + GPU_UTILIZATION_TOLERANCE + 0.0005))


def test_utilization_that_adds_up_to_a_whole_gpu_plus_the_tolerance_fits() -> None:
    m = machine(gpus=(gpu(0),))
    m.allocate("a", Needs(gpu_utilization=1.0, reserve_gpu=False))
    assert fits(m, Needs(gpu_utilization=GPU_UTILIZATION_TOLERANCE, reserve_gpu=False))
    assert not fits(m, Needs(gpu_utilization=GPU_UTILIZATION_TOLERANCE + 0.0005, reserve_gpu=False))


# ---------------------------------------------------------------- a job adopted after a restart


def test_an_adopted_job_is_charged_on_its_gpus_fitting_or_not() -> None:
    """A coordinator that restarted finds the job running on GPU index 5: it holds that GPU's
    place (by index and UUID), charged in full though it over-commits the GPU; GPU indices the
    probe does not show are dropped; a job is adopted once."""
    m = machine(gpus=(gpu(3), gpu(5)))
    needs = Needs(gpu_memory_mb=20000, reserve_gpu=False)
    placement = m.adopt("a", needs, [5, 7])
    assert placement == Placement("m", "a", (5,), needs, ("GPU-5",))
    assert m.running == {"a": placement}
    assert m.gpu_promises() == ((16000, 0, 0), (16000, 0, 20000))
    assert m.gpu_free_memory_mb == (16000, -4000)
    with pytest.raises(ValueError, match=r"^job 'a' already holds resources on m$"):
        m.adopt("a", needs, [3])
    with pytest.raises(ValueError, match=r"^job 'a' already holds resources on m$"):
        m.allocate("a", needs)


# ---------------------------------------------------------------- ghosts


def test_a_released_jobs_memory_stays_charged_until_a_probe_requested_after_the_release() -> None:
    m = machine(gpus=(gpu(0),))
    m.allocate("a", Needs(gpu_memory_mb=7000, reserve_gpu=False))
    seen = host(gpus=(gpu(0, free=11000),), processes=(GpuProcess(11, "GPU-0", 5000),))
    m.update(seen, {"a": OwnUsage(frozenset({11}))}, m.probe_started())
    assert m.gpu_promises() == ((16000, 0, 7000),)
    early = m.probe_started()  # requested before the release: it may still list a's 5000 MiB
    m.release("a")
    # The last probe counted a's 5000 MiB as ours: they are a ghost now, with the others.
    assert m.gpu_promises() == ((16000, 5000, 0),)
    assert m.gpu_free_memory_mb == (11000,)
    m.update(host(gpus=(gpu(0),)), {}, early)
    assert m.gpu_promises() == ((16000, 5000, 0),)
    m.update(host(gpus=(gpu(0),)), {}, m.probe_started())
    assert m.gpu_promises() == ((16000, 0, 0),)
    assert m.gpu_free_memory_mb == (16000,)


def test_every_released_job_leaves_its_own_ghost() -> None:
    m = machine(gpus=(gpu(0),))
    for job in ("a", "b"):
        m.allocate(job, Needs(gpu_memory_mb=4000, reserve_gpu=False))
    seen = host(gpus=(gpu(0, free=9000),), processes=(GpuProcess(11, "GPU-0", 3000), GpuProcess(12, "GPU-0", 4000)))
    m.update(seen, {"a": OwnUsage(frozenset({11})), "b": OwnUsage(frozenset({12}))}, m.probe_started())
    early = m.probe_started()  # requested before the releases: it may still list both
    m.release("a")
    m.release("b")
    assert m.gpu_promises() == ((16000, 7000, 0),)
    m.update(host(gpus=(gpu(0),)), {}, early)
    assert m.gpu_promises() == ((16000, 7000, 0),)


def test_our_shared_jobs_on_gpus_other_users_are_on_leave_the_idle_gpus_to_reserving_jobs() -> None:
    m = machine(gpus=tuple(gpu(i) for i in range(4)), processes=(GpuProcess(OTHER, "GPU-0", 100), GpuProcess(OTHER, "GPU-1", 100)))
    for job, index in (("s0", 0), ("s1", 1)):
        m.adopt(job, Needs(gpu_memory_mb=100, reserve_gpu=False), [index])
    assert [m.allocate(job, Needs()).gpu_indices for job in ("r2", "r3")] == [(2,), (3,)]


# ---------------------------------------------------------------- choosing GPUs


def test_a_reserving_job_takes_the_idle_gpu_however_the_others_are_used() -> None:
    """GPU 0 has another user, GPU 1 our shared jobs (adopted, placed and released in turn),
    GPU 2 nobody: a reserving job gets GPU 2, and once GPU 1 is empty again, GPU 1 too."""
    m = machine(gpus=(gpu(0), gpu(1), gpu(2)), processes=(GpuProcess(OTHER, "GPU-0", 100),))
    shared = Needs(gpu_memory_mb=100, reserve_gpu=False)
    m.adopt("on-theirs", shared, [0])
    for job in ("s1", "s2", "s3"):
        m.adopt(job, shared, [1])
    assert m.allocate("r1", Needs()).gpu_indices == (2,)
    for job in ("s1", "s2", "s3", "on-theirs"):
        m.release(job)
    assert m.allocate("r2", Needs()).gpu_indices == (1,)
    assert not fits(m, Needs())


def test_a_gpu_too_busy_is_passed_over_for_the_next() -> None:
    m = machine(gpus=(gpu(0, util=1.0), gpu(1)), processes=(GpuProcess(OTHER, "GPU-0", 100),))
    assert m.allocate("a", Needs(gpu_memory_mb=0, gpu_utilization=0.5, reserve_gpu=False)).gpu_indices == (1,)


NOTHING = Needs(cpus=0, memory_mb=0, gpus=1, gpu_memory_mb=0, reserve_gpu=False)


@pytest.mark.parametrize(
    ("utils", "needs", "score"),
    [
        # A GPU's load is its utilization with the job's, or its memory in use if larger.
        ((0.3,), replace(NOTHING, gpu_utilization=0.5), 0.2),
        ((0.0,), replace(NOTHING, gpu_memory_mb=4000), 0.75),
        # A job on several GPUs is as loaded as the most loaded of the least loaded ones.
        ((0.3, 0.1, 0.2, 0.9), replace(NOTHING, gpus=3), 0.7),
    ],
)
def test_a_gpu_jobs_score_is_what_its_most_loaded_gpu_leaves(
    utils: tuple[float, ...], needs: Needs, score: float
) -> None:
    gpus = tuple(gpu(i, util=u) for i, u in enumerate(utils))
    m = machine(gpus=gpus, processes=tuple(GpuProcess(OTHER, f"GPU-{i}", 0) for i in range(len(utils))))
    assert m.score(needs) == pytest.approx(score)


def test_a_gpu_whose_memory_is_unknown_counts_as_full() -> None:
    m = machine(gpus=(gpu(0, total=0),))
    assert m.score(NOTHING) == 0.0


# ---------------------------------------------------------------- scores


def test_a_hosts_score_is_the_fraction_of_its_bottleneck_left_after_the_job() -> None:
    """8 cpus (10 with the overload), 64000 MiB RAM, 2000 of them used by a job of ours that
    uses 500 MiB more than it reserved: a job of 2 cpus and 20000 MiB leaves 7/10 of the CPUs
    and 42000/64000 of the RAM; one that must run alone is scored by what others use."""
    m = machine(cpus=8, mem_total=64000, mem_available=62000)
    m.allocate("ours", Needs(gpus=0, cpus=1, memory_mb=1500))
    m.update(host(cpus=8, mem_total=64000, mem_available=62000), {"ours": OwnUsage(frozenset({5}), rss_mb=2000)})
    assert m.score(Needs(gpus=0, cpus=2, memory_mb=20000)) == pytest.approx(42000 / 64000)
    assert m.score(Needs(gpus=0, cpus=2, memory_mb=1000)) == pytest.approx(7 / 10)
    alone = machine(cpus=8, load=2.0, mem_total=64000, mem_available=48000)
    assert alone.score(Needs(gpus=0, reserve_machine=True)) == pytest.approx(min(8 / 10, 48000 / 64000))


def test_a_queue_scores_below_every_host_and_by_its_free_slots() -> None:
    queue = MachineResources("slurm", HostState(1, 0.0, 100, 100, job_slots=4))
    needs = Needs(gpus=0)
    scores = []
    for n in range(4):
        scores.append(queue.score(needs))
        queue.allocate(f"j{n}", needs)
    assert scores == pytest.approx([-10 + 3 / 4, -10 + 2 / 4, -10 + 1 / 4, -10.0])
    assert not fits(queue, needs)
