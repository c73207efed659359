"""Kept dataclass code (cli/class_code.py): our processes make their dataclasses from code
compiled once, which must be exactly what Python compiles, and must never be taken from a file
that is not this user's, damaged or another Python's; a user's own process is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PROBE = Path(__file__).with_name("class_code_probe.py")


def probe(mode: str, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run([sys.executable, "-B", str(PROBE), mode], env=env, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["users_class_works"]
    return result


def kept_file(cache: Path) -> Path:
    files = list((cache / "ssh_scheduler" / "dataclass-code").iterdir())
    assert len(files) == 1, files
    return files[0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return probe("plain", tmp_path_factory.mktemp("plain"))


def test_kept_code_is_what_python_compiles_and_is_reused(plain: dict[str, Any], tmp_path: Path) -> None:
    first = probe("kept", tmp_path)
    assert first["exec_replaced"]
    assert first["counts"]["compiled"] > 100  # every text of ours, once
    stored = kept_file(tmp_path)
    assert stored.stat().st_mode & 0o777 == 0o600
    assert b"zz_users_own_field" not in stored.read_bytes()  # a class of a module not ours
    written = stored.stat().st_mtime_ns

    second = probe("kept", tmp_path)
    assert first["counts"]["kept"] == 0
    assert second["counts"] == {"kept": first["counts"]["compiled"], "compiled": 0}
    assert stored.stat().st_mtime_ns == written  # nothing new: not written again
    # Every made method, its docstring included, exactly as Python made it without us.
    assert len(plain["methods"]) > 300
    assert first["methods"] == plain["methods"]
    assert second["methods"] == plain["methods"]


def test_a_users_process_keeps_pythons_dataclasses(tmp_path: Path) -> None:
    user = probe("user", tmp_path)
    assert not user["exec_replaced"]
    assert user["counts"] == {"kept": 0, "compiled": 0}
    assert not (tmp_path / "ssh_scheduler").exists()


def _damage_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage_garbage(path: Path) -> None:
    header = path.read_bytes().split(b"\n", 1)[0]
    path.write_bytes(header + b"\n" + os.urandom(4096))


def _another_python(path: Path) -> None:
    header, rest = path.read_bytes().split(b"\n", 1)
    path.write_bytes(header.replace(b"|", b"+|", 1) + b"\n" + rest)


def _group_writable(path: Path) -> None:
    path.chmod(0o620)


def _not_a_file(path: Path) -> None:
    target = path.with_name("elsewhere")
    path.rename(target)
    path.symlink_to(target)


def _a_fifo(path: Path) -> None:  # refused, never waited on
    path.unlink()
    os.mkfifo(path, 0o600)


@pytest.mark.parametrize("spoil", [_damage_truncated, _damage_garbage, _another_python, _group_writable, _not_a_file, _a_fifo])
def test_a_file_that_cannot_be_trusted_is_compiled_again(plain: dict[str, Any], tmp_path: Path, spoil: Any) -> None:
    probe("kept", tmp_path)
    spoil(kept_file(tmp_path) if spoil is not _not_a_file else next((tmp_path / "ssh_scheduler" / "dataclass-code").glob("*.bin")))
    again = probe("kept", tmp_path)
    assert again["counts"]["kept"] == 0, spoil.__name__
    assert again["counts"]["compiled"] > 100
    assert again["methods"] == plain["methods"]


def test_a_file_of_another_user_is_not_read(plain: dict[str, Any], tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to give the file away")
    probe("kept", tmp_path)
    os.chown(kept_file(tmp_path), 65534, 65534)
    again = probe("kept", tmp_path)
    assert again["counts"]["kept"] == 0
    assert again["methods"] == plain["methods"]


def test_a_cache_that_cannot_be_written_costs_only_the_compiling(plain: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "ssh_scheduler").write_text("a file where the folder would be\n")
    for _ in range(2):
        result = probe("kept", tmp_path)
        assert result["counts"]["kept"] == 0
        assert result["methods"] == plain["methods"]


@pytest.mark.parametrize("command", ["script", "module"])
def test_our_commands_keep_their_classes_code(tmp_path: Path, command: str) -> None:
    """The console scripts' start (cli/launch.py) and ``python -m ssh_scheduler`` install it
    before the command's modules load: a dry run on this machine leaves the file."""
    batch = tmp_path / "batch.sh"
    batch.write_text("echo one\necho two\n")
    starts = {"script": [str(Path(sys.executable).parent / "execute_batch")], "module": [sys.executable, "-m", "ssh_scheduler", "execute_batch"]}
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "SSH_SCHEDULER_KEEP_WARM": "0"}
    done = subprocess.run([*starts[command], str(batch), "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    stored = kept_file(cache)
    assert stored.stat().st_size > 10_000


def test_priming_keeps_every_class_a_command_makes(tmp_path: Path) -> None:
    """``python -m ssh_scheduler.cli.class_code`` (the launcher's loading, as the benchmark uses
    it beside compileall) loads every module: a command started after it compiles nothing."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "SSH_SCHEDULER_KEEP_WARM": "0"}
    done = subprocess.run([sys.executable, "-m", "ssh_scheduler.cli.class_code"], env=env, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr
    primed = kept_file(tmp_path).stat().st_mtime_ns
    result = probe("kept", tmp_path)  # every module the package has (but the hosts' files)
    assert result["counts"]["compiled"] == 0 and result["counts"]["kept"] > 100
    assert kept_file(tmp_path).stat().st_mtime_ns == primed


def test_each_python_build_has_its_own_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two builds of one Python version sharing a home (NFS) keep a file each, rather than each
    finding the other's (refused by its first line) and writing its own over it."""
    from ssh_scheduler.cli import class_code

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = class_code._path()
    monkeypatch.setattr(class_code, "_header", lambda: b"3.11.7 (another build)|cpython-311|0\n")
    theirs = class_code._path()
    assert ours != theirs and Path(ours).parent == Path(theirs).parent == tmp_path / "ssh_scheduler" / "dataclass-code"
