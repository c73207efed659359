"""Why a job could never fit, word for word (planner/explain.py; the mutation run found these
unchecked: scripts/mutation planner, docs/mutation.md): only the needs no host could ever meet
are named, each at its exact boundary; the largest host is the one that comes closest; a host
without GPUs says why it has none."""

from __future__ import annotations

import pytest

from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.planner.allocate import MachineResources
from ssh_scheduler.planner.explain import explain_unfit
from tests.test_allocate import fleet, gpu, machine

HINT = " (no host has a usable GPU: use --no-gpu-required for CPU-only jobs)"


@pytest.mark.parametrize(
    ("needs", "line"),
    [
        (
            Needs(gpu_utilization=2.0),
            "needs GPU utilization 2 of each GPU, more than a whole GPU (ask for more GPUs per job instead)",
        ),
        # A whole GPU and the tolerance is not more than a whole GPU: the GPU count is what fails.
        (
            Needs(gpus=8, gpu_utilization=1.05),
            "needs 8 GPUs with 1000 MiB each; the largest host gpu2 has 4 GPUs with 24576 MiB",
        ),
        # Utilization is no need of a job without GPUs.
        (
            Needs(gpus=0, cpus=100, gpu_utilization=2.0),
            "needs 100 cpus; the largest host cpu1 has 64 cpus (80 with overload 1.25)",
        ),
        # Every need no host meets, in one line.
        (
            Needs(gpus=0, cpus=100, memory_mb=10**6),
            "needs 100 cpus, 1000000 MiB RAM; the largest host cpu1 has 64 cpus (80 with overload 1.25), "
            "512000 MiB RAM",
        ),
        # No GPU memory asked: none named.
        (Needs(gpus=8, gpu_memory_mb=0), "needs 8 GPUs; the largest host gpu2 has 4 GPUs with 24576 MiB"),
    ],
)
def test_the_line_names_every_need_no_host_meets(needs: Needs, line: str) -> None:
    assert explain_unfit(fleet(), needs) == line


def test_a_need_met_exactly_is_not_named() -> None:
    """8 cpus are 10 with the overload, 64000 MiB RAM, a GPU of exactly 30000 MiB: a job asking
    exactly these, and 11 cpus, is told about the CPUs alone."""
    m = machine("exact", cpus=8, mem_total=64000, gpus=(gpu(0, total=30000),))
    assert explain_unfit([m], Needs(cpus=11, memory_mb=64000, gpu_memory_mb=30000)) == (
        "needs 11 cpus; the largest host exact has 8 cpus (10 with overload 1.25)"
    )
    assert explain_unfit([m], Needs(cpus=10, memory_mb=64001, gpu_memory_mb=30000)) == (
        "needs 64001 MiB RAM; the largest host exact has 64000 MiB RAM"
    )
    mixed = machine("mix", gpus=(gpu(0, total=30000), gpu(1, total=24576)))
    assert explain_unfit([mixed], Needs(gpus=2, gpu_memory_mb=30000)) == (
        "needs 2 GPUs with 30000 MiB each; the largest host mix has 2 GPUs with 30000/24576 MiB (1 with enough memory)"
    )


@pytest.mark.parametrize(
    ("hosts", "largest"),
    [
        # Four GPUs of 50000 MiB are no closer to two of 90000 than two of 81559: more GPUs than
        # asked count for no more, and how big they are counts.
        ([("a-many", (50000,) * 4), ("b-big", (81559,) * 2)], "b-big"),
        # One GPU of 180000 MiB is half of two: more memory than asked counts for no more.
        ([("a-one", (180000,)), ("b-big", (81559,) * 2)], "b-big"),
    ],
)
def test_the_largest_host_is_the_one_that_comes_closest(hosts: list[tuple[str, tuple[int, ...]]], largest: str) -> None:
    machines = [machine(name, gpus=tuple(gpu(i, total=size) for i, size in enumerate(sizes))) for name, sizes in hosts]
    assert f"the largest host {largest} has" in explain_unfit(machines, Needs(gpus=2, gpu_memory_mb=90000))


def test_a_host_without_gpus_says_why_it_has_none() -> None:
    broken = machine("cpu2", gpu_error="nvidia-smi --query-gpu timed out")
    assert explain_unfit([broken], Needs()) == (
        "needs 1 GPU with 1000 MiB; the largest host cpu2 has no GPUs (nvidia-smi --query-gpu timed out)" + HINT
    )
    # Two hosts as close as each other: the first by name, which has no GPU and no error.
    assert explain_unfit([broken, machine("cpu1")], Needs()) == (
        "needs 1 GPU with 1000 MiB; the largest host cpu1 has no GPUs" + HINT
    )
    # A host with a GPU, too small: no hint.
    small: list[MachineResources] = [machine("g", gpus=(gpu(0, total=500),)), broken]
    assert explain_unfit(small, Needs()) == "needs 1 GPU with 1000 MiB; the largest host g has 1 GPU with 500 MiB"
