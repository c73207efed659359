"""The coordinator's own machine as a transport: the agent as a local subprocess, no SSH."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import shutil
import stat
import sys
from pathlib import Path

from ssh_scheduler.errors import (
    TransportError,
)
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.base import (
    CHUNK,
    AgentProcess,
    ExecResult,
    OutputSink,
    SizeLimitExceeded,
    pump,
)
from ssh_scheduler.transport.bootstrap import agent_start
from ssh_scheduler.transport.lines import BoundedLines


class LocalTransport:
    """This machine, without SSH: same agent, plain file copies."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.bytes_sent = 0
        self.bytes_received = 0

    async def start_agent(self, token: str = "") -> AgentProcess:
        start = agent_start(shlex.quote(sys.executable), self.machine.workdir, token)
        proc = await asyncio.create_subprocess_shell(
            start.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdin is not None
        with contextlib.suppress(Exception):  # an agent that could not start says why on stdout
            proc.stdin.write(start.payload)  # its code, before any request

        async def closer() -> None:
            if proc.stdin is not None:
                proc.stdin.close()
            await proc.wait()

        # Bounded as over SSH (transport.lines): the same limit, the same words when it is passed.
        return AgentProcess(proc.stdin, BoundedLines(proc.stdout), closer)

    async def open_file_channel(self) -> None:
        """Plain file copies: no channel to open."""

    async def upload(self, local: Path, remote: str, mode: int) -> int:
        return await asyncio.to_thread(self._copy_in, local, remote, mode)

    def _copy_in(self, local: Path, remote: str, mode: int) -> int:
        final = os.path.expanduser(remote)
        tmp = f"{final}.part-{secrets.token_hex(6)}"  # two uploads of one file may race
        shutil.copyfile(local, tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, final)
        size = os.path.getsize(final)
        self.bytes_sent += size
        return size

    async def download(self, remote: str, fd: int, limit: int) -> int:
        return await asyncio.to_thread(self._copy_out, remote, fd, limit)

    def _copy_out(self, remote: str, fd: int, limit: int) -> int:
        total = 0
        src = os.open(os.path.expanduser(remote), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                raise TransportError(f"{remote} is not a regular file")
            while chunk := os.read(src, CHUNK):
                total += len(chunk)
                if total > limit:
                    raise SizeLimitExceeded(remote, limit)
                os.write(fd, chunk)
        finally:
            os.close(src)
        self.bytes_received += total
        return total

    async def exec(
        self, command: str, on_stdout: OutputSink | None = None, on_stderr: OutputSink | None = None
    ) -> ExecResult:
        proc = await asyncio.create_subprocess_shell(
            command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            out, err = await asyncio.gather(
                pump(proc.stdout, on_stdout), pump(proc.stderr, on_stderr)
            )
            code = await proc.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await proc.wait()  # reap it (KILLed, it ends at once): no zombie, no open transport
            raise
        return ExecResult(128 - code if code < 0 else code, out, err)

    async def close(self) -> None:
        return None
