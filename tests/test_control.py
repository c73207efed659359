"""The control socket on its own: mode, the peer uid check, long folder paths, bad requests."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from ssh_scheduler.coordinator.control import SOCKET_NAME, ControlError, ControlServer, send_request


async def ask(results: Path, request: dict[str, Any]) -> dict[str, Any]:
    return await asyncio.to_thread(send_request, results, request)


async def test_requests_reach_the_handler_over_a_0600_socket_even_in_a_deep_folder(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # over sun_path's 107 bytes
    deep.mkdir(parents=True)
    assert len(os.fsencode(deep / SOCKET_NAME)) > 107
    seen: list[dict[str, Any]] = []

    def handle(request: dict[str, Any]) -> dict[str, Any]:
        seen.append(request)
        return {"ok": True, "echo": request["command"]}

    server = ControlServer(deep, handle)
    await server.start()
    try:
        mode = (deep / SOCKET_NAME).stat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert (await ask(deep, {"command": "pause"}))["echo"] == "pause"
        assert seen == [{"command": "pause"}]
    finally:
        await server.close()
    assert not (deep / SOCKET_NAME).exists()
    with pytest.raises(ControlError, match="no batch is running in"):
        await ask(deep, {"command": "pause"})


async def test_a_peer_of_another_uid_is_refused(tmp_path: Path) -> None:
    # Root may connect whatever the socket's mode; SO_PEERCRED is what keeps others out.  Here
    # the batch "belongs" to another uid, so our own connection is the stranger's.
    seen: list[dict[str, Any]] = []
    server = ControlServer(tmp_path, lambda r: seen.append(r) or {"ok": True}, allowed_uid=os.getuid() + 4242)
    await server.start()
    try:
        with pytest.raises(ControlError, match=f"uid {os.getuid()} may not control a batch of uid"):
            await ask(tmp_path, {"command": "cancel", "jobs": ["a"]})
    finally:
        await server.close()
    assert seen == []  # the request never reached the handler


async def test_a_socket_left_by_a_killed_coordinator_is_replaced(tmp_path: Path) -> None:
    import socket

    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / SOCKET_NAME))
    stale.close()  # the file stays, nothing listens: what SIGKILL leaves
    with pytest.raises(ControlError, match="no batch is running"):
        await ask(tmp_path, {"command": "status"})
    server = ControlServer(tmp_path, lambda r: {"ok": True, "pid": 1})
    await server.start()
    try:
        assert (await ask(tmp_path, {"command": "status"}))["pid"] == 1
    finally:
        await server.close()
