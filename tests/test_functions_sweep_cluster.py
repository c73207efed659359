"""Sweeps of a function (issue 21) on the SSH test cluster: the ``004`` example's two grids give
its four combinations, each one call of ``sweep_work.task`` run in its combination's folder on a
host, with the ``param.json``, ``stat.json`` and ``metrics.json`` a shell sweep leaves and that
``ssh-scheduler results`` reads; a rerun runs only what did not finish; the same through a sweep
YAML naming the function (``execute_batch --sweep``), and a bad reference is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssh_scheduler import Executor
from ssh_scheduler.functions.outcome import read_outcome
from tests.cluster import Cluster
from tests.sweep_project import machines, project_folder  # noqa: F401  (the fixture "project")

HERE = Path(__file__).parent
REPO = HERE.parent
CHEAP = {"no_gpu_required": True, "num_cpus": 0.1, "memory_required": 10}
LIGHT = ["--no-gpu-required", "--memory-required", "10", "--num-cpus", "0.1"]

# The 004 seed's example: global_config, then test_config's two grids -> four combinations.
DEFAULT = {"num_run": 5, "num_epoch": 200}
GRIDS = [
    {"method": ["GAN", "ALI"], "num_packing": [1], "num_zmode": [1]},
    {"method": ["WGAN"], "num_packing": [3], "num_zmode": [1, 2]},
]
COMBINATIONS = [  # (folder, params), in the seed's order
    ("method_GAN-num_packing_1-num_zmode_1", {"method": "GAN", "num_packing": 1, "num_zmode": 1}),
    ("method_ALI-num_packing_1-num_zmode_1", {"method": "ALI", "num_packing": 1, "num_zmode": 1}),
    ("method_WGAN-num_packing_3-num_zmode_1", {"method": "WGAN", "num_packing": 3, "num_zmode": 1}),
    ("method_WGAN-num_packing_3-num_zmode_2", {"method": "WGAN", "num_packing": 3, "num_zmode": 2}),
]
SWEEP_YAML = """\
call: sweep_work:task
default: {num_run: 5, num_epoch: 200}
---
method: [GAN, ALI]
num_packing: [1]
num_zmode: [1]
---
method: [WGAN]
num_packing: [3]
num_zmode: [1, 2]
"""


@pytest.fixture
def hosts(cluster4: Cluster) -> Iterator[Cluster]:
    """The cluster with its homes' logs and failure markers cleared."""

    def clear() -> None:
        for host in cluster4.hosts:
            for name in ("sweeps.log", "fail_ALI", "fail_GAN", "fail_WGAN"):
                (host.home / name).unlink(missing_ok=True)

    clear()
    yield cluster4
    clear()


def runs(cluster: Cluster) -> list[str]:
    """Every run of ``task`` on every host, as ``method-packing-zmode``."""
    found = []
    for host in cluster.hosts:
        log = host.home / "sweeps.log"
        found += log.read_text().splitlines() if log.exists() else []
    return sorted(found)


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "ssh_scheduler", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def results_rows(cwd: Path, folder: str) -> list[dict[str, object]]:
    done = cli(cwd, "results", folder, "--json")
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, object]] = json.loads(done.stdout)
    return rows


def check_folders(results: Path, methods_run_on: dict[str, str] | None = None) -> None:
    """Each combination's folder as a shell sweep leaves it: param.json (its parameters, the
    function as its command), stat.json (the call's exit 0 and host), and what the call wrote
    where it ran (metrics.json)."""
    for name, params in COMBINATIONS:
        folder = results / name
        param = json.loads((folder / "param.json").read_text())
        assert param["_name"] == name and param["_commands"] == {"call": "sweep_work:task"}
        assert {k: param[k] for k in (*params, *DEFAULT)} == {**DEFAULT, **params}
        stat = json.loads((folder / "stat.json").read_text())["call"]
        assert stat["code"] == 0
        if methods_run_on is not None:
            assert stat["host"] == methods_run_on[name]
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics == {"score": params["num_packing"] * 10 + params["num_zmode"], "epochs": 1000}


def test_executor_sweep_of_the_004_example_gives_its_four_combination_folders(hosts: Cluster, project: Path) -> None:
    import sweep_work  # type: ignore[import-not-found]

    with Executor(machines(hosts), **CHEAP) as ex:
        found = ex.sweep(sweep_work.task, GRIDS, default=DEFAULT)
    assert [params for params, _ in found] == [{**DEFAULT, **p} for _, p in COMBINATIONS]
    # each call ran in its combination's folder on a host of the cluster
    assert [value["cwd"] for _, value in found] == [name for name, _ in COMBINATIONS]
    assert {value["host"] for _, value in found} <= {h.name for h in hosts.hosts}
    check_folders(project / "job_results" / "task", {n: v["host"] for (n, _), (_, v) in zip(COMBINATIONS, found, strict=True)})
    rows = results_rows(project, "job_results/task")
    assert [(r["name"], r["method"], r["num_packing"], r["num_zmode"], r["state"], r["score"]) for r in rows] == [
        (name, p["method"], p["num_packing"], p["num_zmode"], "done", p["num_packing"] * 10 + p["num_zmode"])
        for name, p in COMBINATIONS
    ]
    assert runs(hosts) == ["ALI-1-1", "GAN-1-1", "WGAN-3-1", "WGAN-3-2"]


def test_a_rerun_runs_only_the_combinations_that_did_not_finish(hosts: Cluster, project: Path) -> None:
    import sweep_work

    for host in hosts.hosts:
        (host.home / "fail_ALI").write_text("")
    with Executor(machines(hosts), **CHEAP) as ex:
        with pytest.raises(sweep_work.Failed, match="ALI failed as asked"):  # raised once all ended
            ex.sweep(sweep_work.task, GRIDS, default=DEFAULT)
        assert len(runs(hosts)) == 4
        ali = project / "job_results" / "task" / COMBINATIONS[1][0]
        assert json.loads((ali / "stat.json").read_text())["call"]["code"] == 1
        states = {r["name"]: r["state"] for r in results_rows(project, "job_results/task")}
        assert states[COMBINATIONS[1][0]] == "failed: call (exit 1)"
        assert [s for n, s in states.items() if n != COMBINATIONS[1][0]] == ["done"] * 3

        for host in hosts.hosts:
            (host.home / "fail_ALI").unlink()
        again = ex.sweep(sweep_work.task, GRIDS, default=DEFAULT)  # only ALI runs again
        assert runs(hosts) == ["ALI-1-1", "ALI-1-1", "GAN-1-1", "WGAN-3-1", "WGAN-3-2"]
        # the three that finished before give their values from their folders
        assert [v["cwd"] for _, v in again] == [name for name, _ in COMBINATIONS]
        check_folders(project / "job_results" / "task")

        # a grid added: only its new combination runs; the names of the others stay
        more = ex.sweep(sweep_work.task, [*GRIDS, {"method": ["GAN"], "num_packing": [2], "num_zmode": [1]}],
                        default=DEFAULT, return_exceptions=True)
    assert runs(hosts) == ["ALI-1-1", "ALI-1-1", "GAN-1-1", "GAN-2-1", "WGAN-3-1", "WGAN-3-2"]
    assert [v["cwd"] for _, v in more][-1] == "method_GAN-num_packing_2-num_zmode_1"
    check_folders(project / "job_results" / "task")


def test_a_sweep_yaml_naming_a_function_runs_through_execute_batch(hosts: Cluster, project: Path) -> None:
    (project / "sweep.yaml").write_text(SWEEP_YAML)
    args = ("execute_batch", "--sweep", "sweep.yaml", "--machines", *machines(hosts), *LIGHT)
    done = cli(project, *args)
    assert done.returncode == 0, done.stderr
    check_folders(project / "job_results")
    assert runs(hosts) == ["ALI-1-1", "GAN-1-1", "WGAN-3-1", "WGAN-3-2"]
    for name, _ in COMBINATIONS:  # the call ran in its combination's folder; its value is kept
        outcome = read_outcome(project / "job_results" / ".jobs", f"{name}.call", "a host")
        assert outcome.error is None and outcome.value["cwd"] == name
    assert [r["state"] for r in results_rows(project, "job_results")] == ["done"] * 4

    again = cli(project, *args)  # everything finished: nothing runs
    assert again.returncode == 0, again.stderr
    assert "nothing to do: every command of 4 combinations succeeded before" in again.stdout + again.stderr
    assert len(runs(hosts)) == 4


def test_a_bad_function_reference_is_one_line_with_the_fix(cluster4: Cluster, project: Path) -> None:
    for reference, says in [
        ("sweep_work:tsak", "sweep.yaml: call sweep_work:tsak: sweep_work has no tsak (did you mean task?)"),
        ("sweep_wrok:task", "sweep.yaml: call sweep_wrok:task: no module named sweep_wrok; fix: run the sweep"),
        ("sweep_work.task", "does not name a function; write package.module:function"),
    ]:
        (project / "sweep.yaml").write_text(SWEEP_YAML.replace("sweep_work:task", reference))
        done = cli(project, "execute_batch", "--sweep", "sweep.yaml", "--machines", *machines(cluster4), *LIGHT)
        assert done.returncode != 0
        assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (project / "job_results").exists()  # refused before anything ran
