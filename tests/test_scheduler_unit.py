"""Scheduler rules that need no host: outage counting, quarantine, halting."""

from __future__ import annotations

from ssh_scheduler.batch import Job
from ssh_scheduler.config import Machine
from ssh_scheduler.policy import parse_halt
from ssh_scheduler.scheduler import Batch, BatchOptions


def make_batch() -> Batch:
    machines = [Machine(name=n, host=f"{n}.example") for n in ("h1", "h2")]
    return Batch([Job("b.sh.1", "true", 1)], machines, BatchOptions(), out=lambda _: None, err=lambda _: None)


def test_one_outage_counts_once_however_many_jobs_it_took() -> None:
    batch = make_batch()
    host = batch.hosts["h1"]
    for _ in range(5):  # five running jobs lost in the same outage
        batch._host_failed(host, "connection lost")
    assert host.failures == 1 and not host.quarantined


def test_three_outages_in_a_row_quarantine_the_host() -> None:
    batch = make_batch()
    host = batch.hosts["h1"]
    for outage in range(3):
        host.down = None  # it came back in between
        batch._host_failed(host, f"outage {outage}")
    assert host.quarantined and not host.usable


def test_halt_policies() -> None:
    assert not parse_halt(None).reached(10, 10)
    assert parse_halt("now,fail=2").reached(2, 100)
    assert not parse_halt("soon,fail=2").reached(1, 100)
    assert parse_halt("soon,fail=10%").reached(10, 100)
    assert not parse_halt("soon,fail=10%").reached(9, 100)
