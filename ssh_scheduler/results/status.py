"""A batch's state read from its journal (``job_results/.journal.jsonl``): for ``ssh-scheduler
status`` and ``ssh-scheduler jobs``, while the batch runs in another terminal or after its
coordinator died.  Pure: journal entries in, values and lines out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssh_scheduler.results.journal import IN_FLIGHT, JobState

__all__ = ["BatchStatus", "JobRecord", "fold_journal", "joblog_lines", "status_json", "status_lines"]

JOBLOG_HEADER = ("Job", "Host", "Starttime", "JobRuntime", "Send", "Receive", "Exitval", "Signal", "Command")


@dataclass(slots=True)
class JobRecord:
    job: str
    state: JobState
    host: str = ""
    gpus: tuple[int, ...] = ()
    command: str = ""
    code: int | None = None
    started: float | None = None
    ended: float | None = None
    seconds: float | None = None
    bytes_received: int = 0
    timed_out: bool = False

    @property
    def phase(self) -> str:
        """``running`` (placed or started), ``waiting`` (to be placed again), or the end."""
        if self.state in IN_FLIGHT:
            return "running"
        if self.state in (JobState.RETRY, JobState.REQUEUED):
            return "waiting"
        return self.state.value


@dataclass(slots=True)
class BatchStatus:
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    total: int | None = None
    """Jobs the latest run set out to run (``None`` for a journal older than this field)."""
    in_latest_run: set[str] = field(default_factory=set)

    def counts(self) -> dict[str, int]:
        counted = Counter(record.phase for record in self.jobs.values())
        counts = {phase: counted.get(phase, 0) for phase in ("finished", "failed", "running", "waiting", "cancelled")}
        if self.total is not None:
            counts["waiting"] += max(0, self.total - len(self.in_latest_run))
        return counts

    def running(self) -> list[JobRecord]:
        return [r for r in self.jobs.values() if r.phase == "running"]

    def failed(self) -> list[JobRecord]:
        return [r for r in self.jobs.values() if r.phase == "failed"]


def fold_journal(entries: list[dict[str, Any]]) -> BatchStatus:
    status = BatchStatus()
    for entry in entries:
        try:
            state = JobState(str(entry.get("state")))
        except ValueError:
            continue  # a state a newer version wrote
        name = str(entry.get("job", ""))
        t = float(entry.get("t", 0.0))
        if state is JobState.BATCH:
            jobs = entry.get("jobs")
            status.total = int(jobs) if isinstance(jobs, int) else None
            status.in_latest_run = set()
            continue
        status.in_latest_run.add(name)
        record = status.jobs.get(name) or JobRecord(name, state)
        record.state = state
        record.host = str(entry.get("host", record.host))
        if "gpus" in entry:
            record.gpus = tuple(int(g) for g in entry["gpus"])
        record.command = str(entry.get("command", record.command))
        if state is JobState.STARTED:
            record.started, record.ended, record.code = t, None, None
        elif state in (JobState.FINISHED, JobState.FAILED):
            record.ended = t
            record.code = entry.get("code")
            record.seconds = entry.get("seconds")
            record.bytes_received = int(entry.get("bytes", 0))
            record.timed_out = bool(entry.get("timed_out"))
        status.jobs[name] = record
    return status


def status_json(status: BatchStatus, results_dir: Path, coordinator: dict[str, Any] | None) -> dict[str, Any]:
    """``coordinator``: what the running coordinator answered (``None``: nothing answers)."""
    return {
        "results_dir": str(results_dir),
        "coordinator": _coordinator_state(status, coordinator),
        "counts": status.counts(),
        "running": [
            {"job": r.job, "host": r.host, "gpus": list(r.gpus), "since": r.started, "command": r.command}
            for r in status.running()
        ],
        "failed": [
            {"job": r.job, "host": r.host, "code": r.code, "timed_out": r.timed_out,
             "err": str(results_dir / f"{r.job}.err")}
            for r in status.failed()
        ],
    }


def _coordinator_state(status: BatchStatus, coordinator: dict[str, Any] | None) -> str:
    if coordinator is not None:
        return "paused" if coordinator.get("paused") else "running"
    counts = status.counts()
    return "stopped" if counts["running"] or counts["waiting"] else "finished"


def status_lines(status: BatchStatus, results_dir: Path, coordinator: dict[str, Any] | None, now: float) -> list[str]:
    data = status_json(status, results_dir, coordinator)
    counts = data["counts"]
    state = data["coordinator"]
    pid = ""
    if coordinator and "pid" in coordinator:
        host = f" on {coordinator['host']}" if coordinator.get("host") else ""
        pid = f" (pid {coordinator['pid']}{host})"
    lines = [
        f"{results_dir}: {state}{pid}; " + ", ".join(f"{n} {phase}" for phase, n in counts.items()),
    ]
    if state == "stopped" and counts["running"]:
        lines.append(
            "  the coordinator is gone; the hosts keep its jobs running for its lease: "
            "rerun the same execute_batch to reattach to them"
        )
    for record in status.running():
        gpus = f" GPUs {','.join(map(str, record.gpus))}" if record.gpus else ""
        since = f" for {now - record.started:.0f} s" if record.started else " (starting)"
        lines.append(f"  running: {record.job} on {record.host}{gpus}{since}; {record.command}")
    for entry in data["failed"]:
        why = "timed out" if entry["timed_out"] else f"exit {entry['code']}" if entry["code"] is not None else "no exit status"
        lines.append(f"  failed: {entry['job']} ({why} on {entry['host']}): {entry['err']}")
    return lines


def _tsv(value: str) -> str:
    return value.replace("\t", " ").replace("\n", " ")


def joblog_lines(status: BatchStatus) -> list[str]:
    """GNU parallel's ``--joblog``: one row per job that ended.  ``Send`` is 0: inputs travel
    once per host, not per job (the batch's summary has the total).  A job killed by signal n
    reports 128+n as its exit value and n as its signal; one that never got an exit status -1."""
    rows = ["\t".join(JOBLOG_HEADER)]
    for record in status.jobs.values():
        if record.state not in (JobState.FINISHED, JobState.FAILED):
            continue
        code = record.code
        signal = code - 128 if code is not None and 128 < code < 128 + 65 else 0
        runtime = record.seconds if record.seconds is not None else (
            (record.ended - record.started) if record.ended is not None and record.started is not None else 0.0
        )
        start = f"{record.started:.3f}" if record.started is not None else "0"
        rows.append(
            "\t".join(
                (_tsv(record.job), record.host, start, f"{runtime:.3f}", "0", str(record.bytes_received),
                 str(code if code is not None else -1), str(signal), _tsv(record.command))
            )
        )
    return rows
