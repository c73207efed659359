"""The JSON result of a run (schema 1): the environment, the clusters, every tool's runs and
statistics, the targets, each scenario's computed values and notes, and the table's lines;
saved as bench/results/<UTC time>-<git sha>[-quick].json and latest.json."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_driver.base import RESULTS_DIR
from bench_driver.records import Scenario, Target


def result_text(
    *,
    started_utc: dt.datetime,
    total_s: float,
    quick: bool,
    rounds: int,
    wanted: list[str],
    env: dict[str, Any],
    cluster_info: dict[str, Any],
    errors: dict[str, str],
    done: Sequence[Scenario],
    target_map: dict[str, list[Target]],
    table: str,
) -> str:
    result = {
        "schema": 1,
        "started_utc": started_utc.isoformat(timespec="seconds"),
        "total_s": round(total_s, 1),
        "mode": "quick" if quick else "full",
        "rounds": rounds,
        "scenarios_requested": wanted,
        "environment": env,
        "cluster": cluster_info,
        "errors": errors,
        "scenarios": {
            s.sid: {
                "title": s.title,
                "params": s.params,
                "tools": {t.name: t.stats() for t in s.tools},
                "targets": [t.to_json() for t in target_map.get(s.sid, [])],
                "computed": s.computed,
                "notes": s.notes,
            }
            for s in done
        },
        "table": table.splitlines(),
    }
    return json.dumps(result, indent=1, default=str) + "\n"


def save(text: str, started_utc: dt.datetime, git_sha: str, quick: bool) -> Path:
    """Write the result file and latest.json; returns the result file."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = f"{started_utc:%Y-%m-%dT%H%M%SZ}-{git_sha}{'-quick' if quick else ''}.json"
    (RESULTS_DIR / name).write_text(text)
    (RESULTS_DIR / "latest.json").write_text(text)
    return RESULTS_DIR / name
