"""Counting the probes a test-cluster host answers: its ``nvidia-smi`` is wrapped so that each
call leaves a line in the login user's home: a process query before the simulated one answers
(its answer after it), a memory query once it has answered (a look counts from its reading).

A probe asks ``--query-compute-apps``, then ``--query-gpu``, then ``--query-compute-apps`` again
(see :data:`ssh_scheduler.machines.probe.PROBE_SCRIPT`), or, run alone (no job of ours on the
host: :data:`~ssh_scheduler.machines.probe.ALONE`), the first two at once; one ``--query-gpu``
line is one probe.  Each line says how its probe ran (``probe=alone`` or ``probe=ordered``),
read from the probe's shell: the nearest process above the call that runs the probe script.
"""

from __future__ import annotations

from ssh_scheduler.machines.probe import ALONE
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
        "mode=ordered; p=$PPID\n"
        'while [ "${p:-1}" -gt 1 ]; do\n'
        '    if grep -q ssh_scheduler "/proc/$p/cmdline" 2>/dev/null; then\n'
        f'        [ "$(tr \'\\0\' \'\\n\' < /proc/$p/cmdline | tail -n 1)" = {ALONE} ] && mode=alone\n'
        "        break\n"
        "    fi\n"
        "    p=$(cut -d' ' -f4 /proc/$p/stat)\n"
        "done\n"
        'case "$*" in\n'
        "*--query-compute-apps*)\n"
        f'    echo "$* probe=$mode" >> ~/{CALLS}\n'
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
        # Noted once answered: a probe counts from when it has read the GPUs.
        f'*) out=$({real} "$@"); rc=$?; echo "$* probe=$mode" >> ~/{CALLS}\n'
        '    [ -z "$out" ] || printf "%s\\n" "$out"; exit $rc ;;\n'
        "esac\n"
    )
    wrapper.chmod(0o755)


def probes(host: Host) -> int:
    """How many probes ``host`` answered so far (that read the GPUs' memory)."""
    path = host.home / CALLS
    if not path.exists():
        return 0
    return sum(line.startswith("--query-gpu") for line in path.read_text().splitlines())


def process_lists(host: Host) -> list[list[str]]:
    """Each process query's answer so far (its lines, in order)."""
    return [answer for _alone, answer in _answers(host)]


def ordered_pairs(host: Host) -> list[tuple[list[str], list[str]]]:
    """The two process lists of each probe that listed the processes around its memory read
    (not run alone), in order."""
    lists = [answer for alone, answer in _answers(host) if not alone]
    return list(zip(lists[::2], lists[1::2], strict=True))


def alone_probes(host: Host) -> int:
    """How many probes ``host`` answered alone (one process list) so far."""
    return sum(line.startswith("--query-gpu") and line.endswith(" probe=alone") for line in _calls(host))


def _calls(host: Host) -> list[str]:
    path = host.home / CALLS
    return path.read_text().splitlines() if path.exists() else []


def _answers(host: Host) -> list[tuple[bool, list[str]]]:
    """Each process query's answer so far, and whether its probe ran alone."""
    answers: list[tuple[bool, list[str]]] = []
    for line in _calls(host):
        if line.startswith("--query-compute-apps"):
            answers.append((line.endswith(" probe=alone"), []))
        elif line.startswith("--"):
            continue
        elif answers and line.strip():
            answers[-1][1].append(line)
    return answers
