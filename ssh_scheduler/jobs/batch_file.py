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
:func:`parse_remote_command_line`.

Job names (see :func:`validate_job_name`) become file names under ``job_results/``: the folder
``<name>/`` and the files ``<name>.out`` and ``<name>.err``.  Names must be unique, and no name may
equal another job's folder or output file; comparisons ignore case and Unicode normalization
(results may land on a case-insensitive file system).
"""

from __future__ import annotations

import difflib
import shlex
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from ssh_scheduler.errors import BatchError, ConfigError, plain_text, show_value
from ssh_scheduler.jobs.needs import Needs, NeedsOverride

__all__ = [
    "MAX_JOB_NAME_BYTES",
    "RESERVED_NAMES",
    "RESERVED_PREFIXES",
    "RESULT_SUFFIXES",
    "CommandLine",
    "Job",
    "check_dependencies",
    "job_name_prefix",
    "parse_batch",
    "parse_command_line",
    "parse_remote_command_line",
    "validate_job_name",
]

MAX_JOB_NAME_BYTES = 200
"""Longest job name, in UTF-8 bytes (leaves room for suffixes within a 255-byte file name)."""

RESULT_SUFFIXES: tuple[str, ...] = (".out", ".err")
"""Files written next to a job's result folder: ``job_results/<name><suffix>``."""

RESERVED_NAMES = frozenset({".journal.jsonl", ".lock", ".failed", ".events.jsonl", ".control.sock"})
"""The scheduler's own names in ``job_results/`` (the journal, the run's lock file, the folder
``--retry-failed`` keeps old attempts in, a detached run's event file, the control socket); no
job may be called so (any case)."""

RESERVED_PREFIXES: tuple[str, ...] = (".partial-", ".coordinator.log")
"""Prefixes of the scheduler's staging folders and a detached run's logs in ``job_results/``; no
job name may start so."""

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
    needs: NeedsOverride = NeedsOverride()
    """What this job asks for itself; unset fields take the batch's needs."""
    after: tuple[str, ...] = ()
    """Names of jobs that must finish (exit 0) before this one starts."""


@dataclass(frozen=True, slots=True)
class CommandLine:
    """One ``--commands`` line, parsed."""

    command: str
    copy_forwards: tuple[str, ...] | None = None
    copy_backwards: tuple[str, ...] | None = None
    job_name: str | None = None
    needs: NeedsOverride = NeedsOverride()
    after: tuple[str, ...] = ()


def _show(value: str, limit: int = 60) -> str:
    return show_value(value, limit)


_plain = plain_text


def job_name_prefix(batch_path: str) -> str:
    """The ancestor's name prefix: the batch path as given, leading ``./`` removed, ``/`` -> ``_``.

    ``example/batch_script.sh`` -> ``example_batch_script.sh``; ``./b.sh`` -> ``b.sh``;
    ``../x.sh`` -> ``.._x.sh``; ``/abs/b.sh`` -> ``_abs_b.sh``.
    """
    path = batch_path
    while path.startswith("./"):
        path = path[2:].lstrip("/")
    return path.replace("/", "_")


def _job_name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a job name, or ``None`` (rules: :func:`validate_job_name`)."""
    if not name:
        return "the job name is empty"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return f"job name {_show(name)} is not valid Unicode text"
    if size > MAX_JOB_NAME_BYTES:
        return f"job name {_show(name)} is {size} bytes long, more than {MAX_JOB_NAME_BYTES}"
    if "/" in name:
        return f"job name {_show(name)} contains '/'"
    if "\\" in name:
        return f"job name {_show(name)} contains '\\'"
    if not name.isprintable() and any(not ch.isprintable() and ch != " " for ch in name):
        return f"job name {_show(name)} contains a control character"
    if name in (".", ".."):
        return f"job name {_show(name)} is not allowed"
    if name.startswith("-"):
        return f"job name {_show(name)} starts with '-'"
    if name != name.strip():
        return f"job name {_show(name)} starts or ends with whitespace"
    folded = name.casefold()
    if folded in RESERVED_NAMES or folded.startswith(RESERVED_PREFIXES):
        return f"job name {_show(name)} is reserved for the scheduler's own files"
    return None


def validate_job_name(name: str) -> None:
    """Raise :class:`BatchError` unless ``name`` is safe as a file name under ``job_results/``.

    Rules: not empty; at most :data:`MAX_JOB_NAME_BYTES` UTF-8 bytes; no ``/``, ``\\``, NUL or
    other control characters (a plain space is fine); not ``.`` or ``..`` (a leading ``.`` is
    fine otherwise, e.g. ``.._x.sh.1`` from ``../x.sh``); not starting with ``-`` (so it is
    never read as an option); no leading or trailing whitespace; not one of the scheduler's own
    file names in ``job_results/`` (:data:`RESERVED_NAMES`, :data:`RESERVED_PREFIXES`).
    """
    problem = _job_name_problem(name)
    if problem is not None:
        raise BatchError(
            f"{problem} (job names become file names under job_results/; choose another "
            "with --job-name)"
        )


_MULTI_OPTIONS = {"--copy-forwards": "copy_forwards", "--copy-backwards": "copy_backwards"}
_SINGLE_OPTIONS = {"--job-name": "job_name"}
# Per-job needs: the execute_batch flags of the same names, for this line only.
_NEED_OPTIONS: dict[str, tuple[str, type]] = {
    "--num-cpus": ("cpus", float),
    "--memory-required": ("memory_mb", int),
    "--gpus-per-job": ("gpus", int),
    "--gpu-memory-required": ("gpu_memory_mb", int),
    "--gpu-utilization": ("gpu_utilization", float),
}
_NEED_FLAGS: dict[str, tuple[str, object]] = {
    "--reserve": ("reserve_machine", True),
    "--no-gpu-required": ("gpus", 0),
    "--no-reserve-gpu": ("reserve_gpu", False),
}
_AFTER_OPTION = "--after"


def parse_remote_command_line(
    line: str,
) -> tuple[str, tuple[str, ...] | None, tuple[str, ...] | None, str | None]:
    """``(command, copy_forwards, copy_backwards, job_name)`` of :func:`parse_command_line`."""
    parsed = parse_command_line(line)
    return parsed.command, parsed.copy_forwards, parsed.copy_backwards, parsed.job_name


def _need_value(option: str, kind: type, text: str) -> float | int:
    try:
        return int(text) if kind is int else float(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise BatchError(f"{option} needs {what}, not {_show(text)}") from None


def parse_command_line(line: str) -> CommandLine:
    """Parse one ``--commands`` line.

    The line is split like a POSIX shell would (``shlex.split``), e.g.
    ``execute_remote --copy-forwards a test.py --copy-backwards a --job-name a 'python test.py'``.

    * The leading word ``execute_remote`` is optional.
    * ``--copy-forwards`` / ``--copy-backwards`` take the following words up to the next word
      starting with ``-`` (zero words = copy nothing); they may be repeated (values add up) and
      written ``--opt=value`` (exactly that one value).  Not given: ``None`` (batch default).
    * ``--job-name NAME`` / ``--job-name=NAME`` sets the name (validated), at most once.
    * The job's own needs, as the ``execute_batch`` flags of the same names: ``--num-cpus N``,
      ``--memory-required MB``, ``--gpus-per-job N``, ``--gpu-memory-required MB``,
      ``--gpu-utilization F``, ``--reserve``, ``--no-gpu-required``, ``--no-reserve-gpu``; unset
      ones take the batch's values, so GPU and CPU jobs mix in one batch.
    * ``--after NAME`` (repeatable): start only once job NAME finished with exit 0.
    * ``--`` ends the options: every word after it is positional.
    * Exactly one positional word is the command (quote it).  Unlike argparse, a command placed
      right after a multi-value option at the end of the line is still found: when no other
      positional word exists, the last word of that final option list is the command, provided
      the list keeps at least one value (``--copy-backwards out 'python x.py'`` works).
    * Any other option (``--machine``, ``--gpu``, ``-x``...) is an error: it cannot apply in a
      batch, where machines and GPUs are chosen by the scheduler.

    Errors are :class:`BatchError` without a file/line prefix; :func:`parse_batch` adds it.
    """
    try:
        words = shlex.split(line)
    except ValueError as err:
        reason = str(err).lower()
        fix = "remove the trailing backslash" if "escaped" in reason else "close the quote"
        raise BatchError(f"cannot split the line into words: {reason} ({fix})") from None
    if words and words[0] == "execute_remote":
        words = words[1:]

    lists: dict[str, list[str] | None] = {"copy_forwards": None, "copy_backwards": None}
    job_name: str | None = None
    needs: dict[str, object] = {}
    after: list[str] = []
    positionals: list[str] = []
    tail_list: list[str] | None = None  # the multi-value list that ran to the end of the line
    tail_start = 0
    i = 0
    only_positionals = False
    while i < len(words):
        word = words[i]
        tail_list = None
        if only_positionals or word == "-" or not word.startswith("-"):
            positionals.append(word)
            i += 1
            continue
        if word == "--":
            only_positionals = True
            i += 1
            continue
        option, eq, value = word.partition("=")
        if option in _MULTI_OPTIONS:
            field = _MULTI_OPTIONS[option]
            current = lists[field]
            if current is None:
                current = []
                lists[field] = current
            i += 1
            if eq:
                if not value:
                    raise BatchError(f"{option}= has an empty value (give a path after '=')")
                current.append(value)
                continue
            start = len(current)
            while i < len(words) and not (words[i].startswith("-") and words[i] != "-"):
                current.append(words[i])
                i += 1
            if i == len(words) and len(current) > start:
                tail_list, tail_start = current, start
            continue
        if option in _NEED_FLAGS:
            if eq:
                raise BatchError(f"{option} takes no value (remove '={_show(value)}')")
            field, flag_value = _NEED_FLAGS[option]
            if field in needs:
                raise BatchError(f"{option} sets {field} again (keep one)")
            needs[field] = flag_value
            i += 1
            continue
        if option in _NEED_OPTIONS or option == _AFTER_OPTION:
            if eq:
                text = value
                i += 1
            else:
                if i + 1 >= len(words):
                    raise BatchError(f"{option} needs a value (write {option} VALUE)")
                text = words[i + 1]
                i += 2
            if option == _AFTER_OPTION:
                validate_job_name(text)
                after.append(text)
                continue
            field, kind = _NEED_OPTIONS[option]
            if field in needs:
                raise BatchError(f"{option} sets {field} again (keep one)")
            needs[field] = _need_value(option, kind, text)
            continue
        if option in _SINGLE_OPTIONS:
            if job_name is not None:
                raise BatchError("--job-name is given twice (keep one)")
            if eq:
                job_name = value
                i += 1
            else:
                if i + 1 >= len(words):
                    raise BatchError("--job-name needs a value (write --job-name NAME)")
                job_name = words[i + 1]
                i += 2
            validate_job_name(job_name)
            continue
        known = [*_MULTI_OPTIONS, *_SINGLE_OPTIONS, *_NEED_OPTIONS, *_NEED_FLAGS, _AFTER_OPTION]
        close = difflib.get_close_matches(option, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise BatchError(
            f"unknown option {_show(option)} ({hint}in a batch only {', '.join(known)} are "
            "allowed; machines and GPUs are chosen by the scheduler)"
        )

    if not positionals and tail_list is not None and len(tail_list) - tail_start >= 2:
        positionals.append(tail_list.pop())
    if not positionals:
        raise BatchError(
            "no command found (add the command as one quoted word, like 'python test.py')"
        )
    if len(positionals) > 1:
        shown = ", ".join(_show(p, 30) for p in positionals[:3])
        raise BatchError(
            f"expected one command, found {len(positionals)} words: {shown} (quote the whole "
            "command, like 'python test.py arg', and put options before it)"
        )
    command = positionals[0]
    if not command.strip():
        raise BatchError("the command is empty (give the command as one quoted word)")
    for field, values in lists.items():
        for value in values or ():
            option = "--" + field.replace("_", "-")
            if not value:
                raise BatchError(f"{option} has an empty path (remove it or give a path)")
            if "\x00" in value:
                raise BatchError(f"{option} path {_show(value)} contains a NUL byte (remove it)")
    forwards = lists["copy_forwards"]
    backwards = lists["copy_backwards"]
    try:
        override = NeedsOverride(**needs)  # type: ignore[arg-type]
        override.apply(Needs())  # the same range checks as the execute_batch flags
    except ConfigError as err:
        message = str(err)
        for option, (field, _kind) in _NEED_OPTIONS.items():
            if message.startswith(field + " "):
                message = option + message[len(field) :]
        raise BatchError(message) from None
    return CommandLine(
        command,
        tuple(forwards) if forwards is not None else None,
        tuple(backwards) if backwards is not None else None,
        job_name,
        override,
        tuple(after),
    )


def _decode_lines(data: bytes, shown: str) -> list[str]:
    """The physical lines as text; any NUL, stray ``\\r`` or bad UTF-8 raises for the first."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
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


def parse_batch(data: bytes, batch_path: str, *, commands_mode: bool = False) -> list[Job]:
    """Parse a whole batch file (bytes as read) into jobs, in file order.

    ``batch_path`` is the path as given on the command line: it names the file in messages and
    gives the default job names (:func:`job_name_prefix` + ``.<line number>``).  With
    ``commands_mode`` each line is parsed with :func:`parse_remote_command_line`.
    """
    shown = _plain(batch_path)
    prefix = job_name_prefix(batch_path)
    lines = _decode_lines(data, shown)
    jobs: list[Job] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parsed = CommandLine(line)
        if commands_mode:
            try:
                parsed = parse_command_line(line)
            except BatchError as err:
                raise BatchError(f"{shown} line {number}: {err}") from None
        name = parsed.job_name
        if name is None:
            name = f"{prefix}.{number}"
            problem = _job_name_problem(name)
            if problem is not None:
                raise BatchError(
                    f"{shown} line {number}: default {problem} (it comes from the batch file's "
                    "path: rename or move the file, or set names with --commands and --job-name)"
                )
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
