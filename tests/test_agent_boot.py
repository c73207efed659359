"""The agent's first stage (agent/boot.py): only it travels on the command line, the agent follows
on stdin, exactly its size is read (nothing of the protocol with it), and what arrived is
checked against its key before it runs; a python3 too old for the agent is named with the fix."""

from __future__ import annotations

import ast
import hashlib
import os
import select
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ssh_scheduler.agent import boot
from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.executors.host import open_executor
from ssh_scheduler.transport.bootstrap import AGENT_FOLDER, agent_code, agent_start
from tests.hostile_server import HostileServer, hostile_server

AGENT_FILES = sorted(AGENT_FOLDER.glob("*.py"))


def start_agent(root: Path, stdin: bytes, python: str = sys.executable) -> subprocess.CompletedProcess[bytes]:
    start = agent_start(python, str(root))
    return subprocess.run(["/bin/sh", "-c", start.command], input=stdin, capture_output=True, timeout=60, check=False)


def test_only_the_first_stage_travels_on_the_command_line() -> None:
    start = agent_start("python3", "~/.ssh_scheduler", "tok")
    payload, key = agent_code()
    assert start.payload == payload and start.command.endswith(f" tok {key} {len(payload)}")
    assert "\n" not in start.command  # tcsh and fish, as login shells, refuse one inside quotes
    sources = zlib.decompress(payload).split(b"\0")
    assert sources == [(AGENT_FOLDER / f"{name}.py").read_bytes() for name in boot.MODULES]
    assert key == hashlib.sha256(payload).hexdigest()
    # the line is the first stage and short arguments, whatever the agent weighs
    first_stage = (AGENT_FOLDER / "boot.py").read_text()
    assert len(start.command) < len(repr(first_stage)) + 300 < len(payload)
    assert not any(line in start.command for source in sources for line in source.decode().splitlines()[2:] if len(line) > 40)


def test_the_protocol_that_follows_the_code_in_the_same_write_is_not_swallowed(tmp_path: Path) -> None:
    """The first stage reads exactly the code's size with os.read on fd 0, so a request in the
    same write (one SSH packet, one pipe write) is the agent's to answer."""
    start = agent_start(sys.executable, str(tmp_path / "root"))
    with subprocess.Popen(["/bin/sh", "-c", start.command], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        os.write(proc.stdin.fileno(), start.payload + P.Hello(id=1, lease=5).encode())
        ready, _, _ = select.select([proc.stdout], [], [], 30)  # a swallowed hello: no answer
        answer = W.decode_answer(proc.stdout.readline() if ready else b"(no answer)")
        proc.stdin.write(P.Bye().encode())
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    assert isinstance(answer, P.HelloReply) and answer.id == 1


def test_code_that_arrived_damaged_is_refused_and_never_run(tmp_path: Path) -> None:
    payload, key = agent_code()
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0xFF
    done = start_agent(tmp_path / "root", bytes(damaged))
    assert done.returncode == 2
    assert done.stdout.decode() == (
        f"ssh_scheduler agent refused to start: the agent's code arrived damaged (its sha256 is "
        f"not {key}); is something on the host writing to the session, like a login script?\n"
    )
    assert not (tmp_path / "root").exists()  # nothing of it ran


def test_code_that_did_not_arrive_whole_is_refused(tmp_path: Path) -> None:
    payload, _ = agent_code()
    done = start_agent(tmp_path / "root", payload[:100])
    assert (done.returncode, done.stdout.decode()) == (
        2, f"ssh_scheduler agent refused to start: the agent's code did not arrive (100 of {len(payload)} bytes)\n"
    )


OLD_PYTHON = '''#!{python} -I
"""python3 as an old one: says it is 3.6.9, then runs what it was given."""
import sys
at = sys.argv.index("-c")
program = sys.argv[at + 1]
sys.argv = ["-c"] + sys.argv[at + 2:]
sys.version_info = (3, 6, 9, "final", 0)
sys.version = "3.6.9 (a stand-in)"
exec(program)
'''
TOO_OLD = (
    "the host's python3 is 3.6.9, the agent needs 3.8 or newer; fix: install a newer python3, or "
    "put one first on the PATH of non-interactive ssh logins"
)


def old_python(folder: Path, python: str = sys.executable) -> Path:
    path = folder / "python3"
    path.write_text(OLD_PYTHON.format(python=python))
    path.chmod(0o755)
    return path


def test_a_python3_too_old_for_the_agent_is_named_with_the_fix(tmp_path: Path) -> None:
    done = start_agent(tmp_path / "root", agent_code()[0], python=str(old_python(tmp_path)))
    assert (done.returncode, done.stdout.decode()) == (2, f"ssh_scheduler agent refused to start: {TOO_OLD}\n")


@pytest.mark.parametrize("path", AGENT_FILES, ids=lambda p: p.name)
def test_what_travels_to_the_hosts_is_python_3_8(path: Path) -> None:
    ast.parse(path.read_text(), str(path), feature_version=(3, 8))


def test_what_runs_on_any_python3_says_nothing_an_old_one_cannot_parse() -> None:
    """The first stage runs before anyone knows the python3's version: no f-strings, no
    ``from __future__``, no annotation evaluated but plain names."""
    tree = ast.parse((AGENT_FOLDER / "boot.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.JoinedStr | ast.NamedExpr)]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    annotations = [a.annotation for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for a in f.args.args]
    annotations += [f.returns for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.returns]
    assert all(isinstance(a, ast.Name | ast.Constant) for a in annotations if a is not None)


@pytest.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[HostileServer]:
    async with hostile_server(tmp_path) as server:
        yield server


async def test_over_ssh_the_code_comes_on_stdin_before_the_protocol(hostile: HostileServer) -> None:
    executor = await open_executor(hostile.machine())
    try:
        assert hostile.agent_code == [agent_code()[0]]  # whole, then the hello was read
        assert [r.TAG for r in hostile.requests][:1] == ["hello"]
        (command,) = hostile.commands
        assert len(command) < 16 * 1024
    finally:
        await executor.close()


def test_the_agent_does_not_load_ssl(tmp_path: Path) -> None:
    """asyncio offers TLS, the agent never speaks it: its process maps no ``_ssl`` (a job's
    process is its own and imports what it likes)."""
    import _ssl

    if not getattr(_ssl, "__file__", None):
        pytest.skip("this python has _ssl built in: its maps cannot tell")
    start = agent_start(sys.executable, str(tmp_path / "root"))
    with subprocess.Popen(["/bin/sh", "-c", start.command], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        os.write(proc.stdin.fileno(), start.payload + P.Hello(id=1, lease=5).encode())
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        # It answered: its modules ran, asyncio's loop among them.
        answer = W.decode_answer(proc.stdout.readline() if ready else b"(no answer)")
        maps = Path(f"/proc/{proc.pid}/maps").read_text()  # the shell exec'd python: one pid
        proc.stdin.write(P.Bye().encode())
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    assert isinstance(answer, P.HelloReply)
    assert "_ssl" not in maps
