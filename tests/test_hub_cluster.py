"""The hub on the SSH test cluster: commands in a row share one connection (counted by the host's
kernel) and one agent; another user is refused both ways; a killed, stale or stopped hub costs a
direct connection, never a wrong answer or a hang; a host key, key file or config changed while a
connection is held is never reused; ``status`` shows the hub and ``hub stop`` ends it.

Each test gets a hub of its own (its own ``XDG_RUNTIME_DIR``) and stops it; the rest of the suite
connects directly (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.batch import run_batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.doctor import check_host
from ssh_scheduler.coordinator.fleet import execute_to, killable
from ssh_scheduler.coordinator.remote import RemoteOptions, execute_remote
from ssh_scheduler.errors import HostKeyError
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.config import load_machine
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.hub_ask import hub_status, stop_hub
from ssh_scheduler.transport.hub_place import KEEP_WARM_VARIABLE, hub_key
from ssh_scheduler.transport.ssh import connect
from tests.cluster import Cluster, Host, HostSpec
from tests.live_batch import alive, wait_until

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "python3"


# --- the host's own account, and the hub of this test -------------------------------------------


def opens(host: Host) -> int:
    """TCP connections the host's kernel accepted so far (``PassiveOpens``: every SSH login)."""
    rows = [line.split() for line in host.run("cat /proc/net/snmp", check=True).stdout.splitlines() if line.startswith("Tcp:")]
    return int(dict(zip(rows[0], rows[1], strict=True))["PassiveOpens"])


def agents(host: Host) -> set[int]:
    """Our agents running on the host (their pids there)."""
    found = host.run(f"pgrep -u {host.user} -f -- 'python3 -u -I -S -c'").stdout.split()
    return {int(pid) for pid in found}


def hub_pids() -> list[int]:
    return [int(h["pid"]) for h in hub_status()]


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's own hub folder (short: unix socket paths are short); the hub stopped after."""
    runtime = Path(tempfile.mkdtemp(prefix="hub-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv(KEEP_WARM_VARIABLE, "60")
    try:
        yield runtime / "ssh_scheduler"
    finally:
        pids = hub_pids()
        stop_hub()
        for pid in pids:
            wait_until(lambda pid=pid: not alive(pid), f"hub {pid} exited")
        shutil.rmtree(runtime, ignore_errors=True)


def machine_of(host: Host, **changes: object) -> Machine:
    return dataclasses.replace(load_machine(str(host.machine_file)), **changes)  # type: ignore[arg-type]


async def hostname(machine: Machine) -> str:
    result = (await execute_to([machine], "hostname")).results[0]
    assert result.exit_code == 0, result.error
    return result.stdout.decode().strip()


def remote_options(tmp_path: Path, **more: object) -> RemoteOptions:
    values: dict[str, object] = {"copy_forwards": (), "results_dir": tmp_path / "job_results", "base_dir": tmp_path, **more}
    return RemoteOptions(**values)  # type: ignore[arg-type]


# --- the lever -----------------------------------------------------------------------------------


async def one_batch(machine: Machine, folder: Path, command: str = "echo batch") -> str:
    """One job's batch through ``run_batch``; what the job printed."""
    summary = await run_batch(
        [Job("a", command, 1)], [machine],
        BatchOptions(needs=Needs(cpus=0.01, memory_mb=1, gpus=0, gpu_memory_mb=0), gpus_explicit=True,
                     copy_forwards=(), results_dir=folder, base_dir=folder.parent, probe_interval=3600),
        out=None, err=None,
    )
    assert summary.outcomes["a"].ok
    return (folder / "a.out").read_text()


def one_agent(host: Host) -> int:
    """The one agent on the host, once there is one and only one (a spare starts after a batch)."""
    seen: list[set[int]] = []

    def one() -> bool:
        seen[:] = [agents(host)]
        return len(seen[0]) == 1

    try:
        wait_until(one, "one agent on the host")
    except AssertionError as exc:  # (what was there, and what the hub held, say which way it went)
        raise AssertionError(f"{exc}: last seen {sorted(seen[0]) if seen else '?'}; hub: {hub_status()}") from None
    [pid] = seen[0]
    return pid


async def test_commands_in_a_row_share_one_connection_and_one_agent(cluster4: Cluster, hub: Path, tmp_path: Path) -> None:
    host = cluster4.hosts[0]
    machine = machine_of(host)
    before = opens(host)
    assert await hostname(machine) == host.name  # cold: the hub starts and connects
    assert await hostname(machine) == host.name  # warm
    assert agents(host) == set()  # execute_to runs no agent, and leaves no spare
    assert await one_batch(machine, tmp_path / "batch") == "batch\n"
    report = await check_host(machine)
    assert report.ok, report.problems
    spare = one_agent(host)  # the batch's own ended with it; a spare waits for the next

    assert await execute_remote(machine, "echo one", remote_options(tmp_path), stdout=(), stderr=()) == 0
    assert agents(host) == {spare}  # the agent stays for the next command...
    assert await execute_remote(machine, "exit 3", remote_options(tmp_path), stdout=(), stderr=()) == 3
    assert agents(host) == {spare}  # ...which used it: no second agent started
    assert (tmp_path / "job_results").is_dir()

    assert opens(host) - before == 1  # one SSH connection for all six commands
    [state] = hub_status()
    [held] = state["held"]
    assert (held["name"], held["uses"], held["agent"]) == (host.name, 6, True)


async def test_a_batch_adopts_the_spare_agent_the_batch_before_left(cluster4: Cluster, hub: Path, tmp_path: Path) -> None:
    host = cluster4.hosts[2]
    machine = machine_of(host)
    before = opens(host)
    # $PPID of a job is the agent that started it.
    first = int(await one_batch(machine, tmp_path / "b1", "echo $PPID"))
    spare = one_agent(host)
    assert spare != first  # the first batch's agent ended with it
    assert int(await one_batch(machine, tmp_path / "b2", "echo $PPID")) == spare  # adopted
    after = one_agent(host)
    assert after != spare  # the adopted one ended with its batch; a new spare waits
    # A spare an execute_remote used in between (its job ended and was removed) is adopted too.
    assert await execute_remote(machine, "true", remote_options(tmp_path), stdout=(), stderr=()) == 0
    assert agents(host) == {after}
    assert int(await one_batch(machine, tmp_path / "b3", "echo $PPID")) == after
    assert after not in agents(host)
    assert opens(host) - before == 1  # all on one connection


def held_state(name: str) -> dict[str, object]:
    [state] = hub_status()
    return next(h for h in state["held"] if h["name"] == name)


async def test_spares_start_once_no_command_holds_a_connection(cluster4: Cluster, hub: Path, tmp_path: Path) -> None:
    host, other = cluster4.hosts[3], cluster4.hosts[1]
    busy = await connect(machine_of(other))  # another command, still at work
    try:
        await one_batch(machine_of(host), tmp_path / "b")
        wait_until(lambda: held_state(host.name)["state"] == "idle", "the batch gave its connection back")
        # Starting agents now would delay what that command waits for: not yet.
        assert held_state(host.name)["spare_starting"] is False and held_state(host.name)["agent"] is False
        assert agents(host) == set()
    finally:
        await busy.close()
    wait_until(lambda: held_state(host.name)["agent"] is True, "the spare started once nobody held a connection")
    # The hub keeps the spare once its channel is open, before the host has run its python3.
    one_agent(host)


async def test_what_goes_through_the_hub_is_what_a_direct_connection_does(cluster4: Cluster, hub: Path, tmp_path: Path) -> None:
    host = cluster4.hosts[1]
    warm, direct = machine_of(host), machine_of(host, keep_warm=0.0)
    (tmp_path / "in").mkdir()
    big = os.urandom(700_000)  # above the bulk size: by SFTP, a descriptor passed to the hub
    (tmp_path / "in" / "big.bin").write_bytes(big)
    script = "cat in/big.bin in/big.bin > out.bin; printf 'o%.0s' 1 2 3; printf 'e' >&2; exit 7"
    for machine, name in ((warm, "warm1"), (warm, "warm2"), (direct, "direct")):
        options = remote_options(tmp_path, copy_forwards=("in",), copy_backwards=("out.bin",), job_name=name)
        assert await execute_remote(machine, script, options, stdout=(), stderr=()) == 7
        results = tmp_path / "job_results"
        assert (results / name / "out.bin").read_bytes() == big * 2
        assert ((results / f"{name}.out").read_text(), (results / f"{name}.err").read_text()) == ("ooo", "e")
    # A transport's own calls, both ways.
    transport = await connect(warm)
    try:
        assert type(transport).__name__ == "HubTransport"
        got = await transport.exec("printf x; printf y >&2; exit 4")
        assert (got.exit_code, got.stdout, got.stderr) == (4, b"x", b"y")
        with pytest.raises(TimeoutError):  # cancelled: the channel closes, the watchdog kills
            await asyncio.wait_for(transport.exec(killable("sleep 301.7")), 2)
    finally:
        await transport.close()
    wait_until(lambda: "sleep 301.7" not in host.run(f"pgrep -a -u {host.user} sleep").stdout, "the cancelled sleep was killed")
    # A download whose writing here fails (a full disk) is this machine's OSError, as it is
    # directly: a copy-back tells it from the host's fault (executors/transfer.py).
    for machine in (warm, direct):
        transport = await connect(machine)
        fd = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        try:
            assert (await transport.exec("printf data > hub-full.txt")).exit_code == 0
            with pytest.raises(OSError) as failed:
                await transport.download("hub-full.txt", fd, 1 << 20)
            assert failed.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
            await transport.close()


# --- another user -----------------------------------------------------------------------------------


def as_other(cluster: Cluster, *argv: str, **popen: object) -> subprocess.Popen[str]:
    user = pwd.getpwnam(cluster.other_user())
    return subprocess.Popen(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", SYSTEM_PYTHON, "-c", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/", **popen,  # type: ignore[call-overload]
    )


ASK_AND_READ = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
try:
    s.sendall(b'{"op": "stop"}\\n')
except OSError:
    pass
s.settimeout(10)
data = b""
while True:
    try:
        chunk = s.recv(65536)
    except OSError:
        break
    if not chunk:
        break
    data += chunk
print(data.decode())
"""

LISTEN_AND_TELL = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(5)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(5)
    try:
        print(repr(c.recv(65536)), flush=True)
    except OSError as exc:
        print("error", exc, flush=True)
    c.close()
"""


@pytest.mark.namespaces
async def test_another_user_is_refused_both_ways(cluster4: Cluster, hub: Path, tmp_path: Path) -> None:
    host = cluster4.hosts[2]
    machine = machine_of(host)
    await hostname(machine)
    [pid] = hub_pids()
    sock = hub / f"hub-{hub_key()}.sock"

    # 1. Another user who can reach the socket (its folder opened by mistake) gets nothing done.
    hub.parent.chmod(0o711)
    hub.chmod(0o711)
    sock.chmod(0o777)
    try:
        other = as_other(cluster4, ASK_AND_READ, str(sock))
        said, _ = other.communicate(timeout=30)
    finally:
        hub.chmod(0o700)
        sock.chmod(0o600)
    assert "may not use the hub" in said and "held" not in said
    assert hub_pids() == [pid]  # its "stop" was never heard

    # 2. A listener of another user planted at our socket's name is never told anything: the
    # command connects directly.
    stop_hub()
    wait_until(lambda: not alive(pid), "the hub stopped")
    theirs = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chown(theirs, pwd.getpwnam(cluster4.other_user()).pw_uid, -1)
    try:
        fake = as_other(cluster4, LISTEN_AND_TELL, str(theirs / "s"))
        assert fake.stdout is not None and fake.stdout.readline() == "listening\n"
        os.rename(theirs / "s", sock)
        before = opens(host)
        assert await hostname(machine) == host.name
        assert opens(host) - before == 1
        assert hub_pids() == []  # (status asks every socket there: refused too)
        fake.kill()
        told, _ = fake.communicate(timeout=30)
        assert set(told.split()) == {"b''"}  # reached, its owner seen, nothing ever said: direct
    finally:
        shutil.rmtree(theirs, ignore_errors=True)
        sock.unlink(missing_ok=True)

    # 3. A folder of another user at our folder's name: never used.
    shutil.rmtree(hub)
    hub.mkdir(mode=0o700)
    os.chown(hub, pwd.getpwnam(cluster4.other_user()).pw_uid, -1)
    before = opens(host)
    assert await hostname(machine) == host.name
    assert await hostname(machine) == host.name
    assert opens(host) - before == 2 and list(hub.iterdir()) == []
    shutil.rmtree(hub)


# --- a hub that is gone, stuck or stale ---------------------------------------------------------------


async def test_a_killed_stale_or_stuck_hub_costs_a_direct_connection_never_a_wrong_answer(cluster4: Cluster, hub: Path) -> None:
    host = cluster4.hosts[3]
    machine = machine_of(host)
    await hostname(machine)
    [first] = hub_pids()

    # Killed while a command runs through it: the command ends as on a lost connection, and the
    # host's command dies with its channel (the watchdog), as with a cut connection.
    running = asyncio.ensure_future(execute_to([machine], "sleep 40; echo late"))
    await asyncio.to_thread(wait_until, lambda: "sleep 40" in host.run(f"pgrep -a -u {host.user} sleep").stdout, "the command runs")
    os.kill(first, signal.SIGKILL)
    [result] = (await asyncio.wait_for(running, 60)).results
    assert result.exit_code is None and "hub" in (result.error or ""), result
    await asyncio.to_thread(wait_until, lambda: "sleep 40" not in host.run(f"pgrep -a -u {host.user} sleep").stdout, "the command was killed")

    # Its socket is left behind: the next command starts a new hub in its place.
    assert (hub / f"hub-{hub_key()}.sock").exists()
    assert await hostname(machine) == host.name
    [second] = hub_pids()
    assert second != first

    # Stopped (SIGSTOP): it never says it took the request; the command goes direct meanwhile
    # (the limit only stops a hung test: waiting on the stopped hub would never end by itself).
    os.kill(second, signal.SIGSTOP)
    try:
        before = opens(host)
        assert await asyncio.wait_for(hostname(machine), 45) == host.name
        assert opens(host) - before == 1
    finally:
        os.kill(second, signal.SIGCONT)


def test_a_client_killed_midway_leaves_its_connection_to_nobody(cluster4: Cluster, hub: Path, tmp_path: Path) -> None:
    """SIGKILL a command while it uploads: the hub does not lend what it left (an SFTP session cut
    off midway) to the next command, which connects afresh and works."""
    host = cluster4.hosts[0]
    (tmp_path / "data.bin").write_bytes(os.urandom(64 * 1024 * 1024))
    cache = host.workdir / "cache"
    left = set(cache.glob("*.part-*")) if cache.exists() else set()  # other tests' cut uploads
    before = opens(host)
    killed = subprocess.Popen(
        [sys.executable, "-m", "ssh_scheduler", "execute_remote", "--machine", str(host.machine_file),
         "--copy-forwards", "data.bin", "--", "sha256sum data.bin"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_until(lambda: cache.exists() and bool(set(cache.glob("*.part-*")) - left), "the upload runs", 120)
    killed.kill()
    killed.wait()
    done = cli("execute_remote", "--machine", str(host.machine_file), "--copy-forwards", "data.bin", "--",
               "sha256sum data.bin", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert opens(host) - before == 2  # the killed command's connection was not lent again
    [state] = hub_status()
    assert [h["uses"] for h in state["held"]] == [1]


async def test_a_stopping_hub_finishes_what_it_lent_while_a_new_one_serves(cluster4: Cluster, hub: Path) -> None:
    host = cluster4.hosts[2]
    machine = machine_of(host)
    lent = await connect(machine)
    try:
        [old] = hub_pids()
        [stopping] = stop_hub()
        assert stopping["lent"] == 1
        # It no longer listens, and gave its name up: the next command starts a new hub at once.
        assert await hostname(machine) == host.name
        [new] = hub_pids()
        assert new != old and alive(old)
        got = await lent.exec("echo still here")  # what it lent goes on until given back
        assert got.stdout == b"still here\n"
    finally:
        await lent.close()
    await asyncio.to_thread(wait_until, lambda: not alive(old), "the stopped hub exited")


async def test_a_hub_ends_by_itself_once_idle(cluster4: Cluster, hub: Path) -> None:
    host = cluster4.hosts[0]
    await hostname(machine_of(host, keep_warm=1.0))
    [pid] = hub_pids()
    await asyncio.to_thread(wait_until, lambda: not alive(pid), "the idle hub exited", 60)
    assert not (hub / f"hub-{hub_key()}.sock").exists()


async def test_a_host_lost_while_held_is_reported_as_a_direct_connection_reports_it(cluster4: Cluster, hub: Path) -> None:
    host = cluster4.hosts[1]
    machine = machine_of(host, connect_timeout=2.0)
    await hostname(machine)
    host.cut_network()
    try:
        [result] = (await asyncio.wait_for(execute_to([machine], "hostname"), 60)).results
    finally:
        host.heal_network()
    assert result.exit_code is None and not result.reached
    assert "no answer within 2 s" in (result.error or "")


# --- never reused after a change ---------------------------------------------------------------------


@pytest.mark.namespaces
async def test_a_changed_host_key_key_file_or_config_never_reuses_a_connection(make_cluster: Callable[..., Cluster], hub: Path, tmp_path: Path) -> None:
    cluster = make_cluster([HostSpec()])
    host = cluster.hosts[0]
    machine = machine_of(host)
    await hostname(machine)
    await hostname(machine)

    # The host's key changes (reinstalled, say) and known_hosts is told: the next command makes a
    # new connection, checked against the new key, and the one made under the old key is closed.
    key = host.dir / "ssh_host_ed25519_key"
    key.unlink()
    Path(f"{key}.pub").unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    host.stop_sshd()
    host.start_sshd()
    base = opens(host)  # (starting sshd tried a connection)
    kind, blob = Path(f"{key}.pub").read_text().split()[:2]
    cluster.known_hosts.write_text(f"{host.ip} {kind} {blob}\n")
    assert await hostname(machine) == host.name
    assert opens(host) - base == 1
    [state] = hub_status()
    assert [h["uses"] for h in state["held"]] == [1]

    # The client's key file is replaced (same key, another file): another connection.
    copy = tmp_path / "id"
    shutil.copy(cluster.key_path, copy)
    copy.chmod(0o600)
    os.replace(copy, cluster.key_path)
    assert await hostname(machine) == host.name
    assert opens(host) - base == 2

    # Another way to connect (the config says legacy algorithms now): another connection, and
    # the one made under the old config is closed; the same way again: the new one.
    legacy = dataclasses.replace(machine, legacy_algorithms=True)
    assert await hostname(legacy) == host.name
    assert await hostname(legacy) == host.name
    assert opens(host) - base == 3
    [state] = hub_status()
    assert [h["uses"] for h in state["held"]] == [2]

    # An unknown host key is refused through the hub exactly as directly, word for word.
    cluster.known_hosts.write_text("")
    refusals = []
    for keep in (None, 0.0):
        with pytest.raises(HostKeyError) as err:
            await connect(dataclasses.replace(machine, keep_warm=keep))
        refusals.append(str(err.value))
    assert refusals[0] == refusals[1] and "unknown host key" in refusals[0]


# --- the command line -----------------------------------------------------------------------------------


def cli(*args: str, cwd: Path = Path("/")) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ssh_scheduler", *args], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=cwd,
    )


def test_status_shows_the_hub_and_one_command_stops_it(cluster4: Cluster, hub: Path) -> None:
    host = cluster4.hosts[2]
    assert "no hub runs" in cli("hub").stdout
    done = cli("execute_to", "--machines", str(host.machine_file), "--", "hostname")
    assert done.returncode == 0, done.stderr
    shown = cli("status").stdout
    assert "warm connections: 1" in shown and f"  {host.name} ({host.user}@{host.ip}): idle" in shown
    off = cli("execute_to", "--keep-warm", "0", "--machines", str(host.machine_file), "--", "hostname")
    assert off.returncode == 0 and "used 1 times" in cli("hub").stdout  # --keep-warm 0: not through it
    [pid] = hub_pids()
    stopped = cli("hub", "stop")
    assert stopped.stdout.strip() == f"stopped the hub (pid {pid})"
    wait_until(lambda: not alive(pid), "the hub stopped")
    assert "no hub runs" in cli("hub").stdout
    assert cli("hub", "serve").returncode == 2  # not by hand
