"""Pure rules the coordinator applies: when to halt (``--halt``), and what of an earlier run a
rerun takes up (:class:`Resumable`; read from the journal by :mod:`ssh_scheduler.results.resume`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ssh_scheduler.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HaltPolicy:
    """GNU parallel's ``--halt``: after ``count`` failures (or ``percent`` of all jobs), stop
    starting jobs and either let the running ones finish (``soon``) or kill them (``now``)."""

    when: str = "never"  # never | soon | now
    count: int | None = None
    percent: float | None = None

    def reached(self, failures: int, total: int) -> bool:
        if self.when == "never" or failures == 0:
            return False
        if self.count is not None:
            return failures >= self.count
        return self.percent is not None and failures * 100 >= self.percent * max(total, 1)


def parse_halt(text: str | None) -> HaltPolicy:
    """``now,fail=3``, ``soon,fail=10%``, ``never`` (also GNU parallel's ``now,fail=1`` form)."""
    if not text or text == "never":
        return HaltPolicy()
    match = re.fullmatch(r"(now|soon),fail=(\d+(?:\.\d+)?)(%?)", text.strip())
    if not match:
        raise ConfigError(
            f"--halt {text!r}: expected never, now,fail=N, soon,fail=N or soon,fail=N% "
            f"(e.g. --halt now,fail=1)"
        )
    when, number, percent = match.groups()
    if percent:
        return HaltPolicy(when, percent=float(number))
    if "." in number or int(number) < 1:
        raise ConfigError(f"--halt {text!r}: the failure count must be a whole number >= 1")
    return HaltPolicy(when, count=int(number))


@dataclass(frozen=True, slots=True)
class Resumable:
    """What the journal of an earlier run of the same batch says about one job."""

    job: str
    host: str
    gpus: tuple[int, ...]
