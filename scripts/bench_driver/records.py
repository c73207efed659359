"""What a scenario is made of: the tools it measures (with their runs and statistics), the
targets it reports against, the groups that run back to back, and the scenario itself."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_driver.measure import Cmd, Run

SSH_TOOL = "ssh_scheduler"


@dataclass
class Tool:
    """One command measured in a scenario.  ``prepare`` makes a fresh working directory's
    command; ``verify`` checks the run's output (sets run.ok/note/extra)."""

    name: str
    prepare: Callable[[Path], Cmd]
    verify: Callable[[Cmd, Run], None] = lambda cmd, run: None
    jobs: int = 0
    kind: str = "peer"  # "ssh_scheduler" | "peer" | "floor" | "info"
    runs: list[Run] = field(default_factory=list)
    profile_argv: Callable[[Cmd, Path, str], list[str]] | None = None

    def good(self) -> list[Run]:
        return [r for r in self.runs if r.ok]

    def median(self) -> float | None:
        good = self.good()
        return statistics.median(r.wall for r in good) if good else None

    def stats(self) -> dict[str, Any]:
        good = self.good()
        d: dict[str, Any] = {
            "kind": self.kind,
            "jobs": self.jobs,
            "runs": [r.to_json() for r in self.runs],
        }
        if good:
            walls = [r.wall for r in good]
            med = statistics.median(walls)
            d.update(
                median_wall_s=round(med, 4),
                min_wall_s=round(min(walls), 4),
                max_wall_s=round(max(walls), 4),
                median_client_cpu_s=round(statistics.median(r.cpu_s for r in good), 3),
                median_hosts_cpu_s=round(statistics.median(r.hosts_cpu_s for r in good), 3),
                max_peak_rss_mb=round(max(r.maxrss_mb for r in good), 1),
            )
            if self.jobs:
                d["jobs_per_s"] = round(self.jobs / med, 1)
                # The per-job CPU budget on both sides (start-up included), so a regression shows
                # as a number even when the shared machine's walls are noisy.
                d["client_ms_per_job"] = round(d["median_client_cpu_s"] / self.jobs * 1000, 3)
                d["hosts_ms_per_job"] = round(d["median_hosts_cpu_s"] / self.jobs * 1000, 3)
        d["failed_runs"] = len(self.runs) - len(good)
        return d


@dataclass
class Target:
    text: str
    row: str  # tool name the target is shown against
    value: float | None
    limit: float
    higher_is_better: bool
    unit: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.limit if self.higher_is_better else self.value <= self.limit

    def shown(self) -> str:
        if self.value is None:
            return "n/a (no successful run)"
        verdict = "yes" if self.met else "NO"
        return f"{verdict} ({fmt_num(self.value)}{self.unit})"

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.text,
            "row": self.row,
            "value": None if self.value is None else round(self.value, 4),
            "limit": self.limit,
            "unit": self.unit,
            "met": self.met,
        }


@dataclass
class Group:
    """Tools that run back to back in this order (e.g. cold then warm cache); ``setup`` and
    ``teardown`` wrap the group each round (e.g. switch latency on and off)."""

    tools: list[Tool]
    setup: Callable[[], None] = lambda: None
    teardown: Callable[[], None] = lambda: None


@dataclass
class Scenario:
    sid: str
    title: str
    groups: list[Group]
    params: dict[str, Any] = field(default_factory=dict)
    targets: Callable[[Scenario], list[Target]] = lambda s: []
    notes: list[str] = field(default_factory=list)
    prepare: Callable[[], None] = lambda: None
    finish: Callable[[], None] = lambda: None
    computed: dict[str, Any] = field(default_factory=dict)
    rounds: int | None = None  # overrides --rounds (e.g. the combine benchmark)
    # Scenario-specific lines of the report, under the title: before the CPU lines every scenario
    # gets, and after them.
    report_first: Callable[[Scenario], list[str]] = lambda s: []
    report_last: Callable[[Scenario], list[str]] = lambda s: []

    @property
    def tools(self) -> list[Tool]:
        return [t for g in self.groups for t in g.tools]

    def tool(self, name: str) -> Tool:
        for t in self.tools:
            if t.name == name:
                return t
        raise KeyError(name)


def fmt_num(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def first_job_target(tool: Tool) -> Target:
    """Launch to the first job running (the journal's first start against the process start)."""
    starts = [
        r.extra["first_job_started_s"] for r in tool.good() if "first_job_started_s" in r.extra
    ]
    median = statistics.median(starts) if starts else None
    return Target("launch to first job running <= 0.3 s", tool.name, median, 0.3, False, " s")
