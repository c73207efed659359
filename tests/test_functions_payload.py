"""A Python call's trip without hosts: pickled here (functions/payload.py), run by the call runner
(agent/call_runner.py) in a job folder staged as the executors stage it, read back
(functions/outcome.py).  The runner runs in a subprocess of a real Python: this one, and another
minor version where one is installed (tests/other_python.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError, SchedulerError
from ssh_scheduler.executors import python_call
from ssh_scheduler.executors.base import RunRequest, shell_line
from ssh_scheduler.executors.python_call import runner_files, warm_interpreter
from ssh_scheduler.functions.outcome import CallError, RemoteError, RemoteTraceback, read_outcome
from ssh_scheduler.functions.payload import PickledCall, pickle_call
from ssh_scheduler.jobs.python_call import INFO, PAYLOAD, RESULT, RUNNER, PythonCall
from ssh_scheduler.machines.machine_yaml import parse_machine_yaml
from tests.other_python import find_other_python, other_python

OFFSET = 3


def add(a: int, b: int = 0) -> int:
    return a + b


def job_folder(results: Path, call: PickledCall, *, module: Path | None = None) -> Path:
    """The call's folder as a host has it: the runner, cloudpickle and the pickle staged, and
    ``module`` (a file of the copied-forward folder) beside them."""
    folder = results / call.name
    for f in runner_files():
        (folder / f.rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f.path, folder / f.rel)
    shutil.copy(call.work.path, folder / PAYLOAD)
    if module is not None:
        shutil.copy(module, folder / module.name)
    return folder


def run_call(folder: Path, python: str | Path = sys.executable) -> subprocess.CompletedProcess[str]:
    """The call's job line, as executors/base.shell_line writes it for the machine's python."""
    request = RunRequest(name=folder.name, work=PythonCall(folder / PAYLOAD, "", 0), jobdir=str(folder))
    # A host's Python writes bytecode beside the modules it imports unless told not to (here
    # too, where this environment may say otherwise): the line's -B is what stops it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return subprocess.run(
        ["bash", "--norc", "-c", shell_line(request, str(python))], cwd=folder, capture_output=True, text=True,
        timeout=120, env=env,
    )  # fmt: skip


def test_the_call_line_runs_the_runner_with_the_machines_python_after_its_setup() -> None:
    request = RunRequest(name="j", work=PythonCall(Path("x"), "", 0), jobdir="/w/j", setup=("export A=1",))
    line = shell_line(request, "~/venvs/exp/bin/python")
    assert line.startswith("export A=1\n") and line.endswith(
        f"\nexec ~/venvs/exp/bin/python -B -u {RUNNER} {PAYLOAD} {RESULT} {INFO}"
    )
    assert shell_line(request, "/opt/my env/python").endswith(f"exec '/opt/my env/python' -B -u {RUNNER} {PAYLOAD} {RESULT} {INFO}")
    assert parse_machine_yaml("ip: h\npython: ~/venvs/exp/bin/python\n", source="m.yaml").python == "~/venvs/exp/bin/python"
    assert parse_machine_yaml("ip: h\n", source="m.yaml").python == "python3"
    with pytest.raises(ConfigError, match=r"m.yaml line 2: 'python' must be one interpreter, .* got 'python3; rm -rf ~'"):
        parse_machine_yaml("ip: h\npython: 'python3; rm -rf ~'\n", source="m.yaml")


def test_a_warm_interpreter_is_told_apart_by_its_runner_and_its_cloudpickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """It keeps the cloudpickle of its first call loaded (call_warm.preload): a call sent with
    another cloudpickle must go to another interpreter, so that file is in its key (its start)."""
    request = RunRequest(name="j", work=PythonCall(Path("x"), "", 0), jobdir="/w/j")
    warm = warm_interpreter(request, "python3", {})
    assert warm is not None and " --serve " in warm.start
    files = runner_files()
    assert any(f.rel.endswith("cloudpickle/__init__.py") for f in files)
    for changed in range(len(files)):
        other = tuple(dataclasses.replace(f, key=f"{f.key}x") if at == changed else f for at, f in enumerate(files))
        monkeypatch.setattr(python_call, "runner_files", lambda other=other: other)
        moved = warm_interpreter(request, "python3", {})
        assert moved is not None and moved.start != warm.start, files[changed].rel


def info(folder: Path) -> dict[str, object]:
    found: dict[str, object] = json.loads((folder / INFO).read_text())
    return found


def pickled(tmp_path: Path, function: object, *args: object, base: Path | None = None, **kwargs: object) -> PickledCall:
    (tmp_path / "payloads").mkdir(exist_ok=True)
    return pickle_call(function, args, kwargs, tmp_path / "payloads", base or tmp_path)


def test_a_call_travels_by_name_or_by_value_and_its_name_is_its_resume_key(tmp_path: Path) -> None:
    by_name = pickled(tmp_path, add, 1, b=2)
    assert not by_name.holds_code and by_name.name.startswith("add-")
    assert by_name.description == "python tests.test_functions_payload.add(1, b=2)"
    # the same call pickled again (a rerun of the script) has the same name; other arguments,
    # another function, or a run that does not resume (a salt) another
    assert pickled(tmp_path, add, 1, b=2).name == by_name.name
    assert pickled(tmp_path, add, 1, b=3).name != by_name.name
    assert pickle_call(add, (1,), {"b": 2}, tmp_path / "payloads", tmp_path, salt="run2").name != by_name.name
    offset = 10

    def closure(x: int) -> int:
        return x + offset

    for by_value in (pickled(tmp_path, lambda x: x + OFFSET, 1), pickled(tmp_path, closure, 1)):
        assert by_value.holds_code  # bytecode: only the same minor version loads it
    assert pickled(tmp_path, closure, 1).name == pickled(tmp_path, closure, 1).name
    assert pickled(tmp_path, closure, 1).name.startswith("closure-")  # the outer name is too long to add
    header = json.loads(by_name.work.path.read_bytes().split(b"\n", 1)[0])
    assert header["python"] == list(sys.version_info[:3]) and header["code"] is False
    assert by_name.work.key.endswith("-r") and by_name.work.size == by_name.work.path.stat().st_size


def test_a_call_that_does_not_pickle_here_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SchedulerError, match=r"cannot send python .*add\(<lock>\) to a host: it does not pickle \(TypeError: cannot pickle '_thread.lock' object\); fix: "):
        pickled(tmp_path, add, threading.Lock())


@pytest.fixture
def calc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module of the user's, in the folder the executor copies forward (and only there)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "calc.py").write_text("def add(a, b=0):\n    return a + b\n")
    monkeypatch.syspath_prepend(str(project))
    return project / "calc.py"


@pytest.mark.parametrize("python", ["this", "another minor version"])
def test_the_runner_gives_back_a_value_and_an_exception_as_itself(tmp_path: Path, calc: Path, python: str) -> None:
    """A function that travels by name runs on any Python 3.8+ that has its module (the
    runner brings cloudpickle along); its exception comes back as itself with its traceback."""
    import calc as module  # type: ignore[import-not-found]

    command: str | Path = sys.executable
    if python != "this":
        found = find_other_python()
        command = found[0] if found is not None else other_python(tmp_path / "other").command
    results = tmp_path / "results"
    call = pickled(tmp_path, module.add, 2, b=3, base=calc.parent)
    folder = job_folder(results, call, module=calc)
    done = run_call(folder, command)
    assert done.returncode == 0, done.stderr
    assert read_outcome(results, call.name, "h1").value == 5
    assert not list(folder.rglob("__pycache__"))  # -B: the user's modules leave no bytecode among the results

    failing = pickled(tmp_path, module.add, 2, b="x", base=calc.parent)
    folder = job_folder(results, failing, module=calc)
    assert run_call(folder, command).returncode == 1
    error = read_outcome(results, failing.name, "h1").error
    assert isinstance(error, TypeError) and "unsupported operand" in str(error)
    assert isinstance(error.__cause__, RemoteTraceback)
    shown = "".join(traceback.format_exception(error))
    assert "in add\n    return a + b" in shown and "raised by call add-" in shown and " on h1" in shown
    assert "call_runner.py" not in shown  # the traceback there starts at the call


def test_code_pickled_by_another_minor_version_is_refused_before_it_is_unpickled(tmp_path: Path) -> None:
    other = other_python(tmp_path / "other")
    results = tmp_path / "results"
    call = pickled(tmp_path, lambda x: x + OFFSET, 1)
    folder = job_folder(results, call)
    done = run_call(folder, other.command)
    assert done.returncode == 3, done.stderr
    here = ".".join(map(str, sys.version_info[:3]))
    assert info(folder)["kind"] == "refused"
    message = str(read_outcome(results, call.name, "h2").error)
    assert message.startswith("h2: cannot run this call here: tests.test_functions_payload.")
    assert f"pickled by Python {here}, and this host's Python is " in message and f"(Python 3.{other.minor}." in message
    assert f"fix: set python: in the machine's YAML to a Python 3.{sys.version_info[1]} there" in message
    assert "\n" not in message and "Traceback" not in done.stderr  # one line, never a pickle traceback
    if other.real:
        # The check is what stands between the call and a crash: told the pickle holds no
        # code, that Python tries to load this one's bytecode (and 3.12 dies of 3.11's with
        # SIGSEGV, leaving no word of what happened).
        payload = folder / PAYLOAD
        head, rest = payload.read_bytes().split(b"\n", 1)
        payload.chmod(0o644)
        payload.write_bytes(json.dumps({**json.loads(head), "code": False}).encode() + b"\n" + rest)
        (folder / INFO).unlink()
        unchecked = run_call(folder, other.command)
        assert unchecked.returncode != 0 and not (folder / INFO).exists(), (unchecked.returncode, unchecked.stderr)


def test_a_module_missing_on_the_host_is_named_with_the_fix(tmp_path: Path, calc: Path) -> None:
    import calc as module

    results = tmp_path / "results"
    call = pickled(tmp_path, module.add, 2, base=calc.parent)
    assert json.loads(call.work.path.read_bytes().split(b"\n", 1)[0])["path"] == ["."]
    missing = job_folder(results, call)  # not copied forward, not installed there
    assert run_call(missing).returncode == 3
    message = str(read_outcome(results, call.name, "h3").error)
    assert message.startswith("h3: cannot load this call here: calc.add needs the module 'calc', which ")
    assert "does not find on this host; fix: put the module in the copied-forward folder" in message


def test_an_exception_that_does_not_unpickle_here_stands_in_with_its_traceback(tmp_path: Path) -> None:
    """Its class exists only where the call ran: a :class:`RemoteError` with its type, message
    and traceback; one whose state does not pickle there is told the same way."""

    def raise_there() -> None:
        import hostonly  # type: ignore[import-not-found]

        raise hostonly.Refusal("no")

    results = tmp_path / "results"
    call = pickled(tmp_path, raise_there)
    folder = job_folder(results, call)
    (folder / "hostonly.py").write_text("class Refusal(Exception):\n    pass\n")
    assert run_call(folder).returncode == 1
    error = read_outcome(results, call.name, "h4").error
    assert isinstance(error, RemoteError) and isinstance(error, CallError)
    assert error.type_name == "hostonly.Refusal" and error.remote_message == "no"
    assert str(error).startswith("hostonly.Refusal: no (raised by call raise_there-")
    assert "No module named 'hostonly'" in str(error) and "in raise_there\nhostonly.Refusal: no" in error.traceback

    def raise_unpicklable() -> None:
        error = ValueError("with a lock")
        error.lock = threading.Lock()  # type: ignore[attr-defined]
        raise error

    call = pickled(tmp_path, raise_unpicklable)
    folder = job_folder(results, call)
    assert run_call(folder).returncode == 1
    error = read_outcome(results, call.name, "h4").error
    assert isinstance(error, RemoteError) and error.type_name == "builtins.ValueError"
    assert "cannot pickle '_thread.lock' object" in str(error)


def test_a_value_that_does_not_pickle_there_is_the_calls_error(tmp_path: Path) -> None:
    results = tmp_path / "results"
    call = pickled(tmp_path, lambda: (x for x in range(3)))
    folder = job_folder(results, call)
    assert run_call(folder).returncode == 1
    error = read_outcome(results, call.name, "h5").error
    assert isinstance(error, TypeError) and "cannot pickle 'generator' object" in str(error)


def test_a_call_that_left_no_result_is_one_line_naming_its_output(tmp_path: Path) -> None:
    (tmp_path / "results" / "gone-1").mkdir(parents=True)
    error = read_outcome(tmp_path / "results", "gone-1", "h6", "timed out after 5 s").error
    assert str(error) == (
        f"call gone-1 on h6 left no result (timed out after 5 s); its output is in "
        f"{tmp_path / 'results' / 'gone-1'}.out and .err"
    )


def test_the_runner_refuses_a_damaged_call(tmp_path: Path) -> None:
    results = tmp_path / "results"
    call = pickled(tmp_path, add, 1)
    folder = job_folder(results, call)
    (folder / PAYLOAD).chmod(0o644)
    (folder / PAYLOAD).write_bytes(b"not json\n")
    assert run_call(folder).returncode == 3
    assert str(read_outcome(results, call.name, "h7").error) == "h7: the call arrived damaged (its header is not JSON)"


def test_what_the_runner_sends_home_is_only_its_result(tmp_path: Path, calc: Path) -> None:
    """The runner writes its result and how it ended, nothing else of ours (the staged inputs
    stay as they came: the copy back leaves untouched inputs on the host)."""
    import calc as module

    results = tmp_path / "results"
    call = pickled(tmp_path, module.add, 1, base=calc.parent)
    folder = job_folder(results, call, module=calc)
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}
    assert run_call(folder).returncode == 0
    after = {p for p in folder.rglob("*") if p.is_file()}
    assert after - set(before) == {folder / RESULT, folder / INFO}
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())


# (a huge RESULT is a large value, read as a stream: only INFO has a bound)
@pytest.mark.parametrize(("where", "planted"), [(INFO, "link"), (INFO, "fifo"), (INFO, "huge"), (RESULT, "link"), (RESULT, "fifo")])
def test_a_result_in_the_results_folder_is_read_as_untrusted_input(tmp_path: Path, planted: str, where: str) -> None:
    """A rerun reads finished calls from the results folder, which may be a copy or a shared disk
    (results/untrusted): a link there is not followed, a FIFO not waited on, nothing huge read; the
    call's future gets one line naming the file, not a hang or another file's content."""
    results = tmp_path / "results"
    call = pickled(tmp_path, lambda a, b: a + b, 1, 2)  # (by value: the host has no tests package)
    folder = job_folder(results, call)
    assert run_call(folder).returncode == 0
    assert read_outcome(results, call.name, "h8").value == 3
    elsewhere = tmp_path / "elsewhere"
    shutil.copy(folder / where, elsewhere)  # a whole, valid copy: following the link would read it
    (folder / where).unlink()
    if planted == "link":
        (folder / where).symlink_to(elsewhere)
    elif planted == "fifo":
        os.mkfifo(folder / where)
    else:
        (folder / where).write_bytes(b" " * (2 << 20) + elsewhere.read_bytes())
    error = read_outcome(results, call.name, "h8").error
    assert isinstance(error, CallError) and "\n" not in str(error), error
    assert str(error).startswith(f"call {call.name}: {folder / where} (a call's ")


def test_only_folders_that_exist_join_the_calls_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folders of this script's sys.path inside the copied-forward folder go to the host's
    sys.path; an editable install's finder puts a made-up entry there ("__editable__...
    __path_hook__", relative, so inside the folder), which is nothing and stays home."""
    from ssh_scheduler.functions.payload import _import_folders

    monkeypatch.chdir(tmp_path)  # the script runs in its folder: a relative entry lies in it
    (tmp_path / "src").mkdir()
    (tmp_path / "deps.zip").write_bytes(b"PK\x05\x06" + bytes(18))  # a zip on sys.path: importable, kept
    path = (str(tmp_path / "src"), "__editable__.pkg-0.1.0.finder.__path_hook__", str(tmp_path / "deps.zip"), "")
    assert _import_folders(tmp_path, path, str(tmp_path)) == ("src", "deps.zip", ".")
