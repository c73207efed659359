"""Slurm, the pure part: a machine's ``slurm:`` settings, the ``sbatch`` call built from a job's
needs, the one status-and-output query per interval, and reading Slurm's answers.

No I/O here (``executor_slurm`` performs it over the login node's agent), so every rule is
tested against outputs captured from a real Slurm (tests/data/slurm/).

Jobs are named ``sshs-<batch token>-<job>``: a rerun of the batch (same token) finds the jobs an
earlier coordinator submitted in ``squeue`` and follows them instead of submitting them again.
"""

from __future__ import annotations

import base64
import json
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.probe import HostState

__all__ = [
    "DONE_STATES",
    "WAITING_STATES",
    "JobStatus",
    "PollReply",
    "SlurmSettings",
    "batch_script",
    "job_name",
    "parse_poll_reply",
    "parse_scontrol",
    "parse_slurm_section",
    "parse_squeue",
    "poll_command",
    "prefixed",
    "queue_state",
    "sbatch_argv",
    "scancel_command",
    "status_of",
    "submit_command",
]

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

# Slurm's job states (squeue %T, scontrol JobState, sacct State) by what they mean to us.
WAITING_STATES = frozenset(
    {
        "PENDING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "CONFIGURING",
        "SUSPENDED",
        "RESV_DEL_HOLD",
        "RESIZING",
    }
)
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"})
DONE_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "NODE_FAIL",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)
TIMED_OUT = 124  # as events.TIMED_OUT (timeout(1)'s code); kept here so this module stays leaf
CANCELLED_CODE = 128 + 15  # scancel sends SIGTERM first
READ_CHUNK = 1 << 20
"""Bytes of one output file brought home per query (a job writing faster catches up later)."""


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


# -- submitting ------------------------------------------------------------------------------


def job_name(token: str, job: str) -> str:
    return f"sshs-{token}-{job}"


def sbatch_argv(
    settings: SlurmSettings, *, name: str, jobdir: str, needs: Needs, timeout: float | None
) -> list[str]:
    """``sbatch`` and its options for one job; the script comes on stdin."""
    argv = [
        "sbatch", "--parsable", f"--job-name={name}", f"--chdir={jobdir}",
        # append: a job Slurm requeues (its node died) continues the same files, which we keep
        # streaming from where we were
        f"--output={jobdir}.out", f"--error={jobdir}.err", "--open-mode=append",
    ]  # fmt: skip
    for option, setting in (
        ("partition", settings.partition),
        ("account", settings.account),
        ("qos", settings.qos),
    ):
        if setting is not None:
            argv.append(f"--{option}={setting}")
    if needs.gpus > 0:
        argv.append(f"--gres=gpu:{needs.gpus}")
    if needs.cpus > 0:
        argv.append(f"--cpus-per-task={max(1, math.ceil(needs.cpus))}")
    if needs.memory_mb > 0:
        argv.append(f"--mem={needs.memory_mb}M")
    if needs.reserve_machine:
        argv.append("--exclusive")
    if timeout is not None:  # Slurm counts whole minutes; our own --timeout still kills on time
        argv.append(f"--time={max(1, math.ceil(timeout / 60))}")
    elif settings.time_limit is not None:
        argv.append(f"--time={settings.time_limit}")
    argv += settings.sbatch_args
    return argv


def batch_script(command: str, env: Mapping[str, str], *, gpus: int) -> str:
    """The batch script: the job's environment, then its command in ``bash --norc`` as on an
    SSH host.  Slurm sets CUDA_VISIBLE_DEVICES for a GPU job; one without GPUs sees none."""
    lines = ["#!/bin/sh", "# an ssh_scheduler job"]
    for key, value in env.items():
        if key == "CUDA_VISIBLE_DEVICES" and gpus > 0:
            continue
        lines.append(f"export {key}={shlex.quote(value)}")
    lines.append(f"exec /bin/bash --norc -c {shlex.quote(command)}")
    return "\n".join(lines) + "\n"


def prefixed(settings: SlurmSettings, command: str) -> str:
    return f"{settings.command_prefix}\n{command}" if settings.command_prefix else command


def submit_command(settings: SlurmSettings, argv: Sequence[str], script: str) -> str:
    """One shell line: the script on sbatch's stdin (no file to write first); stderr joins
    stdout so a refusal reaches the user."""
    return prefixed(settings, f"printf '%s' {shlex.quote(script)} | {shlex.join(argv)} 2>&1")


def scancel_command(settings: SlurmSettings, ids: Sequence[str]) -> str:
    return prefixed(settings, f"scancel {' '.join(shlex.quote(i) for i in ids)} 2>&1")


def parse_submitted(text: str) -> str | None:
    """The job id ``sbatch --parsable`` printed (``id`` or ``id;cluster``), or None."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    job_id = lines[-1].split(";")[0]
    return job_id if job_id.isdigit() else None


# -- following -------------------------------------------------------------------------------

# Runs on the login node (python3 is there: our agent needs it).  One run answers for every job
# of ours on the machine: squeue for their states; for those of ``follow`` that ended (or that
# squeue no longer shows), scontrol -- else sacct -- for the exit code; and the new bytes of each
# job's output files.
_POLL_SCRIPT = r"""
import base64, json, subprocess, sys
req = json.loads(sys.argv[1])
def run(argv):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout + p.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
rc, out = run(["squeue", "--me", "-r", "-t", "all", "-h", "-o", "%i|%j|%T|%r"])
states = dict((l.split("|")[0], l.split("|")[2]) for l in out.splitlines() if l.count("|") == 3)
detail = {}
for i in req["follow"] if rc == 0 else []:
    if states.get(i, "GONE").split(" ")[0] not in req["done"] and i in states:
        continue
    drc, text = run(["scontrol", "-o", "show", "job", i])
    if drc != 0:
        drc, text = run(["sacct", "-P", "-n", "-X", "-o", "JobID,State,ExitCode", "-j", i])
        text = "sacct " + text
    detail[i] = text
data = {}
for job, rest, at_out, at_err in req["jobs"]:
    for fd, suffix, offset in ((1, ".out", at_out), (2, ".err", at_err)):
        try:
            with open(req["base"] + rest + suffix, "rb") as f:
                f.seek(offset)
                chunk = f.read(req["chunk"])
        except OSError:
            continue
        if chunk:
            data.setdefault(job, {})[fd] = base64.b64encode(chunk).decode()
print(json.dumps({"rc": rc, "squeue": out, "detail": detail, "data": data}))
"""


def _common_start(texts: Sequence[str]) -> str:
    """The longest start every text shares (characters, not path parts: job folders differ
    after ``<token>-``)."""
    if not texts:
        return ""
    first, last = min(texts), max(texts)
    n = 0
    while n < len(first) and first[n] == last[n]:
        n += 1
    return first[:n]


def poll_command(
    settings: SlurmSettings, follow: Sequence[str], outputs: Mapping[str, tuple[str, int, int]]
) -> str:
    """The one query per interval: the Slurm ids we ``follow`` (the exit code of those that
    ended comes back too), and per job its folder and the bytes of its ``.out``/``.err``
    already home (what follows comes back).  Kept compact (the folders' common start is sent
    once): it travels as one argument of ``sh -c``, which Linux caps at 128 KiB."""
    base = _common_start([folder for folder, _out, _err in outputs.values()])
    jobs = [[job, folder[len(base) :], out, err] for job, (folder, out, err) in outputs.items()]
    request = json.dumps(
        {
            "follow": list(follow),
            "done": sorted(DONE_STATES),
            "base": base,
            "jobs": jobs,
            "chunk": READ_CHUNK,
        },
        separators=(",", ":"),
    )
    return prefixed(settings, f"python3 -c {shlex.quote(_POLL_SCRIPT)} {shlex.quote(request)}")


@dataclass(frozen=True, slots=True)
class QueueEntry:
    job_id: str
    name: str
    state: str
    reason: str


@dataclass(slots=True)
class PollReply:
    squeue_ok: bool
    squeue_text: str
    queue: dict[str, QueueEntry] = field(default_factory=dict)
    detail: dict[str, str] = field(default_factory=dict)
    data: dict[str, dict[int, bytes]] = field(default_factory=dict)
    """job -> fd (1, 2) -> the new bytes of its output."""


def parse_squeue(text: str) -> dict[str, QueueEntry]:
    """``squeue -h -o '%i|%j|%T|%r'`` lines by job id (array tasks are ``A_T``)."""
    entries: dict[str, QueueEntry] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[0]:
            continue
        job_id, name, state, reason = parts
        entries[job_id] = QueueEntry(job_id, name, state.split()[0] if state else state, reason)
    return entries


def parse_poll_reply(text: str) -> PollReply:
    """What :data:`_POLL_SCRIPT` printed; raises ValueError on anything else."""
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError(f"no answer from the status query: {text.strip()[-300:]!r}")
    raw = json.loads(lines[-1])
    reply = PollReply(squeue_ok=raw["rc"] == 0, squeue_text=str(raw["squeue"]))
    if reply.squeue_ok:
        reply.queue = parse_squeue(reply.squeue_text)
    reply.detail = {str(k): str(v) for k, v in raw["detail"].items()}
    reply.data = {
        str(job): {int(fd): base64.b64decode(chunk) for fd, chunk in fds.items()}
        for job, fds in raw["data"].items()
    }
    return reply


def parse_scontrol(text: str) -> dict[str, str]:
    """The fields of one ``scontrol -o show job`` line (values never hold spaces with -o,
    except the last fields, which we do not read)."""
    for line in text.splitlines():
        if line.startswith("JobId="):
            return dict(item.partition("=")[::2] for item in line.split())
    return {}


@dataclass(frozen=True, slots=True)
class JobStatus:
    """Where a Slurm job stands: ``code`` is set once it ended (``message`` says how when it
    is not plain success or failure)."""

    state: str
    waiting: bool = False
    running: bool = False
    done: bool = False
    code: int | None = None
    message: str | None = None


def _exit_code(value: str) -> int:
    """Slurm's ``ExitCode=rc:signal`` as a shell would report it."""
    rc, _, sig = value.partition(":")
    if sig.isdigit() and int(sig) > 0:
        return 128 + int(sig)
    return int(rc) if rc.isdigit() else 1


def status_of(state: str, exit_code: str | None = None, reason: str = "") -> JobStatus:
    """A Slurm state (and, once ended, its ``ExitCode``) as what it means for the job."""
    state = state.split()[0] if state.strip() else "UNKNOWN"
    if state in WAITING_STATES:
        return JobStatus(state, waiting=True)
    if state in RUNNING_STATES:
        return JobStatus(state, running=True)
    if state == "COMPLETED":
        return JobStatus(state, done=True, code=0)
    if state == "FAILED":
        code = _exit_code(exit_code) if exit_code else 1
        why = None if reason in ("", "None", "NonZeroExitCode") else f"Slurm: {reason}"
        return JobStatus(state, done=True, code=code or 1, message=why)
    if state in ("TIMEOUT", "DEADLINE"):
        return JobStatus(
            state, done=True, code=TIMED_OUT, message=f"Slurm ended it at its time limit ({state})"
        )
    if state == "CANCELLED":
        return JobStatus(
            state, done=True, code=CANCELLED_CODE, message="cancelled in Slurm (scancel)"
        )
    if state == "OUT_OF_MEMORY":
        return JobStatus(
            state,
            done=True,
            code=_exit_code(exit_code or "0:9") or 137,
            message="Slurm: out of memory (raise --memory-required)",
        )
    if state in DONE_STATES:  # NODE_FAIL without requeue, BOOT_FAIL, PREEMPTED...
        return JobStatus(
            state,
            done=True,
            code=_exit_code(exit_code) if exit_code else 1,
            message=f"Slurm: {state}",
        )
    return JobStatus(state, waiting=True)


def final_status(detail: str) -> JobStatus | None:
    """The end of a job from ``scontrol -o show job`` (or the ``sacct -P`` fallback), or None
    when neither knows it."""
    if detail.startswith("sacct "):
        for line in detail[6:].splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0] and not parts[0].endswith((".batch", ".extern")):
                return status_of(parts[1], parts[2])
        return None
    fields = parse_scontrol(detail)
    if not fields.get("JobState"):
        return None
    return status_of(fields["JobState"], fields.get("ExitCode"), fields.get("Reason", ""))
