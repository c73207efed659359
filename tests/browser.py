"""A real headless browser for the report tests: Debian's ``chromium-headless-shell``, driven
through the Chrome DevTools protocol over a pipe (``--remote-debugging-pipe``: no port, no
websocket library), optionally in a network namespace of its own with nothing in it.

:func:`open_page` loads a file and returns what the tests look at: every request the page made
(the DevTools ``Network`` domain logs each one), the console and the page's exceptions, and
:meth:`Page.evaluate` / :meth:`Page.screenshot` on the drawn page.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BROWSERS = ("chromium-headless-shell", "chromium")


def browser() -> str | None:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class Page:
    proc: subprocess.Popen[bytes]
    to_browser: int
    from_browser: int
    session: str = ""
    requests: list[str] = field(default_factory=list)
    console: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    _next: int = 0
    _pending: bytes = b""

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._pending:
            import select

            left = deadline - time.monotonic()
            assert left > 0, "the browser did not answer"
            ready, _, _ = select.select([self.from_browser], [], [], left)
            if ready:
                chunk = os.read(self.from_browser, 1 << 20)
                assert chunk, f"the browser ended (exit {self.proc.poll()})"
                self._pending += chunk
        message, self._pending = self._pending.split(b"\0", 1)
        return json.loads(message)  # type: ignore[no-any-return]

    def _note(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled":
            self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Log.entryAdded":
            self.console.append(f"{params['entry'].get('level')}: {params['entry'].get('text')}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.exceptions.append(str(details.get("exception", {}).get("description") or details.get("text")))

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True, timeout: float = 60) -> dict[str, Any]:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next:
                assert "error" not in reply, reply["error"]
                return reply.get("result", {})  # type: ignore[no-any-return]
            self._note(reply)

    def wait_for(self, method: str, timeout: float = 60) -> dict[str, Any]:
        while True:
            message = self._read(timeout)
            self._note(message)
            if message.get("method") == method:
                return message.get("params", {})  # type: ignore[no-any-return]

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def screenshot(self, path: Path, width: int = 1400) -> None:
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))


def _high_pipe() -> tuple[int, int]:
    """A pipe whose ends are above fd 10 (the child's 3 and 4 are made from them)."""
    read, write = os.pipe()
    try:
        return fcntl.fcntl(read, fcntl.F_DUPFD_CLOEXEC, 10), fcntl.fcntl(write, fcntl.F_DUPFD_CLOEXEC, 10)
    finally:
        os.close(read)
        os.close(write)


@contextlib.contextmanager
def open_page(path: Path, *, width: int = 1400) -> Iterator[Page]:
    """``path`` loaded in a fresh headless Chromium (its own profile; as root, in a network
    namespace of its own with nothing in it: ``unshare --net``), drawn, ready."""
    binary = browser()
    assert binary is not None, "no Chromium: scripts/test installs chromium-headless-shell"
    # The browser's ends go to fds 3 and 4 in the child: keep ours above them meanwhile.
    to_read, to_browser = _high_pipe()
    from_browser, to_write = _high_pipe()
    profile = tempfile.mkdtemp(prefix="report-browser-")
    argv = [
        binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
        f"--user-data-dir={profile}", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-default-apps", "--disable-sync", "--hide-scrollbars",
        f"--window-size={width},900", "about:blank",
    ]
    if os.geteuid() == 0:
        argv = ["unshare", "--net", "--", *argv]

    def plumb() -> None:  # the pipe's ends as the browser expects them: fd 3 in, fd 4 out
        os.dup2(to_read, 3)
        os.dup2(to_write, 4)

    proc = subprocess.Popen(argv, pass_fds=(3, 4), preexec_fn=plumb, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_read)
    os.close(to_write)
    page = Page(proc, to_browser, from_browser)
    try:
        targets = page.send("Target.getTargets", session=False)["targetInfos"]
        target = next(t["targetId"] for t in targets if t["type"] == "page")
        page.session = page.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        for domain in ("Network", "Runtime", "Log", "Page"):
            page.send(f"{domain}.enable")
        page.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False})
        page.send("Page.navigate", {"url": path.resolve().as_uri()})
        page.wait_for("Page.loadEventFired")
        yield page
    finally:
        with contextlib.suppress(OSError):
            os.close(to_browser)
        with contextlib.suppress(OSError):
            os.close(from_browser)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
