"""Slurm, the pure part of talking to it: the ``sbatch`` call built from a job's needs, the one
status query per interval (a request to the login node's agent), and reading Slurm's answers.

No I/O here (executors/slurm.py performs it over the login node's agent), so every rule is
tested against outputs captured from a real Slurm (tests/data/slurm/).  The machine's own
``slurm:`` settings are machines/slurm.py's.

Jobs are named ``sshs-<batch token>-<job>``: a rerun of the batch (same token) finds the jobs an
earlier coordinator submitted in ``squeue`` and follows them instead of submitting them again.
Nothing we put on a command line grows with the number of jobs: the status query is a request,
ids to cancel are batched (:data:`IDS_PER_LINE`), submissions are cut into chunks
(executors/slurm_submit.py).
"""

from __future__ import annotations

import base64
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.slurm import SlurmSettings

__all__ = [
    "DONE_STATES",
    "WAITING_STATES",
    "JobStatus",
    "PollReply",
    "batch_script",
    "began_marker",
    "final_status",
    "job_name",
    "parse_scontrol",
    "parse_squeue",
    "parse_submitted",
    "poll_reply",
    "prefixed",
    "queue_status",
    "sbatch_argv",
    "scancel_commands",
    "slurm_path",
    "status_of",
    "status_query",
    "submit_command",
]

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
IDS_PER_LINE = 16 * 1024
"""Bytes of job ids on one ``scancel`` line (a command line holds 128 KiB per argument)."""

READ_CHUNK = 1 << 20
"""Bytes of one output file brought home per query (a job writing faster catches up later)."""


def job_name(token: str, job: str) -> str:
    return f"sshs-{token}-{job}"


def slurm_path(path: str) -> str:
    """``path`` as sbatch's ``--output``/``--error`` take it: Slurm expands ``%j``, ``%a``, ``%x``
    and the like in them (a job named ``run%j`` would write elsewhere), and reads ``%%`` as ``%``
    (checked on the real Slurm).  Job names hold no backslash, which would turn expansion off."""
    return path.replace("%", "%%")


def sbatch_argv(
    settings: SlurmSettings, *, name: str, jobdir: str, needs: Needs, timeout: float | None
) -> list[str]:
    """``sbatch`` and its options for one job; the script comes on stdin."""
    argv = [
        "sbatch", "--parsable", f"--job-name={name}", f"--chdir={jobdir}",
        # append: a job Slurm requeues (its node died) continues the same files, which we keep
        # streaming from where we were
        f"--output={slurm_path(jobdir)}.out", f"--error={slurm_path(jobdir)}.err", "--open-mode=append",
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


def began_marker(jobdir: str) -> str:
    """The file a job's batch script makes before anything else: a job Slurm ended without it
    never ran its command (:func:`batch_script`)."""
    return f"{jobdir}.began"


def batch_script(command: str, env: Mapping[str, str], *, gpus: int, jobdir: str) -> str:
    """The batch script: its mark that it began, the job's environment, then its command in
    ``bash --norc`` as on an SSH host.  Slurm sets CUDA_VISIBLE_DEVICES for a GPU job; one
    without GPUs sees none.  No mark, no command: a job whose mark cannot be made stops there."""
    lines = ["#!/bin/sh", "# an ssh_scheduler job", f"true >>{shlex.quote(began_marker(jobdir))} || exit 1"]
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


def scancel_commands(settings: SlurmSettings, ids: Sequence[str]) -> list[str]:
    """``scancel`` of these jobs as shell lines, the ids batched: no line grows past
    :data:`IDS_PER_LINE` however many jobs there are."""
    lines: list[list[str]] = []
    size = 0
    for job_id in ids:
        word = shlex.quote(job_id)
        if not lines or size + len(word) + 1 > IDS_PER_LINE:
            lines.append([])
            size = 0
        lines[-1].append(word)
        size += len(word) + 1
    return [prefixed(settings, f"scancel {' '.join(words)} 2>&1") for words in lines]


def parse_submitted(text: str) -> str | None:
    """The job id ``sbatch --parsable`` printed (``id`` or ``id;cluster``), or None."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    job_id = lines[-1].split(";")[0]
    return job_id if job_id.isdigit() else None


# -- following -------------------------------------------------------------------------------


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


def status_query(
    settings: SlurmSettings, follow: Sequence[str], outputs: Mapping[str, tuple[str, int, int]]
) -> P.SlurmQuery:
    """The one query per interval, a request to the login node's agent (agent/slurm.py): the
    Slurm ids we ``follow`` (how those that ended ended comes back too), and per job its folder
    and the bytes of its ``.out``/``.err`` already home (what follows comes back).  The folders'
    common start is sent once."""
    base = _common_start([folder for folder, _out, _err in outputs.values()])
    return P.SlurmQuery(
        prefix=settings.command_prefix,
        follow=list(follow),
        done=sorted(DONE_STATES),
        base=base,
        outputs=[
            P.OutputAt(job=job, rest=folder[len(base) :], out=out, err=err)
            for job, (folder, out, err) in outputs.items()
        ],
        chunk=READ_CHUNK,
    )


@dataclass(frozen=True, slots=True)
class QueueEntry:
    job_id: str
    name: str
    state: str
    reason: str
    wait_status: str = ""
    """How it ended as wait(2) tells it (squeue's ``exit_code``), once it has."""


@dataclass(slots=True)
class PollReply:
    squeue_ok: bool
    squeue_text: str
    queue: dict[str, QueueEntry] = field(default_factory=dict)
    detail: dict[str, str] = field(default_factory=dict)
    data: dict[str, dict[int, bytes]] = field(default_factory=dict)
    """job -> fd (1, 2) -> the new bytes of its output."""
    more: frozenset[str] = frozenset()
    """Jobs whose new output did not fit the reply: it comes with the next."""


def parse_squeue(text: str) -> dict[str, QueueEntry]:
    """The agent's ``squeue`` lines (``id|name|state|reason|wait status``) by job id (array
    tasks are ``A_T``).  The name is the only free text: a ``|`` in it stays in it."""
    entries: dict[str, QueueEntry] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 5 or not parts[0]:
            continue
        job_id, name, (state, reason, wait_status) = parts[0], "|".join(parts[1:-3]), parts[-3:]
        entries[job_id] = QueueEntry(
            job_id, name, state.split()[0] if state else state, reason, wait_status
        )
    return entries


def poll_reply(answer: P.SlurmReply) -> PollReply:
    """What the agent answered to :func:`status_query`; raises ValueError on output that is
    not base64 or not of stdout or stderr."""
    reply = PollReply(squeue_ok=answer.rc == 0, squeue_text=answer.squeue)
    if reply.squeue_ok:
        reply.queue = parse_squeue(reply.squeue_text)
    reply.detail = dict(answer.detail)
    reply.more = frozenset(answer.more)
    for chunk in answer.data:
        if chunk.fd not in (1, 2):
            raise ValueError(f"output of job {chunk.job!r} on fd {chunk.fd}")
        reply.data.setdefault(chunk.job, {})[chunk.fd] = base64.b64decode(chunk.data, validate=True)
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
        # Slurm ended it before its command did: never a success, whatever ExitCode says (a
        # node that failed leaves 0:0)
        return JobStatus(
            state,
            done=True,
            code=(_exit_code(exit_code) if exit_code else 1) or 1,
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


def queue_status(entry: QueueEntry) -> JobStatus:
    """Where a job squeue lists stands.  One that ended is told whole by its wait status (the
    status query asks scontrol or sacct only of the others); without one (an ``exit_code``
    squeue did not fill) its code is as :func:`status_of` guesses it from the state alone."""
    status = entry.wait_status
    code = f"{(int(status) >> 8) & 0xFF}:{int(status) & 0x7F}" if status.isdigit() else None
    return status_of(entry.state, code, entry.reason)
