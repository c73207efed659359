"""execute_batch through its real command line, for the end-to-end and fault tests: run to the
end, or run in the background and act at moments defined by the batch's own progress (its
output lines, its journal) rather than by a timer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tests.cluster import Cluster, Host

REPO = Path(__file__).resolve().parents[1]
EXECUTE_BATCH = [sys.executable, "-m", "ssh_scheduler", "execute_batch"]


def batch_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def run_batch(cwd: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EXECUTE_BATCH, *args], cwd=cwd, env=batch_env(), capture_output=True, text=True, timeout=timeout
    )


def machines(cluster: Cluster, count: int | None = None) -> list[str]:
    return ["--machines", *(str(p) for p in cluster.machine_files[:count])]


def journal(results: Path) -> list[dict[str, object]]:
    path = results / ".journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def batch_processes(host: Host) -> list[str]:
    """Processes of the host's login user (our agent and jobs), seen inside the host."""
    out = host.run(f"ps -u {host.user} -o pid=,args=").stdout
    return [line for line in out.splitlines() if line.strip() and "ps -u" not in line]


def wait_until(check: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Poll ``check()`` until true; the timeout only stops a hung test."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)



def alive(pid: int) -> bool:
    """Running: a zombie nobody reaped yet has ended."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class LiveBatch:
    """A batch running in the background in its own session; two threads collect its stdout and
    stderr lines as they come, so the test can wait for a line without blocking on a pipe."""

    def __init__(self, cwd: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*EXECUTE_BATCH, *args], cwd=cwd, env=env or batch_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: Iterable[str], into: list[str]) -> None:
        for line in stream:
            with self._changed:
                into.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _ended(self) -> bool:
        return not any(reader.is_alive() for reader in self._readers)

    def wait_for(self, prefix: str, count: int = 1, *, stderr: bool = False, timeout: float = 120) -> list[str]:
        """The first ``count`` lines starting with ``prefix``, once there are that many."""
        lines = self.err if stderr else self.out
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [line for line in lines if line.startswith(prefix)]
                if len(found) >= count:
                    return found[:count]
                assert not self._ended(), f"the batch ended before {count} x {prefix!r}:\n{self.text()}"
                left = deadline - time.monotonic()
                assert left > 0, f"no {count} x {prefix!r} yet:\n{self.text()}"
                self._changed.wait(left)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the coordinator (its whole session), as a crash would."""
        self.signal(signal.SIGKILL)
        self.finish()

    def finish(self, timeout: float = 180) -> int:
        """Wait for the end (the timeout only stops a hung test); the exit status."""
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.signal(signal.SIGKILL)
                self.proc.wait()
            for reader in self._readers:
                reader.join()
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
        return code

    def text(self) -> str:
        return "stdout:\n" + "\n".join(self.out) + "\nstderr:\n" + "\n".join(self.err)
