"""The suite's own rules: a skip is a failure under CI, and the test data is part of the repo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.captures import H100, capture

REPO = Path(__file__).resolve().parents[1]


def test_a_skip_is_a_failure_under_ci(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("from tests.ci_skips import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "def test_skips():\n    pytest.skip('no sshd here')\n\n"
        "@pytest.mark.xfail(reason='known')\ndef test_xfails():\n    assert False\n\n"
        "def test_passes():\n    pass\n"
    )

    def run(ci: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:asyncio", "-q", "-rfs", str(tmp_path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env={**os.environ, "CI": ci, "PYTHONPATH": str(REPO)},
        )

    ci = run("true")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "1 failed, 1 passed, 1 xfailed" in ci.stdout
    assert "CI=true turns this skip into a failure: no sshd here" in ci.stdout
    local = run("")
    assert local.returncode == 0, local.stdout + local.stderr
    assert "1 passed, 1 skipped, 1 xfailed" in local.stdout


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
