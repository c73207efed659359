"""The command line's questions to this user's hubs (hub_server.py): what each holds
(``ssh-scheduler status``, ``hub status``) and that each stop (``hub stop``).  Blocking, one short
request per hub socket in the private folder, each answered only by a hub of our own uid."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from ssh_scheduler.transport.hub_place import (
    REACH_TIMEOUT,
    SOCKET_PREFIX,
    SUPPORTED,
    HubUnusable,
    folder_path,
    private_folder,
)
from ssh_scheduler.transport.unix_socket import peer_uid


def hub_status() -> list[dict[str, Any]]:
    """What every hub of this user holds (one answer per hub that answered; blocking)."""
    return [reply for reply in _ask_all({"op": "status"}) if reply.get("ok")]


def stop_hub() -> list[dict[str, Any]]:
    """Tell every hub of this user to stop (connections lent now finish first); their answers."""
    return [reply for reply in _ask_all({"op": "stop"}) if reply.get("ok")]


def _ask_all(request: dict[str, Any]) -> list[dict[str, Any]]:
    if not SUPPORTED:
        return []
    try:
        folder = private_folder(create=False)
    except HubUnusable:
        return []
    answers = []
    for path in sorted(folder.glob(f"{SOCKET_PREFIX}*.sock")):
        with contextlib.suppress(OSError, ValueError, HubUnusable):
            answers.append(_ask(path, request))
    return answers


def _ask(path: Path, request: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(REACH_TIMEOUT)
        sock.connect(str(path))
        if peer_uid(sock) != os.getuid():
            raise HubUnusable(f"{path} is not served by us")
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data)
    if not isinstance(reply, dict):
        raise ValueError("not an object")
    return reply


def hub_folder() -> Path:
    """Where the hubs of this user listen (for messages)."""
    return folder_path()


__all__ = ["hub_folder", "hub_status", "stop_hub"]
