"""A sweep's run: its batch (or, with ``-d``, one batch per command), each job's results gathered
into its combination's folder as the job ends.

The sweep runs as one batch (:class:`~ssh_scheduler.coordinator.batch.Batch`) of jobs named
``<combination>.<command>``, each waiting for the previous command of its combination (``after``).
As each job ends, what it wrote under ``{_output}`` is moved into the combination's folder and its
stat.json entry is written, so the next command of that combination, sent later, finds it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ssh_scheduler.cli.common import err_line
from ssh_scheduler.events import Event, JobFailed, JobFinished

if TYPE_CHECKING:
    from ssh_scheduler.coordinator.batch import Batch
    from ssh_scheduler.coordinator.batch_run import BatchOptions
    from ssh_scheduler.jobs.batch_file import Job
    from ssh_scheduler.machines.machine import Machine
    from ssh_scheduler.results.sweep_store import Layout

__all__ = ["JournalFollower", "SweepRun", "warn_if_results_travel"]

Show = Callable[["Batch"], contextlib.AbstractContextManager[Any]]
"""Subscribes what the user sees to one batch; entered while it runs."""


class JournalFollower:
    """Reads the batch journal's new lines as jobs end (never again from the start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.pending = b""
        self.by_job: dict[str, dict[str, Any]] = {}

    def stats(self) -> dict[str, dict[str, Any]]:
        from ssh_scheduler.results.sweep_store import job_stats

        entries = []
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self.offset)
            data = self.pending + f.read()
            self.offset = f.tell()
            *lines, self.pending = data.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    entries.append(json.loads(line))
        return job_stats(entries, self.by_job)


def warn_if_results_travel(results: str, forwards: Sequence[str]) -> None:
    """Every job would receive every earlier result when the results folder lies inside what is
    sent and is not one of the names never sent (``job_results``...)."""
    from ssh_scheduler.jobs.forward import DEFAULT_EXCLUDES

    inside = PurePosixPath(results)
    for given in forwards:
        top = PurePosixPath(os.path.normpath(given))
        if given.startswith("/") or not (str(top) == "." or inside.is_relative_to(top)):
            continue
        below = inside.parts if str(top) == "." else inside.relative_to(top).parts
        if not DEFAULT_EXCLUDES.intersection(below):
            err_line(
                f"warning: --results-dir {results} lies inside --copy-forwards {given}: every job "
                "will be sent the earlier results too (use a results folder named job_results, "
                "or narrower --copy-forwards)"
            )
            return


class SweepRun:
    """The batch of a sweep, with each job's results gathered into its combination's folder as
    the job ends (before the combination's next command is sent).

    ``-d`` runs the one combination's commands as one batch each, in order, its output copied to
    the console: the seed runner's debug mode, and in order whatever the scheduler does with
    ``after``."""

    def __init__(self, jobs: Sequence[Job], hosts: Sequence[Machine], options: BatchOptions,
                 layout: Layout, commands: Sequence[str], show: Show, debug: bool = False) -> None:
        from ssh_scheduler.coordinator.batch import Batch
        from ssh_scheduler.events import EventBus

        self.layout = layout
        self.commands = list(commands)
        self.owner = {job.name: tuple(job.name.rsplit(".", 1)) for job in jobs}
        self.journal = JournalFollower(layout.jobs_dir / ".journal.jsonl")
        self.debug = debug
        self.show = show
        self.lines: list[str] = []
        """What the sweep ends with: each batch's summary, then the combinations without a failure."""
        self.exit_code = 1
        stages = [[replace(job, after=())] for job in jobs] if debug else [list(jobs)]
        if debug:  # the seed runner's debug mode: the job's output on the console as it comes
            options = replace(options, echo_output=True)
        self.batches = []
        for stage in stages:
            bus = EventBus()
            bus.subscribe(self.on_event)  # after the journal (it subscribes first), before what is shown
            self.batches.append(Batch(stage, hosts, options, bus=bus))
        self.current = self.batches[0]

    def request_stop(self) -> None:
        self.current.request_stop()

    def gather(self, job: str) -> None:
        from ssh_scheduler.results.sweep_store import collect

        combo, command = self.owner[job]
        collect(self.layout, combo, command, self.journal.stats().get(job), self.commands)

    def on_event(self, event: Event) -> None:
        """A job's end is final (its results home, its journal line written): gather it into its
        combination's folder before the combination's next command is sent."""
        if isinstance(event, JobFinished | JobFailed) and event.job in self.owner:
            self.gather(event.job)

    async def run(self) -> int:
        """Run the batches; the exit status (also :attr:`exit_code`), and :attr:`lines` to end with."""
        summaries = []
        try:
            for batch in self.batches:
                self.current = batch
                with self.show(batch):
                    summaries.append(await batch.run())
                if summaries[-1].exit_code:
                    break  # -d: a failed command ends the combination, as in a shell script
        finally:
            for job in self.owner:
                self.gather(job)  # idempotent; catches any end whose line we did not see
        from ssh_scheduler.view.display import report_line

        self.lines = [summary.describe() for summary in summaries]
        self.lines.append(report_line(Path(self.layout.results)))
        failed = {self.owner[name][0] for s in summaries for name in s.failed if name in self.owner}
        combos = {combo for combo, _ in self.owner.values()}
        self.lines.append(
            f"sweep: {len(combos) - len(failed)} of {len(combos)} combinations without a failure; "
            f"see ssh-scheduler results {self.layout.results}"
        )
        not_sent = len(self.batches) - len(summaries)
        self.exit_code = max(s.exit_code for s in summaries) or int(not_sent > 0)
        return self.exit_code
