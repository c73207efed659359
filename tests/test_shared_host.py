"""A shared host (issue 11, the host side): a second, hostile unix user on a cluster host attacks
our batches, and every process a job starts dies with it.

The attacker is ``cluster.other_user()``, a real unprivileged unix user running inside the host
(``host.run(..., user=other)``).  Each attack is first set up as the issue reproduced it, then the
test shows it fails: a shared work root is refused, the old ``/tmp/ssh_scheduler-<uid>`` socket
is never used, a token that climbs out is refused, and no job process outlives Ctrl-C twice,
``--timeout`` or the lease.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from ssh_scheduler.agent import hostguard
from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent.boot import MODULES
from ssh_scheduler.coordinator.remote import RemoteOptions, execute_remote
from ssh_scheduler.errors import TransportError
from ssh_scheduler.executors.agent_checks import root_matches
from ssh_scheduler.transport.bootstrap import agent_start
from tests.cluster import Cluster, Host
from tests.hostile_server import HostileServer
from tests.live_batch import EXECUTE_BATCH, batch_env, batch_processes, journal, run_batch

NO_GPU = ["--no-gpu-required", "--memory-required", "100"]


def start_batch(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*EXECUTE_BATCH, *args], cwd=cwd, env=batch_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def wait_for_lines(
    proc: subprocess.Popen[str], prefix: str, count: int, timeout: float = 60, stream: str = "stdout"
) -> list[str]:
    """Read ``stream`` until ``count`` lines start with ``prefix`` (the timeout only stops a hang);
    the lines read."""
    pipe = proc.stdout if stream == "stdout" else proc.stderr
    assert pipe is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while len([s for s in seen if s.startswith(prefix)]) < count:
        assert time.monotonic() < deadline, f"no {prefix!r} line came: {seen}"
        line = pipe.readline()
        assert line, f"batch ended early: {seen}"
        seen.append(line)
    return seen

pytestmark = pytest.mark.namespaces


def machine_file(host: Host, tmp_path: Path, workdir: str | None = None) -> str:
    data = host.machine_yaml()
    if workdir is not None:
        data["workdir"] = workdir
    path = tmp_path / f"{host.name}-{abs(hash(workdir)) % 10**6}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def wait_until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def cache_key(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest() + "-r"


# --- attack 1: a pre-created shared work root -----------------------------------------------------


def test_a_work_root_prepared_by_another_user_is_refused(cluster4: Cluster, tmp_path: Path) -> None:
    host, other = cluster4["h1"], cluster4.other_user()
    ours = b"print('ours')\n"
    evil = b"import os;os.system('touch /tmp/pwned')#"[: len(ours)].ljust(len(ours), b"#")
    assert len(evil) == len(ours)
    (tmp_path / "train.py").write_bytes(ours)
    (tmp_path / "b.sh").write_text("python3 train.py\n")
    host.run(f"echo 'our bashrc' > {host.home}/.bashrc", user=host.user, check=True)
    # The attacker's preparation, as in the issue: world-writable folders, a same-size cache
    # file under our input's key, and links where our output files would go.
    host.run(
        f"mkdir -p /tmp/shared/cache /tmp/shared/jobs /tmp/shared/agents && chmod -R 777 /tmp/shared"
        f" && cat > /tmp/shared/cache/{cache_key(ours)}"
        f" && ln -s {host.home}/.bashrc /tmp/shared/jobs/planted.out",
        user=other, check=True, input=evil.decode(),
    )
    try:
        result = run_batch(tmp_path, "b.sh", "--machines", machine_file(host, tmp_path, "/tmp/shared"), *NO_GPU)
        assert result.returncode != 0
        # One line naming the host, the folder and the fix.
        line = next(line for line in result.stderr.splitlines() if "/tmp/shared" in line)
        assert "h1" in line and "belongs to another user" in line and "workdir" in line, result.stderr
        assert host.run("test -e /tmp/pwned && echo yes || echo no").stdout.strip() == "no"
        assert host.run(f"cat {host.home}/.bashrc").stdout == "our bashrc\n"
        # Nothing of ours went into their folder.
        listing = host.run("find /tmp/shared -user " + host.user).stdout
        assert listing == ""
    finally:
        host.run("rm -rf /tmp/shared /tmp/pwned")


def test_a_private_work_root_in_tmp_is_made_and_its_cache_checked_by_hash(
    cluster4: Cluster, tmp_path: Path
) -> None:
    host = cluster4["h1"]
    workdir = f"/tmp/ours-{os.getpid()}"
    (tmp_path / "in.txt").write_text("good\n")
    (tmp_path / "b.sh").write_text("cat in.txt > got.txt\n")
    machines = ["--machines", machine_file(host, tmp_path, workdir)]
    try:
        first = run_batch(tmp_path, "b.sh", *machines, *NO_GPU)
        assert first.returncode == 0, first.stderr
        mode = host.run(f"stat -c '%a %U' {workdir} {workdir}/cache {workdir}/jobs").stdout.split("\n")
        assert mode[:3] == [f"700 {host.user}"] * 3
        # Same size, other bytes: a size check would take it; the hash check does not.
        cached = f"{workdir}/cache/{cache_key(b'good' + bytes([10]))}"
        host.run(f"chmod u+w {cached} && printf 'evil\\n' > {cached}", user=host.user, check=True)
        (tmp_path / "b.sh").write_text("cat in.txt > got.txt\ncat in.txt > got2.txt\n")
        second = run_batch(tmp_path, "b.sh", *machines, *NO_GPU)
        assert second.returncode == 0, second.stderr
        assert (tmp_path / "job_results" / "b.sh.2" / "got2.txt").read_text() == "good\n"
        assert host.run(f"cat {cached}").stdout == "good\n"  # the bad entry was replaced
    finally:
        host.run(f"rm -rf {workdir}")


# --- attacks 2 and 4: the agent's socket ---------------------------------------------------------

LISTENER = """
import os, socket, sys
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(5)
open("/tmp/evil.pid", "w").write(str(os.getpid()))
while True:
    conn, _ = s.accept()
    with open("/tmp/evil.log", "ab") as log:
        log.write(b"connected\\n" + conn.recv(65536))
"""


def test_no_socket_outside_the_private_root(cluster4: Cluster, tmp_path: Path) -> None:
    """The fallback for long work roots (/tmp/ssh_scheduler-<uid>) is gone: an impostor listening
    there receives nothing, and the rerun talks to our own agent."""
    host, other = cluster4["h1"], cluster4.other_user()
    workdir = "/tmp/" + "w" * 90  # long: the old code put the socket in /tmp then
    machines = ["--machines", machine_file(host, tmp_path, workdir)]
    (tmp_path / "b.sh").write_text("echo one\n")
    try:
        assert run_batch(tmp_path, "b.sh", *machines, *NO_GPU).returncode == 0
        token = next(e["token"] for e in journal(tmp_path / "job_results") if e["state"] == "batch")
        host.run("cat > /tmp/listener.py && chmod 755 /tmp/listener.py", user=other, input=LISTENER, check=True)
        fallback = f"/tmp/ssh_scheduler-{host.uid}/{token}.sock"
        host.run(f"nohup python3 /tmp/listener.py {fallback} >/dev/null 2>&1 &", user=other, check=True)
        assert wait_until(lambda: host.run(f"test -S {fallback}").returncode == 0, 10)
        (tmp_path / "b.sh").write_text("echo one\necho two\n")
        rerun = run_batch(tmp_path, "b.sh", *machines, *NO_GPU)
        assert rerun.returncode == 0, rerun.stderr
        assert (tmp_path / "job_results" / "b.sh.2.out").read_text() == "two\n"
        assert host.run("cat /tmp/evil.log").stdout == ""  # never connected to
    finally:
        pid = host.run("cat /tmp/evil.pid").stdout.strip()
        if pid.isdigit():
            host.run(f"kill {pid}", user=other)
        host.run(f"rm -rf {workdir} /tmp/ssh_scheduler-{host.uid} /tmp/listener.py /tmp/evil.*")


def test_a_token_that_climbs_out_is_refused_by_the_agent(cluster4: Cluster) -> None:
    host = cluster4["h2"]
    start = agent_start("python3", "~/.ssh_scheduler", "../../../../tmp/evil")
    result = subprocess.run(host.ssh_argv(start.command), input=start.payload, capture_output=True, timeout=30, check=False)
    assert b"refused to start" in result.stdout and b"not a plain name" in result.stdout
    assert host.run("test -e /tmp/evil.sock").returncode != 0


def test_the_agent_socket_is_out_of_another_users_reach(cluster4: Cluster, tmp_path: Path) -> None:
    host, other = cluster4["h3"], cluster4.other_user()
    (tmp_path / "b.sh").write_text("sleep 30\n")
    before = set(host.run(f"ls {host.workdir}/agents").stdout.split())  # other tests' agents
    proc = start_batch(tmp_path, "b.sh", "--machines", machine_file(host, tmp_path), *NO_GPU)
    try:
        wait_for_lines(proc, "started:", 1)
        sockets = sorted(set(host.run(f"ls {host.workdir}/agents").stdout.split()) - before)
        assert len(sockets) == 1 and sockets[0].endswith(".sock")
        connect = f"python3 -c 'import socket;socket.socket(socket.AF_UNIX).connect(\"{host.workdir}/agents/{sockets[0]}\")'"
        assert "PermissionError" in host.run(connect, user=other).stderr
        os.killpg(proc.pid, signal.SIGKILL)  # detached: the agent waits for us to come back
        proc.communicate()
        assert any("sleep 30" in p for p in batch_processes(host))
        assert "PermissionError" in host.run(connect, user=other).stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


# --- attack 5: escaping the kill -------------------------------------------------------------------

# setsid + env -i, a double fork, a process ignoring SIGTERM (in and out of the session), and
# the job's own main process; the numbers name them.
ESCAPING_JOB = (
    "(setsid env -i sleep {n}1 &); ( (sleep {n}2 &) & ); (trap '' TERM; exec env -i sleep {n}3) & "
    "(trap '' TERM; setsid sleep {n}4 &); sleep {n}5\n"
)


def job_processes(host: Host, n: int) -> list[str]:
    return [p for p in batch_processes(host) if f"sleep {n}" in p]


def start_escaping_job(tmp_path: Path, host: Host, n: int, *args: str):  # type: ignore[no-untyped-def]
    (tmp_path / "b.sh").write_text(ESCAPING_JOB.format(n=n))
    proc = start_batch(tmp_path, "b.sh", "--machines", machine_file(host, tmp_path), *NO_GPU, *args)
    wait_for_lines(proc, "started:", 1)
    assert wait_until(lambda: len(job_processes(host, n)) == 5, 15), job_processes(host, n)
    return proc


def test_ctrl_c_twice_leaves_no_process(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4["h1"]
    proc = start_escaping_job(tmp_path, host, 611)
    os.killpg(proc.pid, signal.SIGINT)
    # The second Ctrl-C once the first was heard (the batch says it drains), not after a guess.
    heard = wait_for_lines(proc, "stopping: ", 1, stream="stderr")
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(heard) + err
    assert wait_until(lambda: batch_processes(host) == [], 15), batch_processes(host)


def test_timeout_leaves_no_process(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4["h2"]
    (tmp_path / "b.sh").write_text(ESCAPING_JOB.format(n=622))
    proc = start_escaping_job(tmp_path, host, 622, "--timeout", "4")
    out, err = proc.communicate(timeout=90)
    assert "timed out" in out + err
    assert wait_until(lambda: batch_processes(host) == [], 15), batch_processes(host)


def test_the_lease_leaves_no_process(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4["h3"]
    proc = start_escaping_job(tmp_path, host, 633, "--lease", "4")
    os.killpg(proc.pid, signal.SIGKILL)  # the coordinator dies: nobody renews the lease
    proc.communicate()
    assert len(job_processes(host, 633)) == 5  # kept for the lease...
    assert wait_until(lambda: batch_processes(host) == [], 30), batch_processes(host)  # ...then gone


# --- limits on what a host sends back ----------------------------------------------------------------


def test_output_over_the_limit_kills_the_job(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4["h4"]
    (tmp_path / "b.sh").write_text("head -c 300000 /dev/zero | tr '\\0' x; sleep 120\n")
    result = run_batch(tmp_path, "b.sh", "--machines", machine_file(host, tmp_path), *NO_GPU,
                       "--max-output-bytes", "1000")
    assert result.returncode != 0
    results = tmp_path / "job_results"
    assert (results / "b.sh.1.out").read_bytes() == b"x" * 1000
    assert "passed the limit of 1000 bytes (--max-output-bytes); the job was killed" in (
        results / "b.sh.1.err").read_text()
    assert [e["state"] for e in journal(results) if e.get("job") == "b.sh.1"][-1] == "failed"
    assert batch_processes(host) == []


# --- the coordinator never takes the agent's paths on trust -----------------------------------


@pytest.mark.parametrize(
    ("root", "workdir", "ok"),
    [
        ("/users/u/.ssh_scheduler", "~/.ssh_scheduler", True),
        ("/tmp/evilroot", "~/.ssh_scheduler", False),
        ("/users/u/x/../.ssh_scheduler", "~/.ssh_scheduler", False),
        ("relative/.ssh_scheduler", "~/.ssh_scheduler", False),
        ("/srv/work", "/srv/work", True),
        ("/srv/work", "/srv/work/", True),
        ("/srv/work2", "/srv/work", False),
        ("/users/u/work", "work", True),
        ("/users/u/notwork", "work", False),
    ],
)
def test_root_rule(root: str, workdir: str, ok: bool) -> None:
    assert root_matches(root, workdir) is ok


async def test_a_hello_root_outside_the_workdir_gets_nothing(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    hostile = await HostileServer(tmp_path / "keys").start()
    try:
        hostile.missing_all = True
        src = tmp_path / "src"
        src.mkdir()
        (src / "input.txt").write_text("secret input\n")
        with pytest.raises(TransportError, match="not the configured workdir"):
            await execute_remote(
                hostile.machine(workdir="~/.ssh_scheduler"), "true",
                RemoteOptions(job_name="j", results_dir=tmp_path / "res", base_dir=src),
                stdout=(), stderr=(),
            )
        assert hostile.uploaded == {}
        assert [r.TAG for r in hostile.requests] == ["hello"]
    finally:
        await hostile.stop()


# --- the same rules, on this machine (no cluster) ------------------------------------------------


def test_cache_trust_is_by_hash_and_remembered(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    good = cache / cache_key(b"good\n")
    good.write_bytes(b"good\n")
    forged = cache / cache_key(b"ours\n")
    forged.write_bytes(b"evil\n")  # same size, other bytes
    record = tmp_path / "trusted.json"
    cache_fd, record_dir = os.open(cache, os.O_RDONLY), os.open(tmp_path, os.O_RDONLY)
    try:
        trust = hostguard.CacheTrust(cache_fd, record_dir, record.name)
        assert trust.check(good.name, 5) and not trust.check(forged.name, 5)
        assert not forged.exists()  # removed, to be uploaded again
        assert not trust.check(cache_key(b"x"), None)  # absent
        trust.save()
        assert json.loads(record.read_text()) == {good.name: list(trust.known[good.name])}
        # A later agent trusts it without hashing, until the file changes.
        again = hostguard.CacheTrust(cache_fd, record_dir, record.name)
        assert again.check(good.name, 5)
        good.chmod(0o600)
        good.write_bytes(b"bad!\n")
        assert not hostguard.CacheTrust(cache_fd, record_dir, record.name).check(good.name, 5)
    finally:
        os.close(cache_fd)
        os.close(record_dir)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_the_agent_refuses_a_work_root_others_may_write(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    start = agent_start(sys.executable, str(root))
    done = subprocess.run(["/bin/sh", "-c", start.command], input=start.payload, capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stdout.decode() == (
        f"ssh_scheduler agent refused to start: {root} is writable by other users (mode "
        f"{mode:o}); run `chmod 700 {root}` if it is yours, or choose another workdir\n")
    assert sorted(os.listdir(root)) == []


def test_the_agent_refuses_a_symlinked_subfolder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir()
    (root / "jobs").symlink_to(tmp_path / "elsewhere")
    start = agent_start(sys.executable, str(root))
    done = subprocess.run(["/bin/sh", "-c", start.command], input=start.payload, capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert f"{root}/jobs is not a folder (a symlink or a file)" in done.stdout.decode()


def test_compiled_code_is_loaded_only_from_a_private_file(tmp_path: Path) -> None:
    """The agent keeps its compiled code in the work root; a copy others could have written is
    never run (and is replaced)."""
    root = tmp_path / "root"
    agent = agent_start(sys.executable, str(root))

    def start() -> str:
        with subprocess.Popen(["/bin/sh", "-c", agent.command], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(agent.payload + P.Hello(id=1, lease=5).encode())
            proc.stdin.flush()
            answer = proc.stdout.readline().decode()
            proc.stdin.write(P.Bye().encode())
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0
        return answer

    assert '"ev":"hello"' in start()
    (kept,) = [p for p in root.iterdir() if p.name.startswith("code-")]
    assert kept.stat().st_mode & 0o777 == 0o600
    assert '"ev":"hello"' in start()  # loaded from the kept code
    marker = tmp_path / "pwned"
    evil = compile(f"open({str(marker)!r}, 'w').close()", "evil", "exec")
    kept.write_bytes(marshal.dumps([evil] * len(MODULES)))
    kept.chmod(0o646)  # as if someone else could have written it
    assert '"ev":"hello"' in start()
    assert not marker.exists()
    assert kept.stat().st_mode & 0o777 == 0o600  # replaced by a good one


def test_files_are_created_private_and_never_through_a_planted_name(tmp_path: Path) -> None:
    target = tmp_path / "bashrc"
    target.write_text("ours\n")
    planted = tmp_path / "job.out"
    planted.symlink_to(target)
    folder = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(FileExistsError):
            hostguard.create_private(folder, planted.name, append=True)
        assert target.read_text() == "ours\n"
        os.close(hostguard.create_private(folder, "fresh.out", append=True))
    finally:
        os.close(folder)
    assert (tmp_path / "fresh.out").stat().st_mode & 0o777 == 0o600
