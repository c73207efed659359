"""The results table: scenario | tool | median wall | min-max | jobs/s | target | per round |
worst | met?, one row per tool (and per further target), a rule between scenarios.  A target's
row shows its value in every round (a ratio of two tools measured back to back in that round),
and its verdict is its worst round's."""

from __future__ import annotations

from collections.abc import Sequence

from bench_driver.records import Scenario, Target, fmt_num

HEADER = [
    "scenario",
    "tool",
    "median wall s",
    "min–max",  # noqa: RUF001 (the asked-for header)
    "jobs/s",
    "target",
    "per round",
    "worst",
    "met?",
]
LEFT = (0, 1, 5, 8)  # columns aligned left; the numbers align right


def render_table(scenarios: Sequence[Scenario], target_map: dict[str, list[Target]]) -> str:
    rows_sid: list[tuple[str, list[str]]] = []
    for s in scenarios:
        for tool in s.tools:
            med = tool.median()
            good = tool.good()
            tgs = [t for t in target_map.get(s.sid, []) if t.row == tool.name]
            if med is None:
                cells = ["FAILED" if tool.runs else "not run", "", ""]
            else:
                walls = [r.wall for r in good]
                cells = [
                    f"{med:.3f}",
                    f"{min(walls):.3f}–{max(walls):.3f}",  # noqa: RUF001
                    fmt_num(tool.jobs / med) if tool.jobs else "",
                ]
            failed = len(tool.runs) - len(good)
            name = tool.name + (f" [{failed} failed run{'s' if failed > 1 else ''}]" if failed else "")
            shown: list[Target | None] = [*tgs] or [None]
            for i, tg in enumerate(shown):
                target_cells = (
                    [tg.text, tg.per_round(), fmt_num(tg.worst) + tg.unit if tg.worst is not None else "", tg.shown()]
                    if tg
                    else ["", "", "", ""]
                )
                row = [s.sid, name, *cells] if i == 0 else [s.sid, "", "", "", ""]
                rows_sid.append((s.sid, row + target_cells))
    rows = [r for _sid, r in rows_sid]
    widths = [max(len(HEADER[i]), *(len(r[i]) for r in rows)) if rows else len(HEADER[i]) for i in range(len(HEADER))]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(
            c.ljust(w) if i in LEFT else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    out = [line(HEADER), rule]
    prev = None
    for sid, r in rows_sid:
        if prev is not None and sid != prev:
            out.append(rule)
        out.append(line(r))
        prev = sid
    return "\n".join(out)
