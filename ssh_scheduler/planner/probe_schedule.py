"""When to probe a host again: a pure, per-host schedule the planner consults (no clock of its
own: every method takes ``now``, seconds on the coordinator's clock).

A probe runs ``nvidia-smi`` and reads ``/proc`` on the host; thousands of short jobs must not
cost thousands of probes.  Rules, per host:

* **One at a time.**  A host never has two probes in flight; a wish for another while one runs
  is remembered and served after it lands.
* **Periodic.**  ``interval`` seconds after the last probe landed (``--probe-interval``): other
  users' load and GPU use change without telling us.
* **On demand, only when it can matter.**  Releasing a job credits back exactly what was
  reserved for it, unless a probe *observed* the job while it ran: then the host's figures
  still count what the job used (RAM missing from MemAvailable, GPU memory kept as a *ghost*,
  see :mod:`ssh_scheduler.planner.allocate`) until a probe requested after the release lands.  So a
  release marks the host *stale* only when a probe landed after the job was placed, and a
  stale host is probed only while jobs wait in the queue (nobody needs the credit otherwise),
  at most once per ``gap`` seconds.  A job too short to be seen by any probe is released
  exactly and costs no probe at all.
* **GPUs other users hold, while jobs wait for a GPU.**  Nothing of ours tells us when another
  user's process frees a GPU: only a probe can see it.  So while a job that needs a GPU waits
  in the queue, a host whose last probe showed GPUs held by others (a process of theirs, or
  memory none of our jobs accounts for) is probed again ``gap`` seconds after the last probe,
  then after twice that, and so on up to ``held_max`` (never beyond ``interval``): a GPU freed
  soon is used within seconds, and one held for hours costs one probe per ``held_max``.  The
  wait starts again from ``gap`` when a probe shows a different set of held GPUs (something
  moved: look again soon) or no job waits for a GPU any more.

Skipping a probe only ever delays a credit (the over-commit invariant of
:mod:`ssh_scheduler.planner.allocate` holds with stale figures: they are conservative).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HostProbes", "ProbeSchedule"]


@dataclass(slots=True)
class HostProbes:
    landed: int = 0
    """Probes that landed on this host so far (a job placed before the last one was observed)."""
    landed_at: float | None = None
    """When the last probe landed (``None``: not known yet; no periodic probe until it is)."""
    in_flight: bool = True  # the first probe (connect and probe) is under way from the start
    stale: bool = False
    """A job a probe observed was released since the last probe was requested."""
    held: tuple[int, ...] = ()
    """The GPUs other users held at the last probe (their indices)."""
    held_looks: int = 0
    """Probes started for held GPUs since the held set last changed (the back-off's exponent)."""


class ProbeSchedule:
    """The probe bookkeeping of every host; the planner owns one."""

    def __init__(self, hosts: list[str], interval: float, gap: float, held_max: float = 8.0) -> None:
        self.interval = interval
        self.gap = gap
        self.held_max = held_max
        self.hosts = {name: HostProbes() for name in hosts}

    def landed(self, host: str, now: float | None, held: tuple[int, ...] = ()) -> None:
        """A probe of ``host`` landed; ``held``: the GPUs it shows other users holding."""
        probes = self.hosts[host]
        probes.in_flight = False
        probes.landed += 1
        if now is not None:
            probes.landed_at = now
        if held != probes.held:
            probes.held = held
            probes.held_looks = 0

    def failed(self, host: str) -> None:
        self.hosts[host].in_flight = False

    def released(self, host: str, landed_at_placement: int) -> None:
        """A job placed when the host had seen ``landed_at_placement`` probes gave its room back."""
        probes = self.hosts[host]
        if probes.landed > landed_at_placement:
            probes.stale = True

    def held_wait(self, host: str) -> float:
        """How long after the last probe a host whose GPUs others hold is looked at again."""
        looks = self.hosts[host].held_looks
        ceiling = min(self.held_max, self.interval)
        # Capped exponent: the ceiling is reached long before, and 2.0**looks could overflow.
        return min(ceiling, self.gap * 2.0 ** min(looks, 32))

    def _due(self, host: str, jobs_waiting: bool, gpu_jobs_waiting: bool) -> float | None:
        probes = self.hosts[host]
        if probes.in_flight:
            return None
        credit = probes.stale and jobs_waiting
        freed = bool(probes.held) and gpu_jobs_waiting
        if probes.landed_at is None:
            # Never timed (a probe that landed without a clock): only a credit can call for one.
            return 0.0 if credit or freed else None
        due = probes.landed_at + self.interval
        if credit:
            due = min(due, probes.landed_at + self.gap)
        if freed:
            due = min(due, probes.landed_at + self.held_wait(host))
        return due

    def next_due(self, usable: list[str], jobs_waiting: bool, gpu_jobs_waiting: bool = False) -> float | None:
        """The earliest time one of the ``usable`` hosts is due a probe, or None.
        ``gpu_jobs_waiting``: some job waiting in the queue needs a GPU."""
        times = [t for h in usable if (t := self._due(h, jobs_waiting, gpu_jobs_waiting)) is not None]
        return min(times) if times else None

    def start_due(self, usable: list[str], jobs_waiting: bool, now: float, gpu_jobs_waiting: bool = False) -> list[str]:
        """The ``usable`` hosts to probe now; each is then in flight and no longer stale (a
        release from now on needs a later probe), and a host whose GPUs others hold waits
        longer for its next look (while no job waits for a GPU, the wait starts over)."""
        start = []
        for host in usable:
            probes = self.hosts[host]
            if not gpu_jobs_waiting:
                probes.held_looks = 0
            due = self._due(host, jobs_waiting, gpu_jobs_waiting)
            if due is not None and due <= now:
                probes.in_flight = True
                probes.stale = False
                if probes.held and gpu_jobs_waiting:
                    probes.held_looks += 1
                start.append(host)
        return start
