"""``ssh_scheduler.Executor`` on the SSH test cluster (issue 21's acceptance): calls as jobs on
real sshd hosts with simulated GPUs, through the same planner, pipeline and journal as shell
jobs.  What a call runs is in tests/call_work.py (the user's own module, copied forward); the
scripts interrupted, killed or measured as processes of their own are tests/call_script.py."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ssh_scheduler import CallError, Executor
from ssh_scheduler.events import Event, EventBus, JobRequeued, JobStarted
from tests.cluster import Cluster, GpuSpec, Host, HostSpec
from tests.live_batch import batch_env, batch_processes, journal, wait_until
from tests.other_python import other_python_on
from tests.test_overcommit_cluster import peak_overlap

HERE = Path(__file__).parent
CHEAP = {"no_gpu_required": True, "num_cpus": 0.1, "memory_required": 10}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The user's folder: ``work.py`` (their module, installed nowhere) and ``script.py``; the
    executor copies it forward and keeps its results there."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(HERE / "call_work.py", folder / "work.py")
    shutil.copy(HERE / "call_script.py", folder / "script.py")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(folder)
    yield folder
    sys.modules.pop("work", None)


def machines(cluster: Cluster, count: int | None = None) -> list[str]:
    return [str(p) for p in cluster.machine_files[:count]]


def clear_homes(cluster: Cluster, *names: str) -> None:
    for host in cluster.hosts:
        for name in ("started.log", "done.log", "calls.log", "gate", "run", "sleeping", *names):
            (host.home / name).unlink(missing_ok=True)


def lines(host: Host, name: str) -> list[str]:
    path = host.home / name
    return path.read_text().splitlines() if path.exists() else []


def write_everywhere(cluster: Cluster, name: str, text: str = "") -> None:
    for host in cluster.hosts:
        (host.home / name).write_text(text)


def script(project: Path, what: str, cluster: Cluster) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "script.py", what, str(project / "job_results"), *machines(cluster)],
        cwd=project, env=batch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def test_values_and_exceptions_round_trip_through_the_hosts(cluster4: Cluster, project: Path) -> None:
    import work  # type: ignore[import-not-found]

    started: dict[str, JobStarted] = {}
    bus = EventBus()
    bus.subscribe(lambda e: started.__setitem__(e.job, e) if isinstance(e, JobStarted) else None)
    offset = 40
    with Executor(machines(cluster4), bus=bus, num_cpus=0.1, memory_required=10, no_reserve_gpu=True) as ex:
        assert ex.submit(lambda x: x + offset, 2).result() == 42  # a closure over a local variable
        assert ex.submit(lambda: sum(range(10))).result() == 45  # a lambda
        placed = [ex.submit(work.where) for _ in range(8)]  # a function of the user's own module
        with pytest.raises(work.Refused, match="not today") as raised:  # caught by its own class
            ex.submit(work.refuse, "not today").result()
        for future in placed:
            host, visible = future.result()
            event = started[future.job]
            # each call sees its own GPU: the one the planner placed it on, on that host
            assert (host, visible) == (event.host, ",".join(map(str, event.gpus))) and visible in ("0", "1")
    shown = "".join(traceback.format_exception(raised.value))
    assert 'work.py", line 23, in refuse\n    raise Refused(why)' in shown  # the remote traceback
    assert "Refused: not today\n(raised by call refuse-" in shown


def test_a_50_mb_value_comes_home_held_once(cluster4: Cluster, project: Path) -> None:
    """The value travels as a result file (copied home to disk through a fixed window of reads,
    not through memory) and is read from it as the value: the coordinator's memory rises by the
    value once while it comes home, never by it twice."""
    proc = script(project, "big", cluster4)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    said = json.loads(out.splitlines()[-1])
    assert said["ok"]
    assert said["peak_mb"] < 75, said  # 50 MiB once; twice would be 100


def test_calls_needing_7000_mb_on_16_gb_gpus_never_share_beyond_what_fits(make_cluster, project: Path) -> None:  # type: ignore[no-untyped-def]
    """The GPU memory invariant of shell jobs, for calls: each reserves 7000 MiB and really
    holds 6500 MiB (seen by the simulated nvidia-smi) for 2 s; at most two share a 16 GB GPU."""
    import work

    cluster = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=16384) for _ in range(2)]) for _ in range(4)])
    with Executor(
        machines(cluster), gpu_memory_required=7000, no_reserve_gpu=True, gpu_utilization=0.3, num_cpus=0.1,
        memory_required=100,
    ) as ex:  # fmt: skip
        held = list(ex.map(work.hold_gpu, [6500] * 48, [2] * 48))
    per_gpu: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for host, gpus, start, end in held:
        assert gpus in ("0", "1"), gpus
        per_gpu[(host, gpus)].append((start, end))
    assert len(per_gpu) == 8
    peaks = {key: peak_overlap(spans) for key, spans in per_gpu.items()}
    assert max(peaks.values()) == 2, peaks  # shared, as no_reserve_gpu allows, never beyond


@pytest.mark.slow
def test_a_host_frozen_mid_call_reruns_its_calls_elsewhere_each_resolved_once(cluster4: Cluster, project: Path) -> None:
    """Eight calls wait at a gate; the host running the most of them is frozen whole (SIGSTOP:
    its sshd, agent and calls), the gate opens on the others.  Each call of the frozen host is
    requeued and run again elsewhere, each future resolves once, with the value of a run that
    ended, and each of those calls left its side effect (a line of done.log) once: the frozen
    runs never got past their gate."""
    import work

    clear_homes(cluster4)
    requeued: list[tuple[str, str]] = []  # (job, the host it was lost with)
    bus = EventBus()
    bus.subscribe(lambda e: requeued.append((e.job, e.host)) if isinstance(e, JobRequeued) else None)
    # keepalive 3 s: the frozen host is lost after 3 missed, a live one on a loaded machine not
    ex = Executor(machines(cluster4), bus=bus, keepalive=3, no_gpu_required=True, num_cpus=1, memory_required=10)
    frozen: Host | None = None
    try:
        futures = [ex.submit(work.gated, f"call{n}") for n in range(8)]
        resolved: Counter[str] = Counter()
        for future in futures:
            future.add_done_callback(lambda f: resolved.update([f.job]))  # type: ignore[attr-defined]
        wait_until(lambda: sum(len(lines(h, "started.log")) for h in cluster4.hosts) >= 8, "every call started")
        frozen = max(cluster4.hosts, key=lambda h: len(lines(h, "started.log")))
        on_frozen = {line.split()[0] for line in lines(frozen, "started.log")}
        frozen.freeze(whole_host=True)
        for host in cluster4.hosts:
            if host is not frozen:
                (host.home / "gate").write_text("")
        results = [future.result(timeout=180) for future in futures]
    finally:
        if frozen is not None:
            frozen.thaw()
        ex.shutdown(wait=True, cancel_futures=True)
    call_of = {future.job: f"call{n}" for n, future in enumerate(futures)}
    assert on_frozen and {call_of[job] for job, host in requeued if host == frozen.name} == on_frozen
    assert set(resolved.values()) == {1} and len(resolved) == 8  # each future resolved once
    done = {host.name: lines(host, "done.log") for host in cluster4.hosts}
    assert done[frozen.name] == []  # the frozen runs never got past their gate
    ended = Counter(line.split()[0] for host_lines in done.values() for line in host_lines)
    for n, (host, run) in enumerate(results):
        assert host != frozen.name and f"call{n} {run}" in done[host]  # its value is that run's
    # One side effect per call, those run again included.  (A live host lost too, on a machine
    # loaded past 3 missed keepalives, would leave a call it ran running on: twice, at least
    # once, as any lost host's calls; not the claim here, so such calls are told apart.)
    lost_live = {call_of[job] for job, host in requeued if host != frozen.name}
    assert set(ended) == {f"call{n}" for n in range(8)}
    assert {name for name, count in ended.items() if count != 1} <= lost_live, (ended, requeued)


def test_map_over_a_thousand_items_keeps_order(cluster4: Cluster, project: Path) -> None:
    with Executor(machines(cluster4), no_gpu_required=True, num_cpus=0.05, memory_required=10) as ex:
        assert list(ex.map(abs, range(-1000, 0))) == list(range(1000, 0, -1))
    assert len({e["host"] for e in journal(project / "job_results") if e["state"] == "finished"}) == 4


def processes_of_calls(host: Host) -> list[str]:
    """The calls running on the host: started by the agent as ``call_runner.py PAYLOAD ...``, or
    forked by its warm interpreter (``call_runner.py --serve``, which they look like in ``ps``),
    but not that interpreter itself, which stays while the executor does."""
    out = host.run(f"ps -u {host.user} -o pid=,ppid=,args=").stdout
    rows = [line.split(None, 2) for line in out.splitlines() if "call_runner.py" in line]
    servers = {pid for pid, _ppid, args in rows if "--serve" in args}
    return [args for pid, ppid, args in rows if pid not in servers or ppid in servers]


def test_cancelling_a_running_call_leaves_no_process_on_its_host(cluster4: Cluster, project: Path) -> None:
    import work

    clear_homes(cluster4)
    with Executor(machines(cluster4), **CHEAP) as ex:
        future = ex.submit(work.sleep_marked, "sleeping")
        wait_until(lambda: any(lines(h, "sleeping") for h in cluster4.hosts), "the call runs")
        (host,) = [h for h in cluster4.hosts if lines(h, "sleeping")]
        assert processes_of_calls(host) and future.running()
        assert future.cancel() and future.cancelled()
        wait_until(lambda: not processes_of_calls(host), f"no call left on {host.name}", 30)
        assert ex.submit(abs, -3).result() == 3  # the executor goes on
    (pid,) = lines(host, "sleeping")
    assert host.run(f"kill -0 {pid}").returncode != 0  # gone, not just out of ps's sight


@pytest.mark.parametrize("how", ["sleep", "sleep-bare"])
def test_ctrl_c_leaves_nothing_on_the_hosts(cluster4: Cluster, project: Path, how: str) -> None:
    """Ctrl-C in a script: in a ``with`` block (the executor stops: its calls are killed) or
    not (the interpreter's exit stops it): either way nothing of ours is left on any host."""
    clear_homes(cluster4)
    proc = script(project, how, cluster4)
    try:
        wait_until(lambda: any(lines(h, "sleeping") for h in cluster4.hosts), "the call runs", 120)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "KeyboardInterrupt" in err
    for host in cluster4.hosts:
        wait_until(functools.partial(lambda h: batch_processes(h) == [], host), f"nothing of ours on {host.name}", 30)


def test_a_script_killed_half_way_runs_only_the_rest_when_run_again(cluster4: Cluster, project: Path) -> None:
    """Ten counted calls; five finish, five wait at a gate; the script is SIGKILLed.  Run again,
    it gets the five results from the results folder, takes up the five still running on their
    hosts (nothing runs twice) and prints all ten."""
    clear_homes(cluster4)
    write_everywhere(cluster4, "run", "1")
    results = project / "job_results"
    first = script(project, "counted", cluster4)
    try:
        wait_until(lambda: sum(e["state"] == "finished" for e in journal(results)) == 5, "five calls finished", 120)
        wait_until(lambda: sum(len(lines(h, "calls.log")) for h in cluster4.hosts) == 10, "all ten started")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    write_everywhere(cluster4, "run", "2")
    write_everywhere(cluster4, "gate")
    again = script(project, "counted", cluster4)
    out, err = again.communicate(timeout=180)
    assert again.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == [i * i for i in range(10)]
    runs = Counter(line for host in cluster4.hosts for line in lines(host, "calls.log"))
    assert sorted(runs) == sorted(f"1 {i}" for i in range(10)) and set(runs.values()) == {1}  # none ran again


def test_a_host_with_another_python_refuses_code_in_one_line_and_the_others_go_on(make_cluster, project: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import work

    cluster = make_cluster(2)
    odd, even = cluster.hosts
    other = other_python_on(odd)  # (a real other version where one is installed; see other_python.py)
    odd_yaml = tmp_path / "odd.yaml"
    odd_yaml.write_text(yaml.safe_dump({**odd.machine_yaml(), "python": str(other.command)}))
    offset = 1
    with Executor([str(odd_yaml), str(even.machine_file)], reserve=True, no_gpu_required=True) as ex:
        by_value = [ex.submit(lambda n: (n + offset, os.uname().nodename), n) for n in range(6)]
        outcomes = []
        for future in by_value:
            try:
                outcomes.append(future.result())
            except CallError as exc:
                outcomes.append(str(exc))
    # A function that travels by name is compiled there, by that Python: it runs.
    with Executor([str(odd_yaml)], results_dir="odd", no_gpu_required=True) as only_odd:
        assert only_odd.submit(work.where).result()[0] == odd.name
    refused = [o for o in outcomes if isinstance(o, str)]
    assert refused and all(o.startswith(f"{odd.name}: cannot run this call here: ") for o in refused)
    here = ".".join(map(str, sys.version_info[:3]))
    assert f"pickled by Python {here}, and this host's Python is " in refused[0]
    assert f"(Python 3.{other.minor}." in refused[0] and "fix: set python: in the machine's YAML" in refused[0]
    assert "\n" not in refused[0]
    ran = [o for o in outcomes if not isinstance(o, str)]
    assert ran and {host for _, host in ran} == {even.name}  # the other host went on


def slurm_machine(site, tmp_path: Path) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "slurm.yaml"
    path.write_text(yaml.safe_dump(site.slurm.machine_yaml(site.login, poll_interval=0.3, max_queued=4)))
    return str(path)


def test_calls_through_slurm_and_a_host_in_one_executor(slurm, project: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The Slurm machine's calls go through sbatch (Slurm picks the node and GPU), the plain
    host's through its agent: the same request, the same results."""
    import work

    events: list[Event] = []
    bus = EventBus()
    bus.subscribe(events.append)
    offset = 7
    with Executor([slurm_machine(slurm, tmp_path), str(slurm.plain.machine_file)], bus=bus, gpus_per_job=1) as ex:
        where = [ex.submit(work.where) for _ in range(6)]
        by_value = ex.submit(lambda: offset * 6)
        with pytest.raises(work.Refused, match="in Slurm too"):
            ex.options(copy_backwards=["nothing"]).submit(work.refuse, "in Slurm too").result()
        assert by_value.result() == 42
        placed = [future.result() for future in where]
    starts = {e.job: e for e in events if isinstance(e, JobStarted)}
    in_slurm = [f for f in where if starts[f.job].slurm_job]
    on_host = [f for f in where if not starts[f.job].slurm_job]
    assert in_slurm and on_host, placed
    assert all(f.result()[0] in slurm.slurm.nodes and f.result()[1] in ("0", "1") for f in in_slurm)
    assert all(f.result() == (slurm.plain.name, "0") for f in on_host)
