"""A skip is a failure where nothing the suite needs can be missing: under CI (``CI=true``),
and under ``scripts/test`` once it has installed every package the suite needs (it sets
``SSH_SCHEDULER_NO_SKIPS=1``), whether or not ``CI=true``.  There a skip means a check that did
not run, never a machine that lacks something.  A plain ``pytest`` on a developer's machine
keeps its skips.  (xfail is strict, see pyproject.toml: an xfail that passes fails too.)
Loaded by tests/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

from tests.cluster import in_ci

NO_SKIPS = "SSH_SCHEDULER_NO_SKIPS"


def skips_fail() -> bool:
    return in_ci() or os.environ.get(NO_SKIPS) == "1"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.skipped and skips_fail() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        why = "CI=true" if in_ci() else f"{NO_SKIPS}=1 (scripts/test installed everything)"
        report.outcome = "failed"
        report.longrepr = f"{why} turns this skip into a failure: {reason}"
    return report
