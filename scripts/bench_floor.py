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

import asyncio
import sys

import asyncssh
from bench_floor_common import floor_main


async def run_host(conn: asyncssh.SSHClientConnection, queue: asyncio.Queue[str], per_host: int) -> tuple[int, int]:
    """``per_host`` loops on the connection, each running the queue's next line as ``conn.run``."""
    done = failed = 0

    async def worker() -> None:
        nonlocal done, failed
        while True:
            try:
                command = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            result = await conn.run(command, check=False)
            done += 1
            failed += result.exit_status != 0

    await asyncio.gather(*(worker() for _ in range(per_host)))
    return done, failed


if __name__ == "__main__":
    sys.exit(floor_main(__doc__.splitlines()[0], "channels at once per connection", run_host))
