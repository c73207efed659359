"""Python functions as jobs against Dask (issue 21).

  functions  1000 [300] calls of a trivial function on 4 hosts, from a cold start (the process's
             start) to the last result: ``ssh_scheduler.Executor.map``, Dask's ``SSHCluster`` doing
             the same on the same hosts (its scheduler and workers started over SSH: start-up
             included), the same calls through joblib's ``Parallel(batch_size=50)`` over our
             backend (50 calls per job, in one process), and 1000 [300] shell ``true`` jobs
             through ``execute_batch``; every tool
             every round, the order rotating, with each round's ratios and the worst round.

The measured programs are scripts/bench_functions.py.  Dask runs from its own venv,
``.venv/peers/dask`` (dask, distributed, asyncssh; scripts/bench makes it, never the package's
dependencies), built from the hosts' own ``/usr/bin/python3``: the same file runs the client here
and the scheduler and workers on the hosts, which see this filesystem (but not /root).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from bench_driver.base import PY, REPO, VENV_BIN
from bench_driver.bench import Bench
from bench_driver.measure import Cmd, Run, read
from bench_driver.profiling import profile_argv
from bench_driver.records import SSH_TOOL, Group, Scenario, Target, Tool, faster_target
from bench_driver.verify import verify_batch

DASK_PY = REPO / ".venv" / "peers" / "dask" / "bin" / "python"
SCRIPT = REPO / "scripts" / "bench_functions.py"
EXECUTOR = SSH_TOOL + " Executor.map"
JOBLIB_BATCH = 50
JOBLIB = SSH_TOOL + f" joblib Parallel(batch_size={JOBLIB_BATCH})"
CHUNKED = SSH_TOOL + f" Executor.map(chunksize={JOBLIB_BATCH})"
DASK = "Dask SSHCluster (start-up included)"
TRUE_JOBS = SSH_TOOL + " execute_batch, shell true"


def verify_calls(expected: int) -> Callable[[Cmd, Run], None]:
    """The program's last stdout line: every call's value came back (and where it ran)."""

    def check(cmd: Cmd, run: Run) -> None:
        lines = [line for line in read(cmd.cwd / "stdout.txt").splitlines() if line.startswith("{")]
        said = json.loads(lines[-1]) if lines else {}
        run.extra.update({k: said[k] for k in ("hosts", "first_result_s", "cluster_up_s") if k in said})
        if run.rc != 0 or not said.get("ok") or said.get("calls") != expected:
            run.ok = False
            err = read(cmd.cwd / "stderr.txt").strip().splitlines()
            run.note = f"rc {run.rc}, {said.get('calls', 0)} of {expected} values; " + (err[-1][:200] if err else "")

    return check


def scenario_functions(bench: Bench) -> Scenario:
    n = 300 if bench.quick else 1000
    names = ["h1", "h2", "h3", "h4"]
    batch = bench.root / f"batch_true_{n}"
    batch.write_text("true\n" * n)

    def ours(cwd: Path) -> Cmd:
        return Cmd([PY, str(SCRIPT), "ours", str(n), *bench.machines(names)], cwd, env=bench.env)

    def joblib(cwd: Path) -> Cmd:
        argv = [PY, str(SCRIPT), "ours", str(n), *bench.machines(names), "--joblib-batch", str(JOBLIB_BATCH)]
        return Cmd(argv, cwd, env=bench.env)

    def chunked(cwd: Path) -> Cmd:
        argv = [PY, str(SCRIPT), "ours", str(n), *bench.machines(names), "--chunksize", str(JOBLIB_BATCH)]
        return Cmd(argv, cwd, env=bench.env)

    def dask(cwd: Path) -> Cmd:
        cluster = bench.cluster
        assert cluster is not None
        if not DASK_PY.exists():  # scripts/bench could not make it: the run fails with why
            why = f"no {DASK_PY} (scripts/bench makes it: pip install dask distributed asyncssh)"
            return Cmd(["sh", "-c", f"echo '{why}' >&2; exit 1"], cwd, env=bench.env)
        hosts = [f"{bench.host(nm).user}@{bench.host(nm).ip}" for nm in names]
        argv = [
            str(DASK_PY), str(SCRIPT), "dask", str(n), *hosts,
            "--key", str(cluster.key_path), "--known-hosts", str(cluster.known_hosts),
            "--python", str(DASK_PY),
        ]  # fmt: skip
        return Cmd(argv, cwd, env=bench.env)

    def true_jobs(cwd: Path) -> Cmd:
        shutil.copy(batch, cwd / "batch")
        (cwd / "empty").mkdir()
        argv = [
            str(VENV_BIN / "execute_batch"), "batch", "--machines", *bench.machines(names),
            "--no-gpu-required", "--num-cpus", "1", "--memory-required", "0", "--copy-forwards", "empty",
        ]  # fmt: skip
        return Cmd(argv, cwd, env=bench.env)

    # Every tool every round ("reference" and "info" are not the slow peers --peer-rounds cuts).
    executor = Tool(EXECUTOR, ours, verify_calls(n), n, "ssh_scheduler")
    batched = Tool(JOBLIB, joblib, verify_calls(n), n, "info")
    in_chunks = Tool(CHUNKED, chunked, verify_calls(n), n, "info")
    peer = Tool(DASK, dask, verify_calls(n), n, "reference")
    shell = Tool(TRUE_JOBS, true_jobs, verify_batch(n), n, "info", profile_argv=profile_argv)

    def targets(s: Scenario) -> list[Target]:
        # Per round, Dask's wall / ours (the two ran in the same round): met only if the worst
        # round meets it.
        return [faster_target("end to end >= 1.0 x Dask's (Dask's wall / ours)", tool, peer, 1.0)
                for tool in (executor, in_chunks, batched)]  # fmt: skip

    return Scenario(
        "functions",
        f"{n} calls of a trivial function on 4 hosts, cold start to last result: Executor.map vs "
        f"Dask SSHCluster (start-up included) vs {n} x true through execute_batch",
        [Group([executor]), Group([peer]), Group([in_chunks]), Group([batched]), Group([shell])],
        {"calls": n, "hosts": 4, "cpus_per_host": 4, "dask_workers": "1 per host, 4 threads",
         "executor_needs": "no GPU, num_cpus 1 on 4-CPU hosts: 4 at once per host, as Dask's 4 threads"},
        targets,
        notes=[
            "Dask: scheduler on h1 beside its worker, one worker of 4 threads per host, client.map "
            "then gather; its venv is .venv/peers/dask (the hosts' python3)",
            "each Executor call is a job: one Python process per call on its host; joblib with "
            f"batch_size={JOBLIB_BATCH} runs {JOBLIB_BATCH} calls per job, in one process",
        ],
        report_last=per_round,
    )


def per_round(s: Scenario) -> list[str]:
    """Each round's ratios (runs of one round side by side) and the worst round, with the load."""
    mine, theirs, shell, batched = s.tool(EXECUTOR), s.tool(DASK), s.tool(TRUE_JOBS), s.tool(JOBLIB)
    out = []
    worst: float | None = None
    for i, run in enumerate(mine.runs):
        dask = theirs.runs[i] if i < len(theirs.runs) else None
        true = shell.runs[i] if i < len(shell.runs) else None
        parts = [f"round {i + 1}: Executor.map {run.wall:.2f} s" + ("" if run.ok else " (failed)")]
        if dask is not None and dask.ok and run.ok:
            ratio = dask.wall / run.wall
            worst = ratio if worst is None else min(worst, ratio)
            up = dask.extra.get("cluster_up_s")
            parts.append(f"Dask {dask.wall:.2f} s (cluster up at {up} s): {ratio:.2f}x Dask")
        elif dask is not None:
            parts.append(f"Dask failed ({dask.note})")
        joblib = batched.runs[i] if i < len(batched.runs) else None
        if joblib is not None and joblib.ok and dask is not None and dask.ok:
            parts.append(f"joblib batches {joblib.wall:.2f} s: {dask.wall / joblib.wall:.2f}x Dask")
        if true is not None and true.ok and run.ok:
            parts.append(f"{s.params['calls']} x true {true.wall:.2f} s: calls take {run.wall / true.wall:.1f}x as long")
        parts.append(f"load1 at start {run.load1:.2f}, machine busy {run.machine_busy_pct:.0f}%")
        out.append("; ".join(parts))
    if worst is not None:
        out.append(f"worst round: Executor.map {worst:.2f}x Dask (target >= 1.0x)")
    pairs = [(d.wall / j.wall) for d, j in zip(theirs.runs, batched.runs, strict=False) if d.ok and j.ok]
    if pairs:
        out.append(f"worst round: joblib batches {min(pairs):.2f}x Dask")
    return out
