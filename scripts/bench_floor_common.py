"""What the benchmark's two floors share (scripts/bench_floor.py, scripts/bench_agent_floor.py):
their command line, the batch as one queue every host takes from, one SSH connection per host on
the pinned algorithms, and the JSON line they print.  Only how a host runs its jobs differs."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncssh
from bench_kex import add_pinning, asyncssh_options

RunHost = Callable[[asyncssh.SSHClientConnection, "asyncio.Queue[str]", int], Awaitable[tuple[int, int]]]
"""Run jobs from the queue on one host with ``per_host`` at once; return (done, failed)."""


async def run_floor(args: argparse.Namespace, run_host: RunHost) -> dict[str, float | int]:
    t0 = time.perf_counter()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for line in Path(args.batch).read_text().splitlines():
        if line.strip():
            queue.put_nowait(line)
    targets = []
    for spec in args.hosts:
        user, _, hostport = spec.rpartition("@")
        host, _, port = hostport.partition(":")
        targets.append((user, host, int(port or 22)))
    options = asyncssh_options(args)
    conns = await asyncio.gather(
        *(asyncssh.connect(host, port=port, username=user, **options) for user, host, port in targets)
    )
    connect_s = time.perf_counter() - t0
    try:
        counts = await asyncio.gather(*(run_host(c, queue, args.per_host) for c in conns))
    finally:
        for conn in conns:
            conn.close()
        await asyncio.gather(*(c.wait_closed() for c in conns))
    return {
        "jobs": sum(done for done, _ in counts),
        "failed": sum(failed for _, failed in counts),
        "seconds": round(time.perf_counter() - t0, 4),
        "connect_s": round(connect_s, 4),
    }


def floor_main(description: str, per_host_help: str, run_host: RunHost) -> int:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("batch")
    ap.add_argument("hosts", nargs="+", help="USER@IP[:PORT]")
    ap.add_argument("--key", required=True)
    ap.add_argument("--known-hosts", required=True)
    ap.add_argument("--per-host", type=int, default=4, help=per_host_help)
    add_pinning(ap)
    args = ap.parse_args()
    result = asyncio.run(run_floor(args, run_host))
    print(json.dumps(result))
    return 1 if result["failed"] else 0
