"""The results table: scenario | tool | median wall | min-max | jobs/s | ratio vs ssh_scheduler |
target | met?, one row per tool (and per further target), a rule between scenarios."""

from __future__ import annotations

from collections.abc import Sequence

from bench_driver.records import Scenario, Target, fmt_num


def render_table(scenarios: Sequence[Scenario], target_map: dict[str, list[Target]]) -> str:
    header = [
        "scenario",
        "tool",
        "median wall s",
        "min–max",  # noqa: RUF001 (the asked-for header)
        "jobs/s",
        "ratio vs ssh_scheduler",
        "target",
        "met?",
    ]
    rows: list[list[str]] = []
    rows_sid: list[tuple[str, list[str]]] = []
    for s in scenarios:
        ref = next((t for t in s.tools if t.kind == "ssh_scheduler"), None)
        ref_med = ref.median() if ref else None
        for tool in s.tools:
            med = tool.median()
            good = tool.good()
            tgs = [t for t in target_map.get(s.sid, []) if t.row == tool.name]
            if med is None:
                cells = ["FAILED" if tool.runs else "not run", "", "", ""]
            else:
                walls = [r.wall for r in good]
                ratio = f"{med / ref_med:.2f}" if ref_med else ""
                cells = [
                    f"{med:.3f}",
                    f"{min(walls):.3f}–{max(walls):.3f}",  # noqa: RUF001
                    fmt_num(tool.jobs / med) if tool.jobs else "",
                    ratio,
                ]
            failed = len(tool.runs) - len(good)
            name = tool.name + (
                f" [{failed} failed run{'s' if failed > 1 else ''}]" if failed else ""
            )
            first = True
            shown: list[Target | None] = [*tgs] or [None]
            for tg in shown:
                rows.append(
                    [s.sid, name if first else "", *(cells if first else ["", "", "", ""]),
                     tg.text if tg else "", tg.shown() if tg else ""]
                )  # fmt: skip
                rows_sid.append((s.sid, rows[-1]))
                first = False
    widths = [
        max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
        for i in range(len(header))
    ]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(
            c.ljust(w) if i in (0, 1, 6, 7) else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(header), "-+-".join("-" * w for w in widths)]
    prev = None
    for sid, r in rows_sid:
        if prev is not None and sid != prev:
            out.append("-+-".join("-" * w for w in widths))
        out.append(line(r))
        prev = sid
    return "\n".join(out)
