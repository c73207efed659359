"""``probed``: the event a landed probe makes, field by field, and how it splits each GPU's memory
into ours (the processes of our running jobs, as our agent reported their pids) and everyone
else's.  The planner charges other users' memory from this split: a wrong ``ours_mb`` either
hides another user's memory (a job placed on a full GPU) or counts our own twice."""

from __future__ import annotations

from ssh_scheduler.events import GpuReading, HostProbed
from ssh_scheduler.machines.host_state import GpuProcess, GpuState, HostState, OwnUsage, probed

# Every number distinct, so that a field taken from the wrong place shows.
A = GpuState(0, "GPU-a", "A100", 40000, 9000, 31000, 0.25)
B = GpuState(1, "GPU-b", "A100", 40001, 8000, 32001, 0.5)
C = GpuState(3, "GPU-c", "A100", 40002, 7000, 33002, 0.75)


def state(*processes: GpuProcess) -> HostState:
    return HostState(
        cpu_count=12, load_1m=3.5, mem_total_mb=64000, mem_available_mb=50000, gpus=(A, B, C), gpu_processes=processes
    )


def test_a_probe_event_carries_the_host_its_cpus_load_memory_and_each_gpu() -> None:
    event = probed("node7", state())
    assert event == HostProbed(
        t=event.t,  # (when it was made)
        host="node7",
        cpus=12,
        load=3.5,
        memory_free_mb=50000,
        memory_total_mb=64000,
        gpus=(
            GpuReading(0, 9000, 40000, 0.25, 0),
            GpuReading(1, 8000, 40001, 0.5, 0),
            GpuReading(3, 7000, 40002, 0.75, 0),
        ),
    )


def test_our_share_of_a_gpu_is_the_memory_of_our_jobs_processes_there() -> None:
    processes = (
        GpuProcess(10, "GPU-a", 1000),  # job 1
        GpuProcess(11, "GPU-a", 500),  # job 1 again: summed
        GpuProcess(20, "GPU-a", 3000),  # another user's: not ours
        GpuProcess(12, "GPU-b", 2500),  # job 2
        GpuProcess(13, "GPU-gone", 4000),  # ours, on a GPU this probe does not list: no reading
    )
    own = {"job1": OwnUsage(frozenset({10, 11}), rss_mb=700), "job2": OwnUsage(frozenset({12, 13}))}
    event = probed("node7", state(*processes), own)
    # GPU-c has no process of ours (and none at all): 0, not a default of anything else.
    assert [g.ours_mb for g in event.gpus] == [1500, 2500, 0]
    assert [g.memory_used_mb for g in event.gpus] == [9000, 8000, 7000]


def test_without_our_agents_report_no_memory_is_ours() -> None:
    processes = (GpuProcess(10, "GPU-a", 1000), GpuProcess(12, "GPU-b", 2500))
    assert [g.ours_mb for g in probed("node7", state(*processes)).gpus] == [0, 0, 0]
    assert [g.ours_mb for g in probed("node7", state(*processes), {}).gpus] == [0, 0, 0]


def test_our_share_is_never_more_than_the_gpu_says_is_used() -> None:
    # The process list and memory.used are read at different moments: a process listed with
    # more than the card now reports in use (it freed memory between the two) counts as all of it.
    own = {"job": OwnUsage(frozenset({10, 11}))}
    event = probed("node7", state(GpuProcess(10, "GPU-b", 6000), GpuProcess(11, "GPU-b", 2001)), own)
    assert [g.ours_mb for g in event.gpus] == [0, 8000, 0]
    # Exactly what is used stays what it is.
    event = probed("node7", state(GpuProcess(10, "GPU-b", 6000), GpuProcess(11, "GPU-b", 2000)), own)
    assert [g.ours_mb for g in event.gpus] == [0, 8000, 0]
    event = probed("node7", state(GpuProcess(10, "GPU-b", 6000), GpuProcess(11, "GPU-b", 1999)), own)
    assert [g.ours_mb for g in event.gpus] == [0, 7999, 0]
