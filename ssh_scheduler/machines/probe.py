"""What a host has free right now: the probe command and the pure parsers of its output.

The scheduler learns a host's state in one SSH round trip by running :data:`PROBE_COMMAND`, which
prints delimited sections (CPU count, load, ``/proc/meminfo``, user name and, where ``nvidia-smi``
exists, the GPU and GPU-process queries).  :func:`parse_probe_output` turns that text into a
frozen :class:`HostState`; the per-section parsers are public so they can be tested on real
``nvidia-smi`` captures.

Units: every ``*_mb`` field is MiB (1024 KiB), the unit ``nvidia-smi`` reports, so host RAM and
GPU memory compare directly with the ``--memory-required`` / ``--gpu-memory-required`` flags.

Failure policy:

* Output we cannot make sense of (no markers, truncated, no CPU/load/memory section) raises
  :class:`~ssh_scheduler.errors.ProbeError` with a one-line reason: the host is unusable.
* A host without ``nvidia-smi`` simply has no GPUs; that is not an error.
* A host whose ``nvidia-smi`` exists but fails (non-zero exit, timeout, unparsable output, in
  any of its queries) gets ``gpus=()`` and a reason in :attr:`HostState.gpu_error`: it still runs
  CPU-only jobs, and the reason can be shown to the user.  The process query failing counts as
  a GPU failure too, because without it other users' processes cannot be told from ours.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from ssh_scheduler.errors import ProbeError
from ssh_scheduler.machines.host_state import GpuProcess, GpuState, HostState

__all__ = [
    "ALONE",
    "GPU_QUERY_FIELDS",
    "PROBE_COMMAND",
    "PROBE_SCRIPT",
    "listed_throughout",
    "parse_compute_apps",
    "parse_gpu_query",
    "parse_loadavg",
    "parse_meminfo",
    "parse_nproc",
    "parse_probe_output",
]


GPU_QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "utilization.gpu",
)
"""The ``--query-gpu`` fields the probe asks for, in the order a header-less reply has them."""

_APPS_QUERY_FIELDS = ("pid", "used_memory", "gpu_uuid")
ALONE = "alone"
"""The probe's first argument where no job of ours runs on the host, from the probe's start to
its end (the agent holds none; a dry run starts none): the GPU processes are then listed once,
at the same time as the memory is read, instead of before and after it.  With no process
attributed to a job of ours, every listed process counts as someone else's, at the larger of
``memory.used`` and the listed sum (:mod:`ssh_scheduler.planner.observed`): never less than
was in use at the read, whichever query ran first.  It saves one of three ``nvidia-smi`` runs,
and the other two overlap: a batch's first probe of each host, on its way to the first job."""
_ONE_LIST = "one_process_list"
_NVSMI_TIMEOUT_S = 10
_GPU_QUERY = f"nvidia-smi --query-gpu={','.join(GPU_QUERY_FIELDS)} --format=csv,noheader,nounits"
_APPS_QUERY = (
    f"nvidia-smi --query-compute-apps={','.join(_APPS_QUERY_FIELDS)} --format=csv,noheader,nounits"
)

# One line on purpose: PROBE_COMMAND hands it to ``sh -c`` inside single quotes, and csh/tcsh
# login shells reject newlines inside quotes.  It also avoids "!" (csh history expansion).
# Every section is followed by its exit status so the parser can tell "printed nothing" from
# "failed"; stderr is folded in so a failure's reason reaches the user.  nvidia-smi can hang on
# a wedged driver, hence ``timeout`` (with -k where supported: old busybox builds lack it).
PROBE_SCRIPT = " ".join(
    (
        "m() { printf '@@ssh_scheduler:%s@@\\n' \"$*\"; };",
        "LC_ALL=C; export LC_ALL;",
        "m begin;",
        "m user; id -un 2>/dev/null || id -u 2>&1; m status user $?;",
        "m nproc; nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>&1; m status nproc $?;",
        "m loadavg; cat /proc/loadavg 2>&1; m status loadavg $?;",
        "m meminfo; cat /proc/meminfo 2>&1; m status meminfo $?;",
        "if command -v nvidia-smi >/dev/null 2>&1; then",
        "t=;",
        f"if timeout -k 5 {_NVSMI_TIMEOUT_S} true >/dev/null 2>&1;",
        f'then t="timeout -k 5 {_NVSMI_TIMEOUT_S}";',
        f"elif timeout {_NVSMI_TIMEOUT_S} true >/dev/null 2>&1;",
        f'then t="timeout {_NVSMI_TIMEOUT_S}"; fi;',
        # Alone (see ALONE): one process list, taken while the memory is read, the two
        # queries at once; the first one's section waits in the pipe until the second's is out.
        # A wedged driver makes both wait out their timeouts side by side.
        f'if [ "$1" = {ALONE} ]; then m {_ONE_LIST}; m status {_ONE_LIST} 0;',
        f"{{ m gpu_processes; $t {_APPS_QUERY} 2>&1; m status gpu_processes $?; }} |",
        f"{{ m gpus; $t {_GPU_QUERY} 2>&1; m status gpus $?; cat; }};",
        "else",
        # The processes are listed before and after the memory is read (see
        # listed_throughout): a process that starts, grows, frees its memory or ends between
        # the calls then never hides memory no listed process accounts for.
        f"m gpu_processes; $t {_APPS_QUERY} 2>&1; s=$?; m status gpu_processes $s;",
        # A wedged driver would make the next query wait out its timeout too: skip it.
        f'm gpus; if [ "$s" = 0 ]; then $t {_GPU_QUERY} 2>&1; s=$?; fi; m status gpus $s;',
        f'm gpu_processes_after; if [ "$s" = 0 ]; then $t {_APPS_QUERY} 2>&1; s=$?; fi;',
        "m status gpu_processes_after $s;",
        "fi;",
        "fi;",
        "m end",
    )
)
"""The probe as a POSIX ``sh`` program (one line); its first argument may be :data:`ALONE`."""

PROBE_COMMAND = f"sh -c {shlex.quote(PROBE_SCRIPT)} sh {ALONE}"
"""The probe as one command line for whatever the remote login shell is, run :data:`ALONE`
(what starts nothing there: a dry run's look): it only asks that shell to start ``sh`` on one
single-quoted line (tested with dash and bash; built for zsh, fish and csh too)."""

_MARKER_RE = re.compile(r"@@ssh_scheduler:([^@\n]*)@@[ \t\r]*$")
_SECTION_NAME_RE = re.compile(r"[a-z_]+")
_HEADER_FIELD_RE = re.compile(r"[a-z][a-z0-9_.]*(?: \[[^\]]*\])?")
_UNIT_SUFFIX_RE = re.compile(r" \[[^\]]*\]$")
_NUMBER_RE = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:MiB|%)?")
# Exit statuses of timeout(1) when it had to stop the command (GNU, then TERM/KILL by signal).
_TIMEOUT_STATUSES = frozenset({124, 137, 143})


def _one_line(text: str, limit: int = 160) -> str:
    """Squash text into a short single line for an error message."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _data_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _split_row(line: str, width: int, name_column: int | None, what: str) -> list[str]:
    """Split one ``nvidia-smi`` CSV row into ``width`` fields.

    ``nvidia-smi`` separates fields with ", " and never quotes, so a name that itself contains
    ", " splits into too many fields: the surplus is glued back into the name column.  Names are
    never split on plain spaces ("NVIDIA H100 80GB HBM3" is one field).
    """
    fields = [field.strip() for field in line.split(", ")]
    surplus = len(fields) - width
    if surplus > 0 and name_column is not None:
        fields[name_column : name_column + surplus + 1] = [
            ", ".join(fields[name_column : name_column + surplus + 1])
        ]
    if len(fields) != width:
        raise ProbeError(f"{what}: expected {width} fields, got {len(fields)}: {_one_line(line)!r}")
    return fields


def _is_header(line: str) -> bool:
    fields = [field.strip() for field in line.split(",")]
    return all(_HEADER_FIELD_RE.fullmatch(field) for field in fields)


def _column_map(header: str, required: tuple[str, ...], what: str) -> dict[str, int]:
    """Map column names (units stripped: ``memory.total [MiB]`` -> ``memory.total``) to positions."""
    names = [_UNIT_SUFFIX_RE.sub("", field.strip()) for field in header.split(",")]
    columns = {name: position for position, name in enumerate(names)}
    missing = [name for name in required if name not in columns]
    if missing:
        raise ProbeError(f"{what}: header lacks {', '.join(missing)}: {_one_line(header)!r}")
    return columns


def _is_unknown(value: str) -> bool:
    # nvidia-smi brackets every value it cannot give: [N/A], [Not Supported], [Unknown Error]...
    return (value.startswith("[") and value.endswith("]")) or value.upper() == "N/A"


def _number(value: str, what: str) -> float | None:
    """A number with an optional ``MiB`` / ``%`` unit; ``None`` when nvidia-smi cannot tell."""
    if _is_unknown(value):
        return None
    match = _NUMBER_RE.fullmatch(value)
    if match is None:
        raise ProbeError(f"{what}: not a number: {_one_line(value)!r}")
    return float(match.group(1))


def _integer(value: str, what: str) -> int:
    number = _number(value, what)
    if number is None or number != int(number) or number < 0:
        raise ProbeError(f"{what}: not a non-negative integer: {_one_line(value)!r}")
    return int(number)


def _mib(value: str, what: str) -> int | None:
    number = _number(value, what)
    return None if number is None else max(0, int(number))


def _skip_line(line: str) -> bool:
    # Older drivers print this instead of nothing for an idle GPU; driver warnings (e.g. a
    # corrupt infoROM) are printed but do not replace any row.
    lowered = line.lower()
    return lowered == "no running processes found" or lowered.startswith("warning:")


def parse_gpu_query(text: str) -> tuple[GpuState, ...]:
    """Parse ``nvidia-smi --query-gpu=...`` output into GPUs, in the order printed.

    Accepts ``--format=csv`` (a header with units, values like ``81559 MiB`` and ``100 %``),
    ``csv,noheader`` and ``csv,noheader,nounits``.  With a header the columns are found by name,
    so extra or reordered fields are fine; without one the order must be
    :data:`GPU_QUERY_FIELDS`.  Empty text means no GPUs.  Anything else (an error message such
    as ``Field "x" is not a valid field to query.``) raises :class:`ProbeError`.
    """
    lines = [line for line in _data_lines(text) if not _skip_line(line)]
    if not lines:
        return ()
    what = "nvidia-smi GPU query"
    if _is_header(lines[0]):
        columns = _column_map(lines[0], GPU_QUERY_FIELDS, what)
        width = len(lines[0].split(","))
        rows = lines[1:]
    else:
        columns = {name: position for position, name in enumerate(GPU_QUERY_FIELDS)}
        width = len(GPU_QUERY_FIELDS)
        rows = lines
    gpus = []
    for line in rows:
        fields = _split_row(line, width, columns["name"], what)
        field = {name: fields[columns[name]] for name in GPU_QUERY_FIELDS}
        total = _mib(field["memory.total"], what)
        used = _mib(field["memory.used"], what)
        free = _mib(field["memory.free"], what)
        utilization = _number(field["utilization.gpu"], what)
        if used is None:
            used = total - free if total is not None and free is not None else 0
        gpus.append(
            GpuState(
                index=_integer(field["index"], what),
                uuid=field["uuid"],
                name=field["name"],
                memory_total_mb=total or 0,
                memory_used_mb=max(0, used),
                memory_free_mb=free or 0,
                utilization=min(1.0, max(0.0, (utilization or 0.0) / 100.0)),
            )
        )
    return tuple(gpus)


def parse_compute_apps(text: str) -> tuple[GpuProcess, ...]:
    """Parse ``nvidia-smi --query-compute-apps=...`` output into GPU processes.

    Accepts the header form of ``pid,process_name,used_memory,gpu_uuid`` (``--format=csv``;
    the header says ``used_gpu_memory [MiB]``) and the header-less
    ``pid,used_memory,gpu_uuid`` form (``csv,noheader[,nounits]``).  A GPU without compute
    processes prints only the header, or nothing at all: both give ``()``.
    """
    lines = [line for line in _data_lines(text) if not _skip_line(line)]
    if not lines:
        return ()
    what = "nvidia-smi compute-apps query"
    if _is_header(lines[0]):
        header = lines[0].replace("used_gpu_memory", "used_memory")
        columns = _column_map(header, _APPS_QUERY_FIELDS, what)
        width = len(header.split(","))
        rows = lines[1:]
    else:
        columns = {name: position for position, name in enumerate(_APPS_QUERY_FIELDS)}
        width = len(_APPS_QUERY_FIELDS)
        rows = lines
    name_column = columns.get("process_name")
    processes = []
    for line in rows:
        fields = _split_row(line, width, name_column, what)
        used = _mib(fields[columns["used_memory"]], what)
        processes.append(
            GpuProcess(
                pid=_integer(fields[columns["pid"]], what),
                gpu_uuid=fields[columns["gpu_uuid"]],
                used_memory_mb=used or 0,
                process_name=None if name_column is None else fields[name_column],
            )
        )
    return tuple(processes)


def listed_throughout(
    before: tuple[GpuProcess, ...], after: tuple[GpuProcess, ...]
) -> tuple[GpuProcess, ...]:
    """One probe's GPU processes from its two process lists, taken before and after it read
    ``memory.used``: every process either list shows (per pid and GPU), at the smaller of its
    two figures, 0 where one list lacks it.

    The planner counts as someone else's the memory no listed process accounts for,
    ``memory.used`` minus the listed figures, so a listed figure must not be larger than what
    the process held when the memory was read.  With one list, taken before the read, a job of
    ours that freed its memory (or ended) in between still showed its old figure, and hid as
    much memory no list shows (another container's) until the next probe.  A process whose
    memory went one way between the two lists held at least the smaller figure at the read;
    one listed only before or only after held nothing at the read, or is counted in
    ``memory.used`` as someone else's.  Counting too little for a process only ever moves its
    memory to the unaccounted part, until the next probe: never too little in all.  (One that
    frees its memory and takes it again, all between the two lists, is beyond any probe.)
    Processes keep the order of the first list, then the second's new ones."""
    earlier, later = _per_process(before), _per_process(after)
    merged = [
        GpuProcess(pid, uuid, min(mb, later[pid, uuid][0]) if (pid, uuid) in later else 0, name)
        for (pid, uuid), (mb, name) in earlier.items()
    ]
    merged += [
        GpuProcess(pid, uuid, 0, name)
        for (pid, uuid), (_mb, name) in later.items()
        if (pid, uuid) not in earlier
    ]
    return tuple(merged)


def _per_process(listing: tuple[GpuProcess, ...]) -> dict[tuple[int, str], tuple[int, str | None]]:
    """One process list by pid and GPU: the MiB (a process listed twice on one GPU, summed) and
    the name."""
    found: dict[tuple[int, str], tuple[int, str | None]] = {}
    for process in listing:
        key = (process.pid, process.gpu_uuid)
        mb, name = found.get(key, (0, process.process_name))
        found[key] = (mb + process.used_memory_mb, name)
    return found


def parse_meminfo(text: str) -> tuple[int, int]:
    """``/proc/meminfo`` -> ``(total_mb, available_mb)`` in MiB (kB there means KiB).

    Available is MemAvailable; kernels older than 3.14 lack it, and then MemFree + Buffers +
    Cached is the usual approximation.
    """
    values: dict[str, int] = {}
    for line in _data_lines(text):
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0])
    if "MemTotal" not in values:
        raise ProbeError(f"meminfo has no MemTotal line: {_one_line(text) or 'empty'!r}")
    if "MemAvailable" in values:
        available_kib = values["MemAvailable"]
    elif "MemFree" in values:
        available_kib = sum(values.get(key, 0) for key in ("MemFree", "Buffers", "Cached"))
    else:
        raise ProbeError("meminfo has neither MemAvailable nor MemFree")
    return values["MemTotal"] // 1024, available_kib // 1024


def parse_loadavg(text: str) -> float:
    """``/proc/loadavg`` -> the 1-minute load average."""
    parts = text.split()
    try:
        load = float(parts[0])
    except (IndexError, ValueError):
        raise ProbeError(f"not a /proc/loadavg line: {_one_line(text) or 'empty'!r}") from None
    if load < 0:
        raise ProbeError(f"negative load average: {_one_line(text)!r}")
    return load


def parse_nproc(text: str) -> int:
    """``nproc`` (or ``getconf _NPROCESSORS_ONLN``) output -> the CPU count (at least 1)."""
    stripped = text.strip()
    if not stripped.isdigit() or int(stripped) < 1:
        raise ProbeError(f"not a CPU count: {_one_line(stripped) or 'empty'!r}")
    return int(stripped)


@dataclass(slots=True)
class _Section:
    lines: list[str]
    status: int | None = None

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def failure(self) -> str:
        """The last line a failed command printed: where its error message is."""
        return _one_line(self.lines[-1]) if self.lines else "no output"


def _split_sections(text: str) -> dict[str, _Section]:
    """Cut probe output into sections at its ``@@ssh_scheduler:...@@`` markers.

    Text before the ``begin`` marker (a login banner, rc-file chatter) is ignored.  A marker may
    follow output that lacked a final newline on the same line; that output is kept.
    """
    sections: dict[str, _Section] = {}
    current: _Section | None = None
    began = ended = False
    for line in text.splitlines():
        match = _MARKER_RE.search(line)
        content = line if match is None else line[: match.start()]
        if current is not None and content.strip():
            current.lines.append(content)
        if match is None:
            continue
        words = match.group(1).split()
        if words == ["begin"]:
            sections, current, began, ended = {}, None, True, False
        elif words == ["end"]:
            current, ended = None, True
        elif len(words) == 3 and words[0] == "status" and words[2].isdigit():
            if words[1] in sections:
                sections[words[1]].status = int(words[2])
            current = None
        elif len(words) == 1 and _SECTION_NAME_RE.fullmatch(words[0]):
            current = sections[words[0]] = _Section([])
    if not began:
        raise ProbeError(
            "probe output has no ssh_scheduler markers (did the probe run at all?): "
            f"{_one_line(text) or 'empty'!r}"
        )
    if not ended:
        raise ProbeError("probe output is truncated (no end marker): did the connection drop?")
    return sections


def _required(sections: dict[str, _Section], name: str, hint: str) -> str:
    section = sections.get(name)
    if section is None or section.status is None:
        raise ProbeError(f"probe output has no {name} section: {hint}")
    if section.status != 0:
        raise ProbeError(
            f"probe {name} section failed (exit {section.status}): {section.failure}; {hint}"
        )
    return section.text


def _nvidia_smi(sections: dict[str, _Section], name: str, query: str) -> str:
    """The text of one nvidia-smi section; raises ProbeError (-> ``gpu_error``) if it failed."""
    section = sections.get(name)
    if section is None or section.status is None:
        raise ProbeError(f"nvidia-smi {query} did not report")
    if section.status in _TIMEOUT_STATUSES:
        raise ProbeError(f"nvidia-smi {query} timed out after {_NVSMI_TIMEOUT_S} s")
    if section.status != 0:
        raise ProbeError(f"nvidia-smi {query} failed (exit {section.status}): {section.failure}")
    return section.text


def parse_probe_output(text: str, *, ours_ran: bool = False) -> HostState:
    """Parse the whole output of :data:`PROBE_COMMAND` into a :class:`HostState`.

    Raises :class:`ProbeError` when the output is garbage, truncated, or lacks the CPU count,
    load or memory.  A failing ``nvidia-smi`` does not raise: see the module docstring.
    ``ours_ran``: a job of ours ran on the host during the probe (its agent said so), when one
    process list (:data:`ALONE`) would not do: such output counts as a failed GPU query.
    """
    sections = _split_sections(text)
    cpu_count = parse_nproc(
        _required(sections, "nproc", "neither nproc nor getconf _NPROCESSORS_ONLN works")
    )
    load = parse_loadavg(_required(sections, "loadavg", "is /proc mounted?"))
    mem_total, mem_available = parse_meminfo(_required(sections, "meminfo", "is /proc mounted?"))
    user_section = sections.get("user")
    user = None
    if user_section is not None and user_section.status == 0 and user_section.lines:
        user = user_section.lines[0].strip() or None

    gpus: tuple[GpuState, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    gpu_error = None
    if sections.keys() & {"gpus", "gpu_processes", "gpu_processes_after"}:
        try:  # in the order the probe runs them, so the first failure is the one reported
            before = parse_compute_apps(
                _nvidia_smi(sections, "gpu_processes", "--query-compute-apps")
            )
            gpus = parse_gpu_query(_nvidia_smi(sections, "gpus", "--query-gpu"))
            if _ONE_LIST in sections:  # run ALONE: the one list, as two identical lists give it
                if ours_ran:
                    raise ProbeError("nvidia-smi listed the GPU processes once while a job of ours ran")
                after = before
            else:
                after = parse_compute_apps(
                    _nvidia_smi(sections, "gpu_processes_after", "--query-compute-apps (the second)")
                )
            processes = listed_throughout(before, after)
        except ProbeError as err:
            gpus, processes, gpu_error = (), (), str(err)
    return HostState(
        cpu_count=cpu_count,
        load_1m=load,
        mem_total_mb=mem_total,
        mem_available_mb=mem_available,
        gpus=gpus,
        gpu_processes=processes,
        user=user,
        gpu_error=gpu_error,
    )
