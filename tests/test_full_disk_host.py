"""A full disk on a host (issue 23, item 4): another user fills the file system that holds our
work root, and the agent's copy of a job's output on the host fails.

The file system is a real tmpfs of 512 KiB mounted inside the test host
(``Host.mount_small_fs``), filled by the cluster's second unix user (``Host.fill_fs``).  What must
hold: the output reaches home whatever happens to the host's copy, the job's exit status is its
own, the failure is said once naming the host and the cause, and a job whose output can no longer
be caught up from the host (a coordinator came back after the copy failed) never comes back as
good.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster import Cluster, Host
from tests.live_batch import LiveBatch, journal, run_batch, wait_until

pytestmark = pytest.mark.namespaces

NO_GPU = ["--no-gpu-required", "--memory-required", "100"]
BIG = 100_000  # bytes of output: far more than the host's copy can keep on the full disk


@pytest.fixture
def full_host(cluster4: Cluster) -> Iterator[tuple[Host, str, str]]:
    """h4 with a 512 KiB file system at /tmp/small-<pid>, our work root's folder on it, and the
    name of the other user's file that fills it (``host.fill_fs(filler, other)``)."""
    host = cluster4["h4"]
    mount = f"/tmp/small-{os.getpid()}"
    host.mount_small_fs(mount, 512)
    host.run(f"mkdir -m 700 {mount}/ours && chown {host.user} {mount}/ours", check=True)
    try:
        yield host, f"{mount}/ours/work", f"{mount}/filler"
    finally:
        host.kill_user_processes()
        host.unmount(mount)


def machine_file(host: Host, tmp_path: Path, workdir: str) -> str:
    path = tmp_path / f"{host.name}.yaml"
    path.write_text(yaml.safe_dump({**host.machine_yaml(), "workdir": workdir}))
    return str(path)


def run_folder(tmp_path: Path, job: str) -> Path:
    """Where the batch runs, its batch file ``b.sh`` holding ``job``; what it copies forward is
    an empty folder (``COPY``): the full disk could not take a file."""
    folder = tmp_path / "run"
    (folder / "empty").mkdir(parents=True)
    (folder / "b.sh").write_text(job)
    return folder


COPY = ["--copy-forwards", "empty"]


def state_of(results: Path, job: str) -> dict[str, object]:
    return [e for e in journal(results) if e.get("job") == job][-1]


def test_output_reaches_home_when_the_hosts_copy_fails(
    full_host: tuple[Host, str, str], cluster4: Cluster, tmp_path: Path
) -> None:
    host, workdir, filler = full_host
    run = run_folder(tmp_path, f"head -c {BIG} /dev/zero | tr '\\0' a; echo; echo to-stderr >&2; echo done\n")
    machines = ["--machines", machine_file(host, tmp_path, workdir), *NO_GPU, *COPY]
    # The work root is made first...
    assert run_batch(run, "b.sh", *machines, "--results-dir", str(tmp_path / "warm")).returncode == 0
    host.fill_fs(filler, cluster4.other_user())  # ...then someone else fills the disk
    result = run_batch(run, "b.sh", *machines)
    results = run / "job_results"
    assert result.returncode == 0, result.stdout + result.stderr
    assert (results / "b.sh.1.out").read_bytes() == b"a" * BIG + b"\ndone\n"
    assert (results / "b.sh.1.err").read_bytes() == b"to-stderr\n"
    assert state_of(results, "b.sh.1")["state"] == "finished"
    # Said once, naming the host and the cause.
    said = [line for line in result.stderr.splitlines() if "No space left on device" in line]
    assert len(said) == 1 and "h4" in said[0] and "output" in said[0], result.stderr


def test_a_job_whose_output_was_lost_on_the_host_is_not_good(
    full_host: tuple[Host, str, str], cluster4: Cluster, tmp_path: Path
) -> None:
    """The coordinator is gone while the host's copy fails: what the job printed then exists
    nowhere.  The coordinator that comes back must not take the job as good."""
    host, workdir, filler = full_host
    flag = f"/tmp/go-{os.getpid()}"
    run = run_folder(tmp_path, f"echo first; while [ ! -e {flag} ]; do sleep 0.1; done; "
                               f"head -c {BIG} /dev/zero | tr '\\0' b; echo; touch {flag}.done\n")
    machines = ["--machines", machine_file(host, tmp_path, workdir), *NO_GPU, *COPY]
    out = run / "job_results" / "b.sh.1.out"
    batch = LiveBatch(run, "b.sh", *machines, "--lease", "120")
    try:
        batch.wait_for("started:")
        wait_until(lambda: out.exists() and out.read_bytes() == b"first\n", "the first line is home")
        batch.kill()  # the coordinator dies; the agent keeps the job for the lease
        host.fill_fs(filler, cluster4.other_user())
        host.run(f"touch {flag}", check=True)  # the job prints what the host cannot keep, ends with 0
        wait_until(lambda: host.run(f"test -e {flag}.done").returncode == 0, "the job's end")
        rerun = run_batch(run, "b.sh", *machines)
        said = rerun.stdout + rerun.stderr
        entry = state_of(run / "job_results", "b.sh.1")
        assert entry["state"] == "failed" and rerun.returncode != 0, (entry, said)
        assert "lost on the host" in said and "No space left on device" in said, said
    finally:
        if batch.proc.poll() is None:
            batch.kill()
        host.run(f"rm -f {flag} {flag}.done")
