"""File transfer: one job moving many small files or one big file, against plain OpenSSH pipes.

Each runs ONE job on ONE host of the small cluster and compares ssh_scheduler's whole process
(start-up, connection, agent, transfer, copy-back) with the plain OpenSSH pipe a user would type
for the same bytes, on the same host, doing the same work on the host:

  files-in    5000 small input files (a dataset folder), first run (the host's cache wiped):
              ``execute_batch --copy-forwards data`` vs ``tar c data | ssh h tar x``; plus a
              repeat (warm cache: nothing is sent) and a rerun (the same local folder again:
              its files' hashes known from an earlier command, the hash memo)
  files-back  one job writing 5000 small result files, copied back: ``execute_batch`` vs
              ``ssh h 'make them; tar c out' | tar x``
  big-back    one job writing a 200 MB result file, copied back: ``execute_batch`` vs
              ``ssh h 'make it; cat big.bin' > big.bin``

Targets are ratios to the peer (ssh_scheduler wall / peer wall) in each round, the OpenSSH pipe
on our key exchange and cipher; a target holds if its worst round does.
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from bench_driver.base import VENV_BIN
from bench_driver.bench import Bench
from bench_driver.measure import Cmd, Run, run_cmd
from bench_driver.profiling import profile_argv
from bench_driver.records import SSH_TOOL, Group, Scenario, Target, Tool, slower_target
from bench_driver.verify import verify_batch
from ssh_scheduler.jobs.hash_memo import RACY_SECONDS

FILE_SCENARIOS = ("files-in", "files-back", "big-back")
N_FILES = 5000
BIG_BYTES = 200_000_000
HOST = "h1"
# The same generator on both sides: python3 writes 5000 files of 1000 random bytes in one process
# (a shell loop of `head -c` would fork 5000 times and swamp what is measured).
MAKE_SMALL = (
    "python3 -c 'import os; os.makedirs(\"out\"); "
    "[open(\"out/r%05d.bin\" % i, \"wb\").write(os.urandom(1000)) for i in range({n})]'"
)
BIG_SOURCE = "bench_big.bin"  # made once per scenario in the host user's home, copied by the job
MAKE_BIG = f"cp ~/{BIG_SOURCE} big.bin"


def file_makers(bench: Bench) -> dict[str, Callable[[], Scenario]]:
    return {
        "files-in": lambda: files_in(bench),
        "files-back": lambda: files_back(bench),
        "big-back": lambda: big_back(bench),
    }


def _ssh_batch(bench: Bench, cwd: Path, line: str, forwards: str) -> Cmd:
    (cwd / "batch").write_text(line + "\n")
    argv = [
        str(VENV_BIN / "execute_batch"), "batch",
        "--machines", *bench.machines([HOST]),
        "--no-gpu-required", "--num-cpus", "0", "--memory-required", "0",
        "--copy-forwards", forwards,
    ]  # fmt: skip
    return Cmd(argv, cwd, env=bench.env)


def _shell(bench: Bench, cwd: Path, pipeline: str) -> Cmd:
    return Cmd(["/bin/bash", "-o", "pipefail", "-c", pipeline], cwd, env=bench.env)


def _ssh_words(bench: Bench) -> str:
    """The plain OpenSSH client for the host, as shell words (strict host keys, the test key),
    pinned to our key exchange and cipher."""
    assert bench.cluster is not None
    return shlex.join(bench.host(HOST).ssh_argv(options=bench.match_ssh(bench.cluster)["options"]))


def _check_tree(folder: Path, count: int, size: int, run: Run) -> None:
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    whole = sum(1 for p in files if p.stat().st_size == size)
    run.extra["files_back"] = whole
    if run.ok and whole != count:
        run.ok, run.note = False, f"{whole} of {count} files came back whole"


def _job_folder(cwd: Path) -> Path:
    found = sorted(p for p in (cwd / "job_results").glob("batch.*") if p.is_dir())
    return found[0] if found else cwd / "job_results" / "missing"


# --------------------------------------------------------------------------- files-in


def files_in(bench: Bench) -> Scenario:
    data = bench.root / "files_in_data"
    count_cmd = f"test $(find data -type f | wc -l) = {N_FILES}"
    state: dict[str, int] = {}

    def make_data() -> None:
        (data / "data").mkdir(parents=True, exist_ok=True)
        for i in range(N_FILES):
            sub = data / "data" / f"d{i % 50:02d}"
            sub.mkdir(exist_ok=True)
            (sub / f"f{i:05d}.bin").write_bytes(os.urandom(200 + (i * 37) % 1800))

    def ssh(cwd: Path, cold: bool) -> Cmd:
        if cold:
            bench.wipe_workdirs([HOST])
        state["before"] = bench.cache_bytes([HOST])
        shutil.copytree(data / "data", cwd / "data")
        return _ssh_batch(bench, cwd, count_cmd, "data")

    def verify_ssh(cmd: Cmd, run: Run) -> None:
        verify_batch(1)(cmd, run)
        run.extra["cache_bytes_added"] = bench.cache_bytes([HOST]) - state["before"]

    # The rerun's folder stays the same from round to round: its files are hashed once, by an
    # untimed command in prepare (what an earlier run of the batch did), then known.  Every
    # other row copies the dataset afresh for each run, so the memo never knows its files.
    rerun_data = bench.root / "files_in_rerun" / "data"

    def prepare() -> None:
        make_data()
        shutil.copytree(data / "data", rerun_data)
        time.sleep(RACY_SECONDS + 0.1)  # files changed just before a command are not kept
        first = run_cmd(rerun(bench.rundir("files-in", "rerun priming")))
        if first.rc != 0:
            raise RuntimeError(f"files-in: the rerun's priming run failed (exit {first.rc})")

    def rerun(cwd: Path) -> Cmd:
        return _ssh_batch(bench, cwd, count_cmd, str(rerun_data))

    def tar(cwd: Path) -> Cmd:
        bench.wipe_workdirs([HOST], extra=["bench_files_in"])
        shutil.copytree(data / "data", cwd / "data")
        remote = f"mkdir -p bench_files_in && cd bench_files_in && tar x && {count_cmd}"
        return _shell(bench, cwd, f"tar c data | {_ssh_words(bench)} {shlex.quote(remote)}")

    t_cold = Tool(SSH_TOOL, lambda cwd: ssh(cwd, True), verify_ssh, 1, "ssh_scheduler",
                  profile_argv=profile_argv)  # fmt: skip
    t_warm = Tool(SSH_TOOL + " (repeat, warm cache)", lambda cwd: ssh(cwd, False), verify_ssh, 1, "info")
    t_rerun = Tool(SSH_TOOL + " (rerun, same folder)", rerun, verify_batch(1), 1, "info")
    t_tar = Tool("tar c | ssh tar x", tar, jobs=1, kind="floor")

    def targets(s: Scenario) -> list[Target]:
        s.computed["warm_cache_bytes_added"] = [r.extra.get("cache_bytes_added") for r in t_warm.good()]
        s.computed["warm_sent_bytes"] = [r.extra.get("sent_bytes") for r in t_warm.good()]
        return [slower_target("wall <= 1.5 x tar pipe", t_cold, t_tar, 1.5)]

    return Scenario(
        "files-in",
        f"one job, {N_FILES} small input files (200-2000 bytes, 50 folders), first run, 1 host",
        [Group([t_cold, t_warm, t_rerun]), Group([t_tar])],
        {"files": N_FILES, "host": HOST},
        targets,
        prepare=prepare,
        notes=["the host's work root (cache) is wiped before each first run; the repeat row runs "
               "right after it and should send nothing",
               "the rerun row walks one folder kept from round to round (an untimed run hashed it "
               "first), after the repeat: what rerunning a batch in the same folder costs"],
    )


# --------------------------------------------------------------------------- files-back


def files_back(bench: Bench) -> Scenario:
    make = MAKE_SMALL.format(n=N_FILES)

    def ssh(cwd: Path) -> Cmd:
        (cwd / "empty").mkdir()
        return _ssh_batch(bench, cwd, make, "empty")

    def verify_ssh(cmd: Cmd, run: Run) -> None:
        verify_batch(1)(cmd, run)
        _check_tree(_job_folder(cmd.cwd) / "out", N_FILES, 1000, run)

    def tar(cwd: Path) -> Cmd:
        remote = f"rm -rf bench_files_back && mkdir bench_files_back && cd bench_files_back && {make} && tar c out"
        return _shell(bench, cwd, f"{_ssh_words(bench)} {shlex.quote(remote)} | tar x")

    def verify_tar(cmd: Cmd, run: Run) -> None:
        _check_tree(cmd.cwd / "out", N_FILES, 1000, run)

    t_ssh = Tool(SSH_TOOL, ssh, verify_ssh, 1, "ssh_scheduler", profile_argv=profile_argv)
    t_tar = Tool("ssh 'make; tar c' | tar x", tar, verify_tar, 1, "floor")

    def targets(s: Scenario) -> list[Target]:
        return [slower_target("wall <= 1.5 x tar pipe", t_ssh, t_tar, 1.5)]

    return Scenario(
        "files-back",
        f"one job writing {N_FILES} result files of 1000 bytes, copied back, 1 host",
        [Group([t_ssh]), Group([t_tar])],
        {"files": N_FILES, "host": HOST},
        targets,
    )


# --------------------------------------------------------------------------- big-back


def big_back(bench: Bench) -> Scenario:
    def make_source() -> None:
        host = bench.host(HOST)
        path = host.home / BIG_SOURCE
        with open(path, "wb") as f:
            for _ in range(BIG_BYTES // 1_000_000):
                f.write(os.urandom(1_000_000))  # random: neither side gains from compression
        os.chown(path, host.uid, -1)

    def drop_source() -> None:
        (bench.host(HOST).home / BIG_SOURCE).unlink(missing_ok=True)

    def ssh(cwd: Path) -> Cmd:
        (cwd / "empty").mkdir()
        return _ssh_batch(bench, cwd, MAKE_BIG, "empty")

    def verify_ssh(cmd: Cmd, run: Run) -> None:
        verify_batch(1)(cmd, run)
        _check_tree(_job_folder(cmd.cwd), 1, BIG_BYTES, run)

    def cat(cwd: Path) -> Cmd:
        remote = f"rm -rf bench_big_back && mkdir bench_big_back && cd bench_big_back && {MAKE_BIG} && cat big.bin"
        return _shell(bench, cwd, f"{_ssh_words(bench)} {shlex.quote(remote)} > big.bin")

    def verify_cat(cmd: Cmd, run: Run) -> None:
        _check_tree(cmd.cwd, 1, BIG_BYTES, run)

    t_ssh = Tool(SSH_TOOL, ssh, verify_ssh, 1, "ssh_scheduler", profile_argv=profile_argv)
    t_cat = Tool("ssh 'make; cat' > file", cat, verify_cat, 1, "floor")

    def targets(s: Scenario) -> list[Target]:
        return [slower_target("wall <= 1.2 x ssh cat", t_ssh, t_cat, 1.2)]

    return Scenario(
        "big-back",
        f"one job writing a {BIG_BYTES // 1_000_000} MB result file, copied back, 1 host",
        [Group([t_ssh]), Group([t_cat])],
        {"bytes": BIG_BYTES, "host": HOST},
        targets,
        prepare=make_source,
        finish=drop_source,
    )
