"""What ``ssh-scheduler report``'s page draws, computed from a batch's history
(``results/batch_history.py``): the timeline's lanes and bars, each GPU's readings against what
we reserved on it, the summary, and a sweep's table and plots.  Pure: values in, one
JSON-ready dict out (``view/report_page.py`` puts it in the page, ``report.js`` draws it).

Every text that came from a job, a host or a file is made visible here first (:func:`visible`:
control characters, terminal escapes and bidirectional overrides become ``\\x1b``-style text);
the page then only ever sets it as text.

Sizes: the arrays are column-wise (one list per field, not one object per attempt), numbers
are relative to the batch's start and rounded, commands cut at :data:`MAX_COMMAND`; 20,000 jobs
make a few MB.  The page aggregates bars narrower than a pixel at draw time.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ssh_scheduler.results.batch_history import OUTCOMES, Attempt, BatchHistory, err_head
from ssh_scheduler.results.results_table import ResultRow, table

__all__ = ["MAX_COMMAND", "report_data", "visible"]

MAX_COMMAND = 2000
MAX_FAILURES = 100
"""Failures listed with the first lines of their ``.err`` (the rest are counted)."""
SLOWEST = 10
MAX_PLOTS = 48
IDLE_UTILIZATION = 0.05

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_CONTROL_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str, *, lines: bool = False, limit: int | None = None) -> str:
    """``text`` with every control and format character shown as an escape (``\\x1b[31m``
    stays those seven characters); ``lines`` keeps newlines and tabs."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + " ..."
    return (_CONTROL if lines else _CONTROL_LINE).sub(_escape, text)


def _r(value: float) -> float:
    return round(value, 3)


def report_data(history: BatchHistory, *, title: str, sweep: Sequence[ResultRow] = ()) -> dict[str, Any]:
    """The page's data (see ``report.js`` for how each part is drawn)."""
    t0 = history.began if history.began is not None else min((a.start for a in history.attempts), default=history.snapshot)
    t1 = max(history.last, t0)
    ends = [_end(a, history, t1) for a in history.attempts]
    lanes, bars = _timeline(history, ends, t0)
    data: dict[str, Any] = {
        "title": visible(title),
        "state": history.state,
        "fromEvents": history.from_events,
        "t0": t0,
        "span": _r(t1 - t0),
        "outcomes": list(OUTCOMES),
        "lanes": [{"name": visible(name), "host": visible(host), "gpu": gpu, "rows": rows} for name, host, gpu, rows in lanes],
        "bars": bars,
        "attempts": _attempts(history, ends, t0),
        "hostChanges": [[_r(c.t - t0), visible(c.host), c.what, visible(c.reason)] for c in history.host_changes],
        "gpus": _gpus(history, ends, t0),
        "summary": _summary(history, ends, lanes, bars, t0, t1),
        "resultsDir": visible(str(history.results_dir)),
        "sweep": _sweep(sweep) if sweep else None,
    }
    return data


def _end(attempt: Attempt, history: BatchHistory, t1: float) -> float:
    return attempt.end if attempt.end is not None else max(t1, attempt.start)


def _lane_keys(attempt: Attempt) -> list[tuple[str, int | None]]:
    return [(attempt.host, g) for g in attempt.gpus] or [(attempt.host, None)]


def _timeline(history: BatchHistory, ends: list[float], t0: float) -> tuple[list[tuple[str, str, int | None, int]], list[list[float]]]:
    """One lane per host and GPU (and one per host for its jobs without GPUs: CPU jobs, Slurm's);
    the attempts on a lane packed into rows so that none overlap."""
    gpus: dict[str, set[int]] = defaultdict(set)
    plain: set[str] = set()
    hosts = dict.fromkeys(history.hosts)
    for attempt in history.attempts:
        hosts.setdefault(attempt.host, None)
        if attempt.gpus:
            gpus[attempt.host].update(attempt.gpus)
        else:
            plain.add(attempt.host)
    for probe in history.probes:
        hosts.setdefault(probe.host, None)
        gpus[probe.host].update(g.index for g in probe.gpus)
    keys: list[tuple[str, int | None]] = []
    for host in hosts:
        if host in plain or not gpus[host]:
            keys.append((host, None))
        keys += [(host, g) for g in sorted(gpus[host])]
    index = {key: i for i, key in enumerate(keys)}
    per_lane: dict[int, list[int]] = defaultdict(list)
    for i, attempt in enumerate(history.attempts):
        for key in _lane_keys(attempt):
            per_lane[index[key]].append(i)
    bars: list[list[float]] = []
    rows_of = [1] * len(keys)
    for lane, members in sorted(per_lane.items()):
        members.sort(key=lambda i: (history.attempts[i].start, ends[i]))
        busy: list[tuple[float, int]] = []  # (end, row) of the rows in use
        free: list[int] = []
        rows = 0
        for i in members:
            start = history.attempts[i].start
            while busy and busy[0][0] <= start:
                heapq.heappush(free, heapq.heappop(busy)[1])
            row = heapq.heappop(free) if free else rows
            rows = max(rows, row + 1)
            heapq.heappush(busy, (ends[i], row))
            bars.append([lane, row, _r(start - t0), _r(ends[i] - t0), i])
        rows_of[lane] = max(rows, 1)
    bars.sort(key=lambda b: (b[0], b[1], b[2]))
    lanes = [(host if gpu is None else f"{host} GPU {gpu}", host, gpu, rows_of[i]) for i, (host, gpu) in enumerate(keys)]
    return lanes, bars


def _attempts(history: BatchHistory, ends: list[float], t0: float) -> dict[str, list[Any]]:
    """Column-wise: ``attempts["job"][i]`` is attempt i's job."""
    columns: dict[str, list[Any]] = {k: [] for k in (
        "job", "host", "gpus", "command", "outcome", "code", "reason", "start", "end", "seconds",
        "bytes", "slurm", "mem", "out", "err",
    )}
    outcome_index = {name: i for i, name in enumerate(OUTCOMES)}
    for attempt, end in zip(history.attempts, ends, strict=True):
        columns["job"].append(visible(attempt.job))
        columns["host"].append(visible(attempt.host))
        columns["gpus"].append(",".join(map(str, attempt.gpus)))
        columns["command"].append(visible(attempt.command, lines=True, limit=MAX_COMMAND))
        columns["outcome"].append(outcome_index[attempt.outcome])
        columns["code"].append(attempt.code)
        columns["reason"].append(visible(attempt.reason, limit=MAX_COMMAND))
        columns["start"].append(_r(attempt.start - t0))
        columns["end"].append(_r(end - t0))
        columns["seconds"].append(None if attempt.seconds is None else _r(attempt.seconds))
        columns["bytes"].append(attempt.bytes_received)
        columns["slurm"].append(visible(attempt.slurm_job))
        columns["mem"].append(attempt.gpu_memory_mb)
        columns["out"].append(f"{attempt.job}.out" in history.outputs)
        columns["err"].append(f"{attempt.job}.err" in history.outputs)
    return columns


def _gpus(history: BatchHistory, ends: list[float], t0: float) -> list[dict[str, Any]]:
    """Per GPU: the probes' readings (used, ours, utilization), the card's size, and the memory
    our jobs reserved on it as a step line; with the two things to see at a glance: the peak of
    reserved plus others' use against the card, and how often the card idled while we held it."""
    readings: dict[tuple[str, int], list[tuple[float, int, int, float, int]]] = defaultdict(list)
    for probe in history.probes:
        for reading in probe.gpus:
            readings[(probe.host, reading.index)].append(
                (probe.t, reading.memory_used_mb, reading.memory_total_mb, reading.utilization, reading.ours_mb)
            )
    # (time, reserved MiB, jobs of ours) changes on each GPU
    steps: dict[tuple[str, int], list[tuple[float, int, int]]] = defaultdict(list)
    for attempt, end in zip(history.attempts, ends, strict=True):
        for g in attempt.gpus:
            steps[(attempt.host, g)] += [(attempt.start, attempt.gpu_memory_mb, 1), (end, -attempt.gpu_memory_mb, -1)]
    order = {host: i for i, host in enumerate(history.hosts)}
    found = []
    for key in sorted(set(readings) | set(steps), key=lambda k: (order.get(k[0], len(order)), k)):
        samples = readings.get(key, [])
        times: list[float] = []
        reserved: list[int] = []
        holding: list[int] = []
        level = count = 0
        for t, delta, jobs in sorted(steps.get(key, [])):
            level, count = level + delta, count + jobs
            if not times or times[-1] != t:
                times.append(t)
                reserved.append(0)
                holding.append(0)
            reserved[-1], holding[-1] = level, count
        total = max((s[2] for s in samples), default=0)
        # A host lost after its last probe: what that probe read ends there, not at the end.
        last = samples[-1][0] if samples else None
        until = next((c.t for c in history.host_changes if c.host == key[0] and c.what == "down" and last is not None and c.t >= last), None)
        peak = idle = held = 0
        for t, used, _, util, ours in samples:
            at = bisect_right(times, t) - 1
            peak = max(peak, (reserved[at] if at >= 0 else 0) + used - ours)
            if at >= 0 and holding[at] > 0:
                held += 1
                idle += util < IDLE_UTILIZATION
        found.append({
            "host": visible(key[0]),
            "index": key[1],
            "total": total,
            "t": [_r(s[0] - t0) for s in samples],
            "used": [s[1] for s in samples],
            "ours": [s[4] for s in samples],
            "util": [round(s[3] * 100) for s in samples],
            "reserved": [[_r(t - t0), mb] for t, mb in zip(times, reserved, strict=True)],
            "until": None if until is None else _r(until - t0),
            "peak": peak,
            "over": bool(total) and peak > total,
            "idleHeld": round(idle / held, 3) if held else None,
        })
    return found


def _union(spans: list[tuple[float, float]]) -> float:
    covered, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered


def _summary(
    history: BatchHistory, ends: list[float], lanes: list[tuple[str, str, int | None, int]],
    bars: list[list[float]], t0: float, t1: float,
) -> dict[str, Any]:
    final: dict[str, int] = {}
    for i, attempt in enumerate(history.attempts):
        final[attempt.job] = i  # a job's last attempt says how it ended
    jobs_by_outcome = {name: 0 for name in OUTCOMES}
    for i in final.values():
        jobs_by_outcome[history.attempts[i].outcome] += 1
    attempts_by_outcome = {name: 0 for name in OUTCOMES}
    for attempt in history.attempts:
        attempts_by_outcome[attempt.outcome] += 1
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for lane, _, start, end, _ in bars:
        spans[int(lane)].append((start, end))
    wall = max(t1 - t0, 0.0)
    busy = [
        {"lane": visible(name), "fraction": round(_union(spans[i]) / wall, 3) if wall > 0 else 0.0}
        for i, (name, _, _, _) in enumerate(lanes)
    ]
    done = [i for i, a in enumerate(history.attempts) if a.end is not None and a.outcome in ("finished", "failed", "timed_out")]
    slowest = sorted(done, key=lambda i: -(ends[i] - history.attempts[i].start))[:SLOWEST]
    failed = [i for i in final.values() if history.attempts[i].outcome in ("failed", "timed_out")]
    failures = []
    for i in failed[:MAX_FAILURES]:
        head = err_head(history.results_dir, history.attempts[i].job)
        failures.append({"attempt": i, "err": None if head is None else visible(head, lines=True)})
    return {
        "jobs": history.jobs,
        "jobsSeen": len(final),
        "jobsByOutcome": jobs_by_outcome,
        "attemptsByOutcome": attempts_by_outcome,
        "retried": sum(a.retried for a in history.attempts),
        "skipped": history.skipped,
        "notRun": [[visible(job), visible(why)] for job, why in list(history.not_run.items())[:MAX_FAILURES]],
        "notRunCount": len(history.not_run),
        "cancelledQueued": len(history.cancelled_queued),
        "wall": _r(wall),
        "ended": history.ended is not None,
        "busy": busy,
        "bytesSent": history.bytes_sent,
        "filesSent": history.files_sent,
        "bytesReceived": history.bytes_received,
        "slowest": slowest,
        "failures": failures,
        "failedCount": len(failed),
        "exitCode": history.exit_code,
        "exitLines": [visible(line) for line in history.exit_lines],
    }


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, bool) or _number(value):
        return value
    return visible(value if isinstance(value, str) else json.dumps(value), limit=MAX_COMMAND)


def _sweep(rows: Sequence[ResultRow]) -> dict[str, Any]:
    """The results table, and each numeric metric against each varying parameter."""
    columns, body = table(rows)
    state = columns.index("state")
    params, metrics = columns[1:state], columns[state + 1:]
    plots: list[dict[str, Any]] = []
    for m, metric in enumerate(metrics, start=state + 1):
        for p, param in enumerate(params, start=1):
            points = [(row[p], row[m], row[0]) for row in body if _number(row[m]) and row[p] is not None]
            if len(points) < 2 or len(plots) >= MAX_PLOTS:
                continue
            numeric = all(_number(x) for x, _, _ in points)
            log = numeric and min(x for x, _, _ in points) > 0 and max(x for x, _, _ in points) >= 100 * min(x for x, _, _ in points)
            plots.append({
                "param": visible(param),
                "metric": visible(metric),
                "numeric": numeric,
                "log": log,
                "points": [[x if numeric else _cell(x), y, visible(str(name))] for x, y, name in points],
            })
    return {
        "columns": [visible(c) for c in columns],
        "rows": [[_cell(v) for v in row] for row in body],
        "plots": plots,
    }
