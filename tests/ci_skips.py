"""Under CI (``CI=true``) a skipped test is a failure: CI must run everything, and a skip there
means the runner lacks something the suite needs (sshd, root, ...).  Loaded by tests/conftest.py."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.cluster import in_ci


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"CI=true turns this skip into a failure: {reason}"
    return report
