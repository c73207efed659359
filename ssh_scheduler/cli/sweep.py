"""``ssh-scheduler sweep`` (also ``execute_batch --sweep``): every combination of a parameter sweep
as jobs across the machines, results per combination.

It takes ``execute_batch``'s options from the same table (:mod:`ssh_scheduler.jobs.options`),
those that make no sense for a sweep refused with their reason, plus its own choice of documents,
commands and combinations.  What the run does is :class:`~ssh_scheduler.cli.sweep_run.SweepRun`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ssh_scheduler.cli.common import err_line, fail, out_line, run_async
from ssh_scheduler.cli.display import batch_display, verbosity_of
from ssh_scheduler.cli.params import command_argv, takes_options
from ssh_scheduler.errors import ConfigError, SchedulerError
from ssh_scheduler.jobs.options import SWEEP

if TYPE_CHECKING:
    from ssh_scheduler.cli.detach import DetachedDisplay
    from ssh_scheduler.cli.sweep_run import Show
    from ssh_scheduler.coordinator.batch import Batch

__all__ = ["sweep"]


@takes_options(SWEEP)
def sweep(
    sweep_file: Annotated[Path, typer.Argument(help="the sweep YAML: template, default, then --- documents")],
    **values: Any,
) -> None:
    """Run every combination of a parameter sweep across the machines; results per combination."""
    from ssh_scheduler.cli.sweep_run import SweepRun, warn_if_results_travel
    from ssh_scheduler.coordinator.batch_run import batch_options
    from ssh_scheduler.coordinator.preflight import check_numbers
    from ssh_scheduler.jobs.needs import flag_needs
    from ssh_scheduler.jobs.sweep import build_jobs, expand, parse_sweep, sample, select_commands
    from ssh_scheduler.machines.config import load_machines
    from ssh_scheduler.machines.machine import local_machine, with_keep_warm
    from ssh_scheduler.planner.policy import parse_halt
    from ssh_scheduler.results.journal import read_journal
    from ssh_scheduler.results.sweep_store import Layout, job_stats, plan_runs, prepare, recover

    debug, dry_run, json_events = values["debug"], values["dry_run"], values["json_events"]
    verbosity = verbosity_of(values)
    # Under --json stdout carries the events alone: the sweep's own lines go to stderr.
    say = err_line if json_events else out_line
    output: DetachedDisplay | None = None
    payloads: Path | None = None  # a function sweep's pickled calls (call: in the header)
    try:
        refuse_together(values)
        layout = Layout.create(str(values["results_dir"]), param_dir=not values["no_param_dir"])
        if values["detach"]:
            raise typer.Exit(detach(sweep_file, values, layout.jobs_dir))
        check_numbers(**values)
        flag_needs(values)  # a need out of range, like a bad --halt, is refused before anything runs
        parse_halt(values["halt"])
        try:
            text = sweep_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SchedulerError(f"cannot read sweep file {sweep_file}: {exc}") from None
        spec = parse_sweep(text, str(sweep_file))
        combos = expand(spec, values["titles"] or ())
        if values["sample_count"] is not None:
            combos = sample(combos, values["sample_count"], values["seed"])
        if debug:
            combos = combos[:1]
        chosen = select_commands(spec, values["only_commands"] or ())
        if spec.call is not None:
            from ssh_scheduler.functions.call_sweep import resolve_function

            function = resolve_function(spec.call, str(sweep_file))
        if not dry_run:
            for job in recover(layout, combos, [n for n, _ in spec.commands], job_stats(read_journal(layout.jobs_dir))):
                say(f"gathered: {job} (it ended while no sweep was watching)")
        runs, skipped = plan_runs(combos, chosen, layout, force=values["force"] or debug)
        for combo, command, _ in skipped if verbosity >= 0 else ():
            say(f"skipped: {combo.name}.{command} (succeeded before; -f reruns it)")
        if dry_run:
            for combo, command, text in runs:
                out_line(f"would run: {combo.name}.{command}; {text}")
            out_line(f"{len(combos)} combinations: {len(runs)} commands to run, {len(skipped)} skipped")
            return
        if not runs:
            say(f"nothing to do: every command of {len(combos)} combinations succeeded before")
            return
        say(
            f"sweep: {len({c.name for c, _, _ in runs})} of {len(combos)} combinations, "
            f"{len(runs)} commands to run, {len(skipped)} skipped; results in {layout.results}/"
        )
        forwards = tuple(values["copy_forwards"] or (".",))
        warn_if_results_travel(layout.results, forwards)
        copies = layout.copies(forwards, values["copy_backwards"])
        if spec.call is not None:
            import tempfile

            from ssh_scheduler.functions.call_sweep import call_jobs

            payloads = Path(tempfile.mkdtemp(prefix="ssh_scheduler-sweep-"))
            jobs = call_jobs(runs, layout, copies, function, payloads, Path.cwd(), str(sweep_file))
        else:
            jobs = build_jobs(runs, copies, str(sweep_file))
        machines = values["machines"]
        hosts = load_machines(machines, exclude=values["exclude_hosts"] or ()) if machines else [local_machine()]
        hosts = with_keep_warm(hosts, values["keep_warm"])
        # Which commands rerun was decided from stat.json and param.json above: a changed command
        # is one the sweep means to run.
        options = batch_options(values, results_dir=layout.jobs_dir, allow_changed=True, dry_run=False)
        prepare(runs, layout)
        layout.jobs_dir.mkdir(parents=True, exist_ok=True)
        if values["status_fd"] is not None:  # we are the coordinator --detach started
            from ssh_scheduler.cli.detach import DetachedDisplay, detached_session

            session = detached_session(layout.jobs_dir, values["status_fd"])
            output = DetachedDisplay(session, verbosity, lambda: (runner.exit_code, runner.lines))
        show = detached_show(output) if output is not None else foreground_show(values)
        runner = SweepRun(jobs, hosts, options, layout, [name for name, _ in chosen], show, debug)
        with output or contextlib.nullcontext():
            code = run_async(runner.run, output.interrupt(runner.request_stop) if output is not None else runner.request_stop)
    except SchedulerError as exc:
        raise fail(exc) from None
    except asyncio.CancelledError:
        err_line("cancelled: running jobs were killed")
        raise typer.Exit(130) from None
    finally:
        if payloads is not None:
            import shutil

            shutil.rmtree(payloads, ignore_errors=True)
    for line in runner.lines:
        err_line(line)
    raise typer.Exit(code)


def refuse_together(values: Mapping[str, Any]) -> None:
    """Flags that each make sense for a sweep but not together."""
    if values["debug"] and values["detach"]:
        raise ConfigError("-d shows the jobs' output on this terminal; it does not go with --detach")
    if values["debug"] and values["json_events"]:
        raise ConfigError("-d copies the jobs' output to stdout, where --json writes events; choose one")
    if values["dry_run"] and values["json_events"]:
        raise ConfigError("a sweep's --dry-run lists its commands as text; drop --json")


def foreground_show(values: Mapping[str, Any]) -> Show:
    """What each batch of the sweep shows on this terminal, as for ``execute_batch``."""
    plain = values["plain"] or values["debug"]  # -d: the jobs' own output interleaves, no live view
    verbosity = verbosity_of(values)

    def show(batch: Batch) -> contextlib.AbstractContextManager[Any]:
        return batch_display(batch, json_events=values["json_events"], plain=plain, verbosity=verbosity)

    return show


def detach(sweep_file: Path, values: Mapping[str, Any], batch_dir: Path) -> int:
    """Start the sweep in the background: this command again, as the coordinator (cli/detach.py);
    its log, event file and control socket are in the folder of the batch under it."""
    from ssh_scheduler.cli.detach import start_detached

    def again(status_fd: int) -> list[str]:
        return command_argv(SWEEP, {**values, "status_fd": status_fd}, [str(sweep_file)], leave_out=("detach",))

    return start_detached(again, batch_dir, json_events=values["json_events"], dry_run=values["dry_run"], what="sweep")


def detached_show(output: DetachedDisplay) -> Show:
    """Each batch of a detached sweep into its log and event file (one for all: ``-d`` cannot
    detach)."""

    def show(batch: Batch) -> contextlib.AbstractContextManager[Any]:
        output.watch(batch)
        return contextlib.nullcontext()

    return show
