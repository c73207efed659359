"""The real H100 captures in tests/data/h100 (see tests/data/README.md): what real commands
printed on a real machine, so that the probe parsers and the simulated ``nvidia-smi`` are tested
against real output.  Part of the repository, so these tests run on every clean clone."""

from __future__ import annotations

import re
from pathlib import Path

H100 = Path(__file__).resolve().parent / "data" / "h100"


def capture(name: str) -> tuple[str, str, int]:
    """(command, output, exit status) of a capture: its first line is ``$ command``, its last
    ``[exit N]``, and what lies between is the output, byte for byte."""
    lines = (H100 / name).read_text().splitlines(keepends=True)
    assert lines[0].startswith("$ "), f"{name}: no command line"
    match = re.fullmatch(r"\[exit (\d+)\]\n?", lines[-1])
    assert match, f"{name}: no exit line"
    return lines[0][2:].rstrip("\n"), "".join(lines[1:-1]), int(match.group(1))
