"""``execute_remote``: one job on one machine, output streamed live, exit status passed through."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .config import Machine
from .errors import BatchError, TransferError, TransportError
from .runner import DEFAULT_LEASE, HostSession
from .transfer import CopyLimits, Hasher, HostCache, collect_forward, fetch_back, send_forward
from .transport import connect


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    copy_forwards: tuple[str, ...] = (".",)
    copy_backwards: tuple[str, ...] | None = None
    job_name: str | None = None
    results_dir: Path = Path("job_results")
    base_dir: Path = Path(".")
    accept_new: bool = False
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES to set; None leaves it alone
    lease: float = DEFAULT_LEASE
    limits: CopyLimits = CopyLimits()


def default_job_name(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"remote.{stamp}.{secrets.token_hex(2)}"


async def execute_remote(
    machine: Machine,
    command: str,
    options: RemoteOptions = RemoteOptions(),
    *,
    stdout: Sequence[int] = (1,),
    stderr: Sequence[int] = (2,),
) -> int:
    """Run ``command`` on ``machine``; returns its exit status (128+n when killed by signal n).

    Output goes live to the given file descriptors and to ``job_results/<job>.out``/``.err``.
    """
    if "\x00" in command:
        raise BatchError("the command contains a NUL byte; remove it")
    name = options.job_name or default_job_name()
    results = options.results_dir
    final = results / name
    if final.exists():
        raise TransferError(f"{final} already exists; results are never overwritten (choose another --job-name)")
    forward = await asyncio.to_thread(collect_forward, options.copy_forwards, options.base_dir, Hasher())
    results.mkdir(parents=True, exist_ok=True)
    transport = await connect(machine, accept_new=options.accept_new)
    try:
        async with HostSession(transport, lease=options.lease) as session:
            jobdir = f"{session.root}/jobs/{secrets.token_hex(4)}-{name}"
            await send_forward(HostCache(session), forward, jobdir)
            env = {"SSH_SCHEDULER_JOB": name}
            if options.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = options.gpus
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
            files = {1: os.open(results / f"{name}.out", flags, 0o644), 2: os.open(results / f"{name}.err", flags, 0o644)}
            sinks = {1: [*stdout, files[1]], 2: [*stderr, files[2]]}

            def on_output(fd: int, data: bytes) -> None:
                for target in sinks[fd]:
                    os.write(target, data)

            try:
                ended = await session.run(
                    name, command, cwd=jobdir, env=env, out_path=None, err_path=None, on_output=on_output,
                    max_output=options.limits.max_output_bytes,
                )
            finally:
                for fd in files.values():
                    os.close(fd)
            if ended.host_lost:
                raise TransportError(f"{machine.name}: connection lost while the job ran: {ended.message}")
            report = await fetch_back(session, jobdir, final, paths=options.copy_backwards, limits=options.limits)
            for warning in report.warnings:
                print(f"warning: {warning}", file=sys.stderr)
            await session.remove(jobdir)
            return ended.code if ended.code is not None else 255
    finally:
        await transport.close()
