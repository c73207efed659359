"""A sweep's result folders on the coordinator: what to (re)run, param.json, stat.json, and the
combination folder assembled from the scheduler's per-job results.

Layout (``results`` is ``--results-dir``, relative to the working directory)::

    results/<combination>/          the combination's folder, ``{_output}``
        param.json                  parameters, name, folder and the exact commands
        stat.json                   per command: code, host, gpus, seconds, started, ended
        train.out, train.err        each command's output
        ...                         what the commands wrote under {_output}
    results/.jobs/                  the batch underneath: a job ``<combination>.<command>`` per
                                    command, its journal, and what a job wrote outside {_output}

With ``--no-param-dir`` there is no folder per combination: ``{_output}`` is ``results`` itself
and the files are ``results/<combination>.param.json``, ``.stat.json``, ``.<command>.out``...

Plain file I/O, no asyncio: the CLI calls :func:`collect` as each job ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ssh_scheduler.errors import ConfigError, plain_text
from ssh_scheduler.jobs.shell_template import render
from ssh_scheduler.jobs.sweep import Combination, Copies, command_values
from ssh_scheduler.results.untrusted import parse_json, read_untrusted

log = logging.getLogger(__name__)

JOBS_FOLDER = ".jobs"
PREVIOUS_FOLDER = ".previous"
Run = tuple[Combination, str, str]
"""``(combination, command name, rendered command)``."""


@dataclass(frozen=True, slots=True)
class Layout:
    results: str
    """The results folder as a relative POSIX path (the same on the hosts, inside each job)."""
    param_dir: bool = True

    @classmethod
    def create(cls, results: str, param_dir: bool = True) -> Layout:
        path = PurePosixPath(results)
        if path.is_absolute() or ".." in path.parts or str(path) in (".", ""):
            raise ConfigError(
                f"--results-dir {plain_text(results)}: a sweep needs a folder below the current "
                "one ({_output} names the same relative folder on every host)"
            )
        return cls(str(path), param_dir)

    @property
    def jobs_dir(self) -> Path:
        return Path(self.results) / JOBS_FOLDER

    def output(self, combo: str) -> str:
        """``{_output}``: where the combination's commands write, relative to their folder."""
        return f"{self.results}/{combo}" if self.param_dir else self.results

    def file(self, combo: str, name: str) -> Path:
        """One of our files of a combination: ``param.json``, ``stat.json``, ``train.out``..."""
        if self.param_dir:
            return Path(self.results) / combo / name
        return Path(self.results) / f"{combo}.{name}"

    def manifest(self, combo: str) -> Path:
        """Which files of the combination each command wrote (so a rerun can set them aside)."""
        if self.param_dir:
            return Path(self.results) / combo / ".files.json"
        return Path(self.results) / f".{combo}.files.json"

    def forwards(self, combo: str, position: int = 0) -> str:
        """What to send with a combination's command so ``{_output}`` exists and holds the
        earlier commands' files: the combination's folder (or, without one, its param.json).

        The scheduler collects a job's inputs when it sends its first job with the same copy
        paths; the k-th command of a combination spells the same folder differently
        (``job_results/lr_1/.`` for the second) so that its inputs are collected when it is sent,
        after the earlier command's files arrived, not when the first command was sent."""
        if not self.param_dir:
            return self.file(combo, "param.json").as_posix()
        return self.output(combo) + "/." * position

    def copies(self, forwards: Sequence[str], backwards: Sequence[str] | None) -> Callable[[Combination, int], Copies]:
        """``build_jobs``'s copy paths: the batch's own plus the combination's folder."""

        def of(combo: Combination, position: int) -> Copies:
            back = (*backwards, self.output(combo.name)) if backwards else None
            return (*forwards, self.forwards(combo.name, position)), back

        return of


MAX_JSON_BYTES = 64 << 20
"""The largest param.json, stat.json or metrics.json read (a sweep writes a few KiB)."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from disk, or ``{}`` when absent or not a JSON object (a torn write).
    Whatever else stands at its name (a link, a FIFO, a folder, a file beyond
    :data:`MAX_JSON_BYTES`) is one error line: the folder may be someone else's."""
    data = read_untrusted(path, "a sweep's file", MAX_JSON_BYTES)
    if data is None:
        return {}
    try:
        parsed = parse_json(data.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError too
        return {}
    return parsed if isinstance(parsed, dict) else {}


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(temp, path)


def recover(layout: Layout, combos: Sequence[Combination], commands: Sequence[str],
            stats: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Gather jobs that ended but were never gathered (the coordinator stopped between a job's
    end and its gathering), so a rerun neither loses nor repeats them.  ``stats`` is
    :func:`job_stats` of the whole batch journal.  Returns the jobs gathered."""
    gathered = []
    for combo in combos:
        recorded = read_json(layout.file(combo.name, "stat.json"))
        for command in commands:
            job = f"{combo.name}.{command}"
            stat = stats.get(job)
            if not stat or "code" not in stat or not (layout.jobs_dir / job).is_dir():
                continue
            if (recorded.get(command) or {}).get("started") != stat["started"]:
                collect(layout, combo.name, command, stat, commands)
                gathered.append(job)
    return gathered


def plan_runs(
    combos: Sequence[Combination],
    commands: Sequence[tuple[str, str]],
    layout: Layout,
    force: bool = False,
) -> tuple[list[Run], list[Run]]:
    """``(to run, skipped)``.  A command is skipped when stat.json says it exited 0 and param.json
    recorded the same command text; once one command of a combination runs, the later ones run
    too (their inputs may change)."""
    runs: list[Run] = []
    skipped: list[Run] = []
    for combo in combos:
        stat = read_json(layout.file(combo.name, "stat.json"))
        recorded = read_json(layout.file(combo.name, "param.json")).get("_commands", {})
        values = command_values(combo, layout.output(combo.name))
        rerun = force
        for name, template in commands:
            text = render(template, values)
            done = (stat.get(name) or {}).get("code") == 0 and recorded.get(name) == text
            rerun = rerun or not done
            (runs if rerun else skipped).append((combo, name, text))
    return runs, skipped


def prepare(runs: Sequence[Run], layout: Layout) -> None:
    """Before the batch: write each combination's param.json, forget stat.json entries of the
    commands about to run, and move their old job results aside (never deleted) so the
    scheduler runs them again."""
    by_combo: dict[str, list[Run]] = {}
    for run in runs:
        by_combo.setdefault(run[0].name, []).append(run)
    for name, combo_runs in by_combo.items():
        combo = combo_runs[0][0]
        param_path = layout.file(name, "param.json")
        recorded = read_json(param_path).get("_commands", {})
        commands = {**recorded, **{command: text for _, command, text in combo_runs}}
        write_json(param_path, {
            "_name": name,
            "_output": layout.output(name),
            "_index": combo.index,
            "_document": combo.document,
            "_title": combo.title,
            "_varying": list(combo.varying),
            "_commands": commands,
            **combo.values,
        })
        stat_path = layout.file(name, "stat.json")
        stat = read_json(stat_path)
        running = {command for _, command, _ in combo_runs}
        if stat:  # an old success must not outlive the rerun that replaces it
            write_json(stat_path, {k: v for k, v in stat.items() if k not in running})
    for combo, command, _ in runs:
        _set_aside(layout, combo.name, command)


def _set_aside(layout: Layout, combo: str, command: str) -> None:
    """Move a command's earlier job results, and the files it wrote into the combination's
    folder, to ``.jobs/.previous/<job>.<n>/``: the rerun starts clean (files sent to a job are
    read-only there, so an old output in its way could not even be overwritten)."""
    jobs = layout.jobs_dir
    job = f"{combo}.{command}"
    paths = [jobs / job, jobs / f"{job}.out", jobs / f"{job}.err"]
    manifest_path = layout.manifest(combo)
    manifest = read_json(manifest_path)
    output = Path(layout.output(combo))
    written = [output / rel for rel in manifest.get(command, ()) if os.path.lexists(output / rel)]
    if not any(p.exists() for p in paths) and not written:
        return
    n = 1
    while (jobs / PREVIOUS_FOLDER / f"{job}.{n}").exists():
        n += 1
    target = jobs / PREVIOUS_FOLDER / f"{job}.{n}"
    target.mkdir(parents=True)
    for path in paths:
        if path.exists():
            os.rename(path, target / path.name)
    for path in written:
        moved = target / "output" / path.relative_to(output)
        moved.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, moved)
    manifest.pop(command, None)
    write_json(manifest_path, manifest)


def job_stats(
    entries: Iterable[Mapping[str, Any]], stats: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """Each job's last attempt from the batch journal: host, GPUs, start, end, exit code and
    seconds (from its start until its results were home).  ``stats`` from earlier entries is
    updated in place (the journal is read as it grows)."""
    stats = {} if stats is None else stats
    for entry in entries:
        job, state, when = str(entry.get("job")), entry.get("state"), entry.get("t")
        if state == "started" and isinstance(when, int | float):
            stats[job] = {"host": entry.get("host"), "gpus": list(entry.get("gpus") or []), "started": when}
        elif state in ("finished", "failed") and job in stats and isinstance(when, int | float):
            record = stats[job]
            record.update(code=entry.get("code"), ended=when, seconds=round(when - record["started"], 3))
            if entry.get("timed_out"):
                record["timed_out"] = True
    return stats


def collect(layout: Layout, combo: str, command: str, stat: Mapping[str, Any] | None, commands: Sequence[str]) -> None:
    """After job ``<combo>.<command>`` ended: move what it wrote under ``{_output}`` into the
    combination's folder, link its logs there and record its stat.json entry.  Safe to call
    twice (the second call finds nothing new to move)."""
    job = f"{combo}.{command}"
    source = layout.jobs_dir / job / layout.output(combo)
    target = Path(layout.output(combo))
    ours = {layout.file(combo, n).name for n in ("param.json", "stat.json")} | {layout.manifest(combo).name}
    ours |= {layout.file(combo, f"{c}{s}").name for c in commands for s in (".out", ".err")}
    if source.is_dir():
        moved = _merge(source, target, ours)
        _remove_empty(source, layout.jobs_dir / job)
        if moved:
            manifest_path = layout.manifest(combo)
            manifest = read_json(manifest_path)
            manifest[command] = sorted({*manifest.get(command, ()), *moved})
            write_json(manifest_path, manifest)
    for suffix in (".out", ".err"):
        log_file = layout.jobs_dir / f"{job}{suffix}"
        if log_file.exists():
            _link(log_file, layout.file(combo, f"{command}{suffix}"))
    if stat is not None:
        stat_path = layout.file(combo, "stat.json")
        write_json(stat_path, {**read_json(stat_path), command: dict(stat)})


def _merge(source: Path, target: Path, protected: set[str]) -> list[str]:
    """Move every file of ``source`` to the same place under ``target`` (replacing an older
    one); our own files at the top are never replaced by a job's.  Returns what was moved."""
    moved: list[str] = []
    for dirpath, dirnames, filenames in os.walk(source, topdown=False):
        here = Path(dirpath)
        rel = here.relative_to(source)
        for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
            if rel == Path(".") and name in protected:
                log.warning("%s: a job wrote %s, which the sweep keeps for itself; left in %s", target, name, here)
                continue
            (target / rel).mkdir(parents=True, exist_ok=True)
            destination = target / rel / name
            if destination.is_dir() and not destination.is_symlink():
                shutil.rmtree(destination)
            os.replace(here / name, destination)
            moved.append((rel / name).as_posix())
        if here != source:
            with contextlib.suppress(OSError):  # something stayed (a protected name)
                here.rmdir()
    return moved


def _remove_empty(folder: Path, stop: Path) -> None:
    """``folder`` and its parents up to ``stop`` (kept), while they are empty."""
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _link(source: Path, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if os.path.samefile(source, destination):
            return  # linked already (rename onto the same file would leave the temp name)
    temp = destination.with_name(f".{destination.name}.tmp")
    temp.unlink(missing_ok=True)
    try:
        os.link(source, temp)
    except OSError:  # another file system: a copy will do
        shutil.copyfile(source, temp)
    os.replace(temp, destination)
