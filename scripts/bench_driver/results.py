"""The JSON result of a run (schema 2): what was measured (a commit, or a working tree that is
not one), the environment, the clusters, every tool's runs (each with its round) and
statistics, the targets with their value in every round, each scenario's computed values and
notes, and the table's lines; saved as bench/results/<UTC time>-<label>[-quick].json, the label
being the measured commit, or ``<sha>-dirty`` when the package had uncommitted changes.
(No latest.json: a result names the code it measured, and the README names the result its
table was made from.)"""

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
        "schema": 2,
        "measured": env["measured"],
        "label": env["label"],
        # the commit whose package was measured; None when it was not one (uncommitted changes)
        "measured_commit": None if env["label"].endswith("-dirty") else env["git_sha"],
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


def save(text: str, started_utc: dt.datetime, label: str, quick: bool) -> Path:
    """Write the result file; returns it."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = f"{started_utc:%Y-%m-%dT%H%M%SZ}-{label}{'-quick' if quick else ''}.json"
    (RESULTS_DIR / name).write_text(text)
    return RESULTS_DIR / name
