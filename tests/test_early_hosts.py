"""Hosts started early (early_hosts.py): connected and their agents started while the batch is
set up, then taken by the batch instead of opened again; closed when the batch is refused; left
alone when the results folder belongs to an earlier run (its token, its agents).  In-process,
against the hostile server, which logs every command and agent request it gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ssh_scheduler.coordinator import early_hosts
from ssh_scheduler.coordinator.batch import Batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.early_hosts import EarlyHosts
from ssh_scheduler.errors import TransferError
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.forward import ForwardPolicy
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.results.journal import batch_token
from tests.hostile_server import AGENT_PREFIX, HostileServer, hostile_server


@pytest.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[HostileServer]:
    async with hostile_server(tmp_path) as server:
        server.folds_probe = True
        yield server


def options(tmp_path: Path, **changes: object) -> BatchOptions:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    return BatchOptions(
        needs=Needs(cpus=0.01, memory_mb=1, gpus=0, gpu_memory_mb=0), gpus_explicit=True,
        results_dir=tmp_path / "results", base_dir=src, probe_interval=3600, **changes,  # type: ignore[arg-type]
    )


async def started(hostile: HostileServer) -> EarlyHosts:
    early = EarlyHosts([hostile.machine()], accept_new=False, keepalive=None, lease=60, max_connecting=8)
    early.start()
    await early.agents_starting()
    return early


def agents(hostile: HostileServer) -> list[str]:
    return [c for c in hostile.commands if c.startswith(AGENT_PREFIX)]


async def test_the_batch_takes_the_host_started_early(hostile: HostileServer, tmp_path: Path) -> None:
    early = await started(hostile)
    summary = await Batch([Job("j", "echo hi", 1)], [hostile.machine()], options(tmp_path), early=early).run()
    assert summary.outcomes["j"].ok
    (agent,) = agents(hostile)  # one connection and one agent: the early one
    assert early.token in agent and batch_token(tmp_path / "results") == early.token
    tags = [r.TAG for r in hostile.requests]
    assert tags[0] == "hello" and "run" in tags and "probe" not in tags


async def test_a_refused_batch_closes_the_hosts_started_early_with_the_same_error(
    hostile: HostileServer, tmp_path: Path
) -> None:
    opts = options(tmp_path, forward=ForwardPolicy(max_files=1))
    for name in ("a", "b", "c"):
        (opts.base_dir / name).write_text(name)
    with pytest.raises(TransferError) as plain:
        await Batch([Job("j", "true", 1)], [hostile.machine()], opts).run()
    assert agents(hostile) == []  # refused before connecting
    early = await started(hostile)
    with pytest.raises(TransferError) as refused:
        await Batch([Job("j", "true", 1)], [hostile.machine()], opts, early=early).run()
    assert str(refused.value) == str(plain.value)
    assert "would send 3 files" in str(refused.value)
    # The host was connected and its agent starting (or asked to end at once): nothing ran.
    assert len(agents(hostile)) <= 1 and "run" not in [r.TAG for r in hostile.requests]
    assert early.take(hostile.machine().name) is None and not (tmp_path / "results" / "j").exists()


async def test_a_folder_an_earlier_run_took_meanwhile_keeps_that_runs_token(
    hostile: HostileServer, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    assert early_hosts.suits(results)
    early = await started(hostile)
    first = await Batch([Job("one", "true", 1)], [hostile.machine()], options(tmp_path)).run()
    assert first.outcomes["one"].ok
    token = batch_token(results)
    assert token is not None and token != early.token and not early_hosts.suits(results)
    second = await Batch([Job("two", "true", 2)], [hostile.machine()], options(tmp_path), early=early).run()
    assert second.outcomes["two"].ok
    started_agents = agents(hostile)
    assert len(started_agents) == 3 and early.token in started_agents[0]
    assert token in started_agents[2] and batch_token(results) == token  # reattached as a rerun does


async def test_a_host_that_never_answers_does_not_hold_the_set_up_back(hostile: HostileServer) -> None:
    """Its TCP is accepted and nothing is ever said (a frozen sshd): the batch is set up once
    the answering host's agent is starting, and takes the silent one whenever it is ready."""
    accepted: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda _r, w: accepted.append(w), "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    machines = [hostile.machine(name="silent", port=port, connect_timeout=600.0), hostile.machine()]
    early = EarlyHosts(machines, accept_new=False, keepalive=None, lease=60, max_connecting=8)
    early.start()
    waiting = None
    try:
        # patience far beyond the test's own limit: only the rule "as long again as the first
        # host took" can end the wait
        await asyncio.wait_for(early.agents_starting(patience=600), 120)
        assert accepted  # it really was knocked on
        waiting = early.take("silent")
        assert waiting is not None and not waiting.done()
        answered = early.take("evil")
        assert answered is not None
        executor = await answered  # the answering host opened, said hello and was probed
        assert executor.agent_jobs == {} and executor.lost is None
        await executor.close()
    finally:
        await early.close()
        if waiting is not None:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        for writer in accepted:
            writer.close()
        silent.close()
        await silent.wait_closed()
