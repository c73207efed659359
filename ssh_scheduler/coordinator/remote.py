"""``execute_remote``: one job on one machine, output streamed live, exit status passed through.

A thin caller of the per-job pipeline (:mod:`ssh_scheduler.coordinator.jobrun`): the job gets what a batch
job gets (environment, staging in the run request, output kept on the host, ``--timeout``,
results brought home atomically, its folder removed, also when cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ssh_scheduler.coordinator.jobrun import JobRun, OutputFiles, job_environment
from ssh_scheduler.errors import BatchError, ConfigError, TransferError, TransportError
from ssh_scheduler.executors.base import RunRequest, ShellCommand
from ssh_scheduler.executors.host import open_executor
from ssh_scheduler.executors.session import DEFAULT_LEASE
from ssh_scheduler.executors.transfer import CopyLimits
from ssh_scheduler.jobs.forward import ForwardSet, Hasher, collect_forward
from ssh_scheduler.jobs.hash_memo import HashMemo
from ssh_scheduler.jobs.hash_memo import default_path as default_memo_path
from ssh_scheduler.machines.machine import Machine

__all__ = ["RemoteOptions", "default_job_name", "execute_remote"]

log = logging.getLogger(__name__)


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
    timeout: float | None = None
    """Seconds the command may run; then its whole process tree is killed (exit 124)."""


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
    warn: Callable[[str], None] | None = None,
) -> int:
    """Run ``command`` on ``machine``; returns its exit status (128+n when killed by signal n,
    124 when ``timeout`` killed it).

    Output goes live to the given file descriptors and to ``job_results/<job>.out``/``.err``.
    Copy-back warnings go to ``warn``, or are logged (logger ``ssh_scheduler.coordinator.remote``).
    """
    if "\x00" in command:
        raise BatchError("the command contains a NUL byte; remove it")
    if options.timeout is not None and not options.timeout > 0:
        raise ConfigError(f"--timeout must be more than 0 seconds, not {options.timeout:g}")
    name = options.job_name or default_job_name()
    results = options.results_dir
    final = results / name
    if final.exists() or final.is_symlink():
        raise TransferError(f"{final} already exists; results are never overwritten (choose another --job-name)")
    hasher = Hasher(HashMemo(default_memo_path()))
    forward = await asyncio.to_thread(collect_forward, options.copy_forwards, options.base_dir, hasher)
    saving = asyncio.ensure_future(asyncio.to_thread(hasher.save))  # beside the connection
    try:
        return await _run(machine, command, options, name, forward, stdout, stderr, warn)
    finally:
        await saving


async def _run(
    machine: Machine,
    command: str,
    options: RemoteOptions,
    name: str,
    forward: ForwardSet,
    stdout: Sequence[int],
    stderr: Sequence[int],
    warn: Callable[[str], None] | None,
) -> int:
    results = options.results_dir
    results.mkdir(parents=True, exist_ok=True)
    executor = await open_executor(machine, accept_new=options.accept_new, lease=options.lease)
    try:
        request = RunRequest(
            name=name,
            work=ShellCommand(command),
            jobdir=executor.jobdir(secrets.token_hex(4), name),
            env=job_environment(name, options.gpus),
            timeout=options.timeout,
            forward=forward,
            copy_backwards=options.copy_backwards,
            limits=options.limits,
        )
        output = OutputFiles(results, name, mirror={1: list(stdout), 2: list(stderr)})
        output.open()
        run = JobRun(executor, request, output, results)
        try:
            ended = await run.run()
        finally:
            output.close()
        if ended.host_lost:
            raise TransportError(f"{machine.name}: connection lost while the job ran: {ended.message}")
        if output.complete() is not None:  # its output is not all here: nothing is removed there
            raise TransferError(f"{output.failure}; its output and results stay on the host, at {run.kept_at}")
        committed = await run.commit()
        if committed.problem is not None:
            raise TransferError(f"copy back failed: {committed.problem}; the results stay on the host, at {committed.kept_at}")
        report = committed.report
        assert report is not None
        for warning in report.warnings:
            if warn is not None:
                warn(warning)
            else:
                log.warning("%s", warning)
        return ended.code if ended.code is not None else 255
    finally:
        await executor.close()
