"""Running a scenario: its rounds, the groups in an order that rotates each round, every tool
in a fresh working folder, measured and verified.  Every tool runs in every round, peers
included, so each round compares tools measured back to back under the same load."""

from __future__ import annotations

import os
from pathlib import Path

from bench_driver.base import log
from bench_driver.bench import Bench
from bench_driver.measure import run_cmd
from bench_driver.profiling import profile
from bench_driver.records import Scenario

BIG = 1 << 20


def set_aside(cwd: Path) -> None:
    """Free a finished run's large files now (the disk's room), and leave its folders and small
    files where they are until the bench ends (Bench.close removes its whole root).

    Why not remove it all now: on ext4 without a journal (this machine's root), the inode
    allocator skips inodes freed in the last minute or more (``recently_deleted``), reading the
    inode table for each: removing a run's thousands of small files right before the next run
    made every file that run created cost several times more (a 1000-job batch's jobs spanned 3.3 s
    in rounds 2 and 3 against 1.5 s in round 1).  That is the harness's own cleanup landing on
    the next tool measured, not that tool's cost.  Large files are few inodes."""
    for folder, _dirs, files in os.walk(cwd):
        for name in files:
            path = os.path.join(folder, name)
            try:
                if os.lstat(path).st_size >= BIG:
                    os.unlink(path)
            except OSError:
                pass


def run_scenario(bench: Bench, s: Scenario) -> None:
    rounds = s.rounds or bench.args.rounds
    log(f"scenario {s.sid}: {s.title} ({rounds} round{'s' if rounds > 1 else ''})")
    s.prepare()
    try:
        for r in range(rounds):
            order = s.groups[r % len(s.groups) :] + s.groups[: r % len(s.groups)]
            for group in order:
                group.setup()
                try:
                    for tool in group.tools:
                        cwd = bench.rundir(s.sid, tool.name)
                        cmd = tool.prepare(cwd)
                        # What the last run (or this one's preparation) wrote is on the disk
                        # before the clock starts: its write-back (200 MB for big-back) would
                        # otherwise land in the next tool's time, whichever tool that is.
                        os.sync()
                        run = run_cmd(cmd, clusters=(bench.cluster, bench.gpu_cluster))
                        run.extra["hub_settled_after_s"] = round(bench.settle(), 3)
                        run.round_no = r
                        tool.verify(cmd, run)
                        tool.runs.append(run)
                        status = "ok" if run.ok else f"FAILED ({run.note})"
                        log(
                            f"  round {r + 1} {tool.name}: {run.wall:.3f} s, cpu client {run.cpu_s:.2f} s + hosts {run.hosts_cpu_s:.2f} s, machine busy {run.machine_busy_pct:.0f}% {status}"
                        )
                        set_aside(cwd)
                finally:
                    group.teardown()
        if bench.args.profile:
            profile(bench, s)
    finally:
        s.finish()
