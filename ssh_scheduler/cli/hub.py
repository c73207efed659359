"""``ssh-scheduler hub``: what the hub keeps warm, and ``hub stop``.

The hub (transport/hub_server.py) keeps hosts' connections warm between commands; commands start
it when they need it (transport/hub_place.spawn_hub runs hub_server.py as a program, with the
pipe it says it is ready on): no command for people starts it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Annotated, Any

import typer

from ssh_scheduler.cli.common import err_line, out_line
from ssh_scheduler.cli.warm_place import running_launchers
from ssh_scheduler.transport.hub_ask import hub_folder, hub_status, stop_hub

__all__ = ["hub", "hub_lines"]


def hub_lines(hubs: list[dict[str, Any]]) -> list[str]:
    """What the hubs hold, a line per connection (none: one line saying so)."""
    if not hubs:
        return [f"warm connections: none (no hub runs in {hub_folder()})"]
    lines = []
    for hub in hubs:
        held = hub.get("held") or []
        state = ", stopping" if hub.get("stopping") else ""
        lines.append(f"warm connections: {len(held)} (hub pid {hub.get('pid')}{state})")
        for h in held:
            user = f"{h['user']}@" if h.get("user") else ""
            port = f":{h['port']}" if h.get("port") not in (None, 22) else ""
            if h.get("state") == "idle":
                left = max(0.0, float(h.get("keep_s") or 0) - float(h.get("idle_s") or 0))
                how = f"idle {h.get('idle_s'):g} s, closes in {left:.0f} s"
            else:
                how = "in use"
            agent = ", agent kept" if h.get("agent") else ", agent starting" if h.get("spare_starting") else ""
            lines.append(f"  {h.get('name')} ({user}{h.get('host')}{port}): {how}{agent}; used {h.get('uses')} times")
    for pid in running_launchers():
        lines.append(f"warm starts: launcher pid {pid} (commands start in a copy of it, everything loaded; it ends with the hub)")
    return lines


def hub(
    action: Annotated[str, typer.Argument(help="status (the default): what it keeps warm; stop: close it all", metavar="[status|stop]")] = "status",
) -> None:
    """The background hub that keeps connections warm between commands: show it, or stop it."""
    if action == "stop":
        stopped = stop_hub()
        ended = stop_launchers()
        if not stopped and not ended:
            out_line("no hub runs")
        for reply in stopped:
            lent = int(reply.get("lent") or 0)
            tail = f"; {lent} connections in use close when their commands end" if lent else ""
            out_line(f"stopped the hub (pid {reply.get('pid')}){tail}")
        for pid in ended:
            out_line(f"stopped the launcher (pid {pid}); a command it runs finishes first")
        return
    if action != "status":
        err_line(f"error: unknown hub action {action!r}; use status or stop")
        raise typer.Exit(2)
    for line in hub_lines(hub_status()):
        out_line(line)


def stop_launchers() -> list[int]:
    """Tell this user's launchers to end (each ends once the commands it runs have)."""
    ended = []
    for pid in running_launchers():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            ended.append(pid)
    return ended


