"""Warm interpreters (agent/warm.py): an ``Executor`` call forked by the host's agent from a
Python it keeps loaded (``call_runner.py --serve``) instead of a Python started for it.  On the
SSH test cluster: the calls of a batch come from one interpreter, each sees what a fresh Python
started for it would (the same machine forced onto the fresh start by a ``setup:`` line is the
reference), ends as a Python's exit would end it, is killed with what it started, and survives
its interpreter being killed; after that the calls start afresh."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import textwrap
import traceback
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ssh_scheduler import CallError, Executor
from tests.cluster import Cluster, Host
from tests.live_batch import wait_until

CHEAP = {"no_gpu_required": True, "num_cpus": 0.1, "memory_required": 10, "out": None}

SEEN = textwrap.dedent(
    '''
    import os, signal, sys, threading, time, atexit, subprocess

    def parent():
        with open("/proc/%d/cmdline" % os.getppid(), "rb") as f:
            return f.read().replace(b"\\0", b" ").decode()

    def seen(number):
        """What the call's process is: its parent, environment, folder, arguments, path..."""
        return {
            "number": number, "parent": parent(), "ppid": os.getppid(), "env": dict(os.environ),
            "cwd": os.getcwd(), "argv": sys.argv, "path": sys.path,
            "own_group": os.getpgid(0) == os.getpid(), "own_session": os.getsid(0) == os.getpid(),
            "umask": os.umask(0o022), "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigpipe": int(signal.getsignal(signal.SIGPIPE)), "sigchld": int(signal.getsignal(signal.SIGCHLD)),
            "fds": sorted(os.listdir("/proc/self/fd")), "stdin": os.path.realpath("/proc/self/fd/0"),
        }

    def leaves(name):
        """Returns at once; a thread (not a daemon) and an atexit function write files after."""
        def later():
            time.sleep(0.3)
            with open("thread.txt", "w") as f:
                f.write(name)
        threading.Thread(target=later).start()
        atexit.register(lambda: open("atexit.txt", "w").write(name))
        print("printed by", name, flush=True)
        return name

    def exits(code):
        sys.exit(code)

    def starts_a_sleeper(home):
        """A grandchild in the call's session, then waits: cancelling the call must end both."""
        child = subprocess.Popen(["sleep", "300"])
        with open(os.path.join(home, "sleeper"), "w") as f:
            f.write("%d %d" % (os.getpid(), child.pid))
        time.sleep(300)

    def gated(home):
        with open(os.path.join(home, "started"), "w") as f:
            f.write("%d %s" % (os.getpid(), parent()))
        while not os.path.exists(os.path.join(home, "gate")):
            time.sleep(0.05)
        return os.getpid()
    '''
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "seen.py").write_text(SEEN)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(folder)
    yield folder
    sys.modules.pop("seen", None)


def with_setup(host: Host, folder: Path) -> str:
    """The host's machine file with a ``setup:`` line that changes nothing: its calls start a
    fresh Python each (their reference)."""
    data = yaml.safe_load(host.machine_file.read_text())
    data["setup"] = ["true"]
    path = folder / f"{host.name}-setup.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def servers(host: Host) -> list[int]:
    """The warm interpreters on the host (its calls look the same in ``ps``: they are forked
    from it, and their parent is one)."""
    rows = [line.split(None, 2) for line in host.run(f"ps -u {host.user} -o pid=,ppid=,args=").stdout.splitlines()]
    serving = {pid for pid, _ppid, args in rows if "call_runner.py --serve" in args}
    return [int(pid) for pid, ppid, _args in rows if pid in serving and ppid not in serving]


def alive(host: Host, pid: int) -> bool:
    return host.run(f"kill -0 {pid}").returncode == 0


def test_calls_fork_from_one_interpreter_and_see_what_a_fresh_python_would(cluster4: Cluster, project: Path) -> None:
    import seen

    host = cluster4[0]
    with Executor([str(host.machine_file)], **CHEAP) as ex:
        warm = list(ex.map(seen.seen, range(6)))
        serving = servers(host)
        with pytest.raises(CallError) as warm_exit:
            ex.submit(seen.exits, 3).result()
    with Executor([with_setup(host, project)], results_dir="fresh", **CHEAP) as ex:
        fresh = list(ex.map(seen.seen, range(2)))
        with pytest.raises(CallError) as fresh_exit:
            ex.submit(seen.exits, 3).result()

    assert [v["number"] for v in warm] == list(range(6))
    assert {v["ppid"] for v in warm} == set(serving) and len(serving) == 1, "one interpreter forks them all"
    assert all("call_runner.py --serve" in v["parent"] for v in warm)
    assert not any("--serve" in v["parent"] for v in fresh)  # the reference started afresh

    def same(value: dict[str, object]) -> dict[str, object]:
        """What must be equal: the job's folder (a name per batch) and its tag (per batch too)
        written as such; who the parent is and the SSH connection's ports left out."""
        folder = str(value["cwd"])
        token = os.path.basename(folder).split("-")[0]

        def plain(item: object) -> object:
            if isinstance(item, dict):
                return {k: plain(v) for k, v in sorted(item.items())}
            if isinstance(item, list):
                return [plain(v) for v in item]
            return item.replace(folder, "<jobdir>").replace(token, "<token>") if isinstance(item, str) else item

        given = value["env"]
        assert isinstance(given, dict)
        env = {k: v for k, v in given.items() if k not in ("SSH_CLIENT", "SSH_CONNECTION")}
        kept = {k: v for k, v in value.items() if k not in ("parent", "ppid", "number", "env")}
        return {k: plain(v) for k, v in (kept | {"env": env}).items()}

    ours, theirs = same(warm[1]), same(fresh[1])
    envs = ours.pop("env"), theirs.pop("env")
    assert isinstance(envs[0], dict) and isinstance(envs[1], dict)
    assert {k: (v, envs[1].get(k)) for k, v in envs[0].items() if envs[1].get(k) != v} == {}
    assert envs[0].keys() == envs[1].keys()
    assert ours == theirs
    assert warm[1]["env"]["PWD"] == warm[1]["cwd"] and warm[1]["own_session"] and warm[1]["stdin"] == "/dev/null"
    assert "SSH_SCHEDULER_WARM_FD" not in warm[1]["env"]
    assert str(warm_exit.value) == str(fresh_exit.value).replace("/fresh/", "/job_results/")
    assert "exit 3" in str(warm_exit.value)


def test_a_warm_call_ends_as_a_python_would(cluster4: Cluster, project: Path) -> None:
    """Its threads are joined and its atexit functions run before it ends (both write files
    that come back with its results); what it prints streams home."""
    import seen

    with Executor([str(cluster4[1].machine_file)], **CHEAP) as ex:
        assert ex.submit(seen.leaves, "one").result() == "one"
        assert servers(cluster4[1])
    results = [p for p in (project / "job_results").iterdir() if p.is_dir() and p.name.startswith("leaves-")]
    (folder,) = results
    assert (folder / "thread.txt").read_text() == "one" and (folder / "atexit.txt").read_text() == "one"
    assert (project / "job_results" / f"{folder.name}.out").read_text() == "printed by one\n"


def test_cancelling_a_warm_call_ends_what_it_started_and_not_the_interpreter(cluster4: Cluster, project: Path) -> None:
    import seen

    host = cluster4[2]
    marker = host.home / "sleeper"
    marker.unlink(missing_ok=True)
    with Executor([str(host.machine_file)], **CHEAP) as ex:
        future = ex.submit(seen.starts_a_sleeper, str(host.home))
        wait_until(lambda: marker.exists() and marker.read_text().count(" ") == 1, "the call runs")
        call, sleeper = (int(x) for x in marker.read_text().split())
        (server,) = servers(host)
        assert alive(host, call) and alive(host, sleeper)
        assert future.cancel()
        wait_until(lambda: not alive(host, call) and not alive(host, sleeper), "the call and its child end", 30)
        assert alive(host, server)  # the interpreter serves the next call
        assert ex.submit(seen.seen, 7).result()["ppid"] == server


def test_a_killed_interpreter_costs_no_call(cluster4: Cluster, project: Path) -> None:
    """The interpreter killed while a call it forked runs: that call still ends with its value
    (the agent, its subreaper, waits for it), and the next call starts a Python afresh."""
    import seen

    host = cluster4[3]
    for name in ("started", "gate"):
        (host.home / name).unlink(missing_ok=True)
    with Executor([str(host.machine_file)], **CHEAP) as ex:
        future = ex.submit(seen.gated, str(host.home))
        wait_until(lambda: (host.home / "started").exists(), "the call runs")
        (server,) = servers(host)
        assert host.run(f"kill -KILL {server}").returncode == 0
        wait_until(lambda: not alive(host, server), "the interpreter is gone")
        (host.home / "gate").write_text("")
        pid, parent = (host.home / "started").read_text().split(" ", 1)
        assert future.result(timeout=60) == int(pid) and "--serve" in parent
        after = ex.submit(seen.seen, 8).result(timeout=60)
        assert "--serve" not in after["parent"] and after["number"] == 8


def test_where_python_does_not_start_the_call_says_so_as_before(cluster4: Cluster, project: Path) -> None:
    """A ``python:`` that is not there: no interpreter starts, and the call runs its own command,
    whose failure names the Python, as without warm interpreters."""
    import seen

    host = cluster4[0]
    data = yaml.safe_load(host.machine_file.read_text())
    data["python"] = "/nonexistent/python3"
    path = project / "nopython.yaml"
    path.write_text(yaml.safe_dump(data))
    with Executor([str(path)], **CHEAP) as ex, pytest.raises(CallError) as failed:
        ex.submit(seen.seen, 9).result(timeout=60)
    assert "left no result (exit 127)" in str(failed.value)
    (err,) = (project / "job_results").glob("seen-*.err")
    assert "/nonexistent/python3: No such file or directory" in err.read_text()


def test_calls_that_travel_as_code_find_cloudpickle_loaded(cluster4: Cluster, project: Path) -> None:
    """A lambda travels as code, which cloudpickle loads: the interpreter has the cloudpickle
    sent with the calls loaded once (from its first call's folder), so a later call does not
    import it again; a call started afresh (the ``setup:`` reference) imports its own copy."""

    def where_cloudpickle_is(_: int) -> tuple[str, str, int]:
        return os.getcwd(), sys.modules["cloudpickle"].__file__ or "", os.getppid()

    host = cluster4[1]
    with Executor([str(host.machine_file)], **CHEAP) as ex:
        first, second = ex.map(lambda x: where_cloudpickle_is(x), range(2))
        (server,) = servers(host)
    with Executor([with_setup(host, project)], results_dir="fresh", **CHEAP) as ex:
        fresh = ex.submit(lambda: where_cloudpickle_is(0)).result()

    assert first[2] == second[2] == server
    assert second[1] == first[1], "both calls have the one cloudpickle the interpreter loaded"
    # ... from the folder of the call it started for (either: they may go at once)
    assert first[1] in {f"{call[0]}/.ssh_scheduler_call/lib/cloudpickle/__init__.py" for call in (first, second)}
    folder, loaded, _ = fresh
    assert loaded.startswith(folder + "/.ssh_scheduler_call/lib/cloudpickle/"), "a fresh Python imports its own"


KEPT_MOD = textwrap.dedent(
    '''
    import os


    def answer():
        return "compiled from this source"


    def fails():
        raise ValueError("raised in kept_mod")


    def code_file():
        return answer.__code__.co_filename, os.getcwd()
    '''
)


def test_a_warm_call_loads_its_modules_from_code_kept_by_their_content(cluster4: Cluster, project: Path) -> None:
    """The code of a module in the call's folder is kept in the work root's ``code`` folder,
    named by the source's hash: a later call runs that code (shown by planting other code under
    the name: it runs), with its own file's path in it (tracebacks show its lines); a kept file
    that is damaged or that others may write is compiled again; a call started afresh neither
    reads nor writes it."""
    import importlib.util
    import marshal

    (project / "kept_mod.py").write_text(KEPT_MOD)
    import kept_mod

    host = cluster4[2]
    code = host.home / ".ssh_scheduler" / "code"
    name = hashlib.sha256(KEPT_MOD.encode()).hexdigest()[:40]

    def entry() -> Path:
        (found,) = code.glob(f"{name}-*")
        return found

    with Executor([with_setup(host, project)], results_dir="fresh", **CHEAP) as ex:
        assert ex.submit(kept_mod.answer).result() == "compiled from this source"
    assert not list(code.glob(f"{name}-*")), "a fresh Python keeps nothing"

    with Executor([str(host.machine_file)], **CHEAP) as ex:
        folder_file, folder = ex.submit(kept_mod.code_file).result()
    assert folder_file == f"{folder}/kept_mod.py"
    kept = entry()
    if not kept.name.endswith(f"-{importlib.util.MAGIC_NUMBER.hex()}-0"):
        pytest.skip("the hosts' python3 is another bytecode version than this one")
    owner = kept.stat()

    def plant(data: bytes | None, mode: int = 0o600) -> None:
        kept.unlink(missing_ok=True)
        if data is None:  # a FIFO under the name: refused, never waited on
            os.mkfifo(kept, mode)
        else:
            kept.write_bytes(data)
        os.chown(kept, owner.st_uid, owner.st_gid)
        kept.chmod(mode)

    planted = compile(KEPT_MOD.replace("compiled from this source", "the kept code"), "elsewhere.py", "exec")
    plant(marshal.dumps(planted))
    with Executor([str(host.machine_file)], results_dir="planted", **CHEAP) as ex:
        assert ex.submit(kept_mod.answer).result() == "the kept code"
        folder_file, folder = ex.submit(kept_mod.code_file).result()
        assert folder_file == f"{folder}/kept_mod.py", "the kept code names this call's file"
        with pytest.raises(ValueError) as failed:
            ex.submit(kept_mod.fails).result()
    shown = "".join(traceback.format_exception(failed.value))  # with the host's traceback, as its cause
    assert f'File "{folder_file.rsplit("/", 2)[0]}/' in shown and "/kept_mod.py\", line 10, in fails" in shown
    assert 'raise ValueError("raised in kept_mod")' in shown  # its source line, found by its path

    spoiled: tuple[tuple[bytes | None, int], ...] = ((marshal.dumps(planted), 0o620), (b"\xe3 not code", 0o600), (b"", 0o600), (None, 0o600))
    for round, (data, mode) in enumerate(spoiled):
        plant(data, mode)  # (each round its own results: a call's result, once there, is its answer)
        # (timeout: a call that waits on a FIFO is killed, and the test fails rather than hangs)
        with Executor([str(host.machine_file)], results_dir=f"round{round}", timeout=30, **CHEAP) as ex:
            assert ex.submit(kept_mod.answer).result() == "compiled from this source", (data, oct(mode))
        assert entry().stat().st_mode & 0o777 == 0o600  # written again, whole

    shutil.rmtree(code)
    code.write_text("a file where the folder would be\n")  # the agent refuses it: calls compile
    try:
        with Executor([str(host.machine_file)], results_dir="no-folder", **CHEAP) as ex:
            assert ex.submit(kept_mod.code_file).result()[0].endswith("/kept_mod.py")
        assert code.read_text() == "a file where the folder would be\n"
    finally:
        code.unlink()
        sys.modules.pop("kept_mod", None)


def test_standard_modules_the_calls_loaded_are_loaded_ahead_unless_the_calls_have_their_own(
    cluster4: Cluster, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standard module a call's module imported (colorsys, which nothing of ours loads) is
    noted in the work root's code folder, and a later interpreter has it loaded before its first
    call; a call whose folder has its own colorsys.py gets that one, as a fresh Python would."""
    (project / "ahead_mod.py").write_text(
        'import sys\n\nALREADY = "colorsys" in sys.modules\n\nimport colorsys  # noqa: E402\n\n\n'
        "def already():\n    return ALREADY, colorsys.__file__\n"
    )
    import ahead_mod

    host = cluster4[3]
    noted = host.home / ".ssh_scheduler" / "code" / "imports"
    noted.unlink(missing_ok=True)
    with Executor([str(host.machine_file)], results_dir="first", **CHEAP) as ex:
        already, where = ex.submit(ahead_mod.already).result()
    assert not already and where.endswith("/colorsys.py") and "/.ssh_scheduler/" not in where
    assert "colorsys" in noted.read_text().split()
    assert set(noted.read_text().split()) <= set(sys.stdlib_module_names)
    with Executor([str(host.machine_file)], results_dir="second", **CHEAP) as ex:
        assert ex.submit(ahead_mod.already).result()[0], "loaded by the interpreter before the call"

    other = tmp_path / "other"
    other.mkdir()
    (other / "colorsys.py").write_text("OWN = True\n")
    (other / "uses_own.py").write_text(
        "import colorsys\n\n\ndef own():\n    return getattr(colorsys, 'OWN', False), colorsys.__file__\n"
    )
    monkeypatch.syspath_prepend(str(other))
    monkeypatch.chdir(other)
    monkeypatch.delitem(sys.modules, "colorsys")  # (put back after: this process's own colorsys)
    import uses_own

    before = noted.read_text().split()
    with Executor([str(host.machine_file)], **CHEAP) as ex:
        own, where = ex.submit(uses_own.own).result()
    assert own and where.endswith("/colorsys.py") and "/.ssh_scheduler/jobs/" in where, where
    assert noted.read_text().split().count("colorsys") == before.count("colorsys")  # its own is not noted
    for name in ("ahead_mod", "uses_own"):
        sys.modules.pop(name, None)


def test_a_zip_on_the_calls_path_still_imports_through_zipimport(cluster4: Cluster, project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept code's finder takes the call's folders only: a .zip among its sys.path entries
    stays zipimport's, as for a fresh Python."""
    archive = project / "deps.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("zipped_mod.py", "def where():\n    return __file__\n")
    monkeypatch.syspath_prepend(str(archive))
    import zipped_mod

    try:
        with Executor([str(cluster4[0].machine_file)], **CHEAP) as ex:
            assert ex.submit(zipped_mod.where).result().endswith("/deps.zip/zipped_mod.py")
    finally:
        sys.modules.pop("zipped_mod", None)
