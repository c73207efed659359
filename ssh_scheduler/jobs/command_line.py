"""One line of an ``execute_batch --commands`` batch: a partial ``execute_remote`` command.

The flags a line may carry are the table's ``line`` options (:mod:`ssh_scheduler.jobs.options`):
what the job copies forward and back, its name, the jobs it waits for, and its own needs under
the ``execute_batch`` flags' names.  Anything else (``--machine``, ``--gpus``...) cannot apply in a
batch, where the scheduler chooses machines and GPUs, and is refused.
"""

from __future__ import annotations

import difflib
import shlex
from dataclasses import dataclass

from ssh_scheduler.errors import BatchError, ConfigError, show_value
from ssh_scheduler.jobs.job_names import validate_job_name
from ssh_scheduler.jobs.needs import NO_OVERRIDE, Needs, NeedsOverride, flag_message
from ssh_scheduler.jobs.options import LINE, Option, option, options_of

__all__ = ["CommandLine", "parse_command_line", "parse_remote_command_line"]


@dataclass(frozen=True, slots=True)
class CommandLine:
    """One ``--commands`` line, parsed."""

    command: str
    copy_forwards: tuple[str, ...] | None = None
    copy_backwards: tuple[str, ...] | None = None
    job_name: str | None = None
    needs: NeedsOverride = NO_OVERRIDE
    after: tuple[str, ...] = ()


_OPTIONS: dict[str, Option] = {flag: o for o in options_of(LINE) for flag in o.flags}
_NAMES_A_JOB = frozenset({"job_name", "after"})
"""Options whose value is a job's name, checked as one."""


def _show(value: str, limit: int = 60) -> str:
    return show_value(value, limit)


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


def _split(line: str) -> list[str]:
    try:
        words = shlex.split(line)
    except ValueError as err:
        reason = str(err).lower()
        fix = "remove the trailing backslash" if "escaped" in reason else "close the quote"
        raise BatchError(f"cannot split the line into words: {reason} ({fix})") from None
    return words[1:] if words and words[0] == "execute_remote" else words


def _unknown(option: str) -> BatchError:
    known = list(_OPTIONS)
    close = difflib.get_close_matches(option, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return BatchError(
        f"unknown option {_show(option)} ({hint}in a batch only {', '.join(known)} are "
        "allowed; machines and GPUs are chosen by the scheduler)"
    )


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

    Errors are :class:`BatchError` without a file/line prefix; ``parse_batch`` adds it.
    """
    words = _split(line)
    lists: dict[str, list[str]] = {}  # the greedy options' values, by option name
    single: dict[str, str] = {}  # --job-name
    repeated: dict[str, list[str]] = {}  # --after
    needs: dict[str, object] = {}  # by Needs field
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
        flag, eq, value = word.partition("=")
        found = _OPTIONS.get(flag)
        if found is None:
            raise _unknown(flag)
        i += 1
        if found.greedy:
            current = lists.setdefault(found.name, [])
            if eq:
                if not value:
                    raise BatchError(f"{flag}= has an empty value (give a path after '=')")
                current.append(value)
                continue
            start = len(current)
            while i < len(words) and not (words[i].startswith("-") and words[i] != "-"):
                current.append(words[i])
                i += 1
            if i == len(words) and len(current) > start:
                tail_list, tail_start = current, start
            continue
        field = found.to.partition(".")[2]
        if found.switch:
            if eq:
                raise BatchError(f"{flag} takes no value (remove '={_show(value)}')")
            if field in needs:
                raise BatchError(f"{flag} sets {field} again (keep one)")
            needs[field] = found.sets
            continue
        if found.name in single:
            raise BatchError(f"{flag} is given twice (keep one)")
        if not eq:
            if i >= len(words):
                metavar = "NAME" if found.name in _NAMES_A_JOB else "VALUE"
                raise BatchError(f"{flag} needs a value (write {flag} {metavar})")
            value = words[i]
            i += 1
        if found.name in _NAMES_A_JOB:
            validate_job_name(value)
        if found.many:
            repeated.setdefault(found.name, []).append(value)
        elif found.to.startswith("needs."):
            if field in needs:
                raise BatchError(f"{flag} sets {field} again (keep one)")
            needs[field] = _need_value(flag, found.kind, value)
        else:
            single[found.name] = value

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
    for name, values in lists.items():
        flag = option(name).flag
        for path in values:
            if not path:
                raise BatchError(f"{flag} has an empty path (remove it or give a path)")
            if "\x00" in path:
                raise BatchError(f"{flag} path {_show(path)} contains a NUL byte (remove it)")
    try:
        override = NeedsOverride(**needs)  # type: ignore[arg-type]
        override.apply(Needs())  # the same range checks as the execute_batch flags
    except ConfigError as err:
        raise BatchError(flag_message(str(err))) from None
    forwards, backwards = lists.get("copy_forwards"), lists.get("copy_backwards")
    return CommandLine(
        command,
        tuple(forwards) if forwards is not None else None,
        tuple(backwards) if backwards is not None else None,
        single.get("job_name"),
        override,
        tuple(repeated.get("after", ())),
    )
