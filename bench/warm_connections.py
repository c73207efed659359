#!/usr/bin/env python3
"""Warm connections (issue 22): each command cold (no hub: it starts one and connects), then warm
(the same command again, through the hub), against the same command connecting directly
(``--keep-warm 0``) and pdsh with the same ssh options -- on the SSH test cluster, as a user runs
them: whole processes, start-up included.  A stopgap until scripts/bench runs its scenarios
cold then warm; needs root (the namespaced cluster).

    .venv/bin/python bench/warm_connections.py [--rounds 5] [--hosts 32] [--out FILE.json]

Rows (median and min of the rounds, wall seconds; client CPU is the command's own process tree,
not the hub's):
  to16 / to32  ``execute_to hostname`` on 16 and 32 hosts, vs ``pdsh -R ssh`` (same ssh options as
               scripts/bench's scenario 4: strict host keys, the cluster's known_hosts)
  remote       ``execute_remote 'echo hi'`` on one host (nothing copied)
  example      the ancestor README's 4-line batch on 2 hosts with 2 GPUs (scenario 7), and the
               launch to its first job running (its journal's first start against the launch)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from bench_driver.verify import journal_summary  # noqa: E402

from tests.cluster import GpuSpec, HostSpec, start_cluster  # noqa: E402

BIN = REPO / ".venv" / "bin"
LINES = [
    'echo "one job"',
    'echo "another job"',
    'echo "another job" && echo "a combined job (bash syntax applies)"',
    'bash examples/local.sh && echo "you can also call local files because they are copied by the remote by the default value of --copy-forwards"',
]


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, float, subprocess.CompletedProcess[str]]:
    """(wall s, client CPU s, launch epoch, the process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0, epoch = time.perf_counter(), time.time()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, cpu, epoch, done


def stop_hub(env: dict[str, str]) -> None:
    subprocess.run([str(BIN / "ssh-scheduler"), "hub", "stop"], env=env, capture_output=True, check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # its socket goes when it has exited
        if not any(Path(env["XDG_RUNTIME_DIR"], "ssh_scheduler").glob("hub-*.sock")):
            return
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    specs = [HostSpec(gpus=[GpuSpec(memory_mb=81559) for _ in range(2)]) for _ in range(args.hosts)]
    cluster = start_cluster(specs)
    runtime = Path(tempfile.mkdtemp(prefix="warm-", dir="/tmp"))
    work = Path(tempfile.mkdtemp(prefix="warm-work-", dir="/var/tmp"))
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), PYTHONPATH=str(REPO))
    env.pop("SSH_SCHEDULER_KEEP_WARM", None)
    machines = {h.name: str(h.machine_file) for h in cluster.hosts}
    ssh_opts = cluster.hosts[0].ssh_argv()[1:-3]
    pdsh_env = dict(env, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS=" ".join([*ssh_opts, "-l%u", "%h"]))
    results: dict[str, dict[str, list[float]]] = {}

    def note(row: str, column: str, value: float) -> None:
        results.setdefault(row, {}).setdefault(column, []).append(round(value, 4))

    def to(n: int, *extra: str) -> Callable[[Path], list[str]]:
        return lambda cwd: [str(BIN / "execute_to"), *extra, "--machines", *[machines[f"h{i}"] for i in range(1, n + 1)], "--", "hostname"]

    def remote(*extra: str) -> Callable[[Path], list[str]]:
        return lambda cwd: [str(BIN / "execute_remote"), *extra, "--machine", machines["h1"], "--", "echo hi"]

    def example(*extra: str) -> Callable[[Path], list[str]]:
        def argv(cwd: Path) -> list[str]:
            shutil.rmtree(cwd / "job_results", ignore_errors=True)
            (cwd / "batch_script.sh").write_text("\n".join(LINES) + "\n")
            (cwd / "examples").mkdir(exist_ok=True)
            (cwd / "examples" / "local.sh").write_text('echo "local.sh ran on $(hostname)"\n')
            return [str(BIN / "execute_batch"), "batch_script.sh", *extra, "--machines",
                    machines[f"h{args.hosts - 1}"], machines[f"h{args.hosts}"], "--memory-required=2000"]

        return argv

    rows = [("to16", to, 16), ("to32", to, 32), ("remote", remote, 0), ("example", example, 0)]
    try:
        for r in range(args.rounds):
            for row, make, n in rows:
                if row == "to32" and args.hosts < 32:
                    continue
                cwd = work / f"{row}-{r}"
                cwd.mkdir()
                build = make(n) if n else make()
                direct = make(n, "--keep-warm", "0") if n else make("--keep-warm", "0")
                stop_hub(env)
                for column, argv in (("cold", build), ("warm", build), ("direct", direct)):
                    wall, cpu, epoch, _ = run(argv(cwd), cwd, env)
                    note(row, column, wall)
                    note(row, f"{column} cpu", cpu)
                    if row == "example":
                        _, first, _ = journal_summary(cwd / "job_results")
                        if first is not None:
                            note(row, f"{column} first job", first - epoch)
                if row.startswith("to"):
                    wall, cpu, _, _ = run(
                        ["pdsh", "-R", "ssh", "-f", "32", "-w",
                         ",".join(f"{h.user}@{h.ip}" for h in cluster.hosts[:n]), "hostname"], cwd, pdsh_env)
                    note(row, "pdsh", wall)
                    note(row, "pdsh cpu", cpu)
            print(f"round {r + 1} done", file=sys.stderr)
    finally:
        stop_hub(env)
        cluster.stop()
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'row':<9} {'column':<18} {'median':>8} {'min':>8}  (seconds, {args.rounds} rounds; load {os.getloadavg()[0]:.1f})")
    for row, columns in results.items():
        for column, values in columns.items():
            print(f"{row:<9} {column:<18} {statistics.median(values):8.3f} {min(values):8.3f}")
    for row in ("to16", "to32"):
        if row in results:
            warm, pdsh = statistics.median(results[row]["warm"]), statistics.median(results[row]["pdsh"])
            print(f"{row}: warm / pdsh = {warm / pdsh:.2f} (target <= 0.25)")
    if args.out:
        with contextlib.suppress(OSError):
            args.out.write_text(json.dumps({"rounds": args.rounds, "hosts": args.hosts, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
