"""A cancelled task ends cancelled: no bounded wait in the package swallows a cancellation.

Python 3.11's ``asyncio.wait_for`` returns the awaited result when its task is cancelled in the
same moment the awaited thing completes, and the task goes on as if nobody had cancelled it.  A
256-host batch hung that way at its very end: closing a hub connection cancels its keepalive
loop and waits for it, the loop's answer from the hub came in that moment, and the loop slept
and pinged for ever (the hub answering each ping).  ``transport.base.bounded`` is the package's
bounded wait (``asyncio.timeout``); a rule keeps ``wait_for`` out of the package.  The agent,
which runs on the hosts' Python (3.8 and later, without ``asyncio.timeout``), waits with
``asyncio.wait``, which never swallows its caller's cancellation.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import socket
import sys
from pathlib import Path

import pytest

import ssh_scheduler
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport import hub_client
from ssh_scheduler.transport.base import bounded, stopped

PACKAGE = Path(ssh_scheduler.__file__).parent


def wait_for_calls(source: str, where: str) -> list[str]:
    """Each use of asyncio's wait_for in ``source`` (as ``asyncio.wait_for`` or imported by
    name), and each ``suppress(...CancelledError...)`` or ``suppress(BaseException)``: around ``await task`` it swallows the
    awaiting task's own cancellation too (transport.base.stopped waits without that)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "wait_for":
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncio" and any(a.name == "wait_for" for a in node.names):
            found.append(f"{where}:{node.lineno}: from asyncio import wait_for")
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("suppress")
            and any(ast.unparse(arg).endswith(("CancelledError", "BaseException")) for arg in node.args)
        ):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_wait_for_in_the_package() -> None:
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in wait_for_calls(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    ]
    assert found == []


def test_the_rule_catches_a_planted_wait_for() -> None:
    planted = "import asyncio\nasync def f(x):\n    return await asyncio.wait_for(x, 5)\n"
    assert wait_for_calls(planted, "m.py") == ["m.py:3: asyncio.wait_for"]
    assert wait_for_calls("from asyncio import wait_for\n", "m.py") == ["m.py:1: from asyncio import wait_for"]
    swallowing = "async def f(t):\n    with contextlib.suppress(asyncio.CancelledError, Exception):\n        await t\n"
    assert wait_for_calls(swallowing, "m.py") == ["m.py:2: contextlib.suppress(asyncio.CancelledError, Exception)"]
    # BaseException holds CancelledError: Prefetch.close waited for its tasks this way.
    everything = "async def f(t):\n    with contextlib.suppress(BaseException):\n        await t\n"
    assert wait_for_calls(everything, "m.py") == ["m.py:2: contextlib.suppress(BaseException)"]


async def cancelled_as_it_completes(wait: object) -> bool:
    """Whether a task waiting through ``wait`` on a future ends cancelled when it is cancelled
    in the same moment the future gets its result."""
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(wait(future, 10))  # type: ignore[operator]
    await asyncio.sleep(0)  # the task waits on the future now
    future.set_result(1)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


async def test_bounded_never_swallows_a_cancellation() -> None:
    assert await cancelled_as_it_completes(bounded)
    if sys.version_info < (3, 12):  # the flaw the rule keeps out, on the Python that has it
        assert not await cancelled_as_it_completes(asyncio.wait_for)


async def test_bounded_times_out_and_returns() -> None:
    with pytest.raises(TimeoutError):
        await bounded(asyncio.sleep(10), 0.01)
    assert await bounded(asyncio.sleep(0, "value"), 5) == "value"


async def slow_to_end() -> None:
    """A task that takes a few loop turns to end once cancelled (it closes something first)."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        for _ in range(3):
            await asyncio.sleep(0)
        raise


async def suppressing(task: asyncio.Task[None]) -> None:
    """The way the package stopped tasks before ``stopped``."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(("stop", "keeps_the_cancellation"), [(stopped, True), (suppressing, False)])
async def test_stopping_a_task_keeps_the_stoppers_own_cancellation(stop: object, keeps_the_cancellation: bool) -> None:
    inner = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(stop(inner))  # type: ignore[operator]
    await asyncio.sleep(0)  # it waits for inner to end
    stopper.cancel()  # e.g. Ctrl-C while a session closes
    try:
        await stopper
    except asyncio.CancelledError:
        ended_cancelled = True
    else:
        ended_cancelled = False
    assert inner.cancelled()
    assert ended_cancelled == keeps_the_cancellation


async def test_stopping_retrieves_what_a_task_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("its own end")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await stopped(task)  # neither raised here nor logged as never retrieved
    assert isinstance(task.exception(), RuntimeError)


@pytest.mark.parametrize("turns", range(8))
async def test_closing_a_hub_connection_ends_when_the_pong_comes_as_it_closes(
    monkeypatch: pytest.MonkeyPatch, turns: int
) -> None:
    """A real socket pair stands for the hub: it answers the keepalive's ping, and the
    connection is closed ``turns`` loop turns later (one of them the moment the answer is
    read).  Each close must end; with wait_for in the keepalive loop one of them never did."""
    monkeypatch.setattr(hub_client, "KEEPALIVE_INTERVAL", 0.001)
    monkeypatch.setattr(hub_client, "KEEPALIVE_COUNT_MAX", 10_000)
    ours, hubs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    hub_reader, hub_writer = await asyncio.open_unix_connection(sock=hubs)
    transport = hub_client.HubTransport(Machine(name="h", host="h"), Path("/nonexistent"), "lease", reader, writer, False)
    try:
        assert await bounded(hub_reader.readline(), 5) == b"ping\n"
        hub_writer.write(b"pong\n")
        for _ in range(turns):
            await asyncio.sleep(0)
        await bounded(transport.close(), 5)  # TimeoutError: the keepalive loop went on
        assert transport._keepalive.cancelled()
    finally:
        hub_writer.close()
        writer.close()
