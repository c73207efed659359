"""The suite's own rules: a skip is a failure under CI and wherever scripts/test installed everything,
an xfail that passes fails, and the test data is part of the repo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.captures import H100, capture

REPO = Path(__file__).resolve().parents[1]


SAMPLE = (
    "import pytest\n\n"
    "def test_skips():\n    pytest.skip('no sshd here')\n\n"
    "@pytest.mark.xfail(reason='known')\ndef test_xfails():\n    assert False\n\n"
    "def test_passes():\n    pass\n"
)


def run_sample(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """pytest on tmp_path's tests, with the suite's skip rule loaded and ``env`` set (the
    rule's switches otherwise unset)."""
    if not (tmp_path / "conftest.py").exists():
        (tmp_path / "conftest.py").write_text("from tests.ci_skips import pytest_runtest_makereport  # noqa: F401\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "SSH_SCHEDULER_NO_SKIPS")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfs", *args, str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**clean, **env, "PYTHONPATH": str(REPO)},
    )


def test_a_skip_is_a_failure_under_ci(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(SAMPLE)
    ci = run_sample(tmp_path, "-p", "no:asyncio", CI="true")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "1 failed, 1 passed, 1 xfailed" in ci.stdout
    assert "CI=true turns this skip into a failure: no sshd here" in ci.stdout
    local = run_sample(tmp_path, "-p", "no:asyncio")
    assert local.returncode == 0, local.stdout + local.stderr
    assert "1 passed, 1 skipped, 1 xfailed" in local.stdout


def test_a_skip_is_a_failure_wherever_scripts_test_installed_everything(tmp_path: Path) -> None:
    """The guard does not wait for CI=true: scripts/test, having installed every package the
    suite needs, says so, and then a skip is a check that did not run."""
    (tmp_path / "test_x.py").write_text(SAMPLE)
    done = run_sample(tmp_path, "-p", "no:asyncio", SSH_SCHEDULER_NO_SKIPS="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed, 1 xfailed" in done.stdout
    assert "scripts/test installed everything) turns this skip into a failure: no sshd here" in done.stdout
    script = (REPO / "scripts" / "test").read_text()
    assert "export SSH_SCHEDULER_NO_SKIPS=1" in script


def test_scripts_test_installs_what_the_checks_that_could_vanish_need() -> None:
    """The probe's zsh case and the strace check of what importing asyncssh runs skip (fail
    under CI) without their tool: scripts/test installs both."""
    script = (REPO / "scripts" / "test").read_text()
    packages = re.search(r"^packages=\((.*)\)$", script, re.MULTILINE)
    assert packages is not None
    assert {"zsh", "strace"} <= set(packages.group(1).split())


def test_an_xfail_that_passes_fails_the_suite(tmp_path: Path) -> None:
    """xfail is strict, as the suite's own configuration says (an XPASS is a fixed bug whose
    marker must go)."""
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.xfail(reason='was a bug')\ndef test_fixed():\n    pass\n"
    )
    # The suite's configuration (pyproject.toml), with its rootdir and plugins, on this one file.
    result = run_sample(tmp_path, "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout and "XPASS(strict)" in result.stdout, result.stdout


def test_captures_are_in_the_repository_and_no_test_reaches_outside_it() -> None:
    assert H100.is_relative_to(REPO)
    names = sorted(p.name for p in H100.iterdir())
    assert len(names) == 19 and "nvsmi_csv_busy.txt" in names
    assert capture("nvsmi_csv_nounits_busy.txt")[1].startswith("0, GPU-7f24e6cb-")
    outside = re.compile(r"""["'](/work/|/home/)|\.parents?\[\d\]\s*/\s*["']shared["']|REPO\.parent""")
    offenders = [
        f"{path.relative_to(REPO)}:{n}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert offenders == []


HOSTILE_REPORTS = (
    "import logging\n\n"
    "BYTES = b'host said \\xff\\x1b'.decode('utf-8', 'surrogateescape')\n\n"
    "def test_logs_and_fails():\n"
    "    logging.getLogger('x').warning('seen %s', BYTES)\n"
    "    print(BYTES)\n"
    "    assert BYTES == 'other'\n\n"
    "def test_logs_and_passes():\n"
    "    logging.getLogger('x').warning('seen %s', BYTES)\n\n"
    "def test_skips_saying_it():\n"
    "    import pytest\n"
    "    pytest.skip('no host ' + BYTES)\n\n"
    "def test_after():\n    pass\n"
)


def test_a_worker_reports_hostile_text_instead_of_dying(tmp_path: Path) -> None:
    """scripts/test runs the suite on pytest-xdist workers, which send each report over execnet:
    a lone surrogate in a test's log, output or failure (the hostile-text tests log them) made
    the worker die with every test it had left.  tests/worker_reports.py makes reports sendable."""
    (tmp_path / "conftest.py").write_text(
        "from tests.worker_reports import pytest_runtest_logreport  # noqa: F401\n"
    )
    (tmp_path / "test_x.py").write_text(HOSTILE_REPORTS)
    result = run_sample(tmp_path, "-p", "no:asyncio", "-n", "2", "--dist", "loadfile")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 2 passed, 1 skipped" in result.stdout, result.stdout
    assert "INTERNALERROR" not in result.stdout + result.stderr
    assert "host said \\udcff" in result.stdout  # the failure's text, its surrogate escaped
    assert "no host host said \\udcff" in result.stdout  # the skip's reason (-rs), escaped too
