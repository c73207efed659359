"""A job line of plain words starts without bash (agent_io.without_shell) only where that is the
same as ``bash --norc -c LINE``: same exit code, output and environment; everything else is
left to bash, which says what it always said (127/126 and their messages)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ssh_scheduler.agent.plumbing import without_shell
from tests.live_batch import EXECUTE_BATCH, REPO

BASH = ["/bin/bash", "--norc", "-c"]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "myprog").write_text("#!/bin/sh\necho \"args: $*\"; echo \"to stderr\" >&2; exit 7\n")
    (work / "myprog").chmod(0o755)
    (work / "noshebang").write_text("echo run by bash\n")
    (work / "noshebang").chmod(0o755)
    (work / "notexec").write_text("#!/bin/sh\necho never\n")
    (tmp_path / "link").symlink_to(work)
    return work


def outcome(argv: list[str], cwd: Path, env: dict[str, str], executable: str | None = None) -> tuple[int, list[str], str]:
    done = subprocess.run(argv, executable=executable, cwd=cwd, env=env, capture_output=True, text=True, timeout=30)
    return done.returncode, sorted(done.stdout.splitlines()), done.stderr


ENVIRONMENTS = {
    "plain": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "A-B": "not a name"},
    "shell level 3, PWD elsewhere, OLDPWD a folder": {"PATH": "/usr/bin:/bin", "SHLVL": "3", "PWD": "/", "OLDPWD": "/usr"},
    "OLDPWD not a folder, SHLVL 07": {"PATH": "/usr/bin/:/bin", "OLDPWD": "/nowhere", "SHLVL": "07"},
    "PWD names the folder through a link": {"PATH": "/usr/bin:/bin", "PWD": "LINK"},
}


@pytest.mark.parametrize("line", ["env", "true", "false", "sleep 0", "./myprog a=1 b,c", "printenv PWD", "  env  "])
@pytest.mark.parametrize("which", sorted(ENVIRONMENTS))
def test_plain_lines_run_the_same_without_bash(folder: Path, line: str, which: str) -> None:
    env = {k: (str(folder.parent / "link") if v == "LINK" else v) for k, v in ENVIRONMENTS[which].items()}
    direct = without_shell(line, str(folder), env)
    assert direct is not None, line  # the fast path is really taken for these lines
    argv, program, direct_env = direct
    assert outcome(argv, folder, direct_env, program) == outcome([*BASH, line], folder, env)


@pytest.mark.parametrize(
    "line",
    [
        "echo hi",  # a builtin: bash's echo is not /bin/echo
        "true --help",  # /bin/true --help prints its help, the builtin does not
        "A=1 env",  # an assignment
        "env $HOME",  # an expansion
        "ls *.py",  # a glob
        "env > out",  # a redirection
        "true && env",  # an operator
        "env 'a b'",  # quotes
        "~/bin/x",  # a tilde
        "time sleep 0",  # a keyword
        "nosuchcommand a",  # not on PATH: bash says "command not found" (127)
        "./notexec",  # not executable: bash says "Permission denied" (126)
        "./missing",
        ".",
        "",
    ],
)
def test_lines_only_bash_can_run_are_left_to_it(folder: Path, line: str) -> None:
    assert without_shell(line, str(folder), {"PATH": "/usr/bin:/bin"}) is None


@pytest.mark.parametrize(
    "env",
    [
        {"PATH": "/usr/bin:/bin", "BASH_ENV": "/etc/profile"},  # bash would read it first
        {"PATH": "/usr/bin:/bin", "BASH_FUNC_env%%": "() { echo function; }"},  # an exported function
        {"PATH": "/usr/bin:/bin", "SHELLOPTS": "xtrace"},
        {"PATH": "/usr/bin:/bin", "SHLVL": "1000"},  # bash warns on stderr
        {"PATH": ".:/usr/bin:/bin"},  # bash's own rule for a relative PATH entry met first
        {"HOME": "/root"},  # no PATH: bash's default one
    ],
)
def test_environments_that_change_what_bash_does_are_left_to_it(folder: Path, env: dict[str, str]) -> None:
    assert without_shell("env", str(folder), env) is None


def test_a_script_without_shebang_passes_the_check_but_exec_refuses_it(folder: Path) -> None:
    """Why the agent falls back to bash when the exec fails: bash runs such a file itself."""
    direct = without_shell("./noshebang", str(folder), {"PATH": "/usr/bin:/bin"})
    assert direct is not None
    with pytest.raises(OSError):
        subprocess.run(direct[0], executable=direct[1], cwd=folder, env=direct[2], timeout=30)


def test_a_batch_gets_bashs_exit_codes_messages_and_environment(folder: Path, tmp_path: Path) -> None:
    """End to end through the agent (here, without ssh): the fast path and bash side by side."""
    lines = ["env", "bash --norc -c env", "nosuchcommand a", "./notexec", "./noshebang", "./myprog x"]
    (folder / "b.sh").write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "home"))
    done = subprocess.run(
        [*EXECUTE_BATCH, "b.sh", "--no-gpu-required", "--num-cpus", "0"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120,
    )
    results = folder / "job_results"

    def read(name: str) -> str:
        path = results / name
        return path.read_text() if path.exists() else ""

    per_job = {"SSH_SCHEDULER_JOB", "SSH_SCHEDULER_TAG"}
    seen = [
        sorted(v.replace(f"b.sh.{n}", "b.sh.N") for v in read(f"b.sh.{n}.out").splitlines() if v.split("=")[0] not in per_job)
        for n in (1, 2)
    ]
    assert seen[0] and seen[0] == seen[1]  # the program's environment is what bash gave it
    assert "exit 127 on" in done.stdout and "exit 126 on" in done.stdout and "exit 7 on" in done.stdout
    assert read("b.sh.3.err") == "/bin/bash: line 1: nosuchcommand: command not found\n"
    assert read("b.sh.4.err") == "/bin/bash: line 1: ./notexec: Permission denied\n"
    assert read("b.sh.5.out") == "run by bash\n"  # exec refused it, bash ran it
    assert (read("b.sh.6.out"), read("b.sh.6.err")) == ("args: x\n", "to stderr\n")
