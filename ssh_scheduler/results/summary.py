"""What a batch gave: each job's outcome and the batch's totals, folded from the event stream.

:class:`BatchSummary` subscribes to the events (``JobFinished``, ``JobFailed``, ``JobSkipped``,
``JobCancelled``) and is what ``run_batch`` returns and the summary lines are made from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ssh_scheduler.events import Ended, Event, JobCancelled, JobFailed, JobFinished, JobSkipped

__all__ = ["BatchSummary", "JobOutcome"]


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """One job's end in this run."""

    job: str
    host: str
    ended: Ended
    seconds: float = 0.0
    bytes_received: int = 0

    @property
    def ok(self) -> bool:
        return self.ended.ok

    @property
    def exit_code(self) -> int | None:
        return self.ended.code

    @property
    def message(self) -> str | None:
        return self.ended.message

    @property
    def timed_out(self) -> bool:
        return self.ended.timed_out


@dataclass(slots=True)
class BatchSummary:
    outcomes: dict[str, JobOutcome] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0
    files_uploaded: int = 0
    bytes_downloaded: int = 0
    cancelled: bool = False
    halted: bool = False
    not_run: list[str] = field(default_factory=list)
    skipped_failed: list[str] = field(default_factory=list)
    """Skipped because results exist, but the earlier run recorded them as failed."""
    cancelled_jobs: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[str]:
        return [name for name, o in self.outcomes.items() if not o.ok]

    @property
    def exit_code(self) -> int:
        unfinished = self.failed or self.cancelled or self.not_run or self.cancelled_jobs
        return 1 if unfinished or self.skipped_failed else 0

    def describe(self) -> str:
        finished = len(self.outcomes) - len(self.failed)
        left = f", {len(self.not_run)} not run" if self.not_run else ""
        return (
            f"done: {finished} finished, {len(self.failed)} failed, {len(self.skipped)} skipped{left}; "
            f"sent {self.bytes_uploaded} bytes in {self.files_uploaded} files, "
            f"received {self.bytes_downloaded} bytes"
        )

    def __call__(self, event: Event) -> None:
        """Subscribed to the event stream: collects each job's end."""
        if isinstance(event, JobFinished):
            self.outcomes[event.job] = JobOutcome(event.job, event.host, Ended(0), event.seconds, event.bytes_received)
            self.bytes_downloaded += event.bytes_received
        elif isinstance(event, JobFailed):
            ended = Ended(
                event.code, timed_out=event.timed_out, message=event.message or event.reason, kept_at=event.kept or None
            )
            self.outcomes[event.job] = JobOutcome(event.job, event.host, ended, event.seconds, event.bytes_received)
            self.bytes_downloaded += event.bytes_received
        elif isinstance(event, JobSkipped):
            self.skipped.append(event.job)
            if event.failed:
                self.skipped_failed.append(event.job)
        elif isinstance(event, JobCancelled) and event.job not in self.cancelled_jobs:
            self.cancelled_jobs.append(event.job)
