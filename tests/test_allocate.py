from __future__ import annotations

import math
from collections import deque

import pytest

from ssh_scheduler.errors import ConfigError, SchedulerError
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.host_state import GpuProcess, GpuState, HostState, OwnUsage
from ssh_scheduler.planner.allocate import MachineResources, choose, max_concurrent
from ssh_scheduler.planner.explain import explain_unfit
from ssh_scheduler.planner.placement import NoFit, Placement

CPU_ONLY = Needs(gpus=0)
SHARED = Needs(reserve_gpu=False)


def gpu(
    index: int, *, total: int = 16000, free: int | None = None, util: float = 0.0, uuid: str = ""
) -> GpuState:
    free = total if free is None else free
    return GpuState(index, uuid or f"GPU-{index}", "Test GPU", total, total - free, free, util)


def host(
    *,
    cpus: int = 8,
    load: float = 0.0,
    mem_total: int = 64000,
    mem_available: int | None = None,
    gpus: tuple[GpuState, ...] = (),
    processes: tuple[GpuProcess, ...] = (),
    gpu_error: str | None = None,
) -> HostState:
    return HostState(
        cpu_count=cpus,
        load_1m=load,
        mem_total_mb=mem_total,
        mem_available_mb=mem_total if mem_available is None else mem_available,
        gpus=gpus,
        gpu_processes=processes,
        gpu_error=gpu_error,
    )


def machine(name: str = "m", **kwargs: object) -> MachineResources:
    return MachineResources(name, host(**kwargs))  # type: ignore[arg-type]


def fits(m: MachineResources, needs: Needs) -> bool:
    return m.score(needs) > -math.inf


# ---------------------------------------------------------------- reservation


@pytest.mark.parametrize(
    ("state", "needs"),
    [
        # RAM: 3000 MiB free, two jobs of 2000.
        (host(mem_available=3000), Needs(gpus=0, memory_mb=2000)),
        # CPUs: 8 * 1.25 = 10, two jobs of 6.
        (host(), Needs(gpus=0, cpus=6)),
        # GPU memory: one shared GPU with 16000 MiB, two jobs of 10000.
        (host(gpus=(gpu(0),)), Needs(gpu_memory_mb=10000, reserve_gpu=False)),
        # GPU utilization: two jobs of 0.6 on one shared GPU.
        (host(gpus=(gpu(0),)), Needs(gpu_utilization=0.6, reserve_gpu=False)),
        # Reserved GPU: one GPU, two jobs.
        (host(gpus=(gpu(0),)), Needs()),
    ],
)
def test_race_two_jobs_that_fit_alone_do_not_fit_together(state: HostState, needs: Needs) -> None:
    m = MachineResources("m", state)
    assert fits(m, needs)
    m.allocate("a", needs)
    assert not fits(m, needs)
    with pytest.raises(NoFit, match="b does not fit on m now"):
        m.allocate("b", needs)
    m.release("a")
    assert m.allocate("b", needs).job_id == "b"


def test_release_restores_exactly_and_is_idempotent() -> None:
    m = machine(load=1.5, mem_available=50000, gpus=(gpu(0), gpu(1)))
    before = (m.free_cpus, m.free_memory_mb, m.gpu_free_memory_mb)
    needs = Needs(cpus=0.1, memory_mb=1234, gpus=2, gpu_memory_mb=333, gpu_utilization=0.3)
    for job in ("a", "b", "c"):
        m.allocate(job, replace_reserve(needs))
    assert m.free_memory_mb == 50000 - 3 * 1234
    assert m.gpu_free_memory_mb == (16000 - 999, 16000 - 999)
    for job in ("b", "a", "c", "c", "unknown"):
        m.release(job)
    assert (m.free_cpus, m.free_memory_mb, m.gpu_free_memory_mb) == before
    assert m.running == {}


def replace_reserve(needs: Needs) -> Needs:
    return Needs(
        cpus=needs.cpus,
        memory_mb=needs.memory_mb,
        gpus=needs.gpus,
        gpu_memory_mb=needs.gpu_memory_mb,
        gpu_utilization=needs.gpu_utilization,
        reserve_gpu=False,
    )


def test_placement_and_running_view() -> None:
    m = machine(gpus=(gpu(0, uuid="GPU-aa"), gpu(1, uuid="GPU-bb")))
    placement = m.allocate("job1", Needs())
    assert placement == Placement("m", "job1", (0,), Needs(), ("GPU-aa",))
    assert dict(m.running) == {"job1": placement}
    with pytest.raises(TypeError):
        m.running["x"] = placement  # type: ignore[index]
    with pytest.raises(ValueError, match="already holds"):
        m.allocate("job1", Needs())


def test_nofit_is_not_a_scheduler_error() -> None:
    assert issubclass(NoFit, Exception) and not issubclass(NoFit, SchedulerError)


@pytest.mark.parametrize(
    ("state", "needs", "reason"),
    [
        (host(mem_available=500), CPU_ONLY, "needs 1000 MiB RAM, 500 MiB free"),
        (host(load=9.5), Needs(gpus=0, cpus=4), "needs 4 cpus, 3.00 free"),
        (host(), Needs(), "never could: needs 1 GPU with 1000 MiB"),
        (
            host(gpus=(gpu(0, free=500), gpu(1))),
            Needs(gpu_memory_mb=1000, gpus=2),
            "GPUs 0: 500 MiB free, 1: fits",
        ),
    ],
)
def test_nofit_says_why(state: HostState, needs: Needs, reason: str) -> None:
    with pytest.raises(NoFit) as info:
        MachineResources("m", state).allocate("j", needs)
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- other users and our own use


def test_other_users_gpu_memory_is_never_free_and_blocks_reserving_jobs() -> None:
    # The busy H100 capture: another user's pid 618 holds 21482 MiB at 100 %.
    busy = gpu(0, total=81559, free=59589, util=1.0, uuid="GPU-7f24")
    state = host(gpus=(busy,), processes=(GpuProcess(618, "GPU-7f24", 21482),))
    m = MachineResources("h100", state)
    assert not fits(m, Needs())  # reserve_gpu: never a GPU someone else is on
    assert not fits(m, Needs(reserve_gpu=False, gpu_memory_mb=60000))
    assert fits(m, Needs(reserve_gpu=False, gpu_memory_mb=59589))
    # Their 100 % leaves no utilization to ask for (beyond the tolerance).
    assert not fits(m, Needs(reserve_gpu=False, gpu_utilization=0.1))
    assert fits(m, Needs(reserve_gpu=False, gpu_utilization=0.05))
    # Telling the machine pid 618 is ours changes the picture.
    m.update(state, {"old": OwnUsage(frozenset({618}))})
    assert fits(m, Needs())
    assert fits(m, Needs(reserve_gpu=False, gpu_utilization=1.0))


def test_reserving_job_takes_the_gpu_nobody_else_uses() -> None:
    state = host(
        gpus=(gpu(0, free=15000), gpu(1, free=15000)), processes=(GpuProcess(7, "GPU-0", 1000),)
    )
    m = MachineResources("m", state)
    assert m.allocate("a", Needs()).gpu_indices == (1,)
    assert not fits(m, Needs())
    # Sharing jobs may use the GPU someone else is on, but never the one we reserved.
    assert {m.allocate(f"s{n}", SHARED).gpu_indices for n in range(5)} == {(0,)}


@pytest.mark.parametrize(
    ("reserved", "observed", "counted"),
    [(3000, 5000, 5000), (3000, 1000, 3000), (3000, 0, 3000), (3000, 3000, 3000)],
)
def test_own_use_is_counted_once(reserved: int, observed: int, counted: int) -> None:
    needs = Needs(memory_mb=reserved, gpu_memory_mb=reserved)
    m = machine(mem_available=64000, gpus=(gpu(0),))
    m.allocate("job", needs)
    assert m.free_memory_mb == 64000 - reserved
    assert m.gpu_free_memory_mb == (16000 - reserved,)
    # Re-probe while the job runs: its use is already missing from MemAvailable / memory.free.
    state = host(
        mem_available=64000 - observed,
        gpus=(gpu(0, free=16000 - observed),),
        processes=(GpuProcess(4242, "GPU-0", observed),) if observed else (),
    )
    m.update(state, {"job": OwnUsage(frozenset({4242}), rss_mb=observed)})
    assert m.free_memory_mb == 64000 - counted
    assert m.gpu_free_memory_mb == (16000 - counted,)
    # Not held by another user: the job is ours.
    assert "other users" not in m.capacity_summary()
    m.release("job")
    # Until the next probe the finished job's real use still looks taken: conservative.
    assert m.free_memory_mb == 64000 - observed
    assert m.gpu_free_memory_mb == (16000 - observed,)


def test_job_unknown_to_the_agent_counts_as_its_reservation_on_top() -> None:
    m = machine(mem_available=64000)
    m.allocate("job", Needs(gpus=0, memory_mb=3000))
    m.update(host(mem_available=60000))  # it uses 4000 but nobody told us its pids
    assert m.free_memory_mb == 57000


def test_own_process_on_a_gpu_the_job_was_not_given_stays_used() -> None:
    m = machine(gpus=(gpu(0), gpu(1)))
    assert m.allocate("job", Needs(gpu_memory_mb=1000)).gpu_indices == (0,)
    state = host(
        gpus=(gpu(0, free=15000), gpu(1, free=14000)),
        processes=(GpuProcess(5, "GPU-0", 1000), GpuProcess(5, "GPU-1", 2000)),
    )
    m.update(state, {"job": OwnUsage(frozenset({5}))})
    assert m.gpu_free_memory_mb == (15000, 14000)
    assert fits(m, Needs())  # our stray process does not make GPU 1 "another user's"


def test_update_keeps_placements_by_uuid() -> None:
    m = machine(gpus=(gpu(0, uuid="GPU-a"), gpu(1, uuid="GPU-b")))
    m.allocate("job", Needs(gpu_memory_mb=4000))
    # The next probe lists the GPUs in another order (or renumbered).
    m.update(host(gpus=(gpu(0, uuid="GPU-b"), gpu(1, uuid="GPU-a"))))
    assert m.gpu_free_memory_mb == (16000, 12000)
    assert m.allocate("next", Needs()).gpu_indices == (0,)


# ---------------------------------------------------------------- CPUs and utilization


@pytest.mark.parametrize(
    ("load", "cpus", "count"),
    [
        (0.0, 1.0, 10),  # 8 cpus * 1.25
        (4.0, 1.0, 6),
        (4.0, 4.0, 1),
        (12.0, 1.0, 3),  # others overload the host: their share is capped at cpus - 1
        (12.0, 4.0, 0),  # ... so only small jobs still fit
        (12.0, 0.0, 1024),  # a job that needs no CPU still fits (capped count)
        (0.0, 0.5, 20),
    ],
)
def test_cpu_capacity(load: float, cpus: float, count: int) -> None:
    m = machine(cpus=8, load=load, mem_total=10**9)
    assert max_concurrent(m, Needs(gpus=0, cpus=cpus, memory_mb=0)) == count


def test_load_of_our_own_jobs_is_not_counted_twice() -> None:
    m = machine(cpus=8)
    for job in ("a", "b"):
        m.allocate(job, Needs(gpus=0, cpus=2))
    assert m.free_cpus == 6
    m.update(host(cpus=8, load=4.0))  # the load is our two jobs
    assert m.free_cpus == 6
    m.update(host(cpus=8, load=7.0))  # 3 more from someone else
    assert m.free_cpus == 3


def test_cpu_overload_is_configurable() -> None:
    m = MachineResources("m", host(cpus=8), cpu_overload=1.0)
    assert max_concurrent(m, Needs(gpus=0, cpus=1, memory_mb=0)) == 8
    with pytest.raises(ConfigError):
        MachineResources("m", host(), cpu_overload=0)


@pytest.mark.parametrize(
    ("processes", "util", "reserved", "asked", "expected"),
    [
        # Another user's process makes the probed utilization theirs.
        ((GpuProcess(9, "GPU-0", 100),), 0.6, (), 0.5, False),
        ((GpuProcess(9, "GPU-0", 100),), 0.6, (), 0.4, True),
        ((GpuProcess(9, "GPU-0", 100),), 0.6, (), 0.45, True),  # within the 0.05 tolerance
        # No other process: the utilization is ours and already reserved.
        ((), 0.6, (0.5,), 0.5, True),
        ((), 0.6, (0.5,), 0.56, False),
        ((), 0.0, (0.5, 0.5), 0.05, True),
        ((), 0.0, (0.5, 0.5), 0.06, False),
        # A job asking no utilization is never blocked by it.
        ((GpuProcess(9, "GPU-0", 100),), 1.0, (0.5,), 0.0, True),
    ],
)
def test_gpu_utilization(
    processes: tuple[GpuProcess, ...],
    util: float,
    reserved: tuple[float, ...],
    asked: float,
    expected: bool,
) -> None:
    m = machine(gpus=(gpu(0),))
    for n, u in enumerate(reserved):
        m.allocate(f"ours{n}", Needs(gpu_utilization=u, reserve_gpu=False))
    m.update(host(gpus=(gpu(0, util=util),), processes=processes))
    assert fits(m, Needs(gpu_utilization=asked, reserve_gpu=False)) is expected


# ---------------------------------------------------------------- GPU choice


def test_mixed_gpu_sizes_are_compared_in_mib() -> None:
    m = machine(gpus=(gpu(0, total=24576), gpu(1, total=81559)))
    assert m.allocate("big", Needs(gpu_memory_mb=30000)).gpu_indices == (1,)
    other = machine(gpus=(gpu(0, total=24576), gpu(1, total=81559)))
    assert not fits(other, Needs(gpu_memory_mb=90000))
    assert other.could_ever_fit(Needs(gpu_memory_mb=30000))


def test_multi_gpu_jobs_get_distinct_gpus() -> None:
    m = machine(gpus=tuple(gpu(i) for i in range(4)))
    two = Needs(gpus=2)
    first = m.allocate("a", two).gpu_indices
    second = m.allocate("b", two).gpu_indices
    assert len(set(first)) == len(set(second)) == 2
    assert sorted(first + second) == [0, 1, 2, 3]
    assert not fits(m, two)
    m.release("a")
    assert m.allocate("c", two).gpu_indices == first


def test_multi_gpu_job_needs_every_gpu_to_qualify() -> None:
    m = machine(gpus=(gpu(0, free=20000, total=24000), gpu(1, free=5000), gpu(2)))
    placement = m.allocate("a", Needs(gpus=2, gpu_memory_mb=10000))
    assert placement.gpu_indices == (0, 2)
    assert not fits(m, Needs(gpus=1, gpu_memory_mb=10000))
    assert not m.could_ever_fit(Needs(gpus=4))


def test_exactly_two_jobs_fit_per_gpu() -> None:
    m = machine(cpus=64, mem_total=10**6, gpus=(gpu(0, total=16000), gpu(1, total=16000)))
    needs = Needs(gpu_memory_mb=8000, reserve_gpu=False)
    assert max_concurrent(m, needs) == 4
    placed = [m.allocate(f"j{n}", needs).gpu_indices for n in range(4)]
    assert sorted(placed) == [(0,), (0,), (1,), (1,)]
    assert not fits(m, needs)
    assert max_concurrent(m, needs) == 0


def test_jobs_spread_evenly_over_hosts_and_gpus() -> None:
    for needs in (Needs(), SHARED):
        machines = [machine(name, gpus=(gpu(0), gpu(1))) for name in ("b", "a")]
        used = []
        for n in range(4):
            target = choose(machines, needs)
            assert target is not None
            used.append((target.name, *target.allocate(f"j{n}", needs).gpu_indices))
        assert used == [("a", 0), ("b", 0), ("a", 1), ("b", 1)], needs


def test_gpus_fill_evenly_on_a_big_host() -> None:
    m = machine(cpus=64, mem_total=10**6, gpus=tuple(gpu(i, total=81559) for i in range(8)))
    counts = [0] * 8
    for n in range(24):
        (index,) = m.allocate(f"j{n}", SHARED).gpu_indices
        counts[index] += 1
    assert counts == [3] * 8


def test_choose_prefers_headroom_and_breaks_ties_by_name() -> None:
    idle = machine("z", gpus=(gpu(0),))
    loaded = machine("a", load=6.0, gpus=(gpu(0),))
    assert choose([loaded, idle], Needs()) is idle
    twins = [machine(name, gpus=(gpu(0),)) for name in ("c", "b", "d")]
    assert choose(twins, Needs()) is twins[1]
    assert choose(list(reversed(twins)), Needs()) is twins[1]
    assert choose([], Needs()) is None
    assert choose([machine("cpu")], Needs()) is None


def test_no_gpu_jobs_ignore_gpus() -> None:
    m = machine("cpu", gpu_error="nvidia-smi --query-gpu failed (exit 9): NVML")
    assert m.allocate("a", CPU_ONLY).gpu_indices == ()
    assert not fits(m, Needs())
    assert not m.could_ever_fit(Needs())
    assert "no GPUs (nvidia-smi --query-gpu failed" in m.capacity_summary()


def test_gpu_with_unknown_memory_only_takes_jobs_needing_none() -> None:
    m = machine(gpus=(GpuState(0, "GPU-0", "GH200", 0, 0, 0, 0.0),))
    assert not fits(m, Needs())
    assert fits(m, Needs(gpu_memory_mb=0))


# ---------------------------------------------------------------- reserve_machine


def test_reserve_machine_runs_alone() -> None:
    m = machine(gpus=(gpu(0), gpu(1), gpu(2)))
    whole = Needs(reserve_machine=True)
    m.allocate("small", Needs())
    assert not fits(m, whole)
    m.release("small")
    placement = m.allocate("whole", whole)
    assert placement.gpu_indices == (0, 1, 2)
    for needs in (Needs(), CPU_ONLY, whole, Needs(gpus=0, cpus=0, memory_mb=0)):
        assert not fits(m, needs)
    with pytest.raises(NoFit, match="reserved by whole"):
        m.allocate("x", CPU_ONLY)
    assert "reserved by whole" in m.capacity_summary()
    m.release("whole")
    assert fits(m, Needs())


def test_reserve_machine_ignores_current_use_but_not_totals() -> None:
    busy = machine(load=20.0, mem_available=10, gpus=(gpu(0, free=0),))
    assert busy.allocate("w", Needs(reserve_machine=True)).gpu_indices == (0,)
    cpu_job = Needs(reserve_machine=True, gpus=0)
    assert machine(gpus=(gpu(0),)).allocate("w", cpu_job).gpu_indices == ()
    assert not fits(machine(), Needs(reserve_machine=True))  # no GPU at all
    assert not fits(machine(mem_total=500), Needs(reserve_machine=True, gpus=0))


# ---------------------------------------------------------------- could_ever_fit / explain_unfit


@pytest.mark.parametrize(
    ("needs", "expected"),
    [
        (Needs(gpus=0, cpus=10), True),  # 8 * 1.25
        (Needs(gpus=0, cpus=10.5), False),
        (Needs(gpus=0, memory_mb=64000), True),
        (Needs(gpus=0, memory_mb=64001), False),
        (Needs(gpus=2, gpu_memory_mb=81559), True),
        (Needs(gpus=2, gpu_memory_mb=81560), False),
        (Needs(gpus=3), False),
        (Needs(gpu_utilization=1.0), True),
        (Needs(gpu_utilization=1.5), False),
        (Needs(gpus=0, gpu_utilization=1.5), True),
    ],
)
def test_could_ever_fit_uses_totals(needs: Needs, expected: bool) -> None:
    # Fully used right now, by us and by others: could_ever_fit looks at totals only.
    state = host(
        load=50.0,
        mem_available=0,
        gpus=(gpu(0, total=81559, free=0), gpu(1, total=81559, free=0)),
        processes=(GpuProcess(1, "GPU-0", 81559),),
    )
    assert MachineResources("m", state).could_ever_fit(needs) is expected


def fleet() -> list[MachineResources]:
    return [
        machine("gpu2", cpus=8, mem_total=32000, gpus=tuple(gpu(i, total=24576) for i in range(4))),
        machine("gpu1", cpus=16, mem_total=128887, gpus=(gpu(0, total=81559), gpu(1, total=81559))),
        machine("cpu1", cpus=64, mem_total=512000),
    ]


@pytest.mark.parametrize(
    ("needs", "line"),
    [
        (
            Needs(gpus=2, gpu_memory_mb=90000),
            "needs 2 GPUs with 90000 MiB each; the largest host gpu1 has 2 GPUs with 81559 MiB",
        ),
        (
            Needs(gpus=8),
            "needs 8 GPUs with 1000 MiB each; the largest host gpu2 has 4 GPUs with 24576 MiB",
        ),
        (
            Needs(gpus=0, cpus=100),
            "needs 100 cpus; the largest host cpu1 has 64 cpus (80 with overload 1.25)",
        ),
        (
            Needs(gpus=0, memory_mb=10**6),
            "needs 1000000 MiB RAM; the largest host cpu1 has 512000 MiB RAM",
        ),
        (
            Needs(memory_mb=200000),
            "needs 200000 MiB RAM; the largest host gpu1 has 128887 MiB RAM",
        ),
        (Needs(gpu_utilization=2.0), "more than a whole GPU"),
        (Needs(gpus=0), "cpu1 could fit it once it has room"),
    ],
)
def test_explain_unfit(needs: Needs, line: str) -> None:
    machines = fleet()
    explained = explain_unfit(machines, needs)
    assert explained == line or (line.startswith("more") and line in explained)
    assert "\n" not in explained


def test_explain_unfit_on_cpu_only_fleet_hints_at_no_gpu() -> None:
    machines = [machine("cpu1"), machine("cpu2", gpu_error="nvidia-smi --query-gpu timed out")]
    assert not any(m.could_ever_fit(Needs()) for m in machines)
    line = explain_unfit(machines, Needs())
    assert line.startswith("needs 1 GPU with 1000 MiB; the largest host cpu1 has no GPUs")
    assert "--no-gpu-required" in line
    assert explain_unfit([], Needs()) == "there are no machines to run on"


def test_explain_unfit_mixed_gpu_sizes() -> None:
    m = machine("mix", gpus=(gpu(0, total=81559), gpu(1, total=24576), gpu(2, total=24576)))
    assert explain_unfit([m], Needs(gpus=2, gpu_memory_mb=30000)) == (
        "needs 2 GPUs with 30000 MiB each; "
        "the largest host mix has 3 GPUs with 81559/24576 MiB (1 with enough memory)"
    )


# ---------------------------------------------------------------- summaries and limits


def test_capacity_summary() -> None:
    state = host(
        cpus=16,
        load=0.52,
        mem_total=128887,
        mem_available=128398,
        gpus=(gpu(0, total=81559, free=81079), gpu(1, total=81559, free=59589)),
        processes=(GpuProcess(618, "GPU-1", 21482),),
    )
    m = MachineResources("h", state)
    assert m.capacity_summary() == (
        "16 cpus (load 0.52), 128398/128887 MiB free, "
        "GPUs 0:81079/81559 MiB 1:59589/81559 MiB (other users)"
    )
    m.allocate("j", Needs(memory_mb=398, gpu_memory_mb=1079))
    assert "128000/128887 MiB free, GPUs 0:80000/81559 MiB" in m.capacity_summary()
    assert machine("c").capacity_summary().endswith("no GPUs")


@pytest.mark.parametrize(
    ("state", "needs", "count"),
    [
        # The ancestor's example: 2 GPUs, reserved by default -> 2 at a time.
        (host(cpus=16, gpus=(gpu(0), gpu(1))), Needs(memory_mb=2000), 2),
        (host(cpus=16, gpus=(gpu(0), gpu(1))), Needs(gpus=0, memory_mb=2000), 20),
        (host(mem_total=5000), Needs(gpus=0, memory_mb=2000), 2),
        (host(gpus=(gpu(0),) * 4), Needs(reserve_machine=True), 1),
        (host(gpus=(gpu(0), gpu(1), gpu(2))), Needs(gpus=2), 1),
        (host(), Needs(), 0),
    ],
)
def test_max_concurrent(state: HostState, needs: Needs, count: int) -> None:
    m = MachineResources("m", state)
    before = (m.free_cpus, m.free_memory_mb, m.gpu_free_memory_mb, dict(m.running))
    assert max_concurrent(m, needs) == count
    assert (m.free_cpus, m.free_memory_mb, m.gpu_free_memory_mb, dict(m.running)) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cpus": -1.0},
        {"cpus": math.nan},
        {"memory_mb": -1},
        {"gpus": -1},
        {"gpu_memory_mb": 1.5},
        {"gpu_utilization": -0.1},
        {"gpu_utilization": math.inf},
    ],
)
def test_needs_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Needs(**kwargs)  # type: ignore[arg-type]


def test_score_cache_follows_state_changes() -> None:
    m = machine(gpus=(gpu(0),))
    needs = Needs()
    first = m.score(needs)
    assert m.score(needs) == first
    m.allocate("a", needs)
    assert m.score(needs) == -math.inf
    m.release("a")
    assert m.score(needs) == first
    m.update(host(gpus=(gpu(0),), processes=(GpuProcess(3, "GPU-0", 10),)))
    assert m.score(needs) == -math.inf
    assert m.score(Needs(reserve_gpu=False)) > -math.inf


def test_hundred_thousand_allocate_release_cycles() -> None:
    """The dry-run plan's shape: 100,000 jobs over 64 hosts x 8 GPUs, each placed with
    choose + allocate, the oldest released whenever nothing fits.  No timing assertion: this
    proves the bookkeeping holds up (and stays cheap enough to run in the test suite)."""
    gpus = tuple(gpu(i, total=81559) for i in range(8))
    machines = [
        MachineResources(f"gpu{n:02d}", host(cpus=64, mem_total=512000, gpus=gpus))
        for n in range(64)
    ]
    needs = Needs()
    running: deque[tuple[MachineResources, str]] = deque()
    per_host = dict.fromkeys((m.name for m in machines), 0)
    for n in range(100_000):
        while (target := choose(machines, needs)) is None:
            done_on, done_job = running.popleft()
            done_on.release(done_job)
        target.allocate(f"job{n}", needs)
        running.append((target, f"job{n}"))
        per_host[target.name] += 1
    assert len(running) == 64 * 8
    assert set(per_host.values()) <= {1562, 1563}  # 100000 / 64, spread evenly
    for m, job in running:
        m.release(job)
    assert all(m.running == {} and m.free_memory_mb == 512000 for m in machines)


def test_update_falls_back_to_indices_when_uuids_are_not_unique() -> None:
    same = (gpu(0, uuid="[N/A]"), gpu(1, uuid="[N/A]"))
    m = machine(gpus=same)
    m.allocate("a", Needs(gpu_memory_mb=4000))
    m.update(host(gpus=same))
    assert m.gpu_free_memory_mb == (12000, 16000)


def test_jobs_that_need_nothing_measurable_spread_over_hosts() -> None:
    machines = [MachineResources(name, host(cpus=4)) for name in ("a", "b", "c", "d")]
    free = Needs(gpus=0, cpus=0, memory_mb=0)
    for n in range(8):
        target = choose(machines, free)
        assert target is not None
        target.allocate(f"j{n}", free)
    assert sorted(len(m.running) for m in machines) == [2, 2, 2, 2]
