from __future__ import annotations

import random
import sys
import tracemalloc
from types import FrameType
from typing import Any

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines import hostlist
from ssh_scheduler.machines.hostlist import MAX_EXPANSION, expand, fold


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("gpu1", ["gpu1"]),
        ("gpu[1-3]", ["gpu1", "gpu2", "gpu3"]),
        ("gpu[1-3,12]", ["gpu1", "gpu2", "gpu3", "gpu12"]),
        ("gpu[1-8,12]", [f"gpu{i}" for i in range(1, 9)] + ["gpu12"]),
        ("n[01-10]", [f"n{i:02d}" for i in range(1, 11)]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
        ("n[0-2]", ["n0", "n1", "n2"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a,b[1-2]", ["a", "b1", "b2"]),
        ("a, b[1-2] ", ["a", "b1", "b2"]),
        ("gpu[1-3,2]", ["gpu1", "gpu2", "gpu3"]),  # duplicates dropped, first kept
        ("a,a", ["a"]),
        ("[1-2]x", ["1x", "2x"]),
        ("gpu[1-2].lan", ["gpu1.lan", "gpu2.lan"]),
        ("ben@gpu[1-2]:2222", ["ben@gpu1:2222", "ben@gpu2:2222"]),
        ("machines/m[1-2].yaml", ["machines/m1.yaml", "machines/m2.yaml"]),
        ("x[5]", ["x5"]),
        ("x[ 1 - 2 ]".replace(" - ", "-"), ["x1", "x2"]),
        ("10.0.0.[1-3]", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
        ("a[1-5]!a3", ["a1", "a2", "a4", "a5"]),
        ("a[1-5]!a3,b1", ["a1", "a2", "a4", "a5", "b1"]),
        ("a[1-3]&a[2-5]", ["a2", "a3"]),
        ("a[1-3]^a[2-5]", ["a1", "a4", "a5"]),
        ("n[1-60000],n[1-60000]", [f"n{i}" for i in range(1, 60001)]),  # the limit counts names
        ("n[1-60000,1-60000]", [f"n{i}" for i in range(1, 60001)]),
        ("n[1]a0[2]", ["n1a02"]),  # something besides digits between the brackets
        ("r[1-2]n0[1-2]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("a1[8-9]", ["a18", "a19"]),  # a digit before a range that keeps its width
        ("a1[08-10]", ["a108", "a109", "a110"]),
        ("a[1-6]^a[4-9]!a2,a3", ["a1", "a3", "a7", "a8", "a9"]),
        ("a[1-6]^a[4-9]!a3,a3", ["a1", "a2", "a7", "a8", "a9", "a3"]),  # a3 joins again, last
        ("a[1-6]&a[3-9]", ["a3", "a4", "a5", "a6"]),
        ("a[1-9]&a[6,2]", ["a2", "a6"]),  # the order of the set, not of the operand
        ("n3,n1,n2&n[2-3]", ["n3", "n2"]),  # the set's order also when the operand is smaller
        ("n1^n3,n2&n[2-3]", ["n3", "n2"]),  # names joined by '^' keep their place too
    ],
)
def test_expand(pattern: str, expected: list[str]) -> None:
    assert expand(pattern) == expected


@pytest.mark.parametrize(
    ("pattern", "needle"),
    [
        ("gpu[3-1]", "3-1"),
        ("gpu[", "never closed"),
        ("gpu[1-2", "never closed"),
        ("gpu1-2]", "without a matching"),
        ("a]b[1]", "without a matching"),  # also when a range follows
        ("gpu[a-b]", "'a-b'"),
        ("gpu[*]", "'*' is not a number"),  # inside brackets: a bad number, not a wildcard
        ("gpu[1-]", "'1-'"),
        ("gpu[-3]", "'-3'"),
        ("gpu[]", "empty brackets"),
        ("gpu[1,,2]", "''"),
        ("gpu[[1-2]]", "nested"),
        ("n[08-100]", "different widths"),
        ("n[1-010]", "different widths"),
        ("n[1-2][3-4]", "next to each other"),
        ("@gpus", "node groups"),
        ("gpu[1-9/2]", "steps"),
        ("a!a", "leaves no host"),
        ("a[1-5]!", "nothing beside '!'"),
        ("", "empty host pattern"),
        ("   ", "empty host pattern"),
        ("a,,b", "empty name"),
        ("a,", "empty name"),
        ("n[1-100000000000]", "limit"),
        ("n[1-1000]m[1-1000]", "limit"),
        ("a[1-60000],b[1-60000]", "limit"),
        ("n[1]0[2]", "only digits ('0') between two brackets"),
        ("n[1-2]0[1-2]", "only digits"),
        ("x1[2]34[5]", "only digits ('34')"),
        ("gpu*", "wildcards like 'gpu*' are not supported"),
        ("gpu?", "wildcards like 'gpu?'"),
        ("a,g*u[1-2]", "wildcards like 'g*u[1-2]'"),
        ("a1[8-10]", "from 9 to 10 is not supported"),
        ("n1[98-99,100]", "from 99 to 100"),
    ],
)
def test_expand_errors(pattern: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand(pattern)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert "(" in message  # says how to fix it


def test_size_is_checked_before_anything_is_built() -> None:
    """40 brackets of 100000 numbers would take gigabytes; the error comes first."""
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="limit"):
            expand("x".join(["n[1-100000]"] * 40))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_fold_unicode_digits_are_text() -> None:
    assert fold(["x\u2460", "x\u2461", "y\u00b2"]) == "x\u2460,x\u2461,y\u00b2"
    assert fold(["n\u00b21", "n\u00b22"]) == "n\u00b2[1-2]"


def test_expand_limit_is_exact() -> None:
    assert len(expand(f"n[1-{MAX_EXPANSION}]")) == MAX_EXPANSION
    with pytest.raises(ConfigError):
        expand(f"n[0-{MAX_EXPANSION}]")


def test_a_range_over_the_limit_says_its_exact_size() -> None:
    """The limit counts distinct names exactly (ranges of a bracket merged where they overlap),
    before building them; a name and one range over the limit says how many names it would be,
    a pattern of several ranges only that it is over."""
    n = MAX_EXPANSION
    assert len(expand(f"n[1-60000,50001-{n}]")) == n
    for pattern, size in [
        (f"n[0-{n}]", n + 1),
        (f"n[1-60000,50001-{n + 1}]", n + 1),
        (f"n[1-{n},{n + 1}-{n + 2}]", n + 2),
    ]:
        with pytest.raises(ConfigError) as info:
            expand(pattern)
        assert str(info.value) == (
            f"host range {pattern!r} expands to {size} names, more than the limit of {n} names (use a smaller range)"
        )
    with pytest.raises(ConfigError) as info:
        expand("r[1-1000]n[1-1000]")
    assert str(info.value) == (
        f"host range 'r[1-1000]n[1-1000]' expands to more than the limit of {n} names (use a smaller range)"
    )


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["gpu1", "gpu2", "gpu3", "gpu5"], "gpu[1-3,5]"),
        (["gpu5", "gpu3", "gpu1", "gpu2"], "gpu[1-3,5]"),
        (["gpu1"], "gpu1"),
        (["gpu1", "gpu1"], "gpu1"),
        ([], ""),
        (["n08", "n09", "n10"], "n[08-10]"),
        (["n8", "n9", "n10"], "n[8-10]"),
        (["n1", "n01"], "n[1,01]"),
        (["a", "b", "gpu2", "gpu1"], "a,b,gpu[1-2]"),
        (["r1n1", "r1n2", "r2n1"], "r1n[1-2],r2n1"),
        (["r10n1", "r2n1", "r2n2"], "r2n[1-2],r10n1"),  # prefixes compared numerically
        (["10x1", "10x2", "2x1", "2x2"], "2x[1-2],10x[1-2]"),  # also a prefix's first digits
        (["x1", "x2", "1x1", "1x2"], "1x[1-2],x[1-2]"),  # digits before letters, as in ASCII
        (["abc1", "abc0", "abc"], "abc,abc[0-1]"),  # a plain name before its prefix's range
        (["gpu1.lan", "gpu2.lan", "gpu3"], "gpu3,gpu[1-2].lan"),
        (["10.0.0.1", "10.0.0.2"], "10.0.0.[1-2]"),
        (["x9", "x10", "x11", "x13"], "x[9-11,13]"),
        ([f"n{i:02d}" for i in range(8, 101)], "n[08-99,100]"),
    ],
)
def test_fold(names: list[str], expected: str) -> None:
    assert fold(names) == expected


@pytest.mark.parametrize(
    "pattern",
    ["gpu[1-3,5]", "n[08-10]", "n[8-10]", "a,b,gpu[1-2]", "x[1,3,5-7,10-12]", "gpu7", "n[001-120]"],
)
def test_fold_expand_round_trip(pattern: str) -> None:
    assert fold(expand(pattern)) == pattern


def test_expand_fold_property_random_sets() -> None:
    rng = random.Random(1234)
    prefixes = ["gpu", "node-", "r1n", "h", "x.y", ""]
    suffixes = ["", ".lan", "-ib"]
    for _ in range(300):
        names: set[str] = set()
        for _ in range(rng.randint(1, 25)):
            width = rng.choice([0, 0, 2, 3])
            number = rng.randint(0, 150)
            digits = f"{number:0{width}d}" if width else str(number)
            names.add(rng.choice(prefixes) + digits + rng.choice(suffixes))
        if rng.random() < 0.2:
            names.add(rng.choice(["login", "head", "db"]))
        folded = fold(names)
        assert sorted(expand(folded)) == sorted(names), folded
        assert fold(expand(folded)) == folded


def _work(pattern: str) -> int:
    """Lines of hostlist.py run to expand ``pattern``: a count of work, the same on every
    machine (no timing)."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if frame.f_code.co_filename != hostlist.__file__:
            return None
        count += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        expand(pattern)
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize("operator", ["!", "^", ","])
def test_an_operator_costs_its_operand_not_the_set(operator: str) -> None:
    """"n[1-100000]" then 2,000 "!x" took 48 s: every operator copied the whole set.  The work
    of 200 operators is the same after 1,000 names as after 8,000."""
    chain = "".join(f"{operator}x{i}" for i in range(200))
    small = _work("n[1-1000]" + chain) - _work("n[1-1000]")
    large = _work("n[1-8000]" + chain) - _work("n[1-8000]")
    assert 0 < large <= small + 10, (small, large)


def test_intersection_with_a_few_names_does_not_walk_the_set() -> None:
    small = _work("n[1-1000]&n5") - _work("n[1-1000]")
    large = _work("n[1-8000]&n5") - _work("n[1-8000]")
    assert 0 < large <= small + 10, (small, large)
