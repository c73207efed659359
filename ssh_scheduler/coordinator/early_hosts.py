"""Hosts started before the batch is ready to use them.

Start-up is the coordinator's CPU (imports, the batch's set-up) and the hosts' (sshd's key
exchange, the agent's Python start, the first probe).  Done one after the other, the user
waits for both; here the connections and agents are started as soon as the machine files are
read, and the coordinator sets the rest of the batch up while the hosts start their agents.
:class:`~ssh_scheduler.coordinator.batch.Batch` then takes each host's executor from here instead
of opening one.

Only for a fresh results folder: its agents are started with a new batch token, which no other
run can hold, so nothing an earlier run left (agents to reattach, jobs to resume) is touched
before the batch is known to run.  A batch refused later (a bad copy forward, a command that
changed) closes what was started here; the refusal and its message are the ones it always was.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence
from pathlib import Path

from ssh_scheduler.executors.backends import open_backend
from ssh_scheduler.executors.base import Executor
from ssh_scheduler.machines.machine import Machine


def suits(results_dir: Path) -> bool:
    """Can a batch with this results folder start its hosts early (no earlier run's token)?"""
    if not results_dir.exists():  # the usual first run: the journal code can load later
        return True
    from ssh_scheduler.results.journal import batch_token

    return batch_token(results_dir) is None


class EarlyHosts:
    """Connects, starts the agent and its first probe on every agent machine (not Slurm), at
    most ``max_connecting`` at once; :meth:`take` hands each host's opening to the batch."""

    def __init__(
        self, machines: Sequence[Machine], *, accept_new: bool, keepalive: float | None, lease: float, max_connecting: int
    ) -> None:
        self.token = secrets.token_hex(8)
        self.connecting = asyncio.Semaphore(max(1, max_connecting))  # the batch's, for later reconnects
        self._first_wave = max(1, max_connecting)
        self._machines = [m for m in machines if m.slurm is None]
        self._accept_new, self._keepalive, self._lease = accept_new, keepalive, lease
        self._tasks: dict[str, asyncio.Task[Executor]] = {}
        self._starting: list[asyncio.Future[None]] = []

    def start(self) -> None:
        for machine in self._machines:
            starting = asyncio.get_running_loop().create_future()
            self._starting.append(starting)
            self._tasks[machine.name] = asyncio.create_task(self._open(machine, starting))

    async def _open(self, machine: Machine, starting: asyncio.Future[None]) -> Executor:
        try:
            return await open_backend(
                machine, accept_new=self._accept_new, keepalive=self._keepalive, lease=self._lease,
                token=self.token, probe_first=True, on_hello_sent=lambda: starting.set_result(None),
                connecting=self.connecting,
            )
        finally:
            if not starting.done():
                starting.set_result(None)

    async def agents_starting(self, patience: float = 1.0) -> None:
        """Until the first hosts (as many as connect at once) have their agents starting (the
        host's CPU from there: sshd's exec, the Python start, the probe) or have failed.

        Not every host (with hundreds, the first would wait for the last before taking a job),
        and not a slow one: after the first host, the others get as long again as it took, and
        nobody more than ``patience`` seconds.  A host that does not answer (frozen, far, down)
        is taken by the batch whenever it is ready; failures are the batch's to report."""
        wave = self._starting[: self._first_wave]
        if not wave:
            return
        loop = asyncio.get_running_loop()
        began = loop.time()
        done, pending = await asyncio.wait(wave, timeout=patience, return_when=asyncio.FIRST_COMPLETED)
        if done and pending:
            await asyncio.wait(pending, timeout=min(loop.time() - began, patience))

    def take(self, name: str) -> asyncio.Task[Executor] | None:
        return self._tasks.pop(name, None)

    async def close(self) -> None:
        """End what the batch did not take (it was refused, or gave the hosts up)."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for opened in await asyncio.gather(*tasks, return_exceptions=True):
            if not isinstance(opened, BaseException):  # it was open before the cancel came
                with contextlib.suppress(Exception):
                    await opened.close()
