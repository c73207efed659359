"""``ssh-scheduler results DIR``: one row per combination of a sweep (pure file reading/formatting).

A row holds the combination's name, the parameters that vary across the sweep, its state, and
every metric its commands wrote to ``metrics.json`` in the combination's folder (nested objects
flattened to ``a.b`` columns).  Output: an aligned table, or CSV/TSV/JSON records for pandas
(``pd.read_csv``, ``pd.read_json``).

The folder is read as untrusted input (it may be a copy of someone else's): no link is followed
(a linked folder or file is not a combination we wrote), every file through
:mod:`ssh_scheduler.results.untrusted`, ``param.json`` and ``stat.json`` checked for the types the
sweep writes (a wrong one is one error line naming the file and key), metrics nested at most
:data:`MAX_DEPTH` deep; every cell of the text, CSV and TSV output passes the one sanitizer
(:func:`ssh_scheduler.errors.plain_text`) before it is measured or written.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.results.journal import last_states
from ssh_scheduler.results.sweep_store import JOBS_FOLDER, read_json

__all__ = ["ResultRow", "format_delimited", "format_json", "format_text", "read_results", "table"]

METRICS_FILE = "metrics.json"
MAX_DEPTH = 32
"""Metrics nested deeper than this stay one JSON cell."""


@dataclass(frozen=True, slots=True)
class ResultRow:
    name: str
    index: int
    params: dict[str, Any]
    varying: tuple[str, ...]
    state: str
    metrics: dict[str, Any] = field(default_factory=dict)


def _flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``, in order; deeper than :data:`MAX_DEPTH` a value
    stays whole (no recursion: the JSON parser allows nesting deeper than Python's stack)."""
    flat: dict[str, Any] = {}
    stack = [("", iter(data.items()))]
    while stack:
        prefix, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        name = f"{prefix}{item[0]}"
        if isinstance(item[1], dict) and len(stack) <= MAX_DEPTH:
            stack.append((name + ".", iter(item[1].items())))
        else:
            flat[name] = item[1]
    return flat


def combination_state(param: Mapping[str, Any], stat: Mapping[str, Any], journal: Mapping[str, Mapping[str, Any]]) -> str:
    """``done``, ``failed: CMD (exit N)``, ``running: CMD``, or ``not run: CMD`` (the first
    command without a result)."""
    name = str(param.get("_name"))
    commands = list(param.get("_commands") or {})
    for command in commands:
        entry = stat.get(command) or {}
        code = entry.get("code")
        if code is not None and code != 0:
            return f"failed: {command} (exit {code})"
    for command in commands:
        if (stat.get(command) or {}).get("code") == 0:
            continue
        if journal.get(f"{name}.{command}", {}).get("state") in ("placed", "started"):
            return f"running: {command}"
        return f"not run: {command}"
    return "done"


def _param_problem(param: Mapping[str, Any]) -> str | None:
    """What in a param.json is not of the type the sweep writes, or None."""
    name, index, varying, commands = (param.get(k) for k in ("_name", "_index", "_varying", "_commands"))
    if not isinstance(name, str):
        return f"'_name' must be a name, not {show_value(name, 40)}"
    if index is not None and not (isinstance(index, int) and not isinstance(index, bool)):
        return f"'_index' must be a whole number, not {show_value(index, 40)}"
    if varying is not None and not (isinstance(varying, list) and all(isinstance(v, str) for v in varying)):
        return f"'_varying' must be a list of parameter names, not {show_value(varying, 40)}"
    if commands is not None and not (isinstance(commands, dict) and all(isinstance(v, str) for v in commands.values())):
        return f"'_commands' must map command names to commands, not {show_value(commands, 40)}"
    return None


def _stat_problem(stat: Mapping[str, Any]) -> str | None:
    for command, entry in stat.items():
        if not isinstance(entry, dict):
            return f"{show_value(command, 40)} must be an object, not {show_value(entry, 40)}"
        code = entry.get("code")
        if code is not None and not (isinstance(code, int) and not isinstance(code, bool)):
            return f"{show_value(command, 40)}: 'code' must be an exit status, not {show_value(code, 40)}"
    return None


def _checked(path: Path, problem: Callable[[Mapping[str, Any]], str | None]) -> dict[str, Any]:
    data = read_json(path)
    found = problem(data) if data else None
    if found is not None:
        raise ConfigError(
            f"{plain_text(path)}: {found}; it is not as the sweep wrote it: fix or remove it"
        )
    return data


def _combination_files(results: Path) -> list[dict[str, Path]]:
    """Each combination's files, from real folders and files only (a link is not ours)."""
    found = []
    with os.scandir(results) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                if os.path.lexists(Path(entry.path) / "param.json"):
                    found.append({n: Path(entry.path) / n for n in ("param.json", "stat.json", METRICS_FILE)})
            elif entry.name.endswith(".param.json") and entry.is_file(follow_symlinks=False):  # --no-param-dir
                stem = entry.name[: -len("param.json")]
                found.append({n: results / f"{stem}{n}" for n in ("param.json", "stat.json", METRICS_FILE)})
    return found


def read_results(results: Path) -> list[ResultRow]:
    """Every combination under ``results`` (a sweep's ``--results-dir``), in sweep order."""
    if not results.is_dir():
        raise ConfigError(f"{plain_text(results)} is not a folder (give a sweep's --results-dir)")
    journal = last_states(results / JOBS_FOLDER)
    rows: list[ResultRow] = []
    try:
        combinations = _combination_files(results)
    except OSError as exc:
        raise ConfigError(f"cannot read {plain_text(results)}: {exc.strerror or exc}") from None
    for files in combinations:
        param = read_json(files["param.json"])
        if "_name" not in param:
            continue
        problem = _param_problem(param)
        if problem is not None:
            raise ConfigError(f"{plain_text(files['param.json'])}: {problem}; it is not as the sweep wrote it: fix or remove it")
        params = {k: v for k, v in param.items() if not k.startswith("_")}
        stat = _checked(files["stat.json"], _stat_problem)
        rows.append(ResultRow(
            param["_name"],
            param.get("_index") or 0,
            params,
            tuple(param.get("_varying") or ()),
            combination_state(param, stat, journal),
            _flatten(read_json(files[METRICS_FILE])),
        ))
    if not rows:
        raise ConfigError(f"{plain_text(results)} holds no sweep results (no */param.json)")
    return sorted(rows, key=lambda r: (r.index, r.name))


def _varying_columns(rows: Sequence[ResultRow]) -> list[str]:
    """The parameters the sweep recorded as varying; where none were recorded, those whose
    value differs between rows."""
    recorded = list(dict.fromkeys(k for r in rows for k in r.varying))
    if recorded:
        return recorded
    keys = list(dict.fromkeys(k for r in rows for k in r.params))
    return [k for k in keys if len({json.dumps(r.params.get(k)) for r in rows}) > 1]


def table(rows: Sequence[ResultRow]) -> tuple[list[str], list[list[Any]]]:
    """Columns ``name``, the varying parameters, ``state``, then the metrics in order of first
    appearance (a metric named like a column above becomes ``metrics.<name>``)."""
    params = _varying_columns(rows)
    fixed = ["name", *params, "state"]
    metrics = list(dict.fromkeys(k for r in rows for k in r.metrics))
    shown = [f"metrics.{m}" if m in fixed else m for m in metrics]
    body = [
        [r.name, *(r.params.get(p) for p in params), r.state, *(r.metrics.get(m) for m in metrics)]
        for r in rows
    ]
    return [*fixed, *shown], body


def _cell(value: Any, tabs: bool = False) -> str:
    """A value as the text and CSV/TSV outputs write it, through the one sanitizer."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        try:
            return json.dumps(value)  # escapes every control character itself
        except (ValueError, RecursionError):
            return "(too deep to show)"
    return plain_text(value, tabs=tabs)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def format_text(columns: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    """An aligned table; numbers right-aligned."""
    columns = [plain_text(c) for c in columns]
    cells = [[_cell(v) for v in row] for row in body]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    numeric = [
        bool(body) and all(_is_number(row[i]) or row[i] is None for row in body)
        for i in range(len(columns))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def format_delimited(columns: Sequence[str], body: Sequence[Sequence[Any]], delimiter: str = ",") -> str:
    """CSV (or TSV) that ``csv`` and ``pandas.read_csv`` read back."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, delimiter=delimiter, lineterminator="\n")
    writer.writerow([plain_text(c, tabs=True) for c in columns])
    writer.writerows([_cell(v, tabs=True) for v in row] for row in body)
    return buffer.getvalue().rstrip("\n")


def format_json(columns: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    """A list of records with values as typed (``pandas.read_json(..., orient='records')``)."""
    return json.dumps([dict(zip(columns, row, strict=True)) for row in body], indent=2)
