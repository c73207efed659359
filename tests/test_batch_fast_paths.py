"""A batch file's usual case is checked whole (its bytes, its names) and only a bad file goes
line by line, to name the first problem: on random files and names, both ways give the same
lines and the same verdict, message for message."""

from __future__ import annotations

import random
import re

import pytest

from ssh_scheduler.errors import BatchError
from ssh_scheduler.jobs.batch_file import (
    Job,
    _check_names,
    _decode_each,
    _decode_lines,
    _first_collision,
    parse_batch,
)
from ssh_scheduler.jobs.job_names import job_name_prefix, job_name_problem

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


# Pieces of a batch file's path, which names its jobs: the rules' edges (separators, control
# characters, a leading '-' or space, the scheduler's reserved names and prefixes, UTF-8, and
# lengths near the 200-byte limit, which a line number's digits cross).
PATH_PIECES = ["b", "/", "./", "\\", "\x01", "-", " ", ".", "..", ".partial", "-", ".coordinator", ".log", ".lock", "é", "y" * 95, "z" * 30]


def default_names_line_by_line(data: bytes, path: str, commands_mode: bool) -> object:
    """The default names as the rule states them: each line's ``<prefix>.<number>`` checked on
    its own (a ``--commands`` line's ``--job-name`` instead, when it has one); the jobs, or the
    first bad line's number."""
    prefix = job_name_prefix(path)
    jobs = []
    for number, line in enumerate(_decode_lines(data, path), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        named = line.split()[1] if commands_mode and line.startswith("--job-name ") else None
        name = named or f"{prefix}.{number}"
        if named is None and job_name_problem(name) is not None:
            return f"line {number}"
        jobs.append(Job(name, line.split(" ", 2)[2] if named else line, number))
    return jobs or "no commands"


@pytest.mark.parametrize("commands_mode", [False, True], ids=["plain", "commands"])
@pytest.mark.parametrize("seeds", [range(start, start + 25) for start in range(0, 200, 25)], ids=str)
def test_default_names_are_checked_once_per_digit_count_as_line_by_line(seeds: range, commands_mode: bool) -> None:
    """parse_batch checks the first default name of each digit count only; on random paths and
    files (up to 1,200 lines: 1 to 4 digits; with --commands, lines that name their job among
    them) it finds the same jobs, or the same first bad line."""
    for seed in seeds:
        rng = random.Random(seed)
        path = "".join(rng.choice(PATH_PIECES) for _ in range(rng.randint(1, 4)))
        count = rng.choice([1, 9, 10, 99, 100, 150, 1200])
        command = "true" if commands_mode else "echo x"  # (--commands: one word, or quoted)
        pool = [f"{command}\n", f"{command}\n", "\n", "# c\n"] + ([f"--job-name n{{}} {command}\n"] * 2 if commands_mode else [])
        data = "".join(rng.choice(pool).format(at) for at in range(count)).encode()
        try:
            got: object = parse_batch(data, path, commands_mode=commands_mode)
        except BatchError as exc:
            bad = re.search(r" line (\d+): default job name ", str(exc))
            got = f"line {bad[1]}" if bad else "no commands" if "no commands" in str(exc) else str(exc)
        assert got == default_names_line_by_line(data, path, commands_mode), (seed, path, count)


@pytest.mark.parametrize(("length", "first_bad"), [(198, 10), (197, 100), (196, 1000)])
def test_a_default_name_is_too_long_from_the_line_whose_number_makes_it_so(length: int, first_bad: int) -> None:
    """A path of ``length`` bytes: ``<path>.<number>`` passes 200 bytes at the first number with
    one digit more, and that line is the one named."""
    with pytest.raises(BatchError, match=rf"^{'p' * length} line {first_bad}: default job name .* is 201 bytes long"):
        parse_batch(b"echo x\n" * 1200, "p" * length)
