"""What a job may be called: its name becomes file names under ``job_results/``.

A job's results are the folder ``<name>/`` and the files ``<name>.out`` and ``<name>.err``, so a
name must be a safe file name (see :func:`validate_job_name`) and must not be one of the
scheduler's own names there.  A batch file's jobs are named ``<prefix>.<line number>`` by
default (:func:`job_name_prefix`).
"""

from __future__ import annotations

from ssh_scheduler.errors import BatchError, show_value

__all__ = [
    "MAX_JOB_NAME_BYTES",
    "RESERVED_NAMES",
    "RESERVED_PREFIXES",
    "RESULT_SUFFIXES",
    "job_name_prefix",
    "job_name_problem",
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


def _show(value: str, limit: int = 60) -> str:
    return show_value(value, limit)


def job_name_prefix(batch_path: str) -> str:
    """The ancestor's name prefix: the batch path as given, leading ``./`` removed, ``/`` -> ``_``.

    ``example/batch_script.sh`` -> ``example_batch_script.sh``; ``./b.sh`` -> ``b.sh``;
    ``../x.sh`` -> ``.._x.sh``; ``/abs/b.sh`` -> ``_abs_b.sh``.
    """
    path = batch_path
    while path.startswith("./"):
        path = path[2:].lstrip("/")
    return path.replace("/", "_")


def job_name_problem(name: str) -> str | None:
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
    problem = job_name_problem(name)
    if problem is not None:
        raise BatchError(
            f"{problem} (job names become file names under job_results/; choose another "
            "with --job-name)"
        )
