"""Errors that name the cause, through the real CLI on the SSH test cluster: a host that is
reached but cannot run our agent (no python3 on the login PATH, one too old, a read-only home)
says what failed there and the fix, not "no host could be reached"; and every command runs user
commands with the same shell (bash without ~/.bashrc), whatever the login shell."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import asyncssh
import pytest

from ssh_scheduler import agent
from ssh_scheduler.coordinator.fleet import killable
from ssh_scheduler.machines.machine import DEFAULT_MAX_SESSIONS, DEFAULT_PORT, DEFAULT_WORKDIR
from ssh_scheduler.machines.machine_yaml import MACHINE_KEYS
from tests.cluster import Cluster, HostSpec
from tests.test_agent_boot import TOO_OLD, old_python
from tests.test_fleet_unit import finish, start_killable
from tests.test_hub_cluster import hub  # noqa: F401  (a fixture)
from tests.test_view_cluster import NO_GPU, cli, machine_variant

REPO = Path(__file__).resolve().parents[1]

NO_PYTHON = (
    "python3 was not found on the host (bash: line 1: exec: python3: not found); fix: install "
    "python3 (Debian/Ubuntu: apt install python3) or put it on the PATH of non-interactive ssh logins"
)


def read_only_home(cluster: Cluster, index: int) -> str:
    """Make host ``index``'s home a read-only mount (inside the host only); return the message
    the user must see."""
    host = cluster.hosts[index]
    host.run(f"mount --bind {host.home} {host.home} && mount -o remount,bind,ro {host.home}", check=True)
    probe = host.run("touch ~/x", user=host.user)
    assert probe.returncode != 0 and "Read-only file system" in probe.stderr  # the fault is real
    return (
        f"{host.name}: cannot create the work root ~/.ssh_scheduler ({host.home}/.ssh_scheduler): "
        "Read-only file system; fix: set workdir: in the machine YAML to a folder this user can write"
    )


def no_python_on_path(cluster: Cluster, index: int) -> None:
    """The host's login shell (bash, which reads ~/.bashrc over ssh) gets a PATH without python3."""
    host = cluster.hosts[index]
    (host.home / ".bashrc").write_text("PATH=/nonexistent\n")
    probe = subprocess.run(host.ssh_argv("command -v python3 || echo missing"), capture_output=True, text=True, timeout=30)
    assert probe.stdout.strip() == "missing"  # the fault is real: that login has no python3


@pytest.mark.namespaces  # per-host homes and mounts: the namespaced cluster
def test_hosts_reached_but_unusable_say_why_and_the_fix(make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    cluster = make_cluster(3)
    read_only = read_only_home(cluster, 0)
    no_python_on_path(cluster, 1)
    (tmp_path / "b.sh").write_text("echo hi\n")
    bad = [str(p) for p in cluster.machine_files[:2]]

    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", *bad, *NO_GPU)
    assert done.returncode == 255 and done.stdout == "" and "Traceback" not in done.stderr
    h2 = cluster.hosts[1].name
    *warnings, error = done.stderr.splitlines()
    assert sorted(warnings) == sorted([f"warning: {read_only}", f"warning: {h2}: {NO_PYTHON}"]), done.stderr
    assert error in (  # the hosts in the order their answers came
        f"error: no host could be used, nothing was run: {read_only}; {h2}: {NO_PYTHON}",
        f"error: no host could be used, nothing was run: {h2}: {NO_PYTHON}; {read_only}",
    )
    assert "reached" not in done.stderr and "agent exited" not in done.stderr
    assert not (cluster.hosts[0].home / ".ssh_scheduler").exists()

    # Nothing lost: with a good host beside them the batch runs there, the others named.
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", *bad, str(cluster.machine_files[2]), *NO_GPU, "--results-dir", "r2")
    assert done.returncode == 0, done.stderr
    assert f"warning: {read_only}" in done.stderr.splitlines()
    assert (tmp_path / "r2" / "b.sh.1.out").read_text() == "hi\n"

    # The fix the message gives works: a writable workdir on the read-only-home host.
    fixed = machine_variant(cluster, 0, tmp_path / "fixed.yaml", workdir="/tmp/sshs-work")
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(fixed), *NO_GPU, "--results-dir", "r3")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "r3" / "b.sh.1.out").read_text() == "hi\n"


@pytest.mark.namespaces
def test_a_python3_too_old_for_the_agent_is_named_with_the_fix(make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    cluster = make_cluster(1)
    host = cluster.hosts[0]
    (host.home / "oldpy").mkdir()
    old_python(host.home / "oldpy", "/usr/bin/python3")
    (host.home / ".bashrc").write_text(f"PATH={host.home}/oldpy:$PATH\n")
    probe = subprocess.run(host.ssh_argv("python3 -c 'import sys; print(sys.version_info[:2])'"), capture_output=True, text=True, timeout=30)
    assert probe.stdout.strip() == "(3, 6)"  # the fault is real: that login's python3 says 3.6
    (tmp_path / "b.sh").write_text("echo hi\n")
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(cluster.machine_files[0]), *NO_GPU)
    cause = f"{host.name}: {TOO_OLD}"
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (255, "", [
        f"warning: {cause}", f"error: no host could be used, nothing was run: {cause}",
    ])


@pytest.mark.namespaces
def test_a_workdir_nobody_may_create_is_named_with_its_error(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[0]
    locked = host.dir / "locked"  # root's, 0555: the host's user may not create anything in it
    locked.mkdir(mode=0o555, exist_ok=True)
    bad = machine_variant(cluster4, 0, tmp_path / "bad.yaml", workdir=f"{locked}/work")
    (tmp_path / "b.sh").write_text("echo hi\n")
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(bad), *NO_GPU)
    cause = (
        f"{host.name}: cannot create the work root {locked}/work: Permission denied; fix: set workdir: "
        "in the machine YAML to a folder this user can write"
    )
    assert (done.returncode, done.stderr.splitlines()) == (255, [
        f"warning: {cause}", f"error: no host could be used, nothing was run: {cause}",
    ])
    assert not (locked / "work").exists()


BASHRC = 'echo "bashrc says hi"\necho "bashrc on stderr" >&2\n'
BASH_ONLY = '[[ "$BASH_VERSION" == [0-9]* ]] && echo "bash ok"'


@pytest.mark.namespaces
def test_one_shell_for_every_command_and_a_printing_bashrc_prints_once(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = make_cluster(2)
    h1, h2 = cluster.hosts
    for host in cluster.hosts:
        (host.home / ".bashrc").write_text(BASHRC)
    # h2 logs in with dash: the command must still run under bash ([[ fails under dash).
    subprocess.run(["usermod", "-s", "/bin/sh", h2.user], check=True, capture_output=True, timeout=30)
    login = subprocess.run(h2.ssh_argv('[ -z "$BASH_VERSION" ] && echo dash'), capture_output=True, text=True, timeout=30)
    assert login.stdout.strip() == "dash"  # the fault is real: that login shell is not bash
    files = [str(p) for p in cluster.machine_files]

    done = cli(tmp_path, "execute_to", BASH_ONLY, "--machines", *files)
    assert done.returncode == 0, done.stderr
    # h1's login shell (bash, as sshd starts it) reads ~/.bashrc once; the command's shell does not.
    assert sorted(done.stdout.splitlines()) == sorted([f"{h1.name}: bashrc says hi", f"{h1.name}: bash ok", f"{h2.name}: bash ok"])
    assert sorted(done.stderr.splitlines()) == sorted([f"{h1.name}: bashrc on stderr", "exit 0: h[1-2]"])

    (tmp_path / "b.sh").write_text(BASH_ONLY + "\n" + BASH_ONLY + "\n")
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", *files, *NO_GPU)
    assert done.returncode == 0, done.stderr
    for job in ("b.sh.1", "b.sh.2"):  # the job's output is the job's, not ~/.bashrc's
        assert (tmp_path / "job_results" / f"{job}.out").read_text() == "bash ok\n"
        assert (tmp_path / "job_results" / f"{job}.err").read_text() == ""  # nothing on stderr


def test_readme_lists_every_machine_key_with_its_default_and_a_route_that_installs_on_debian() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme.split("| key | meaning | default |", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("|")[1].strip(" `"): line.split("|")[3].strip() for line in table.splitlines()[2:]}
    assert sorted(rows) == sorted(MACHINE_KEYS)
    assert (rows["port"], rows["workdir"], rows["max_sessions"]) == (f"`{DEFAULT_PORT}`", f"`{DEFAULT_WORKDIR}`", f"`{DEFAULT_MAX_SESSIONS}`")
    assert all(rows.values())  # every key has a default (or says it is required / none)
    # The install route that works on an externally managed system Python, and the example's venv.
    assert "python3 -m venv ~/.venvs/ssh-scheduler && ~/.venvs/ssh-scheduler/bin/pip install -e ." in readme
    assert "pipx install -e ." in readme
    assert ".venv/bin/execute_batch" in readme and "`source .venv/bin/activate`" in readme


async def second_session_refused(cluster: Cluster) -> bool:
    host = cluster.hosts[0]
    async with asyncssh.connect(
        host.ip, port=host.port, username=host.user, client_keys=[str(cluster.key_path)], known_hosts=str(cluster.known_hosts)
    ) as conn:
        first = await conn.create_process("sleep 30")
        try:
            await conn.create_process("sleep 30")
        except asyncssh.ChannelOpenError:
            return True
        finally:
            first.close()
        return False


@pytest.mark.namespaces
def test_a_host_allowing_one_session_is_refused_with_the_fix(make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    cluster = make_cluster([HostSpec(max_sessions=1)])
    host = cluster.hosts[0]
    (tmp_path / "b.sh").write_text("echo hi\n")
    assert "MaxSessions 1\n" in (host.dir / "sshd_config").read_text()
    assert asyncio.run(second_session_refused(cluster))  # the fault is real

    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(cluster.machine_files[0]), *NO_GPU)
    cause = (
        f"{host.name}: sshd refused a second session on the connection (open failed; is its MaxSessions 1?): "
        "ssh_scheduler needs 2 per host, one for its agent and one for file transfers; fix: set MaxSessions 2 "
        "or more in the host's sshd_config (the default is 10)"
    )
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (255, "", [
        f"warning: {cause}", f"error: no host could be used, nothing was run: {cause}",
    ])

    # max_sessions: 1 in the machine YAML: refused before connecting, in one line.
    one = machine_variant(cluster, 0, tmp_path / "one.yaml", max_sessions="1")
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(one), *NO_GPU, "--results-dir", "r2")
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: {host.name}: max_sessions is 1, but a batch needs 2 ssh sessions per host (its agent and file "
        "transfers); fix: set MaxSessions 2 or more in the host's sshd_config and max_sessions: 2 or more in the machine YAML"
    ]
    # execute_to needs one session per host: it works there.
    done = cli(tmp_path, "execute_to", "echo hi", "--machines", str(one))
    assert (done.returncode, done.stdout) == (0, f"{host.name}: hi\n"), done.stderr


def test_execute_to_runs_bash_whatever_shell_parses_its_one_line() -> None:
    line = killable(BASH_ONLY)
    assert "\n" not in line and line.startswith("exec /bin/sh -c ")  # tcsh and fish parse it too
    for path in (os.environ["PATH"], "/nonexistent"):  # with the usual programs, and with none
        with start_killable(BASH_ONLY, PATH=path, SHELL="/bin/dash") as proc:
            assert finish(proc) == (0, b"bash ok\n", b""), path
    # Every line of the watchdog ends a command, so the one line means what the file says:
    # each shell that may be /bin/sh reads the same commands from both.
    text = (Path(agent.__file__).parent / "watchdog.sh").read_text()
    commands = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert commands and all(c.endswith((";", "&")) for c in commands)
    for shell in ("/bin/dash", "/bin/bash"):
        assert subprocess.run([shell, "-n", "-c", " ".join(commands)]).returncode == 0, shell


@pytest.mark.namespaces
def test_doctor_names_a_host_without_python3_and_the_fix(make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    cluster = make_cluster(2)
    no_python_on_path(cluster, 1)
    good, bare = cluster.hosts
    done = cli(tmp_path, "doctor", "--machines", *(str(p) for p in cluster.machine_files))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    row = {line.split()[0]: line.split() for line in lines[1:3]}
    assert row[good.name][1:4] == ["yes", "yes", "yes"] and row[good.name][4].startswith("3.")
    assert row[bare.name][1:4] == ["yes", "yes", "yes"] and row[bare.name][4] == "NO"
    problems = lines[3:]
    # Only the bare host has problems (its PATH lacks the other tools too, e.g. df), and python3's
    # is named first with its fix.
    assert {p.split(":", 1)[0] for p in problems} == {bare.name}
    assert "python3 does not run" in problems[0] and "apt install python3" in problems[0]


@pytest.mark.namespaces
@pytest.mark.parametrize("through", ["direct", "hub"])
def test_a_host_whose_sftp_server_never_answers_is_left_out_not_waited_for(
    make_cluster: Callable[..., Cluster], tmp_path: Path, request: pytest.FixtureRequest, through: str
) -> None:
    """The file channel opens but its server never answers (sshd runs a command that says
    nothing): the host is lost after 3 x connect_timeout, said as such, and the batch runs on
    the other host.  Without the bound the opening waited without end, directly and through a
    hub, and the host was silently never used."""
    if through == "hub":
        request.getfixturevalue("hub")  # this test's own hub, stopped after
    cluster = make_cluster([HostSpec(), HostSpec(sftp_server="/bin/sleep 600")])
    (tmp_path / "b.sh").write_text("sleep 4\nsleep 4\n")
    silent = machine_variant(cluster, 1, tmp_path / "silent.yaml", connect_timeout="1")
    done = cli(tmp_path, "execute_batch", "b.sh", "--machines", str(cluster.machine_files[0]), str(silent),
               *NO_GPU, "--reserve", timeout=60)
    host = cluster.hosts[1]
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("finished: ") == 2
    assert f"{host.name} ({host.user}@{host.ip}): its SFTP channel did not answer within 3 s" in done.stderr
