"""A Python call's inputs on a host: the call runner, cloudpickle's own sources and the pickled
call, staged into the job's folder beside the job's copy forward.

They travel like any input, through the host's content-addressed cache
(:class:`~ssh_scheduler.executors.transfer.HostCache`): the runner and cloudpickle reach a host
once (and not at all when an earlier batch sent the same bytes), each call's pickle once, and
every call's folder gets hard links.  So a host needs nothing installed but a Python: where its
Python has no cloudpickle (or another version of it), the runner uses the one it was sent with,
the same as the coordinator's.  Everything lands under ``.ssh_scheduler_call/`` (see
:mod:`ssh_scheduler.jobs.python_call`); a copy-forward entry there would be linked over ours, so
it is left out.  A shell command's inputs are its copy forward alone.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import assert_never

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.errors import ConfigError
from ssh_scheduler.executors.base import RunRequest, ShellCommand, python_word
from ssh_scheduler.executors.stage_plan import StagePlan
from ssh_scheduler.executors.transfer import HostCache
from ssh_scheduler.jobs.forward import LocalFile
from ssh_scheduler.jobs.python_call import (
    CALL_FOLDER,
    CLOUDPICKLE_FOLDER,
    INFO,
    PAYLOAD,
    RESULT,
    RUNNER,
    WARM_RUNNER,
    PythonCall,
)
from ssh_scheduler.transport.bootstrap import AGENT_FOLDER

__all__ = ["call_files", "runner_files", "warm_interpreter", "work_inputs"]


def _local_file(rel: str, path: Path) -> LocalFile:
    data = path.read_bytes()
    return LocalFile(rel, path, f"{hashlib.sha256(data).hexdigest()}-r", len(data))


@functools.cache
def runner_files() -> tuple[LocalFile, ...]:
    """The runner (``agent/call_runner.py``) and cloudpickle's sources (the package this
    coordinator imports), hashed once: what every call's folder gets besides its pickle."""
    spec = importlib.util.find_spec("cloudpickle")  # its files, without importing it here
    if spec is None or spec.origin is None:
        raise ConfigError("cloudpickle is not installed here; fix: pip install cloudpickle")
    package = Path(spec.origin).parent
    sources = sorted(name for name in os.listdir(package) if name.endswith(".py"))
    return (
        _local_file(RUNNER, AGENT_FOLDER / "call_runner.py"),
        _local_file(WARM_RUNNER, AGENT_FOLDER / "call_warm.py"),
        *(_local_file(f"{CLOUDPICKLE_FOLDER}/cloudpickle/{name}", package / name) for name in sources),
    )


def _ours(rel: str) -> bool:
    return rel == CALL_FOLDER or rel.startswith(CALL_FOLDER + "/")


def call_files(request: RunRequest) -> tuple[LocalFile, ...]:
    """The inputs the job's work brings besides its copy forward: none for a shell command; for
    a Python call, the runner, cloudpickle and the call's pickle."""
    work = request.work
    match work:
        case ShellCommand():
            return ()
        case PythonCall():
            return (*runner_files(), LocalFile(PAYLOAD, work.path, work.key, work.size))
    assert_never(work)


async def work_inputs(cache: HostCache, request: RunRequest) -> StagePlan | None:
    """What the job's folder gets before its work runs (with the run request, or staged on a
    Slurm cluster's shared filesystem): its copy forward (``request.staged``) and, for a Python
    call, the runner, cloudpickle and the call's pickle, now in the host's cache."""
    work = request.work
    match work:
        case ShellCommand():
            return request.staged
        case PythonCall():
            files = call_files(request)
            await cache.ensure(files)
            staged = request.staged or StagePlan([], [])
            return StagePlan(
                [(rel, key) for rel, key in staged.files if not _ours(rel)] + [(f.rel, f.key) for f in files],
                [d for d in staged.dirs if not _ours(d)],
            )
    assert_never(work)


def warm_interpreter(request: RunRequest, python: str, machine_env: dict[str, str]) -> P.Warm | None:
    """How the host's agent may fork a Python call from an interpreter it keeps loaded
    (agent/warm.py) instead of starting the machine's Python for it: the same runner, started
    once with ``--serve`` (the hash of the runner and cloudpickle tells them apart) in the machine's environment.
    None for a shell command, and where the machine has ``setup:`` lines: they run in each job's
    own shell, before its Python, with the job's own environment (its GPUs among it), which an
    interpreter started once could not honour."""
    if not isinstance(request.work, PythonCall) or request.setup:
        return None
    # Its key: the runner's files, cloudpickle's among them (the interpreter loads that once).
    key = hashlib.sha256("\0".join(f.key for f in runner_files()).encode()).hexdigest()[:16]
    return P.Warm(
        start=f"exec {python_word(python)} -B -u {RUNNER} --serve {key}",
        env=dict(machine_env),
        argv=[PAYLOAD, RESULT, INFO],
    )
