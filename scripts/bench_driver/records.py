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
    warm_of: str | None = None  # the cold tool this one repeats right after (cold_then_warm)

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
    """A target judged round by round: ``values`` holds one value per round of the scenario
    (a ratio of two tools' walls in that round, or one tool's wall...), None where a side of
    that round failed.  It is met only if its worst round meets it: a median can hide a round
    that missed, and a skeptic reads the worst."""

    text: str
    row: str  # tool name the target is shown against
    values: list[float | None]
    limit: float
    higher_is_better: bool
    unit: str = ""

    @property
    def known(self) -> list[float]:
        return [v for v in self.values if v is not None]

    @property
    def worst(self) -> float | None:
        known = self.known
        if not known:
            return None
        return min(known) if self.higher_is_better else max(known)

    @property
    def median(self) -> float | None:
        return statistics.median(self.known) if self.known else None

    @property
    def met(self) -> bool | None:
        worst = self.worst
        if worst is None:
            return None
        return worst >= self.limit if self.higher_is_better else worst <= self.limit

    def per_round(self) -> str:
        """``0.91 0.85 -`` (a dash: no value that round)."""
        return " ".join("-" if v is None else fmt_num(v) for v in self.values)

    def shown(self) -> str:
        if self.met is None:
            return "n/a (no successful round)"
        verdict = "yes" if self.met else "NO"
        missing = len(self.values) - len(self.known)
        if missing:
            verdict += f" ({len(self.known)} of {len(self.values)} rounds)"
        if len(self.values) < MIN_ROUNDS:
            verdict += f" (indicative: under {MIN_ROUNDS} rounds)"
        return verdict

    def to_json(self) -> dict[str, Any]:
        def r4(v: float | None) -> float | None:
            return None if v is None else round(v, 4)

        return {
            "target": self.text,
            "row": self.row,
            "per_round": [r4(v) for v in self.values],
            "worst": r4(self.worst),
            "median": r4(self.median),
            "spread": [r4(min(self.known)), r4(max(self.known))] if self.known else None,
            "limit": self.limit,
            "higher_is_better": self.higher_is_better,
            "unit": self.unit,
            "met": self.met,
        }


MIN_ROUNDS = 3
"""Fewer rounds than this judge nothing for sure: the verdict says it is indicative."""


def rounds_of(*tools: Tool) -> list[int]:
    """The rounds any of ``tools`` ran in (failed runs count: a failed round is a round)."""
    return sorted({r.round_no for t in tools for r in t.runs})


def per_round(tool: Tool, value: Callable[[Run], float | None] = lambda r: r.wall,
              rounds: list[int] | None = None) -> list[float | None]:
    """``value`` of the tool's good run in each round (None where it failed or did not run)."""
    good = {r.round_no: r for r in tool.good()}
    return [value(good[n]) if n in good else None for n in (rounds or rounds_of(tool))]


def ratio_per_round(num: Tool, den: Tool) -> list[float | None]:
    """num's wall / den's wall, round by round: the two ran in the same round, back to back,
    under the same load; None where either failed."""
    rounds = rounds_of(num, den)
    a, b = per_round(num, rounds=rounds), per_round(den, rounds=rounds)
    return [x / y if x is not None and y else None for x, y in zip(a, b, strict=True)]


def slower_target(text: str, ours: Tool, peer: Tool, limit: float) -> Target:
    """ours' wall <= limit x peer's, each round (shown against ours' row)."""
    return Target(text, ours.name, ratio_per_round(ours, peer), limit, False, "x")


def faster_target(text: str, ours: Tool, peer: Tool, limit: float) -> Target:
    """ours' jobs/s >= limit x peer's (peer's wall / ours'), each round."""
    return Target(text, ours.name, ratio_per_round(peer, ours), limit, True, "x")


def wall_target(text: str, tool: Tool, limit: float) -> Target:
    """The tool's wall <= limit seconds, each round."""
    return Target(text, tool.name, per_round(tool), limit, False, " s")


@dataclass
class Group:
    """Tools that run back to back in this order (e.g. cold then warm cache); ``setup`` and
    ``teardown`` wrap the group each round (e.g. switch latency on and off)."""

    tools: list[Tool]
    setup: Callable[[], None] = lambda: None
    teardown: Callable[[], None] = lambda: None


def cold_then_warm(cold: Tool, make_cold: Callable[[], int], held: list[int]) -> tuple[Group, Tool]:
    """The same command twice, back to back: ``cold`` after ``make_cold`` ended whatever held
    connections to the hosts (its count goes to ``held``), then the warm call, which reuses
    what the first left (a hub's connections and agents) -- or, while nothing keeps them, is
    simply a second cold call; the report says which from the logins each call made."""
    name = cold.name.replace("cold", "warm (2nd call)", 1) if "cold" in cold.name else cold.name + " warm (2nd call)"
    warm = Tool(name, cold.prepare, cold.verify, cold.jobs, cold.kind, warm_of=cold.name)
    return Group([cold, warm], setup=lambda: held.append(make_cold())), warm


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


def first_job_target(tool: Tool, limit: float = 0.3, what: str = "") -> Target:
    """Launch to the first job running (the journal's first start against the process start),
    each round."""
    starts = per_round(tool, lambda r: r.extra.get("first_job_started_s"))
    return Target(f"launch to first job running{what} <= {limit:g} s", tool.name, starts, limit, False, " s")
