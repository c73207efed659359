#!/usr/bin/env python3
"""README.md's benchmark table, made from one stored result (bench/results/*.json).

    bench_readme.py bench/results/RESULT.json   # rewrite the table between the markers from it
    bench_readme.py --check                     # is the table what its named result makes?

The table sits between two marker lines in README.md; the first names the result file it was
made from, so the numbers a reader sees can be traced to the run (and the commit) that measured
them.  Only a full run of a commit can be the README's: a quick run, one with fewer than 3
rounds, or one of a working tree with uncommitted package changes is refused.
tests/test_bench_readme.py checks that the README's table is what this makes of the result it
names.  Standard library only; imports nothing of the driver.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from bench_driver.records import fmt_num
from bench_driver.report import disk_words

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN = re.compile(r"^<!-- bench-table: (\S+) .*-->$", re.M)
END = "<!-- /bench-table -->"
MIN_ROUNDS = 3


class Refused(Exception):
    """What is wrong with a result or the README, in one line."""


def refusal(result: dict[str, Any]) -> str | None:
    """Why ``result`` cannot be the README's (None: it can)."""
    if result.get("schema") != 2:
        return f"schema {result.get('schema')}: made before results named the commit they measured (need schema 2)"
    if result.get("mode") != "full":
        return "a quick run (smaller sizes, 1 round): run scripts/bench without --quick"
    if result.get("rounds", 0) < MIN_ROUNDS:
        return f"{result.get('rounds')} round(s): a verdict needs at least {MIN_ROUNDS}"
    if not result.get("measured_commit"):
        return f"it measured {result.get('measured')}: commit the package, then run scripts/bench again"
    return None


def fmt(x: float | None) -> str:
    """A stored value as the driver's own table writes it (``-``: no value that round)."""
    return "-" if x is None else fmt_num(x)


def worst(target: dict[str, Any]) -> float | None:
    """The target's worst round, read again from its rounds (not from the stored verdict)."""
    known = [v for v in target["per_round"] if v is not None]
    if not known:
        return None
    return min(known) if target["higher_is_better"] else max(known)


def verdict(target: dict[str, Any]) -> str:
    """Met only if the worst round meets the limit."""
    bad = worst(target)
    if bad is None:
        return "n/a (no successful round)"
    met = bad >= target["limit"] if target["higher_is_better"] else bad <= target["limit"]
    known = sum(v is not None for v in target["per_round"])
    shown = "yes" if met else "**NO**"
    return shown + (f" ({known} of {len(target['per_round'])} rounds)" if known < len(target["per_round"]) else "")


def cell(text: str) -> str:
    """Text in a Markdown table cell: a '|' would end the cell."""
    return text.replace("|", "\\|")


WARM = "warm (2nd call)"


def warm_lines(result: dict[str, Any]) -> list[str]:
    """What each warm row measured, from the SSH logins the hosts saw: a warm call that logged
    in as often as its cold call reused nothing (no hub kept a connection): a second cold call."""
    lines = []
    for sid, scenario in result["scenarios"].items():
        tools = scenario["tools"]
        for wname, warm in tools.items():
            if WARM not in wname:
                continue
            cname = wname.replace(WARM, "cold", 1) if wname.replace(WARM, "cold", 1) in tools else wname.replace(" " + WARM, "", 1)
            if cname not in tools:
                continue
            logins = [r["ssh_logins"] for r in warm["runs"] if r.get("ok") and "ssh_logins" in r]
            cold = [r["ssh_logins"] for r in tools[cname]["runs"] if r.get("ok") and "ssh_logins" in r]
            if not logins or not cold:
                continue
            what = ("a second cold call: it logged in as often as the cold one (nothing kept its connections)"
                    if min(logins) >= min(cold) else "it reused connections the cold call left")  # fmt: skip
            lines.append(f"- {sid}, {wname}: SSH logins per call {logins} (cold {cold}): {what}.")
    return lines


def render(result: dict[str, Any], name: str) -> str:
    """The README's block for ``result`` (stored at ``name``, relative to the repository),
    markers included."""
    env = result["environment"]
    match = env.get("ssh_match") or {}
    kex = (f"key exchange `{match['kex']}`, cipher `{match['cipher']}` on every side (ours; every OpenSSH "
           "peer and floor pinned to it)" if match.get("same") else "key exchange NOT matched")  # fmt: skip
    lines = [
        f"<!-- bench-table: {name} (made by scripts/bench_readme.py from that file; do not edit by hand) -->",
        f"Measured: {result['measured']}, {result['started_utc'].replace('T', ' ')[:16]} UTC; "
        f"{result['rounds']} rounds for every tool; {env['cores']} cores ({env['cpu_model']}), "
        f"load average {env['loadavg_start'][0]} at the start, {env['loadavg_end'][0]} at the end "
        f"(the machine is shared); {kex}"
        + (f"; the runs and the hosts on {disk_words(env['disk'])}." if env.get("disk") else "."),
        "A target holds only if its worst round does; \"per round\" is its value in each round "
        "(for a ratio: the two tools' walls measured back to back in that round).",
        "",
        "| scenario | measured | target | per round | worst | met? |",
        "|---|---|---|---|---|---|",
    ]
    for sid, scenario in result["scenarios"].items():
        for t in scenario["targets"]:
            per_round = " ".join(fmt(v) for v in t["per_round"])
            bad = worst(t)
            shown = "-" if bad is None else fmt(bad) + t["unit"]
            lines.append(f"| {sid} | {cell(t['row'])} | {cell(t['target'])} | {per_round} | {shown} | {verdict(t)} |")
    for sid, why in result.get("errors", {}).items():
        lines.append(f"| {sid} | (did not run) | {cell(why)} | - | - | n/a |")
    warm = warm_lines(result)
    if warm:
        lines += ["", "What the warm rows measured:", *warm]
    lines.append(END)
    return "\n".join(lines)


def table_span(text: str) -> tuple[int, int, str]:
    """(start, end, the result it names) of the README's block."""
    begin = BEGIN.search(text)
    end = text.find(END)
    if begin is None or end < 0 or end < begin.start():
        raise Refused(f"README.md: no '<!-- bench-table: FILE ... -->' ... '{END}' lines; put them in its Benchmark section")
    return begin.start(), end + len(END), begin.group(1)


def load(name: str, root: Path = REPO) -> dict[str, Any]:
    path = root / name
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Refused(f"{name}: cannot read it as a result ({exc}); name a file under bench/results/") from None
    why = refusal(result)
    if why is not None:
        raise Refused(f"{name}: not fit for the README: {why}")
    return result


def rewrite(readme: Path, name: str, root: Path = REPO) -> None:
    text = readme.read_text()
    start, end, _old = table_span(text)
    readme.write_text(text[:start] + render(load(name, root), name) + text[end:])


def check(readme: Path, root: Path = REPO) -> str | None:
    """None when the README's table is what its named result makes; else what differs."""
    text = readme.read_text()
    start, end, name = table_span(text)
    if text[start:end] != render(load(name, root), name):
        return f"{readme.name}: its benchmark table is not what {name} makes: run scripts/bench_readme.py {name}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", nargs="?", help="the result file (bench/results/...json) to make the table from")
    ap.add_argument("--check", action="store_true", help="only check the table against the result it names")
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args()
    try:
        if args.check:
            wrong = check(args.readme)
            if wrong:
                print(f"bench_readme: {wrong}", file=sys.stderr)
                return 1
            return 0
        if not args.result:
            ap.error("name a result file, or --check")
        path = Path(args.result).resolve()
        if not path.is_relative_to(REPO):
            raise Refused(f"{args.result}: not in this repository; store it under bench/results/ and commit it")
        rewrite(args.readme, str(path.relative_to(REPO)))
    except Refused as exc:
        print(f"bench_readme: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
