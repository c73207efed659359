#!/usr/bin/env python3
"""The agent floor: what ssh_scheduler's design (one connection and one agent per host, jobs
sent to the agent as lines) can cost at best.

One asyncssh connection per host (host keys verified; ``--kex``/``--cipher`` pin the algorithms
to ours), one channel on it running the minimal stdlib agent of scripts/bench_agent_floor_host.py
(its text on the ``python3 -u -I -S -c`` command line, as ssh_scheduler starts its agent).  Jobs
come from one shared queue; each host keeps ``--per-host`` of them in flight (a new line goes
out as an exit comes back), so a fast host takes more, as the coordinator's slots do.  The agent
spawns each line without a shell and reports its exit status: no placement, no output capture,
no journal, no files.  Measured as a whole process, like execute_batch.

    bench_agent_floor.py BATCH --key KEY --known-hosts FILE [--per-host N] [--kex K --cipher C]
                         USER@IP[:PORT]...

Prints one JSON line: {"jobs": N, "failed": F, "seconds": T, "connect_s": C}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

import asyncssh
from bench_kex import add_pinning, asyncssh_options

HOST_PROGRAM = Path(__file__).with_name("bench_agent_floor_host.py")


async def one_host(
    conn: asyncssh.SSHClientConnection, queue: asyncio.Queue[str], per_host: int, counts: dict[str, int]
) -> None:
    """Start the agent on the host, keep ``per_host`` jobs in flight until the queue is empty,
    then end its stdin and wait for it to exit."""
    command = f"exec python3 -u -I -S -c {shlex.quote(HOST_PROGRAM.read_text())} {per_host}"
    async with conn.create_process(command, encoding=None) as agent:

        def send_next() -> bool:
            try:
                line = queue.get_nowait()
            except asyncio.QueueEmpty:
                return False
            counts["sent"] += 1
            agent.stdin.write(f"{counts['sent']}\t{line}\n".encode())
            return True

        in_flight = sum(send_next() for _ in range(per_host))
        while in_flight:
            answer = await agent.stdout.readline()
            if not answer:
                err = (await agent.stderr.read()).decode(errors="replace").strip()
                raise RuntimeError(f"the agent floor's agent ended early: {err[-300:]}")
            counts["done"] += 1
            counts["failed"] += answer.split()[1] != b"0"
            in_flight += send_next() - 1
        agent.stdin.write_eof()
        await agent.wait()


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
    counts = {"sent": 0, "done": 0, "failed": 0}
    try:
        await asyncio.gather(*(one_host(c, queue, args.per_host, counts) for c in conns))
    finally:
        for conn in conns:
            conn.close()
        await asyncio.gather(*(c.wait_closed() for c in conns))
    return {
        "jobs": counts["done"],
        "failed": counts["failed"],
        "seconds": round(time.perf_counter() - t0, 4),
        "connect_s": round(connect_s, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch")
    ap.add_argument("hosts", nargs="+", help="USER@IP[:PORT]")
    ap.add_argument("--key", required=True)
    ap.add_argument("--known-hosts", required=True)
    ap.add_argument("--per-host", type=int, default=4, help="jobs at once per host (its slots)")
    add_pinning(ap)
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
