"""The agent's ``slurm`` request: where this user's Slurm jobs stand, asked on the login node.

One request answers for every job of ours on the machine (executors/slurm.py sends one per
interval): ``squeue`` for their states and, for those that ended, their exit status (squeue's
``exit_code``: nothing more to ask of a job it still lists); for the followed jobs squeue no
longer shows, ONE ``scontrol -o show job`` -- of that job alone when only one, else of every
job slurmctld knows, filtered here -- instead of one per job (each is an RPC that Slurm's
``sdiag`` counts); ``sacct`` for those scontrol no longer knows, their ids batched so no
argument grows with the number of jobs; and the new bytes of each job's output files.

Runs on the login node's python3 (3.8 or newer) as part of the agent: standard library only,
no 3.9+ syntax; the annotations are strings, checked by mypy, never evaluated there.
"""

from __future__ import annotations

import base64
import os
import stat

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import rooted as R

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Awaitable, Callable, Dict, List, Optional, Tuple

    Runner = Callable[[List[str]], Awaitable[Tuple[int, str]]]
    """Runs a command (argv, no shell): its exit status and its output, stderr after stdout."""

SQUEUE = [
    "squeue", "--me", "-r", "-t", "all", "-h",
    # ":0": no field cut to a width; the name is the only free text (it may hold "|")
    "-O", "JobArrayID:0|,Name:0|,State:0|,Reason:0|,exit_code:0",
]  # fmt: skip
"""``id|name|state|reason|wait status``: a job that ended is told whole by its line (the status
as wait(2) gives it, the same ``ExitCode`` scontrol shows as ``rc:signal``), however many end."""
SQUEUE_PLAIN = ["squeue", "--me", "-r", "-t", "all", "-h", "-o", "%i|%j|%T|%r|"]
"""The same lines with no wait status, for a squeue that refuses :data:`SQUEUE` (one without
``exit_code``): the jobs that ended are then asked of scontrol, never left waiting."""
SCONTROL = ["scontrol", "-o", "show", "job"]
SACCT = ["sacct", "-P", "-n", "-X", "-o", "JobID,State,ExitCode", "-j"]
IDS_PER_ARGUMENT = 16 * 1024
"""Bytes of job ids in one ``sacct -j`` argument (a command line holds 128 KiB per argument)."""
DATA_BUDGET = P.MAX_LINE // 2
"""Bytes of output in one reply (4/3 of it in base64): the rest of the line is for the states."""


def with_prefix(prefix: Optional[str], argv: List[str]) -> List[str]:
    """``argv`` run after the machine's ``command_prefix`` (``module load slurm``) in /bin/sh,
    as every Slurm command of ours; the prefix is the only script, the command its arguments."""
    if not prefix:
        return argv
    return ["/bin/sh", "-c", prefix + '\nexec "$@"', "sh", *argv]


def queue_states(text: str) -> Dict[str, Tuple[str, str]]:
    """Slurm id -> (state (its first word), wait status) from :data:`SQUEUE`'s lines."""
    states = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 5 and parts[0]:
            states[parts[0]] = (parts[-3].split(" ")[0], parts[-1].strip())
    return states


def scontrol_id(line: str) -> Optional[str]:
    """The id a ``scontrol -o show job`` line is about, as squeue -r and sbatch name it: an
    array task ``A_T`` (scontrol says ``JobId=N ArrayJobId=A ArrayTaskId=T``), else the JobId."""
    if not line.startswith("JobId="):
        return None
    fields = dict(item.partition("=")[::2] for item in line.split(" ", 3)[:3])
    array, task = fields.get("ArrayJobId"), fields.get("ArrayTaskId", "")
    if array and task.isdigit():
        return array + "_" + task
    return fields.get("JobId") or None


def id_batches(ids: List[str], limit: int = IDS_PER_ARGUMENT) -> List[List[str]]:
    """``ids`` in runs whose comma-joined length stays under ``limit``."""
    batches = []  # type: List[List[str]]
    size = 0
    for job_id in ids:
        if not batches or size + len(job_id) + 1 > limit:
            batches.append([])
            size = 0
        batches[-1].append(job_id)
        size += len(job_id) + 1
    return batches


async def how_they_ended(req: P.SlurmQuery, states: Dict[str, Tuple[str, str]], run: Runner) -> Dict[str, str]:
    """Slurm id -> what scontrol (or sacct, prefixed ``sacct ``) says of each followed job that
    squeue no longer shows, or shows ended without a wait status."""
    done = set(req.done)
    wanted = [
        i for i in req.follow
        if i not in states or (states[i][0] in done and not states[i][1].isdigit())
    ]  # fmt: skip
    if not wanted:
        return {}
    detail = {}  # type: Dict[str, str]
    rc, text = await run(with_prefix(req.prefix, SCONTROL + (wanted if len(wanted) == 1 else [])))
    if rc == 0:
        asked = set(wanted)
        for line in text.splitlines():
            key = scontrol_id(line)
            if key in asked:
                detail[key] = line
    for batch in id_batches([i for i in wanted if i not in detail]):
        rc, text = await run(with_prefix(req.prefix, [*SACCT, ",".join(batch)]))
        if rc != 0:  # no accounting here, say: what sacct said, for every job of the batch
            detail.update((i, "sacct " + text) for i in batch)
            continue
        lines = {}  # type: Dict[str, List[str]]
        for line in text.splitlines():
            lines.setdefault(line.split("|", 1)[0].strip(), []).append(line)
        detail.update((i, "sacct " + "\n".join(lines.get(i, []))) for i in batch)
    return detail


async def query(req: P.SlurmQuery, run: Runner) -> P.SlurmReply:
    """squeue, then how the followed jobs that ended ended (not their output: see new_output)."""
    rc, text = await run(with_prefix(req.prefix, SQUEUE))
    if rc != 0:  # an older squeue's "Invalid job format", say; or Slurm not answering at all
        plain_rc, plain = await run(with_prefix(req.prefix, SQUEUE_PLAIN))
        if plain_rc == 0:
            rc, text = plain_rc, plain
    reply = P.SlurmReply(id=req.id, rc=rc, squeue=text)
    if rc == 0:
        reply.detail = await how_they_ended(req, queue_states(text), run)
    return reply


def new_output(req: P.SlurmQuery, below_root: Callable[[str], str], root: int) -> Tuple[List[P.OutputChunk], List[str]]:
    """Up to ``req.chunk`` new bytes of each job's ``.out`` and ``.err`` (read after the states,
    so a job seen ended has all its output here or in a full chunk), and the jobs left for the
    next query: the reply stays within the protocol's line limit (:data:`DATA_BUDGET`), the
    coordinator asks again for those.  Only files in the work root (``root``, its descriptor:
    ``below_root`` names a path relative to it), opened one name at a time, never through a
    link, never a FIFO a job left there (it would block us)."""
    chunks = []  # type: List[P.OutputChunk]
    more = []  # type: List[str]
    budget = DATA_BUDGET
    for at in req.outputs:
        try:
            rel = below_root(req.base + at.rest)
        except ValueError:
            continue
        if chunks and budget < 2 * req.chunk:
            more.append(at.job)
            continue
        for fd, suffix, offset in ((1, ".out", at.out), (2, ".err", at.err)):
            data = read_from(root, rel + suffix, offset, req.chunk)
            if data:
                budget -= len(data)
                chunks.append(P.OutputChunk(job=at.job, fd=fd, data=base64.b64encode(data).decode()))
    return chunks, more


def read_from(root: int, rel: str, offset: int, size: int) -> bytes:
    try:
        with R.At(root, rel) as (folder, name):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except (OSError, ValueError, TypeError):
        return b""  # not written yet
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.pread(fd, size, offset)
    except OSError:
        return b""
    finally:
        os.close(fd)
