"""``ssh-scheduler results DIR``: one row per combination of a sweep (pure file reading/formatting).

A row holds the combination's name, the parameters that vary across the sweep, its state, and
every metric its commands wrote to ``metrics.json`` in the combination's folder (nested objects
flattened to ``a.b`` columns).  Output: an aligned table, or CSV/TSV/JSON records for pandas
(``pd.read_csv``, ``pd.read_json``).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import ConfigError, plain_text
from ssh_scheduler.results.journal import last_states
from ssh_scheduler.results.sweep_store import JOBS_FOLDER, read_json

__all__ = ["ResultRow", "format_delimited", "format_json", "format_text", "read_results", "table"]

METRICS_FILE = "metrics.json"


@dataclass(frozen=True, slots=True)
class ResultRow:
    name: str
    index: int
    params: dict[str, Any]
    varying: tuple[str, ...]
    state: str
    metrics: dict[str, Any] = field(default_factory=dict)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
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


def read_results(results: Path) -> list[ResultRow]:
    """Every combination under ``results`` (a sweep's ``--results-dir``), in sweep order."""
    if not results.is_dir():
        raise ConfigError(f"{plain_text(str(results))} is not a folder (give a sweep's --results-dir)")
    journal = last_states(results / JOBS_FOLDER)
    rows: list[ResultRow] = []
    for entry in sorted(results.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and (entry / "param.json").is_file():
            files = {n: entry / n for n in ("param.json", "stat.json", METRICS_FILE)}
        elif entry.name.endswith(".param.json") and entry.is_file():  # --no-param-dir
            stem = entry.name[: -len("param.json")]
            files = {n: results / f"{stem}{n}" for n in ("param.json", "stat.json", METRICS_FILE)}
        else:
            continue
        param = read_json(files["param.json"])
        if "_name" not in param:
            continue
        params = {k: v for k, v in param.items() if not k.startswith("_")}
        stat = read_json(files["stat.json"])
        rows.append(ResultRow(
            str(param["_name"]),
            int(param.get("_index") or 0),
            params,
            tuple(param.get("_varying") or ()),
            combination_state(param, stat, journal),
            _flatten(read_json(files[METRICS_FILE])),
        ))
    if not rows:
        raise ConfigError(f"{plain_text(str(results))} holds no sweep results (no */param.json)")
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


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def format_text(columns: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    """An aligned table; numbers right-aligned."""
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
    writer.writerow(columns)
    writer.writerows([_cell(v) for v in row] for row in body)
    return buffer.getvalue().rstrip("\n")


def format_json(columns: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    """A list of records with values as typed (``pandas.read_json(..., orient='records')``)."""
    return json.dumps([dict(zip(columns, row, strict=True)) for row in body], indent=2)
