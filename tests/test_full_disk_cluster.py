"""A full disk HERE, and results that stay on the host (issue 23, items 2 and 3), end to end on
the SSH test cluster with a real full file system: ``job_results/`` is a small tmpfs mounted for
the test (root, as the suite runs).

What must hold: a write that fails here is the batch's failure, named as such, never a host's
(no requeue, no host lost, no quarantine; the batch starts nothing new and says why); a job whose
results did not all come home is failed with its own exit status, and its folder and output stay
on the host (named in the summary) whatever the batch does at its end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.live_batch import journal, machines, run_batch
from tests.test_local_writes import small_disk

pytestmark = pytest.mark.namespaces  # mounting a tmpfs needs root

# One job at a time on a host (4 CPUs each): what is still queued when the disk fills shows
# whether the batch goes on starting jobs.
ONE_AT_A_TIME = ("--num-cpus", "4", "--no-gpu-required", "--memory-required", "100")


def kept_folders(text: str) -> list[Path]:
    """The host folders the summary says the results are kept in (``host:/folder``)."""
    found = []
    for line in text.splitlines():
        if "results kept on " in line:
            where = line.split("results kept on ", 1)[1].split(";", 1)[0]
            found.append(Path(where.split(":", 1)[1]))
    return found


def ended(results: Path) -> dict[str, dict[str, object]]:
    """Each job's last finished / failed journal line."""
    return {str(e["job"]): e for e in journal(results) if e["state"] in ("finished", "failed")}


def no_host_blamed(text: str) -> None:
    for word in ("requeued:", "lost", "quarantined", "Traceback"):
        assert word not in text, text


def test_output_that_fills_the_disk_here_stops_the_batch_not_the_host(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[0]
    # 3 MB of stdout into a 2 MB results folder; three more jobs wait their turn.
    flood = "head -c 3000000 /dev/zero | tr '\\0' x; echo"
    (tmp_path / "flood.sh").write_text(flood + "\n" + "echo later\n" * 3)
    with small_disk(tmp_path / "job_results") as results:
        done = run_batch(tmp_path, "flood.sh", *machines(cluster4, 1), *ONE_AT_A_TIME)
        text = done.stdout + done.stderr
        assert done.returncode == 1, text
        no_host_blamed(text)
        halting = [line for line in done.stderr.splitlines() if line.startswith("halting: ")]
        assert halting == [
            "halting: no space left in job_results/: writing flood.sh.1.out (No space left on device); no new jobs start"
        ], text
        # The job itself exited 0, and the journal says so; it failed because its output is not
        # all here, and nothing else of the batch started after that.
        states = ended(results)
        assert states["flood.sh.1"]["state"] == "failed" and states["flood.sh.1"]["code"] == 0, states
        assert set(states) == {"flood.sh.1"}, states
        assert "done: 0 finished, 1 failed, 0 skipped, 3 not run" in done.stderr, text
        failed = [line for line in done.stderr.splitlines() if line.startswith("  failed: flood.sh.1 ")]
        assert len(failed) == 1 and failed[0].startswith("  failed: flood.sh.1 (exit 0, not copied back on h1): results kept on h1:"), text
        # Nothing was deleted there: the job's folder and its whole output, beside it.
        (folder,) = kept_folders(done.stderr)
        assert folder.is_dir() and folder.parent == host.workdir / "jobs", folder
        assert Path(f"{folder}.out").stat().st_size == 3000001


@pytest.mark.parametrize("files", [20, 1], ids=["small files in bulk", "one file by sftp"])
def test_a_copy_back_that_fills_the_disk_here_keeps_the_results_on_the_host(
    cluster4: Cluster, tmp_path: Path, files: int
) -> None:
    host = cluster4.hosts[1]
    size = 3_000_000 // files  # 150 kB each go many to a message; 3 MB goes by SFTP
    make = f"python3 -c \"import os; os.makedirs('out'); [open('out/r%02d' % i, 'wb').write(b'r' * {size}) for i in range({files})]\""
    (tmp_path / "fill.sh").write_text(make + "\n" + "echo later\n")
    with small_disk(tmp_path / "job_results") as results:
        done = run_batch(tmp_path, "fill.sh", "--machines", str(host.machine_file), *ONE_AT_A_TIME)
        text = done.stdout + done.stderr
        assert done.returncode == 1, text
        no_host_blamed(text)
        assert any(
            line.startswith("halting: no space left in job_results/: copying back fill.sh.1/out/r")
            and line.endswith("(No space left on device); no new jobs start")
            for line in done.stderr.splitlines()
        ), text
        states = ended(results)
        assert states["fill.sh.1"]["code"] == 0 and states["fill.sh.1"]["state"] == "failed", states
        # (The next job may start on the room it freed while its results travel home.)
        # Nothing half-copied here: no result folder, no staging folder; both output files.
        names = os.listdir(results)
        assert "fill.sh.1" not in names and not [n for n in names if n.startswith(".partial")], names
        assert {"fill.sh.1.out", "fill.sh.1.err"} <= set(names), names
        # ...and every result still on the host, where the summary says.
        (folder,) = kept_folders(done.stderr)
        assert sorted(os.listdir(folder / "out")) == [f"r{i:02d}" for i in range(files)]
        assert all((folder / "out" / f"r{i:02d}").stat().st_size == size for i in range(files))


def test_a_failed_copy_back_keeps_the_exit_status_and_the_host_folder(cluster4: Cluster, tmp_path: Path) -> None:
    """Not the disk: a copy-back limit.  The job that exited 0 is failed (its results are not
    here) with exit 0 recorded, and the end-of-batch sweep leaves its folder on the host."""
    host = cluster4.hosts[2]
    lines = ["for i in 1 2 3 4 5; do echo $i > r$i; done; echo made", "true", "echo out; echo err >&2"]
    (tmp_path / "b.sh").write_text("\n".join(lines) + "\n")
    done = run_batch(tmp_path, "b.sh", "--machines", str(host.machine_file), *ONE_AT_A_TIME, "--max-result-files", "3")
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    results = tmp_path / "job_results"
    states = ended(results)
    assert states["b.sh.1"]["state"] == "failed" and states["b.sh.1"]["code"] == 0, states
    assert states["b.sh.2"]["state"] == states["b.sh.3"]["state"] == "finished", states
    assert "failed: b.sh.1; for i in 1 2 3 4 5; do echo $i > r$i; done; echo made  (exit 0, not copied back on h3)" in done.stdout
    (folder,) = kept_folders(done.stderr)
    assert states["b.sh.1"]["kept"] == f"h3:{folder}"
    assert sorted(os.listdir(folder)) == ["b.sh", "r1", "r2", "r3", "r4", "r5"]  # its input too
    assert Path(f"{folder}.out").read_text() == "made\n"  # its output, beside it
    summary = [line for line in done.stderr.splitlines() if line.startswith("  failed: b.sh.1 ")]
    assert summary == [f"  failed: b.sh.1 (exit 0, not copied back on h3): results kept on h3:{folder}; job_results/b.sh.1.err"]
    assert "over the copy-back limit of 3 files (raise --max-result-files)" in done.stderr, text
    # Every job that ended has both files, printed on or not.
    for n in (1, 2, 3):
        assert (results / f"b.sh.{n}.out").is_file() and (results / f"b.sh.{n}.err").is_file()
    assert (results / "b.sh.2.out").read_text() == (results / "b.sh.2.err").read_text() == ""
    assert (results / "b.sh.3.err").read_text() == "err\n"
    # The jobs that came home left nothing there.
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.startswith(folder.name)) == []


def test_the_batch_copy_back_budget_stops_the_batch_with_one_line(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[3]
    three = "echo a > a; echo b > b; echo c > c"
    deep = "mkdir -p " + "/".join(["d"] * 70) + " && touch " + "/".join(["d"] * 70) + "/f"
    (tmp_path / "b.sh").write_text(f"{deep}\n{three}\n{three}\n{three}\n")
    done = run_batch(
        tmp_path, "b.sh", "--machines", str(host.machine_file), *ONE_AT_A_TIME, "--max-batch-result-files", "4"
    )
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    states = ended(tmp_path / "job_results")
    # Too deep: that job's copy-back fails (its own limit), the batch goes on.
    assert states["b.sh.1"]["code"] == 0 and states["b.sh.1"]["state"] == "failed", states
    assert "a result is 71 folders deep, over the copy-back limit of 64 (raise --max-result-depth)" in done.stderr
    # Three files came home, then three more would pass the batch's four: it stops there.
    assert states["b.sh.2"]["state"] == "finished" and states["b.sh.3"]["state"] == "failed", states
    # (b.sh.4 may have started on the room b.sh.3 freed while it copied back: it fails alike.)
    assert states.get("b.sh.4", {"state": "failed"})["state"] == "failed", states
    halting = [line for line in done.stderr.splitlines() if line.startswith("halting: ")]
    assert len(halting) == 1 and "more than the 1 the batch may still copy back of its 4 (raise --max-batch-result-files)" in halting[0], text
    kept = kept_folders(done.stderr)
    assert len(kept) == len(states) - 1 and all(folder.is_dir() for folder in kept), kept
