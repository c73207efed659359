#!/usr/bin/env python3
"""Summarise a py-spy ``--format raw`` profile (collapsed stacks): where the samples went.

    bench_profile.py PROFILE.raw [--top 25] [--match ssh_scheduler]

Prints the total samples, then the frames matching ``--match`` by inclusive share (the frame is
somewhere on the stack), then all frames by self share (the frame is the leaf).  Frames read
``function (file:line)`` as py-spy writes them; with ``--idle`` profiles, time waiting in the event
loop's select() shows up as its own leaf.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

LINE_IN_FRAME = re.compile(r":\d+\)$")


def short(frame: str) -> str:
    """``run (/x/y/site-packages/asyncssh/conn.py:12)`` -> ``run (asyncssh/conn.py:12)``."""
    m = re.match(r"^(.*) \((.*)\)$", frame)
    if not m:
        return frame
    func, where = m.groups()
    for marker in ("site-packages/", "/lib/python3.11/", "/ssh_scheduler/", "/scripts/"):
        if marker in where:
            prefix = "ssh_scheduler/" if marker == "/ssh_scheduler/" else ""
            where = prefix + where.split(marker, 1)[1]
            break
    return f"{func} ({where})"


def summarise(path: Path, top: int, match: str, all_threads: bool = False) -> str:
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [short(f) for f in stack.split(";")]
        if not all_threads and frames and frames[0].startswith("Thread._bootstrap (threading"):
            continue  # a worker thread (asyncio.to_thread pool): mostly parked, not the loop
        total += count
        # py-spy's first frame is the thread ("process 123:...", "thread (0x..)"): skip non-code frames.
        frames = [f for f in frames if "(" in f]
        for f in set(frames):
            inclusive[f] += count
        if frames:
            leaf[frames[-1]] += count
    out = [f"{path.name}: {total} samples ({'all threads' if all_threads else 'main thread'})"]
    if not total:
        return out[0]
    out.append(f"  frames containing {match!r}, by inclusive share:")
    for f, c in [(f, c) for f, c in inclusive.most_common() if match in f][:top]:
        out.append(f"    {100 * c / total:5.1f}%  {f}")
    out.append("  leaf frames (self time):")
    for f, c in leaf.most_common(top):
        out.append(f"    {100 * c / total:5.1f}%  {f}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--match", default="ssh_scheduler/")
    ap.add_argument(
        "--all-threads",
        action="store_true",
        help="also count worker threads (default: main thread only)",
    )
    args = ap.parse_args()
    print(summarise(args.profile, args.top, args.match, args.all_threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
