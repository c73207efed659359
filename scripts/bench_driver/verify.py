"""Checks of a run's output, each made for a tool (``Tool.verify``): they set ``run.ok`` and
``run.note`` and keep what they read in ``run.extra`` (jobs finished, bytes sent, jobs per host,
the start-up / jobs / wind-down split of the wall)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from pathlib import Path

from bench_driver.measure import Cmd, Run, read, tail


def journal_summary(results: Path) -> tuple[dict[str, int], float | None, float | None]:
    """From the batch journal (job_results/.journal*.jsonl), if any: jobs placed per host, the
    time the first job started and the time the last job ended (epoch seconds)."""
    counts: dict[str, int] = {}
    first: float | None = None
    last: float | None = None
    for journal in results.glob(".journal*"):
        with contextlib.suppress(OSError):
            for line in journal.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    rec = json.loads(line)
                    state = rec.get("state", rec.get("event"))
                    t = float(rec.get("t", 0)) or None
                    if state == "placed" and rec.get("host"):
                        counts[rec["host"]] = counts.get(rec["host"], 0) + 1
                    elif state == "started" and t is not None:
                        first = t if first is None else min(first, t)
                    elif state in ("finished", "failed") and t is not None:
                        last = t if last is None else max(last, t)
    return dict(sorted(counts.items())), first, last


def verify_batch(expected: int, *, limits: int | None = None) -> Callable[[Cmd, Run], None]:
    def check(cmd: Cmd, run: Run) -> None:
        out = read(cmd.cwd / "stdout.txt")
        err = read(cmd.cwd / "stderr.txt")
        finished = out.count("\nfinished: ") + out.startswith("finished: ")
        run.extra["finished"] = finished
        m = re.search(r"sent (\d+) bytes in (\d+) files, received (\d+) bytes", err + out)
        if m:
            run.extra["sent_bytes"] = int(m.group(1))
            run.extra["sent_files"] = int(m.group(2))
            run.extra["received_bytes"] = int(m.group(3))
        if limits is not None:
            lm = re.search(r"machine limits:\s*(\{.*\})", out)
            if lm:
                values = [int(v) for v in re.findall(r":\s*(\d+)", lm.group(1))]
                run.extra["machine_limits"] = values
                if any(v != limits for v in values):
                    run.note = (
                        run.note + "; " if run.note else ""
                    ) + f"machine limits {values}, wanted {limits} each"
        per_host, first, last = journal_summary(cmd.cwd / "job_results")
        if per_host:
            run.extra["placed_per_host"] = per_host
        t0 = run.extra.get("_t0_epoch")
        if t0 and first is not None and last is not None:
            # wall = start-up (until the first job starts) + span + wind-down (after the last end)
            run.extra["first_job_started_s"] = round(first - t0, 3)
            run.extra["jobs_span_s"] = round(last - first, 3)
            run.extra["after_last_job_s"] = round(t0 + run.wall - last, 3)
        if run.ok and finished != expected:
            run.ok = False
            run.note = f"{finished} of {expected} jobs finished: {tail(cmd.cwd / 'stderr.txt')}"

    return check


def verify_lines(expected: int, pattern: str = "") -> Callable[[Cmd, Run], None]:
    def check(cmd: Cmd, run: Run) -> None:
        lines = [
            ln
            for ln in read(cmd.cwd / "stdout.txt").splitlines()
            if ln.strip() and pattern in ln
        ]
        run.extra["output_lines"] = len(lines)
        if run.ok and len(lines) != expected:
            run.ok = False
            run.note = (
                f"{len(lines)} output lines, wanted {expected}: {tail(cmd.cwd / 'stderr.txt')}"
            )

    return check


def verify_floor(expected: int) -> Callable[[Cmd, Run], None]:
    def check(cmd: Cmd, run: Run) -> None:
        try:
            data = json.loads(read(cmd.cwd / "stdout.txt").strip().splitlines()[-1])
        except (ValueError, IndexError):
            data = {}
        run.extra.update({f"floor_{k}": v for k, v in data.items()})
        if run.ok and data.get("jobs") != expected:
            run.ok = False
            run.note = (
                f"floor ran {data.get('jobs')} of {expected}: {tail(cmd.cwd / 'stderr.txt')}"
            )

    return check
