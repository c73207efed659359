"""A hostile SSH/SFTP server, run in-process with asyncssh, that impersonates the host agent.

It listens on 127.0.0.1 (port 0) with a fresh host key and accepts one generated client key.
A command starting with ``exec python3 -u -I -S -c`` (``transport.bootstrap.agent_start``) gets an agent
that reads the agent's code from its stdin as the first stage does (exactly the size its command
line gives, kept in :attr:`HostileServer.agent_code`), then speaks the protocol of
``ssh_scheduler/agent/protocol.py`` (its own classes) but answers ``manifest`` with whatever the
test put in :attr:`HostileServer.scenarios` for that job; the SFTP subsystem serves
file contents from memory (or forever, for :data:`ENDLESS`) and never touches the local disk.

Nothing here writes to the file system except the key files the test asks for.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shlex
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.machines.probe import PROBE_SCRIPT

ENDLESS = object()
"""File content that never ends (every SFTP read returns a full block)."""
STALL = object()
"""File content that never comes (every SFTP read waits forever, like an idle FIFO)."""



@dataclass
class Answers:
    """File content served by a rule: ``rule(data, offset, size)`` is the answer to each SFTP
    read (a host that cuts its answers short, or sends more than asked)."""

    data: bytes
    rule: Callable[[bytes, int, int], bytes]


ROOT = "/evil"
AGENT_PREFIX = "exec python3 -u -I -S -c"

_probe_output: str | None = None


def probe_output() -> str:
    """A valid probe answer: the real probe script run on this machine."""
    global _probe_output
    if _probe_output is None:
        _probe_output = subprocess.run(
            ["/bin/sh", "-c", PROBE_SCRIPT], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    return _probe_output


@dataclass
class Scenario:
    """What the host claims a job left behind."""

    entries: list[Any] | Callable[[], list[Any]] = field(default_factory=list)
    contents: dict[str, Any] = field(default_factory=dict)
    """rel -> bytes, ENDLESS, STALL, Answers, or an SFTPError that opening it raises; a rel not here
    reads as b"data of <rel>"."""
    exit_code: int = 0
    output: bytes = b""


class _Handle:
    def __init__(self, path: str, content: Any = None, writing: bool = False) -> None:
        self.path = path
        self.content = content
        self.writing = writing
        self.data = bytearray()


class HostileServer:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.scenarios: dict[str, Scenario] = {}
        self.missing_all = False  # answer `have` with every hash missing (forces SFTP uploads)
        self.endless_hello = False  # answer `hello` with one line that never ends
        self.long_hello = 0  # answer `hello` with one (well-formed) line of about this many bytes
        self.bad_have = False  # answer `have` with something that is not a list
        # answer `fetch` with extra files under names nobody asked for (escaping ones too)
        self.fetch_lies = False
        self.without_bulk = False  # answer `put` and `fetch` as an agent that predates them would
        # answer the probe a `hello` carries, as today's agent does (False: as an older agent,
        # which ignores it, so the coordinator has to send a `probe` of its own)
        self.folds_probe = False
        self.on_read: Callable[[str], None] | None = None  # called with each path read (SFTP or fetch)
        self.opened: list[str] = []  # every path the client asked the SFTP server to open
        self.uploaded: dict[str, bytes] = {}
        self.requests: list[W.Request] = []  # every agent request seen
        self.commands: list[str] = []  # every exec'd command
        self.agent_code: list[bytes] = []  # what each agent start sent before the protocol
        self.server: Any = None
        self.port = 0
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.client_key = asyncssh.generate_private_key("ssh-ed25519")
        self.key_path = base / "id_client"
        self.client_key.write_private_key(str(self.key_path))
        os.chmod(self.key_path, 0o600)
        self.known_hosts = base / "known_hosts"

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> HostileServer:
        server = self

        class SFTP(_HostileSFTP):
            owner = server

        self.server = await asyncssh.listen(
            "127.0.0.1",
            0,
            server_host_keys=[self.host_key],
            authorized_client_keys=asyncssh.import_authorized_keys(
                self.client_key.export_public_key().decode()
            ),
            process_factory=self._process,
            sftp_factory=SFTP,
            encoding=None,
            allow_scp=False,
            agent_forwarding=False,
        )
        self.port = self.server.sockets[0].getsockname()[1]
        public = self.host_key.export_public_key().decode().strip()
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {public}\n")
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def machine(self, **overrides: Any) -> Machine:
        fields: dict[str, Any] = dict(
            name="evil",
            host="127.0.0.1",
            port=self.port,
            user="tester",
            key_paths=(str(self.key_path),),
            known_hosts=(str(self.known_hosts),),
            connect_timeout=10.0,
            workdir=ROOT,  # what this host's hello answers (the coordinator checks it)
        )
        fields.update(overrides)
        return Machine(**fields)

    # -- the fake agent ---------------------------------------------------------------------
    def scenario_for(self, jobdir: str) -> Scenario:
        name = jobdir.rsplit("/", 1)[-1].split("-", 1)[-1]
        return self.scenarios.get(name, Scenario())

    async def _process(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        command = process.command or ""
        self.commands.append(command)
        if not command.startswith(AGENT_PREFIX):
            process.stderr.write(b"hostile: only the agent is spoken here\n")
            process.exit(127)
            return
        try:
            await self._agent(process)
        except Exception:  # the client hung up on us: expected, we are hostile
            pass
        finally:
            with contextlib.suppress(Exception):
                process.exit(0)

    async def _agent(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        # Built with the protocol's own classes, whose encode checks nothing: that is how this
        # server sends ill-typed fields (a listing that is not a list, a number for names).
        def send(message: W.Message) -> None:
            process.stdout.write(message.encode())

        # The first stage's last argument is the size of the code that comes first on stdin.
        size = int(shlex.split(process.command or "")[-1])
        self.agent_code.append(await process.stdin.readexactly(size))
        while True:
            line = await process.stdin.readline()
            if not line:
                return
            req = W.decode_request(line)
            self.requests.append(req)
            if isinstance(req, P.Hello) and self.endless_hello:
                process.stdout.write(b'{"ev":"hello","root":"')
                block = b"x" * (1 << 20)
                while True:
                    process.stdout.write(block)
                    await process.stdout.drain()
            elif isinstance(req, P.Hello) and self.long_hello:
                process.stdout.write(b'{"ev":"hello","id":%d,"pid":1,"python":"3","root":"' % (req.id or 0)
                                     + b"x" * self.long_hello + b'"}\n')
                await process.stdout.drain()
                continue
            elif isinstance(req, P.Bye):
                return
            answer = self._answer(req)
            for message in answer:
                send(message)
            await process.stdout.drain()

    def _answer(self, req: W.Request) -> list[W.Message]:
        """What this host says to one request (every request type of the protocol)."""
        rid = req.id
        if isinstance(req, P.Hello):
            hello = P.HelloReply(id=rid, pid=4242, root=ROOT, python="3.11.0")
            if req.probe is None or not self.folds_probe:
                return [hello]
            hello.probing = True
            return [hello, *self._answer(req.probe)]
        if isinstance(req, P.Probe):
            return [P.ProbeReply(id=rid, out=probe_output(), rc=0)]
        if isinstance(req, P.Have):
            missing: Any = list(req.hashes) if self.missing_all else []
            return [P.HaveReply(id=rid, missing=5 if self.bad_have else missing)]
        if isinstance(req, P.Stage):
            return [P.Staged(id=rid)]
        if isinstance(req, P.Run):
            scenario = self.scenario_for(req.cwd)
            events: list[W.Message] = [P.Started(job=req.job, pid=4243)]
            if scenario.output:
                data = base64.b64encode(scenario.output).decode()
                events.append(P.Output(job=req.job, fd=1, data=data))
            entries = None
            if req.listing:  # the results listing rides on the exit event
                entries = scenario.entries() if callable(scenario.entries) else scenario.entries
            events.append(P.Exit(job=req.job, code=scenario.exit_code, entries=entries))
            return events
        if isinstance(req, P.Manifest):
            entries = self.scenario_for(req.dir).entries
            return [P.ManifestReply(id=rid, entries=entries() if callable(entries) else entries)]
        if isinstance(req, P.Remove):
            return [P.Removed(id=rid)] if rid is not None else []
        if isinstance(req, P.Sweep):
            return [P.Swept(id=rid)]
        if isinstance(req, (P.Put, P.Fetch)) and self.without_bulk:
            return [P.Error(id=rid, message=f"unknown op {req.TAG!r}")]
        if isinstance(req, P.Put):  # bulk uploads land where SFTP ones would
            for blob in req.files:
                self.uploaded[f"{ROOT}/cache/{blob.name}"] = base64.b64decode(blob.data or "")
            return [P.PutReply(id=rid)]
        if isinstance(req, P.Fetch):
            return self._fetch(req)
        if isinstance(req, P.SlurmQuery):  # no Slurm here: squeue "fails"
            return [P.SlurmReply(id=rid, rc=127, squeue="hostile: squeue: not found")]
        if isinstance(req, P.Adopt):  # this host never lends a spare agent
            return [P.AdoptReply(id=rid, ok=False, why="hostile: not a spare")]
        if isinstance(req, (P.Ping, P.Kill, P.Resume, P.Bye)):
            return []  # nothing to say: no job here ever runs, so none is killed or resumed
        return [P.Error(id=rid, message=f"unknown op {req.TAG!r}")]

    def _fetch(self, req: P.Fetch) -> list[W.Message]:
        """Small files in bulk, from the same contents the SFTP server serves: an endless file
        sends past the limit, a stalled one leaves the whole request unanswered."""
        blobs = []
        if self.fetch_lies:
            blobs += [P.Blob(name=name, data=base64.b64encode(b"pwned").decode())
                      for name in ("../../../../../../tmp/pwned", "/tmp/evil", "..", "sneaky")]
        for rel in req.paths:
            path = f"{req.dir}/{rel}"
            self.opened.append(path)
            if self.on_read is not None:
                self.on_read(path)
            try:
                content = self.content_for(path)
            except asyncssh.SFTPError as exc:
                content = exc
            if content is STALL:
                return []
            if isinstance(content, asyncssh.SFTPError):
                blobs.append(P.Blob(name=rel, error=content.reason))
                continue
            if isinstance(content, Answers):
                content = content.data
            data = b"\xff" * (req.limit + 1) if content is ENDLESS else bytes(content)
            blobs.append(P.Blob(name=rel, data=base64.b64encode(data).decode()))
        return [P.Fetched(id=req.id, files=blobs)]

    # -- the fake file system (used by the SFTP server) ---------------------------------------
    def content_for(self, path: str) -> Any:
        prefix = ROOT + "/jobs/"
        if not path.startswith(prefix):
            raise asyncssh.SFTPNoSuchFile(path)
        jobdir_name, _, rel = path[len(prefix) :].partition("/")
        scenario = self.scenario_for(jobdir_name)
        return scenario.contents.get(rel, f"data of {rel}".encode("utf-8", "surrogateescape"))


class _HostileSFTP(asyncssh.SFTPServer):
    """Serves everything from memory; every method that would touch a real file is replaced."""

    owner: HostileServer

    def open(self, path: bytes, pflags: int, attrs: asyncssh.SFTPAttrs) -> _Handle:
        name = os.fsdecode(path)
        if pflags & asyncssh.FXF_WRITE:
            return _Handle(name, writing=True)
        self.owner.opened.append(name)
        if self.owner.on_read is not None:
            self.owner.on_read(name)
        content = self.owner.content_for(name)
        if isinstance(content, Exception):
            raise content
        return _Handle(name, content)

    def read(self, file_obj: _Handle, offset: int, size: int) -> Any:
        if file_obj.content is STALL:
            return asyncio.get_running_loop().create_future()  # never resolved
        if file_obj.content is ENDLESS:
            return b"\xff" * size
        if isinstance(file_obj.content, Answers):
            return file_obj.content.rule(file_obj.content.data, offset, size)
        data = bytes(file_obj.content)
        return data[offset : offset + size]

    def write(self, file_obj: _Handle, offset: int, data: bytes) -> int:
        end = offset + len(data)
        if len(file_obj.data) < end:
            file_obj.data.extend(b"\0" * (end - len(file_obj.data)))
        file_obj.data[offset:end] = data
        return len(data)

    def close(self, file_obj: _Handle) -> None:
        if file_obj.writing:
            self.owner.uploaded[file_obj.path] = bytes(file_obj.data)

    def _attrs(self, size: int) -> asyncssh.SFTPAttrs:
        return asyncssh.SFTPAttrs(type=asyncssh.FILEXFER_TYPE_REGULAR, size=size, permissions=0o100644)

    def fstat(self, file_obj: _Handle) -> asyncssh.SFTPAttrs:
        if file_obj.writing:
            return self._attrs(len(file_obj.data))
        if file_obj.content is ENDLESS or file_obj.content is STALL:
            return self._attrs(1 << 62)
        if isinstance(file_obj.content, Answers):
            return self._attrs(len(file_obj.content.data))
        return self._attrs(len(file_obj.content))

    def stat(self, path: bytes) -> asyncssh.SFTPAttrs:
        name = os.fsdecode(path)
        if name in self.owner.uploaded:
            return self._attrs(len(self.owner.uploaded[name]))
        raise asyncssh.SFTPNoSuchFile(name)

    lstat = stat

    def setstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        return None

    def fsetstat(self, file_obj: _Handle, attrs: asyncssh.SFTPAttrs) -> None:
        return None

    def posix_rename(self, oldpath: bytes, newpath: bytes) -> None:
        old, new = os.fsdecode(oldpath), os.fsdecode(newpath)
        self.owner.uploaded[new] = self.owner.uploaded.pop(old, b"")

    rename = posix_rename

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise asyncssh.SFTPPermissionDenied("not here")

    remove = mkdir = rmdir = readlink = symlink = link = _refuse  # type: ignore[assignment]
    statvfs = fstatvfs = lsetstat = _refuse  # type: ignore[assignment]

    def realpath(self, path: bytes) -> bytes:
        return path

    async def scandir(self, path: bytes) -> Any:  # type: ignore[override]
        raise asyncssh.SFTPPermissionDenied("not here")
        yield  # pragma: no cover


async def start_hostile(base: Path) -> HostileServer:
    return await HostileServer(base).start()


@contextlib.asynccontextmanager
async def hostile_server(tmp_path: Path) -> AsyncIterator[HostileServer]:
    """A started server with its keys in ``tmp_path/keys``, stopped on the way out (the tests'
    fixtures are this, under the name each file uses)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    server = await HostileServer(keys).start()
    try:
        yield server
    finally:
        await server.stop()


def run_in_loop(coro: Any) -> Any:  # pragma: no cover - convenience for manual runs
    return asyncio.run(coro)
