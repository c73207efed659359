"""Parameter sweeps end to end on the SSH test cluster (issue 14's acceptance), through the CLI."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.cluster import Cluster
from tests.test_sweep import SEED_GRID

REPO = Path(__file__).resolve().parents[1]

# The seed runner's example shape (SEED_GRID): a template of two commands, defaults, and two sweep
# documents whose cross products share one combination (lr 0.01, seed 2).  Each command records where and
# when it ran; `fail-<lr>-<seed>` files (sent with the working directory) make a test fail.
SWEEP = """\
template:
  train: >-
    echo "$(hostname) $CUDA_VISIBLE_DEVICES $(date +%s.%N)" > {_output}/train_where.txt;
    sleep 0.5; echo "model {lr} {seed}" > {_output}/model.txt;
    date +%s.%N > {_output}/train_end.txt
  test: >-
    date +%s.%N > {_output}/test_start.txt;
    echo "$(hostname) $CUDA_VISIBLE_DEVICES" > {_output}/test_where.txt;
    test ! -e fail-{lr}-{seed} || exit 3;
    printf '{"score": %s, "epochs": %s}' {lr} {epochs} > {_output}/metrics.json
""" + SEED_GRID
EXPECTED = {
    "lr_0.1-seed_1": (0.1, 1),
    "lr_0.1-seed_2": (0.1, 2),
    "lr_0.01-seed_1": (0.01, 1),
    "lr_0.01-seed_2": (0.01, 2),
    "lr_0.001-seed_2": (0.001, 2),
}
LIGHT = ["--gpu-memory-required", "100", "--no-reserve-gpu", "--memory-required", "100",
         "--num-cpus", "0.1", "--probe-interval", "0.5"]


def cli(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "ssh_scheduler", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def sweep(cluster: Cluster, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    machines = ["--machines", *(str(p) for p in cluster.machine_files)]
    return cli(cwd, "execute_batch", "--sweep", "sweep.yaml", *machines, *LIGHT, *args)


def started_jobs(stdout: str) -> list[str]:
    return re.findall(r"^started: (\S+);", stdout, flags=re.M)


def test_seed_example_runs_every_combination_once_with_its_records(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    result = sweep(cluster4, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    started = started_jobs(result.stdout)
    assert sorted(started) == sorted(f"{n}.{c}" for n in EXPECTED for c in ("train", "test"))
    results = tmp_path / "job_results"
    assert sorted(p.name for p in results.iterdir() if not p.name.startswith(".")) == sorted(EXPECTED)
    where: set[tuple[str, str]] = set()
    for name, (lr, seed) in EXPECTED.items():
        folder = results / name
        param = json.loads((folder / "param.json").read_text())
        assert {k: param[k] for k in ("_name", "_output", "lr", "seed", "epochs")} == {
            "_name": name, "_output": f"job_results/{name}", "lr": lr, "seed": seed, "epochs": 10,
        }
        assert param["_commands"]["test"].endswith(
            f"printf '{{\"score\": %s, \"epochs\": %s}}' {lr} 10 > job_results/{name}/metrics.json"
        )
        stat = json.loads((folder / "stat.json").read_text())
        assert set(stat) == {"train", "test"}
        host, gpus, _ = (folder / "train_where.txt").read_text().split()
        for command in ("train", "test"):
            entry = stat[command]
            assert entry["code"] == 0 and entry["host"] in {"h1", "h2", "h3", "h4"}
            assert len(entry["gpus"]) == 1 and entry["seconds"] >= 0 and entry["ended"] >= entry["started"]
            # both commands print nothing (they write files): every job that ended has both logs
            assert (folder / f"{command}.out").read_text() == (folder / f"{command}.err").read_text() == ""
        # stat.json names the host and GPU the job itself saw.
        assert (stat["train"]["host"], str(stat["train"]["gpus"][0])) == (host, gpus)
        assert (folder / "model.txt").read_text() == f"model {lr} {seed}\n"
        where.add((host, gpus))
    assert len({h for h, _ in where}) >= 2 and len(where) >= 3  # spread over hosts and GPUs

    table = cli(tmp_path, "results")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["name", "lr", "seed", "state", "score", "epochs"]
    assert [line.split()[:4] for line in lines[2:]] == [
        [n, str(lr), str(seed), "done"] for n, (lr, seed) in EXPECTED.items()
    ]
    as_csv = cli(tmp_path, "results", "job_results", "--csv")
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [(r["name"], float(r["lr"]), int(r["seed"]), r["state"], float(r["score"])) for r in rows] == [
        (n, lr, seed, "done", lr) for n, (lr, seed) in EXPECTED.items()
    ]


def test_rerun_after_one_failure_reruns_only_that_command(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    (tmp_path / "fail-0.01-1").write_text("make this combination's test fail once")
    first = sweep(cluster4, tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "failed: lr_0.01-seed_1.test;" in first.stdout and "(exit 3 on h" in first.stdout
    folder = tmp_path / "job_results" / "lr_0.01-seed_1"
    before = json.loads((folder / "stat.json").read_text())
    assert before["test"]["code"] == 3 and before["train"]["code"] == 0
    failing = cli(tmp_path, "results", "--csv")
    states = {r["name"]: r["state"] for r in csv.DictReader(io.StringIO(failing.stdout))}
    assert states.pop("lr_0.01-seed_1") == "failed: test (exit 3)"
    assert set(states.values()) == {"done"}

    (tmp_path / "fail-0.01-1").unlink()
    second = sweep(cluster4, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert started_jobs(second.stdout) == ["lr_0.01-seed_1.test"]
    assert second.stdout.count("skipped: ") == 9
    after = json.loads((folder / "stat.json").read_text())
    assert after["train"] == before["train"] and after["test"]["code"] == 0
    assert json.loads((folder / "metrics.json").read_text()) == {"score": 0.01, "epochs": 10}
    # The failed attempt's own files were kept, not deleted.
    assert (tmp_path / "job_results" / ".jobs" / ".previous" / "lr_0.01-seed_1.test.1").is_dir()

    # -t and -c pick what runs; -f runs it again even though it succeeded.
    third = sweep(cluster4, tmp_path, "-t", "small", "-c", "train", "-f")
    assert third.returncode == 0, third.stdout + third.stderr
    assert sorted(started_jobs(third.stdout)) == ["lr_0.001-seed_2.train", "lr_0.01-seed_2.train"]


def test_each_combination_runs_its_commands_in_order(cluster4: Cluster, tmp_path: Path) -> None:
    # Room for every job at once: only `after` can keep a test from starting with its train.
    (tmp_path / "sweep.yaml").write_text(SWEEP.replace(
        "test ! -e fail-{lr}-{seed} || exit 3;", "cat {_output}/model.txt || exit 4;"
    ))
    result = sweep(cluster4, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in EXPECTED:
        folder = tmp_path / "job_results" / name
        train_end = float((folder / "train_end.txt").read_text())
        test_start = float((folder / "test_start.txt").read_text())
        assert test_start > train_end, name  # the jobs' own clocks, on the hosts they ran on
        # The test read what its train wrote, wherever each of them ran.
        assert (folder / "test.out").read_text() == (folder / "model.txt").read_text()


def test_a_documents_needs_apply_to_its_jobs(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "sweep.yaml").write_text(SWEEP + "gpus_per_job: 2\n")  # the "small" document
    result = sweep(cluster4, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    two = (tmp_path / "job_results" / "lr_0.001-seed_2" / "test_where.txt").read_text().split()
    one = (tmp_path / "job_results" / "lr_0.1-seed_1" / "test_where.txt").read_text().split()
    assert sorted(two[1].split(",")) == ["0", "1"] and one[1] in ("0", "1")


# --- execute_batch's options on a sweep: --detach (attach, status, cancel) and --json ----------

MARK = "sleep 3232"  # a job command no other test runs: found on a host by pgrep -f


def jobs_on_hosts(cluster: Cluster) -> int:
    return sum(len(h.run(f"pgrep -f '^{MARK}$' || true", user=h.user).stdout.split()) for h in cluster.hosts)


def wait_for(check: Callable[[], bool], limit: float = 60) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def gone(pid: int) -> bool:
    return wait_for(lambda: not Path(f"/proc/{pid}").exists())


def test_a_detached_sweep_runs_on_and_attach_status_and_results_follow_it(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    # The command, whole: with --json, stdout holds the records `attach --json` starts with.
    started = sweep(cluster4, tmp_path, "--json", "--detach", "-q", "--max-connecting", "4")
    assert started.returncode == 0, started.stderr
    pid = int(re.findall(r"^detached: the sweep runs on in the background \(pid (\d+)\); its log: "
                         r"job_results/\.jobs/\.coordinator\.log$", started.stderr, flags=re.M)[0])
    records = [json.loads(line) for line in started.stdout.splitlines()]  # nothing else on stdout
    assert records[0]["event"] == "coordinator" and records[0]["pid"] == pid
    assert records[-1]["event"] == "batch_started" and records[-1]["jobs"] == 10
    assert ("  follow it: ssh-scheduler attach --results-dir job_results/.jobs; "
            "stop it: ssh-scheduler cancel --all --results-dir job_results/.jobs") in started.stderr.splitlines()
    assert "sweep: 5 of 5 combinations, 10 commands to run, 0 skipped; results in job_results/" in started.stderr

    attached = cli(tmp_path, "attach", "--results-dir", "job_results/.jobs")  # to its end, then its story
    assert attached.returncode == 0, attached.stderr
    assert sorted(started_jobs(attached.stdout)) == sorted(f"{n}.{c}" for n in EXPECTED for c in ("train", "test"))
    assert attached.stderr.splitlines()[-1] == "sweep: 5 of 5 combinations without a failure; see ssh-scheduler results job_results"
    assert gone(pid)
    status = json.loads(cli(tmp_path, "status", "job_results/.jobs", "--json").stdout)
    assert status["coordinator"] == "finished" and status["counts"]["finished"] == 10
    # The coordinator gathered each job into its combination's folder, as a foreground sweep does.
    table = list(csv.DictReader(io.StringIO(cli(tmp_path, "results", "--csv").stdout)))
    assert [(r["name"], r["state"]) for r in table] == [(n, "done") for n in EXPECTED]
    log = (tmp_path / "job_results" / ".jobs" / ".coordinator.log").read_text()
    assert "started: " not in log and "done: 10 finished, 0 failed" in log  # -q, as given


def test_cancel_all_stops_a_detached_sweep_and_its_jobs_on_the_hosts(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "sweep.yaml").write_text(f"template:\n  train: {MARK}\n  test: echo never\n---\nlr: [1, 2]\n")
    started = sweep(cluster4, tmp_path, "--detach")
    assert started.returncode == 0, started.stderr
    batch = ["--results-dir", "job_results/.jobs"]
    assert wait_for(lambda: jobs_on_hosts(cluster4) == 2)
    state = json.loads(cli(tmp_path, "status", "job_results/.jobs", "--json").stdout)
    assert state["coordinator"] == "running" and state["counts"]["running"] == 2

    stopped = cli(tmp_path, "cancel", "--all", *batch)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.splitlines()[-1] == "stopped"
    assert jobs_on_hosts(cluster4) == 0  # killed on the hosts, not orphaned
    attached = cli(tmp_path, "attach", *batch)
    assert attached.returncode == 130 and "echo never" not in attached.stdout
    assert attached.stderr.splitlines()[-1] == "cancelled: running jobs were killed"  # as a foreground sweep's two Ctrl-C


def test_json_prints_the_sweep_s_events_and_its_own_lines_go_to_stderr(cluster4: Cluster, tmp_path: Path) -> None:
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    result = sweep(cluster4, tmp_path, "--json", "--max-output-bytes", "100000", "--max-connecting", "4")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]  # nothing else on stdout
    assert events[0]["event"] in ("host_probed", "batch_started") and events[-1]["event"] == "batch_finished"
    finished = sorted(e["job"] for e in events if e["event"] == "job_finished")
    assert finished == sorted(f"{n}.{c}" for n in EXPECTED for c in ("train", "test"))
    assert "sweep: 5 of 5 combinations, 10 commands to run, 0 skipped; results in job_results/" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("sweep: 5 of 5 combinations without a failure")

