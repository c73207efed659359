"""``ssh-scheduler report`` without a browser: the event file every run keeps, reading a results
folder back (events, journal, crafted input), the page's data, and the page itself."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.events import (
    BatchFinished,
    BatchStarted,
    Event,
    GpuReading,
    HostDown,
    HostProbed,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobPlaced,
    JobReattached,
    JobRequeued,
    JobRetrying,
    JobStarted,
)
from ssh_scheduler.machines.host_state import GpuProcess, GpuState, HostState, OwnUsage, probed
from ssh_scheduler.results.batch_history import read_history
from ssh_scheduler.results.event_log import EVENTS_NAME, EventLog, ProbeThinning
from ssh_scheduler.results.results_table import ResultRow
from ssh_scheduler.view.display import report_line
from ssh_scheduler.view.report_data import report_data, visible
from ssh_scheduler.view.report_page import embedded_json, render_page

REPO = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000.0


def probe(t: float, host: str, *gpus: GpuReading) -> HostProbed:
    return HostProbed(host=host, cpus=8, load=0.0, memory_free_mb=1000, memory_total_mb=2000, gpus=gpus, t=T0 + t)


def ran(job: str, host: str, gpus: tuple[int, ...], start: float, *, mem: int = 0, command: str = "train") -> list[Event]:
    return [
        JobPlaced(job=job, host=host, gpus=gpus, command=command, t=T0 + start - 0.1),
        JobStarted(job=job, host=host, gpus=gpus, command=command, gpu_memory_mb=mem, t=T0 + start),
    ]


BATCH: list[Event] = [
    probe(0, "h1", GpuReading(0, 5480, 16384, 0.2, 0), GpuReading(1, 480, 16384, 0.0, 0)),
    BatchStarted(token="0123456789abcdef", jobs=6, hosts=("h1", "h2"), t=T0),
    *ran("a", "h1", (0,), 1, mem=4000),
    *ran("b", "h1", (0,), 1, mem=4000),
    *ran("c", "h2", (0,), 1, mem=4000),
    *ran("d", "h1", (), 1),
    probe(2, "h1", GpuReading(0, 11480, 16384, 0.8, 6000), GpuReading(1, 480, 16384, 0.0, 0)),
    HostDown(host="h2", reason="connection reset", t=T0 + 3),
    JobRequeued(job="c", host="h2", reason="host h2 was lost", t=T0 + 3),
    JobFinished(job="a", host="h1", command="train", code=0, seconds=4, bytes_received=100, t=T0 + 5),
    JobFailed(job="b", host="h1", command="train", code=3, reason="exit 3", seconds=4, t=T0 + 5),
    *ran("c", "h1", (1,), 5, mem=4000),
    JobRetrying(job="d", host="h1", code=1, attempt=1, attempts=2, t=T0 + 6),
    *ran("d", "h1", (), 6),
    JobFailed(job="c", host="h1", command="train", code=124, reason="timed out after 3 s", seconds=3, timed_out=True, t=T0 + 8),
    JobCancelled(job="d", host="h1", t=T0 + 9),
    JobCancelled(job="e", host="", t=T0 + 9),
    BatchFinished(finished=1, failed=("b", "c"), skipped=0, not_run=(), cancelled=True, halted=False,
                  seconds=10, bytes_sent=5, files_sent=1, bytes_received=100, t=T0 + 10),
]


def write_events(folder: Path, events: list[Event], *, end: tuple[int, list[str]] | None = (1, ["done: ..."])) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    log = EventLog(folder)
    for event in events:
        log(event)
    if end is not None:
        log.finish(*end)


def records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / EVENTS_NAME).read_text().splitlines()]


# --- the event file -------------------------------------------------------------------------


def test_the_event_file_is_made_at_the_batch_s_start_and_ends_with_the_exit_record(tmp_path: Path) -> None:
    (tmp_path / EVENTS_NAME).write_text("an earlier run's\n")
    log = EventLog(tmp_path, lambda: (0, ["done: 1 finished"]))
    with log:
        log(probe(0, "h1"))
        assert (tmp_path / EVENTS_NAME).read_text() == "an earlier run's\n"  # not ours until the folder is
        log(BatchStarted(token="t", jobs=1, hosts=("h1",), t=T0))
        log(JobFinished(job="a", host="h1", command="x", code=0, seconds=1, t=T0 + 1))
    kinds = [r["event"] for r in records(tmp_path)]
    assert kinds == ["coordinator", "host_probed", "batch_started", "job_finished", "coordinator_exit"]
    assert records(tmp_path)[0]["pid"] == os.getpid() and records(tmp_path)[-1]["lines"] == ["done: 1 finished"]
    assert (tmp_path / EVENTS_NAME).stat().st_mode & 0o777 == 0o600


def test_a_run_refused_before_its_start_leaves_no_event_file_and_an_error_ends_it(tmp_path: Path) -> None:
    from ssh_scheduler.errors import NoUsableHostError

    with pytest.raises(NoUsableHostError), EventLog(tmp_path) as log:
        log(probe(0, "h1"))
        raise NoUsableHostError("no host could be reached; nothing was run")
    assert not (tmp_path / EVENTS_NAME).exists()
    with pytest.raises(NoUsableHostError), EventLog(tmp_path) as log:
        log(BatchStarted(token="t", jobs=1, hosts=("h1",), t=T0))
        raise NoUsableHostError("nothing left")
    last = records(tmp_path)[-1]
    assert (last["event"], last["code"], last["lines"]) == ("coordinator_exit", NoUsableHostError.exit_code, ["error: nothing left"])


def test_probes_are_all_kept_in_a_short_batch_and_one_a_minute_in_a_long_one() -> None:
    thinning = ProbeThinning()
    kept = [t for t in range(0, 200 * 3600, 1) if thinning.keep(probe(t, "h1"))]
    assert kept[:120] == list(range(120))  # the first minutes: every probe (one a second here)
    late = [b - a for a, b in itertools.pairwise(kept) if a > 4 * 3600]
    assert late and set(late) == {60}  # after hours: one a minute
    assert len(kept) < 200 * 60 + 1200  # the bound: one a minute, and about a thousand more
    other = ProbeThinning()
    assert other.keep(probe(0, "h1")) and other.keep(probe(0.5, "h2")) and not other.keep(probe(0.6, "h1"))


def test_a_write_that_fails_costs_the_viewers_not_the_batch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog(tmp_path)
    log(BatchStarted(token="t", jobs=1, hosts=("h1",), t=T0))
    assert log._fd is not None
    os.close(log._fd)  # as a full disk or a gone folder would
    log._fd = os.open("/dev/full", os.O_WRONLY)
    log(JobFinished(job="a", host="h1", command="x", code=0, seconds=1))
    log(JobFinished(job="b", host="h1", command="x", code=0, seconds=1))
    log.finish(0, [])
    assert [r.message for r in caplog.records] == [
        "cannot write .events.jsonl ([Errno 28] No space left on device): attach and report will not see the rest of this batch"
    ]


def test_a_probe_splits_each_gpu_s_memory_into_ours_by_pid_and_everyone_else_s() -> None:
    state = HostState(
        4, 0.0, 16384, 12000,
        (GpuState(0, "G0", "sim", 16384, 11480, 4904, 0.8), GpuState(1, "G1", "sim", 16384, 480, 15904, 0.0)),
        (GpuProcess(10, "G0", 3000), GpuProcess(11, "G0", 3000), GpuProcess(99, "G0", 5000)),
    )
    own = {"b.1": OwnUsage(frozenset({10})), "b.2": OwnUsage(frozenset({11, 12}))}
    assert [(g.memory_used_mb, g.ours_mb) for g in probed("h", state, own).gpus] == [(11480, 6000), (480, 0)]
    assert [g.ours_mb for g in probed("h", state).gpus] == [0, 0]


# --- reading a folder back ------------------------------------------------------------------


def test_every_attempt_is_read_back_with_how_it_ended(tmp_path: Path) -> None:
    write_events(tmp_path, BATCH)
    history = read_history(tmp_path, running=False, now=T0 + 100)
    got = [(a.job, a.host, a.gpus, a.start - T0, None if a.end is None else a.end - T0, a.outcome) for a in history.attempts]
    assert got == [
        ("a", "h1", (0,), 1, 5, "finished"),
        ("b", "h1", (0,), 1, 5, "failed"),
        ("c", "h2", (0,), 1, 3, "requeued"),
        ("d", "h1", (), 1, 6, "failed"),
        ("c", "h1", (1,), 5, 8, "timed_out"),
        ("d", "h1", (), 6, 9, "cancelled"),
    ]
    assert history.attempts[3].retried and history.attempts[2].reason == "host h2 was lost"
    assert history.hosts == ["h1", "h2"] and history.state == "finished" and history.cancelled_queued == ["e"]
    assert [(c.host, c.what, c.reason) for c in history.host_changes] == [("h2", "down", "connection reset")]
    assert (history.bytes_sent, history.files_sent, history.bytes_received, history.exit_code) == (5, 1, 100, 1)
    assert [p.gpus[0].ours_mb for p in history.probes] == [0, 6000]


def test_a_running_batch_is_a_snapshot_and_a_killed_one_has_no_end(tmp_path: Path) -> None:
    events = BATCH[:11]  # a, b, c, d started, a probe; nothing ended
    write_events(tmp_path, events, end=None)
    running = read_history(tmp_path, running=True, now=T0 + 30)
    assert {a.outcome for a in running.attempts} == {"running"} and running.state == "running"
    assert running.last == T0 + 30  # the bars reach the moment the folder was read
    killed = read_history(tmp_path, running=False, now=T0 + 30)
    assert killed.state == "stopped" and {a.outcome for a in killed.attempts} == {"unknown"}
    assert {a.end for a in killed.attempts} == {T0 + 2}  # the last thing it recorded


def test_without_an_event_file_the_journal_tells_the_latest_run(tmp_path: Path) -> None:
    from ssh_scheduler.results.journal import Journal, JournalWriter

    tmp_path.mkdir(exist_ok=True)
    with Journal.open(tmp_path) as journal:
        writer = JournalWriter(journal)
        for event in BATCH:
            if event != BATCH[-2]:  # a queued job's cancel: the journal records no host for it
                writer(event)
    history = read_history(tmp_path, running=False, now=T0)
    assert [a.outcome for a in history.attempts] == ["finished", "failed", "requeued", "failed", "timed_out", "cancelled"]
    assert not history.from_events and history.probes == []


def test_a_rerun_draws_its_own_run_and_a_reattached_job_from_its_first_start(tmp_path: Path) -> None:
    lines = [
        {"t": T0, "job": "", "state": "batch", "token": "0123456789abcdef", "jobs": 2},
        {"t": T0 + 1, "job": "a", "state": "started", "host": "h1", "gpus": [0], "command": "x"},
        {"t": T0 + 1, "job": "b", "state": "started", "host": "h1", "gpus": [1], "command": "y"},
    ]  # the first coordinator was killed here
    (tmp_path / ".journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    write_events(tmp_path, [
        BatchStarted(token="0123456789abcdef", jobs=1, hosts=("h1",), t=T0 + 50),
        JobReattached(job="a", host="h1", gpus=(0,), running=True, t=T0 + 50),
        JobFinished(job="a", host="h1", command="x", code=0, seconds=60, t=T0 + 60),
    ])
    with (tmp_path / ".journal.jsonl").open("a") as journal:  # the rerun's own journal lines
        journal.write(json.dumps({"t": T0 + 50, "job": "", "state": "batch", "token": "0123456789abcdef", "jobs": 1}) + "\n")
    history = read_history(tmp_path, running=False, now=T0 + 70)
    assert [(a.job, a.start, a.end, a.outcome) for a in history.attempts] == [("a", T0 + 1, T0 + 60, "finished")]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ({"event": "job_started", "t": "soon", "job": "a", "host": "h1"}, "line 3: 't' must be a number, got 'soon'"),
        ({"event": "job_started", "t": 1.0, "job": "a", "host": "h1", "gpus": "0,1"}, "'gpus' must be a list of GPU indices"),
        ({"event": "host_probed", "t": 1.0, "host": "h1", "gpus": [{"index": -1}]}, "indices from 0 to 4095"),
        ({"event": "job_failed", "t": 1.0, "job": ["a"], "host": "h1"}, "'job' must be a string, got ['a']"),
        ({"event": "job_finished", "t": 1.0, "job": "a", "host": "h1", "seconds": 1e400}, "'seconds' must be a number"),
        ({"event": "coordinator_exit", "t": 1.0, "code": 0, "lines": [1]}, "'lines' must be a list of strings"),
    ],
)
def test_a_crafted_event_file_is_one_error_naming_its_line(tmp_path: Path, line: dict[str, Any], says: str) -> None:
    text = json.dumps({"event": "batch_started", "t": 0.0, "jobs": 1, "hosts": []}) + "\n{torn\n" + json.dumps(line).replace("1e400", "1e999")
    (tmp_path / EVENTS_NAME).write_text(text + "\n")
    with pytest.raises(ConfigError) as caught:
        read_history(tmp_path, running=False, now=0.0)
    message = str(caught.value)
    assert says in message and str(tmp_path / EVENTS_NAME) in message and "\n" not in message


def test_the_command_says_one_line_for_a_crafted_folder_and_never_a_traceback(tmp_path: Path) -> None:
    def report(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ssh_scheduler", "report", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))

    nothing = report()
    assert nothing.returncode == 2 and nothing.stderr.startswith("error: job_results is not a folder")
    folder = tmp_path / "job_results"
    folder.mkdir()
    empty = report()
    assert empty.returncode == 2 and "holds no batch" in empty.stderr and len(empty.stderr.splitlines()) == 1
    (folder / ".journal.jsonl").write_text(json.dumps({"t": 1, "job": "a", "state": "started", "host": "h\x1b[2J"}) + "\n")
    bad = report()
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "Traceback" not in bad.stderr
    (folder / ".journal.jsonl").write_text(json.dumps({"t": 1, "job": "a", "state": "finished", "host": "h", "seconds": "long"}) + "\n")
    bad = report()
    assert bad.returncode == 2 and "'seconds' must be a duration in seconds, got 'long'" in bad.stderr and len(bad.stderr.splitlines()) == 1
    (folder / ".journal.jsonl").write_text(json.dumps({"t": 1, "job": "a", "state": "finished", "host": "h", "seconds": 2}) + "\n")
    unwritable = report("-o", "no/such/folder/r.html")
    assert unwritable.returncode == 2 and unwritable.stderr.startswith("error: cannot write no/such/folder/r.html")
    good = report()
    assert good.returncode == 0 and good.stdout == "report: report.html (1 attempts on 1 lanes)\n"
    (tmp_path / "report.html").unlink()
    (tmp_path / "elsewhere.html").write_text("keep me")
    (tmp_path / "link.html").symlink_to(tmp_path / "elsewhere.html")
    assert report("-o", "link.html").returncode == 0
    assert (tmp_path / "elsewhere.html").read_text() == "keep me" and not (tmp_path / "link.html").is_symlink()


def test_a_planted_link_never_carries_another_file_into_the_report(tmp_path: Path) -> None:
    write_events(tmp_path, [
        BatchStarted(token="t", jobs=2, hosts=("h1",), t=T0),
        JobFailed(job="a", host="h1", command="x", code=1, reason="exit 1", seconds=1, t=T0 + 1),
        JobFailed(job="../secret", host="h1", command="x", code=1, reason="exit 1", seconds=1, t=T0 + 1),
    ])
    (tmp_path.parent / "secret.err").write_text("the secret\n")
    (tmp_path / "a.err").symlink_to(tmp_path.parent / "secret.err")
    data = report_data(read_history(tmp_path, running=False, now=T0), title="x")
    assert [f["err"] for f in data["summary"]["failures"]] == [None, None]


# --- the page's data ------------------------------------------------------------------------


def test_lanes_rows_reservations_and_the_summary(tmp_path: Path) -> None:
    write_events(tmp_path, BATCH)
    (tmp_path / "b.err").write_text("Traceback...\n" + "".join(f"line {n}\n" for n in range(30)))
    data = report_data(read_history(tmp_path, running=False, now=T0 + 100), title="job_results")
    assert [(lane["name"], lane["rows"]) for lane in data["lanes"]] == [
        ("h1", 1), ("h1 GPU 0", 2), ("h1 GPU 1", 1), ("h2 GPU 0", 1),
    ]
    assert len(data["bars"]) == 6 and sorted(b[4] for b in data["bars"]) == list(range(6))
    gpu0 = data["gpus"][0]
    assert (gpu0["host"], gpu0["index"], gpu0["total"]) == ("h1", 0, 16384)
    assert gpu0["reserved"] == [[1.0, 8000], [5.0, 0]] and gpu0["peak"] == 13480 and not gpu0["over"]
    assert gpu0["idleHeld"] == 0.0 and data["gpus"][1]["idleHeld"] is None
    summary = data["summary"]
    assert summary["jobsByOutcome"] == {**dict.fromkeys(data["outcomes"], 0), "finished": 1, "failed": 1, "timed_out": 1, "cancelled": 1}
    assert summary["attemptsByOutcome"]["requeued"] == 1 and summary["retried"] == 1 and summary["cancelledQueued"] == 1
    assert [data["attempts"]["job"][i] for i in summary["slowest"][:3]] == ["d", "a", "b"]
    failures = {data["attempts"]["job"][f["attempt"]]: f["err"] for f in summary["failures"]}
    assert failures["c"] is None and failures["b"].splitlines() == ["Traceback...", *(f"line {n}" for n in range(11))]
    assert [b["fraction"] for b in summary["busy"]] == [0.8, 0.4, 0.3, 0.2]


def test_an_over_committed_card_is_flagged() -> None:
    from ssh_scheduler.results.batch_history import Attempt, BatchHistory, Probe

    history = BatchHistory(Path("r"), T0 + 10, began=T0, hosts=["h1"])
    history.attempts = [Attempt("a", "h1", (0,), T0 + 1, end=T0 + 9, outcome="finished", gpu_memory_mb=12000)]
    history.probes = [Probe(T0 + 5, "h1", (GpuReading(0, 9000, 16384, 0.01, 2000),))]
    gpu = report_data(history, title="r")["gpus"][0]
    assert gpu["peak"] == 19000 and gpu["over"] and gpu["idleHeld"] == 1.0


def test_a_sweep_plots_each_numeric_metric_against_each_varying_parameter() -> None:
    from ssh_scheduler.results.batch_history import BatchHistory

    rows = [
        ResultRow(f"c{i}", i, {"lr": lr, "opt": opt}, ("lr", "opt"), "done", {"loss": loss, "note": "x"})
        for i, (lr, opt, loss) in enumerate([(0.1, "sgd", 0.5), (0.001, "adam", 0.2), (0.01, "sgd", 0.3)])
    ]
    sweep = report_data(BatchHistory(Path("r"), T0), title="r", sweep=rows)["sweep"]
    assert sweep["columns"] == ["name", "lr", "opt", "state", "loss", "note"]
    assert [(p["metric"], p["param"], p["numeric"], p["log"]) for p in sweep["plots"]] == [
        ("loss", "lr", True, True), ("loss", "opt", False, False),
    ]
    assert sweep["plots"][0]["points"][1] == [0.001, 0.2, "c1"]


# --- the page -------------------------------------------------------------------------------


HOSTILE = '</script><script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">\x1b[2J\u202e'


def test_hostile_text_cannot_end_the_data_or_hide_as_a_control_sequence() -> None:
    assert visible("a\x1b[31mred\x07\u202eevil\nnext\tx") == "a\\x1b[31mred\\x07\\u202eevil\\x0anext\\x09x"
    assert visible("keep\nlines\tand tabs\x1b", lines=True) == "keep\nlines\tand tabs\\x1b"
    text = embedded_json({"name": HOSTILE, "sep": "\u2028"})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"name": HOSTILE, "sep": "\u2028"}


def test_the_page_is_self_contained_and_runs_only_its_own_script(tmp_path: Path) -> None:
    write_events(tmp_path, BATCH)
    page = render_page(report_data(read_history(tmp_path, running=False, now=T0), title=HOSTILE))
    assert not re.search(r"<[^>]*\s(src|href)\s*=|https?://(?!www\.w3\.org/2000/svg)|@import|url\(", page)  # nothing to fetch
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)
    assert policy is not None and policy.group(1).startswith("default-src &#x27;none&#x27;; script-src &#x27;sha256-")
    assert page.count("<script") == 2 and "window.__pwned" in page and "<script>window.__pwned" not in page
    assert "<title>ssh_scheduler report: &lt;/script&gt;" in page


def test_the_summary_and_a_sweep_name_the_command_that_draws_the_report() -> None:
    assert report_line(Path("job_results")) == "  report: ssh-scheduler report  (one HTML page: timeline, GPUs, failures)"
    assert report_line(Path("runs/my results")).startswith("  report: ssh-scheduler report 'runs/my results'  (")
    # Naming it does not load the page's module (html, hashing, templates): every batch ends so.
    named = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from ssh_scheduler.view.display import summary_lines, report_line;"
         " report_line(Path('x')); assert 'ssh_scheduler.view.report_page' not in sys.modules"],
        capture_output=True, text=True, timeout=60,
    )
    assert named.returncode == 0, named.stderr


def test_twenty_thousand_jobs_make_a_page_in_seconds(tmp_path: Path) -> None:
    # No timing is asserted (the machine is shared); the time is printed, and the page must
    # stay a few MB with every attempt in it.
    events: list[Event] = [BatchStarted(token="t", jobs=20_000, hosts=tuple(f"g{h}" for h in range(10)), t=T0)]
    for n in range(20_000):
        host, gpu, start = f"g{n % 10}", (n // 10) % 8, (n // 80) * 30.0 + (n % 7)
        events += ran(f"j.{n}", host, (gpu,), start, mem=4000, command=f"python train.py --seed {n}")
        if n % 50 == 0:
            events.append(JobFailed(job=f"j.{n}", host=host, command="x", code=1, reason="exit 1", seconds=20, t=T0 + start + 20))
        else:
            events.append(JobFinished(job=f"j.{n}", host=host, command="x", code=0, seconds=25, t=T0 + start + 25))
    for t in range(0, 7500, 15):
        events += [probe(t, f"g{h}", *(GpuReading(g, 8000, 81559, 0.9, 8000) for g in range(8))) for h in range(10)]
    write_events(tmp_path, events)
    began = time.monotonic()
    page = render_page(report_data(read_history(tmp_path, running=False, now=T0), title="big"))
    took = time.monotonic() - began
    print(f"20,000 jobs: {len(page) / 1e6:.1f} MB page in {took:.1f} s")
    assert 1e6 < len(page) < 12e6 and page.count('"j.19999"') == 1


def test_lanes_follow_the_order_the_machines_were_given_not_which_answered_first(tmp_path: Path) -> None:
    write_events(tmp_path, [
        probe(0, "h2", GpuReading(0, 0, 100, 0.0)), probe(0.1, "h9"), probe(0.2, "h1", GpuReading(0, 0, 100, 0.0)),
        BatchStarted(token="t", jobs=1, hosts=("h1", "h2"), t=T0 + 1),
    ])
    history = read_history(tmp_path, running=False, now=T0)
    assert history.hosts == ["h1", "h2", "h9"]
    assert [lane["name"] for lane in report_data(history, title="x")["lanes"]] == ["h1 GPU 0", "h2 GPU 0", "h9"]
