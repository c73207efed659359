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


class ProbeSchedule:
    """The probe bookkeeping of every host; the planner owns one."""

    def __init__(self, hosts: list[str], interval: float, gap: float) -> None:
        self.interval = interval
        self.gap = gap
        self.hosts = {name: HostProbes() for name in hosts}

    def landed(self, host: str, now: float | None) -> None:
        probes = self.hosts[host]
        probes.in_flight = False
        probes.landed += 1
        if now is not None:
            probes.landed_at = now

    def failed(self, host: str) -> None:
        self.hosts[host].in_flight = False

    def released(self, host: str, landed_at_placement: int) -> None:
        """A job placed when the host had seen ``landed_at_placement`` probes gave its room back."""
        probes = self.hosts[host]
        if probes.landed > landed_at_placement:
            probes.stale = True

    def _due(self, probes: HostProbes, jobs_waiting: bool) -> float | None:
        if probes.in_flight:
            return None
        if probes.landed_at is None:
            # Never timed (a probe that landed without a clock): only a credit can call for one.
            return 0.0 if probes.stale and jobs_waiting else None
        due = probes.landed_at + self.interval
        if probes.stale and jobs_waiting:
            due = min(due, probes.landed_at + self.gap)
        return due

    def next_due(self, usable: list[str], jobs_waiting: bool) -> float | None:
        """The earliest time one of the ``usable`` hosts is due a probe, or None."""
        times = [t for h in usable if (t := self._due(self.hosts[h], jobs_waiting)) is not None]
        return min(times) if times else None

    def start_due(self, usable: list[str], jobs_waiting: bool, now: float) -> list[str]:
        """The ``usable`` hosts to probe now; each is then in flight and no longer stale (a
        release from now on needs a later probe)."""
        start = []
        for host in usable:
            probes = self.hosts[host]
            due = self._due(probes, jobs_waiting)
            if due is not None and due <= now:
                probes.in_flight = True
                probes.stale = False
                start.append(host)
        return start
