"""What ``execute_to`` gives and shows: each host's result, the exit status of the whole, and its
output as prefixed lines, gathered blocks (``-b``, like ``clush -b``) or one JSON object per host.

Pure presentation of :class:`HostResult` values, plus :class:`Capture`, which keeps one host's
output and streams it as prefixed lines while the command runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ssh_scheduler.machines.hostlist import fold

LineSink = Callable[[str], None]

TIMEOUT_EXIT = 124
UNREACHABLE_EXIT = 255
MAX_LINE = 64 * 1024  # a longer run of bytes without a newline is shown as a line of its own
SEPARATOR = "-" * 15


@dataclass(frozen=True, slots=True)
class HostResult:
    host: str
    exit_code: int | None
    """The command's exit status (128+n for signal n, 124 when timed out); None when the host
    could not be reached or was lost before the command's end was seen."""
    stdout: bytes
    stderr: bytes
    seconds: float
    error: str | None = None
    timed_out: bool = False
    reached: bool = True
    """False when connecting failed (unreachable, host key, authentication)."""


@dataclass(frozen=True, slots=True)
class FleetResult:
    results: tuple[HostResult, ...]
    """One per machine, in the order the machines were given."""
    seconds: float

    @property
    def exit_status(self) -> int:
        return fleet_exit_status(self.results)


# --- pure helpers ----------------------------------------------------------------------------


def fleet_exit_status(results: Sequence[HostResult]) -> int:
    """0 when every host ran the command with exit 0; 255 when any host could not be reached
    (or was lost); otherwise the largest exit code."""
    if any(r.exit_code is None for r in results):
        return UNREACHABLE_EXIT
    return max((r.exit_code for r in results if r.exit_code is not None), default=0)


def _natural_key(text: str) -> tuple[tuple[int, int, str], ...]:
    return tuple(
        (0, int(chunk), chunk) if chunk.isdigit() else (1, 0, chunk)
        for chunk in re.split(r"(\d+)", text)
        if chunk
    )


def _groups(results: Sequence[HostResult], stream: str) -> list[tuple[list[str], bytes]]:
    by_output: dict[bytes, list[str]] = {}
    for r in results:
        data: bytes = getattr(r, stream)
        if data:
            by_output.setdefault(data, []).append(r.host)
    groups = [(sorted(hosts, key=_natural_key), data) for data, hosts in by_output.items()]
    groups.sort(key=lambda g: (_natural_key(g[0][0]), g[0][0]))
    return groups


def gather_outputs(results: Sequence[HostResult], stream: str = "stdout") -> list[tuple[str, bytes]]:
    """Each distinct non-empty output once, with the folded set of hosts that produced it,
    ordered by the first host of each set.  ``stream`` is ``"stdout"`` or ``"stderr"``."""
    return [(fold(hosts), data) for hosts, data in _groups(results, stream)]


def gather_blocks(results: Sequence[HostResult], stream: str = "stdout") -> list[str]:
    """The lines ``-b`` prints: per distinct output a header with the folded host set and its
    size between separator lines, then the output."""
    lines: list[str] = []
    for hosts, data in _groups(results, stream):
        header = f"{fold(hosts)} ({len(hosts)})"
        rule = "-" * max(len(SEPARATOR), len(header))
        lines += [rule, header, rule]
        text = _decode(data)
        lines += text[:-1].split("\n") if text.endswith("\n") else text.split("\n")
    return lines


_DESCRIBED = re.compile(r"^(?P<name>.+?) \([^()]*\): ")


def _reason(r: HostResult) -> str:
    """The error without the leading ``host (user@addr:port): `` the transport puts first."""
    error = r.error or "unknown error"
    m = _DESCRIBED.match(error)
    if m and m.group("name") == r.host:
        return error[m.end():]
    return error


def summarize_exit_codes(results: Sequence[HostResult]) -> list[str]:
    """One line per outcome: ``exit 0: h[1-6]``, ``exit 3: h7``, ``timed out: h9 (exit 124,
    ...)``, ``unreachable: h8 (reason)``, ``failed: h10 (reason)`` (lost after connecting)."""
    codes: dict[int, list[str]] = {}
    timed_out: dict[str, list[str]] = {}
    broken: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.timed_out:
            timed_out.setdefault(r.error or "", []).append(r.host)
        elif r.exit_code is not None:
            codes.setdefault(r.exit_code, []).append(r.host)
        else:
            label = "unreachable" if not r.reached else "failed"
            broken.setdefault((label, _reason(r)), []).append(r.host)
    lines = [f"exit {code}: {fold(hosts)}" for code, hosts in sorted(codes.items())]
    for why, hosts in timed_out.items():
        detail = f"exit {TIMEOUT_EXIT}, {why}" if why else f"exit {TIMEOUT_EXIT}"
        lines.append(f"timed out: {fold(hosts)} ({detail})")
    ordered = sorted(broken.items(), key=lambda kv: (kv[0][0], _natural_key(kv[1][0]), kv[1][0]))
    for (label, why), hosts in ordered:
        lines.append(f"{label}: {fold(hosts)} ({why})")
    return lines


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def json_line(r: HostResult) -> str:
    """One host as one JSON object on one line (outputs decoded as UTF-8, bad bytes replaced)."""
    return json.dumps(
        {
            "host": r.host,
            "exit_code": r.exit_code,
            "stdout": r.stdout.decode("utf-8", "replace"),
            "stderr": r.stderr.decode("utf-8", "replace"),
            "seconds": round(r.seconds, 3),
            "error": r.error,
            "timed_out": r.timed_out,
        },
        ensure_ascii=False,
    )


# --- output ----------------------------------------------------------------------------------


def discard(line: str) -> None:
    """No printer given: the library prints nothing itself (results are in the FleetResult)."""


class LineSplitter:
    """Feeds complete lines (and, at the end, the unfinished rest) to ``emit``."""

    def __init__(self, emit: Callable[[bytes], None]) -> None:
        self.emit = emit
        self.pending = bytearray()

    def feed(self, data: bytes) -> None:
        self.pending += data
        while True:
            cut = self.pending.find(b"\n")
            if cut < 0:
                if len(self.pending) >= MAX_LINE:
                    self.emit(bytes(self.pending))
                    self.pending.clear()
                return
            self.emit(bytes(self.pending[:cut]))
            del self.pending[: cut + 1]

    def flush(self) -> None:
        if self.pending:
            self.emit(bytes(self.pending))
            self.pending.clear()


class Capture:
    """One host's output: kept whole, and streamed as prefixed lines when asked."""

    def __init__(self, host: str, out: LineSink | None, err: LineSink | None) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()
        self._splitters: list[LineSplitter] = []
        self._out = self._err = None
        if out is not None:
            self._out = self._prefixed(host, out)
        if err is not None:
            self._err = self._prefixed(host, err)

    def _prefixed(self, host: str, sink: LineSink) -> LineSplitter:
        splitter = LineSplitter(lambda line: sink(f"{host}: {_decode(line)}"))
        self._splitters.append(splitter)
        return splitter

    def on_stdout(self, data: bytes) -> None:
        self.stdout += data
        if self._out is not None:
            self._out.feed(data)

    def on_stderr(self, data: bytes) -> None:
        self.stderr += data
        if self._err is not None:
            self._err.feed(data)

    # The per-job pipeline's output interface (jobrun.Output).
    offsets = (0, 0)

    def write(self, fd: int, data: bytes) -> None:
        self.on_output(fd, data)

    def on_output(self, fd: int, data: bytes) -> None:
        (self.on_stderr if fd == 2 else self.on_stdout)(data)

    def flush(self) -> None:
        for splitter in self._splitters:
            splitter.flush()
