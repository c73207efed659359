"""Sweeps of a Python function: every combination of a grid is one call, ``fn(**params)``, run in
the combination's folder, with the same folders, ``param.json``, ``stat.json``, skip-finished rule
and ``ssh-scheduler results`` as a sweep of shell commands.

Two ways in, one path: :meth:`ssh_scheduler.Executor.sweep` (:func:`run_sweep`: the grid as
Python dicts, the results returned), and a sweep YAML whose header names a function instead of a
template (``call: package.module:function``, read by :mod:`ssh_scheduler.jobs.sweep`; the CLI
builds its jobs with :func:`call_jobs`).  Either way the combinations come from
``jobs.sweep.expand`` (the dicts are the YAML's documents), what runs and what is skipped from
``results.sweep_store.plan_runs``, and each combination's job is ``<combination>.call``: its
work the pickled call (``functions.payload``, run by the call runner in ``{_output}``, the
combination's folder on the host, so what the function writes there comes home into the
combination's folder, ``metrics.json`` included).  Its return value stays in its job's results
(``.jobs/<combination>.call/``), where a rerun that skips the combination reads it again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import importlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.errors import ConfigError, plain_text
from ssh_scheduler.events import EventBus
from ssh_scheduler.functions.outcome import Outcome, read_outcome
from ssh_scheduler.functions.payload import pickle_call
from ssh_scheduler.functions.runtime import CallBatch, CallFuture
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.python_call import INFO, RESULT
from ssh_scheduler.jobs.sweep import (
    CALL_COMMAND,
    Copies,
    SweepSpec,
    build_jobs,
    expand,
    parse_sweep,
)
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.results.journal import read_journal
from ssh_scheduler.results.sweep_store import (
    Layout,
    Run,
    collect,
    job_stats,
    plan_runs,
    prepare,
    recover,
)

__all__ = ["call_jobs", "grid_spec", "resolve_function", "run_sweep"]

WHERE = "Executor.sweep"
"""How messages about a grid name it (``default`` is its document 1, the grids 2, 3...)."""


def resolve_function(reference: str, where: str) -> Callable[..., Any]:
    """The function ``package.module:function`` names, imported here as ``python -m`` would
    (the current folder first on ``sys.path``): the call travels by name, so what cannot be
    imported here would not load on a host either.  A bad reference is one line with the fix."""
    module_name, _, qualname = reference.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    shown = f"{plain_text(where)}: call {reference}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"{shown}: no module named {exc.name}; fix: run the sweep from the folder that holds "
            f"{module_name.split('.')[0]} (or install it), and check the spelling package.module:function"
        ) from None
    except Exception as exc:  # (importing runs the module's code: anything may go wrong)
        raise ConfigError(f"{shown}: importing {module_name} raised {type(exc).__name__}: {str(exc)[:200]}") from None
    found: object = module
    for part in qualname.split("."):
        if not hasattr(found, part):
            names = [n for n in dir(found) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"did you mean {close[0]}?" if close else "fix: name a function defined in it"
            raise ConfigError(f"{shown}: {module_name} has no {qualname} ({hint})")
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError(f"{shown}: {qualname} is a {type(found).__name__}, not a function")
    return found


def _reference(function: object) -> str:
    """How ``param.json`` records the function (a changed function is a changed command)."""
    module = getattr(function, "__module__", None) or "?"
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}:{name}"


def _plain(value: object, where: str) -> object:
    """A grid value as YAML writes it: a scalar, or a list (a tuple too) of them."""
    if isinstance(value, tuple | list):
        return [_plain(v, where) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise ConfigError(
        f"{where}: {type(value).__name__} is not a parameter value; use numbers, strings or "
        "booleans (they name the combination's folder and are written to its param.json)"
    )


def grid_spec(function: Callable[..., Any], grid: Mapping[str, Any] | Sequence[Mapping[str, Any]],
              default: Mapping[str, Any] | None = None) -> SweepSpec:
    """The sweep of ``function`` over ``grid`` (one dict of lists, or a list of them: the union
    of their cross products) with ``default`` filling the rest: the spec a sweep YAML with the
    same documents gives, checked by the same code (:func:`~ssh_scheduler.jobs.sweep.parse_sweep`)."""
    grids = [grid] if isinstance(grid, Mapping) else list(grid)
    if not grids or not all(isinstance(g, Mapping) for g in grids):
        raise ConfigError(f"{WHERE}: grid must be a dict of parameter lists, or a list of such dicts (their union)")
    if default is not None and not isinstance(default, Mapping):
        raise ConfigError(f"{WHERE}: default must be a dict of parameter values")
    header = {"call": "function:placeholder", "default": {k: _plain(v, f"{WHERE}: default {k!r}") for k, v in (default or {}).items()}}
    documents = [{k: _plain(v, f"{WHERE}: grid {k!r}") for k, v in g.items()} for g in grids]
    spec = parse_sweep(yaml.safe_dump_all([header, *documents], sort_keys=False), WHERE)
    reference = _reference(function)
    return dataclasses.replace(spec, call=reference, commands=((CALL_COMMAND, reference),))


def call_jobs(runs: Sequence[Run], layout: Layout, copies: Callable[[Any, int], Copies], function: Callable[..., Any],
              payloads: Path, base_dir: Path, path: str) -> list[Job]:
    """The jobs of a function sweep's ``runs``: the jobs ``jobs.sweep.build_jobs`` makes of them
    (names, copy paths, needs), each with the pickled call ``function(**params)`` as its work,
    run in the combination's folder, its result brought home with the paths asked for."""
    jobs = build_jobs(runs, copies, path)
    called = []
    for (combo, _, _), job in zip(runs, jobs, strict=True):
        pickled = pickle_call(function, (), dict(combo.values), payloads, base_dir, cwd=layout.output(combo.name))
        back = job.copy_backwards
        if back is not None:  # the paths asked for, and the call's result
            back = (*back, RESULT, INFO)
        called.append(dataclasses.replace(job, command=pickled.description, copy_backwards=back, call=pickled.work))
    return called


def _results_dir(options: BatchOptions, function: object) -> str:
    """The default: the function's own folder in the executor's results folder (``job_results``
    is never copied forward, so no job is sent the earlier combinations' results)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(getattr(function, "__name__", "call"))).strip("._") or "call"
    try:
        below = Path(options.results_dir).resolve().relative_to(Path(options.base_dir).resolve())
    except ValueError:
        raise ConfigError(
            f"{WHERE}: the executor's results folder lies outside its base folder; pass results_dir= "
            "(a folder below the current one)"
        ) from None
    return (below / name).as_posix()


def run_sweep(
    machines: Sequence[Machine], options: BatchOptions, function: Callable[..., Any],
    grid: Mapping[str, Any] | Sequence[Mapping[str, Any]], default: Mapping[str, Any] | None = None, *,
    results_dir: str | Path | None = None, force: bool = False, return_exceptions: bool = False,
) -> list[tuple[dict[str, Any], Any]]:
    """Run ``function(**params)`` for every combination (see :func:`grid_spec`) on ``machines``
    as one batch of its own with the executor's ``options``; block until every combination has
    ended and is gathered into its folder under ``results_dir`` (default:
    ``job_results/<function name>``, relative to the current folder, which must be the
    executor's base folder).  A combination that succeeded before is not run again (``force``:
    it is); its value is read from its folder.  Returns ``[(params, value), ...]`` in the
    combination order; the first exception a call raised is raised once every combination has
    ended, unless ``return_exceptions`` (then it stands in the list in place of the value)."""
    if Path.cwd().resolve() != Path(options.base_dir).resolve():
        raise ConfigError(
            f"{WHERE}: run it from the executor's base folder ({plain_text(str(options.base_dir))}): a "
            "sweep's folders are named relative to the current folder, here and on the hosts"
        )
    spec = grid_spec(function, grid, default)
    layout = Layout.create(str(results_dir) if results_dir is not None else _results_dir(options, function))
    combos = expand(spec)
    recover(layout, combos, [CALL_COMMAND], job_stats(read_journal(layout.jobs_dir)))
    runs, _ = plan_runs(combos, spec.commands, layout, force=force)
    futures = _run(machines, options, function, runs, layout, spec.path) if runs else {}
    found: list[tuple[dict[str, Any], Any]] = []
    first_error: BaseException | None = None
    for combo in combos:
        future = futures.get(combo.name)
        if future is None:  # finished before: its value is in its folder
            outcome = read_outcome(layout.jobs_dir, f"{combo.name}.{CALL_COMMAND}", "an earlier run")
        elif future.cancelled():
            outcome = Outcome(error=concurrent.futures.CancelledError(f"combination {combo.name} was cancelled"))
        else:
            outcome = Outcome(value=None, error=future.exception()) if future.exception() else Outcome(future.result())
        if outcome.error is not None and first_error is None:
            first_error = outcome.error
        found.append((dict(combo.values), outcome.error if outcome.error is not None else outcome.value))
    if first_error is not None and not return_exceptions:
        raise first_error
    return found


def _run(machines: Sequence[Machine], options: BatchOptions, function: Callable[..., Any], runs: Sequence[Run],
         layout: Layout, path: str) -> dict[str, CallFuture]:
    """The runs as one open batch of calls; every run gathered into its combination's folder
    at the end, also when interrupted (a rerun gathers what ended after that: ``recover``)."""
    prepare(runs, layout)
    layout.jobs_dir.mkdir(parents=True, exist_ok=True)
    payloads = Path(tempfile.mkdtemp(prefix="ssh_scheduler-sweep-"))
    try:
        copies = layout.copies(options.copy_forwards, options.copy_backwards)
        jobs = call_jobs(runs, layout, copies, function, payloads, Path(options.base_dir), path)
    except BaseException:
        shutil.rmtree(payloads, ignore_errors=True)
        raise
    # A batch of its own (its results folder is the sweep's .jobs), with a bus of its own: the
    # executor's journal and futures hear only the executor's batch.
    batch = dataclasses.replace(options, results_dir=layout.jobs_dir.resolve(), allow_changed=True)
    calls = CallBatch(machines, batch, EventBus(), payloads)  # (removes payloads when it ends)
    calls.start()
    futures: dict[str, CallFuture] = {}
    try:
        for (combo, _, _), job in zip(runs, jobs, strict=True):
            assert job.call is not None
            future = futures[combo.name] = CallFuture(job.name, calls.cancel)
            calls.add(job, future, job.call.path)
        calls.close()
        concurrent.futures.wait(futures.values())
        calls.join()
    except BaseException:  # Ctrl-C: nothing is left running on a host
        calls.stop()
        calls.join()
        raise
    finally:
        stats = job_stats(read_journal(layout.jobs_dir))
        for combo, command, _ in runs:
            collect(layout, combo.name, command, stats.get(f"{combo.name}.{command}"), [CALL_COMMAND])
    return futures
