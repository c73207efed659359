"""A command ends as its interpreter would have ended it (cli/launched.run_command, which both a
launcher's copy and a command run in its own process end through, skipping only the teardown
of every module): compared case by case with plain python running the same function."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Each case: a body for the command's main function.  The same body runs as a plain python
# program's main and as the command ssh_scheduler through run_command.
CASES = {
    "returns": "print('out'); print('err', file=sys.stderr)",
    "exit 3": "print('partial', end=''); raise SystemExit(3)",
    "exit None": "raise SystemExit(None)",
    "exit text": "raise SystemExit('said on stderr')",
    "exit 300": "raise SystemExit(300)",
    "uncaught": "raise ValueError('boom')",
    "ctrl-c": "raise KeyboardInterrupt",
    "atexit": "atexit.register(lambda: print('at exit', flush=True)); print('body')",
    "buffered": "sys.stdout.write('no newline, not flushed')",
    "thread": "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()",
}
PRELUDE = "import atexit, sys, threading, time\ndef main():\n"


def run(body: str, through_command: bool) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + "".join(f"    {line}\n" for line in body.splitlines())
    if through_command:
        code += (
            "import ssh_scheduler.cli.main as commands\n"
            "commands.main = main\n"
            "from ssh_scheduler.cli.launched import run_command\n"
            "run_command('ssh_scheduler')\n"
        )
    else:
        code += "main()\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_command_ends_as_python_would(case: str) -> None:
    plain, ours = run(CASES[case], False), run(CASES[case], True)
    assert ours.returncode == plain.returncode, (ours, plain)
    assert ours.stdout == plain.stdout
    # A traceback names different frames; its last line (the error) is the same.
    assert last_line(ours.stderr) == last_line(plain.stderr)
    assert ("Traceback" in ours.stderr) == ("Traceback" in plain.stderr)
