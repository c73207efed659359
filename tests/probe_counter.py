"""Counting the probes a test-cluster host answers: its ``nvidia-smi`` is wrapped so that each
call leaves a line in the login user's home before the simulated one answers.

A probe asks ``--query-compute-apps``, then ``--query-gpu``, then ``--query-compute-apps`` again
(see :data:`ssh_scheduler.machines.probe.PROBE_SCRIPT`); one ``--query-gpu`` line is one probe.
"""

from __future__ import annotations

from tests.cluster import Host

CALLS = "nvidia-smi.calls"


def count_probes(host: Host, *, hide_pids: tuple[int, ...] = (), widen_s: float = 0.0, mark_listed: bool = False) -> None:
    """Wrap ``host``'s simulated ``nvidia-smi`` so that every call is noted in ``~/nvidia-smi.calls``
    (the process query's answer with it).

    ``hide_pids``: processes the process query leaves out, as a real ``nvidia-smi`` in a
    container leaves out another container's processes while ``memory.used`` still counts
    their memory.  ``widen_s``: seconds the process query waits after answering, so that what
    happens between a probe's queries (a process starting, exiting or freeing memory) is
    not left to chance.  ``mark_listed``: each process query leaves ``~/listed.<pid>`` for every
    process it listed, before it waits, so that a job can act on having been listed (free its
    memory while the probe has yet to read it)."""
    real = host.dir / "bin" / "nvidia-smi.real"
    wrapper = host.dir / "bin" / "nvidia-smi"
    if not real.exists():
        wrapper.rename(real)
    hide = "".join(f" | grep -v '^{pid},'" for pid in hide_pids)
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> ~/{CALLS}\n'
        'case "$*" in\n'
        "*--query-compute-apps*)\n"
        f'    out=$({real} "$@"); rc=$?\n'
        f'    [ -z "$out" ] || printf "%s\\n" "$out"{hide} | tee -a ~/{CALLS}\n'
        + (
            '    for pid in $(printf "%s\\n" "$out" | cut -d, -f1); do touch ~/listed.$pid; done\n'
            if mark_listed
            else ""
        )
        +
        f"    sleep {widen_s}\n"
        "    exit $rc ;;\n"
        f'*) exec {real} "$@" ;;\n'
        "esac\n"
    )
    wrapper.chmod(0o755)


def probes(host: Host) -> int:
    """How many probes ``host`` answered so far."""
    path = host.home / CALLS
    if not path.exists():
        return 0
    return sum(line.startswith("--query-gpu") for line in path.read_text().splitlines())


def process_lists(host: Host) -> list[list[str]]:
    """Each process query's answer so far (its lines, in order)."""
    path = host.home / CALLS
    answers: list[list[str]] = []
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.startswith("--query-compute-apps"):
            answers.append([])
        elif line.startswith("--"):
            continue
        elif answers and line.strip():
            answers[-1].append(line)
    return answers
