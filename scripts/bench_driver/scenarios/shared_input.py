"""Jobs sharing an input folder: what is sent, what the hosts' caches keep, against GNU
parallel's --transferfile (per job) and --basefile (per host).

  3  100 [40] jobs sharing a 20 MB input folder on 4 hosts, each writing a 100 KB result:
     execute_batch, 4 slots per host like parallel's -j4 (cold caches, then a repeat with warm
     caches) vs parallel --transferfile/--return and --basefile/--return
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bench_driver.base import VENV_BIN
from bench_driver.bench import Bench
from bench_driver.measure import Cmd, Run
from bench_driver.profiling import profile_argv
from bench_driver.records import SSH_TOOL, Group, Scenario, Target, Tool, faster_target, per_round
from bench_driver.verify import verify_batch

MB = 1_000_000


def scenario3(bench: Bench) -> Scenario:
    names = ["h1", "h2", "h3", "h4"]
    n = 40 if bench.quick else 100
    n_files, file_size, result_size = 20, 1_000_000, 100_000
    data = bench.root / "s3data"
    command = "cat data/* > /dev/null && head -c {size} /dev/urandom > result_{i}.bin"

    def make_data() -> None:
        (data / "data").mkdir(parents=True, exist_ok=True)
        for i in range(n_files):
            (data / "data" / f"part{i:02d}.bin").write_bytes(os.urandom(file_size))
        (data / "batch").write_text(
            "".join(command.format(size=result_size, i=i) + "\n" for i in range(1, n + 1))
        )

    def ssh_cmd(cwd: Path) -> Cmd:
        shutil.copytree(data / "data", cwd / "data")
        shutil.copy(data / "batch", cwd / "batch")
        argv = [
            str(VENV_BIN / "execute_batch"), "batch",
            "--machines", *bench.machines(names),
            # 4 slots on each 4-CPU host: parallel's -j4
            "--no-gpu-required", "--num-cpus", "1", "--memory-required", "0",
            "--copy-forwards", "data",
        ]  # fmt: skip
        return Cmd(argv, cwd, env=bench.env)

    state: dict[str, int] = {}

    def cold(cwd: Path) -> Cmd:
        bench.wipe_workdirs(names)
        state["before"] = bench.cache_bytes(names)
        return ssh_cmd(cwd)

    def warm(cwd: Path) -> Cmd:
        state["before"] = bench.cache_bytes(names)
        return ssh_cmd(cwd)

    def verify_ssh(cmd: Cmd, run: Run) -> None:
        verify_batch(n)(cmd, run)
        run.extra["cache_bytes_added"] = bench.cache_bytes(names) - state["before"]
        got = list((cmd.cwd / "job_results").glob("batch.*/result_*.bin"))
        run.extra["results"] = len(got)
        if run.ok and (len(got) != n or any(p.stat().st_size != result_size for p in got)):
            run.ok, run.note = False, f"{len(got)} of {n} results came back whole"

    def par(cwd: Path, send: str = "--transferfile") -> Cmd:
        bench.wipe_workdirs(names, extra=["bench_s3"])
        shutil.copytree(data / "data", cwd / "data")
        seq = cwd / "args"
        seq.write_text("".join(f"{i}\n" for i in range(1, n + 1)))
        extra = ["--workdir", "bench_s3"]
        for i in range(n_files):
            extra += [send, f"data/part{i:02d}.bin"]
        extra += ["--return", "result_{}.bin", command.format(size=result_size, i="{}")]
        return bench.parallel_cmd(cwd, seq, 4, 4, extra)

    def verify_par(cmd: Cmd, run: Run) -> None:
        got = list(cmd.cwd.glob("result_*.bin"))
        run.extra["results"] = len(got)
        if run.ok and (len(got) != n or any(p.stat().st_size != result_size for p in got)):
            run.ok, run.note = False, f"{len(got)} of {n} results came back whole"

    t_cold = Tool(
        SSH_TOOL, cold, verify_ssh, n, "ssh_scheduler", profile_argv=profile_argv
    )
    t_warm = Tool(SSH_TOOL + " (repeat, warm cache)", warm, verify_ssh, n, "info")
    t_par = Tool("GNU parallel --transferfile/--return -j4", par, verify_par, n)
    # What a fair user would write: --basefile sends each input once per host, not per job.
    t_par_base = Tool("GNU parallel --basefile/--return -j4", lambda cwd: par(cwd, "--basefile"), verify_par, n)
    input_bytes = n_files * file_size

    def sent_mb(run: Run) -> float | None:
        sent = run.extra.get("sent_bytes", run.extra.get("cache_bytes_added"))
        return None if sent is None else sent / MB

    def targets(s: Scenario) -> list[Target]:
        s.computed.update(
            cold_sent_bytes=[r.extra.get("sent_bytes") for r in t_cold.good()],
            warm_sent_bytes=[r.extra.get("sent_bytes") for r in t_warm.good()],
            cold_cache_bytes=[r.extra.get("cache_bytes_added") for r in t_cold.good()],
            hosts_used=[len(r.extra.get("placed_per_host", {})) for r in t_cold.good()],
            input_bytes=input_bytes,
        )
        return [
            Target(f"bytes sent <= 1.1 x 4 x {input_bytes / MB:.0f} MB", t_cold.name,
                   per_round(t_cold, sent_mb), 1.1 * 4 * input_bytes / MB, False, " MB"),
            Target("repeat sends < 1 MB", t_warm.name, per_round(t_warm, sent_mb), 1.0, False, " MB"),
            faster_target("parallel --transferfile wall >= 3 x ssh_scheduler", t_cold, t_par, 3.0),
            # the issue sets no bar here: reported, against "not slower than it"
            faster_target("fair peer, reported: parallel --basefile wall >= 1 x ssh_scheduler",
                          t_cold, t_par_base, 1.0),
        ]  # fmt: skip

    return Scenario(
        "3",
        f"{n} jobs sharing a {input_bytes / MB:.0f} MB input folder ({n_files} files) on 4 hosts, each returning {result_size // 1000} KB",
        [Group([t_cold, t_warm]), Group([t_par]), Group([t_par_base])],
        {
            "jobs": n,
            "hosts": 4,
            "input_files": n_files,
            "input_bytes": input_bytes,
            "result_bytes": result_size,
        },
        targets,
        prepare=make_data,
        notes=[
            "bytes sent: ssh_scheduler's own counter ('sent N bytes'), else bytes that landed in "
            "the hosts' ~/.ssh_scheduler/cache; caches wiped before each cold run",
            "parallel: one --transferfile per input file and --return per result, fixed --workdir "
            "(rsync skips files already there; no --cleanup), remote dirs wiped before each run",
        ],
        report_first=bytes_sent,
        report_last=hosts_used,
    )


def bytes_sent(s: Scenario) -> list[str]:
    c = s.computed
    if c.get("cold_sent_bytes") is None:
        return []
    return [f"bytes sent cold {c['cold_sent_bytes']}, repeat {c['warm_sent_bytes']}, landed in caches {c['cold_cache_bytes']}"]


def hosts_used(s: Scenario) -> list[str]:
    c = s.computed
    if not c.get("hosts_used"):
        return []
    return [f"hosts that got jobs: {c['hosts_used']}"]
