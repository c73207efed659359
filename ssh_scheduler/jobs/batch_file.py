"""Batch files -> frozen :class:`Job` objects with validated, collision-free names.

A batch file holds one shell command per physical line (ancestor-compatible):

* Blank lines and lines whose first non-space character is ``#`` are skipped, but every physical
  line counts for numbering, so a job's default name is ``<prefix>.<line number>`` with the
  first line being ``.1`` (``example/batch_script.sh`` line 1 -> ``example_batch_script.sh.1``).
* Line ends: ``\\n`` or ``\\r\\n``; only the line end is removed, all other whitespace (leading
  and trailing) is kept as written.  A UTF-8 byte order mark at the start of the file is
  dropped.  A ``\\r`` elsewhere in a line is an error (mixed/old Mac line endings).
* A line ending in ``\\`` is *not* joined with the next one: one job per physical line.
* The whole file is checked before any job exists: a NUL byte or invalid UTF-8 on any line is a
  :class:`BatchError` naming the file and line.  A file without any command is an error too.

``--commands`` mode (ancestor): every line is a partial ``execute_remote`` command line, see
:mod:`ssh_scheduler.jobs.command_line`.

Job names (:mod:`ssh_scheduler.jobs.job_names`) become file names under ``job_results/``: the
folder ``<name>/`` and the files ``<name>.out`` and ``<name>.err``.  Names must be unique, and no
name may equal another job's folder or output file; comparisons ignore case and Unicode
normalization (results may land on a case-insensitive file system).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from ssh_scheduler.errors import BatchError, plain_text, show_value
from ssh_scheduler.jobs.command_line import parse_command_line
from ssh_scheduler.jobs.job_names import RESULT_SUFFIXES, job_name_prefix, job_name_problem
from ssh_scheduler.jobs.needs import NO_OVERRIDE, NeedsOverride
from ssh_scheduler.jobs.python_call import PythonCall

__all__ = ["Job", "check_dependencies", "parse_batch"]

_SUFFIX_ROLES = {"": "result folder", ".out": "stdout file", ".err": "stderr file"}


@dataclass(frozen=True, slots=True)
class Job:
    """One command of a batch."""

    name: str
    command: str
    line_number: int
    """1-based physical line in the batch file."""
    copy_forwards: tuple[str, ...] | None = None
    """``None``: the batch-level default; ``()``: copy nothing."""
    copy_backwards: tuple[str, ...] | None = None
    """``None``: the batch-level default; ``()``: copy nothing back."""
    needs: NeedsOverride = NO_OVERRIDE
    """What this job asks for itself; unset fields take the batch's needs."""
    after: tuple[str, ...] = ()
    """Names of jobs that must finish (exit 0) before this one starts."""
    call: PythonCall | None = None
    """A Python call to run instead of ``command``, which then only describes it
    (``ssh_scheduler.Executor``'s jobs)."""


def _show(value: str, limit: int = 60) -> str:
    return show_value(value, limit)


_plain = plain_text


def _decode_lines(data: bytes, shown: str) -> list[str]:
    """The physical lines as text; any NUL, stray ``\\r`` or bad UTF-8 raises for the first."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    unix = data.replace(b"\r\n", b"\n")
    if b"\x00" not in unix and b"\r" not in unix:
        # The usual file, checked whole in C (10x faster on a 100,000-line batch): the same
        # lines; only a bad one needs _decode_each, to name the first.
        try:
            text = unix.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            lines = text.split("\n")
            if lines and lines[-1] == "":
                lines.pop()
            return lines
    return _decode_each(data, shown)


def _decode_each(data: bytes, shown: str) -> list[str]:
    """:func:`_decode_lines` line by line (after the BOM), raising for the first bad line."""
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()
    lines: list[str] = []
    errors: list[tuple[int, str]] = []
    for number, raw in enumerate(raw_lines, start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        problem = ""
        if b"\x00" in raw:
            column = raw.index(b"\x00") + 1
            problem = f"contains a NUL byte at byte {column} (remove it; is this a binary file?)"
        elif b"\r" in raw:
            column = raw.index(b"\r") + 1
            problem = (
                f"contains a carriage return (\\r) at byte {column} (convert the file to "
                "Unix or Windows line endings)"
            )
        else:
            try:
                lines.append(raw.decode("utf-8"))
                continue
            except UnicodeDecodeError as err:
                problem = (
                    f"is not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1}; "
                    "save the file as UTF-8)"
                )
        errors.append((number, problem))
    if errors:
        number, problem = errors[0]
        more = f" ({len(errors) - 1} more bad line(s) after it)" if len(errors) > 1 else ""
        raise BatchError(f"{shown} line {number}: the line {problem}{more}")
    return lines


def _collision_key(name: str) -> str:
    if name.isascii():  # the common case, 10x cheaper (a 100,000-line batch checks 300,000)
        return name.lower()
    return unicodedata.normalize("NFC", name).casefold()


def _check_names(jobs: Sequence[Job], shown: str) -> None:
    """Unique names, and no name equal to another job's folder/.out/.err (ignoring case)."""
    # Two keys of one job never meet (their suffixes differ), so the names are good exactly
    # when every job's keys are all different: checked at once (the key of name+suffix is the
    # key of name, plus the ASCII suffix); _first_collision finds the first pair that meets.
    bases = [_collision_key(job.name) for job in jobs]
    every_key = {base + suffix for base in bases for suffix in ("", *RESULT_SUFFIXES)}
    if len(every_key) != len(bases) * (1 + len(RESULT_SUFFIXES)):
        _first_collision(jobs, shown)


def _first_collision(jobs: Sequence[Job], shown: str) -> None:
    """Raise for the first job whose name meets an earlier job's (the names or their files)."""
    occupied: dict[str, tuple[Job, str]] = {}
    for job in jobs:
        # The suffixes are ASCII, so the key of name+suffix is the key of name, plus suffix.
        base = _collision_key(job.name)
        keys = [(base + suffix, suffix) for suffix in ("", *RESULT_SUFFIXES)]
        for key, suffix in keys:
            other = occupied.get(key)
            if other is None:
                continue
            other_job, other_suffix = other
            if suffix == "" and other_suffix == "":
                same = "the same job name" if other_job.name == job.name else "job names"
                detail = (
                    f"{same} {_show(job.name)}"
                    if other_job.name == job.name
                    else f"{same} {_show(other_job.name)} and {_show(job.name)}, which differ "
                    "only in case"
                )
                raise BatchError(
                    f"{shown} line {job.line_number}: {detail} (also line "
                    f"{other_job.line_number}; give each job its own --job-name)"
                )
            # ``owner`` writes the file ``owner.name + suffix``, which is ``folder``'s folder
            owner, folder = (other_job, job) if other_suffix else (job, other_job)
            owner_suffix = other_suffix or suffix
            raise BatchError(
                f"{shown} line {folder.line_number}: job name {_show(folder.name)} collides with "
                f"the {_SUFFIX_ROLES[owner_suffix]} job_results/{_plain(owner.name)}"
                f"{owner_suffix} of job {_show(owner.name)} (line {owner.line_number}; rename "
                "one of them with --job-name)"
            )
        for key, suffix in keys:
            occupied[key] = (job, suffix)


def check_dependencies(jobs: Sequence[Job], shown: str) -> None:
    """Every ``after`` names a job of the batch, and no job waits on itself through a cycle:
    such a batch could never finish, so it is refused before anything runs."""
    if not any(job.after for job in jobs):
        return
    by_name = {job.name: job for job in jobs}
    for job in jobs:
        for name in job.after:
            if name not in by_name:
                raise BatchError(
                    f"{shown} line {job.line_number}: --after {_show(name)} names no job of this "
                    "batch (use the other line's --job-name)"
                )
    # Iterative depth-first search: 0 unseen, 1 on the current path, 2 done.
    mark: dict[str, int] = {}
    for root in jobs:
        if mark.get(root.name):
            continue
        stack: list[tuple[str, int]] = [(root.name, 0)]
        mark[root.name] = 1
        while stack:
            name, index = stack[-1]
            after = by_name[name].after
            if index == len(after):
                mark[name] = 2
                stack.pop()
                continue
            stack[-1] = (name, index + 1)
            nxt = after[index]
            if mark.get(nxt) == 1:
                cycle = [n for n, _ in stack[[n for n, _ in stack].index(nxt) :]] + [nxt]
                raise BatchError(
                    f"{shown} line {by_name[nxt].line_number}: jobs wait on each other in a "
                    f"circle ({' -> '.join(_show(n, 30) for n in cycle)}); remove one --after"
                )
            if not mark.get(nxt):
                mark[nxt] = 1
                stack.append((nxt, 0))


def _check_default_name(name: str, shown: str, number: int) -> None:
    """A default name (``<prefix>.<line number>``) must be a job name.  Whether it is depends
    only on the prefix and how many digits the number has (no rule of :func:`job_name_problem`
    looks at which digits: tests/test_batch_fast_paths.py), so a batch checks the first default
    name of each digit count."""
    problem = job_name_problem(name)
    if problem is not None:
        raise BatchError(
            f"{shown} line {number}: default {problem} (it comes from the batch file's "
            "path: rename or move the file, or set names with --commands and --job-name)"
        )


def parse_batch(data: bytes, batch_path: str, *, commands_mode: bool = False) -> list[Job]:
    """Parse a whole batch file (bytes as read) into jobs, in file order.

    ``batch_path`` is the path as given on the command line: it names the file in messages and
    gives the default job names (:func:`job_name_prefix` + ``.<line number>``).  With
    ``commands_mode`` each line is parsed with :func:`~ssh_scheduler.jobs.command_line.parse_command_line`.
    """
    shown = _plain(batch_path)
    prefix = job_name_prefix(batch_path)
    lines = _decode_lines(data, shown)
    jobs: list[Job] = []
    checked_digits = 0  # default names of this many digits were checked (see _check_default_name)
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parsed = None  # without --commands the line is the command, and sets nothing else
        if commands_mode:
            try:
                parsed = parse_command_line(line)
            except BatchError as err:
                raise BatchError(f"{shown} line {number}: {err}") from None
        if parsed is not None and parsed.job_name is not None:
            name = parsed.job_name
        else:
            name = f"{prefix}.{number}"
            if len(name) - len(prefix) - 1 != checked_digits:
                _check_default_name(name, shown, number)
                checked_digits = len(name) - len(prefix) - 1
        if parsed is None:
            jobs.append(Job(name, line, number))
        else:
            jobs.append(
                Job(
                    name, parsed.command, number, parsed.copy_forwards, parsed.copy_backwards,
                    parsed.needs, parsed.after,
                )
            )
    if not jobs:
        raise BatchError(
            f"{shown}: no commands (every line is blank or a comment; write one command per line)"
        )
    _check_names(jobs, shown)
    check_dependencies(jobs, shown)
    return jobs
