"""A machine's env: and setup: (machine_env), parsed from YAML and turned into shell text."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines.config import load_machine
from ssh_scheduler.machines.machine_env import SETUP_FAILED, with_setup


def machine_file(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text("ip: 10.0.0.1\nusername: ben\n" + extra)
    return path


def test_env_and_setup_are_read_from_the_machine_file(tmp_path: Path) -> None:
    machine = load_machine(str(machine_file(tmp_path, "env: {OMP_NUM_THREADS: 4, MODE: fast}\nsetup: source ~/venv/bin/activate\n")))
    assert machine.env == (("OMP_NUM_THREADS", "4"), ("MODE", "fast"))
    assert machine.setup == ("source ~/venv/bin/activate",)
    listed = load_machine(str(machine_file(tmp_path, "setup: [a, b]\n")))
    assert listed.setup == ("a", "b") and listed.env == ()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("env: [A]\n", "'env' must map variable names to values"),
        ("env: {1A: x}\n", "'env' name '1A' is not a shell variable name"),
        ("env: {A: [1]}\n", "'env' value of A must be text or a number"),
        ("setup: ['']\n", "'setup' must be a shell line or a list of them"),
        ("setup: {a: b}\n", "'setup' must be a shell line or a list of them"),
    ],
)
def test_bad_env_or_setup_is_a_one_line_error(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_machine(str(machine_file(tmp_path, extra)))


def bash(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})


def test_setup_runs_in_the_jobs_shell_and_a_failing_line_stops_the_job() -> None:
    assert with_setup("echo x", ()) == "echo x"
    ran = bash(with_setup('echo "$A"', ("export A=from-setup",)))
    assert (ran.returncode, ran.stdout) == (0, "from-setup\n")
    stopped = bash(with_setup("echo job-ran", ("true", "false", "echo never")))
    assert stopped.returncode == SETUP_FAILED and "job-ran" not in stopped.stdout
    assert stopped.stderr.strip() == "ssh_scheduler: the machine's setup line failed (exit code follows): false 1"


def test_conda_activate_gets_the_shell_hook_only_when_used() -> None:
    assert "shell.bash hook" not in with_setup("x", ("source venv/bin/activate",))
    text = with_setup("x", ("export PATH=/opt/conda/bin:$PATH", "conda activate exp"))
    assert text.index("export PATH") < text.index("shell.bash hook") < text.index("conda activate exp")
