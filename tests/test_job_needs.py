"""Per-job needs and dependencies on --commands lines (pure parsing)."""

from __future__ import annotations

import pytest

from ssh_scheduler.errors import BatchError
from ssh_scheduler.jobs.batch_file import parse_batch
from ssh_scheduler.jobs.command_line import parse_command_line
from ssh_scheduler.jobs.needs import Needs, NeedsOverride


def test_line_sets_its_own_needs() -> None:
    line = parse_command_line(
        "--num-cpus 2.5 --memory-required 4000 --gpus-per-job 2 --gpu-memory-required 7000 "
        "--gpu-utilization 0.3 --no-reserve-gpu --job-name t 'python train.py'"
    )
    assert line.command == "python train.py"
    assert line.job_name == "t"
    assert line.needs == NeedsOverride(
        cpus=2.5, memory_mb=4000, gpus=2, gpu_memory_mb=7000, gpu_utilization=0.3, reserve_gpu=False
    )
    assert line.needs.apply(Needs()) == Needs(2.5, 4000, 2, 7000, 0.3, False, False)


def test_unset_needs_take_the_batch_values() -> None:
    base = Needs(cpus=4, memory_mb=100, gpus=1, gpu_memory_mb=9000)
    line = parse_command_line("--no-gpu-required 'make test'")
    assert line.needs.apply(base) == Needs(4, 100, 0, 0, 0.0, False, False)
    plain = parse_command_line("'make test'")
    assert plain.needs.empty and plain.needs.apply(base) == base
    assert parse_command_line("--reserve x").needs.apply(base).reserve_machine


def test_mixed_batch_keeps_each_lines_needs() -> None:
    jobs = parse_batch(
        b"--job-name gpu --gpus-per-job 1 --gpu-memory-required 7000 'python train.py'\n"
        b"--job-name cpu --no-gpu-required --num-cpus 1 'python prep.py'\n"
        b"--job-name eval --after gpu --after cpu 'python eval.py'\n",
        "b.sh",
        commands_mode=True,
    )
    assert [j.needs.gpus for j in jobs] == [1, 0, None]
    assert jobs[2].after == ("gpu", "cpu")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--num-cpus -1 x", "--num-cpus must be a finite number >= 0"),
        ("--gpus-per-job 1.5 x", "--gpus-per-job needs a whole number, not '1.5'"),
        ("--memory-required lots x", "--memory-required needs a whole number"),
        ("--gpu-utilization nan x", "--gpu-utilization must be a finite number"),
        ("--reserve=yes x", "--reserve takes no value"),
        ("--num-cpus 1 --num-cpus 2 x", "sets cpus again"),
        ("--no-gpu-required --gpus-per-job 2 x", "sets gpus again"),
        ("--gpus-per-job", "--gpus-per-job needs a value"),
        ("--after '../x' y", "job name"),
    ],
)
def test_bad_needs_are_one_line(line: str, message: str) -> None:
    with pytest.raises(BatchError) as caught:
        parse_command_line(line)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"--job-name a --after b x\n--job-name b --after a y\n", "in a circle ('a' -> 'b' -> 'a')"),
        (b"--job-name a --after a x\n", "in a circle ('a' -> 'a')"),
        (b"--after nobody x\n", "--after 'nobody' names no job of this batch"),
    ],
)
def test_dependencies_are_checked_before_anything_runs(data: bytes, message: str) -> None:
    with pytest.raises(BatchError) as caught:
        parse_batch(data, "b.sh", commands_mode=True)
    assert message in str(caught.value)
    assert str(caught.value).startswith("b.sh line ")


def test_long_dependency_chain_is_checked_without_recursion() -> None:
    lines = [b"--job-name j0 x"] + [f"--job-name j{i} --after j{i - 1} x".encode() for i in range(1, 5000)]
    jobs = parse_batch(b"\n".join(lines) + b"\n", "chain.sh", commands_mode=True)
    assert jobs[-1].after == ("j4998",)
