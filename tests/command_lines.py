"""Every argument we put on a remote command line, recorded where remote commands are issued.

Linux refuses a single argument over 128 KiB (MAX_ARG_STRLEN); we keep every one under
:data:`LIMIT`.  What counts: the commands a transport runs (``exec``: sshd hands the whole line to
the login shell as ONE argument of ``-c``), the agent's start command (the same), and what the
agent runs for us in a shell -- a probe's command (``/bin/sh -c CMD``) and the Slurm query's
``command_prefix`` script.  Recorded from the requests the coordinator writes to its agents, so
nothing escapes by taking another path.  A user's own job command is theirs and not counted
(tests run short ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import slurm as agent_slurm
from ssh_scheduler.agent import wire as W
from ssh_scheduler.transport import local, ssh
from ssh_scheduler.transport.base import AgentProcess
from ssh_scheduler.transport.bootstrap import AgentStart

LIMIT = 64 * 1024
"""The most bytes any one argument we build may have (half of what Linux accepts)."""


@dataclass
class Issued:
    execs: list[str] = field(default_factory=list)  # Transport.exec
    starts: list[str] = field(default_factory=list)  # agent start commands
    probes: list[str] = field(default_factory=list)  # /bin/sh -c of the agent
    queries: list[P.SlurmQuery] = field(default_factory=list)

    def arguments(self) -> list[str]:
        """Each whole command line, as the one argument it travels as."""
        prefixes = [agent_slurm.with_prefix(q.prefix, [])[2] for q in self.queries if q.prefix]
        return [*self.execs, *self.starts, *self.probes, *prefixes]

    def longest(self) -> int:
        return max((len(a.encode()) for a in self.arguments()), default=0)


def record_commands(monkeypatch: pytest.MonkeyPatch) -> Issued:
    """Record, until ``monkeypatch`` undoes it, every command line issued (see the docstring)."""
    record = Issued()
    for module in (ssh, local):
        start = module.agent_start

        def recorded_start(*args: Any, start: Any = start, **kwargs: Any) -> AgentStart:
            made: AgentStart = start(*args, **kwargs)
            record.starts.append(made.command)
            return made

        monkeypatch.setattr(module, "agent_start", recorded_start)
    for transport in (ssh.SSHTransport, local.LocalTransport):
        run = transport.exec

        async def recorded_exec(self: Any, command: str, *args: Any, run: Any = run, **kwargs: Any) -> Any:
            record.execs.append(command)
            return await run(self, command, *args, **kwargs)

        monkeypatch.setattr(transport, "exec", recorded_exec)
    write = AgentProcess.write

    def recorded_write(self: AgentProcess, data: bytes) -> None:
        for line in data.splitlines():
            request = W.decode_request(line)  # all a coordinator writes is requests
            if isinstance(request, P.Hello) and request.probe is not None:
                request = request.probe
            if isinstance(request, P.Probe):
                record.probes.append(request.cmd)
            elif isinstance(request, P.SlurmQuery):
                record.queries.append(request)
        write(self, data)

    monkeypatch.setattr(AgentProcess, "write", recorded_write)
    return record
