"""Tests of the SSH test cluster itself (tests/cluster)."""

from __future__ import annotations

import os
import pwd
import re
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import asyncssh
import pytest
import yaml

from tests.captures import capture
from tests.cluster import (
    ClusterError,
    GpuSpec,
    HostSpec,
    Unsupported,
    cleanup_leftovers,
    skip_or_fail,
)
from tests.cluster._impl import _cleanup, _global_lock

REPO = Path(__file__).resolve().parents[1]
FAKE_SMI = REPO / "tests" / "cluster" / "fake_nvidia_smi.py"
GPU_HOLD = REPO / "tests" / "cluster" / "gpu_hold.py"
CAPTURE_UUID = "GPU-7f24e6cb-4b33-6b85-55fd-4c3170fa56d0"
CSV_FIELDS = (
    "index,uuid,name,memory.total,memory.used,memory.free,utilization.gpu,"
    "utilization.memory,temperature.gpu,power.draw,pstate,compute_mode"
)
APPS_QUERY = (
    "nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv; "
    "nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits"
)


def fixture(name: str) -> tuple[str, str]:
    """(command, output) of a real H100 capture."""
    command, output, _ = capture(name)
    return command, output


def connect_result(ip: str, port: int = 22, timeout: float = 1.0) -> str:
    """'banner' | 'no-banner' | 'timeout' | 'refused'."""
    try:
        sock = socket.create_connection((ip, port), timeout=timeout)
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    with sock:
        sock.settimeout(timeout)
        try:
            data = sock.recv(64)
        except TimeoutError:
            return "no-banner"
    return "banner" if data.startswith(b"SSH-2.0-") else f"other:{data!r}"


def start_session(host, cmd: str) -> subprocess.Popen[str]:
    """An ssh session running ``cmd``, returned once the remote side is running it."""
    proc = subprocess.Popen(
        host.ssh_argv(f"echo started; {cmd}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "started\n"
    return proc


def handshake_rtt_us(ip: str, port: int = 22) -> int:
    """The round-trip time the kernel measured on a TCP handshake with the host (``tcpi_rtt``
    of ``TCP_INFO``, in microseconds): the network's own account of a delay, not this process's
    clock."""
    with socket.create_connection((ip, port), timeout=10) as sock:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    # struct tcp_info: 8 single bytes, then 32-bit fields; tcpi_rtt is the 16th of those.
    return int(struct.unpack_from("I", info, 8 + 15 * 4)[0])


# --------------------------------------------------------------------------- fake nvidia-smi (local)


@pytest.fixture
def smi_state(tmp_path: Path) -> Path:
    state = tmp_path / "gpu"
    (state / "procs").mkdir(parents=True)
    (state / "lock").write_text("")
    (state / "gpus").write_text(f"0\t{CAPTURE_UUID}\t81559\t480\tNVIDIA H100 80GB HBM3\n")
    return state


def smi(state: Path, cmd: str) -> subprocess.CompletedProcess[str]:
    """Run a capture's shell command with the fake nvidia-smi first on PATH."""
    bindir = state.parent / "bin"
    bindir.mkdir(exist_ok=True)
    for name, src in (("nvidia-smi", FAKE_SMI), ("gpu_hold", GPU_HOLD)):
        link = bindir / name
        if not link.exists():
            link.symlink_to(src)
    env = dict(os.environ, FAKE_NVSMI_STATE=str(state), PATH=f"{bindir}:{os.environ['PATH']}")
    return subprocess.run(
        ["bash", "-c", cmd],
        capture_output=True,
        text=True,
        env=env,
        cwd=state.parent,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    "name",
    [
        "nvsmi_csv_idle.txt",
        "nvsmi_csv_nounits_idle.txt",
        "nvsmi_apps_idle.txt",
        "nvsmi_csv_nounits_after.txt",
        "nvsmi_apps_after.txt",
        "bad_query.txt",
    ],
)
def test_fake_smi_idle_matches_capture_bytes(smi_state: Path, name: str) -> None:
    cmd, expected = fixture(name)
    out = smi(smi_state, cmd)
    assert out.stdout + out.stderr == expected
    assert out.returncode == capture(name)[2]


def test_fake_smi_plain_table_idle_shape(smi_state: Path) -> None:
    cmd, expected = fixture("nvsmi_plain_idle.txt")
    got = smi(smi_state, cmd).stdout.splitlines()
    want = expected.splitlines()
    assert len(got) == len(want)
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}       ", got[0])
    assert got[1:] == want[1:]  # power 72 W idle, like the capture


def test_fake_smi_list_and_version(smi_state: Path) -> None:
    _, host = fixture("host.txt")
    out = smi(smi_state, "nvidia-smi --version; nvidia-smi -L").stdout
    assert out in host
    assert (
        smi(smi_state, "nvidia-smi -L -i 0").stdout
        == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {CAPTURE_UUID})\n"
    )
    bad = smi(smi_state, "nvidia-smi --query-compute-apps=pid,bogus --format=csv")
    assert (bad.returncode, bad.stdout) == (2, 'Field "bogus" is not a valid field to query.\n\n')


def test_fake_smi_busy_matches_capture(smi_state: Path) -> None:
    """Hold 21482 MiB at 100 % like the capture: identical except the PID and the 9 MiB
    context overhead the real driver adds to memory.used (we report the holders' sum)."""
    with subprocess.Popen(
        [
            sys.executable,
            str(GPU_HOLD),
            "--mb",
            "21482",
            "--util",
            "100",
            "--name",
            "python3",
            "--ready",
        ],
        env=dict(os.environ, FAKE_NVSMI_STATE=str(smi_state)),
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout is not None
            pid = int(holder.stdout.readline().split()[1])
            cmd, expected = fixture("nvsmi_csv_busy.txt")
            got = smi(smi_state, cmd).stdout
            want = expected.replace("21491 MiB, 59589 MiB", "21482 MiB, 59597 MiB")
            assert got == want
            cmd, expected = fixture("nvsmi_apps_busy.txt")
            assert smi(smi_state, cmd).stdout == expected.replace("618,", f"{pid},")
            cmd, expected = fixture("nvsmi_csv_nounits_busy.txt")
            assert smi(smi_state, cmd).stdout == expected.replace("21491, 59589", "21482, 59597")
            cmd, expected = fixture("nvsmi_plain_busy.txt")
            got_lines = smi(smi_state, cmd).stdout.splitlines()
            want_lines = expected.splitlines()
            assert [len(x) for x in got_lines] == [len(x) for x in want_lines]
            got_proc = [x for x in got_lines if "python3" in x]
            assert got_proc == [
                x.replace(f"{618:>16}", f"{pid:>16}") for x in want_lines if "python3" in x
            ]
            assert next(x for x in got_lines if "MiB /" in x).split("|")[2:] == [
                "   21482MiB /  81559MiB ",
                "    100%      Default ",
                "",
            ]
            holder.send_signal(signal.SIGKILL)  # a killed holder disappears (no deregistration)
            holder.wait()
            assert (
                smi(smi_state, "nvidia-smi --query-gpu=memory.used --format=csv,noheader").stdout
                == "0 MiB\n"
            )
        finally:
            holder.kill()  # whatever failed above, the holder must not outlive the test


def test_gpu_hold_cuda_visible_devices_and_oom(smi_state: Path) -> None:
    (smi_state / "gpus").write_text(
        f"0\t{CAPTURE_UUID}\t1000\t480\tGPU A\n1\tGPU-1111aaaa-0000-0000-0000-000000000000\t1000\t480\tGPU B\n"
    )
    out = smi(
        smi_state,
        "CUDA_VISIBLE_DEVICES=GPU-1111aaaa gpu_hold --mb 300 --util 60 --seconds 30 --ready > r & "
        "until grep -q READY r; do sleep 0.02; done; "
        "nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader,nounits; "
        "CUDA_VISIBLE_DEVICES=1,0 gpu_hold --mb 300 --seconds 1; echo rc=$?; "
        "CUDA_VISIBLE_DEVICES= gpu_hold --mb 1 --seconds 1; echo rc=$?; kill %1; wait",
    )
    assert out.stdout.splitlines() == ["0, 0, 0", "1, 300, 60", "rc=1", "rc=1"]
    assert "CUDA out of memory" in out.stderr and "no CUDA-capable device" in out.stderr


# --------------------------------------------------------------------------- the cluster


def test_skip_or_fail_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        skip_or_fail("no namespaces")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail("no namespaces")


@pytest.mark.namespaces
def test_four_hosts_start_and_login(cluster4) -> None:
    for i, host in enumerate(cluster4.hosts, 1):
        assert host.ip == f"10.213.{57 + cluster4.slot}.{10 + i}" and host.port == 22
        out = host.ssh("hostname; id -un; echo $HOME")
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [host.name, host.user, str(host.home)]
        data = yaml.safe_load(host.machine_file.read_text())
        assert data == {
            "name": host.name,
            "username": host.user,
            "ip": host.ip,
            "port": 22,
            "ssh_key_path": str(cluster4.key_path),
            "known_hosts": str(cluster4.known_hosts),
        }
    # StrictHostKeyChecking=yes really checks: another host's key is refused
    h1, h2 = cluster4.hosts[:2]
    wrong = cluster4.base / "wrong_known_hosts"
    wrong.write_text(f"{h1.ip} " + (h2.dir / "ssh_host_ed25519_key.pub").read_text())
    try:
        argv = h1.ssh_argv("true")
        argv[argv.index(f"UserKnownHostsFile={cluster4.known_hosts}")] = (
            f"UserKnownHostsFile={wrong}"
        )
        bad = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        assert bad.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in bad.stderr
    finally:
        wrong.unlink()
    wrapper = subprocess.run(
        [str(cluster4.ssh_wrapper), f"{h2.user}@{h2.ip}", "hostname"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert wrapper.stdout == "h2\n"


@pytest.mark.namespaces
def test_hosts_are_isolated(cluster4) -> None:
    h1, h2 = cluster4.hosts[:2]
    assert (
        h1.ssh("echo secret > ~/mine.txt; echo x > /tmp/t1; chmod 644 ~/mine.txt").returncode == 0
    )
    assert (h1.home / "mine.txt").read_text() == "secret\n"
    out = h2.ssh(f"ls ~; ls {h1.home} 2>&1; cat /tmp/t1 2>&1; ls {cluster4.base}/hosts")
    assert "mine.txt" not in out.stdout.split("\n")[0]
    assert "No such file" in out.stdout  # h1's home and /tmp are not even visible
    assert out.stdout.splitlines()[-1] == "h2"
    assert oct((h1.home).stat().st_mode & 0o777) == "0o700"
    assert h1.run("ip -o -4 addr show eth0").stdout.split()[3] == f"{h1.ip}/24"
    assert (h1.home / "mine.txt").exists()
    (h1.home / "mine.txt").unlink()


@pytest.mark.namespaces
def test_meminfo_cpus_load_per_host(make_cluster) -> None:
    c = make_cluster(
        [HostSpec(mem_total_mb=8000, mem_available_mb=3000, cpus=3), HostSpec(cpus=1, loadavg=0.5)]
    )
    h1, h2 = c.hosts
    cmd = "head -3 /proc/meminfo; nproc; python3 -c 'import os; print(os.cpu_count())'; grep -c ^processor /proc/cpuinfo; cat /proc/loadavg; free -m | sed -n 2p"
    a = h1.ssh(cmd).stdout.splitlines()
    assert a[:3] == [
        "MemTotal:        8192000 kB",
        "MemFree:         3072000 kB",
        "MemAvailable:    3072000 kB",
    ]
    assert a[3:6] == ["3", "3", "3"]
    assert a[6].startswith("0.00 0.00 0.00")
    assert a[7].split()[1] == "8000" and a[7].split()[-1] == "3000"
    b = h2.ssh(cmd).stdout.splitlines()
    assert (
        b[0] == "MemTotal:       16777216 kB"
        and b[3:6] == ["1", "1", "1"]
        and b[6].startswith("0.50 0.50 0.50")
    )
    h1.set_memory(available_mb=1000)
    h2.set_loadavg(2.25)
    assert h1.ssh("grep MemAvailable /proc/meminfo").stdout == "MemAvailable:    1024000 kB\n"
    assert h2.ssh("cat /proc/loadavg").stdout.startswith("2.25 2.25 2.25")
    assert h1.ssh("command -v nvidia-smi || echo none").stdout == "none\n"
    assert h1.ssh("command -v python3").stdout == "/usr/bin/python3\n"


@pytest.mark.namespaces
def test_nvidia_smi_over_ssh_matches_capture(make_cluster) -> None:
    c = make_cluster(
        [HostSpec(gpus=[GpuSpec(name="NVIDIA H100 80GB HBM3", memory_mb=81559, uuid=CAPTURE_UUID)])]
    )
    h = c.hosts[0]
    for name in (
        "nvsmi_csv_idle.txt",
        "nvsmi_csv_nounits_idle.txt",
        "nvsmi_apps_idle.txt",
        "bad_query.txt",
    ):
        cmd, expected = fixture(name)
        assert h.ssh(cmd).stdout == expected, name
    assert h.ssh("nvidia-smi -L").stdout == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {CAPTURE_UUID})\n"
    hold = h.hold_gpu(0, 21482, util=100)
    cmd, expected = fixture("nvsmi_csv_busy.txt")
    assert h.ssh(cmd).stdout == expected.replace("21491 MiB, 59589 MiB", "21482 MiB, 59597 MiB")
    cmd, expected = fixture("nvsmi_apps_busy.txt")
    assert h.ssh(APPS_QUERY).stdout == expected.replace("618,", f"{hold.pid},")
    # the PID is the one visible inside the host (where jobs run), owned by root there
    assert h.ssh(f"ps -o user=,comm= -p {hold.pid}").stdout.split() == ["root", "gpu_hold"]
    hold.release()
    assert h.ssh(APPS_QUERY).stdout == fixture("nvsmi_apps_idle.txt")[1]
    # a job's own holder (login user, CUDA_VISIBLE_DEVICES) and its SIGKILL
    out = h.ssh(
        "cd /tmp; CUDA_VISIBLE_DEVICES=0 gpu_hold --mb 3000 --util 40 --ready > r & "
        "until grep -q READY r; do sleep 0.02; done; "
        "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits; echo pid=$!; "
        "kill -9 $!; wait; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader"
    ).stdout.splitlines()
    assert out[0] == f"{out[1][4:]}, 3000" and out[2] == "0 MiB, 0 %"


@pytest.mark.namespaces
def test_gpu_hold_api_on_cluster4(cluster4) -> None:
    h = cluster4.hosts[3]
    with h.hold_gpu(1, 15000, util=100):
        out = h.ssh(
            "nvidia-smi --query-gpu=index,memory.used,memory.free,utilization.gpu --format=csv,noheader,nounits"
        )
        assert out.stdout == "0, 0, 15520, 0\n1, 15000, 520, 100\n"
        with pytest.raises(ClusterError, match="out of memory"):
            h.hold_gpu(1, 1000)
    assert (
        h.ssh("nvidia-smi --query-gpu=memory.used --format=csv,noheader -i 1").stdout == "0 MiB\n"
    )


@pytest.mark.namespaces
def test_crash_kills_everything_and_restart_keeps_identity(cluster4) -> None:
    h = cluster4.hosts[0]
    (h.home / "keep.txt").write_text("kept\n")
    session = start_session(h, "sleep 1000")
    detached = h.ssh("setsid nohup sleep 999 >/dev/null 2>&1 < /dev/null & echo $!").stdout.strip()
    assert "sleep 999" in h.run(f"ps -o args= -p {detached}").stdout
    global_pids = [g for g, _ in h.processes()]
    assert len(global_pids) >= 5
    h.crash()
    assert not h.is_running()
    session.communicate(timeout=10)
    assert session.returncode == 255  # the session died with the host
    assert all(not Path(f"/proc/{p}").exists() or _is_zombie(p) for p in global_pids)
    assert connect_result(h.ip) == "refused"
    h.start()
    assert h.ssh("cat ~/keep.txt").stdout == "kept\n"  # same key, host key (strict check), home
    assert "sleep" not in h.run("ps -eo args").stdout
    assert len(h.processes()) == 2  # init + sshd


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.namespaces
def test_power_off_crash_makes_sessions_hang(cluster4) -> None:
    h = cluster4.hosts[1]
    session = start_session(h, "sleep 1000")
    h.crash(power_off=True)
    with pytest.raises(subprocess.TimeoutExpired):
        session.wait(timeout=1.0)
    assert connect_result(h.ip, timeout=0.5) == "timeout"
    session.kill()
    session.communicate()
    h.start()
    assert connect_result(h.ip) == "banner"


@pytest.mark.namespaces
def test_cut_network_hangs_connects(cluster4) -> None:
    h = cluster4.hosts[2]
    h.cut_network()
    assert connect_result(h.ip, timeout=1.0) == "timeout"  # no RST, no SYN-ACK: silence
    h.heal_network()
    assert connect_result(h.ip) == "banner"


@pytest.mark.namespaces
def test_freeze_gives_no_banner(cluster4) -> None:
    h = cluster4.hosts[2]
    h.freeze()
    assert connect_result(h.ip, timeout=1.0) == "no-banner"
    h.thaw()
    assert connect_result(h.ip) == "banner"


@pytest.mark.namespaces
def test_stop_start_sshd_keeps_sessions(cluster4) -> None:
    h = cluster4.hosts[3]
    session = start_session(h, "sleep 1; echo survived")
    h.stop_sshd()
    assert not h.sshd_running() and h.is_running()
    assert connect_result(h.ip) == "refused"
    out, _ = session.communicate(timeout=10)
    assert (session.returncode, out) == (0, "survived\n")
    h.start_sshd()
    assert h.ssh("echo back").stdout == "back\n"


@pytest.mark.namespaces
def test_latency_and_loss(cluster4) -> None:
    h = cluster4.hosts[1]
    h.set_latency(150)
    # The host holds each packet it sends for 150 ms, its SYN-ACK too: the kernel's round-trip
    # measurement of the handshake says so (a lower bound, whatever this machine's load).
    assert handshake_rtt_us(h.ip) >= 150_000
    assert h.ssh("echo slow").stdout == "slow\n"
    h.set_latency(0, loss_percent=100)
    assert connect_result(h.ip, timeout=0.5) == "timeout"
    h.clear_latency()
    assert "NFQUEUE" not in h.run("iptables -S OUTPUT").stdout
    assert connect_result(h.ip) == "banner"


@pytest.mark.namespaces
async def test_max_sessions_limit(cluster4) -> None:
    h = cluster4.hosts[0]
    h.set_sshd_limits(max_sessions=2)
    assert "MaxSessions 2" in (h.dir / "sshd_config").read_text()
    async with asyncssh.connect(
        h.ip,
        port=h.port,
        username=h.user,
        client_keys=[str(cluster4.key_path)],
        known_hosts=str(cluster4.known_hosts),
    ) as conn:
        p1 = await conn.create_process("sleep 30")
        p2 = await conn.create_process("sleep 30")
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.create_process("sleep 30")
        p1.close()
        p2.close()


@pytest.mark.namespaces
def test_reset_undoes_faults_and_kills_leftover_jobs(cluster4) -> None:
    h1, h2 = cluster4.hosts[:2]
    job = h2.ssh("setsid sleep 500 >/dev/null 2>&1 < /dev/null & echo $!").stdout.strip()
    h1.cut_network()
    h2.set_memory(available_mb=10)
    h2.set_sshd_limits(max_sessions=1)
    h1.hold_gpu(0, 1000)
    cluster4.reset()
    assert h2.run(f"ps -o args= -p {job}").stdout == ""
    assert (
        h1.ssh("nvidia-smi --query-gpu=memory.used --format=csv,noheader").stdout
        == "0 MiB\n0 MiB\n"
    )
    assert h2.ssh("grep MemAvailable /proc/meminfo").stdout == "MemAvailable:   12288000 kB\n"
    assert "MaxSessions 10" in (h2.dir / "sshd_config").read_text()


def _leftovers(cid: str) -> list[str]:
    found = []
    netns = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    found += [line for line in netns.splitlines() if line.startswith(f"sshs-{cid}-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    found += [line.split(":")[1] for line in links.splitlines() if f"sshs{cid}" in line]
    found += [p.pw_name for p in pwd.getpwall() if p.pw_name.startswith(f"sshs_{cid}_")]
    with open("/etc/group") as f:
        found += [line.split(":")[0] for line in f if line.startswith(f"sshs_{cid}_")]
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"sshs-{cid}".encode() in cmd:
            found.append(f"pid {pid}: {cmd!r}")
    if Path(f"/var/lib/sshs-{cid}").exists():
        found.append(f"/var/lib/sshs-{cid}")
    return found


@pytest.mark.namespaces
def test_teardown_leaves_nothing(make_cluster) -> None:
    c = make_cluster([HostSpec(gpus=[GpuSpec()]), HostSpec()])
    h = c.hosts[0]
    h.set_latency(10)
    h.cut_network()
    h.hold_gpu(0, 100)
    h.freeze()
    session = start_session(c.hosts[1], "sleep 100")
    assert _leftovers(c.cluster_id)
    c.stop()
    session.communicate(timeout=10)  # it ended with its host
    c.stop()  # idempotent
    assert _leftovers(c.cluster_id) == []
    assert not c.base.exists()


@pytest.mark.namespaces
def test_leftovers_of_a_killed_owner_are_removed() -> None:
    cid = "z" + os.urandom(2).hex()
    code = (
        "import os; from tests.cluster import start_cluster, HostSpec, GpuSpec; "
        f"c = start_cluster([HostSpec(gpus=[GpuSpec()])] * 2, cluster_id={cid!r}); "
        "c.hosts[0].set_latency(5); print('up', flush=True); os._exit(0)"  # no atexit: a "crash"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.stdout == "up\n", out.stderr
    # a concurrent test run may clean it up first: look and clean under the cluster lock
    with _global_lock():
        existed = bool(_leftovers(cid))
        removed = _cleanup()
    assert (f"cluster {cid}" in removed) == existed
    assert _leftovers(cid) == []
    assert cleanup_leftovers() is not None  # the public, locking wrapper


def test_loopback_fallback(make_cluster) -> None:
    """The non-namespaced fallback (what non-root users get), forced here."""
    c = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=1000)]), HostSpec()], mode="loopback")
    h1, h2 = c.hosts
    assert not c.namespaces and h1.ip == "127.0.0.11" and h1.port != 22
    data = yaml.safe_load(h1.machine_file.read_text())
    assert data["workdir"] == str(h1.workdir) and data["port"] == h1.port
    out = h1.ssh("nvidia-smi --query-gpu=memory.total --format=csv,noheader; echo $SSHS_HOST")
    assert out.stdout == f"1000 MiB\n{c.cluster_id}/h1\n", out.stderr
    assert h2.ssh("command -v nvidia-smi || echo none").stdout == "none\n"
    with pytest.raises(Unsupported):
        h1.cut_network()
    h1.freeze()
    assert connect_result(h1.ip, h1.port) == "no-banner"
    h1.thaw()
    bg = h1.ssh("sleep 100 > /dev/null 2>&1 & echo $!").stdout.strip()
    assert Path(f"/proc/{bg}").exists()
    h1.crash()
    assert not Path(f"/proc/{bg}").exists() or _is_zombie(int(bg))
    assert connect_result(h1.ip, h1.port) == "refused"
    h1.start()
    assert h1.ssh("echo up").stdout == "up\n"
