#!/usr/bin/env python3
"""The benchmark's exec floor: the least a scheduler could do with asyncssh and no agent.

One SSH connection per host (host keys verified against the given known_hosts; ``--kex`` and
``--cipher`` pin the algorithms to ours), then every host runs its share of the batch with
``conn.run`` in a loop -- ``--per-host`` loops at once on each connection (one channel each,
below sshd's MaxSessions).  Each job is a channel of its own and a login shell running the line
(more work on the host than our agent's spawn: a bar to clear, not a floor under our design;
scripts/bench_agent_floor.py is that).  Jobs are handed out from one shared queue, so a fast
host takes more.  No placement, no file transfer, no results on disk.

    bench_floor.py BATCH --key KEY --known-hosts FILE [--per-host N] [--kex K --cipher C]
                   USER@IP[:PORT]...

Prints one JSON line: {"jobs": N, "failed": F, "seconds": T, "connect_s": C}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import asyncssh
from bench_kex import add_pinning, asyncssh_options


async def main_async(args: argparse.Namespace) -> dict[str, float | int]:
    t0 = time.perf_counter()
    commands = [line for line in Path(args.batch).read_text().splitlines() if line.strip()]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for command in commands:
        queue.put_nowait(command)
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
    failed = 0

    async def worker(conn: asyncssh.SSHClientConnection) -> None:
        nonlocal failed
        while True:
            try:
                command = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            result = await conn.run(command, check=False)
            if result.exit_status != 0:
                failed += 1

    await asyncio.gather(*(worker(c) for c in conns for _ in range(args.per_host)))
    for conn in conns:
        conn.close()
    await asyncio.gather(*(c.wait_closed() for c in conns))
    return {
        "jobs": len(commands),
        "failed": failed,
        "seconds": round(time.perf_counter() - t0, 4),
        "connect_s": round(connect_s, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch")
    ap.add_argument("hosts", nargs="+", help="USER@IP[:PORT]")
    ap.add_argument("--key", required=True)
    ap.add_argument("--known-hosts", required=True)
    ap.add_argument("--per-host", type=int, default=4, help="channels at once per connection")
    add_pinning(ap)
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
