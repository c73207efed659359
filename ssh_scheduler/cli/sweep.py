"""``ssh-scheduler sweep`` (also ``execute_batch --sweep``) and ``ssh-scheduler results``.

The sweep runs as one batch (``ssh_scheduler.coordinator.batch.run_batch``) of jobs named
``<combination>.<command>``, each waiting for the previous command of its combination (``after``).
As each job ends, what it wrote under ``{_output}`` is moved into the combination's folder and its
stat.json entry is written, so the next command of that combination, sent later, finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ssh_scheduler.cli.main import (
    AcceptNewOpt,
    ExcludeOpt,
    GpuMemoryOpt,
    GpusPerJobOpt,
    GpuUtilizationOpt,
    HaltOpt,
    KeepaliveOpt,
    LeaseOpt,
    MachinesOpt,
    MemoryOpt,
    NoGpuOpt,
    NoReserveGpuOpt,
    NumCpusOpt,
    ProbeIntervalOpt,
    ReserveOpt,
    err_line,
    fail,
    flag_needs,
    out_line,
    run_async,
)
from ssh_scheduler.errors import SchedulerError
from ssh_scheduler.events import Event, JobFailed, JobFinished

if TYPE_CHECKING:
    from ssh_scheduler.coordinator.batch import BatchOptions
    from ssh_scheduler.jobs.batch_file import Job
    from ssh_scheduler.machines.config import Machine
    from ssh_scheduler.results.sweep_store import Layout



def sweep_args(args: Sequence[str]) -> list[str]:
    """``execute_batch --sweep FILE rest`` -> ``sweep FILE rest`` (the same flags otherwise)."""
    rest: list[str] = []
    files: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--sweep" and i + 1 < len(args):
            files.append(args[i + 1])
            i += 2
            continue
        if arg.startswith("--sweep="):
            files.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return [*files, *rest]


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


def sweep(
    sweep_file: Annotated[Path, typer.Argument(help="the sweep YAML: template, default, then --- documents")],
    machines: MachinesOpt = None,
    exclude_hosts: ExcludeOpt = None,
    titles: Annotated[list[str] | None, typer.Option("--title", "-t", help="only the documents with this _title")] = None,
    commands: Annotated[list[str] | None, typer.Option("--command", "-c", help="only this command of the template")] = None,
    debug: Annotated[bool, typer.Option("--debug", "-d", help="run only the first combination, its output on the console")] = False,
    force: Annotated[bool, typer.Option("--force", "-f", help="rerun commands that already succeeded")] = False,
    no_param_dir: Annotated[bool, typer.Option("--no-param-dir", help="no folder per combination: {_output} is the results folder")] = False,
    sample_count: Annotated[int | None, typer.Option("--sample", help="run N combinations drawn at random")] = None,
    seed: Annotated[int, typer.Option("--seed", help="random seed of --sample")] = 0,
    results_dir: Annotated[str, typer.Option("--results-dir", help="where the combination folders go")] = "job_results",
    copy_forwards: Annotated[list[str] | None, typer.Option("--copy-forwards", help="paths to send (default: .)")] = None,
    copy_backwards: Annotated[list[str] | None, typer.Option("--copy-backwards", help="paths to bring back besides {_output}")] = None,
    num_cpus: NumCpusOpt = 1.0,
    memory_required: MemoryOpt = 1000,
    reserve: ReserveOpt = False,
    no_gpu_required: NoGpuOpt = False,
    gpus_per_job: GpusPerJobOpt = None,
    gpu_memory_required: GpuMemoryOpt = 1000,
    gpu_utilization: GpuUtilizationOpt = 0.0,
    no_reserve_gpu: NoReserveGpuOpt = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list the commands that would run, run nothing")] = False,
    accept_new: AcceptNewOpt = False,
    probe_interval: ProbeIntervalOpt = 15.0,
    lease: LeaseOpt = 60.0,
    retries: Annotated[int, typer.Option("--retries", help="run a failed command again up to N times")] = 0,
    timeout: Annotated[float | None, typer.Option("--timeout", help="seconds a command may run")] = None,
    halt: HaltOpt = None,
    keepalive: KeepaliveOpt = None,
) -> None:
    """Run every combination of a parameter sweep across the machines; results per combination."""
    from ssh_scheduler.coordinator.batch import BatchOptions
    from ssh_scheduler.jobs.sweep import build_jobs, expand, parse_sweep, sample, select_commands
    from ssh_scheduler.machines.config import load_machines, local_machine
    from ssh_scheduler.planner.policy import parse_halt
    from ssh_scheduler.results.journal import read_journal
    from ssh_scheduler.results.sweep_store import Layout, job_stats, plan_runs, prepare, recover

    try:
        try:
            text = sweep_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SchedulerError(f"cannot read sweep file {sweep_file}: {exc}") from None
        spec = parse_sweep(text, str(sweep_file))
        layout = Layout.create(results_dir, param_dir=not no_param_dir)
        combos = expand(spec, titles or ())
        if sample_count is not None:
            combos = sample(combos, sample_count, seed)
        if debug:
            combos = combos[:1]
        chosen = select_commands(spec, commands or ())
        if not dry_run:
            for job in recover(layout, combos, [n for n, _ in spec.commands], job_stats(read_journal(layout.jobs_dir))):
                out_line(f"gathered: {job} (it ended while no sweep was watching)")
        runs, skipped = plan_runs(combos, chosen, layout, force=force or debug)
        for combo, command, _ in skipped:
            out_line(f"skipped: {combo.name}.{command} (succeeded before; -f reruns it)")
        if dry_run:
            for combo, command, text in runs:
                out_line(f"would run: {combo.name}.{command}; {text}")
            out_line(f"{len(combos)} combinations: {len(runs)} commands to run, {len(skipped)} skipped")
            return
        if not runs:
            out_line(f"nothing to do: every command of {len(combos)} combinations succeeded before")
            return
        out_line(
            f"sweep: {len({c.name for c, _, _ in runs})} of {len(combos)} combinations, "
            f"{len(runs)} commands to run, {len(skipped)} skipped; results in {layout.results}/"
        )
        forwards = tuple(copy_forwards or (".",))
        warn_if_results_travel(layout.results, forwards)
        jobs = build_jobs(runs, layout.copies(forwards, copy_backwards), str(sweep_file))
        hosts = load_machines(machines, exclude=exclude_hosts or ()) if machines else [local_machine()]
        needs, gpus_explicit = flag_needs(
            num_cpus, memory_required, reserve, no_gpu_required, gpus_per_job,
            gpu_memory_required, gpu_utilization, no_reserve_gpu,
        )
        options = BatchOptions(
            needs=needs,
            gpus_explicit=gpus_explicit,
            copy_forwards=forwards,
            results_dir=layout.jobs_dir,
            accept_new=accept_new,
            probe_interval=probe_interval,
            lease=lease,
            retries=retries,
            allow_changed=True,  # which commands rerun is decided from stat.json/param.json above
            timeout=timeout,
            halt=parse_halt(halt),
            keepalive=keepalive,
        )
        prepare(runs, layout)
        layout.jobs_dir.mkdir(parents=True, exist_ok=True)
        runner = SweepRun(jobs, hosts, options, layout, [name for name, _ in chosen], debug)
        code = run_async(runner.run, runner.request_stop)
    except SchedulerError as exc:
        raise fail(exc) from None
    except asyncio.CancelledError:
        err_line("cancelled: running jobs were killed")
        raise typer.Exit(130) from None
    raise typer.Exit(code)


def warn_if_results_travel(results: str, forwards: Sequence[str]) -> None:
    """Every job would receive every earlier result when the results folder lies inside what is
    sent and is not one of the names never sent (``job_results``...)."""
    from ssh_scheduler.executors.transfer import DEFAULT_EXCLUDES

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
                 layout: Layout, commands: Sequence[str], debug: bool = False) -> None:
        from ssh_scheduler.coordinator.batch import Batch
        from ssh_scheduler.events import EventBus

        self.layout = layout
        self.commands = list(commands)
        self.owner = {job.name: tuple(job.name.rsplit(".", 1)) for job in jobs}
        self.journal = JournalFollower(layout.jobs_dir / ".journal.jsonl")
        self.debug = debug
        stages = [[replace(job, after=())] for job in jobs] if debug else [list(jobs)]
        if debug:  # the seed runner's debug mode: the job's output on the console as it comes
            options = replace(options, echo_output=True)
        self.batches = []
        for stage in stages:
            bus = EventBus()
            bus.subscribe(self.on_event)  # after the journal (it subscribes first), before nothing else
            self.batches.append(Batch(stage, hosts, options, out=out_line, err=err_line, bus=bus))
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
        summaries = []
        try:
            for batch in self.batches:
                self.current = batch
                summaries.append(await batch.run())
                if summaries[-1].exit_code:
                    break  # -d: a failed command ends the combination, as in a shell script
        finally:
            for job in self.owner:
                self.gather(job)  # idempotent; catches any end whose line we did not see
        for summary in summaries:
            err_line(summary.describe())
        failed = {self.owner[name][0] for s in summaries for name in s.failed if name in self.owner}
        combos = {combo for combo, _ in self.owner.values()}
        err_line(
            f"sweep: {len(combos) - len(failed)} of {len(combos)} combinations without a failure; "
            f"see ssh-scheduler results {self.layout.results}"
        )
        not_sent = len(self.batches) - len(summaries)
        return max(s.exit_code for s in summaries) or int(not_sent > 0)


def results(
    results_dir: Annotated[Path, typer.Argument(help="a sweep's --results-dir")] = Path("job_results"),
    as_csv: Annotated[bool, typer.Option("--csv", help="comma-separated values on stdout")] = False,
    as_tsv: Annotated[bool, typer.Option("--tsv", help="tab-separated values on stdout")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="a JSON list of records on stdout")] = False,
) -> None:
    """One row per combination of a sweep: varying parameters, state, metrics.json values."""
    from ssh_scheduler.results.results_table import (
        format_delimited,
        format_json,
        format_text,
        read_results,
        table,
    )

    if sum((as_csv, as_tsv, as_json)) > 1:
        err_line("error: choose one of --csv, --tsv, --json")
        raise typer.Exit(2)
    try:
        columns, body = table(read_results(results_dir))
    except SchedulerError as exc:
        raise fail(exc) from None
    if as_csv or as_tsv:
        out_line(format_delimited(columns, body, "," if as_csv else "\t"))
    elif as_json:
        out_line(format_json(columns, body))
    else:
        out_line(format_text(columns, body))


COMMANDS: dict[str, Callable[..., None]] = {"sweep": sweep, "results": results}
