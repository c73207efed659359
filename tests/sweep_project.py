"""The user's folder for the function-sweep and joblib tests: it holds their module
``sweep_work.py`` (copied forward to the hosts; results kept there), and the cluster's machine
files as the Executor takes them."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster

HERE = Path(__file__).parent


@pytest.fixture(name="project")
def project_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The user's folder, holding their module ``sweep_work.py``: copied forward, results kept there."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(HERE / "sweep_work.py", folder / "sweep_work.py")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(folder)
    yield folder
    sys.modules.pop("sweep_work", None)


def machines(cluster: Cluster) -> list[str]:
    return [str(p) for p in cluster.machine_files]
