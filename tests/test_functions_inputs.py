"""A Python call's inputs on a host (executors/python_call.py), with a stand-in for the host's
session: what the job's folder gets, and calls staged at once while the host goes away."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConnectionLostError
from ssh_scheduler.executors.base import RunRequest, ShellCommand
from ssh_scheduler.executors.python_call import runner_files, work_inputs
from ssh_scheduler.executors.stage_plan import StagePlan
from ssh_scheduler.executors.transfer import HostCache
from ssh_scheduler.jobs.python_call import CALL_FOLDER, PAYLOAD, RUNNER, PythonCall


class Host:
    """What HostCache asks of a session: ``have`` (which keys the host lacks) and ``put``.  The
    first ``have`` waits until a second one came, then fails as a lost link does."""

    name = "h1"
    root = "/srv/root"

    def __init__(self) -> None:
        self.asked: list[list[str]] = []
        self.second = asyncio.Event()

    async def have(self, keys: list[str], sizes: dict[str, int]) -> list[str]:
        self.asked.append(keys)
        if len(self.asked) == 1:
            await self.second.wait()
            raise ConnectionLostError("h1: connection lost")
        self.second.set()
        await asyncio.sleep(0)  # the first fails now, while this one is under way
        return []

    async def put(self, files: object) -> list[str]:
        return []


def call(tmp_path: Path, name: str, staged: StagePlan | None = None) -> RunRequest:
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(name.encode())
    return RunRequest(name=name, work=PythonCall(path, f"{name:0>64}-r", len(name)), jobdir=f"/srv/root/jobs/{name}", staged=staged)


async def test_a_call_gets_the_runner_cloudpickle_and_its_pickle_beside_its_copy_forward(tmp_path: Path) -> None:
    host = Host()
    host.asked.append([])  # (no failure here)
    cache = HostCache(host)  # type: ignore[arg-type]
    forward = StagePlan([("train.py", "a" * 64 + "-r"), (f"{CALL_FOLDER}/call.pickle", "b" * 64 + "-r")], ["data", CALL_FOLDER])
    request = call(tmp_path, "c1", forward)
    staged = await work_inputs(cache, request)
    assert staged is not None
    rels = [rel for rel, _ in staged.files]
    assert rels == ["train.py", *(f.rel for f in runner_files()), PAYLOAD]
    # a copied-forward file in our folder would be linked over ours: left out
    assert dict(staged.files)[PAYLOAD] == request.work.key  # type: ignore[union-attr]
    assert RUNNER in rels and any(rel.endswith("/cloudpickle/cloudpickle.py") for rel in rels)
    assert staged.dirs == ["data"]
    shell = RunRequest(name="s", work=ShellCommand("true"), jobdir="/srv/root/jobs/s", staged=forward)
    assert await work_inputs(cache, shell) is forward  # a shell command: its copy forward alone


async def test_calls_staged_at_once_on_a_host_that_goes_away_each_end_as_lost(tmp_path: Path) -> None:
    """Two calls share the runner's files and differ by their pickle.  The first asks the host
    for everything, the second only for its pickle; the host goes away under the first: both
    end with the lost link (a lost host: requeued), never with an error of the cache's own."""
    host = Host()
    cache = HostCache(host)  # type: ignore[arg-type]
    first = asyncio.ensure_future(work_inputs(cache, call(tmp_path, "c1")))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(work_inputs(cache, call(tmp_path, "c2")))
    for task in (first, second):
        with pytest.raises(ConnectionLostError, match="h1: connection lost"):
            await task
    assert len(host.asked[0]) == len(runner_files()) + 1 and len(host.asked[1]) == 1
