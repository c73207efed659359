"""Slurm job arrays, the pure part: jobs submitted together that ask Slurm for the same things go
in ONE ``sbatch --array`` (one submission, one scheduling decision for all of them, as a user
would do by hand), each task running its own job's script in its own folder.

The array is named ``sshs-<token>-@<first job>`` and its dispatch script, kept next to the job
folders as ``<token>-@<first job>.array``, lists task -> job folder: a rerun of the batch reads it
to know which task is which job (:func:`parse_array_script`).  Slurm itself writes task i's
output to ``<token>-@<first job>.<i>.out`` and ``.err`` (:func:`task_outputs`), as it writes a
single job's to ``<folder>.out``: what Slurm says of a task (``*** JOB 12 CANCELLED ***``, an
``execve`` that failed) lands there, where the job's own output is.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from ssh_scheduler.executors.slurm_jobs import prefixed, slurm_path
from ssh_scheduler.machines.slurm import SlurmSettings

__all__ = [
    "ARRAY_MARK",
    "MAX_COMMAND",
    "array_script",
    "array_submit_command",
    "parse_array_script",
    "shared_options",
    "task_output",
    "task_outputs",
]

ARRAY_MARK = "@"
"""Starts the job part of an array's name (``sshs-<token>-@<first job>``): no job name does."""
MAX_COMMAND = 48 * 1024
"""Bytes of one submission's shell line: it travels as ONE argument (``sh -c``), and no argument
we build may pass 64 KiB (Linux refuses one over 128 KiB); an array past it is cut in two."""

_PER_JOB = ("--job-name=", "--chdir=", "--output=", "--error=", "--open-mode=")
_TASK_RE = re.compile(r"^(\d+)\) f=(.*);;$")
_OWN_REDIRECT = '>>"$f.out"'  # how an older dispatch script sent each task's output


def shared_options(argv: Sequence[str]) -> tuple[str, ...]:
    """The options of a single job's ``sbatch`` argv that are not about that job alone: jobs with
    the same ones can share an array."""
    return tuple(a for a in argv[2:] if not a.startswith(_PER_JOB))


def array_script(jobdirs: Sequence[str]) -> str:
    """The array's batch script: task i runs ``<folder i>.sh`` in folder i (its output goes
    where Slurm opened it: :func:`task_outputs`)."""
    lines = [
        "#!/bin/sh",
        "# an ssh_scheduler job array: task i runs the job of folder i",
        'case "$SLURM_ARRAY_TASK_ID" in',
    ]
    lines += [f"{i}) f={shlex.quote(d)};;" for i, d in enumerate(jobdirs)]
    lines += [
        '*) echo "ssh_scheduler: no job for array task $SLURM_ARRAY_TASK_ID" >&2; exit 1;;',
        "esac",
        'cd "$f" || exit 1',
        'exec /bin/sh "$f.sh"',
    ]
    return "\n".join(lines) + "\n"


def task_outputs(script: str, stem: str) -> list[str]:
    """Where each task of the array whose dispatch script is ``script`` has its output (the
    path before ``.out``/``.err``): ``<stem>.<i>``, ``stem`` being the script's path without
    ``.array``.  An array an older version submitted appended its output to each job's folder
    path from the script itself: a rerun that follows it reads it there."""
    folders = parse_array_script(script)
    if _OWN_REDIRECT in script:
        return folders
    return [task_output(stem, i) for i in range(len(folders))]


def task_output(stem: str, task: int) -> str:
    """Where task ``task`` of the array of ``stem`` has its output: sbatch's ``%a`` below."""
    return f"{stem}.{task}"


def parse_array_script(text: str) -> list[str]:
    """The job folders of an array's tasks, in task order."""
    folders: dict[int, str] = {}
    for line in text.splitlines():
        match = _TASK_RE.match(line)
        if match:
            words = shlex.split(match.group(2))
            if len(words) == 1:
                folders[int(match.group(1))] = words[0]
    return [folders[i] for i in sorted(folders)]


def array_submit_command(
    settings: SlurmSettings,
    options: Sequence[str],
    *,
    name: str,
    workdir: str,
    stem: str,
    jobs: Sequence[tuple[str, str]],
) -> str:
    """One shell line: write each job's script (``jobs``: folder, script) and the dispatch
    script (``<stem>.array``), then ``sbatch --array`` it; stderr joins stdout so a refusal
    reaches the user.  Slurm opens each task's output (:func:`task_outputs`) in append mode:
    a task it requeues continues the same files, as a single job does."""
    script_path = f"{stem}.array"
    steps = [
        f"printf '%s' {shlex.quote(script)} > {shlex.quote(folder + '.sh')}"
        for folder, script in jobs
    ]
    steps.append(
        f"printf '%s' {shlex.quote(array_script([f for f, _ in jobs]))} > {shlex.quote(script_path)}"
    )
    argv = [
        "sbatch", "--parsable", f"--job-name={name}", f"--chdir={workdir}",
        f"--output={slurm_path(stem)}.%a.out", f"--error={slurm_path(stem)}.%a.err", "--open-mode=append",
        f"--array=0-{len(jobs) - 1}", *options, script_path,
    ]  # fmt: skip
    return prefixed(settings, " && ".join(steps) + f" && {shlex.join(argv)} 2>&1")
