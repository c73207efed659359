"""execute_remote end to end on the SSH test cluster (issue 2's acceptance), through the real CLI,
plus the probe read from a simulated host against the real H100 captures."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ssh_scheduler.machines.config import load_machine
from ssh_scheduler.machines.probe import PROBE_COMMAND, parse_gpu_query, parse_probe_output
from ssh_scheduler.transport.ssh import connect
from tests.captures import capture
from tests.cluster import Cluster, GpuSpec, HostSpec

REPO = Path(__file__).resolve().parents[1]
EXECUTE_REMOTE = [sys.executable, "-m", "ssh_scheduler", "execute_remote"]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def remote(cwd: Path, machine: Path | str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EXECUTE_REMOTE, "--machine", str(machine), *args],
        cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout,
    )


def test_output_streams_live(cluster4: Cluster, tmp_path: Path) -> None:
    machine = cluster4.hosts[0].machine_file
    proc = subprocess.Popen(
        [*EXECUTE_REMOTE, "--machine", str(machine), "echo first; sleep 3; echo second"],
        cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first == "first\n"
    assert proc.poll() is None, "the first line only arrived after the command ended"
    rest, _ = proc.communicate(timeout=30)
    assert rest == "second\n"
    assert proc.returncode == 0


@pytest.mark.parametrize(
    ("command", "code"),
    [("true", 0), ("exit 3", 3), ("no_such_command_here", 127), ("kill -TERM $$", 143), ("kill -KILL $$", 137)],
)
def test_exit_codes_pass_through(cluster4: Cluster, tmp_path: Path, command: str, code: int) -> None:
    result = remote(tmp_path, cluster4.hosts[1].machine_file, command)
    assert result.returncode == code, result.stderr


def test_copy_forward_and_back(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "numbers.txt").write_text("1\n2\n3\n")
    (tmp_path / "job_results").mkdir()
    (tmp_path / "job_results" / "old").write_text("never sent")
    command = "test ! -e job_results && awk '{s+=$1} END {print s}' inputs/numbers.txt > sum.txt && mkdir -p out && echo x > out/x"
    result = remote(tmp_path, cluster4.hosts[0].machine_file, "--job-name", "adder", command)
    assert result.returncode == 0, result.stderr
    back = tmp_path / "job_results" / "adder"
    assert (back / "sum.txt").read_text() == "6\n"
    assert (back / "out" / "x").read_text() == "x\n"
    assert not (back / "inputs").exists()  # untouched inputs don't come back by default

    explicit = remote(
        tmp_path, cluster4.hosts[0].machine_file, "--job-name", "explicit",
        "--copy-backwards", "inputs", "--", "echo y > y.txt",
    )
    assert explicit.returncode == 0, explicit.stderr
    assert sorted(p.name for p in (tmp_path / "job_results" / "explicit").iterdir()) == ["inputs"]

    again = remote(tmp_path, cluster4.hosts[0].machine_file, "--job-name", "adder", "true")
    assert again.returncode != 0 and "already exists" in again.stderr
    assert (back / "sum.txt").read_text() == "6\n"


def test_wrong_key_is_refused_once_with_a_clear_message(cluster4: Cluster, tmp_path: Path) -> None:
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    spec = yaml.safe_load(cluster4.hosts[0].machine_file.read_text())
    spec["ssh_key_path"] = str(key)
    machine = tmp_path / "wrong.yaml"
    machine.write_text(yaml.safe_dump(spec))
    result = remote(tmp_path, machine, "touch should_not_run")
    assert result.returncode == 255
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "permission denied" in lines[0], result.stderr
    assert not (cluster4.hosts[0].home / ".ssh_scheduler" / "should_not_run").exists()


@pytest.mark.namespaces
def test_unreachable_host_fails_within_its_connect_timeout(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[2]
    spec = yaml.safe_load(host.machine_file.read_text())
    spec["connect_timeout"] = 2
    machine = tmp_path / "slow.yaml"
    machine.write_text(yaml.safe_dump(spec))
    host.cut_network()
    result = remote(tmp_path, machine, "true")
    assert result.returncode == 255
    assert "no answer within 2 s" in result.stderr  # it gave up by its own connect timeout

    host.heal_network()
    host.stop_sshd()
    refused = remote(tmp_path, machine, "true")
    assert refused.returncode == 255 and "refused" in refused.stderr.lower(), refused.stderr


def test_hosts_are_isolated(cluster4: Cluster, tmp_path: Path) -> None:
    h1, h2 = cluster4.hosts[:2]
    assert remote(tmp_path, h1.machine_file, "echo secret > ~/isolation.txt").returncode == 0
    assert (h1.home / "isolation.txt").exists()
    check = remote(tmp_path, h2.machine_file, "test -e ~/isolation.txt || ls /work 2>&1 | head -1")
    assert check.returncode == 0
    assert not (h2.home / "isolation.txt").exists()


def test_probe_reads_the_simulated_h100_like_the_real_capture(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    real = parse_gpu_query(capture("nvsmi_csv_nounits_busy.txt")[1])[0]
    cluster = make_cluster([HostSpec(gpus=[GpuSpec(name=real.name, memory_mb=real.memory_total_mb, uuid=real.uuid)])])
    host = cluster.hosts[0]
    hold = host.hold_gpu(0, 21482, util=100)

    async def probe() -> str:
        transport = await connect(load_machine(str(host.machine_file)))
        try:
            return (await transport.exec(PROBE_COMMAND)).stdout.decode()
        finally:
            await transport.close()

    try:
        state = parse_probe_output(asyncio.run(probe()))
    finally:
        hold.release()
    simulated = state.gpus[0]
    assert (simulated.index, simulated.uuid, simulated.name) == (real.index, real.uuid, real.name)
    assert simulated.memory_total_mb == real.memory_total_mb
    assert simulated.utilization == real.utilization == 1.0
    # The real card adds a few MiB of context overhead to memory.used; the simulation does not.
    assert abs(simulated.memory_used_mb - real.memory_used_mb) < 16
    assert [(p.gpu_uuid, p.used_memory_mb) for p in state.gpu_processes] == [(real.uuid, 21482)]
    assert state.cpu_count == 4 and state.mem_available_mb == 12000
