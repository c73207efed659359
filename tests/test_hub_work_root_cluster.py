"""Someone cleans a host (``rm -rf ~/.ssh_scheduler``) while the hub keeps its connection and a
spare agent: the next batch (or ``execute_remote``, which takes the kept agent as it is) still
sends its inputs into the host's cache, where its job finds them, with no host taken for lost and
no upload falling back to SFTP, on the same connection and agent.  On the SSH test cluster, through this test's own hub."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.batch import run_batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.remote import execute_remote
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from tests.cluster import Cluster
from tests.live_batch import wait_until
from tests.test_hub_cluster import (
    agents,
    held_state,
    hub,  # noqa: F401  (a fixture)
    machine_of,
    one_agent,
    one_batch,
    opens,
    remote_options,
)

FILES = 40


async def test_a_batch_after_the_work_root_was_removed_sends_its_inputs_into_a_new_one(
    cluster4: Cluster, hub: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    host = cluster4.hosts[1]
    machine = machine_of(host)
    before = opens(host)
    assert await one_batch(machine, tmp_path / "b1") == "batch\n"
    spare = one_agent(host)  # kept for the next batch, its work root open
    # Serving, not still starting: a root removed under an agent that is opening it ends that
    # agent (the batch then starts one, which is right too, but not what this test is about).
    # It works in its agents folder once its work root is open.
    wait_until(lambda: held_state(host.name)["agent"] is True, "the spare is kept")
    wait_until(lambda: host.run(f"readlink /proc/{spare}/cwd").stdout.strip().endswith("/agents"), "the spare serves")
    host.run("rm -rf ~/.ssh_scheduler", user=host.user, check=True)

    data = tmp_path / "data"
    data.mkdir()
    for i in range(FILES):
        (data / f"f{i:02d}.txt").write_text(f"input {i}\n")
    caplog.set_level(logging.INFO)
    summary = await run_batch(
        [Job("a", "cat data/*.txt | wc -l; echo $PPID", 1)], [machine],
        BatchOptions(needs=Needs(cpus=0.01, memory_mb=1, gpus=0, gpu_memory_mb=0), gpus_explicit=True,
                     copy_forwards=("data",), results_dir=tmp_path / "b2", base_dir=tmp_path, probe_interval=3600),
        out=None, err=None,
    )
    assert summary.outcomes["a"].ok
    lines, ppid = (tmp_path / "b2" / "a.out").read_text().split()
    assert int(lines) == FILES
    assert int(ppid) == spare  # the kept agent ran it, in its new root
    # Without the fix each upload into the removed cache failed, and every file went by SFTP.
    assert not [r.getMessage() for r in caplog.records if "goes by SFTP" in r.getMessage()]
    assert not [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert host.run("ls ~/.ssh_scheduler/cache | wc -l", user=host.user, check=True).stdout.split() == [str(FILES)]
    assert opens(host) - before == 1  # one SSH connection for both


async def test_execute_remote_on_a_kept_agent_whose_work_root_was_removed(
    cluster4: Cluster, hub: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    host = cluster4.hosts[2]
    machine = machine_of(host)
    options = remote_options(tmp_path, copy_forwards=("data",))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(FILES):
        (data / f"f{i:02d}.txt").write_text(f"input {i}\n")
    assert await execute_remote(machine, "true", remote_options(tmp_path), stdout=(), stderr=()) == 0
    [kept] = agents(host)  # the hub keeps it for the next command, which takes it as it is
    host.run("rm -rf ~/.ssh_scheduler", user=host.user, check=True)
    caplog.set_level(logging.INFO)
    command = f"test $(cat data/*.txt | wc -l) = {FILES} && test $PPID = {kept}"
    assert await execute_remote(machine, command, options, stdout=(), stderr=()) == 0
    assert not [r.getMessage() for r in caplog.records if "goes by SFTP" in r.getMessage()]
    assert host.run("ls ~/.ssh_scheduler/cache | wc -l", user=host.user, check=True).stdout.split() == [str(FILES)]
