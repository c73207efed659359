#!/usr/bin/env python3
"""ssh_scheduler benchmark driver (run it through ``scripts/bench``).

Brings up the SSH test cluster (tests/cluster: real sshd hosts in network namespaces), then runs
every scenario as whole processes from the command line, as a user would, for ssh_scheduler and
its peers in alternation (the order rotates each round), several rounds.  Wall time is measured
around the full subprocess (start-up included); peak RSS and CPU come from ``wait4``.

Peers (parallel, pdsh) are slow, so they run at most ``--peer-rounds`` (2) rounds; ssh_scheduler and
the floor run every round.  ``--ref REV`` measures the package as committed at REV (exported, put
first on PYTHONPATH) instead of the working tree.  CPU is accounted per run for the client process
tree (wait4) and for the simulated hosts (their init/sshd reaped children), since on a small
machine the hosts share its cores.  Benchmarks are not tests: missed targets never fail the run.

Scenarios (``--quick`` sizes in brackets):
  1  1000 [300] x ``true`` on 4 hosts, no GPU, nothing copied: execute_batch (--num-cpus 0
     --memory-required 0, and a tiny-needs variant that spreads jobs over the hosts) vs the
     raw-asyncssh floor (scripts/bench_floor.py) vs GNU parallel -S --controlmaster
  2  200 x ``sleep 0.1`` on 4 hosts, 10 slots per host (ideal 0.5 s): execute_batch vs parallel
  3  100 [40] jobs sharing a 20 MB input folder, each writing a 100 KB result: execute_batch
     (cold caches, then a repeat with warm caches) vs parallel --transferfile/--return
  4  ``hostname`` on 16 hosts: execute_to vs pdsh -R ssh
  5  scenario 1 with 25 ms added on every host (cluster set_latency) vs the same on the LAN
  6  100,000 [20,000]-line batch, 64 [16] hosts x 8 GPUs, --dry-run: wall, peak RSS, us per job
  7  the ancestor README's 4-line example on 2 GPU hosts, start to finish
  combine  scripts/bench_combine.py (100k [20k] files)
  files-in, files-back, big-back  one job moving 5000 small files in / back, or one 200 MB file
     back, vs tar / cat over plain ssh (scripts/bench_driver/scenarios/files.py)
  scale256, churn  many hosts from one coordinator: scripts/bench_driver/scenarios/scale.py (not in
     the default list)
  slurm  (c) 1000 [200] x ``true`` through a test Slurm vs ``sbatch --array`` by hand
         (scripts/bench_slurm.py; only when asked: --scenarios slurm)

Results: a table on stdout and JSON in bench/results/<UTC time>-<git sha>.json (+ latest.json).
The code: this command line and scripts/bench_driver/ (the shared core, one module per scenario
family).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.cluster
sys.path.insert(0, str(REPO / "scripts"))  # bench_driver and the helper scripts

from bench_driver.base import PY, VENV_BIN, log  # noqa: E402
from bench_driver.bench import Bench  # noqa: E402
from bench_driver.catalogue import DEFAULT, ON_SMALL_CLUSTER, ORDER, makers  # noqa: E402
from bench_driver.environment import environment, sh  # noqa: E402
from bench_driver.records import Scenario, Target  # noqa: E402
from bench_driver.report import heading, summary  # noqa: E402
from bench_driver.results import result_text, save  # noqa: E402
from bench_driver.runner import run_scenario  # noqa: E402
from bench_driver.scenarios.files import FILE_SCENARIOS  # noqa: E402
from bench_driver.scenarios.scale import SCALE_SCENARIOS  # noqa: E402
from bench_driver.table import render_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds per scenario (default 3; median, min-max over rounds)",
    )
    ap.add_argument(
        "--scenarios",
        default=DEFAULT,
        help="comma list of 1-7, 'combine', the file-transfer ones (" + ", ".join(FILE_SCENARIOS) + "), "
        + ", ".join(SCALE_SCENARIOS) + " and 'slurm' (default: 1-7, combine and the file-transfer ones)",
    )
    ap.add_argument("--quick", action="store_true", help="1 round, smaller sizes")
    ap.add_argument(
        "--peer-rounds",
        type=int,
        default=2,
        help="at most this many rounds for the (slow) peers parallel and pdsh (default 2; the floor and ssh_scheduler run every round)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also run each ssh_scheduler command once under pyinstrument and once under py-spy (untimed) into bench/profiles/",
    )
    ap.add_argument(
        "--floor-channels",
        default="1,4",
        help="floor variants: channels at once per host connection (default 1,4)",
    )
    ap.add_argument(
        "--ref",
        help="measure the package as committed at this git ref (e.g. HEAD) instead of the working tree",
    )
    ap.add_argument(
        "--workdir",
        default="/var/tmp",
        help="where the runs' working directories go (default /var/tmp)",
    )
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/*.json")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    args.floor_channels = [int(x) for x in str(args.floor_channels).split(",") if x.strip()]
    wanted = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    bad = [w for w in wanted if w not in ORDER]
    if bad or args.rounds < 1:
        ap.error(
            f"unknown scenario(s) {bad}; choose from 1-7, combine and slurm"
            if bad
            else "--rounds must be >= 1"
        )
    if args.profile and not (
        (VENV_BIN / "py-spy").exists() and (VENV_BIN / "pyinstrument").exists()
    ):
        subprocess.run(
            [
                PY,
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "py-spy",
                "pyinstrument",
            ],
            check=True,
        )
    if os.geteuid() != 0:
        log(
            "warning: not root: the cluster runs in loopback mode (no latency control, no per-host namespaces)"
        )

    t_start = time.monotonic()
    env = environment()
    if args.ref:
        sha = sh(["git", "-C", str(REPO), "rev-parse", "--short", args.ref])
        if not sha:
            ap.error(f"--ref {args.ref}: not a git ref")
        env.update(measured=f"git {args.ref} ({sha})", git_sha=sha, ssh_scheduler_uncommitted_changes=[],
                   ssh_scheduler_tree_hash=None, git_subject=sh(["git", "-C", str(REPO), "log", "-1", "--format=%s", args.ref]))  # fmt: skip
    else:
        env["measured"] = "working tree"
    started_utc = dt.datetime.now(dt.UTC)
    log(f"{env['cores']} cores, load {env['loadavg_start']}, git {env['git_sha']}"
        + (f" (+ uncommitted changes in {len(env['ssh_scheduler_uncommitted_changes'])} package files)" if env["ssh_scheduler_uncommitted_changes"] else ""))  # fmt: skip

    bench = Bench(args)
    # As the measured commands import it: from a clean directory, with the runs' environment.
    env["package_imported_from"] = sh(
        [
            "env",
            f"PYTHONPATH={bench.env.get('PYTHONPATH', '')}",
            str(VENV_BIN / "python"),
            "-c",
            "import ssh_scheduler.cli.main, os; print(os.path.dirname(ssh_scheduler.cli.main.__file__))",
        ],
        cwd=bench.root,
    )
    if args.ref:
        in_ref = {p.name for p in (bench.code_root / "ssh_scheduler").glob("*.py")}
        env["modules_not_in_ref_taken_from_working_tree"] = sorted(
            p.name for p in (REPO / "ssh_scheduler").glob("*.py") if p.name not in in_ref
        )
    done: list[Scenario] = []
    target_map: dict[str, list[Target]] = {}
    errors: dict[str, str] = {}

    def on_term(signo: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        if any(w in wanted for w in ON_SMALL_CLUSTER):
            bench.cluster = bench.start_small_cluster()
        make = makers(bench)
        for sid in [v for v in ORDER if v in wanted]:
            if sid == "5" and bench.cluster is not None and not bench.cluster.namespaces:
                errors[sid] = "skipped: set_latency needs the namespaced cluster (root)"
                continue
            s = make[sid]()
            s.computed["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
            t0 = time.monotonic()
            try:
                run_scenario(bench, s)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # a broken scenario must not hide the others
                errors[sid] = f"{type(exc).__name__}: {exc}"
                log(f"scenario {sid} aborted: {errors[sid]}")
            s.computed["scenario_s"] = round(time.monotonic() - t0, 1)
            s.computed["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            target_map[sid] = s.targets(s)
            done.append(s)
    except KeyboardInterrupt:
        log("interrupted: reporting what was measured")
        errors["interrupted"] = "run interrupted"
    finally:
        bench.close()

    total_s = time.monotonic() - t_start
    env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    table = render_table(done, target_map)
    print()
    for line in heading(env, started_utc, args.quick, args.rounds, total_s):
        print(line)
    print()
    print(table)
    print()
    for line in summary(done, errors):
        print(line)
    text = result_text(
        started_utc=started_utc, total_s=total_s, quick=args.quick, rounds=args.rounds,
        wanted=wanted, env=env, cluster_info=bench.cluster_info, errors=errors, done=done,
        target_map=target_map, table=table,
    )  # fmt: skip
    if not args.no_save:
        saved = save(text, started_utc, env["git_sha"], args.quick)
        print(f"\nresults: {saved} (and latest.json)")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
