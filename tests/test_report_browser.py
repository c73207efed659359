"""The report in a real headless Chromium (tests/browser.py): hostile text stays text, and the
report of a batch while it runs, after it was killed, and of a detached one, each drawn with
its bars as the batch left them.  (The cluster batch of the acceptance: test_report_cluster.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ssh_scheduler.events import BatchStarted, HostDown, JobFailed, JobPlaced, JobStarted
from ssh_scheduler.results.event_log import EventLog
from tests.browser import Page, browser, open_page
from tests.cluster import skip_or_fail
from tests.test_detach import CLI, LOCAL, batch_dir, cli_run, coordinator_pid, env, gone
from tests.test_report import T0

HOSTILE = '</script><script>window.__pwned=1</script><img src=x onerror="window.__pwned=2"><b id=bold>'


@pytest.fixture(autouse=True)
def _chromium() -> None:
    if browser() is None:
        skip_or_fail("no Chromium (Debian: chromium-headless-shell); scripts/test installs it")


def drawn(page: Page) -> dict[str, Any]:
    """What every report must be: drawn whole, nothing fetched, nothing thrown or complained
    of (a CSP violation is a console message); its data back."""
    assert page.evaluate("document.body.dataset.drawn") == "yes", page.exceptions
    assert len(page.requests) == 1 and page.requests[0].startswith("file:///")
    assert page.exceptions == [] and page.console == []
    return page.evaluate("JSON.parse(document.getElementById('data').textContent)")  # type: ignore[no-any-return]


def bar_classes(page: Page) -> list[str]:
    return page.evaluate("[...document.querySelectorAll('rect.bar')].map(r => r.getAttribute('class'))")  # type: ignore[no-any-return]


def test_hostile_names_commands_hosts_and_output_are_shown_as_text_never_run(tmp_path: Path) -> None:
    folder = tmp_path / "job_results"
    folder.mkdir()
    host = "h<script>window.__pwned=3</script>\x1b[31m"
    job = "<img src=x onerror=window.__pwned=4>.1"  # a valid job name: it has an .err
    log = EventLog(folder)
    for event in (
        BatchStarted(token="t", jobs=2, hosts=(host,), t=T0),
        JobPlaced(job=job, host=host, gpus=(0,), command=HOSTILE, t=T0),
        JobStarted(job=job, host=host, gpus=(0,), command=HOSTILE, t=T0 + 1),
        JobFailed(job=job, host=host, command=HOSTILE, code=1, reason="exit 1", message=HOSTILE, seconds=2, t=T0 + 3),
        JobStarted(job=HOSTILE, host=host, gpus=(), command="\x1b]0;pwned\x07", t=T0 + 1),
        HostDown(host=host, reason=HOSTILE, t=T0 + 4),
    ):
        log(event)
    log.finish(1, [HOSTILE])
    (folder / f"{job}.err").write_text("Traceback\n" + HOSTILE + "\n\x1b[2J\x1b]0;title\x07\n")
    made = subprocess.run([*CLI, "report", "-o", "r.html"], cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    with open_page(tmp_path / "r.html") as page:
        drawn(page)
        assert page.evaluate("window.__pwned === undefined")
        tags = page.evaluate("[...document.querySelectorAll('img, b, iframe, object, embed, link')].length")
        assert tags == 0 and page.evaluate("document.querySelectorAll('script').length") == 2
        text = page.evaluate("document.body.textContent")
        assert text.count(HOSTILE) >= 3  # the command, the failure's message, the exit lines, the .err
        assert "h<script>window.__pwned=3</script>\\x1b[31m" in text  # escapes shown, not obeyed
        assert "\\x1b[2J\\x1b]0;title\\x07" in text and "\x1b" not in text
        lanes = page.evaluate("[...document.querySelectorAll('g.lane')].map(g => g.dataset.lane)")
        assert lanes == ["h<script>window.__pwned=3</script>\\x1b[31m", "h<script>window.__pwned=3</script>\\x1b[31m GPU 0"]
        page.evaluate("document.querySelector('rect.bar.o-failed').dispatchEvent(new MouseEvent('click', {bubbles: true}))")
        assert HOSTILE in page.evaluate("document.getElementById('details').textContent")
        assert page.evaluate("window.__pwned === undefined")


def test_a_detached_batch_while_it_runs_and_once_it_ended(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    batch_dir(tmp_path, ["echo quick", f"while [ ! -e {gate} ]; do sleep 0.1; done; echo waited", "exit 4"])
    started = cli_run(tmp_path, "execute_batch", "b.sh", "--detach", *LOCAL)
    assert started.returncode == 0, started.stderr
    pid = coordinator_pid(tmp_path)
    try:
        _wait_for_journal(tmp_path, lambda e: e.get("state") == "failed")
        assert "  detached: its log is job_results/.coordinator.log" in cli_run(tmp_path, "status").stdout
        snapshot = cli_run(tmp_path, "report", "-o", "running.html")
        assert snapshot.returncode == 0 and snapshot.stdout.endswith("; a snapshot: the batch runs on)\n"), snapshot
        with open_page(tmp_path / "running.html") as page:
            data = drawn(page)
            assert data["state"] == "running"
            assert sorted(bar_classes(page)) == ["bar o-failed", "bar o-finished", "bar o-running"]
            assert "running: a snapshot taken" in page.evaluate("document.getElementById('state').textContent")
    finally:
        gate.touch()
    assert gone(pid)
    ended = cli_run(tmp_path, "report", "-o", "ended.html")
    assert ended.returncode == 0 and "snapshot" not in ended.stdout
    with open_page(tmp_path / "ended.html") as page:
        data = drawn(page)
        assert data["state"] == "finished" and data["summary"]["exitCode"] == 1
        assert sorted(bar_classes(page)) == ["bar o-failed", "bar o-finished", "bar o-finished"]
        assert "ssh-scheduler report" in "\n".join(data["summary"]["exitLines"])


def test_a_killed_batch_is_drawn_up_to_what_it_recorded(tmp_path: Path) -> None:
    batch_dir(tmp_path, ["echo quick", "exec sleep 300"])
    proc = subprocess.Popen(
        [*CLI, "execute_batch", "b.sh", *LOCAL], cwd=tmp_path, env=env(tmp_path),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        _wait_for_journal(tmp_path, lambda e: e.get("state") == "finished")
        _wait_for_journal(tmp_path, lambda e: e.get("state") == "started" and e.get("command") == "exec sleep 300")
        status = cli_run(tmp_path, "status")  # it keeps an event file too, but it is no detached run
        assert status.stdout.startswith("job_results: running") and "detached" not in status.stdout, status
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the coordinator and its local agent, as a crash would
        proc.wait()
    made = cli_run(tmp_path, "report")
    assert made.returncode == 0, made.stderr
    with open_page(tmp_path / "report.html") as page:
        data = drawn(page)
        assert data["state"] == "stopped" and sorted(bar_classes(page)) == ["bar o-finished", "bar o-unknown"]
        assert "stopped: its coordinator ended without finishing it" in page.evaluate("document.getElementById('state').textContent")


def _wait_for_journal(tmp: Path, wanted: Any, limit: float = 60) -> None:
    import time

    deadline = time.monotonic() + limit
    path = tmp / "job_results" / ".journal.jsonl"
    while True:
        entries = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
        if any(wanted(e) for e in entries):
            return
        assert time.monotonic() < deadline, entries
        time.sleep(0.1)


def test_a_sweep_shows_its_results_and_each_metric_against_each_parameter(tmp_path: Path) -> None:
    sweep = tmp_path / "runs"
    log = EventLog(sweep / ".jobs")
    (sweep / ".jobs").mkdir(parents=True)
    log(BatchStarted(token="t", jobs=3, hosts=("h1",), t=T0))
    for n, (lr, loss) in enumerate([(0.1, 0.9), (0.01, 0.4), (0.001, 0.6)]):
        name = f"lr{lr}"
        (sweep / name).mkdir()
        param = {"_name": name, "_index": n, "_varying": ["lr"], "_commands": {"train": "python train.py"}, "lr": lr}
        (sweep / name / "param.json").write_text(json.dumps(param))
        (sweep / name / "stat.json").write_text(json.dumps({"train": {"code": 0}}))
        (sweep / name / "metrics.json").write_text(json.dumps({"loss": loss, "eval": {"acc": 1 - loss}}))
        log(JobStarted(job=f"{name}.train", host="h1", gpus=(n % 2,), command=f"python train.py --lr {lr}", t=T0 + n))
    log.finish(0, [])
    made = cli_run(tmp_path, "report", "runs", "-o", "sweep.html")
    assert made.returncode == 0, made.stderr
    with open_page(tmp_path / "sweep.html") as page:
        data = drawn(page)
        assert data["sweep"]["columns"] == ["name", "lr", "state", "loss", "eval.acc"]
        rows = page.evaluate("[...document.querySelectorAll('table.results tbody tr')].map(r => r.textContent)")
        assert len(rows) == 3 and rows[1].startswith("lr0.010.01")
        captions = page.evaluate("[...document.querySelectorAll('figure.plot figcaption')].map(c => c.textContent)")
        assert captions == ["loss against lr", "eval.acc against lr"]
        assert page.evaluate("document.querySelectorAll('figure.plot circle.dot').length") == 6
        assert len(bar_classes(page)) == 3
