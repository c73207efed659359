from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from ssh_scheduler.errors import ProbeError
from ssh_scheduler.machines.host_state import GpuProcess, GpuState, HostState
from ssh_scheduler.machines.probe import (
    PROBE_COMMAND,
    PROBE_SCRIPT,
    listed_throughout,
    parse_compute_apps,
    parse_gpu_query,
    parse_loadavg,
    parse_meminfo,
    parse_nproc,
    parse_probe_output,
)
from tests.captures import H100 as H100_CAPTURES
from tests.captures import capture as h100_capture
from tests.cluster import skip_or_fail

# ---------------------------------------------------------------- real captures


def capture(name: str) -> tuple[str, int]:
    """A capture's raw output and exit status."""
    _, text, status = h100_capture(name)
    return text, status


def output(name: str) -> str:
    return capture(name)[0]


UUID = "GPU-7f24e6cb-4b33-6b85-55fd-4c3170fa56d0"
H100 = "NVIDIA H100 80GB HBM3"
IDLE_GPU = GpuState(0, UUID, H100, 81559, 0, 81079, 0.0)
BUSY_GPU = GpuState(0, UUID, H100, 81559, 21491, 59589, 1.0)

# ---------------------------------------------------------------- GPU query


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("nvsmi_csv_idle.txt", IDLE_GPU),
        ("nvsmi_csv_busy.txt", BUSY_GPU),
        ("nvsmi_csv_after.txt", IDLE_GPU),
        ("nvsmi_csv_nounits_idle.txt", IDLE_GPU),
        ("nvsmi_csv_nounits_busy.txt", BUSY_GPU),
        ("nvsmi_csv_nounits_after.txt", IDLE_GPU),
    ],
)
def test_gpu_query_captures(name: str, expected: GpuState) -> None:
    text, status = capture(name)
    assert status == 0
    assert parse_gpu_query(text) == (expected,)


@pytest.mark.parametrize("moment", ["idle", "busy", "after"])
def test_gpu_query_csv_noheader_and_nounits_agree(moment: str) -> None:
    with_header = output(f"nvsmi_csv_{moment}.txt")
    # The same state without header but with units, as --format=csv,noheader prints it (the
    # 12-field capture cut down to the probe's 7 fields).
    noheader = "\n".join(", ".join(line.split(", ")[:7]) for line in with_header.splitlines()[1:])
    nounits = output(f"nvsmi_csv_nounits_{moment}.txt")
    assert parse_gpu_query(with_header) == parse_gpu_query(noheader) == parse_gpu_query(nounits)


@pytest.mark.parametrize(
    "name",
    [
        "bad_query.txt",
        "nvsmi_plain_idle.txt",
        "nvsmi_plain_busy.txt",
        "nvsmi_xml_busy.xml",
        "host.txt",
    ],
)
def test_gpu_query_rejects_what_is_not_a_gpu_list(name: str) -> None:
    # The XML capture is the raw file (no "$ command" / "[exit N]" lines).
    text = (H100_CAPTURES / name).read_text() if name.endswith(".xml") else output(name)
    with pytest.raises(ProbeError) as info:
        parse_gpu_query(text)
    assert "\n" not in str(info.value)


def test_bad_query_capture_is_a_failure() -> None:
    text, status = capture("bad_query.txt")
    assert status != 0
    with pytest.raises(ProbeError, match="bogus_field"):
        parse_gpu_query(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ()),
        ("\n\n", ()),
        (
            "index, uuid, name, memory.total [MiB], memory.used [MiB], memory.free [MiB], "
            "utilization.gpu [%]\n",
            (),
        ),
        # Names with spaces stay whole; a name with ", " is glued back together.
        (
            "3, GPU-b, Tesla V100-SXM2-16GB, 16160, 100, 16060, 7\n",
            (GpuState(3, "GPU-b", "Tesla V100-SXM2-16GB", 16160, 100, 16060, 0.07),),
        ),
        (
            "1, GPU-c, Odd, Name GPU, 24576, 0, 24000, 50\n",
            (GpuState(1, "GPU-c", "Odd, Name GPU", 24576, 0, 24000, 0.5),),
        ),
        # Unknown values: utilization 0, memory 0 (nothing is free on a GPU we cannot measure).
        (
            "0, GPU-d, NVIDIA GH200, [N/A], [N/A], [N/A], [Not Supported]\n",
            (GpuState(0, "GPU-d", "NVIDIA GH200", 0, 0, 0, 0.0),),
        ),
        (
            "0, GPU-e, X, 16000, [N/A], 10000, [N/A]\n",
            (GpuState(0, "GPU-e", "X", 16000, 6000, 10000, 0.0),),
        ),
        # Columns in another order, plus ones we ignore, are mapped by the header.
        (
            "name, pstate, utilization.gpu [%], memory.free [MiB], memory.used [MiB], "
            "memory.total [MiB], uuid, index\n"
            "NVIDIA A10, P0, 30 %, 20000 MiB, 2000 MiB, 23028 MiB, GPU-f, 1\n"
            "NVIDIA A10, P8, 0 %, 22000 MiB, 0 MiB, 23028 MiB, GPU-g, 0\n",
            (
                GpuState(1, "GPU-f", "NVIDIA A10", 23028, 2000, 20000, 0.3),
                GpuState(0, "GPU-g", "NVIDIA A10", 23028, 0, 22000, 0.0),
            ),
        ),
        # A driver warning does not hide the rows.
        (
            "WARNING: infoROM is corrupted at gpu 0000:00:06.0\n0, U, N, 100, 0, 100, 0\n",
            (GpuState(0, "U", "N", 100, 0, 100, 0.0),),
        ),
    ],
)
def test_gpu_query_forms(text: str, expected: tuple[GpuState, ...]) -> None:
    assert parse_gpu_query(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "No devices were found\n",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
        "0, GPU-a, H100, 81559, 0, 81079\n",  # a field short
        "x, GPU-a, H100, 81559, 0, 81079, 0\n",  # index not a number
        "0, GPU-a, H100, lots, 0, 81079, 0\n",
        "index, uuid, name\n0, GPU-a, H100\n",  # header without the memory columns
    ],
)
def test_gpu_query_errors(text: str) -> None:
    with pytest.raises(ProbeError):
        parse_gpu_query(text)


# ---------------------------------------------------------------- compute apps


def apps_outputs(name: str) -> tuple[str, str]:
    """The nvsmi_apps_* captures hold two commands' output: the header form (4 fields) and the
    header-less nounits form (3 fields)."""
    lines = output(name).splitlines()
    with_header = [line for line in lines if len(line.split(", ")) == 4]
    noheader = [line for line in lines if len(line.split(", ")) == 3]
    assert len(with_header) + len(noheader) == len(lines)
    return "\n".join(with_header), "\n".join(noheader)


@pytest.mark.parametrize(
    ("name", "expected_pids"),
    [("nvsmi_apps_idle.txt", ()), ("nvsmi_apps_after.txt", ()), ("nvsmi_apps_busy.txt", (618,))],
)
def test_compute_apps_captures(name: str, expected_pids: tuple[int, ...]) -> None:
    with_header, noheader = apps_outputs(name)
    named = parse_compute_apps(with_header)
    bare = parse_compute_apps(noheader)
    assert tuple(p.pid for p in named) == tuple(p.pid for p in bare) == expected_pids
    if expected_pids:
        assert named == (GpuProcess(618, UUID, 21482, "python3"),)
        assert bare == (GpuProcess(618, UUID, 21482, None),)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ()),
        ("No running processes found\n", ()),
        (
            "pid, process_name, used_gpu_memory [MiB], gpu_uuid\n"
            "12, /opt/my app/bin/python, 100 MiB, GPU-a\n"
            "13, weird, name, [N/A], GPU-b\n",
            (
                GpuProcess(12, "GPU-a", 100, "/opt/my app/bin/python"),
                GpuProcess(13, "GPU-b", 0, "weird, name"),
            ),
        ),
        (
            "1, 10, GPU-a\n2, 20, GPU-a\n3, 30, GPU-b\n",
            (GpuProcess(1, "GPU-a", 10), GpuProcess(2, "GPU-a", 20), GpuProcess(3, "GPU-b", 30)),
        ),
    ],
)
def test_compute_apps_forms(text: str, expected: tuple[GpuProcess, ...]) -> None:
    assert parse_compute_apps(text) == expected


@pytest.mark.parametrize("text", ["618, GPU-a\n", "pid, used_memory\n1, 2\n", "abc, 1, GPU-a\n"])
def test_compute_apps_errors(text: str) -> None:
    with pytest.raises(ProbeError):
        parse_compute_apps(text)


# ---------------------------------------------------------------- the two process lists of a probe


A, B = "GPU-a", "GPU-b"


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        # A process in both lists counts at the smaller figure, whichever list has it.
        ((GpuProcess(1, A, 500),), (GpuProcess(1, A, 900),), (GpuProcess(1, A, 500),)),
        ((GpuProcess(1, A, 900),), (GpuProcess(1, A, 500),), (GpuProcess(1, A, 500),)),
        # Listed before only (it ended, or freed its memory and left the list), or after only
        # (it started): 0 MiB, but still on its GPU.
        ((GpuProcess(1, A, 900),), (), (GpuProcess(1, A, 0),)),
        ((), (GpuProcess(2, B, 700, "python3"),), (GpuProcess(2, B, 0, "python3"),)),
        # One pid on two GPUs is two processes; one listed twice on a GPU holds the sum.
        (
            (GpuProcess(1, A, 100), GpuProcess(1, B, 200), GpuProcess(1, A, 300)),
            (GpuProcess(1, B, 250), GpuProcess(1, A, 50), GpuProcess(1, A, 400)),
            (GpuProcess(1, A, 400), GpuProcess(1, B, 200)),
        ),
        # The first list's order, then what only the second shows; names kept.
        (
            (GpuProcess(3, A, 30, "c"), GpuProcess(1, A, 10, "a")),
            (GpuProcess(2, A, 20, "b"), GpuProcess(1, A, 10, "a"), GpuProcess(3, A, 30, "c")),
            (GpuProcess(3, A, 30, "c"), GpuProcess(1, A, 10, "a"), GpuProcess(2, A, 0, "b")),
        ),
        ((), (), ()),
    ],
)
def test_a_probe_counts_each_process_at_the_smaller_of_its_two_figures(
    before: tuple[GpuProcess, ...], after: tuple[GpuProcess, ...], expected: tuple[GpuProcess, ...]
) -> None:
    """What a process held when the probe read memory.used is at least the smaller of what the
    lists before and after showed (0 where one lacks it): never more is counted as ours."""
    assert listed_throughout(before, after) == expected


def test_a_probe_run_alone_counts_its_one_process_list_as_it_is() -> None:
    text = probe_text(
        gpus=capture("nvsmi_csv_nounits_busy.txt"), apps=(f"618, 21482, {UUID}\n700, 100, {UUID}", 0), one_list=True
    )
    state = parse_probe_output(text)
    assert state.gpu_error is None
    assert state.gpu_processes == (GpuProcess(618, UUID, 21482), GpuProcess(700, UUID, 100))


def test_one_process_list_while_a_job_of_ours_ran_leaves_a_cpu_host() -> None:
    """The agent lists the processes once only while it holds no job; output that says so
    beside a job of ours (whatever printed it) is not trusted for the GPUs."""
    text = probe_text(gpus=capture("nvsmi_csv_nounits_busy.txt"), apps=(f"618, 21482, {UUID}", 0), one_list=True)
    state = parse_probe_output(text, ours_ran=True)
    assert state.gpus == () and state.gpu_processes == ()
    assert state.gpu_error == "nvidia-smi listed the GPU processes once while a job of ours ran"


def test_probe_output_reads_both_process_lists() -> None:
    state = parse_probe_output(
        probe_text(
            gpus=capture("nvsmi_csv_nounits_busy.txt"),
            apps=(f"618, 21482, {UUID}\n700, 100, {UUID}", 0),
            apps_after=(f"800, 50, {UUID}\n618, 9000, {UUID}", 0),
        )
    )
    assert state.gpu_error is None
    assert state.gpu_processes == (
        GpuProcess(618, UUID, 9000),
        GpuProcess(700, UUID, 0),
        GpuProcess(800, UUID, 0),
    )


@pytest.mark.parametrize(
    ("after", "reason"),
    [
        (("Failed to initialize NVML", 9), r"^nvidia-smi --query-compute-apps \(the second\) failed \(exit 9\): Failed"),
        (("", 124), r"^nvidia-smi --query-compute-apps \(the second\) timed out after 10 s$"),
        (("garbage here", 0), "^nvidia-smi compute-apps query: expected 3 fields, got 1"),
    ],
)
def test_a_failing_second_process_list_leaves_a_cpu_host(after: tuple[str, int], reason: str) -> None:
    state = parse_probe_output(
        probe_text(gpus=capture("nvsmi_csv_nounits_busy.txt"), apps=("", 0), apps_after=after)
    )
    assert state.gpus == () and state.gpu_processes == ()
    assert state.gpu_error is not None and re.search(reason, state.gpu_error), state.gpu_error


def test_a_probe_without_its_second_process_list_leaves_a_cpu_host() -> None:
    text = probe_text(gpus=capture("nvsmi_csv_nounits_busy.txt"), apps=("", 0))
    text = re.sub(r"@@ssh_scheduler:gpu_processes_after@@\n.*?0@@\n", "", text, flags=re.S)
    state = parse_probe_output(text)
    assert state.gpus == ()
    assert state.gpu_error == "nvidia-smi --query-compute-apps (the second) did not report"


# ---------------------------------------------------------------- /proc and nproc


def host_parts() -> tuple[str, str, str]:
    """nproc, /proc/loadavg and the head of /proc/meminfo as printed in host.txt."""
    lines = output("host.txt").splitlines()
    nproc = lines[1]
    loadavg = next(
        line for line in lines if re.fullmatch(r"[\d.]+ [\d.]+ [\d.]+ \d+/\d+ \d+", line)
    )
    meminfo = "\n".join(line for line in lines if re.fullmatch(r"\w+:\s+\d+ kB", line))
    return nproc, loadavg, meminfo


def test_host_capture_parts() -> None:
    nproc, loadavg, meminfo = host_parts()
    assert parse_nproc(nproc) == 16
    assert parse_loadavg(loadavg) == 0.52
    # 131981020 kB and 131480092 kB, in MiB.
    assert parse_meminfo(meminfo) == (128887, 128398)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("MemTotal: 2048 kB\nMemFree: 1024 kB\nMemAvailable: 1536 kB\n", (2, 1)),
        # Before Linux 3.14 there is no MemAvailable.
        ("MemTotal: 10240 kB\nMemFree: 1024 kB\nBuffers: 1024 kB\nCached: 2048 kB\n", (10, 4)),
    ],
)
def test_meminfo(text: str, expected: tuple[int, int]) -> None:
    assert parse_meminfo(text) == expected


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (parse_meminfo, ""),
        (parse_meminfo, "MemFree: 10 kB\n"),
        (parse_meminfo, "MemTotal: 10 kB\n"),
        (parse_loadavg, ""),
        (parse_loadavg, "load\n"),
        (parse_nproc, ""),
        (parse_nproc, "0\n"),
        (parse_nproc, "sixteen\n"),
    ],
)
def test_proc_errors(parser: object, text: str) -> None:
    assert callable(parser)
    with pytest.raises(ProbeError):
        parser(text)


# ---------------------------------------------------------------- whole probe output


def probe_text(
    *,
    gpus: tuple[str, int] | None = None,
    apps: tuple[str, int] | None = None,
    apps_after: tuple[str, int] | None = None,
    user: str = "alice",
    banner: str = "",
    one_list: bool = False,
) -> str:
    """Probe output as PROBE_COMMAND prints it, built from the real host capture (the second
    process list the same as the first unless given; ``one_list``: none, as run ALONE)."""
    nproc, loadavg, meminfo = host_parts()
    parts = [banner, "@@ssh_scheduler:begin@@"]

    def section(name: str, body: str, status: int = 0) -> None:
        parts.append(f"@@ssh_scheduler:{name}@@")
        if body:
            parts.append(body.rstrip("\n"))
        parts.append(f"@@ssh_scheduler:status {name} {status}@@")

    section("user", user)
    section("nproc", nproc)
    section("loadavg", loadavg)
    section("meminfo", meminfo)
    if gpus is not None:
        section("gpus", *gpus)
    if apps is not None:
        section("gpu_processes", *apps)
    if one_list:
        section("one_process_list", "")
    elif apps_after is not None or (apps is not None and gpus is not None):
        section("gpu_processes_after", *(apps_after or apps or ("", 0)))
    parts.append("@@ssh_scheduler:end@@")
    return "\n".join(part for part in parts if part) + "\n"


def test_probe_output_without_nvidia_smi() -> None:
    assert parse_probe_output(probe_text()) == HostState(
        cpu_count=16, load_1m=0.52, mem_total_mb=128887, mem_available_mb=128398, user="alice"
    )


def test_probe_output_busy_gpu_attributes_process_memory() -> None:
    state = parse_probe_output(
        probe_text(
            gpus=capture("nvsmi_csv_nounits_busy.txt"),
            apps=(apps_outputs("nvsmi_apps_busy.txt")[1], 0),
        )
    )
    assert state.gpu_error is None
    assert state.gpus == (BUSY_GPU,)
    assert state.gpu_processes == (GpuProcess(618, UUID, 21482),)
    assert sum(p.used_memory_mb for p in state.gpu_processes if p.gpu_uuid == UUID) == 21482


def test_probe_output_idle_gpu() -> None:
    state = parse_probe_output(probe_text(gpus=capture("nvsmi_csv_nounits_idle.txt"), apps=("", 0)))
    assert state.gpus == (IDLE_GPU,)
    assert state.gpu_processes == ()


@pytest.mark.parametrize(
    ("gpus", "apps", "reason"),
    [
        (("bad", 2), ("", 0), r"^nvidia-smi --query-gpu failed \(exit 2\): bad$"),
        (None, None, "bad_query"),  # filled in from the capture below
        (("No devices were found", 6), ("", 0), "No devices were found"),
        (None, ("", 124), "timed out after 10 s"),  # the first query timed out: no second
        (("0, U, N, 1, 0, 1, 0", 0), ("garbage here", 0), "compute-apps query"),
        (("0, U, N, 1, 0, 1, 0", 0), ("Failed to initialize NVML", 9), "exit 9"),
        (("0, U, N, 1, 0, 1, 0", 0), None, "did not report"),
        (("Unable to determine the device handle", 0), ("", 0), "GPU query"),
    ],
)
def test_failing_nvidia_smi_leaves_a_cpu_host(
    gpus: tuple[str, int] | None, apps: tuple[str, int] | None, reason: str
) -> None:
    if gpus is None:
        gpus, apps, reason = capture("bad_query.txt"), ("", 0), "bogus_field"
    state = parse_probe_output(probe_text(gpus=gpus, apps=apps))
    assert state.gpus == () and state.gpu_processes == ()
    assert state.gpu_error is not None and "\n" not in state.gpu_error
    assert re.search(reason, state.gpu_error), state.gpu_error
    assert state.cpu_count == 16 and state.mem_available_mb == 128398


def test_probe_output_ignores_banner_and_glued_markers() -> None:
    text = probe_text(banner="Welcome to gpu1!\n@@ssh_scheduler:meminfo@@\nMemTotal: 1 kB")
    # Output that lacked a final newline gets the next marker on its own line.
    text = text.replace("alice\n@@ssh_scheduler:status", "alice@@ssh_scheduler:status")
    state = parse_probe_output(text)
    assert state.user == "alice" and state.mem_total_mb == 128887


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no ssh_scheduler markers"),
        ("hello world\n", "no ssh_scheduler markers"),
        ("sh: 1: Syntax error: Unterminated quoted string\n", "no ssh_scheduler markers"),
        ("@@ssh_scheduler:begin@@\n@@ssh_scheduler:end@@\n", "no nproc section"),
    ],
)
def test_garbage_probe_output(text: str, message: str) -> None:
    with pytest.raises(ProbeError, match=message) as info:
        parse_probe_output(text)
    assert "\n" not in str(info.value)


def test_truncated_probe_output() -> None:
    text = probe_text(gpus=capture("nvsmi_csv_nounits_busy.txt"), apps=("618, 21482, U", 0))
    parse_probe_output(text)
    cut_points = [m.start() for m in re.finditer("\n", text)][:-1]
    for cut in cut_points:
        with pytest.raises(ProbeError):
            parse_probe_output(text[:cut])


@pytest.mark.parametrize(
    ("section", "message"),
    [("meminfo", "no meminfo section: is /proc mounted"), ("loadavg", "no loadavg section")],
)
def test_missing_section(section: str, message: str) -> None:
    text = re.sub(
        rf"@@ssh_scheduler:{section}@@\n.*?@@ssh_scheduler:status {section} 0@@\n",
        "",
        probe_text(),
        flags=re.S,
    )
    with pytest.raises(ProbeError, match=message):
        parse_probe_output(text)


def test_failed_section_reports_its_output() -> None:
    text = re.sub(
        r"@@ssh_scheduler:meminfo@@\n.*?@@ssh_scheduler:status meminfo 0@@",
        "@@ssh_scheduler:meminfo@@\n"
        "cat: /proc/meminfo: No such file or directory\n@@ssh_scheduler:status meminfo 1@@",
        probe_text(),
        flags=re.S,
    )
    with pytest.raises(ProbeError, match=r"meminfo section failed \(exit 1\): cat: /proc"):
        parse_probe_output(text)


# ---------------------------------------------------------------- the probe command itself


def test_probe_command_is_one_line_for_any_login_shell() -> None:
    assert "\n" not in PROBE_COMMAND and "!" not in PROBE_COMMAND
    assert PROBE_COMMAND.startswith("sh -c '")
    for query in (
        "--query-gpu=index,uuid,name,memory.total,memory.used,memory.free,utilization.gpu "
        "--format=csv,noheader,nounits",
        "--query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits",
    ):
        assert query in PROBE_SCRIPT
    assert "timeout" in PROBE_SCRIPT and "getconf _NPROCESSORS_ONLN" in PROBE_SCRIPT


def hermetic_bin(tmp_path: Path, nvidia_smi: str | None) -> str:
    """A PATH holding only the tools the probe uses, and a fake nvidia-smi if given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "id", "nproc", "getconf", "cat", "timeout", "true", "sleep"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    if nvidia_smi is not None:
        script = bin_dir / "nvidia-smi"
        script.write_text("#!/bin/sh\n" + nvidia_smi)
        script.chmod(0o755)
    return str(bin_dir)


SHELLS = ["/bin/sh", "/bin/dash", "/bin/bash", "/bin/zsh"]
"""Every shell the probe is run with here; one that is missing skips its case (a failure
under CI, and once scripts/test has installed them all), never drops it unseen."""


ORDERED = "sh -c " + shlex.quote(PROBE_SCRIPT)
"""The probe as the agent runs it while a job of ours runs: its processes listed around the read."""


def run_probe(path: str, shell: str = "/bin/sh", command: str = PROBE_COMMAND) -> str:
    result = subprocess.run(
        [shell, "-c", command],
        env={"PATH": path, "HOME": "/"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_probe_command_runs_here(tmp_path: Path, shell: str) -> None:
    if not Path(shell).exists():
        skip_or_fail(f"{shell} is not installed (scripts/test installs it)")
    state = parse_probe_output(run_probe(hermetic_bin(tmp_path, None), shell))
    assert state.cpu_count >= 1
    assert 0 < state.mem_available_mb <= state.mem_total_mb
    assert state.gpus == () and state.gpu_error is None
    assert state.user


def test_probe_command_with_fake_nvidia_smi(tmp_path: Path) -> None:
    gpus = output("nvsmi_csv_nounits_busy.txt")
    apps = apps_outputs("nvsmi_apps_busy.txt")[1]
    fake = (
        'case "$1" in\n'
        f"--query-gpu=*) printf '%s\\n' '{gpus.strip()}' ;;\n"
        f"--query-compute-apps=*) printf '%s\\n' '{apps.strip()}' ;;\n"
        "*) exit 3 ;;\n"
        "esac\n"
    )
    state = parse_probe_output(run_probe(hermetic_bin(tmp_path, fake)))
    assert state.gpus == (BUSY_GPU,)
    assert state.gpu_processes == (GpuProcess(618, UUID, 21482),)
    assert state.gpu_error is None


@pytest.mark.parametrize(
    ("failing", "calls"),
    [
        ("", "--query-compute-apps --query-gpu --query-compute-apps"),
        ("--query-compute-apps", "--query-compute-apps"),
        ("--query-gpu", "--query-compute-apps --query-gpu"),
    ],
)
def test_the_probe_lists_processes_reads_memory_lists_again_and_stops_at_a_failure(
    tmp_path: Path, failing: str, calls: str
) -> None:
    """The order the GPU accounting relies on while a job of ours runs; and after a failing
    query (a wedged driver would make every later one wait out its timeout) the probe asks
    nothing more."""
    log = tmp_path / "calls"
    fake = (
        f'echo "${{1%%=*}}" >>{log}\n'
        f'case "${{1%%=*}}" in {failing or "none"}) echo wedged; exit 3 ;; esac\n'
        'case "$1" in --query-gpu=*) echo "0, U, N, 100, 0, 100, 0" ;; esac\n'
    )
    state = parse_probe_output(run_probe(hermetic_bin(tmp_path, fake), command=ORDERED))
    assert log.read_text().split() == calls.split()
    assert (state.gpu_error is None) == (not failing), state.gpu_error


@pytest.mark.parametrize(
    ("failing", "reason"),
    [
        ("", None),
        ("--query-compute-apps", r"^nvidia-smi --query-compute-apps failed \(exit 3\): wedged$"),
        ("--query-gpu", r"^nvidia-smi --query-gpu failed \(exit 3\): wedged$"),
    ],
)
def test_alone_the_probe_lists_the_processes_once_beside_the_read(
    tmp_path: Path, failing: str, reason: str | None
) -> None:
    """What ``PROBE_COMMAND`` (a dry run's look) and an agent holding no job run: one process
    list and one memory read, both asked whatever the other answers (at once: below)."""
    log = tmp_path / "calls"
    fake = (
        f'echo "${{1%%=*}}" >>{log}\n'
        f'case "${{1%%=*}}" in {failing or "none"}) echo wedged; exit 3 ;; esac\n'
        f'case "$1" in --query-gpu=*) echo "0, {UUID}, N, 100, 60, 40, 0" ;;'
        f' --query-compute-apps=*) echo "618, 50, {UUID}" ;; esac\n'
    )
    state = parse_probe_output(run_probe(hermetic_bin(tmp_path, fake)))
    assert sorted(log.read_text().split()) == ["--query-compute-apps", "--query-gpu"]
    if reason is None:
        assert state.gpu_error is None
        assert state.gpus == (GpuState(0, UUID, "N", 100, 60, 40, 0.0),)
        assert state.gpu_processes == (GpuProcess(618, UUID, 50),)
    else:
        assert state.gpus == () and state.gpu_processes == ()
        assert state.gpu_error is not None and re.search(reason, state.gpu_error), state.gpu_error


def test_alone_the_process_list_and_the_memory_read_run_at_once(tmp_path: Path) -> None:
    """The two queries meet at a FIFO, the memory query writing and the process query reading:
    each one's open waits for the other's.  Asked one after the other, the first waits until
    the probe's own timeout stops it, and the probe reports that."""
    meet = tmp_path / "meet"
    os.mkfifo(meet)
    fake = (
        'case "$1" in\n'
        f'--query-gpu=*) echo met > {meet}; echo "0, {UUID}, N, 100, 0, 100, 0" ;;\n'
        f"*) read -r _ < {meet} ;;\n"
        "esac\n"
    )
    state = parse_probe_output(run_probe(hermetic_bin(tmp_path, fake)))
    assert state.gpu_error is None
    assert [gpu.uuid for gpu in state.gpus] == [UUID]


def test_probe_command_with_failing_nvidia_smi(tmp_path: Path) -> None:
    message = output("bad_query.txt").strip()
    fake = f"echo '{message}' >&2\nexit 2\n"
    state = parse_probe_output(run_probe(hermetic_bin(tmp_path, fake)))
    assert state.gpus == ()
    # The process list is asked for first (see probe.PROBE_SCRIPT), so its failure is reported.
    assert state.gpu_error == f"nvidia-smi --query-compute-apps failed (exit 2): {message}"
