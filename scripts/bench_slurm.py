#!/usr/bin/env python3
"""Benchmark scenario (c): N trivial jobs through ssh_scheduler into Slurm, against the same N
submitted by hand as one ``sbatch --array`` on the login node.

Starts its own test Slurm (tests/slurm_cluster.py: slurmctld, 4 slurmd nodes; needs root and
Debian's slurmctld slurmd slurm-client munge) with an SSH login node (tests/cluster), then, in
alternation for ``--rounds`` rounds:

* by hand: ``ssh login sbatch --array=1-N --wrap true``, wall until squeue shows none of them
  (OpenSSH pinned to the key exchange and cipher ssh_scheduler negotiates: scripts/bench_kex.py);
* ssh_scheduler: ``execute_batch`` of N lines of ``true`` with the login node's machine YAML
  (``slurm: {max_queued, poll_interval}``), wall and CPU of the whole coordinator process.

Prints a table and, last, one JSON line (scripts/bench_run.py's ``slurm`` scenario reads it),
with each round's pair of walls and their ratio (``per_round``).
Benchmarks are not tests: nothing here fails over a number.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_kex import matched  # noqa: E402

from tests.cluster import HostSpec, start_cluster  # noqa: E402
from tests.slurm_cluster import SlurmCluster, slurm_available, slurm_cluster  # noqa: E402

PY = (
    str(REPO / ".venv" / "bin" / "python")
    if (REPO / ".venv" / "bin" / "python").exists()
    else sys.executable
)


def wait_drained(slurm: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while slurm.active_jobs():
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs still queued after {timeout:g} s")
        time.sleep(0.05)


def by_hand(login: object, slurm: SlurmCluster, jobs: int, options: list[str]) -> float:
    began = time.monotonic()
    sub = login.ssh(f"sbatch --parsable --array=1-{jobs} -o /dev/null --mem=100M --wrap true", options=options)  # type: ignore[attr-defined]
    if sub.returncode != 0:
        raise RuntimeError(f"sbatch failed: {sub.stderr}")
    wait_drained(slurm, 3600)
    return time.monotonic() - began


def through_us(machine: dict[str, object], jobs: int, workdir: Path) -> tuple[float, float, int]:
    """Wall seconds, coordinator CPU seconds (user + system, wait4) and jobs finished."""
    workdir.mkdir()
    (workdir / "jobs.sh").write_text("true\n" * jobs)
    (workdir / "slurm.yaml").write_text(yaml.safe_dump(machine))
    argv = [PY, "-m", "ssh_scheduler", "execute_batch", "jobs.sh", "--machines", "slurm.yaml",
            "--no-gpu-required", "--num-cpus", "1", "--memory-required", "100", "-q"]  # fmt: skip
    env = measured_env()
    began = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - began
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        # What the failed jobs said (their .err files go with the run's folder).
        said = [f"{p.name}: {p.read_text(errors='replace')[-500:]}"
                for p in sorted((workdir / "job_results").glob("*.err")) if p.stat().st_size]
        raise RuntimeError(f"execute_batch failed ({proc.returncode}): {err[-2000:]} | {' | '.join(said)[:2000]}")
    # Each committed job has its results folder (a silent job leaves no .out file).
    done = sum(1 for p in (workdir / "job_results").glob("jobs.sh.*") if p.is_dir())
    return wall, usage.ru_utime + usage.ru_stime, done


def what_slurm_said(slurm: SlurmCluster) -> str:
    """Slurm's own record of the jobs that did not complete (scontrol, and what slurmctld and
    the nodes' slurmd logged of them): how a failed job failed, beyond its exit status."""
    text = slurm.command("scontrol", "-o", "show", "job", check=False)
    failed = [line for line in text.splitlines() if " JobState=" in line and " JobState=COMPLETED " not in line]
    # slurmctld logs an array's task as JobId=<array>_<task>(<id>), a plain job as JobId=<id>
    names = []
    for line in failed[:3]:
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        job_id = re.escape(fields.get("JobId", "?"))
        names += [rf"JobId={job_id}\b", rf"\[{job_id}\.batch\]", rf"\bjob {job_id}\b"]  # slurmd's forms
        if "ArrayJobId" in fields:
            names.append(re.escape(f"JobId={fields['ArrayJobId']}_{fields.get('ArrayTaskId', '?')}("))
    log = []  # the controller's log, then the nodes' (slurmd-<node>.log)
    for path in sorted((slurm.base / "log").glob("slurm*.log"), key=lambda p: p.name != "slurmctld.log"):
        log += [f"{path.stem}: {line}" for line in path.read_text(errors="replace").splitlines()]
    said = [line for line in log if any(re.search(n, line) for n in names)]
    return f"{len(failed)} not completed: {' || '.join(failed[:3])} || logged: {' || '.join(said[-30:])}"


def measured_env() -> dict[str, str]:
    """The environment the measured package is imported in: a PYTHONPATH given (the driver's
    --ref puts the exported package there) or this checkout."""
    return dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH") or str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument(
        "--cpus-per-node", type=int, default=4, help="job slots per node (default 4: 16 in all)"
    )
    ap.add_argument("--max-queued", type=int, default=64)
    ap.add_argument("--poll-interval", type=float, default=1.0)
    args = ap.parse_args()
    why = slurm_available()
    if why is not None:
        print(f"bench_slurm: {why}", file=sys.stderr)
        return 2
    cluster = start_cluster([HostSpec(name="login")])
    hand: list[float] = []
    ours: list[tuple[float, float, int]] = []
    try:
        with slurm_cluster(cluster, nodes=args.nodes, cpus_per_node=args.cpus_per_node) as slurm:
            login = cluster.hosts[0]
            pinned = matched(PY, str(cluster.machines_dir / "login.yaml"), measured_env(), login.ssh_argv())
            machine = slurm.machine_yaml(
                login, max_queued=args.max_queued, poll_interval=args.poll_interval
            )
            with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
                for r in range(args.rounds):
                    for kind in ("hand", "ours") if r % 2 == 0 else ("ours", "hand"):
                        if kind == "hand":
                            hand.append(by_hand(login, slurm, args.jobs, pinned["options"]))
                        else:
                            try:
                                ours.append(through_us(machine, args.jobs, Path(tmp) / f"round{r}"))
                            except RuntimeError as exc:
                                raise RuntimeError(f"{exc} | {what_slurm_said(slurm)}") from None
                        print(
                            f"round {r + 1} {kind}: {hand[-1] if kind == 'hand' else ours[-1][0]:.1f} s",
                            file=sys.stderr,
                        )
    finally:
        cluster.stop()
    hand_s = statistics.median(hand)
    ours_s = statistics.median(w for w, _c, _n in ours)
    result = {
        "scenario": "slurm",
        "jobs": args.jobs,
        "slots": args.nodes * args.cpus_per_node,
        "max_queued": args.max_queued,
        "poll_interval": args.poll_interval,
        "by_hand_array_s": round(hand_s, 2),
        "through_us_s": round(ours_s, 2),
        "through_us_jobs_per_s": round(args.jobs / ours_s, 1),
        "by_hand_jobs_per_s": round(args.jobs / hand_s, 1),
        "ratio_us_to_hand": round(ours_s / hand_s, 2),
        "coordinator_cpu_s": round(statistics.median(c for _w, c, _n in ours), 2),
        "jobs_finished": min(n for _w, _c, n in ours),
        "rounds": args.rounds,
        "per_round": [
            {"by_hand_s": round(h, 2), "through_us_s": round(o[0], 2), "ratio_us_to_hand": round(o[0] / h, 3)}
            for h, o in zip(hand, ours, strict=True)
        ],
        "ssh_match": {k: pinned[k] for k in ("kex", "cipher", "same", "openssh")},
    }
    print(f"{'':24}{'median wall':>12}{'jobs/s':>9}")
    print(f"{'sbatch --array by hand':24}{hand_s:>11.1f}s{args.jobs / hand_s:>9.1f}")
    print(f"{'execute_batch (Slurm)':24}{ours_s:>11.1f}s{args.jobs / ours_s:>9.1f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
