"""What the probe's parsers say about output they cannot use, word for word (a host's refusal or
its ``gpu_error`` is all the user learns of why it is not used), and how they read output at the
edges: values nvidia-smi cannot give, a reading over 100 %, a load of 0, one CPU, a kernel without
MemAvailable, stray or malformed markers."""

from __future__ import annotations

import pytest

from ssh_scheduler.errors import ProbeError
from ssh_scheduler.machines.host_state import GpuProcess, GpuState
from ssh_scheduler.machines.probe import (
    parse_compute_apps,
    parse_gpu_query,
    parse_loadavg,
    parse_meminfo,
    parse_nproc,
    parse_probe_output,
)

GPU_QUERY = "nvidia-smi GPU query"
APPS_QUERY = "nvidia-smi compute-apps query"
GPU_HEADER = "index, uuid, name, memory.total [MiB], memory.used [MiB], memory.free [MiB], utilization.gpu [%]"


def refusal(parse: object, text: str) -> str:
    assert callable(parse)
    with pytest.raises(ProbeError) as err:
        parse(text)
    return str(err.value)


# ---------------------------------------------------------------- nvidia-smi's queries

GPU_QUERY_REFUSALS = {
    # the row's fields, each in turn not a number
    "0, U, N, lots, 0, 100, 0": f"{GPU_QUERY}: not a number: 'lots'",
    "0, U, N, 100, lots, 100, 0": f"{GPU_QUERY}: not a number: 'lots'",
    "0, U, N, 100, 0, lots, 0": f"{GPU_QUERY}: not a number: 'lots'",
    "0, U, N, 100, 0, 100, busy": f"{GPU_QUERY}: not a number: 'busy'",
    "x, U, N, 100, 0, 100, 0": f"{GPU_QUERY}: not a number: 'x'",
    # half a bracket is not nvidia-smi's "cannot tell"
    "0, U, N, [100, 0, 100, 0": f"{GPU_QUERY}: not a number: '[100'",
    "0, U, N, 100], 0, 100, 0": f"{GPU_QUERY}: not a number: '100]'",
    # an index must be a whole number of at least 0, and known
    "-1, U, N, 100, 0, 100, 0": f"{GPU_QUERY}: not a non-negative integer: '-1'",
    "1.5, U, N, 100, 0, 100, 0": f"{GPU_QUERY}: not a non-negative integer: '1.5'",
    "[N/A], U, N, 100, 0, 100, 0": f"{GPU_QUERY}: not a non-negative integer: '[N/A]'",
    # too few fields (a name is glued back only when there are too many)
    "0, U, N, 100, 0, 100": f"{GPU_QUERY}: expected 7 fields, got 6: '0, U, N, 100, 0, 100'",
    # a header without the columns the probe needs names each one missing
    "index, name, memory.total [MiB], memory.used [MiB], memory.free [MiB]\n0, N, 1, 0, 1": (
        f"{GPU_QUERY}: header lacks uuid, utilization.gpu: "
        "'index, name, memory.total [MiB], memory.used [MiB], memory.free [MiB]'"
    ),
}


@pytest.mark.parametrize("text", GPU_QUERY_REFUSALS)
def test_a_gpu_query_it_cannot_read_says_what_and_where(text: str) -> None:
    assert refusal(parse_gpu_query, text) == GPU_QUERY_REFUSALS[text]


APPS_REFUSALS = {
    "abc, 1, GPU-a": f"{APPS_QUERY}: not a number: 'abc'",
    "[N/A], 1, GPU-a": f"{APPS_QUERY}: not a non-negative integer: '[N/A]'",
    "1, lots, GPU-a": f"{APPS_QUERY}: not a number: 'lots'",
    "pid, process_name, gpu_uuid\n1, python, GPU-a": (
        f"{APPS_QUERY}: header lacks used_memory: 'pid, process_name, gpu_uuid'"
    ),
}


@pytest.mark.parametrize("text", APPS_REFUSALS)
def test_a_process_list_it_cannot_read_says_what_and_where(text: str) -> None:
    assert refusal(parse_compute_apps, text) == APPS_REFUSALS[text]


def test_a_long_line_is_shown_on_one_line_up_to_160_characters() -> None:
    # Whitespace squashed to single spaces; 160 characters shown whole, more cut to 157 and "...".
    assert refusal(parse_nproc, "x" * 80 + " \t\n " + "y" * 79) == f"not a CPU count: '{'x' * 80} {'y' * 79}'"
    assert refusal(parse_nproc, "x" * 161) == f"not a CPU count: '{'x' * 157}...'"


def test_values_nvidia_smi_cannot_give_read_as_unknown() -> None:
    """``N/A`` unbracketed, in any case, as some drivers print it; used memory unknown with free
    memory unknown too is 0, never a guess; a reading over 100 % is a whole GPU."""
    assert parse_gpu_query("0, U, N, 100, N/A, 40, n/a\n1, V, N, 100, [N/A], [N/A], 150\n") == (
        GpuState(0, "U", "N", 100, 60, 40, 0.0),
        GpuState(1, "V", "N", 100, 0, 0, 1.0),
    )
    assert parse_compute_apps("7, N/A, GPU-a") == (GpuProcess(7, "GPU-a", 0),)


# ---------------------------------------------------------------- /proc and nproc

PROC_REFUSALS = [
    (parse_nproc, "", "not a CPU count: 'empty'"),
    (parse_nproc, "0", "not a CPU count: '0'"),
    (parse_loadavg, "", "not a /proc/loadavg line: 'empty'"),
    (parse_loadavg, "high 0.1 0.1 1/100 42", "not a /proc/loadavg line: 'high 0.1 0.1 1/100 42'"),
    (parse_loadavg, "-0.5 0.1 0.1 1/100 42", "negative load average: '-0.5 0.1 0.1 1/100 42'"),
    (parse_meminfo, "", "meminfo has no MemTotal line: 'empty'"),
    (parse_meminfo, "MemFree: 10 kB", "meminfo has no MemTotal line: 'MemFree: 10 kB'"),
    (parse_meminfo, "MemTotal: 10 kB\nBuffers: 5 kB", "meminfo has neither MemAvailable nor MemFree"),
]


@pytest.mark.parametrize(("parse", "text", "message"), PROC_REFUSALS)
def test_a_proc_file_it_cannot_read_is_refused_in_words(parse: object, text: str, message: str) -> None:
    assert refusal(parse, text) == message


def test_the_smallest_good_values_pass() -> None:
    assert parse_nproc("1\n") == 1
    assert parse_loadavg("0.00 0.00 0.00 1/100 42\n") == 0.0


def test_meminfo_lines_without_a_number_are_skipped_and_missing_parts_count_nothing() -> None:
    # Before Linux 3.14: MemFree + Buffers + Cached, a missing one counted as 0 (not 1 KiB).
    text = "MemTotal: 4096 kB\nHugePages:\nWeird: many kB\nMemFree: 1023 kB\nCached: 1024 kB\n"
    assert parse_meminfo(text) == (4, 1)


# ---------------------------------------------------------------- the whole probe's output


def probe(*sections: tuple[str, str, int | str], end: bool = True) -> str:
    """Probe output with these (name, body, status) sections, after a host's CPU, load and memory."""
    lines = ["@@ssh_scheduler:begin@@"]
    base = (
        ("user", "alice", 0),
        ("nproc", "4", 0),
        ("loadavg", "0.5 0.4 0.3 1/100 42", 0),
        ("meminfo", "MemTotal: 8192 kB\nMemAvailable: 4096 kB", 0),
    )
    for name, body, status in (*base, *sections):
        lines.append(f"@@ssh_scheduler:{name}@@")
        lines += [body] if body else []
        lines.append(f"@@ssh_scheduler:status {name} {status}@@")
    if end:
        lines.append("@@ssh_scheduler:end@@")
    return "\n".join(lines) + "\n"


def without(text: str, name: str) -> str:
    """``text`` without the section ``name`` (its marker, its lines, its status)."""
    lines = text.splitlines()
    start = lines.index(f"@@ssh_scheduler:{name}@@")
    stop = next(i for i, line in enumerate(lines) if line.startswith(f"@@ssh_scheduler:status {name} "))
    return "\n".join(lines[:start] + lines[stop + 1 :]) + "\n"


def failed(text: str, name: str, output: str) -> str:
    lines = text.splitlines()
    start = lines.index(f"@@ssh_scheduler:{name}@@")
    stop = next(i for i, line in enumerate(lines) if line.startswith(f"@@ssh_scheduler:status {name} "))
    return "\n".join([*lines[: start + 1], output, f"@@ssh_scheduler:status {name} 1@@", *lines[stop + 1 :]]) + "\n"


def test_output_without_markers_or_without_its_end_is_refused_in_words() -> None:
    assert refusal(parse_probe_output, "") == (
        "probe output has no ssh_scheduler markers (did the probe run at all?): 'empty'"
    )
    assert refusal(parse_probe_output, "sh: 1: Syntax error\n") == (
        "probe output has no ssh_scheduler markers (did the probe run at all?): 'sh: 1: Syntax error'"
    )
    assert refusal(parse_probe_output, probe(end=False)) == (
        "probe output is truncated (no end marker): did the connection drop?"
    )


def test_a_missing_or_failed_host_section_says_which_and_what_to_check() -> None:
    assert refusal(parse_probe_output, without(probe(), "nproc")) == (
        "probe output has no nproc section: neither nproc nor getconf _NPROCESSORS_ONLN works"
    )
    assert refusal(parse_probe_output, without(probe(), "loadavg")) == (
        "probe output has no loadavg section: is /proc mounted?"
    )
    assert refusal(parse_probe_output, failed(probe(), "loadavg", "cat: /proc/loadavg: No such file or directory")) == (
        "probe loadavg section failed (exit 1): cat: /proc/loadavg: No such file or directory; is /proc mounted?"
    )


def test_the_login_name_is_known_only_from_a_user_section_that_succeeded() -> None:
    assert parse_probe_output(probe()).user == "alice"
    assert parse_probe_output(without(probe(), "user")).user is None
    assert parse_probe_output(failed(probe(), "user", "id: cannot find name for user ID 1234")).user is None


def test_malformed_or_stray_markers_never_break_the_parse() -> None:
    """A marker with nothing in it, a status that is not a number, and text between a status and
    the next section are ignored; a section whose status cannot be read has none."""
    text = probe().replace(
        "@@ssh_scheduler:status user 0@@",
        "@@ssh_scheduler:status user 0@@\nchatter from a login script\n@@ssh_scheduler:@@",
    )
    state = parse_probe_output(text)
    assert (state.user, state.cpu_count, state.mem_total_mb) == ("alice", 4, 8)
    text = probe().replace("@@ssh_scheduler:status nproc 0@@", "@@ssh_scheduler:status nproc zero@@")
    assert refusal(parse_probe_output, text) == (
        "probe output has no nproc section: neither nproc nor getconf _NPROCESSORS_ONLN works"
    )


@pytest.mark.parametrize(
    ("present", "error"),
    [
        ("gpus", "nvidia-smi --query-compute-apps did not report"),
        ("gpu_processes", "nvidia-smi --query-gpu did not report"),
        ("gpu_processes_after", "nvidia-smi --query-compute-apps did not report"),
    ],
)
def test_any_gpu_section_means_nvidia_smi_is_there(present: str, error: str) -> None:
    """One GPU section without the others is a GPU probe that broke off, reported as such:
    never read as a host without GPUs."""
    bodies = {"gpus": "0, U, N, 100, 0, 100, 0", "gpu_processes": "", "gpu_processes_after": ""}
    state = parse_probe_output(probe((present, bodies[present], 0)))
    assert (state.gpus, state.gpu_error) == ((), error)
