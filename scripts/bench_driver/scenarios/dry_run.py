"""Planning alone: a big batch on many GPU hosts with --dry-run (a cluster of its own).

  6  100,000 [20,000]-line batch, 64 [16] hosts x 8 GPUs: wall, peak RSS, placement us per job
     (against a 1-line batch: the fixed cost of connecting and probing)
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_driver.base import VENV_BIN, log
from bench_driver.bench import Bench
from bench_driver.measure import Cmd
from bench_driver.profiling import profile_argv
from bench_driver.records import SSH_TOOL, Group, Scenario, Target, Tool, per_round, wall_target
from bench_driver.verify import verify_lines
from tests.cluster import GpuSpec, HostSpec, start_cluster


def scenario6(bench: Bench) -> Scenario:
    n = 20_000 if bench.quick else 100_000
    want_hosts = 16 if bench.quick else 64
    gpus = 8
    info: dict[str, Any] = {}

    def prepare() -> None:
        hosts, per = want_hosts, gpus
        t0 = time.monotonic()
        try:
            bench.gpu_cluster = start_cluster(gpu_specs(hosts, per), timeout=120, base_dir=bench.disk.cluster_base("gpu"))
        except Exception as exc:  # report and fall back
            log(
                f"warning: {hosts} GPU hosts did not start ({exc}); falling back to 16 hosts x 32 GPUs"
            )
            bench.gpu_fallback = (
                f"{hosts} hosts failed to start ({exc}); used 16 hosts x 32 GPUs"
            )
            hosts, per = 16, 32
            t0 = time.monotonic()
            bench.gpu_cluster = start_cluster(gpu_specs(hosts, per), timeout=120, base_dir=bench.disk.cluster_base("gpu"))
        info.update(hosts=hosts, gpus_per_host=per, start_s=round(time.monotonic() - t0, 2))
        bench.cluster_info["gpu"] = info
        log(f"GPU cluster up: {hosts} hosts x {per} GPUs in {info['start_s']} s")
        batch = bench.root / "batch_plan"
        batch.write_text("".join(f"python train.py --seed {i}\n" for i in range(n)))
        (bench.root / "batch_plan1").write_text("python train.py --seed 0\n")

    def finish() -> None:
        if bench.gpu_cluster is not None:
            t0 = time.monotonic()
            bench.gpu_cluster.stop()
            bench.gpu_cluster = None
            info["stop_s"] = round(time.monotonic() - t0, 2)

    def cmd_for(batch_name: str) -> Callable[[Path], Cmd]:
        def make(cwd: Path) -> Cmd:
            assert bench.gpu_cluster is not None
            shutil.copy(bench.root / batch_name, cwd / "batch")
            names = [h.name for h in bench.gpu_cluster.hosts]
            argv = [
                str(VENV_BIN / "execute_batch"),
                "batch",
                "--machines",
                *bench.machines(names, bench.gpu_cluster),
                "--dry-run",
            ]
            return Cmd(argv, cwd, env=bench.env)

        return make

    big = Tool(
        SSH_TOOL,
        cmd_for("batch_plan"),
        verify_lines(n, "plan: "),
        n,
        "ssh_scheduler",
        profile_argv=profile_argv,
    )
    one = Tool(
        SSH_TOOL + " (1-line batch: fixed cost)",
        cmd_for("batch_plan1"),
        verify_lines(1, "plan: "),
        0,
        "info",
    )

    def targets(s: Scenario) -> list[Target]:
        a, b = big.median(), one.median()
        good_big, good_one = big.good(), one.good()
        if a is not None and b is not None:
            s.computed["placement_us_per_job_wall"] = round((a - b) / (n - 1) * 1e6, 2)
            s.computed["placement_us_per_job_cpu"] = round(
                (
                    statistics.median(r.cpu_s for r in good_big)
                    - statistics.median(r.cpu_s for r in good_one)
                )
                / (n - 1)
                * 1e6,
                2,
            )
        s.computed["peak_rss_mb"] = max((r.maxrss_mb for r in good_big), default=None)
        s.computed["hosts"] = info.get("hosts")
        if bench.gpu_fallback:
            s.notes.append("FALLBACK: " + bench.gpu_fallback)
        return [
            wall_target("wall <= 2 s", big, 2.0),
            Target("peak RSS <= 150 MB", big.name, per_round(big, lambda r: r.maxrss_mb), 150.0, False, " MB"),
        ]

    return Scenario(
        "6",
        f"{n:,}-line batch, {want_hosts} hosts x {gpus} GPUs, --dry-run (planning only)",
        [Group([big]), Group([one])],
        {
            "jobs": n,
            "hosts": want_hosts,
            "gpus_per_host": gpus,
            "needs": "defaults (1 GPU, 1000 MB GPU mem, 1 CPU, 1000 MB)",
        },
        targets,
        prepare=prepare,
        finish=finish,
        notes=[
            "placement cost per job = (median wall of the 100k-line plan - median wall of a 1-line plan) / jobs; "
            "the 1-line run is connect + probe of every host + start-up",
            "GPU hosts: 32 CPUs, 500 GiB RAM (480000 MiB available), 8 x 81559 MiB simulated GPUs",
        ],
        report_first=placement,
    )


def placement(s: Scenario) -> list[str]:
    c = s.computed
    if "placement_us_per_job_wall" not in c:
        return []
    return [f"placement {c['placement_us_per_job_wall']} us/job (wall), {c['placement_us_per_job_cpu']} us/job (client CPU); "
            f"peak RSS {c['peak_rss_mb']:.0f} MB; {c.get('hosts')} hosts"]  # fmt: skip


def gpu_specs(hosts: int, gpus: int) -> list[HostSpec]:
    return [
        HostSpec(
            name=f"g{i}",
            cpus=32,
            mem_total_mb=512_000,
            mem_available_mb=480_000,
            gpus=[GpuSpec() for _ in range(gpus)],
        )
        for i in range(1, hosts + 1)
    ]
