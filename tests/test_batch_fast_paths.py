"""A batch file's usual case is checked whole (its bytes, its names) and only a bad file goes
line by line, to name the first problem: on random files and names, both ways give the same
lines and the same verdict, message for message."""

from __future__ import annotations

import random

import pytest

from ssh_scheduler.errors import BatchError
from ssh_scheduler.jobs.batch_file import (
    Job,
    _check_names,
    _decode_each,
    _decode_lines,
    _first_collision,
)

PIECES = [b"echo a", b"x", b" ", b"\n", b"\r\n", b"\r", b"\x00", b"\xff", "é".encode(), b"\xc3", b"#", b"\xef\xbb\xbf"]


def outcome(call: object, *args: object) -> object:
    try:
        return call(*args)  # type: ignore[operator]
    except BatchError as exc:
        return f"error: {exc}"


SEEDS = [range(start, start + 50) for start in range(0, 400, 50)]
"""400 random cases in 8 tests (one test per case cost the suite seconds of its own)."""


@pytest.mark.parametrize("seeds", SEEDS, ids=str)
def test_a_file_decodes_whole_as_it_does_line_by_line(seeds: range) -> None:
    for seed in seeds:
        rng = random.Random(seed)
        # Mostly good pieces, so that both the whole path and the loop are taken.
        good = PIECES[:5] + PIECES[8:9]
        pool = good if rng.random() < 0.5 else PIECES
        data = b"".join(rng.choice(pool) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.2:
            data = b"\xef\xbb\xbf" + data
        body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
        assert outcome(_decode_lines, data, "b.sh") == outcome(_decode_each, body, "b.sh"), (seed, data)


NAMES = ["a", "A", "a.out", "A.OUT", "a.err", "b", "b.out.err", "b.out", "ß", "SS", "ss", "é", "é", "x.Out"]


@pytest.mark.parametrize("seeds", SEEDS, ids=str)
def test_names_are_checked_at_once_as_one_by_one(seeds: range) -> None:
    for seed in seeds:
        rng = random.Random(seed)
        names = rng.sample(NAMES, rng.randint(1, 6)) + [f"j{i}" for i in range(rng.randint(0, 3))]
        rng.shuffle(names)
        jobs = [Job(name, "true", number) for number, name in enumerate(names, start=1)]
        assert outcome(_check_names, jobs, "b.sh") == outcome(_first_collision, jobs, "b.sh"), (seed, names)
