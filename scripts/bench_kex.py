#!/usr/bin/env python3
"""Which key exchange and cipher ssh_scheduler negotiates with a host, and the OpenSSH options
that make every OpenSSH peer of the benchmark negotiate the same.

A login's cost is mostly its key exchange: OpenSSH 9.x prefers the post-quantum
``sntrup761x25519-sha512`` (about 0.24 s of client CPU per login here), asyncssh without liboqs
settles on ``curve25519-sha256`` (about 0.025 s).  A peer left on its default pays ten times our
handshake, and a ratio against it measures the algorithm, not the tool.  So the benchmark asks
both sides what they actually negotiate with the test hosts and pins the peers to ours:

    bench_kex.py MACHINE_YAML           # ours: connect as ssh_scheduler does, print one JSON line
                                        # {"kex": ..., "cipher": ..., "mac": ...}

``matched(...)`` (used by the driver and bench_slurm.py) runs that in the measured code's
environment, then ``ssh -v`` with the pinning options, and reports both sides; the asyncssh
floors take ``add_pinning``'s options and connect with ``asyncssh_options``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def add_pinning(ap: argparse.ArgumentParser) -> None:
    """The floors' --kex and --cipher options (the driver passes ours)."""
    ap.add_argument("--kex", help="the one key exchange to offer (the benchmark passes ours)")
    ap.add_argument("--cipher", help="the one cipher to offer (the benchmark passes ours)")


def asyncssh_options(args: argparse.Namespace) -> dict[str, Any]:
    """A floor's asyncssh.connect options: the test key and known_hosts (strict), no ssh
    config or agent, and the algorithms --kex and --cipher pin."""
    options: dict[str, Any] = {
        "client_keys": [args.key],
        "known_hosts": args.known_hosts,
        "config": None,
        "agent_path": None,
    }
    if args.kex:
        options["kex_algs"] = [args.kex]
    if args.cipher:
        options["encryption_algs"] = [args.cipher]
    return options


def openssh_options(kex: str, cipher: str) -> list[str]:
    """The OpenSSH options that pin a peer to our key exchange and cipher."""
    return ["-o", f"KexAlgorithms={kex}", "-o", f"Ciphers={cipher}"]


def openssh_negotiated(ssh_argv: Sequence[str]) -> dict[str, str]:
    """What a plain ``ssh`` (``ssh_argv``: the client, its options, user@host; ``-v`` and the
    command are added) negotiates, from its debug lines; empty values when it could not say."""
    argv = [*ssh_argv[:-1], "-v", "-o", "LogLevel=DEBUG1", ssh_argv[-1], "true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"kex": "", "cipher": "", "error": str(exc)}
    kex = re.search(r"kex: algorithm: (\S+)", done.stderr)
    cipher = re.search(r"kex: client->server cipher: (\S+) MAC: (\S+)", done.stderr)
    found = {"kex": kex.group(1) if kex else "", "cipher": cipher.group(1) if cipher else ""}
    if done.returncode != 0:
        found["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    return found


def ours_negotiated(python: str, machine_yaml: str, env: dict[str, str]) -> dict[str, str]:
    """What ssh_scheduler negotiates with the host of ``machine_yaml``: this file run as a
    script by the measured code's interpreter and environment (--ref puts its package first)."""
    done = subprocess.run(
        [python, __file__, machine_yaml], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    try:
        found: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"kex": "", "cipher": "", "error": (done.stderr.strip() or f"exit {done.returncode}")[-300:]}
    return found


def matched(python: str, machine_yaml: str, env: dict[str, str], ssh_argv: Sequence[str]) -> dict[str, Any]:
    """Ours, then OpenSSH pinned to ours, checked: ``{"kex", "cipher", "ours", "openssh",
    "options", "same"}``.  ``options`` is what to give every OpenSSH peer (empty when ours could
    not be read: the peers then keep their defaults, and ``same`` is False)."""
    ours = ours_negotiated(python, machine_yaml, env)
    kex, cipher = ours.get("kex", ""), ours.get("cipher", "")
    options = openssh_options(kex, cipher) if kex and cipher else []
    theirs = openssh_negotiated([*ssh_argv[:-1], *options, ssh_argv[-1]])
    return {
        "kex": kex,
        "cipher": cipher,
        "ours": ours,
        "openssh": theirs,
        "options": options,
        "same": bool(kex) and (theirs.get("kex"), theirs.get("cipher")) == (kex, cipher),
    }


async def negotiate(machine_yaml: str) -> dict[str, str]:
    """Connect to the host exactly as ssh_scheduler's SSH transport does, noting the key exchange
    asyncssh picks (its kex factory sees the name) and the cipher it settled on."""
    import asyncssh.connection

    from ssh_scheduler.machines.config import load_machine
    from ssh_scheduler.transport.ssh import SSHTransport

    chosen: list[bytes] = []
    make_kex = asyncssh.connection.get_kex

    def noted(conn: Any, alg: bytes) -> Any:
        chosen.append(alg)
        return make_kex(conn, alg)

    asyncssh.connection.get_kex = noted  # type: ignore[assignment]
    transport = await SSHTransport.connect(load_machine(machine_yaml))
    try:
        conn = transport.conn
        return {
            "kex": chosen[0].decode() if chosen else "",
            "cipher": bytes(getattr(conn, "_enc_alg_cs", b"") or b"").decode(),
            "mac": bytes(getattr(conn, "_mac_alg_cs", b"") or b"").decode(),
        }
    finally:
        await transport.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(negotiate(sys.argv[1]))))
