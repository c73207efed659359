"""Nothing from outside reaches the terminal raw (issue 23, item 7): every printed field is fed
an escape sequence (a window title, a cleared screen, a carriage return and a newline that would
draw a fake ``done:`` line, a C1 CSI, a bidi override, a NUL, an undecodable byte) and what comes
out must hold none of them raw, and no line of its own.

Through every way out: the plain lines of every event kind (CLI printers and the library's own),
the live view's lines and table, ``--json``, error lines, the log lines, ``doctor``'s table, and
``status`` / ``jobs`` / ``attach`` / ``results`` on a crafted results folder; on the SSH test
cluster, a host whose ``nvidia-smi`` prints escape sequences, seen by a batch and by ``doctor``."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import socket
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ssh_scheduler import events
from ssh_scheduler.cli.common import err_line, fail, out_line
from ssh_scheduler.coordinator.doctor import HostReport, parse_report, report_lines
from ssh_scheduler.errors import ConfigError, plain_text
from ssh_scheduler.events import Event, GpuReading
from ssh_scheduler.view.display import JsonLines, plain_subscriber, wire_logging
from ssh_scheduler.view.live import LiveView, render
from ssh_scheduler.view.terminal import TerminalLines

REPO = Path(__file__).resolve().parents[1]
FAKE_DONE = "done: 9 finished, 0 failed"
HOSTILE = (
    "h\x1b]0;pwned\x07\x1b[2J\x1b[1;1H\r" + FAKE_DONE + "\n" + FAKE_DONE + "\x9b31m\u202egnp.exe\x00\x7f\udcff"
    "[link=https://evil.example]click[/link]"
)


def assert_clean(text: str) -> None:
    """No character a terminal acts on (a newline ends a line), and no line that a field made."""
    raw = sorted({c for c in text if not (c.isprintable() or c in "\n\t")})
    assert raw == [], f"raw {raw!r} in {text!r}"
    assert not any(line.startswith(FAKE_DONE) for line in text.splitlines()), text


def _hostile(hint: Any) -> Any:
    if hint is str:
        return HOSTILE
    if hint is bool:
        return True
    if hint is int:
        return 3
    if hint is float:
        return 1.5
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _hostile(next(a for a in typing.get_args(hint) if a is not type(None)))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return (_hostile(args[0]),)
        return tuple(_hostile(a) for a in args)
    if hint is GpuReading:
        return GpuReading(0, 100, 200, 0.5)
    raise AssertionError(hint)


def hostile_events() -> list[Event]:
    """One event of every kind, every field hostile (a Notice of each level)."""
    made: list[Event] = []
    for name in events.__all__:
        cls = getattr(events, name)
        if not (isinstance(cls, type) and issubclass(cls, Event) and cls is not Event):
            continue
        hints = typing.get_type_hints(cls)
        values = {f.name: _hostile(hints[f.name]) for f in dataclasses.fields(cls) if f.name != "t"}
        made.append(cls(**values))
        if cls is events.Notice:
            made += [cls(**{**values, "level": level}) for level in ("info", "error")]
        if cls is events.JobStarted:
            made.append(cls(**{**values, "slurm_job": ""}))
        if cls is events.HostDown:
            made.append(cls(**{**values, "at_start": False}))
    assert len(made) >= 25
    return made


def test_every_event_s_plain_lines_are_escaped_on_the_cli_printers(capsys: pytest.CaptureFixture[str]) -> None:
    show = plain_subscriber(out_line, err_line, verbosity=1)
    for event in hostile_events():
        show(event)
    out, err = capsys.readouterr()
    assert_clean(out + err)
    assert "\\x1b]0;pwned\\x07" in out and "\\ndone: 9" in out  # shown, escaped


def test_the_library_s_lines_are_escaped_for_any_printer() -> None:
    lines: list[str] = []
    show = TerminalLines(lines.append, lines.append)
    for event in hostile_events():
        show(event)
    quiet = plain_subscriber(lines.append, lines.append, verbosity=1)
    for event in hostile_events():
        quiet(event)
    assert lines and all("\n" not in line for line in lines)
    assert_clean("\n".join(lines))


def test_json_lines_escape_every_field() -> None:
    lines: list[str] = []
    show = JsonLines(lines.append)
    for event in hostile_events():
        show(event)
    for line in lines:
        assert_clean(line)
        json.loads(line)


def test_the_live_view_draws_lines_and_table_escaped_and_never_as_markup() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False, color_system=None, width=500, highlight=False)
    view = LiveView(console=console, verbosity=1)
    for event in hostile_events():
        view(event)
    console.print(render(view.board))
    drawn = buffer.getvalue()
    assert_clean(drawn)
    assert "[link=https://evil.example]" in drawn  # the text itself, not a link


def test_error_and_log_lines_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    from ssh_scheduler.cli.main import _LowerLevel

    fail(ConfigError(f"cannot read {HOSTILE}"))
    record = logging.LogRecord("ssh_scheduler.transport", logging.WARNING, __file__, 1, "host said %s", (HOSTILE,), None)
    err_line(_LowerLevel().format(record))
    wire_logging(1, err_line)
    try:
        logging.getLogger("ssh_scheduler.transport").info("sent %s", HOSTILE)
    finally:
        wire_logging(0, err_line)
        for handler in list(logging.getLogger("ssh_scheduler").handlers):
            if type(handler).__name__ == "_ToPrinter":
                logging.getLogger("ssh_scheduler").removeHandler(handler)
    out, err = capsys.readouterr()
    assert_clean(out + err)
    assert err.startswith("error: cannot read h\\x1b]0;pwned") and err.count("\n") == 3


def test_doctor_s_table_is_escaped_and_stays_aligned() -> None:
    report = HostReport(HOSTILE, reachable=True, host_key=True, login=True, latency_ms=1.5, slurm=HOSTILE)
    parse_report(report, f"shell={HOSTILE}\npython=3.11{HOSTILE}\ndisk_free_kb=99999999\ncpus=4\n"
                         f"gpu=0, NVIDIA error {HOSTILE}\ncuda=13.0\nsetup_error={HOSTILE}\n")
    good = HostReport("h2", reachable=True, host_key=True, login=True, python="3.11", disk_free_mb=5000, cpus=2, latency_ms=2.0)
    lines = report_lines([report, good])
    assert_clean("\n".join(lines))
    header, first, second = lines[:3]
    assert header.index("latency") == first.index("1.5 ms") == second.index("2 ms")
    assert any(line.startswith("h\\x1b]0;pwned") and "nvidia-smi fails" in line for line in lines[3:])


# --- the readers of a results folder, through the real commands -------------------------------


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """A command in this process: its exit status, stdout and stderr (an exception fails the test)."""
    from ssh_scheduler.cli.main import main

    logger = logging.getLogger("ssh_scheduler")
    handlers = list(logger.handlers)
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:  # the CLI's log handler holds this test's captured stderr
        for handler in [h for h in logger.handlers if h not in handlers]:
            logger.removeHandler(handler)
    out, err = capsys.readouterr()
    return code, out, err


def dead_pid() -> int:
    done = subprocess.run(["true"], check=True)
    del done
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def crafted_batch(results: Path) -> None:
    """A batch's results folder as someone else might have written it: every text hostile."""
    results.mkdir(parents=True, exist_ok=True)
    text = HOSTILE.replace("\x00", "")  # a NUL in a journal is refused (its own test)
    entries = [
        {"t": 1.0, "job": "", "state": "batch", "token": "0123456789abcdef", "jobs": 3},
        {"t": 2.0, "job": text, "state": "started", "host": "h1", "gpus": [0], "command": text},
        {"t": 3.0, "job": text, "state": "failed", "host": "h1", "code": 1, "timed_out": False, "seconds": 1.0, "bytes": 5},
        {"t": 4.0, "job": "j2" + text, "state": "started", "host": "h1", "gpus": [1], "command": text},
        {"t": 5.0, "job": "j3" + text, "state": "finished", "host": "h1", "code": 0, "timed_out": False, "seconds": 2.0, "bytes": 7},
    ]
    (results / ".journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    header = {"version": 1, "event": "coordinator", "t": 1.0, "pid": dead_pid(), "host": socket.gethostname()}
    records = [header, *(e.to_json() for e in hostile_events())]
    records.append({"version": 1, "event": "coordinator_exit", "t": 9.0, "code": 3, "lines": [HOSTILE]})
    (results / ".events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def crafted_sweep(results: Path) -> None:
    folder = results / "c1"
    folder.mkdir(parents=True)
    (folder / "param.json").write_text(json.dumps({
        "_name": HOSTILE, "_index": 1, "_varying": ["p" + HOSTILE], "_commands": {"train": HOSTILE},
        "p" + HOSTILE: HOSTILE,
    }))
    (folder / "stat.json").write_text(json.dumps({"train": {"code": 0}}))
    (folder / "metrics.json").write_text(json.dumps({HOSTILE: HOSTILE, "nested": {HOSTILE: 1}, "list": [HOSTILE]}))


@pytest.mark.parametrize(
    "command",
    [["status"], ["status", "--json"], ["jobs"], ["attach"], ["attach", "--json"], ["attach", "-v"], ["attach", "--live"]],
    ids=" ".join,
)
def test_batch_readers_print_a_crafted_folder_escaped(command: list[str], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    crafted_batch(tmp_path / "job_results")
    code, out, err = cli(capsys, *command)
    assert_clean(out + err)
    assert "pwned" in out + err  # the text is shown, escaped
    assert code == (3 if command[0] == "attach" else 0), err


@pytest.mark.parametrize("flag", [[], ["--csv"], ["--tsv"], ["--json"]], ids=lambda f: " ".join(f) or "text")
def test_results_prints_a_crafted_sweep_escaped(flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    crafted_sweep(tmp_path / "out")
    code, out, err = cli(capsys, "results", str(tmp_path / "out"), *flag)
    assert code == 0, err
    assert_clean(out + err)
    assert "pwned" in out


def test_the_sanitizer_escapes_what_a_terminal_acts_on_and_keeps_the_rest() -> None:
    assert plain_text("é 中文 emoji 😀 C:\\path a\\tb") == "é 中文 emoji 😀 C:\\path a\\tb"
    assert plain_text("\x1b[2J\r\n\t\x9b\u202e\x00\x7f\udcff") == "\\x1b[2J\\r\\n\\t\\x9b\\u202e\\x00\\x7f\\udcff"
    assert plain_text("a\tb", tabs=True) == "a\tb"
    assert plain_text("x" * 10, limit=6) == "xxx..."
    assert plain_text(None) == "" and plain_text(3) == "3"


# --- on the SSH test cluster: a host whose nvidia-smi prints escape sequences -----------------

HOSTILE_SMI = (
    "#!/bin/sh\n"
    "printf 'NVML error \\033]0;pwned\\007\\033[2J\\033[1;1H\\r%s\\n' "
    f"'{FAKE_DONE}'\n"
    "printf 'GPU error \\033]0;pwned\\007\\033[2J\\233 %s' "  # the last line: the error a probe reports
    f"'{FAKE_DONE}' >&2\n"
    "exit 9\n"
)


@pytest.mark.namespaces
def test_a_host_s_escape_sequences_reach_no_terminal(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests.cluster import GpuSpec, HostSpec

    cluster = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=16000)])])
    (cluster.hosts[0].dir / "bin" / "nvidia-smi").write_text(HOSTILE_SMI)
    machines = ["--machines", str(cluster.machine_files[0])]
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ssh_scheduler", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, errors="surrogateescape", timeout=180)

    (tmp_path / "b.sh").write_text("echo gpu\n")
    gpu_batch = run("execute_batch", "b.sh", *machines, "--gpus-per-job", "1", "--plain")
    (tmp_path / "c.sh").write_text("echo cpu\n")
    cpu_batch = run("execute_batch", "c.sh", *machines, "--no-gpu-required", "--memory-required", "100",
                    "--plain", "-v", "--results-dir", "cpu_results")
    doctor = run("doctor", *machines)
    for done in (gpu_batch, cpu_batch, doctor):
        assert_clean(done.stdout + done.stderr)
    assert gpu_batch.returncode != 0 and "\\x1b]0;pwned" in gpu_batch.stderr, gpu_batch.stderr
    assert cpu_batch.returncode == 0, cpu_batch.stderr
    assert doctor.returncode == 1 and "\\x1b]0;pwned" in doctor.stdout, doctor.stdout
