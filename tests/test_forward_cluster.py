"""What a copy forward really sends to a host (issue 11): no key from a home-like folder, the size
shown by --dry-run, a big default copy stopped before any byte leaves, hostile --commands copies
refused before dispatch.  The host's whole work root is searched for the secrets' bytes, so the
check holds whatever the cache layout."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ssh_scheduler.jobs.forward import human_bytes
from tests.cluster import Cluster, GpuSpec, Host, HostSpec

REPO = Path(__file__).resolve().parents[1]
FAKE_KEY = (
    b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ"
    + os.urandom(8).hex().encode()
    + b"\n-----END OPENSSH PRIVATE KEY-----\n"
)


def run_batch(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ssh_scheduler", "execute_batch", *args, "--no-gpu-required",
         "--num-cpus", "0.1", "--memory-required", "10"],
        cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def digests_on(host: Host) -> set[str]:
    """The sha256 of every file under the host's work root, but the agent's own compiled code
    (``code-*`` at its top, written by the first agent to start there, whichever test that is)."""
    found = set()
    for dirpath, _dirs, files in os.walk(host.workdir):
        for name in files:
            path = Path(dirpath) / name
            if path.parent == Path(host.workdir) and name.startswith("code-"):
                continue
            if path.is_file() and not path.is_symlink():
                found.add(hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def home_like_folder(root: Path) -> dict[str, bytes]:
    files = {
        ".ssh/id_ed25519": FAKE_KEY,
        ".ssh/config": b"Host gpu1\n  User " + os.urandom(4).hex().encode() + b"\n",
        ".aws/credentials": b"[default]\naws_secret_access_key=" + os.urandom(8).hex().encode() + b"\n",
        ".netrc": b"machine x password " + os.urandom(8).hex().encode() + b"\n",
        "old/deploy_key": FAKE_KEY.replace(b"OPENSSH", b"EC"),
        "train.py": b"print('train " + os.urandom(4).hex().encode() + b"')\n",
        "data/big.bin": os.urandom(300_000),
        "scratch/tmp.bin": os.urandom(1000),
        ".sshschedulerignore": b"scratch/\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "b.sh").write_text("find . -type f ! -name listing.txt | sort > listing.txt\n")
    return files


def sendable(root: Path, files: dict[str, bytes]) -> str:
    """How --dry-run and the size stop describe what may be sent: the four files that are
    neither secret nor ignored."""
    total = sum(len(files[r]) for r in ("train.py", "data/big.bin", ".sshschedulerignore"))
    total += len((root / "b.sh").read_bytes())
    return f"4 files, {human_bytes(total)}"


def test_the_default_copy_sends_no_secret(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4[0]
    files = home_like_folder(tmp_path)
    machine = ["--machines", str(host.machine_file)]

    dry = run_batch(tmp_path, "b.sh", *machine, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    line = next(x for x in dry.stdout.splitlines() if x.startswith("copy forward (.): "))
    assert f"{sendable(tmp_path, files)} (" in line and "; largest: data (293.0 KiB), b.sh" in line, line
    assert "withheld as secrets: .aws, .netrc, .ssh, old/deploy_key" in line, line
    assert not (tmp_path / "job_results").exists()

    result = run_batch(tmp_path, "b.sh", *machine)
    assert result.returncode == 0, result.stderr
    listing = (tmp_path / "job_results" / "b.sh.1" / "listing.txt").read_text().split()
    assert listing == ["./.sshschedulerignore", "./b.sh", "./data/big.bin", "./train.py"]
    on_host = digests_on(host)
    assert sha(files["train.py"]) in on_host and sha(files["data/big.bin"]) in on_host  # it looked
    for rel in (".ssh/id_ed25519", ".ssh/config", ".aws/credentials", ".netrc", "old/deploy_key", "scratch/tmp.bin"):
        assert sha(files[rel]) not in on_host, f"{rel} reached the host"


def test_a_big_default_copy_stops_before_anything_is_sent(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4[1]
    files = home_like_folder(tmp_path)
    before = digests_on(host)
    machine = ["--machines", str(host.machine_file)]
    result = run_batch(tmp_path, "b.sh", *machine, "--forward-max-bytes", "100000")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"the default copy forward (.) would send {sendable(tmp_path, files)} to every host" in lines[0]
    assert "largest: data (293.0 KiB)" in lines[0] and "--yes-copy-all" in lines[0]
    assert digests_on(host) == before and not (tmp_path / "job_results").exists()

    named = run_batch(tmp_path, "b.sh", *machine, "--forward-max-bytes", "100000", "--copy-forwards", "b.sh", "train.py")
    assert named.returncode == 0, named.stderr
    assert sha(files["data/big.bin"]) not in digests_on(host)
    confirmed = run_batch(tmp_path, "b.sh", *machine, "--forward-max-bytes", "100000", "--yes-copy-all", "--results-dir", "r2")
    assert confirmed.returncode == 0, confirmed.stderr
    assert sha(files["data/big.bin"]) in digests_on(host)


def test_hostile_commands_copies_are_refused_before_dispatch(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4[2]
    project = tmp_path / "project"
    project.mkdir()
    outside = tmp_path / "id_ed25519"
    outside.write_bytes(FAKE_KEY)
    (project / "b.sh").write_text(
        "--copy-forwards b.sh 'true'\n"
        f"--copy-forwards {outside} ../../../etc/hostname 'cat id_ed25519 hostname'\n"
    )
    before = digests_on(host)
    machine = ["--machines", str(host.machine_file)]
    result = run_batch(project, "b.sh", "--commands", *machine)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: batch line 2 (job b.sh.2): --copy-forwards ")
    assert "is an absolute path" in lines[0] and "--allow-outside-copies" in lines[0]
    assert result.stdout == "" and digests_on(host) == before
    # Allowed outside, the key is still a secret.
    allowed = run_batch(project, "b.sh", "--commands", *machine, "--allow-outside-copies")
    assert allowed.returncode == 2 and "--allow-secret-copies" in allowed.stderr
    assert digests_on(host) == before


def test_a_batch_whose_output_goes_into_the_folder_leaves_that_file_home(cluster4: Cluster, tmp_path: Path) -> None:
    """``execute_batch b.sh > log.txt`` run in the folder it copies: the log grows while the
    copy is hashed and sent, so a host would refuse it under its hash and fetch it again by
    SFTP, a round trip before the first job; it is not sent at all (-v says so), and the rest
    travels through the cache as always."""
    host = cluster4[1]
    (tmp_path / "b.sh").write_text("find . -type f ! -name listing.txt | sort > listing.txt\n")
    (tmp_path / "input.txt").write_text("data " + os.urandom(4).hex() + "\n")
    log_file = tmp_path / "log.txt"
    with open(log_file, "w") as log:
        result = subprocess.run(
            [sys.executable, "-m", "ssh_scheduler", "execute_batch", "b.sh", "--machines", str(host.machine_file),
             "--no-gpu-required", "--num-cpus", "0.1", "--memory-required", "10", "-v"],
            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log, stderr=subprocess.STDOUT,
            timeout=120,
        )  # fmt: skip
    said = log_file.read_text()
    assert result.returncode == 0, said
    listing = (tmp_path / "job_results" / "b.sh.1" / "listing.txt").read_text().split()
    assert listing == ["./b.sh", "./input.txt"], said
    assert "leaving out log.txt: this command's own output goes there" in said, said
    assert "did not keep" not in said and "by SFTP" not in said, said


def wait_for_input_in_probe(host: Host, digest: str) -> Path:
    """Make the host's first nvidia-smi call wait (at most 8 s: the probe stops each call at 10)
    until a file named for ``digest`` is in its cache, and note whether it came (``seen`` or
    ``missing``) in the returned file; later calls note nothing and wait for nothing."""
    real = host.dir / "bin" / "nvidia-smi.real"
    (host.dir / "bin" / "nvidia-smi").rename(real)
    notes = host.home / "probe-notes"  # (the host's user writes it)
    wrapper = host.dir / "bin" / "nvidia-smi"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ -e {notes} ] && exec {real} "$@"\n'
        "i=0\n"
        f"while [ $i -lt 80 ] && ! ls '{host.workdir}/cache' 2>/dev/null | grep -q {digest}; do\n"
        "  sleep 0.1; i=$((i+1))\n"
        "done\n"
        f"if ls '{host.workdir}/cache' 2>/dev/null | grep -q {digest}; then echo seen; else echo missing; fi >> {notes}\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    return notes


def test_a_batch_sends_its_inputs_to_each_host_while_its_first_probe_runs(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """As many jobs as hosts, and a small copy forward: each host gets the inputs as it
    connects, before its first probe has answered (the probe here waits for them, and would
    have waited in vain: a job's own staging comes after the probe, at placement).  A job
    placed there then starts without staging's round trips."""
    cluster = make_cluster([HostSpec(gpus=[GpuSpec(memory_mb=16000)]) for _ in range(2)])
    data = os.urandom(5000)
    (tmp_path / "input.bin").write_bytes(data)
    (tmp_path / "b.sh").write_text("sha256sum input.bin > sum.txt\nsha256sum input.bin > sum.txt\n")
    notes = [wait_for_input_in_probe(host, sha(data)) for host in cluster.hosts]
    done = run_batch(tmp_path, "b.sh", "--machines", *(str(h.machine_file) for h in cluster.hosts))
    assert done.returncode == 0, done.stderr
    assert [n.read_text().splitlines()[0] for n in notes] == ["seen", "seen"]
    for job in ("b.sh.1", "b.sh.2"):
        assert (tmp_path / "job_results" / job / "sum.txt").read_text().split()[0] == sha(data)


def test_fewer_jobs_than_hosts_send_inputs_only_where_a_job_runs(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """One job on two hosts: the host that runs nothing is sent nothing."""
    cluster = make_cluster([HostSpec() for _ in range(2)])
    data = os.urandom(5000)
    (tmp_path / "input.bin").write_bytes(data)
    (tmp_path / "b.sh").write_text("sha256sum input.bin > sum.txt\n")
    done = run_batch(tmp_path, "b.sh", "--machines", *(str(h.machine_file) for h in cluster.hosts))
    assert done.returncode == 0, done.stderr
    assert sorted(sha(data) in digests_on(host) for host in cluster.hosts) == [False, True]


def test_a_rerun_reads_none_of_the_inputs_that_did_not_change(cluster4: Cluster, tmp_path: Path) -> None:
    """The hash memo through the command line (jobs/hash_memo.py): the second batch reads only
    the input that changed since the first, and its job sees the new content."""
    host = cluster4[3]
    (tmp_path / "data").mkdir()
    for i in range(6):
        (tmp_path / "data" / f"f{i}.txt").write_text(f"input {i}\n")
    time.sleep(2.1)  # a file changed less than 2 s before it was read is not kept (racy)
    (tmp_path / "batch").write_text("cat data/f0.txt\n")
    args = ["batch", "--machines", str(host.machine_file), "--copy-forwards", "data", "-v"]
    first = run_batch(tmp_path, *args, "--results-dir", "r1")
    assert first.returncode == 0, first.stderr
    assert "copy forward: 6 files read, 0 known as an earlier command read them" in first.stderr + first.stdout
    (tmp_path / "data" / "f0.txt").write_text("INPUT 0\n")  # the same size, a moment ago
    second = run_batch(tmp_path, *args, "--results-dir", "r2")
    assert second.returncode == 0, second.stderr
    assert "copy forward: 1 files read, 5 known as an earlier command read them" in second.stderr + second.stdout
    assert (tmp_path / "r2" / "batch.1.out").read_text() == "INPUT 0\n"
