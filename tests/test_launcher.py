"""The warm launcher (cli/launcher.py) and the thin start (cli/launch.py), as users run them: the
console scripts, a real launcher process, real signals.

A command handed to a launcher must be the command run in its own process: the same output,
exit status and error lines, in the caller's folder, environment, umask and limits, with its
standard streams; a Ctrl-C or kill reaches it, a caller that dies stops it.  A launcher another
user listens on is never told anything; a caller in another context (priority, CPUs) runs its
command itself; a launcher ends with its hub.  Each test checks the launcher's log to know that
the command did (or did not) go through it.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssh_scheduler.cli.launch import connects
from ssh_scheduler.cli.warm_place import (
    READY,
    claim,
    launcher_key,
    launcher_path,
    loading_launchers,
    running_launchers,
)
from ssh_scheduler.transport import hub_ask, hub_client, hub_place
from ssh_scheduler.transport.hub_place import (
    KEEP_WARM_VARIABLE,
    private_folder,
    sha256,
    socket_path,
    start_early,
    take_early,
)
from tests.live_batch import alive, wait_until

BIN = Path(sys.executable).parent
# The interpreter the console scripts run (their first line): part of the launcher's key.
SCRIPT_PYTHON = (BIN / "execute_remote").read_text().splitlines()[0].removeprefix("#!").strip()
KEY_OF = "from ssh_scheduler.cli.warm_place import READY, claim, launcher_key, launcher_path, loading_launchers, running_launchers; from ssh_scheduler.transport.hub_place import hub_key; print(launcher_key(), hub_key())"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher needs Linux (SO_PEERCRED, pidfd)")


class Warm:
    """A private folder with a hub's socket name in it, and a launcher serving there."""

    def __init__(self, runtime: Path, fake_hub: bool = True) -> None:
        self.runtime = runtime
        self.folder = runtime / "ssh_scheduler"
        self.folder.mkdir(mode=0o700)
        self.env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
        self.env[KEEP_WARM_VARIABLE] = "30"
        self.env.pop("PYTHONPATH", None)
        keys = subprocess.run([SCRIPT_PYTHON, "-c", KEY_OF], env=self.env, capture_output=True, text=True, check=True, cwd="/")
        self.key, hub = keys.stdout.split()
        self.hub = self.folder / f"hub-{hub}.sock"
        if fake_hub:
            self.hub.touch()  # the launcher lives while its hub's socket is there
        self.socket = self.folder / f"launcher-{self.key}.sock"
        self.log = self.socket.with_suffix(".log")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [SCRIPT_PYTHON, "-m", "ssh_scheduler.cli.launcher"], env=self.env, stdout=log, stderr=log,
                stdin=subprocess.DEVNULL, cwd="/", start_new_session=True,
            )
        wait_until(self.ready, "the launcher is ready")

    def ready(self) -> bool:
        return self.log.exists() and "launcher ready" in self.log.read_text()

    def launched(self) -> list[int]:
        """The pids of the copies it forked so far (its log)."""
        text = self.log.read_text() if self.log.exists() else ""
        return [int(line.split(" as pid ")[1]) for line in text.splitlines() if " as pid " in line]

    def run(self, *argv: str, cwd: Path, env: dict[str, str] | None = None, script: str = "execute_remote",
            **popen: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / script), *argv], env=env or self.env, cwd=cwd, capture_output=True, text=True, timeout=120,
            **popen,  # type: ignore[call-overload]
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)


@pytest.fixture
def warm() -> Iterator[Warm]:
    runtime = Path(tempfile.mkdtemp(prefix="lch-", dir="/tmp"))  # short: unix socket names are
    place = Warm(runtime)
    try:
        yield place
    finally:
        place.stop()
        shutil.rmtree(runtime, ignore_errors=True)


PROBE = 'echo "FOO=$FOO"; umask; ulimit -Sn; ulimit -Hn; cat in.txt; echo out; echo err >&2; exit 7'


def lowered_limits() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 321), min(hard, 654)))
    os.umask(0o027)


def test_a_command_handed_over_is_the_command_run_in_its_own_process(warm: Warm, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("input here\n")
    env = dict(warm.env, FOO="bar baz")
    # Here first (no launcher yet), then through it: the same to the byte, and the same status.
    here = warm.run(PROBE, "--copy-forwards", "in.txt", "--job-name", "here", cwd=tmp_path, env=env, preexec_fn=lowered_limits)
    assert warm.launched() == []
    warm.start()
    there = warm.run(PROBE, "--copy-forwards", "in.txt", "--job-name", "there", cwd=tmp_path, env=env, preexec_fn=lowered_limits)
    assert len(warm.launched()) == 1
    assert here.returncode == there.returncode == 7
    assert here.stdout == there.stdout == "FOO=bar baz\n0027\n321\n654\ninput here\nout\n"
    assert here.stderr == there.stderr == "err\n"
    # Its results went into the caller's folder, as here.
    for name in ("here", "there"):
        assert (tmp_path / "job_results" / f"{name}.out").read_text().endswith("out\n")
        assert (tmp_path / "job_results" / f"{name}.err").read_text() == "err\n"


def test_a_command_waits_for_a_launcher_that_is_loading(warm: Warm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command right after the one that started a launcher finds it loading (lock taken, no
    socket yet) and waits for it rather than load everything itself.  (The benchmark waits for
    the same state to pass, loading_launchers, before it measures the next tool.)"""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(warm.runtime))
    with open(warm.log, "ab") as log:
        warm.process = subprocess.Popen(
            [SCRIPT_PYTHON, "-m", "ssh_scheduler.cli.launcher"], env=warm.env, stdout=log, stderr=log,
            stdin=subprocess.DEVNULL, cwd="/", start_new_session=True,
        )
    lock = warm.socket.with_suffix(".lock")
    wait_until(lambda: lock.exists() and lock.read_text().strip() == str(warm.process.pid), "the launcher holds its lock")
    loading = loading_launchers()
    assert not warm.ready()  # still loading
    if READY not in lock.read_bytes():  # not loaded after the look, so not during it either
        assert loading == [warm.process.pid]
    done = warm.run("echo waited", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "waited\n")
    assert len(warm.launched()) == 1
    assert loading_launchers() == [] and running_launchers() == [warm.process.pid]


def test_a_command_whose_caller_gave_up_is_never_run_twice(warm: Warm, tmp_path: Path) -> None:
    """A launcher too slow to answer (stopped here) is given up on: the caller runs its command
    itself, and the launcher, once it goes on, must not run it again."""
    warm.start()
    assert warm.process is not None
    warm.process.send_signal(signal.SIGSTOP)
    try:
        done = warm.run(f"echo once >> {tmp_path}/ran.txt", cwd=tmp_path)
    finally:
        warm.process.send_signal(signal.SIGCONT)
    assert done.returncode == 0 and (tmp_path / "ran.txt").read_text() == "once\n"
    wait_until(lambda: "a command not taken" in warm.log.read_text(), "the launcher read the request it was too late for")
    assert warm.launched() == []
    assert (tmp_path / "ran.txt").read_text() == "once\n"


def test_refusals_and_help_are_the_same_through_the_launcher(warm: Warm, tmp_path: Path) -> None:
    cases = [
        ("execute_remote", ["--keep-warm", "abc", "true"]),
        ("execute_batch", ["missing.sh", "--machines", "nowhere.yaml"]),
        ("combine_folders", ["--help"]),
        ("ssh-scheduler", ["hub"]),
    ]
    here = [warm.run(*argv, cwd=tmp_path, script=script) for script, argv in cases]
    warm.start()
    there = [warm.run(*argv, cwd=tmp_path, script=script) for script, argv in cases]
    assert len(warm.launched()) == len(cases)
    for (script, _), a, b in zip(cases, here, there, strict=True):
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr), script
    assert here[0].returncode == 2 and here[0].stderr.startswith("error: Invalid value for '--keep-warm'")


def test_ctrl_c_reaches_the_command_and_a_dead_caller_stops_it(warm: Warm, tmp_path: Path) -> None:
    warm.start()
    # What the job runs ("sleep 47.N") is not in the caller's own arguments: pgrep finds the job only.
    tail = os.getpid() % 1000
    marker = f"sleep 47.{tail}"

    def started() -> subprocess.Popen[str]:
        caller = subprocess.Popen(
            [str(BIN / "execute_remote"), f"sleep $((40 + 7)).{tail}"], env=warm.env, cwd=tmp_path, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        wait_until(lambda: subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0, "the job runs")
        return caller

    # Ctrl-C (SIGINT to the command we started): the job is killed and the command says so.
    caller = started()
    [copy] = warm.launched()
    assert Path(f"/proc/{copy}/comm").read_text() == "execute_remote\n"  # as its own process's name
    caller.send_signal(signal.SIGINT)
    out, err = caller.communicate(timeout=60)
    assert caller.returncode == 130, (out, err)
    assert "cancelled" in err or "interrupted" in err, err
    wait_until(lambda: subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode != 0, "the job ended")
    assert not alive(copy)

    # The caller killed outright: its copy is stopped (SIGTERM: the command's clean stop).
    caller = started()
    caller.kill()
    caller.communicate(timeout=30)
    copy = warm.launched()[-1]
    wait_until(lambda: not alive(copy), "the copy of a killed caller ended")
    wait_until(lambda: subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode != 0, "its job ended")


def test_a_signal_the_caller_ignores_the_command_ignores_too(warm: Warm, tmp_path: Path) -> None:
    """``nohup execute_remote ...``: a closed terminal (SIGHUP) ends neither the caller nor its
    command, as it ends neither when the command runs in its own process."""
    warm.start()
    tail = os.getpid() % 1000
    marker = f"sleep 48.{tail}"
    caller = subprocess.Popen(
        [str(BIN / "execute_remote"), f"sleep $((40 + 8)).{tail}"], env=warm.env, cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    wait_until(lambda: subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0, "the job runs")
    # SIGHUP, then SIGINT: had the hangup reached the command it would have died of it first
    # (a lower signal number is delivered first), not stopped on Ctrl-C as it does here.
    caller.send_signal(signal.SIGHUP)
    caller.send_signal(signal.SIGINT)
    out, err = caller.communicate(timeout=60)
    assert caller.returncode == 130 and "cancelled" in err, (out, err)


def test_a_caller_in_another_context_runs_the_command_itself(warm: Warm, tmp_path: Path) -> None:
    warm.start()
    done = warm.run("echo here", cwd=tmp_path, env=warm.env, preexec_fn=lambda: os.nice(3))
    assert (done.returncode, done.stdout) == (0, "here\n")
    assert warm.launched() == []  # another priority: another key, no launcher of it
    off = dict(warm.env)
    off[KEEP_WARM_VARIABLE] = "0"
    assert warm.run("echo here", cwd=tmp_path, env=off).stdout == "here\n"
    assert warm.launched() == []  # no warm starts asked for
    assert warm.run("echo here", cwd=tmp_path).stdout == "here\n"
    assert len(warm.launched()) == 1


def test_the_launcher_ends_with_its_hub(warm: Warm) -> None:
    warm.start()
    assert warm.process is not None and warm.process.poll() is None
    warm.hub.unlink()  # the hub ended (idle, or hub stop)
    assert warm.process.wait(30) == 0
    assert not warm.socket.exists() and not warm.socket.with_suffix(".lock").exists()


@pytest.mark.namespaces
def test_a_launcher_of_another_user_is_never_told_anything(warm: Warm, tmp_path: Path, cluster4: object) -> None:
    other = pwd.getpwnam(cluster4.other_user())  # type: ignore[attr-defined]
    # A socket at the launcher's name that another user listens on (the peer credentials of a
    # listening socket are those of the process that called listen()).
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(warm.socket))
    told, tell = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(other.pw_gid)
            os.setuid(other.pw_uid)
            listener.listen(5)
            os.write(tell, b"listening\n")
            conn, _ = listener.accept()
            conn.settimeout(10)
            got = b""
            while chunk := conn.recv(1 << 16):
                got += chunk
            os.write(tell, json.dumps({"got": len(got)}).encode() + b"\n")
        finally:
            os._exit(0)
    listener.close()
    os.close(tell)
    with os.fdopen(told) as said:
        try:
            assert said.readline() == "listening\n"
            done = warm.run("echo mine", cwd=tmp_path)
            assert (done.returncode, done.stdout) == (0, "mine\n")  # ran here
            assert json.loads(said.readline()) == {"got": 0}  # reached, its owner seen, told nothing
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert warm.launched() == []


@pytest.mark.namespaces
def test_a_warm_command_leaves_a_launcher_the_next_starts_in_and_it_ends_with_the_hub(cluster4: object, tmp_path: Path) -> None:
    host = cluster4.hosts[0]  # type: ignore[attr-defined]
    runtime = Path(tempfile.mkdtemp(prefix="lch-", dir="/tmp"))
    warm = Warm(runtime, fake_hub=False)
    warm.env[KEEP_WARM_VARIABLE] = "60"
    try:
        for n in (1, 2):
            done = warm.run("hostname", "--machine", str(host.machine_file), cwd=tmp_path)
            assert (done.returncode, done.stdout, done.stderr) == (0, f"{host.name}\n", "")
            if n == 1:  # through the hub; at its end it started a launcher (loading, not waited for)
                assert warm.launched() == [] and warm.hub.exists()
                wait_until(warm.socket.exists, "the first command's launcher listens")
        assert len(warm.launched()) == 1  # the second started in it
        pid = int(warm.socket.with_suffix(".lock").read_text().split()[0])
        # It borrowed its connection from the hub: the launcher never loaded asyncssh (whose
        # cryptography is a shared library in its memory map), which a cold command's start
        # would have paid for beside it.
        assert "cryptography" not in Path(f"/proc/{pid}/maps").read_text()
        shown = warm.run("hub", cwd=tmp_path, script="ssh-scheduler").stdout
        assert f"warm starts: launcher pid {pid} " in shown and "warm connections: 1" in shown
        assert warm.run("hub", "stop", cwd=tmp_path, script="ssh-scheduler").returncode == 0
        wait_until(lambda: not alive(pid), "the launcher ended with its hub")
        assert not warm.socket.exists()
    finally:
        subprocess.run([str(BIN / "ssh-scheduler"), "hub", "stop"], env=warm.env, capture_output=True, timeout=60)
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_command_through_the_hub_starts_its_launcher_as_it_ends_not_while_it_runs(cluster4: object, tmp_path: Path) -> None:
    """The launcher loads (~0.3 s of CPU) after the command, not beside its start: on 2 cores
    that was a cold command's time.  While the first command runs (through the hub) no launcher
    exists; once it ended, one loads and listens."""
    host = cluster4.hosts[1]  # type: ignore[attr-defined]
    runtime = Path(tempfile.mkdtemp(prefix="lch-", dir="/tmp"))
    warm = Warm(runtime, fake_hub=False)
    warm.env[KEEP_WARM_VARIABLE] = "60"
    lock = warm.socket.with_suffix(".lock")
    try:
        command = subprocess.Popen(
            [str(BIN / "execute_remote"), "--machine", str(host.machine_file), "echo begun; sleep 2; echo over"],
            env=warm.env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert command.stdout is not None
            assert command.stdout.readline() == "begun\n"  # connected through the hub, running there
            assert warm.hub.exists() and not lock.exists() and not warm.socket.exists()
            out, err = command.communicate(timeout=120)
        finally:
            if command.poll() is None:
                command.kill()
        assert (command.returncode, out, err) == (0, "over\n", "")
        # Listening (its socket claimed by the command, handed over) before the command ended:
        # the next command, however soon, finds it -- loading, or ready.
        assert warm.socket.exists() and lock.read_bytes().split()[0].isdigit()
        done = warm.run("hostname", "--machine", str(host.machine_file), cwd=tmp_path)
        assert (done.returncode, done.stdout) == (0, f"{host.name}\n")
        assert len(warm.launched()) == 1, warm.log.read_text()
    finally:
        subprocess.run([str(BIN / "ssh-scheduler"), "hub", "stop"], env=warm.env, capture_output=True, timeout=60)
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_launcher_never_serves_a_place_claimed_for_another_key(warm: Warm, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a command claims and hands over (claim) is for that command's key: a launcher of
    another key (another python, flags, environment...) handed it refuses it, and removes the
    socket, whose lock it holds, so no command of that key waits there for nobody."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(warm.runtime))
    other = launcher_path(warm.folder, "0123456789abcdef0123")
    place = claim(other)
    assert place is not None and other.exists()
    lock, listener = place
    args = ["--lock-fd", str(lock), "--listen-fd", str(listener.fileno()), "--key", "0123456789abcdef0123"]
    with open(warm.log, "ab") as log:
        process = subprocess.Popen(
            [SCRIPT_PYTHON, "-m", "ssh_scheduler.cli.launcher", *args], env=warm.env, stdout=log, stderr=log,
            stdin=subprocess.DEVNULL, cwd="/", pass_fds=(lock, listener.fileno()), start_new_session=True,
        )
    listener.close()
    os.close(lock)
    assert process.wait(60) == 0
    assert "handed a place for another key" in warm.log.read_text()
    assert not other.exists() and not warm.socket.exists()
    assert running_launchers() == []


def test_the_keys_hash_is_sha256_without_openssl() -> None:
    """The thin start hashes its keys with python's own SHA-256: the same digests as hashlib's."""
    import hashlib

    for data in (b"", b"abc", bytes(range(256)) * 300):
        digest = sha256()
        digest.update(data)
        assert digest.hexdigest() == hashlib.sha256(data).hexdigest()


def test_the_thin_start_loads_none_of_the_commands() -> None:
    loaded = subprocess.run(
        [SCRIPT_PYTHON, "-c", "import sys, ssh_scheduler.cli.launch; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, cwd="/",
    ).stdout.split()
    # Nor what only names types or logs (typing, dataclasses, logging: 10 ms of every start),
    # nor OpenSSL, nor socket.py.
    heavy = [name for name in loaded if name.split(".")[0] in (
        "asyncio", "asyncssh", "typer", "yaml", "cryptography", "typing", "dataclasses", "logging",
        "_hashlib",  # hashlib's OpenSSL: 5 ms of every start, for a hash python has built in
        "socket", "selectors",  # socket.py's enums and selectors: 5 ms, where _socket does
    )]
    ours = sorted(name for name in loaded if name.startswith("ssh_scheduler"))
    assert heavy == []
    assert ours == [
        "ssh_scheduler", "ssh_scheduler.cli", "ssh_scheduler.cli.launch", "ssh_scheduler.cli.warm_place",
        "ssh_scheduler.transport", "ssh_scheduler.transport.hub_place", "ssh_scheduler.transport.unix_socket",
    ]


def test_the_key_differs_with_what_a_command_would_not_share() -> None:
    assert launcher_key() == launcher_key()
    nice = subprocess.run(
        [SCRIPT_PYTHON, "-c", "import os; os.nice(2); from ssh_scheduler.cli.warm_place import READY, claim, launcher_key, launcher_path, loading_launchers, running_launchers; print(launcher_key())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    same = subprocess.run(
        [SCRIPT_PYTHON, "-c", "from ssh_scheduler.cli.warm_place import READY, claim, launcher_key, launcher_path, loading_launchers, running_launchers; print(launcher_key())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert nice != same


# --- the hub, started first thing -----------------------------------------------------------------


@pytest.mark.parametrize(("entry", "args", "expected"), [
    ("execute_to", ["--machines", "a.yaml", "hostname"], True),
    ("execute_remote", ["hostname", "--machine", "a.yaml"], True),
    ("execute_batch", ["b.sh", "--machines", "a.yaml"], True),
    ("ssh_scheduler", ["doctor", "--machines", "a.yaml"], True),
    ("ssh_scheduler", ["--verbose", "execute-to", "--machines", "a.yaml", "true"], True),
    ("execute_batch", ["b.sh", "--machines", "a.yaml", "--dry-run"], True),  # it probes the hosts
    ("execute_to", ["--help"], False),
    ("execute_to", ["--machines", "a.yaml", "--keep-warm", "0", "hostname"], False),  # no hub at all
    ("execute_remote", ["hostname", "--keep-warm=0", "--machine", "a.yaml"], False),
    ("execute_remote", ["hostname", "--keep-warm", "30", "--machine", "a.yaml"], True),
    ("ssh_scheduler", ["status"], False),
    ("ssh_scheduler", ["hub", "stop"], False),
    ("combine_folders", ["a", "b"], False),
])
def test_only_a_command_that_connects_starts_the_hub_first_thing(entry: str, args: list[str], expected: bool) -> None:
    assert connects(entry, args) is expected


def test_the_command_waits_for_the_hub_it_started_first_thing_and_starts_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="hub-", dir="/tmp"))  # short: unix socket names are
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    try:
        start_early()  # the thin start's call: returns at once
        path = socket_path(private_folder(create=False))

        def no_second(_path: Path) -> None:
            raise AssertionError("a second hub was started")

        monkeypatch.setattr(hub_client, "spawn_hub", no_second)
        hub_client.start_hub(path)  # waits for that one's "ready"
        assert path.exists() and take_early(path) is None
    finally:
        hub_ask.stop_hub()
        shutil.rmtree(runtime, ignore_errors=True)


def test_the_hub_is_no_program_to_run_by_hand() -> None:
    done = subprocess.run([sys.executable, "-m", "ssh_scheduler.transport.hub_server"], capture_output=True, text=True, cwd="/")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "error: the hub is started by the commands that use it (keep_warm); nothing to run by hand\n"


def test_a_hub_started_first_thing_that_listens_already_leaves_no_zombie(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="hub-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    try:
        start_early()
        path = socket_path(private_folder(create=False))
        starting = hub_place._early[path]
        wait_until(path.exists, "the hub listens")  # before the command first reaches it
        sock = asyncio.run(hub_client._reach(path))
        sock.close()
        # Its first process (which forked the hub away and exited) was reaped, its pipe closed.
        assert starting.process.returncode == 0 and take_early(path) is None
    finally:
        hub_ask.stop_hub()
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_first_process_still_there_when_the_hub_is_reached_is_reaped_when_it_ends(tmp_path: Path) -> None:
    async def settle() -> subprocess.Popen[bytes]:
        said, unused = os.pipe()
        os.close(unused)
        first = subprocess.Popen(["sleep", "0.3"])
        path = tmp_path / "hub.sock"
        hub_place._early[path] = hub_place.Starting(path, first, said, tmp_path / "hub.log")
        hub_client._settle_early(path)
        assert first.returncode is None and take_early(path) is None
        while first.returncode is None:  # set by the reaping (never polled here)
            await asyncio.sleep(0.02)
        return first

    assert asyncio.run(asyncio.wait_for(settle(), 30)).returncode == 0
