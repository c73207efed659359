"""One cache, two agents: a home folder on NFS shared by several hosts, or one machine listed under
two names.  Each agent may put the same input into the cache (a write under its own name and a
rename: a new inode each time); neither may take the other's good copy for a spoiled one.

Found by CI (stop 27): ``execute_to`` over two names of this machine failed now and then with
"its inputs kept disappearing from the host's cache", the two agents evicting each other's copy.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssh_scheduler.agent import hostguard


def cache_key(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest() + "-r"


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[tuple[Path, int, int]]:
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    cache_fd, record_dir = os.open(folder, os.O_RDONLY), os.open(tmp_path, os.O_RDONLY)
    try:
        yield folder, cache_fd, record_dir
    finally:
        os.close(cache_fd)
        os.close(record_dir)


def test_an_entry_another_agent_put_again_is_not_evicted(cache: tuple[Path, int, int]) -> None:
    folder, cache_fd, record_dir = cache
    data = b"the payload\n"
    key = cache_key(data)
    a = hostguard.CacheTrust(cache_fd, record_dir, "a.json")
    b = hostguard.CacheTrust(cache_fd, record_dir, "b.json")
    assert hostguard.keep_in_cache(cache_fd, key, data) is None
    a.learn(key)
    assert a.usable(key)
    first = (folder / key).stat().st_ino
    # The other agent was told the entry was missing at the same moment, and puts it too.
    assert hostguard.keep_in_cache(cache_fd, key, data) is None
    b.learn(key)
    assert (folder / key).stat().st_ino != first  # a new inode: what a's record no longer matches
    assert a.usable(key) and b.usable(key)
    assert (folder / key).read_bytes() == data
    # The same holds for the have-query (check) of the first agent.
    assert a.check(key, len(data)) and (folder / key).exists()


def put_and_learn(cache: tuple[Path, int, int]) -> tuple[hostguard.CacheTrust, str, Path]:
    folder, cache_fd, record_dir = cache
    key = cache_key(b"the payload\n")
    a = hostguard.CacheTrust(cache_fd, record_dir, "a.json")
    assert hostguard.keep_in_cache(cache_fd, key, b"the payload\n") is None
    a.learn(key)
    return a, key, folder / key


def test_an_entry_rewritten_in_place_is_still_spoiled(cache: tuple[Path, int, int]) -> None:
    a, key, entry = put_and_learn(cache)
    entry.chmod(0o600)
    with open(entry, "r+b") as f:  # through a job's hard link: the same inode, other bytes
        f.write(b"THE")
    assert not a.usable(key)
    assert not entry.exists()  # removed, to be sent again


def test_an_entry_replaced_by_bad_bytes_is_spoiled(cache: tuple[Path, int, int]) -> None:
    a, key, entry = put_and_learn(cache)
    forged = entry.parent / "forged"
    forged.write_bytes(b"THE payload\n")
    os.replace(forged, entry)  # a new inode whose bytes do not hash to the name
    assert not a.usable(key)
    assert not entry.exists()


def test_evicting_what_a_job_spoiled_spares_another_agents_newer_copy(cache: tuple[Path, int, int]) -> None:
    folder, cache_fd, record_dir = cache
    data = b"the payload\n"
    key = cache_key(data)
    a = hostguard.CacheTrust(cache_fd, record_dir, "a.json")
    assert hostguard.keep_in_cache(cache_fd, key, data) is None
    spoiled = (folder / key).stat().st_ino  # the inode a's job wrote through
    assert hostguard.keep_in_cache(cache_fd, key, data) is None  # the other agent's good copy
    a.evict(key, spoiled)
    assert (folder / key).read_bytes() == data
    a.evict(key, (folder / key).stat().st_ino)
    assert not (folder / key).exists()
