"""The hub's warm connections: which one a command may have, and when one must go.

A connection is lent to one client at a time, whole (its channels counted against the host's
MaxSessions exactly as a direct connection's); clients at once get a connection each.  Back in
the pool it stays warm for the machine's ``keep_warm`` seconds of idleness.

"The same host with the same identity" is exact (:func:`identity`): everything the resolved
:class:`Machine` says about how to connect -- address, port, user, key files, known_hosts files,
jump hosts, ProxyCommand, algorithms, forwarding, sessions -- and the keepalive.  Beside it, what
those name is checked at every reuse and at every sweep (:class:`Held.fresh`): each key file's
identity (inode, size, times: an edited or replaced key), and what the known_hosts files say
about the host and each jump host (a key recorded, removed, revoked).  A connection made under
what has changed is never lent again, and is closed; so is one of a machine (the same name from
the same file) that now connects another way: its config changed.  The host is asked for an answer before a
connection is lent (:meth:`SSHTransport.answers`): a host that crashed or was cut off while held
costs a short wait and a fresh connection, which then fails as a direct one would.

A connection keeps at most one agent between clients (:meth:`Pool.agent_for`): the one a
token-less session left, or a spare started without a token when a batch gave the connection
back (:meth:`Pool.start_spare`), for the next batch to adopt (hub_agent.py).  Either ends with
the connection; a spare costs the host one idle python3 for as long as the connection is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import json
import logging
import os
import time
from typing import Any

from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.transport.auth import jump_chain
from ssh_scheduler.transport.base import bounded, stopped
from ssh_scheduler.transport.hostkeys import KnownHosts, known_hosts_files
from ssh_scheduler.transport.hub_agent import AgentLink
from ssh_scheduler.transport.ssh import SSHTransport

log = logging.getLogger(__name__)

ANSWER_TIMEOUT = 2.0
"""Seconds a held connection's host has to answer before the connection is given up."""
SPARE_WAIT = 10.0
"""Seconds a session waits for a spare agent still starting before it starts one of its own."""
PER_USE = ("name", "source", "workdir", "env", "setup", "slurm", "connect_timeout", "keep_warm")
"""Machine fields that say how a connection is used, not how it is made."""


def identity(machine: Machine, keepalive: float | None) -> str:
    """Everything about how the connection to ``machine`` is made, as one string."""
    return json.dumps([_how(machine), keepalive], sort_keys=True, default=str)


def _how(machine: Machine | None) -> Any:
    if machine is None:
        return None
    fields = {f.name: getattr(machine, f.name) for f in dataclasses.fields(machine) if f.name not in PER_USE}
    fields["jump_host"] = _how(machine.jump_host)
    return fields


def key_files(machine: Machine) -> tuple[tuple[Any, ...], ...]:
    """Each key file the login may read, as it is now (the default ``~/.ssh/id_*`` when the
    machine names none), the jump hosts' too."""
    found: list[tuple[Any, ...]] = []
    for hop in (*jump_chain(machine), machine) if (machine.proxy_jump or machine.jump_host) else (machine,):
        paths = hop.key_paths or tuple(sorted(glob.glob(os.path.expanduser("~/.ssh/id_*"))))
        for path in paths:
            try:
                st = os.stat(path)
            except OSError as exc:
                found.append((path, exc.errno))
                continue
            found.append((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(found)


def trust(machine: Machine, addr: str) -> tuple[tuple[str, ...], ...]:
    """What the known_hosts files say about the host (at the address it was reached at) and
    about each jump host: the fingerprints of the keys, CAs and revoked keys that match."""
    said = []
    hops = jump_chain(machine) if (machine.proxy_jump or machine.jump_host) else []
    for hop, at in [*((h, "") for h in hops), (machine, addr)]:
        keys, cas, revoked = KnownHosts(known_hosts_files(hop)).lookup(hop.host, at, hop.port)
        said.append(tuple(sorted(f"{kind}:{k.get_fingerprint()}" for kind, found in (("key", keys), ("ca", cas), ("revoked", revoked)) for k in found)))
    return tuple(said)


@dataclasses.dataclass(eq=False)
class Held:
    """One warm connection: lent to one client, or idle in the pool."""

    key: str
    transport: SSHTransport
    keys: tuple[tuple[Any, ...], ...]
    trusted: tuple[tuple[str, ...], ...]
    addr: str
    made: float = dataclasses.field(default_factory=time.monotonic)
    keep: float = 0.0
    idle_since: float | None = None
    uses: int = 0
    lent: bool = False
    agent: AgentLink | None = None
    spare: asyncio.Task[None] | None = None
    """A spare agent being started (start_spare)."""
    choosing: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock, repr=False)
    """Held while a session's agent is chosen: a kept agent goes to one session only."""
    _timer: asyncio.TimerHandle | None = None

    @property
    def machine(self) -> Machine:
        return self.transport.machine

    def fresh(self) -> bool:
        """Is everything it was made under still so?  (Never raises: unreadable is changed.)"""
        try:
            return key_files(self.machine) == self.keys and trust(self.machine, self.addr) == self.trusted
        except Exception as exc:
            log.debug("%s: cannot check its files (%s): not reused", self.machine.name, exc)
            return False

    def lose_agent(self, gone: AgentLink) -> None:
        if self.agent is gone:
            self.agent = None

    def kept_agent(self, workdir: str) -> AgentLink | None:
        if self.agent is not None and self.agent.kept and self.agent.workdir == workdir:
            return self.agent
        return None

    def describe(self) -> dict[str, Any]:
        m = self.machine
        now = time.monotonic()
        return {
            "name": m.name, "host": m.host, "port": m.port, "user": m.user,
            "state": "in use" if self.lent else "idle",
            "idle_s": round(now - self.idle_since, 1) if self.idle_since is not None and not self.lent else None,
            "keep_s": self.keep, "age_s": round(now - self.made, 1), "uses": self.uses,
            "agent": self.agent is not None and self.agent.kept,
            "spare_starting": self.spare is not None,
        }


class Pool:
    """Every warm connection of the hub, idle or lent."""

    def __init__(self) -> None:
        self.held: list[Held] = []
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self.held)

    @property
    def idle(self) -> bool:
        return not self.held

    async def lend(self, machine: Machine, *, accept_new: bool, keepalive: float | None) -> tuple[Held, bool]:
        """A connection for ``machine``: a warm one that still answers, else a new one (raising
        what a direct connect raises).  Returns it and whether it was warm."""
        key = identity(machine, keepalive)
        how = identity(machine, None)
        for held in list(self.held):
            # The same machine (its name, from the same file) now connects another way: its
            # config changed, and what was made under the old one goes.
            same = (held.machine.name, held.machine.source) == (machine.name, machine.source)
            if same and not held.lent and identity(held.machine, None) != how:
                log.debug("%s: its config changed; the connection made under the old one is closed", machine.name)
                self._close_soon(held)
        for held in sorted(self.held, key=lambda h: -(h.idle_since or 0)):
            if held.lent or held.key != key:
                continue
            held.lent = True
            self._stop_timer(held)
            if held.fresh() and await answers(held.transport, ANSWER_TIMEOUT):
                held.uses += 1
                held.transport.machine = machine  # its name in messages, its workdir
                return held, True
            log.debug("%s: the warm connection is gone or outdated; connecting afresh", machine.name)
            await self.drop(held, orderly=False)
        keys = key_files(machine)
        before = None if accept_new else trust(machine, "")
        transport = await SSHTransport.connect(machine, accept_new=accept_new, keepalive=keepalive)
        addr = ""
        with contextlib.suppress(Exception):
            peer = transport.conn.get_extra_info("peername")
            addr = str(peer[0]) if peer else ""
        trusted = trust(machine, addr) if (before is None or addr) else before
        held = Held(key, transport, keys, trusted, addr, lent=True, uses=1)
        self.held.append(held)
        watcher = asyncio.get_running_loop().create_task(self._watch(held))
        self._closing.add(watcher)
        watcher.add_done_callback(self._closing.discard)
        return held, False

    async def agent_for(self, held: Held, token: str) -> tuple[AgentLink, bool]:
        """The agent of a client's session on ``held``, and whether it was warm: the kept one
        (for a batch ``token``, once it adopted it), else one started now (raising what
        starting one raises).  A kept agent no use to this client is closed: not one more."""
        async with held.choosing:
            return await self._agent_for(held, token)

    async def _agent_for(self, held: Held, token: str) -> tuple[AgentLink, bool]:
        workdir = held.machine.workdir
        if held.spare is not None:  # nearly there: cheaper to wait than to start a second...
            await asyncio.wait({held.spare}, timeout=SPARE_WAIT)  # ...but not for one stuck
        link = held.kept_agent(workdir)
        if link is not None and token:
            if await link.adopt(token):
                held.agent = None  # the batch's now: ends with it
                return link, True
            link = None
        if link is not None:
            return link, True
        if held.agent is not None and held.agent.kept:
            kept, held.agent = held.agent, None
            await kept.close()
        agent = await held.transport.start_agent(token)
        keepable = not token and held.agent is None
        link = AgentLink(agent, workdir, keepable=keepable, on_end=held.lose_agent)
        if keepable:
            held.agent = link
        return link, False

    def start_spare(self, held: Held) -> None:
        """After a batch: an agent started without a token, kept on ``held`` for the next
        batch to adopt (its start is most of a warm batch's wait for its first job)."""
        # A host allowing 2 sessions has none for a spare beside the file channel: an
        # execute_to on this connection would be refused its channel.
        roomy = held.machine.max_sessions >= 3
        if roomy and held in self.held and not held.lent and held.agent is None and held.spare is None:
            held.spare = asyncio.get_running_loop().create_task(self._spare(held), name="hub spare agent")

    async def _spare(self, held: Held) -> None:
        try:
            agent = await held.transport.start_agent("")
        except Exception as exc:  # the next batch starts its own, as without a spare
            log.debug("%s: no spare agent: %s", held.machine.name, exc)
            return
        finally:
            held.spare = None
        link = AgentLink(agent, held.machine.workdir, keepable=True, on_end=held.lose_agent)
        if held in self.held and held.agent is None:
            held.agent = link
            link.park()
        else:  # the connection went meanwhile, or a client left an agent of its own
            await link.close()

    def give_back(self, held: Held, keep: float, *, usable: bool) -> None:
        """The client is done with it: warm for ``keep`` seconds, or closed."""
        held.lent = False
        if not usable or keep <= 0 or held.transport.conn.is_closed() or not held.fresh():
            self._close_soon(held)
            return
        held.keep = keep
        held.idle_since = time.monotonic()
        held._timer = asyncio.get_running_loop().call_later(keep, self._close_soon, held)

    def sweep(self) -> None:
        """Close every idle connection made under something that has changed since."""
        for held in list(self.held):
            if not held.lent and not held.fresh():
                log.debug("%s: its keys or known hosts changed; the warm connection is closed", held.machine.name)
                self._close_soon(held)

    async def _watch(self, held: Held) -> None:
        """Forget a connection as soon as it closes (the host went away, keepalives failed)."""
        with contextlib.suppress(Exception):
            await held.transport.conn.wait_closed()
        if held in self.held and not held.lent:
            await self.drop(held, orderly=False)

    def _stop_timer(self, held: Held) -> None:
        if held._timer is not None:
            held._timer.cancel()
            held._timer = None

    def _close_soon(self, held: Held) -> None:
        """Forget it now (nobody is lent it again), close it in the background."""
        self._forget(held)
        task = asyncio.get_running_loop().create_task(self.drop(held))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _forget(self, held: Held) -> None:
        self._stop_timer(held)
        with contextlib.suppress(ValueError):
            self.held.remove(held)

    async def drop(self, held: Held, *, orderly: bool = True) -> None:
        """Close it and forget it: ``orderly``, a kept agent is told ``bye`` and waited for
        first; else (the host no longer answers) the connection goes at once, and the agent's
        channel with it."""
        self._forget(held)
        if held.spare is not None:
            await stopped(held.spare)
        agent, held.agent = held.agent, None
        if agent is not None and orderly:
            await agent.close()
        with contextlib.suppress(Exception):
            await held.transport.close()
        if agent is not None and not orderly:
            await agent.close()

    async def close_all(self) -> None:
        await asyncio.gather(*(self.drop(h) for h in list(self.held)), return_exceptions=True)
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)


async def answers(transport: SSHTransport, timeout: float) -> bool:
    """Does the host still answer on this connection (one round trip, an OpenSSH keepalive
    request)?  A crashed or cut host must not be handed out as a warm connection."""
    request = getattr(transport.conn, "_make_global_request", None)
    if request is None:  # another asyncssh: its own keepalives decide
        return not transport.conn.is_closed()
    try:
        await bounded(request(b"keepalive@openssh.com"), timeout)
    except Exception:  # no answer in time, or the connection broke meanwhile
        return False
    return not transport.conn.is_closed()
