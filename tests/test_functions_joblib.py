"""The joblib backend ``ssh_scheduler`` (issue 21): ``joblib.Parallel`` across the SSH test
cluster (results in order, spread over the hosts; a call's exception raised as itself; ``n_jobs``
bounds the calls under way), and joblib staying optional (importing ``ssh_scheduler`` never
imports it; without it the backend's import is one line with the fix)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.events import Event, EventBus, JobCancelled, JobFailed, JobFinished, JobStarted
from tests.cluster import Cluster
from tests.sweep_project import machines, project_folder  # noqa: F401  (the fixture "project")

joblib = pytest.importorskip("joblib")
import ssh_scheduler.functions.joblib_backend  # noqa: E402,F401  (registers the backend)

HERE = Path(__file__).parent
REPO = HERE.parent
CHEAP = {"no_gpu_required": True, "num_cpus": 1, "memory_required": 10}


class UnderWay:
    """The most calls under way at once, from the batch's events."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.started = 0
        self.seen: list[str] = []

    def __call__(self, event: Event) -> None:
        self.seen.append(type(event).__name__)
        if isinstance(event, JobStarted):
            self.now += 1
            self.started += 1
            self.peak = max(self.peak, self.now)
        elif isinstance(event, JobFinished | JobFailed | JobCancelled):
            self.now -= 1


def test_parallel_runs_across_the_hosts_in_order(cluster4: Cluster, project: Path) -> None:
    import sweep_work  # type: ignore[import-not-found]

    with joblib.parallel_config(backend="ssh_scheduler", machines=machines(cluster4), **CHEAP):
        got = joblib.Parallel(n_jobs=-1)(joblib.delayed(sweep_work.square)(x) for x in range(40))
    assert [value for value, _ in got] == [x * x for x in range(40)]
    # 40 calls of 1 CPU on hosts of 4 CPUs: they cannot all fit one host
    assert len({host for _, host in got}) >= 2
    assert {host for _, host in got} <= {h.name for h in cluster4.hosts}


def test_a_calls_exception_is_raised_as_itself(cluster4: Cluster, project: Path) -> None:
    import sweep_work

    with joblib.parallel_config(backend="ssh_scheduler", machines=machines(cluster4), **CHEAP):
        with pytest.raises(sweep_work.Failed, match="three is refused") as raised:
            joblib.Parallel(n_jobs=-1)(joblib.delayed(sweep_work.refuse)(x) for x in range(6))
        # the backend is usable again after the abort (a second Parallel call in the block)
        assert joblib.Parallel(n_jobs=2)(joblib.delayed(sweep_work.refuse)(x) for x in (1, 2)) == [1, 2]
    assert "raise Failed" in str(raised.value.__cause__)  # the remote traceback


def test_n_jobs_bounds_the_calls_under_way(cluster4: Cluster, project: Path) -> None:
    import sweep_work

    for n_jobs, most in ((2, 2), (-1, None)):
        under_way = UnderWay()
        bus = EventBus()
        bus.subscribe(under_way)
        # resume=False: the second round runs the same calls again instead of reading their results
        with joblib.parallel_config(backend="ssh_scheduler", machines=machines(cluster4), bus=bus, resume=False, **CHEAP):
            got = joblib.Parallel(n_jobs=n_jobs)(joblib.delayed(sweep_work.slow_square)(x) for x in range(12))
        assert got == [x * x for x in range(12)]
        assert under_way.started == 12, under_way.seen
        if most is not None:
            assert under_way.peak == most, (n_jobs, under_way.peak)
        else:  # no bound of ours: the fleet's 16 CPUs take all 12 at once
            assert under_way.peak > 2, under_way.peak


def test_a_batch_of_calls_is_one_job(cluster4: Cluster, project: Path) -> None:
    """Parallel(batch_size=10, pre_dispatch="all"): 40 calls in 4 jobs, each running its 10 calls in one process;
    the values in order all the same, a call's exception raised as itself."""
    import sweep_work

    under_way = UnderWay()
    bus = EventBus()
    bus.subscribe(under_way)
    with joblib.parallel_config(backend="ssh_scheduler", machines=machines(cluster4), bus=bus, **CHEAP):
        got = joblib.Parallel(n_jobs=-1, batch_size=10, pre_dispatch="all")(joblib.delayed(sweep_work.square)(x) for x in range(40))
        assert [value for value, _ in got] == [x * x for x in range(40)]
        assert under_way.started == 4
        # a batch's hosts are the same for its 10 calls: they ran in one process
        assert all(len({host for _, host in got[i : i + 10]}) == 1 for i in range(0, 40, 10))
        with pytest.raises(sweep_work.Failed, match="three is refused"):
            joblib.Parallel(n_jobs=-1, batch_size=4, pre_dispatch="all")(joblib.delayed(sweep_work.refuse)(x) for x in range(8))


def test_an_executor_of_the_script_is_used_and_left_open(cluster4: Cluster, project: Path) -> None:
    import sweep_work

    from ssh_scheduler import Executor

    with Executor(machines(cluster4), **CHEAP) as ex:
        with joblib.parallel_config(backend="ssh_scheduler", executor=ex):
            assert joblib.Parallel(n_jobs=-1)(joblib.delayed(sweep_work.refuse)(x) for x in (4, 5)) == [4, 5]
        assert ex.submit(sweep_work.refuse, 6).result() == 6  # still open


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_importing_ssh_scheduler_never_imports_joblib() -> None:
    done = run_python(
        "import sys, ssh_scheduler\n"
        "from ssh_scheduler import Executor\n"
        "import ssh_scheduler.functions.call_sweep\n"
        "assert 'joblib' not in sys.modules, 'joblib imported'\n"
    )
    assert done.returncode == 0, done.stderr


def test_without_joblib_the_backend_is_one_line_with_the_fix() -> None:
    done = run_python(
        "import sys\n"
        "sys.modules['joblib'] = None  # as if not installed\n"
        "try:\n"
        "    import ssh_scheduler.functions.joblib_backend\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "the ssh_scheduler joblib backend needs joblib, which this Python lacks; fix: pip install joblib"
    )
