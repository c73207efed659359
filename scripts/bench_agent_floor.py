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

import asyncio
import shlex
import sys
from pathlib import Path

import asyncssh
from bench_floor_common import floor_main

HOST_PROGRAM = Path(__file__).with_name("bench_agent_floor_host.py")


async def one_host(conn: asyncssh.SSHClientConnection, queue: asyncio.Queue[str], per_host: int) -> tuple[int, int]:
    """Start the agent on the host, keep ``per_host`` jobs in flight until the queue is empty,
    then end its stdin and wait for it to exit; (done, failed)."""
    counts = {"sent": 0, "done": 0, "failed": 0}
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
    return counts["done"], counts["failed"]


if __name__ == "__main__":
    sys.exit(floor_main(__doc__.splitlines()[0], "jobs at once per host (its slots)", one_host))
