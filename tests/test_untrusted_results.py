"""Every reader of a results folder treats it as untrusted input (issue 23, items 7 and 8):
``status``, ``jobs``, ``attach``, ``results``, ``pause``, ``resume`` and ``cancel`` end with one
error line or their normal output, never a traceback or a hang, whatever the folder holds.

A fuzz over the journal, the event file and a sweep's JSON files (every field given every other
type, depth, size, undecodable bytes), special files in place of the journal, the event file,
the control socket and a sweep's files (a folder, a FIFO, a link to /dev/zero, a socket, a huge
sparse file), and hostile control servers: one of our own uid answering garbage, one of another
uid (it is never asked anything: ``SO_PEERCRED`` says whose it is)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_terminal_text import (
    HOSTILE,
    assert_clean,
    cli,
    crafted_batch,
    crafted_sweep,
    dead_pid,
)

DEEP = "[" * 100_000 + "]" * 100_000
ODD: list[Any] = [
    None, True, False, 0, -1, 2**70, 1.5, float("inf"), float("nan"), "", "x", HOSTILE.replace("\x00", ""),
    [], {}, [1, "a", None], {"a": [1]}, [[[[[[[[[[1]]]]]]]]]], "a" * 200_001, list(range(300)),
]
BAD_LINES = [DEEP, '{"a":' * 50_000 + "1" + "}" * 50_000, "null", "[]", '"text"', "1e999", "9" * 5000,
             "\x00\x01", "{", '{"job": "a", "state": "started", "gpus": [' + "0," * 100_000 + "0]}"]


@contextlib.contextmanager
def deadline(seconds: int = 30) -> Iterator[None]:
    """A command that hangs (a FIFO read, a wait on a socket) fails the test instead."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """A command on untrusted input: it ends, within the deadline, with its usual output or with
    one error line; nothing it prints is raw."""
    with deadline():
        code, out, err = cli(capsys, *args)
    assert_clean(out + err)
    if code == 2:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and err.endswith("\n") and "Traceback" not in err, err
    return code, out, err


def write_lines(path: Path, lines: list[str | bytes]) -> None:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")) + b"\n"
                              for line in lines))


# --- the journal -------------------------------------------------------------------------------

JOURNAL = [
    {"t": 1.0, "job": "", "state": "batch", "token": "0123456789abcdef", "jobs": 3},
    {"t": 2.0, "job": "a", "state": "placed", "host": "h1", "gpus": [0], "command": "echo a"},
    {"t": 2.5, "job": "a", "state": "started", "host": "h1", "gpus": [0], "command": "echo a"},
    {"t": 3.0, "job": "a", "state": "failed", "host": "h1", "code": 1, "timed_out": False, "seconds": 0.5, "bytes": 3},
    {"t": 4.0, "job": "b", "state": "retry", "host": "h1", "code": 1},
    {"t": 5.0, "job": "b", "state": "requeued", "host": "h1"},
    {"t": 6.0, "job": "b", "state": "finished", "host": "h2", "code": 0, "timed_out": False, "seconds": 1.0, "bytes": 9},
    {"t": 7.0, "job": "c", "state": "cancelled", "host": "h2"},
]


def journal_variants(count: int = 160) -> list[list[str]]:
    """The journal with one field of one entry replaced by a value of another type, or one
    line replaced by something that is not an entry."""
    rng = random.Random(7)
    variants = []
    for _ in range(count):
        entries = [dict(e) for e in JOURNAL]
        entry = rng.choice(entries)
        entry[rng.choice([*entry, "extra"])] = rng.choice(ODD)
        variants.append([json.dumps(e) for e in entries])
    for bad in BAD_LINES:
        lines = [json.dumps(e) for e in JOURNAL]
        lines.insert(3, bad)
        variants.append(lines)
    return variants


def test_status_and_jobs_on_any_journal_end_with_their_output_or_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "job_results"
    results.mkdir()
    for lines in journal_variants():
        write_lines(results / ".journal.jsonl", list(lines))
        for command in (["status", str(results)], ["status", str(results), "--json"], ["jobs", str(results)]):
            code, _, _ = run(capsys, *command)
            assert code in (0, 2)


# --- the event file ----------------------------------------------------------------------------


def event_records() -> list[dict[str, Any]]:
    from tests.test_terminal_text import hostile_events

    return [e.to_json() for e in hostile_events()]


def events_variants(count: int = 120) -> list[list[str]]:
    rng = random.Random(11)
    header = {"version": 1, "event": "coordinator", "t": 1.0, "pid": dead_pid(), "host": socket.gethostname()}
    end = {"version": 1, "event": "coordinator_exit", "t": 9.0, "code": 0, "lines": ["done"]}
    variants = []
    for _ in range(count):
        records = [dict(header), *event_records(), dict(end)]
        record = rng.choice(records)
        key = rng.choice([k for k in record if k not in ("event", "version")] or ["extra"])
        value = rng.choice(ODD)
        if record is records[0] and key == "host" and isinstance(value, str) and value:
            value = None  # another host's coordinator is followed until it ends: not for a test
        record[key] = value
        variants.append([json.dumps(r) for r in records])
    for bad in BAD_LINES:
        variants.append([json.dumps(header), bad, *(json.dumps(r) for r in event_records()), json.dumps(end)])
        variants.append([bad, json.dumps(end)])  # no header
    variants.append([json.dumps({**header, "pid": -1})])  # kill(-1, 0) would name every process
    variants.append([json.dumps({**header, "pid": 0})])
    variants.append([])  # empty: nothing writes it
    return variants


def test_attach_on_any_event_file_ends_with_its_output_or_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ssh_scheduler.coordinator.detach as detach

    monkeypatch.setattr(detach, "HEADER_WAIT", 0.3)
    results = tmp_path / "job_results"
    results.mkdir()
    for lines in events_variants():
        write_lines(results / ".events.jsonl", list(lines))
        for command in (["attach", "--results-dir", str(results)], ["attach", "--json", "--results-dir", str(results)]):
            code, _, _ = run(capsys, *command)
            assert 0 <= code <= 255


# --- a sweep's files ---------------------------------------------------------------------------


def test_results_on_any_sweep_files_end_with_the_table_or_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(5)
    base = {"_name": "c1", "_index": 1, "_varying": ["lr"], "_commands": {"train": "t"}, "lr": 1}
    for n in range(120):
        out = tmp_path / f"out{n}"
        folder = out / "c1"
        folder.mkdir(parents=True)
        param, stat, metrics = dict(base), {"train": {"code": 0}}, {"acc": 1, "n": {"m": 2}}
        target = rng.choice([param, stat, stat["train"], metrics])
        target[rng.choice([*target, "extra"])] = rng.choice(ODD)
        texts = {"param.json": json.dumps(param), "stat.json": json.dumps(stat), "metrics.json": json.dumps(metrics)}
        if n % 10 == 0:
            texts[rng.choice(list(texts))] = rng.choice(BAD_LINES)
        for name, text in texts.items():
            (folder / name).write_text(text, encoding="utf-8", errors="surrogatepass")
        for flag in ([], ["--csv"]):
            code, _, _ = run(capsys, "results", str(out), *flag)
            assert code in (0, 2)


# --- special files in place of the folder's files ----------------------------------------------


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _folder(path: Path) -> None:
    path.mkdir()


def _to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere")


def _huge(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate((1 << 30) + 1)  # sparse: nothing is written, nothing may be read


def _socket(path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))  # bound, never listening: connect is refused
    listener.close()


def _link_to_a_copy(path: Path) -> None:
    copy = path.parent.parent / f"elsewhere-{path.name}"
    if path.exists():
        os.replace(path, copy)
    else:
        copy.write_text("{}")
    path.symlink_to(copy)


SPECIAL: dict[str, Callable[[Path], None]] = {
    "fifo": _fifo, "folder": _folder, "link to /dev/zero": _to_dev_zero, "dangling link": _dangling,
    "huge sparse file": _huge, "socket": _socket, "link to a copy": _link_to_a_copy,
}
BATCH_FILES = {".journal.jsonl": (["status"], ["jobs"]), ".events.jsonl": (["attach", "--results-dir"],),
               ".control.sock": (["status"], ["pause", "--results-dir"], ["cancel", "--all", "--results-dir"])}


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", BATCH_FILES)
def test_special_files_in_a_batch_folder_are_one_error_line(
    name: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "job_results"
    crafted_batch(results)
    target = results / name
    if target.exists() and kind != "link to a copy":
        target.unlink()
    SPECIAL[kind](target)
    for command in BATCH_FILES[name]:
        code, out, err = run(capsys, *command, str(results))
        if name == ".control.sock" and command == ["status"]:
            assert code == 0 and "stopped" in out  # the journal says it all; the socket is ignored
        elif name == ".control.sock":
            assert code == 2 and ("no batch is running" in err or "symbolic link" in err), err
        elif kind == "link to a copy" and name == ".journal.jsonl":
            assert code == 2 and "symbolic link" in err
        else:
            assert code in (1, 2), (code, out, err)


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", ["param.json", "stat.json", "metrics.json"])
def test_special_files_in_a_sweep_folder_are_one_error_line(
    name: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crafted_sweep(tmp_path / "out")
    target = tmp_path / "out" / "c1" / name
    if kind != "link to a copy":
        target.unlink()
    SPECIAL[kind](target)
    code, _, err = run(capsys, "results", str(tmp_path / "out"))
    assert code in (0, 2), err


# --- hostile control servers -------------------------------------------------------------------

REPLIES: list[bytes] = [
    b"", b"garbage\n", b"[1, 2]\n", b'{"ok": "yes"}\n', b'{"ok": true, "running": 5}\n',
    b'{"ok": true, "pid": "1"}\n', b'{"ok": true, "host": 7}\n', b'{"ok": false, "error": 7}\n',
    json.dumps({"ok": False, "error": HOSTILE}).encode() + b"\n",
    json.dumps({"ok": True, "pid": 12, "host": "elsewhere" + HOSTILE, "paused": True, "running": [HOSTILE]}).encode() + b"\n",
    DEEP.encode() + b"\n", b'{"ok": true, "x": "' + b"a" * (2 << 20) + b'"}\n', b"\xff\xfe\n",
]
CONTROL = (["status"], ["pause", "--results-dir"], ["resume", "--results-dir"], ["cancel", "j1", "--results-dir"],
           ["cancel", "--all", "--results-dir"])


class Server:
    """A control socket served by a thread of this process (our own uid) with one reply."""

    def __init__(self, results: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(results / ".control.sock"))
        self.listener.listen(8)
        self.reply = b""
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.settimeout(5)
                conn.recv(65536)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.stopped = True
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(timeout=10)


def test_a_server_of_our_uid_answering_garbage_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "job_results"
    crafted_batch(results)
    server = Server(results)
    try:
        for reply in REPLIES:
            server.reply = reply
            for command in CONTROL:
                code, out, err = run(capsys, *command, str(results))
                if command == ["status"]:
                    assert code == 0
                elif b'"ok": true' in reply and b'"pid": 12' in reply:
                    assert code == 0 and "elsewhere" not in err  # a sound reply: shown, escaped
                else:
                    assert code == 2, (reply[:80], command, out, err)
    finally:
        server.close()


def _serve_as(uid: int, listener: socket.socket, report: int) -> None:
    """The forked child: become ``uid``, then listen (SO_PEERCRED records the listener's
    credentials at listen time) and answer every connection like a coordinator would."""
    try:
        os.setgid(uid)
        os.setuid(uid)
        listener.listen(8)
        os.write(report, b"ready\n")
        listener.settimeout(30)
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(2)
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                os.write(report, b"sent " + data.replace(b"\n", b" ") + b"\n")
                with contextlib.suppress(OSError):
                    conn.sendall(b'{"ok": true, "pid": 1, "host": "x", "paused": false, "running": []}\n')
    finally:
        os._exit(0)


@pytest.mark.skipif(os.getuid() != 0, reason="serving as another uid needs root")
def test_a_socket_served_by_another_uid_is_never_asked_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "job_results"
    crafted_batch(results)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(results / ".control.sock"))
    report_read, report_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        _serve_as(65534, listener, report_write)
    os.close(report_write)
    listener.close()
    try:
        with open(report_read, "rb", closefd=True) as report:
            assert report.readline() == b"ready\n"
            for command in CONTROL:
                code, out, err = run(capsys, *command, str(results))
                if command == ["status"]:
                    assert code == 0 and err.startswith("warning: ") and "served by uid 65534" in err
                    assert "stopped" in out  # the coordinator it claims to be is not believed
                else:
                    assert code == 2 and "served by uid 65534, not by you" in err, err
                    assert "paused" not in out and "cancelled" not in out and "stopping" not in out
                assert report.readline() == b"sent \n"  # it was connected to, and sent nothing
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
