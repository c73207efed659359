#!/usr/bin/env python3
"""The fan-out floor for execute_to: the least a tool could do with asyncssh to run one command
on many hosts and print what each said.

Connects to every host at once (host keys verified against the given known_hosts; ``--kex`` and
``--cipher`` pin the algorithms to ours), runs the
command on each over one channel, prints ``host: line`` for every line of output as execute_to
does, and exits with 0 when every host exited 0.  Measured as a whole process (interpreter
start and ``import asyncssh`` included), like execute_to.

    bench_fanout.py COMMAND --key KEY --known-hosts FILE [--kex K --cipher C] NAME=USER@IP[:PORT]...
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import asyncssh
from bench_kex import add_pinning, asyncssh_options


async def one(name: str, spec: str, command: str, options: dict[str, Any]) -> int:
    user, _, hostport = spec.rpartition("@")
    host, _, port = hostport.partition(":")
    async with asyncssh.connect(host, port=int(port or 22), username=user, **options) as conn:
        result = await conn.run(command, check=False)
    for line in str(result.stdout or "").splitlines():
        print(f"{name}: {line}")
    for line in str(result.stderr or "").splitlines():
        print(f"{name}: {line}", file=sys.stderr)
    return result.exit_status if result.exit_status is not None else 255


async def main_async(args: argparse.Namespace) -> int:
    hosts = [h.partition("=")[::2] for h in args.hosts]
    options = asyncssh_options(args)
    codes = await asyncio.gather(*(one(name, spec, args.command, options) for name, spec in hosts))
    return 0 if all(c == 0 for c in codes) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command")
    ap.add_argument("hosts", nargs="+", help="NAME=USER@IP[:PORT]")
    ap.add_argument("--key", required=True)
    ap.add_argument("--known-hosts", required=True)
    add_pinning(ap)
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
