#!/usr/bin/env python3
"""Benchmark combine_folders on many small files; prints one JSON line to stdout.

Builds three sources holding ``--files`` small files in all.  A third of each source's files are
byte-identical copies shared by all three (so they are size-compared, hashed and collapsed); the
rest are unique.  Then times ``combine_folders`` (plan and write) into a fresh DEST.

    python scripts/bench_combine.py [--files 100000] [--workdir DIR] [--keep]

Output: {"scenario": "combine_100k", "files": N, "seconds": T, "files_per_s": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ssh_scheduler.results.combine import combine_folders

SOURCES = 3
FILES_PER_DIR = 100


def build_sources(root: Path, files: int) -> list[Path]:
    """Create the sources; returns them.  ``files`` counts every file in every source."""
    sources = [root / f"src{i}" for i in range(SOURCES)]
    shared = files // (SOURCES * 3)  # per source: 1/3 shared ...
    unique = (files - SOURCES * shared) // SOURCES  # ... 2/3 its own
    for index, source in enumerate(sources):
        names = [f"shared/{n // FILES_PER_DIR}/r{n}.txt" for n in range(shared)]
        names += [f"own{index}/{n // FILES_PER_DIR}/r{n}.txt" for n in range(unique)]
        made: set[str] = set()
        for name in names:
            parent = name.rpartition("/")[0]
            if parent not in made:
                (source / parent).mkdir(parents=True, exist_ok=True)
                made.add(parent)
            # Shared files must be identical in every source: content depends on the name only.
            with open(source / name, "w") as handle:
                handle.write(f"result of {name}\n" * 3)
    return sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100_000, help="files in all sources together")
    parser.add_argument("--workdir", type=Path, default=None, help="where to build (default: tmp)")
    parser.add_argument("--keep", action="store_true", help="leave the trees behind")
    args = parser.parse_args(argv)

    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-combine-", dir=args.workdir))
    try:
        sources = build_sources(root, args.files)
        created = sum(len(files) for source in sources for _, _, files in os.walk(source))
        dest = root / "dest"
        # Flush the freshly built trees first, so their writeback does not compete with (and get
        # billed to) the combine being measured.
        os.sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        report = combine_folders(dest, sources, out=lambda line: None)
        seconds = time.perf_counter() - start
        # user+sys of all threads: steadier than wall time on a machine with a noisy disk
        cpu_seconds = time.process_time() - cpu_start
        result = {
            "scenario": "combine_100k",
            "files": created,
            "seconds": round(seconds, 3),
            "cpu_seconds": round(cpu_seconds, 3),
            "files_per_s": round(created / seconds),
            "copied": report.copied,
            "identical": report.identical,
            "skipped": len(report.skipped),
        }
        print(json.dumps(result))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
