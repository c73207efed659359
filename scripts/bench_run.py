#!/usr/bin/env python3
"""ssh_scheduler benchmark driver (run it through ``scripts/bench``).

Brings up the SSH test cluster (tests/cluster: real sshd hosts in network namespaces), then runs
every scenario as whole processes from the command line, as a user would, for ssh_scheduler and
its peers in alternation (the order rotates each round), several rounds.  Wall time is measured
around the full subprocess (start-up included); peak RSS and CPU come from ``wait4``.

Fair by construction: every tool runs in every round (>= 3 for a verdict) on the same hosts with
the same jobs at once per host; every OpenSSH peer (pdsh, GNU parallel, the ssh pipes, the
by-hand sbatch) and asyncssh floor is pinned to the key exchange and cipher ssh_scheduler
negotiates (scripts/bench_kex.py reads both sides; the report says which); workloads are real
programs (/bin/true, hostname), never a shell builtin.  Each target is judged round by round on
the two tools measured back to back, and holds only if its worst round does.  Commands with a
warm variant run twice, cold (whatever held connections to the hosts is ended first) then warm;
the report says, from the logins the hosts saw, whether the warm call reused anything.

Two floors under ssh_scheduler's throughput: the exec floor (scripts/bench_floor.py: a channel
and login shell per job, more host work than our agent: a bar) and the agent floor
(scripts/bench_agent_floor.py: one channel per host, a minimal stdlib agent spawning each line
without a shell: what our design can cost at best).  ``--ref REV`` measures the package as
committed at REV (exported, put first on PYTHONPATH) instead of the working tree.  CPU is
accounted per run for the client process tree (wait4) and for the simulated hosts (their
init/sshd reaped children), since on a small machine the hosts share its cores.  Benchmarks are
not tests: missed targets never fail the run.

Scenarios (``--quick`` sizes in brackets):
  1  1000 [300] x /bin/true on 4 hosts, 4 at once per host: execute_batch vs the exec floor, the
     agent floor and GNU parallel -S -M
  2  200 x ``sleep 0.1`` on 4 hosts, 10 slots per host (ideal 0.5 s): execute_batch vs parallel
  3  100 [40] jobs sharing a 20 MB input folder, each writing a 100 KB result: execute_batch
     (cold caches, then a repeat with warm caches) vs parallel --transferfile and --basefile
  4  ``hostname`` on 16 and 32 hosts: execute_to cold and warm vs pdsh -R ssh and an asyncssh fan-out
  5  scenario 1 with 25 ms added on every host (cluster set_latency) vs the same on the LAN
  6  100,000 [20,000]-line batch, 64 [16] hosts x 8 GPUs, --dry-run: wall, peak RSS, us per job
  7  the ancestor README's 4-line example on 2 GPU hosts, cold and warm: start to finish, and
     launch to the first job
  remote  execute_remote of one command on one host, cold and warm
  combine  scripts/bench_combine.py (100k [20k] files; only when asked)
  files-in, files-back, big-back  one job moving 5000 small files in / back, or one 200 MB file
     back, vs tar / cat over plain ssh (scripts/bench_driver/scenarios/files.py)
  scale256  256 hosts: connect + probe + one job each vs pdsh running /bin/true on them
  churn  2000 [500] x true on 4, 16 and 32 hosts: CPU per job, probes (only when asked)
  slurm  (c) 300 [100] x ``true`` through a test Slurm vs one ``sbatch --array`` by hand
         (scripts/bench_slurm.py)

Results: a table on stdout and JSON in bench/results/<UTC time>-<label>.json, the label being the
measured commit (``<sha>-dirty`` when the package had uncommitted changes: not that commit);
scripts/bench_readme.py makes the README's table from one.  The code: this command line and
scripts/bench_driver/ (the shared core, one module per scenario family).
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
from bench_driver.environment import environment, label, sh  # noqa: E402
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
        help="rounds per scenario for every tool (default 3; fewer judge nothing for sure)",
    )
    ap.add_argument(
        "--scenarios",
        default=DEFAULT,
        help="comma list of 1-7, 'remote', 'combine', the file-transfer ones (" + ", ".join(FILE_SCENARIOS) + "), "
        + ", ".join(SCALE_SCENARIOS) + " and 'slurm' (default: all but churn and combine)",
    )
    ap.add_argument("--quick", action="store_true", help="1 round, smaller sizes")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also run each ssh_scheduler command once under pyinstrument and once under py-spy (untimed) into bench/profiles/",
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
    ap.add_argument(
        "--disk",
        choices=("loop", "here"),
        default="loop",
        help="loop (default, as root): measure on a fresh ext4 with a journal on a loop device; "
        "here: on --workdir's own filesystem (see bench_driver/disk.py for why)",
    )
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/*.json")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    wanted = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    bad = [w for w in wanted if w not in ORDER]
    if bad or args.rounds < 1:
        ap.error(
            f"unknown scenario(s) {bad}; choose from {', '.join(ORDER)}"
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
        env.update(git_sha=sha, ssh_scheduler_uncommitted_changes=[],
                   ssh_scheduler_tree_hash=None, git_subject=sh(["git", "-C", str(REPO), "log", "-1", "--format=%s", args.ref]))  # fmt: skip
    env["measured"], env["label"] = label(env)
    if env["ssh_scheduler_uncommitted_changes"]:
        log(f"warning: measuring {env['measured']}: the result is labelled {env['label']}")
    started_utc = dt.datetime.now(dt.UTC)
    log(f"{env['cores']} cores, load {env['loadavg_start']}, git {env['git_sha']}"
        + (f" (+ uncommitted changes in {len(env['ssh_scheduler_uncommitted_changes'])} package files)" if env["ssh_scheduler_uncommitted_changes"] else ""))  # fmt: skip

    bench = Bench(args)
    env["disk"] = bench.disk.info
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
    env["ssh_match"] = bench.ssh_match
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
        saved = save(text, started_utc, env["label"], args.quick)
        print(f"\nresults: {saved}")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
