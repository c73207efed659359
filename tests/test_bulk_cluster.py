"""Small files in bulk through the agent (bulk.py), end to end on the SSH test cluster, and the
agent's side of it (hostguard.keep_in_cache, rooted.read_regular, Agent.op_put / op_fetch) in process.

Thousands of files must go out and come back byte for byte with their modes, by a handful of
agent messages instead of SFTP round trips per file (the SFTP calls are counted by wrapping the
real transport's methods, which still do the work); the content-addressed cache must still send
nothing on a repeat and only what changed after an edit.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ssh_scheduler.agent import hostguard as G
from ssh_scheduler.agent import main as agent
from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import rooted as R
from ssh_scheduler.agent import wire as W
from ssh_scheduler.coordinator.batch import run_batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.executors import bulk
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.config import load_machine
from ssh_scheduler.results.summary import BatchSummary
from ssh_scheduler.transport.ssh import SSHTransport
from tests.cluster import Cluster

N_FILES = 3000
MODES = (0o644, 0o600, 0o755, 0o640, 0o700)  # none touched by a umask of 022
# big.bin: 3 MB of counted 4-byte words, every offset's bytes its own: more than the 8 SFTP reads
# of 255 KiB (OpenSSH's block) the download keeps in flight, so a misplaced answer shows.
BIG_WORDS = 750_000
# On the host: every input's hash and exec bit, then N_FILES results of known content and mode.
JOB = (
    "find data -type f -exec sha256sum {} + | sort -k2 > sums.txt && "
    "find data -type f -perm -u+x | sort > exec.txt && "
    "python3 -c 'import os\n"
    "modes = " + repr(MODES) + "\n"
    "for i in range(" + str(N_FILES) + "):\n"
    "    d = \"out/%02d\" % (i % 40)\n"
    "    os.makedirs(d, exist_ok=True)\n"
    "    p = \"%s/r%05d\" % (d, i)\n"
    "    open(p, \"wb\").write(bytes([i % 251]) * (i % 1500))\n"
    "    os.chmod(p, modes[i % len(modes)])\n"
    "open(\"big.bin\", \"wb\").write(b\"\".join(i.to_bytes(4, \"big\") for i in range(" + str(BIG_WORDS) + ")))'"
)


@pytest.fixture
def sftp_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """How many files went by SFTP (the real upload/download still run)."""
    calls = {"upload": 0, "download": 0}
    for name in calls:
        real = getattr(SSHTransport, name)

        async def counted(self: SSHTransport, *args: Any, _real: Any = real, _name: str = name) -> Any:
            calls[_name] += 1
            return await _real(self, *args)

        monkeypatch.setattr(SSHTransport, name, counted)
    yield calls


def make_inputs(root: Path) -> dict[str, tuple[bytes, bool]]:
    files: dict[str, tuple[bytes, bool]] = {}
    for i in range(N_FILES):
        rel = f"data/d{i % 30:02d}/f{i:05d}.bin"
        files[rel] = (os.urandom(1 + i % 2000), i % 7 == 0)  # random: no two share a cache entry
    files["data/large.bin"] = (os.urandom(300_000), False)  # above bulk.SMALL_FILE: by SFTP
    for rel, (data, executable) in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o755 if executable else 0o644)
    return files


async def run_once(machine: Any, base: Path, name: str) -> BatchSummary:
    return await run_batch(
        [Job(name, JOB, 1)],
        [machine],
        BatchOptions(
            needs=Needs(cpus=0.01, memory_mb=1, gpus=0, gpu_memory_mb=0),
            gpus_explicit=True,
            copy_forwards=("data",),
            results_dir=base / "job_results",
            base_dir=base,
            probe_interval=3600,
        ),
        out=lambda line: None,
        err=lambda line: None,
    )


async def test_thousands_of_files_round_trip_in_bulk(
    cluster4: Cluster, tmp_path: Path, sftp_calls: dict[str, int]
) -> None:
    machine = load_machine(str(cluster4.hosts[2].machine_file))
    files = make_inputs(tmp_path)

    first = await run_once(machine, tmp_path, "first")
    assert first.outcomes["first"].ok, first.outcomes["first"].message
    # Out: every input reached the job byte for byte, with its exec bit; only the large one by SFTP.
    assert first.files_uploaded == len(files)
    assert first.bytes_uploaded == sum(len(data) for data, _ in files.values())
    assert sftp_calls["upload"] == 1
    job = tmp_path / "job_results" / "first"
    want = sorted(f"{hashlib.sha256(data).hexdigest()}  {rel}" for rel, (data, _) in files.items())
    assert sorted((job / "sums.txt").read_text().splitlines()) == want
    assert sorted((job / "exec.txt").read_text().splitlines()) == sorted(r for r, (_, x) in files.items() if x)
    # Back: every result byte for byte with its mode; only those above bulk.SMALL_FILE by SFTP.
    large = [p for p in job.rglob("*") if p.is_file() and p.stat().st_size > bulk.SMALL_FILE]
    assert job / "big.bin" in large and sftp_calls["download"] == len(large)
    umask = os.umask(0)
    os.umask(umask)
    for i in range(N_FILES):
        path = job / "out" / f"{i % 40:02d}" / f"r{i:05d}"
        assert path.read_bytes() == bytes([i % 251]) * (i % 1500), path
        assert stat.S_IMODE(path.stat().st_mode) == MODES[i % len(MODES)] & ~umask, path
    assert (job / "big.bin").read_bytes() == b"".join(i.to_bytes(4, "big") for i in range(BIG_WORDS))
    assert not (job / "data").exists()  # untouched inputs stay on the host

    # A repeat sends nothing: the host's cache has every input.
    again = await run_once(machine, tmp_path, "again")
    assert again.outcomes["again"].ok, again.outcomes["again"].message
    assert (again.files_uploaded, again.bytes_uploaded) == (0, 0)
    assert (tmp_path / "job_results" / "again" / "sums.txt").read_bytes() == (job / "sums.txt").read_bytes()

    # After an edit, only the changed file is sent.
    edited = tmp_path / "data" / "d03" / "f00003.bin"
    edited.write_bytes(b"changed\n")
    changed = await run_once(machine, tmp_path, "changed")
    assert changed.outcomes["changed"].ok, changed.outcomes["changed"].message
    assert (changed.files_uploaded, changed.bytes_uploaded) == (1, len(b"changed\n"))
    sums = (tmp_path / "job_results" / "changed" / "sums.txt").read_text()
    assert f"{hashlib.sha256(b'changed' + bytes([10])).hexdigest()}  data/d03/f00003.bin" in sums.splitlines()
    # Existing results are never overwritten: the first run's folder is as it was.
    assert sorted((job / "sums.txt").read_text().splitlines()) == want


# --- the agent's side, in process ----------------------------------------------------------------


def key_of(data: bytes, executable: bool = False) -> str:
    return f"{hashlib.sha256(data).hexdigest()}-{'x' if executable else 'r'}"


def folder_fd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def test_the_cache_keeps_only_what_hashes_to_its_key(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    fd = folder_fd(cache)
    good = key_of(b"hello", executable=True)
    assert G.keep_in_cache(fd, good, b"hello") is None
    assert (cache / good).read_bytes() == b"hello"
    assert stat.S_IMODE((cache / good).stat().st_mode) == 0o500
    assert G.keep_in_cache(fd, key_of(b"other"), b"hello") == "the content does not match its hash"
    for bad in ("../" + good, good + "/x", "/etc/passwd", ".hidden-r", "zz-r"):
        assert G.keep_in_cache(fd, bad, b"hello") == "not a cache key"
    os.close(fd)
    assert sorted(os.listdir(cache)) == [good]  # nothing else, no leftover temporary file


def test_read_regular_refuses_links_fifos_and_folders(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"0123456789")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    os.mkfifo(tmp_path / "fifo")  # nobody writes: reading it would wait forever
    (tmp_path / "dir").mkdir()
    (tmp_path / "through").symlink_to(tmp_path / "dir")
    (tmp_path / "dir" / "inner").write_bytes(b"inner")
    fd = folder_fd(tmp_path)
    assert R.read_regular(fd, "file", 4) == (b"0123", None)
    assert R.read_regular(fd, "file", 100) == (b"0123456789", None)
    assert R.read_regular(fd, "dir/inner", 100) == (b"inner", None)
    for name in ("link", "fifo", "dir", "missing", "through/inner", "../file", "/etc/passwd"):
        data, reason = R.read_regular(fd, name, 100)
        assert data is None and reason, name
    os.close(fd)


class Captured:
    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.lines.append(data)

    def answer(self) -> Any:
        (line,) = self.lines
        return W.decode_answer(line)


def agent_in(tmp_path: Path) -> tuple[agent.Agent, Captured]:
    root = tmp_path / "root"
    for sub in ("", "cache", "jobs"):
        (root / sub).mkdir(mode=0o700, exist_ok=True)
    host = agent.Agent(str(root), "t1")
    host.client = Captured()
    return host, host.client


def test_op_fetch_reads_only_regular_files_inside_the_job_folder(tmp_path: Path) -> None:
    host, sent = agent_in(tmp_path)
    jobdir = Path(host.root) / "jobs" / "t1-j"
    (jobdir / "sub").mkdir(parents=True)
    (jobdir / "a").write_bytes(b"aaaa")
    (jobdir / "sub" / "b").write_bytes(b"bbbbbb")
    (jobdir / "to_secret").symlink_to(tmp_path / "secret")
    (tmp_path / "secret").write_bytes(b"secret")
    (jobdir / "through").symlink_to(jobdir / "sub")
    asked = ["a", "sub/b", "to_secret", "../../../secret", "/etc/passwd", "sub/../a", "missing"]
    asyncio.run(host.op_fetch(P.Fetch(id=1, dir=str(jobdir), paths=asked, limit=100)))
    reply = sent.answer()
    assert isinstance(reply, P.Fetched) and [b.name for b in reply.files] == asked
    got = {b.name: (None if b.data is None else base64.b64decode(b.data), b.error) for b in reply.files}
    assert got["a"] == (b"aaaa", None) and got["sub/b"] == (b"bbbbbb", None)
    for name in asked[2:]:
        assert got[name][0] is None and got[name][1], name

    # The byte budget: at most limit + 1 bytes in all (so going over shows), the rest left out.
    sent.lines.clear()
    asyncio.run(host.op_fetch(P.Fetch(id=2, dir=str(jobdir), paths=["a", "sub/b", "a"], limit=5)))
    reply = sent.answer()
    assert [(b.name, base64.b64decode(b.data or "")) for b in reply.files] == [("a", b"aaaa"), ("sub/b", b"bb")]


def test_op_fetch_refuses_a_folder_outside_the_work_root(tmp_path: Path) -> None:
    host, _ = agent_in(tmp_path)
    with pytest.raises(ValueError, match="outside the work root"):
        asyncio.run(host.op_fetch(P.Fetch(id=1, dir=str(tmp_path), paths=["x"], limit=10)))


def test_op_put_keeps_what_matches_and_remembers_it_as_checked(tmp_path: Path) -> None:
    host, sent = agent_in(tmp_path)
    good, bad = key_of(b"input\n"), key_of(b"something else")
    blobs = [P.Blob(name=good, data=base64.b64encode(b"input\n").decode()),
             P.Blob(name=bad, data=base64.b64encode(b"tampered").decode()),
             P.Blob(name="../escape-r", data="")]
    asyncio.run(host.op_put(P.Put(id=3, files=blobs)))
    reply = sent.answer()
    assert isinstance(reply, P.PutReply)
    assert [entry.split(":", 1)[0] for entry in reply.failed] == [bad, "../escape-r"]
    assert sorted(os.listdir(host.cache)) == [good]
    assert not (Path(host.root).parent / "escape-r").exists()
    # Written and hashed by the agent itself: a later 'have' trusts it without hashing again.
    record = json.loads((Path(host.root) / "cache-trusted.json").read_text())
    assert list(record) == [good]
    assert host.missing_from_cache([good, bad], {}) == [bad]


def test_batches_keep_order_and_bounds() -> None:
    sizes = [bulk.BATCH_BYTES // 3] * 7 + [1] * (bulk.BATCH_FILES + 5)
    groups = bulk.batches(sizes, lambda size: size)
    assert [x for group in groups for x in group] == sizes
    assert all(len(g) <= bulk.BATCH_FILES for g in groups)
    assert all(sum(g) <= bulk.BATCH_BYTES or len(g) == 1 for g in groups)
    assert bulk.batches([bulk.BATCH_BYTES * 2], lambda size: size) == [[bulk.BATCH_BYTES * 2]]


def test_a_temporary_file_left_by_a_killed_agent_is_replaced(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    key = key_of(b"again")
    # a killed agent's, in the thread that writes this one (the name is per host, pid and thread)
    (cache / f"{key}.put-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}").write_bytes(b"half")
    fd = folder_fd(cache)
    assert G.keep_in_cache(fd, key, b"again") is None
    os.close(fd)
    assert sorted(os.listdir(cache)) == [key] and (cache / key).read_bytes() == b"again"


def test_puts_are_written_off_the_loop_and_side_by_side(tmp_path: Path) -> None:
    """While a put's files are written, the agent's loop goes on (a job's end is not held up
    behind 2,000 files); three puts at once all land, each file checked, all remembered."""
    host, sent = agent_in(tmp_path)
    contents = [os.urandom(64) + str(i).encode() for i in range(3000)]
    blobs = [P.Blob(name=key_of(data), data=base64.b64encode(data).decode()) for data in contents]
    ticks: list[int] = []

    async def main() -> None:
        puts = [asyncio.ensure_future(host.op_put(P.Put(id=i, files=blobs[i::3]))) for i in range(3)]
        while not all(p.done() for p in puts):
            ticks.append(len(os.listdir(host.cache)))  # the loop turns while files are written
            await asyncio.sleep(0)
        for p in puts:
            p.result()

    asyncio.run(main())
    assert len(ticks) > 3 and any(0 < n < len(blobs) for n in ticks), ticks[:10]
    replies = [W.decode_answer(line) for line in sent.lines]
    assert sorted(r.id for r in replies) == [0, 1, 2] and all(r.failed == [] for r in replies)
    assert sorted(os.listdir(host.cache)) == sorted(b.name for b in blobs)
    record = json.loads((Path(host.root) / "cache-trusted.json").read_text())
    assert sorted(record) == sorted(b.name for b in blobs)
