"""A machine's environment recipe: ``env:`` (variables) and ``setup:`` (shell lines run before
every job, e.g. ``source ~/venv/bin/activate`` or ``conda activate exp``).

SSH runs jobs in non-interactive shells, which read no ``.bashrc``: ``conda activate`` there
fails with "run conda init first".  So when a setup line uses conda, conda's shell hook is
loaded first (``eval "$(conda shell.bash hook)"``), which is what ``conda init`` puts in a
``.bashrc`` (loaded just before the first line that uses it).  A failing setup line fails the job with exit 126 and says which line failed, so a
broken recipe is not mistaken for a failing job.  Pure: values in, shell text out.
"""

from __future__ import annotations

import re
import shlex

from ssh_scheduler.errors import ConfigError, show_value

__all__ = ["PYTHON_WORD", "SETUP_FAILED", "parse_env", "parse_python", "parse_setup", "with_setup"]

SETUP_FAILED = 126
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PYTHON_WORD = re.compile(r"[A-Za-z0-9_./~+][A-Za-z0-9_./~+-]*")
"""What ``python:`` may be: one shell word, a command or a path (its ``~`` expands there)."""
_CONDA_RE = re.compile(r"(^|[;&|\s])(conda|mamba|micromamba)\s+activate\b")
_CONDA_HOOK = (
    'for __sshs_conda in conda mamba micromamba; do command -v "$__sshs_conda" >/dev/null 2>&1 '
    '&& eval "$("$__sshs_conda" shell.bash hook 2>/dev/null)" && break; done'
)


def parse_env(value: object, at: str) -> tuple[tuple[str, str], ...]:
    """``env:`` must map variable names to text or numbers."""
    if not isinstance(value, dict):
        raise ConfigError(f"{at}: 'env' must map variable names to values, like 'env: {{OMP_NUM_THREADS: 4}}'")
    pairs = []
    for name, raw in value.items():
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ConfigError(f"{at}: 'env' name {show_value(name)} is not a shell variable name")
        if isinstance(raw, bool) or not isinstance(raw, str | int | float) or "\x00" in str(raw):
            raise ConfigError(f"{at}: 'env' value of {name} must be text or a number, got {show_value(raw)}")
        pairs.append((name, str(raw)))
    return tuple(pairs)


def parse_setup(value: object, at: str) -> tuple[str, ...]:
    """``setup:`` is one shell line or a list of them."""
    lines: list[object] = list(value) if isinstance(value, list) else [value]
    for line in lines:
        if not isinstance(line, str) or not line.strip() or "\x00" in line or "\n" in line:
            raise ConfigError(
                f"{at}: 'setup' must be a shell line or a list of them (one command each), got {show_value(line)}"
            )
    return tuple(str(line) for line in lines)


def parse_python(value: object, at: str) -> str:
    """``python:`` names one interpreter: a command on the PATH or a path (``~`` is the remote
    home), one shell word, so it goes on the call's command line as written."""
    if not isinstance(value, str) or not PYTHON_WORD.fullmatch(value):
        raise ConfigError(
            f"{at}: 'python' must be one interpreter, a command or a path like ~/venvs/exp/bin/python "
            f"(letters, digits and _ . / ~ + -; no spaces or shell characters), got {show_value(value)}"
        )
    return value


def with_setup(command: str, setup: tuple[str, ...]) -> str:
    """``command`` preceded by the machine's setup lines, in the same shell (so what they
    export or activate is the job's), each checked."""
    if not setup:
        return command
    steps = []
    hooked = False
    for line in setup:
        if not hooked and _CONDA_RE.search(line):
            steps.append(_CONDA_HOOK)  # here, not first: earlier lines may put conda on PATH
            hooked = True
        message = shlex.quote(f"ssh_scheduler: the machine's setup line failed (exit code follows): {line}")
        steps.append(f"{line}\n__sshs_rc=$?; if [ $__sshs_rc -ne 0 ]; then echo {message} $__sshs_rc >&2; exit {SETUP_FAILED}; fi")
    return "\n".join([*steps, command])
