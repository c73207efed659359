"""``ssh-scheduler doctor``: check every host at once before a batch, and say how to fix what
fails: reachable, host key known, login works, the remote shell and ``python3``, free disk in the
work root, CPU and memory, GPUs with driver and CUDA versions, round-trip latency.

:func:`parse_report` (the remote check script's output -> facts and problems) is pure; the rest
connects, through the same transport as every other command.  What a host printed is kept as it
came in the report (``--json`` escapes it); the table and the problem lines show every cell
through the one sanitizer (:func:`ssh_scheduler.errors.plain_text`), measured after it, so a
host's escape sequence neither reaches the terminal nor bends the columns.
"""

from __future__ import annotations

import asyncio
import functools
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import (
    AuthenticationError,
    HostKeyError,
    HostUnreachableError,
    TransportError,
    plain_text,
)
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.machines.machine_env import with_setup
from ssh_scheduler.machines.slurm import SlurmSettings
from ssh_scheduler.transport.ssh import connect

__all__ = ["HostReport", "check_hosts", "parse_report", "report_lines"]

MIN_FREE_DISK_MB = 1024
"""Below this the copy forward of a typical project (and its results) is likely to fail."""

@functools.cache
def _check_text() -> str:
    """The check's shell text: ``doctor_check.sh`` beside this module (a file, so shellcheck
    reads it; it travels as one ``sh -c`` argument, its inputs as the arguments after it)."""
    return (Path(__file__).parent / "doctor_check.sh").read_text()


def check_script(workdir: str, setup: tuple[str, ...] = (), slurm: SlurmSettings | None = None) -> str:
    """The remote check, for ``sh``; a ``~`` work root is the remote home.  The machine's
    ``setup:`` runs as before a job (bash, not interactive) and its failure is reported.  A Slurm
    login node also runs sbatch, squeue, scancel and scontrol (after its ``command_prefix``),
    and squeue must reach the controller."""
    recipe = with_setup("true", setup) if setup else ""
    kind, prefix = ("slurm", slurm.command_prefix or "") if slurm is not None else ("", "")
    words = (workdir, recipe, kind, prefix)
    return "sh -c " + shlex.quote(_check_text()) + " doctor " + " ".join(shlex.quote(w) for w in words)


@dataclass(slots=True)
class HostReport:
    host: str
    reachable: bool = False
    host_key: bool = False
    login: bool = False
    shell: str = ""
    python: str = ""
    disk_free_mb: int | None = None
    cpus: int | None = None
    memory_free_mb: int | None = None
    gpus: list[str] = field(default_factory=list)
    cuda: str = ""
    latency_ms: float | None = None
    setup: str = ""
    """``ok``, ``failed`` or empty (the machine has no ``setup:``)."""
    slurm: str = ""
    """A Slurm login node's Slurm version, once its commands ran (empty otherwise)."""
    problems: list[str] = field(default_factory=list)
    """Each: what is wrong, then ``; fix: ...``."""

    @property
    def ok(self) -> bool:
        return not self.problems


def _int(value: str) -> int | None:
    return int(value) if value.strip().isdigit() else None


def parse_report(report: HostReport, text: str) -> None:
    """Fill ``report`` from the check script's output and add what is wrong, with its fix."""
    python_error = ""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        match key:
            case "shell":
                report.shell = value.strip()
            case "python":
                report.python = value.strip()
            case "python_error":
                python_error = value.strip() or "python3 failed"
            case "disk_free_kb":
                kb = _int(value)
                report.disk_free_mb = kb // 1024 if kb is not None else None
            case "cpus":
                report.cpus = _int(value)
            case "mem_free_kb":
                kb = _int(value)
                report.memory_free_mb = kb // 1024 if kb is not None else None
            case "gpu":
                report.gpus.append(value.strip())
            case "cuda":
                report.cuda = value.strip()
            case "setup":
                report.setup = "ok"
            case "slurm":
                report.slurm = value.strip()
            case "slurm_error":
                report.problems.append(
                    f"Slurm does not answer on this login node ({value.strip()}); fix: put sbatch and squeue on "
                    "the PATH (slurm: command_prefix: 'module load slurm', say) and check that squeue works there"
                )
            case "setup_error":
                report.setup = "failed"
                report.problems.append(
                    f"setup failed: {value.strip()}; fix: correct the machine's setup: lines "
                    "(they run in a non-interactive bash before every job)"
                )
    if not report.python:
        report.problems.append(
            f"python3 does not run ({python_error or 'no answer'}); fix: install it (Debian/Ubuntu: "
            "apt install python3), the agent that runs the jobs needs it"
        )
    if report.disk_free_mb is None:
        report.problems.append("cannot read free disk in the work root; fix: check the machine's workdir")
    elif report.disk_free_mb < MIN_FREE_DISK_MB:
        report.problems.append(
            f"only {report.disk_free_mb} MB free in the work root; fix: free space or set workdir to a bigger disk"
        )
    if any("failed" in gpu.lower() or "error" in gpu.lower() for gpu in report.gpus):
        report.problems.append(f"nvidia-smi fails ({report.gpus[0]}); fix: check the NVIDIA driver")


async def check_host(machine: Machine, *, accept_new: bool = False) -> HostReport:
    report = HostReport(machine.name)
    try:
        transport = await connect(machine, accept_new=accept_new)
    except HostKeyError as exc:
        report.reachable = True
        report.problems.append(f"{exc}")
        return report
    except AuthenticationError as exc:
        report.reachable = report.host_key = True
        report.problems.append(f"login failed: {exc}; fix: check username and ssh_key_path, or ssh-copy-id")
        return report
    except (HostUnreachableError, TransportError) as exc:
        report.problems.append(f"unreachable: {exc}; fix: check ip, port and that sshd runs there")
        return report
    report.reachable = report.host_key = report.login = True
    try:
        began = time.monotonic()
        await transport.exec("true")
        report.latency_ms = round((time.monotonic() - began) * 1000, 1)
        result = await transport.exec(check_script(machine.workdir, machine.setup, machine.slurm))
        parse_report(report, result.stdout.decode(errors="replace"))
    except TransportError as exc:
        report.problems.append(f"the checks did not finish: {exc}")
    finally:
        await transport.close()
    return report


async def check_hosts(machines: list[Machine], *, accept_new: bool = False) -> list[HostReport]:
    """Every host at once; one report each, in the order given."""
    return list(await asyncio.gather(*(check_host(m, accept_new=accept_new) for m in machines)))


def _mark(value: bool) -> str:
    return "yes" if value else "NO"


def report_lines(reports: list[HostReport]) -> list[str]:
    """One table row per host, then each problem with its fix."""
    rows = [("host", "reachable", "key", "login", "python3", "disk free", "cpus", "mem free", "GPUs", "CUDA", "setup", "latency")]
    for r in reports:
        rows.append((
            r.host, _mark(r.reachable), _mark(r.host_key), _mark(r.login), r.python or ("-" if not r.login else "NO"),
            f"{r.disk_free_mb} MB" if r.disk_free_mb is not None else "-",
            str(r.cpus) if r.cpus is not None else "-",
            f"{r.memory_free_mb} MB" if r.memory_free_mb is not None else "-",
            str(len(r.gpus)) if r.login else "-",
            r.cuda or "-",
            r.setup or "-",
            f"{r.latency_ms:g} ms" if r.latency_ms is not None else "-",
        ))
    cells = [[plain_text(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    for r in reports:
        host = plain_text(r.host)
        if r.slurm:
            lines.append(f"{host}: a Slurm login node ({plain_text(r.slurm)}): sbatch, squeue, scancel and scontrol run")
        lines.extend(f"{host}: {plain_text(problem)}" for problem in r.problems)
    return lines


def report_json(reports: list[HostReport]) -> list[dict[str, Any]]:
    return [{**asdict(r), "ok": r.ok} for r in reports]
