"""A machine's ``slurm:`` section: the machine is a Slurm login node, and what the planner sees
of it (a queue, :func:`queue_state`).

Pure: what we tell Slurm (``sbatch`` built from a job's needs) and what Slurm answers are
executors/slurm_jobs.py's, next to the Slurm executor that talks to it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines.host_state import HostState

__all__ = ["DEFAULT_MAX_QUEUED", "SLURM_KEYS", "SlurmSettings", "parse_slurm_section", "queue_state"]

DEFAULT_MAX_QUEUED = 32
SLURM_KEYS: dict[str, str] = {
    "partition": "the partition to submit to (sbatch --partition)",
    "account": "the account to charge (sbatch --account)",
    "qos": "the quality of service (sbatch --qos)",
    "time_limit": "the time limit of every job when --timeout is not given, like 2:00:00 (sbatch --time)",
    "sbatch_args": "more sbatch arguments, like ['--constraint=a100']",
    "max_queued": f"most jobs submitted at once, default {DEFAULT_MAX_QUEUED}",
    "command_prefix": "a shell line run before every Slurm command, like 'module load slurm'",
    "poll_interval": "seconds between two status queries, default 2",
    "arrays": "false to submit every job with its own sbatch, default true (jobs submitted together that ask for the same go in one sbatch --array)",
}


@dataclass(frozen=True, slots=True)
class SlurmSettings:
    """A machine YAML's ``slurm:`` section: the machine is a Slurm login node."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = None
    sbatch_args: tuple[str, ...] = ()
    max_queued: int = DEFAULT_MAX_QUEUED
    command_prefix: str | None = None
    poll_interval: float = 2.0
    arrays: bool = True


def parse_slurm_section(value: object, at: str) -> SlurmSettings:
    """Check a ``slurm:`` section; every error is one line with the fix."""
    if value is None or value is True:
        return SlurmSettings()
    if not isinstance(value, dict):
        raise ConfigError(
            f"{at}: 'slurm' must be a mapping like {{partition: gpu, max_queued: 64}}, got {value!r}"
        )
    unknown = sorted(str(k) for k in value if k not in SLURM_KEYS)
    if unknown:
        raise ConfigError(
            f"{at}: unknown key 'slurm.{unknown[0]}'; the slurm keys are: {', '.join(SLURM_KEYS)}"
        )

    def text(key: str) -> str | None:
        raw = value.get(key)
        if raw is None:
            return None
        if (
            not isinstance(raw, str | int)
            or isinstance(raw, bool)
            or not str(raw).strip()
            or "\n" in str(raw)
        ):
            raise ConfigError(
                f"{at}: 'slurm.{key}' must be one line of text ({SLURM_KEYS[key]}), got {raw!r}"
            )
        return str(raw)

    raw_args = value.get("sbatch_args", ())
    if isinstance(raw_args, str):
        raw_args = shlex.split(raw_args)
    if not isinstance(raw_args, list | tuple) or not all(
        isinstance(a, str) and a.startswith("-") for a in raw_args
    ):
        raise ConfigError(
            f"{at}: 'slurm.sbatch_args' must be a list of sbatch options like ['--constraint=a100'], got {raw_args!r}"
        )
    max_queued = value.get("max_queued", DEFAULT_MAX_QUEUED)
    if (
        isinstance(max_queued, bool)
        or not isinstance(max_queued, int)
        or not 1 <= max_queued <= 100_000
    ):
        raise ConfigError(
            f"{at}: 'slurm.max_queued' must be a whole number from 1 to 100000, got {max_queued!r}"
        )
    interval = value.get("poll_interval", 2.0)
    if (
        isinstance(interval, bool)
        or not isinstance(interval, int | float)
        or not 0.1 <= interval <= 600
    ):
        raise ConfigError(
            f"{at}: 'slurm.poll_interval' must be a number of seconds from 0.1 to 600, got {interval!r}"
        )
    arrays = value.get("arrays", True)
    if not isinstance(arrays, bool):
        raise ConfigError(f"{at}: 'slurm.arrays' must be true or false, got {arrays!r}")
    return SlurmSettings(
        arrays=arrays,
        partition=text("partition"),
        account=text("account"),
        qos=text("qos"),
        time_limit=text("time_limit"),
        sbatch_args=tuple(raw_args),
        max_queued=max_queued,
        command_prefix=text("command_prefix"),
        poll_interval=float(interval),
    )


def queue_state(settings: SlurmSettings) -> HostState:
    """What the planner sees of a Slurm machine: a queue of ``max_queued`` slots and no
    resources of its own to place on (Slurm places jobs, sets their GPUs, and refuses at
    submission what could never run)."""
    slots = settings.max_queued
    return HostState(
        cpu_count=slots, load_1m=0.0, mem_total_mb=0, mem_available_mb=0, job_slots=slots
    )
