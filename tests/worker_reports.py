"""Reports a pytest-xdist worker can send: execnet refuses a string that is not valid UTF-8, and
a refused report kills its worker, with every test it had not run yet.  The suite's hostile-text
tests log lone surrogates (undecodable bytes from a host, kept by ``surrogateescape``), so each
report's captured sections and failure text are made encodable first, the surrogates written as
``\\udcff`` escapes, before the worker's own hook sends them."""

from __future__ import annotations

import pytest


def encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    report.sections = [(title, encodable(content)) for title, content in report.sections]
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):
        path, line, reason = longrepr
        report.longrepr = (encodable(str(path)), line, encodable(reason))
    elif longrepr is not None:
        text = str(longrepr)
        if encodable(text) != text:
            report.longrepr = encodable(text)
