"""The text around the results table: the heading (when, which commit, the environment, the
load), and under the table each scenario's title, its own lines, the CPU each tool used, the
wall's phases and its notes, then the errors and the profiles' top frames."""

from __future__ import annotations

import datetime as dt
import statistics
from collections.abc import Sequence
from typing import Any

from bench_driver.records import Scenario


def heading(env: dict[str, Any], started_utc: dt.datetime, quick: bool, rounds: int, total_s: float) -> list[str]:
    match = env.get("ssh_match") or {}
    if match.get("same"):
        kex = (f"key exchange {match['kex']}, cipher {match['cipher']}: ours, and every OpenSSH peer "
               f"(-o KexAlgorithms/Ciphers, checked with ssh -v) and asyncssh floor pinned to it")
    elif match:
        kex = f"key exchange NOT matched: ours {match.get('ours')}, OpenSSH pinned {match.get('openssh')}"
    else:
        kex = "key exchange: not read (no SSH scenario ran)"
    return [
        f"ssh_scheduler benchmark  {started_utc:%Y-%m-%d %H:%M} UTC  measured: {env['measured']}"
        + f"  {'quick, ' if quick else ''}{rounds} round{'s' if rounds > 1 else ''} for every tool, total {total_s:.0f} s",
        f"environment: {env['cores']} cores ({env['cpu_model']}), {env['mem_total']} RAM, {env['os']}, kernel {env['kernel']}, "
        f"Python {env['python']}, asyncssh {env['asyncssh']}, {env['parallel']}, {env['pdsh']}, {env['openssh'].split(',')[0]}",
        f"load average (1/5/15 min): start {env['loadavg_start']}, end {env['loadavg_end']}"
        "  (other tenants of this machine count too; see machine_busy_pct per run in the JSON)",
        kex,
        "filesystem: " + disk_words(env.get("disk")),
        "a target holds only if its worst round holds it; 'per round' = its value in each round "
        "(a ratio: the two tools' walls measured back to back in that round)",
    ]  # fmt: skip


def scenario_lines(s: Scenario) -> list[str]:
    """``  [sid] line`` for the title, the scenario's own first lines, CPU per tool and per job,
    the wall's phases, its own last lines and its notes."""
    extras = s.report_first(s)
    cpu = []
    for t in s.tools:
        good = t.good()
        if good:
            cl = statistics.median(r.cpu_s for r in good)
            ho = statistics.median(r.hosts_cpu_s for r in good)
            busy = statistics.median(r.machine_busy_pct for r in good)
            cpu.append(f"{t.name} {cl:.2f}+{ho:.2f} s ({busy:.0f}% busy)")
    if cpu:
        extras.append("CPU client+hosts, medians (machine busy, all tenants): " + "; ".join(cpu))
    per_job = [
        f"{t.name} {st['client_ms_per_job']:.2f} + {st['hosts_ms_per_job']:.2f}"
        for t in s.tools
        if "client_ms_per_job" in (st := t.stats())
    ]
    if per_job:
        extras.append(
            "CPU per job, ms, coordinator + hosts (start-up included): " + "; ".join(per_job)
        )
    phases = []
    for t in s.tools:
        good = [r for r in t.good() if "first_job_started_s" in r.extra]
        if good:
            med = {
                k: statistics.median(r.extra[k] for r in good)
                for k in ("first_job_started_s", "jobs_span_s", "after_last_job_s")
            }
            phases.append(
                f"{t.name} {med['first_job_started_s']:.2f} + {med['jobs_span_s']:.2f} + {med['after_last_job_s']:.2f} s"
            )
    if phases:
        extras.append(
            "wall = until 1st job starts + jobs span + after last job ends (medians): "
            + "; ".join(phases)
        )
    extras += warm_lines(s)
    extras += s.report_last(s)
    return [f"  [{s.sid}] {line}" for line in [s.title, *extras, *s.notes]]


def warm_lines(s: Scenario) -> list[str]:
    """What each warm call reused, read from the hosts: the SSH logins each call made (new TCP
    connections the hosts accepted), and the connections still open after the cold call."""
    out = []
    for warm in (t for t in s.tools if t.warm_of):
        cold = s.tool(warm.warm_of or "")
        logins = [int(r.extra["ssh_logins"]) for r in warm.good() if "ssh_logins" in r.extra]
        cold_logins = [int(r.extra["ssh_logins"]) for r in cold.good() if "ssh_logins" in r.extra]
        held = [int(r.extra.get("ssh_connections_held_after", 0)) for r in cold.good()]
        if not logins or not cold_logins:
            continue  # a loopback cluster: the hosts share this machine's counters
        if any(held) or min(logins) < min(cold_logins):
            verdict = "the warm call reused what the cold one left"
        else:
            verdict = ("nothing survived the cold call (no connection held after it: no hub in this "
                       "code), so the warm call is a second cold one")
        out.append(f"{warm.name}: SSH logins per call {logins} (cold {cold_logins}), connections "
                   f"held after the cold call {held}: {verdict}")  # fmt: skip
    return out


def summary(done: Sequence[Scenario], errors: dict[str, str]) -> list[str]:
    """Everything printed under the table: each scenario's lines, the errors, the profiles."""
    out = [line for s in done for line in scenario_lines(s)]
    out += [f"  [{sid}] ERROR: {msg}" for sid, msg in errors.items()]
    for s in done:
        for name, prof in s.computed.get("profiles", {}).items():
            out += ["", f"profile [{s.sid}] {name}: {', '.join(prof['files'])}"]
            for line in prof["top"][2:]:
                if "cli.py" not in line and "__main__.py" not in line:
                    out.append("  " + line)
    return out


def disk_words(disk: dict[str, Any] | None) -> str:
    """What the runs wrote on (bench_driver/disk.py), in words."""
    if not disk:
        return "not recorded"
    journal = {True: "with a journal", False: "WITHOUT a journal", None: ""}[disk.get("journal")]
    where = (f"a fresh one on a loop device{' (direct I/O)' if disk.get('direct_io') else ''}"
             if disk.get("mode") == "loop" else f"the work folder's own ({disk.get('mode')})")  # fmt: skip
    return f"{disk.get('fstype', '?')} {journal}, {where}; mount options {disk.get('options', '?')}"
