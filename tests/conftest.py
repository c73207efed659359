"""Shared pytest fixtures for the SSH test cluster (implementation: tests/cluster).

* ``cluster4`` (session): 4 hosts h1..h4, each with 2 simulated GPUs named
  "NVIDIA H100 80GB HBM3" but with 16000 MiB (15520 MiB free when idle: 480 MiB reserved,
  like the real card), 16384 MiB RAM (12000 MiB available), 4 CPUs, MaxSessions 10.
  After every test that used it, ``Cluster.reset()`` undoes faults and resource changes
  (thaw, heal, clear latency, restart crashed hosts/sshd, release ``hold_gpu`` holds,
  restore sshd limits/meminfo/loadavg) and kills the login users' leftover processes;
  files in homes are kept (``cluster4.reset(wipe_homes=True)`` empties them).
* ``make_cluster(specs, **kw)`` (function): start extra clusters (``start_cluster``
  arguments); all are stopped when the test ends.

Tests using these fixtures get the ``cluster`` marker automatically.  Mark a test
``@pytest.mark.namespaces`` if it needs the namespaced (root) cluster: without root it is
skipped, or failed when ``CI=true``.

The suite connects directly unless a test asks for the hub (tests/test_hub*.py): a connection
kept warm between tests would carry one test's hosts into the next.  ``SSH_SCHEDULER_KEEP_WARM``
set before the run keeps its value (set it to 60 to run the whole suite through the hub).
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator

import pytest

from ssh_scheduler.transport.hub_place import KEEP_WARM_VARIABLE

# The hook that fails skipped tests under CI=true (imported here so pytest registers it).
from tests.ci_skips import pytest_runtest_makereport  # noqa: F401
from tests.cluster import (
    Cluster,
    GpuSpec,
    HostSpec,
    namespaces_available,
    skip_or_fail,
    sshd_available,
    start_cluster,
)
from tests.conftest_slurm import slurm  # noqa: F401  (the real-Slurm fixture)

# The hook that keeps a worker's reports sendable (hostile text in a test's log or failure).
from tests.worker_reports import pytest_runtest_logreport  # noqa: F401

CLUSTER_FIXTURES = ("cluster4", "make_cluster", "slurm")


def _quit(number: int, _frame: object) -> None:
    raise SystemExit(128 + number)
os.environ.setdefault(KEEP_WARM_VARIABLE, "0")  # before any test: CLI subprocesses inherit it
# The memo of what local files hashed to (jobs/hash_memo.py): the suite's own, not the user's.
_CACHE_HOME = tempfile.mkdtemp(prefix="sshs-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, True)


def cluster4_specs() -> list[HostSpec]:
    return [
        HostSpec(gpus=[GpuSpec(name="NVIDIA H100 80GB HBM3", memory_mb=16000) for _ in range(2)])
        for _ in range(4)
    ]


def pytest_configure(config: pytest.Config) -> None:
    # The tests send SIGINT and SIGQUIT to the commands they start, as a terminal would.  A suite
    # started in the background of a script (``.ci/run &``, ``nohup``) inherits those signals
    # ignored, and so would every command it starts: their Ctrl-C tests then hang or fail for
    # no fault of the code.  A handler here is reset to the default in each child at exec.
    for number in (signal.SIGINT, signal.SIGQUIT):
        if signal.getsignal(number) == signal.SIG_IGN:
            signal.signal(number, signal.default_int_handler if number == signal.SIGINT else _quit)
    config.addinivalue_line(
        "markers",
        "namespaces: needs the namespaced (root) SSH test cluster; skipped without root, failed if CI=true",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if any(f in fixtures for f in CLUSTER_FIXTURES):
            item.add_marker(pytest.mark.cluster)
        if "slurm" in fixtures:
            # One worker runs every test of the real Slurm (scripts/test: ``--dist loadgroup``):
            # its session fixture (a cluster and Slurm's daemons, seconds to start) then starts once.
            item.add_marker(pytest.mark.xdist_group("slurm"))


def _require_sshd() -> None:
    if not sshd_available():
        skip_or_fail(
            "the SSH test cluster needs /usr/sbin/sshd and ssh-keygen (Debian: openssh-server)"
        )


@pytest.fixture(scope="session")
def cluster4() -> Iterator[Cluster]:
    _require_sshd()
    cluster = start_cluster(cluster4_specs())
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(specs: list[HostSpec] | int, **kwargs: object) -> Cluster:
        _require_sshd()
        cluster = start_cluster(specs, **kwargs)  # type: ignore[arg-type]
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


@pytest.fixture(autouse=True)
def _cluster_hygiene(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("namespaces") and not namespaces_available():
        skip_or_fail("needs root for the namespaced SSH test cluster")
    shared = request.getfixturevalue("cluster4") if "cluster4" in request.fixturenames else None
    yield
    if shared is not None:
        shared.reset()


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """Collect garbage while the test that made it is still current: an unclosed pipe or an
    unreaped process (a ResourceWarning, an error here) then fails the test that leaked it,
    not whichever test the collector happens to interrupt later."""
    yield
    gc.collect()
