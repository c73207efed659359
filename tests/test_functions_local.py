"""``ssh_scheduler.Executor`` on this machine (no machines given: no SSH, this Python): what a
call is, resume, cancel, the options and the ``concurrent.futures`` contract.  The same calls
on the SSH test cluster: tests/test_functions_cluster.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssh_scheduler import CallError, Executor
from ssh_scheduler.errors import ConfigError, SchedulerError
from ssh_scheduler.events import BatchStarted, Event, EventBus, JobsAdded, JobSkipped, JobStarted
from ssh_scheduler.results.batch_history import read_history
from ssh_scheduler.results.event_log import CANCELLED_LINE

CHEAP = {"no_gpu_required": True, "num_cpus": 0.1, "memory_required": 10}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A user's folder: a module of their own in it (not installed anywhere), the folder the
    executor copies forward and keeps its results in."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "experiment.py").write_text(
        "import os\n\n"
        "class Diverged(Exception):\n    pass\n\n\n"
        "def train(lr, log=None):\n"
        "    if log:\n"
        "        with open(log, 'a') as f:\n            f.write(f'{lr}\\n')\n"
        "    if lr > 1:\n        raise Diverged(f'lr {lr} is too high')\n"
        "    return {'lr': lr, 'loss': 1 / (1 + lr), 'cwd': os.getcwd()}\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(folder)
    yield folder
    sys.modules.pop("experiment", None)


def test_closures_lambdas_own_modules_and_exceptions_round_trip(project: Path) -> None:
    import experiment  # type: ignore[import-not-found]

    scale = 3
    with Executor(**CHEAP) as ex:
        assert ex.submit(lambda x: x * scale, 14).result() == 42
        trained = ex.submit(experiment.train, 0.5)
        got = trained.result()
        assert got["loss"] == pytest.approx(1 / 1.5)
        assert Path(got["cwd"]).name.endswith(f"-{trained.job}")  # ran in its own folder
        failing = ex.submit(experiment.train, 10)
        with pytest.raises(experiment.Diverged, match="lr 10 is too high") as raised:
            failing.result()
        shown = "".join(traceback.format_exception(raised.value))
        assert "experiment.py\", line 12, in train" in shown and f"raised by call {failing.job} on localhost" in shown
    results = project / "job_results"
    assert (results / f"{failing.job}.err").read_text().startswith("Traceback")  # its stderr, as a shell job's


def test_map_keeps_order_and_submits_lazily(project: Path) -> None:
    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    with Executor(bus=bus, **CHEAP) as ex:
        squares = ex.map(pow, range(30), [2] * 30, buffersize=8)
        assert next(squares) == 0
        # The window joined the batch before the first result could come; then one more call
        # for the result taken (an eager map would have sent all 30 long before).
        joined = [e.jobs for e in events if isinstance(e, BatchStarted | JobsAdded)]  # (before it opened: at its start)
        assert 8 <= sum(joined) <= 9
        assert list(squares) == [n * n for n in range(1, 30)]


def test_map_chunksize_runs_that_many_calls_as_one_job_in_one_process(project: Path) -> None:
    """``chunksize`` is real (calls far shorter than a process's start pay one start per chunk):
    25 calls in chunks of 10 are 3 jobs, each one process on its host; order kept; a call that
    raises ends its chunk, which raises it where the chunk's results begin (as
    ``ProcessPoolExecutor.map`` does)."""

    def _square_and_pid(x: int) -> tuple[int, int]:  # local: travels by value
        if x == 17:
            raise ArithmeticError("17 refused")
        return x * x, os.getpid()

    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    with Executor(bus=bus, **CHEAP) as ex:
        got = list(ex.map(_square_and_pid, range(17), chunksize=10))
        assert [value for value, _ in got] == [n * n for n in range(17)]
        assert len({pid for _, pid in got[:10]}) == 1 and len({pid for _, pid in got[10:]}) == 1
        assert got[0][1] != got[10][1]
        joined = sum(e.jobs for e in events if isinstance(e, BatchStarted | JobsAdded))
        assert joined == 2
        failing = ex.map(_square_and_pid, range(0, 35), chunksize=10)
        assert [value for value, _ in itertools.islice(failing, 10)] == [n * n for n in range(10)]
        with pytest.raises(ArithmeticError, match="17 refused"):
            next(failing)  # the chunk 10..19
        with pytest.raises(ValueError, match="chunksize must be a whole number >= 1"):
            ex.map(pow, [1], [2], chunksize=0)


def test_a_rerun_gets_finished_calls_from_the_results_folder(project: Path) -> None:
    """The resume: calls are named by the function and their arguments, so a second run of the
    same script runs only what the first did not finish (here: the call that raised); with
    ``resume=False`` everything runs again."""
    import experiment

    log = project / "ran.log"

    def script(**options: object) -> list[object]:
        outcomes: list[object] = []
        with Executor(**CHEAP, **options) as ex:  # type: ignore[arg-type]
            for future in [ex.submit(experiment.train, lr, log=str(log)) for lr in (0.1, 0.2, 5)]:
                try:
                    outcomes.append(future.result()["lr"])
                except experiment.Diverged as exc:
                    outcomes.append(str(exc))
        return outcomes

    assert script() == [0.1, 0.2, "lr 5 is too high"]
    assert sorted(log.read_text().split()) == ["0.1", "0.2", "5"]
    log.write_text("")
    assert script() == [0.1, 0.2, "lr 5 is too high"]
    assert log.read_text().split() == ["5"]  # only the call that failed ran again
    log.write_text("")
    assert script(retry_failed=False) == [0.1, 0.2, "lr 5 is too high"]  # its exception, from the results
    assert log.read_text() == ""
    assert script(resume=False) == [0.1, 0.2, "lr 5 is too high"]
    assert sorted(log.read_text().split()) == ["0.1", "0.2", "5"]


def test_the_same_call_twice_runs_twice(project: Path) -> None:
    with Executor(**CHEAP) as ex:
        first, second = ex.submit(os.getpid), ex.submit(os.getpid)
        assert second.job == f"{first.job}.2"
        assert first.result() != second.result()


def test_cancel_a_queued_call_and_a_running_one(project: Path) -> None:
    gate = project / "gate"
    started: list[str] = []
    bus = EventBus()
    bus.subscribe(lambda e: started.append(e.job) if isinstance(e, JobStarted) else None)

    def wait_for(path: str, value: int = 1) -> int:  # (by value: this test's module is not on the host)
        Path(f"{path}.{value}.pid").write_text(str(os.getpid()))  # it runs: here is its process
        while not os.path.exists(path):
            time.sleep(0.05)
        return value

    with Executor(bus=bus, no_gpu_required=True, reserve=True) as ex:  # one call at a time
        try:
            running = ex.submit(wait_for, str(gate))
            queued = ex.submit(wait_for, str(gate), 2)
            pid_file = project / "gate.1.pid"
            deadline = time.monotonic() + 60
            while not (running.running() and pid_file.exists() and pid_file.read_text()):
                assert time.monotonic() < deadline, "the first call never started"
                assert not running.done(), running.exception()
                time.sleep(0.05)
            pid = int(pid_file.read_text())
            assert not queued.running()
            assert queued.cancel() and queued.cancelled()
            assert running.cancel() and running.cancelled()  # running, still cancellable: it is killed
            with pytest.raises(concurrent.futures.CancelledError):
                running.result()
            after = ex.submit(os.getpid)
            # One call at a time: this one starts once the killed call's room is free again.
            assert after.result(timeout=60) > 0
        finally:
            gate.touch()  # whatever failed above, no call waits for ever
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the call's process is gone
    assert queued.job not in started  # taken out of the queue, never run
    assert not (project / "gate.2.pid").exists()
    assert not (project / "job_results" / running.job).exists()  # killed: nothing committed


def test_futures_work_with_asyncio_and_shutdown_refuses_new_calls(project: Path) -> None:
    ex = Executor(**CHEAP)

    async def gather() -> list[int]:
        return list(await asyncio.gather(*(asyncio.wrap_future(ex.submit(abs, -n)) for n in range(3))))

    assert asyncio.run(gather()) == [0, 1, 2]
    ex.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        ex.submit(abs, 1)


def test_per_call_needs_without_a_second_executor(project: Path) -> None:
    with Executor(**CHEAP) as ex:
        wide = ex.options(num_cpus=1.5)
        assert wide.submit(abs, -4).result() == 4
        assert list(wide.map(abs, [-1, -2])) == [1, 2]
        with pytest.raises(CallError, match="can never run"):
            ex.options(num_cpus=10_000).submit(abs, -1).result()
        assert ex.submit(abs, -5).result() == 5  # the executor goes on
        with pytest.raises(ConfigError, match="gpus_per_job must be a whole number >= 0, not -1"):
            ex.options(gpus_per_job=-1)


def test_options_are_the_batchs_checked_as_the_command_line_checks_them(project: Path) -> None:
    with pytest.raises(ConfigError, match=r"Executor: unknown option 'gpu_per_job' \(did you mean gpus_per_job\?\)"):
        Executor(gpu_per_job=1)
    with pytest.raises(ConfigError, match="--timeout must be a positive number of seconds, not -1"):
        Executor(timeout=-1)
    with pytest.raises(ConfigError, match=r"Executor: unknown option .dry_run. \(an executor runs its calls"):
        Executor(dry_run=True)
    with pytest.raises(ConfigError, match=r"Executor: retries must be a whole number, got 1\.5"):
        Executor(retries=1.5)


def test_one_results_folder_one_executor(project: Path) -> None:
    with Executor(**CHEAP) as ex, pytest.raises(ConfigError, match="job_results"):
        Executor(**CHEAP)
    assert ex.submit is not None


def test_a_call_past_its_timeout_is_killed_and_says_so(project: Path) -> None:
    with Executor(timeout=5, **CHEAP) as ex:  # (time enough for any call but the one that sleeps)
        with pytest.raises(CallError, match=r"call sleep-\w+ on localhost left no result \(timed out after 5 s\)"):
            ex.submit(time.sleep, 600).result()
        assert ex.submit(abs, -1).result() == 1


def test_a_skipped_call_is_told_to_the_bus_like_a_skipped_job(project: Path) -> None:
    with Executor(**CHEAP) as ex:
        ex.submit(abs, -7).result()
    skipped: list[str] = []
    bus = EventBus()
    bus.subscribe(lambda e: skipped.append(e.job) if isinstance(e, JobSkipped) else None)
    with Executor(bus=bus, **CHEAP) as ex:
        assert ex.submit(abs, -7).result() == 7
    assert len(skipped) == 1


def test_no_host_to_run_on_fails_every_call_with_the_reason_in_one_line(project: Path) -> None:
    ex = Executor(["nobody@127.0.0.1:1"], no_gpu_required=True)  # nothing listens on port 1: refused at once
    try:
        # The batch may have ended before the first call comes (the host refuses at once): then
        # submit itself raises the reason, else the call's future does.  CI saw both.
        with pytest.raises(SchedulerError, match=r"^no host could be reached; nothing was run$"):
            ex.submit(abs, -1).result(timeout=120)
        with pytest.raises(SchedulerError, match=r"^no host could be reached"):
            ex.submit(abs, -2)
    finally:
        ex.shutdown()


def test_the_executors_batch_keeps_its_event_file_for_attach_and_report(project: Path) -> None:
    """What ``ssh-scheduler report`` draws: the calls, where they ran, the probes, how it ended;
    a stopped executor's file ends as a batch stopped by Ctrl-C does."""
    with Executor(**CHEAP) as ex:
        jobs = [ex.submit(abs, -n).job for n in range(3)]
    results = project / "job_results"
    history = read_history(results, running=False, now=time.time())
    assert history.from_events and history.exit_code == 0
    assert sorted(a.job for a in history.attempts) == sorted(jobs)
    assert {a.host for a in history.attempts} == {"localhost"} and history.probes
    assert history.exit_lines[0].startswith("done: 3 finished, 0 failed, 0 skipped")
    started = threading.Event()
    bus = EventBus()
    bus.subscribe(lambda e: started.set() if isinstance(e, JobStarted) else None)
    ex = Executor(bus=bus, **CHEAP)
    running = ex.submit(time.sleep, 600)
    assert started.wait(60), "the call never started"
    ex.stop()
    assert running.cancelled() or running.done()
    history = read_history(results, running=False, now=time.time())
    assert history.from_events and history.exit_code == 130 and history.exit_lines == [CANCELLED_LINE]


def test_a_call_that_spoils_the_runner_in_the_host_cache_costs_the_next_call_nothing(project: Path) -> None:
    """The runner lives in the host's cache, one file linked into every call's folder: a call
    that writes through its link spoils the entry, which the agent drops; the next call is staged
    with the runner sent again (as a shell job's spoiled input is), and runs."""

    def spoil(rel: str) -> int:  # (by value: a function of this test, which the call has no module of)
        os.chmod(rel, 0o600)  # as a job may, then writes through its link to the input
        with open(rel, "a") as f:
            f.write("# spoiled\n")
        return os.getpid()

    with Executor(reserve=True, **CHEAP) as ex:  # one call at a time: the next is staged after
        assert ex.submit(spoil, ".ssh_scheduler_call/call_runner.py").result() > 0
        assert ex.submit(abs, -3).result() == 3
        assert ex.submit(spoil, ".ssh_scheduler_call/lib/cloudpickle/__init__.py").result() > 0
        assert ex.submit(abs, -4).result() == 4


def test_calls_fork_from_one_warm_interpreter_that_ends_without_a_word(project: Path) -> None:
    """On this machine too the calls are forked from one interpreter (agent/warm.py), and the
    batch's end ends it quietly: the agent waits for it as asyncio does, rather than reaping it
    under asyncio, whose child watcher then printed "exit status already read" into the user's
    terminal (this Python's stderr)."""
    (project / "run.py").write_text(
        "import os\n"
        "from ssh_scheduler import Executor\n\n\n"
        "def parent(_):\n"
        "    with open('/proc/%d/cmdline' % os.getppid(), 'rb') as f:\n"
        "        return f.read().split(b'\\0')\n\n\n"
        "if __name__ == '__main__':\n"
        "    with Executor(no_gpu_required=True, num_cpus=0.1, memory_required=10) as ex:\n"
        "        parents = list(ex.map(parent, range(3)))\n"
        "    print(sum(b'--serve' in p for p in parents), len({tuple(p) for p in parents}))\n"
    )
    result = subprocess.run(
        [sys.executable, "run.py"], cwd=project, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, SSH_SCHEDULER_KEEP_WARM="0"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "1"]  # three calls, one interpreter's children
    assert result.stderr == ""
