"""Our host ranges against ClusterShell's ``NodeSet`` (what ``clush``/``nodeset`` read).

Generated patterns, and the ones users sent in (``tests/data/hostlist/patterns.txt``), must
expand to the same set of names, or be refused by both; where we refuse what ClusterShell
accepts, it is a deliberate refusal (node groups, wildcards, steps, an empty result).  Our folds
must read back in ClusterShell as the same set, and ClusterShell's folds in ours.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from ClusterShell.NodeSet import NodeSet, NodeSetException

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines.hostlist import expand, fold

DELIBERATE = ("not supported", "leaves no host")
DATA = Path(__file__).parent / "data" / "hostlist"
PREFIXES = ["gpu", "n", "r1n", "node-", "a.b", "", "x_"]
SUFFIXES = ["", ".lan", "-ib", "c"]


def number(rng: random.Random, width: int) -> str:
    value = rng.randint(0, 10 ** max(width, 1) - 1 if width else 150)
    return f"{value:0{width}d}" if width else str(value)


def bracket_item(rng: random.Random) -> str:
    width = rng.choice([0, 0, 0, 2, 3])
    lo = number(rng, width)
    if rng.random() < 0.4:
        return lo
    span = rng.randint(0, 40)
    hi_value = int(lo) + span if rng.random() < 0.95 else max(int(lo) - 1, 0)
    hi = f"{hi_value:0{len(lo)}d}" if width else str(hi_value)
    if rng.random() < 0.05:
        hi = "0" + hi  # a different width: both must refuse
    return f"{lo}-{hi}"


def operand(rng: random.Random) -> str:
    text = rng.choice(PREFIXES)
    for index in range(rng.choice([0, 1, 1, 1, 2])):
        if index and rng.random() < 0.9:
            # ClusterShell refuses "][" and digits alone between brackets (so do we), and reads
            # a digit right before a bracket its own way (we refuse where that differs)
            odd = rng.random() < 0.15
            text += rng.choice(["0", "12", "1a", "a1"] if odd else ["x", "-", "n"])
        items = ",".join(bracket_item(rng) for _ in range(rng.randint(1, 3)))
        text += f"[{items}]"
    text += rng.choice(SUFFIXES)
    if rng.random() < 0.01:
        text += rng.choice(["*", "?"])  # a wildcard over a group source: we refuse it
    return text or "h"


def pattern(rng: random.Random) -> str:
    text = operand(rng)
    for _ in range(rng.choice([0, 0, 1, 2])):
        text += rng.choice([",", ",", ",", "!", "&", "^"]) + operand(rng)
    if rng.random() < 0.03:
        text = rng.choice(["@grp", "a[1-9/2]", "a,,b", "a[", "a]", "a[[1]]", "a[]", "!a", "a,"])
    return text


def clustershell(text: str) -> set[str] | None:
    try:
        return set(NodeSet(text))
    except NodeSetException:
        return None


def compare(text: str) -> str:
    """Expand with both; assert they agree; return 'same', 'both refuse' or 'we refuse'."""
    theirs = clustershell(text)
    try:
        mine = expand(text)
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message and repr(text[:20])[:-1] in message, message
        if theirs is None:
            return "both refuse"
        assert any(word in message for word in DELIBERATE), (text, message)
        return "we refuse"
    assert theirs is not None, (text, mine)
    assert set(mine) == theirs, text
    assert len(mine) == len(set(mine))
    return "same"


def test_generated_patterns_agree_with_clustershell() -> None:
    rng = random.Random(16)
    outcomes = {"same": 0, "both refuse": 0, "we refuse": 0}
    for _ in range(3000):
        outcomes[compare(pattern(rng))] += 1
    assert outcomes["same"] > 2000 and outcomes["both refuse"] > 50, outcomes
    assert outcomes["we refuse"] > 10, outcomes


def users_patterns() -> list[str]:
    lines = (DATA / "patterns.txt").read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip() and not line.startswith("# ")]


@pytest.mark.parametrize("text", users_patterns())
def test_users_patterns_agree_with_clustershell(text: str) -> None:
    compare(text)


def test_users_patterns_cover_the_three_outcomes() -> None:
    outcomes: dict[str, list[str]] = {}
    for text in users_patterns():
        outcomes.setdefault(compare(text), []).append(text)
    assert len(outcomes["both refuse"]) == 8, outcomes  # digits between brackets
    assert len(outcomes["we refuse"]) == 10, outcomes  # wildcards, digit before a growing range
    assert len(outcomes["same"]) == 10, outcomes


@pytest.mark.parametrize("operator", ["!", "^", ",", "&"])
def test_long_operator_chains_agree_with_clustershell(operator: str) -> None:
    """2,000 operators after a 100,000-name range, as users generate them (an exclude list)."""
    size = 100_000 if operator in "!&" else 50_000
    text = f"n[1-{size}]" + "".join(f"{operator}n{i * 7}" for i in range(1, 2001))
    assert compare(text) == ("same" if operator != "&" else "we refuse")


def names(rng: random.Random) -> set[str]:
    out: set[str] = set()
    for _ in range(rng.randint(1, 40)):
        width = rng.choice([0, 0, 2, 3])
        digits = number(rng, width) if width else str(rng.randint(0, 150))
        name = rng.choice(PREFIXES) + digits + rng.choice(SUFFIXES)
        if rng.random() < 0.2:
            name += "n" + str(rng.randint(1, 12))  # two numbers: r1n3 and friends
        out.add(name)
    if rng.random() < 0.2:
        out.add(rng.choice(["login", "head", "db"]))
    return out


def test_folds_round_trip_through_clustershell() -> None:
    rng = random.Random(1126)
    for _ in range(1000):
        group = names(rng)
        ours = fold(group)
        assert set(NodeSet(ours)) == group, ours
        assert set(expand(ours)) == group, ours
        theirs = str(NodeSet.fromlist(sorted(group)))
        assert set(expand(theirs)) == group, theirs


@pytest.mark.parametrize(
    ("group", "folded"),
    [
        ([f"n{i:02d}" for i in range(1, 121)], "n[01-99,100-120]"),
        ([f"n{i:02d}" for i in range(8, 101)], "n[08-99,100]"),
        (["n1", "n01", "n2"], "n[1-2,01]"),
        (["n9", "n10", "n11", "n010"], "n[9-11,010]"),
        (["n099", "n100", "n101"], "n[099-101]"),
        (["n0", "n00", "n000", "n1"], "n[0-1,00,000]"),
    ],
)
def test_fold_matches_clustershell_numbers(group: list[str], folded: str) -> None:
    assert fold(group) == folded == str(NodeSet.fromlist(group))
