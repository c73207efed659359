"""A kept agent whose work root was removed or moved between two commands (someone cleaning the
host while the hub kept the agent warm) makes it again at the next command's hello or adoption,
as a fresh agent would: without that, its inputs went into folders nobody sees (the
coordinator's file transfers name the root's path), each upload into the cache failed, and a
batch's copy forward fell back to one SFTP upload per file, or took the host for lost.  An
agent with a running job keeps its folders.  Against the shipped agent over pipes."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent.hostguard import AGENTS_DIR, CACHE_DIR, JOBS_DIR
from tests.test_agent_adopt import Agent


@pytest.fixture
def kept(tmp_path: Path) -> Iterator[Agent]:
    agent = Agent(tmp_path / "root")
    try:
        hello = agent.ask(P.Hello(id=1, lease=60))
        assert isinstance(hello, P.HelloReply)
        assert put(agent, 2, b"first command's input") == []
        yield agent
    finally:
        agent.end()


def key_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() + "-r"


def put(agent: Agent, request_id: int, data: bytes) -> list[str]:
    reply = agent.ask(P.Put(id=request_id, files=[P.Blob(name=key_of(data), data=base64.b64encode(data).decode())]))
    assert isinstance(reply, P.PutReply), reply
    return reply.failed


def folders(root: Path) -> list[bool]:
    return [(root / name).is_dir() for name in (CACHE_DIR, JOBS_DIR, AGENTS_DIR)]


def test_a_removed_work_root_is_made_again_at_the_next_hello(kept: Agent, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.rmtree(root)
    hello = kept.ask(P.Hello(id=3, lease=60))
    assert isinstance(hello, P.HelloReply) and hello.real == str(root)
    assert folders(root) == [True, True, True]
    data = b"second command's input"
    assert put(kept, 4, data) == []  # without the fix: "FileNotFoundError: ..." for the file
    assert (root / CACHE_DIR / key_of(data)).read_bytes() == data


def test_a_moved_work_root_is_left_where_it_went_and_made_again_at_its_path(kept: Agent, tmp_path: Path) -> None:
    root, aside = tmp_path / "root", tmp_path / "aside"
    root.rename(aside)
    assert isinstance(kept.ask(P.Hello(id=3, lease=60)), P.HelloReply)
    data = b"second command's input"
    assert put(kept, 4, data) == []
    assert (root / CACHE_DIR / key_of(data)).read_bytes() == data  # where SFTP and stagings look
    assert not (aside / CACHE_DIR / key_of(data)).exists()


def test_a_removed_cache_folder_alone_is_made_again(kept: Agent, tmp_path: Path) -> None:
    cache = tmp_path / "root" / CACHE_DIR
    shutil.rmtree(cache)
    assert isinstance(kept.ask(P.Hello(id=3, lease=60)), P.HelloReply)
    data = b"second command's input"
    assert put(kept, 4, data) == []
    assert (cache / key_of(data)).read_bytes() == data


def test_a_spare_adopted_after_its_root_was_removed_listens_in_the_new_one(kept: Agent, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.rmtree(root)
    reply = kept.ask(P.Adopt(id=3, token="batch-f6"))
    assert isinstance(reply, P.AdoptReply) and (reply.ok, reply.why) == (True, "")
    assert (root / AGENTS_DIR / "batch-f6.sock").exists()  # a returning coordinator reaches it


def test_an_agent_with_a_running_job_keeps_its_folders(kept: Agent, tmp_path: Path) -> None:
    root, aside = tmp_path / "root", tmp_path / "aside"
    assert kept.proc.stdin is not None and kept.proc.stdout is not None
    kept.proc.stdin.write(P.Run(id=3, job="j", cmd="sleep 30", cwd=f"{root}/{JOBS_DIR}/t-j", stage=P.Staging()).encode())
    kept.proc.stdin.flush()
    started = json.loads(kept.proc.stdout.readline())
    assert started.get("ev") == "started", started
    root.rename(aside)
    assert isinstance(kept.ask(P.Hello(id=4, lease=60)), P.HelloReply)
    assert not root.exists()  # the job's folder is where it runs: nothing was made anew
    ended = kept.ask(P.Kill(id=5, job="j", grace=0.1))
    assert isinstance(ended, P.Exit) and ended.job == "j", ended


def test_a_work_root_replaced_by_a_file_is_refused_in_one_line(kept: Agent, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.rmtree(root)
    root.write_text("not a folder\n")
    reply = kept.ask(P.Hello(id=3, lease=60))
    assert isinstance(reply, P.Error), reply  # the command says it: "h1: agent: Refused: ..."
    assert reply.message == f"Refused: {root} is not a folder (a symlink or a file); remove it, or choose another workdir"
    assert root.read_text() == "not a folder\n"  # left as it was
