"""Host ranges as ClusterShell (``clush``, ``nodeset``) writes them: ``expand("gpu[1-8,12]")``
and its inverse ``fold``.  ``tests/test_hostlist_differential.py`` holds both to ClusterShell's
``NodeSet``.

Syntax accepted by :func:`expand`:

* ``gpu[1-8,12]`` -> ``gpu1 .. gpu8, gpu12``: a bracket holds comma-separated numbers and
  ``lo-hi`` ranges (``lo <= hi``, decimal digits only).
* Zero padding: ``n[01-10]`` -> ``n01 .. n10``; ``n[1-10]`` -> ``n1 .. n10``.  Both ends of a
  padded range have the same number of digits (``n[08-100]`` is refused, as ClusterShell does:
  write ``n[08-99,100]``).
* Several brackets give the cartesian product, leftmost bracket varying slowest
  (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``).  Between two brackets there must be something
  other than digits: ClusterShell refuses ``n[1][2]`` and ``n[1]0[2]`` alike.
* ClusterShell's set operators between patterns, evaluated left to right: ``,`` union,
  ``!`` difference (``gpu[1-8]!gpu3``), ``&`` intersection, ``^`` symmetric difference;
  whitespace around each pattern is ignored.  Each operator costs the size of its own
  operand, not of the set so far, so a long chain of them stays linear.
* Everything outside brackets is literal text, so ``ben@gpu[1-2]:2222`` and
  ``machines/gpu[1-2].yaml`` work too.
* The result keeps the order of the pattern and drops repeated names (first one wins).
* At most :data:`MAX_EXPANSION` distinct names; more is a :class:`ConfigError`, checked before
  the names are generated.

Refused, because ClusterShell would read them differently: node groups (``@gpus``), wildcards
(``gpu*``, ``gpu?``: ClusterShell matches them against the hosts of a group source, and we have
none) and range steps (``[1-10/2]``).  Anything malformed (``gpu[3-1]``, ``gpu[``, ``gpu[a-b]``, ``gpu[]``, an
empty pattern) raises :class:`ConfigError` with a one-line message.

:func:`fold` is the inverse used for display; ``expand(fold(names))`` gives back the same set of
names, and ClusterShell reads the folded text as the same set.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ssh_scheduler.errors import ConfigError

__all__ = ["MAX_EXPANSION", "expand", "fold"]

MAX_EXPANSION = 100_000
"""Most distinct names one pattern may expand to."""

OPERATORS = ",!&^"
_RANGE_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_LAST_NUMBER = re.compile(r"^(.*?)([0-9]+)([^0-9]*)$", re.DOTALL)
_ALL_DIGITS = re.compile(r"[0-9]+")
_DIGITS = frozenset("0123456789")
_MAX_SHOWN = 60


def _show(text: str) -> str:
    """A pattern for an error message: quoted, control characters escaped, long ones cut."""
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return repr(text)


def _split_operators(pattern: str) -> list[tuple[str, str]]:
    """``a,b!c`` -> ``[("", "a"), (",", "b"), ("!", "c")]``: operators outside brackets."""
    parts: list[tuple[str, str]] = []
    depth = 0
    start = 0
    operator = ""
    for i, ch in enumerate(pattern):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif ch in OPERATORS and depth == 0:
            parts.append((operator, pattern[start:i]))
            operator, start = ch, i + 1
    parts.append((operator, pattern[start:]))
    return parts


def _padded(digits: str) -> bool:
    return len(digits) > 1 and digits.startswith("0")


@dataclass(frozen=True, slots=True)
class _Bracket:
    """The numbers of one ``[...]``: ``(lo, hi, width)`` ranges, width 0 = no padding."""

    ranges: tuple[tuple[int, int, int], ...]

    def count(self) -> int:
        """Distinct names, without generating them (ranges of one width merged)."""
        total = 0
        for width in {w for _, _, w in self.ranges}:
            spans = sorted((lo, hi) for lo, hi, w in self.ranges if w == width)
            end = -1
            for lo, hi in spans:
                if hi > end:
                    total += hi - max(lo, end + 1) + 1
                    end = hi
        return total

    def crossing(self) -> int | None:
        """A power of ten that the unpadded numbers reach from the number before it (9 and 10,
        99 and 100...): ClusterShell prepends the digits before a bracket to each end of a run
        of numbers, which across such a step gives another range (1[9-10] -> 19-110)."""
        spans = [(lo, hi) for lo, hi, width in self.ranges if not width]
        power = 10
        while spans and power <= max(hi for _, hi in spans):
            if all(any(lo <= n <= hi for lo, hi in spans) for n in (power - 1, power)):
                return power
            power *= 10
        return None

    def values(self) -> list[str]:
        seen: dict[str, None] = {}
        for lo, hi, width in self.ranges:
            for n in range(lo, hi + 1):
                seen.setdefault(f"{n:0{width}d}" if width else str(n))
        return list(seen)


def _parse_bracket(body: str, whole: str) -> _Bracket:
    if not body.strip():
        raise ConfigError(
            f"host range {_show(whole)}: empty brackets '[]' (write numbers inside, like gpu[1-4])"
        )
    ranges: list[tuple[int, int, int]] = []
    for raw in body.split(","):
        item = raw.strip()
        m = _RANGE_ITEM.fullmatch(item)
        if m is None:
            if "/" in item:
                raise ConfigError(
                    f"host range {_show(whole)}: steps like {_show(item)} are not supported "
                    "(list the numbers, like gpu[1,3,5])"
                )
            raise ConfigError(
                f"host range {_show(whole)}: {_show(item)} is not a number or a lo-hi range "
                "of numbers (write it like gpu[1-8,12])"
            )
        lo_text, hi_text = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ConfigError(
                f"host range {_show(whole)}: range {_show(item)} goes down "
                f"(write the smaller number first: {hi_text}-{lo_text})"
            )
        if (_padded(lo_text) or _padded(hi_text)) and len(lo_text) != len(hi_text):
            raise ConfigError(
                f"host range {_show(whole)}: range {_show(item)} has ends of different widths, "
                "which ClusterShell refuses too (write both ends with the same digits, like "
                "n[08-99,100] or n[008-100])"
            )
        ranges.append((lo, hi, len(lo_text) if _padded(lo_text) else 0))
    return _Bracket(tuple(ranges))


def _too_many(whole: str, size: int | None = None) -> ConfigError:
    count = f" expands to {size} names," if size is not None else " expands to"
    return ConfigError(
        f"host range {_show(whole)}{count} more than the limit of {MAX_EXPANSION} names "
        "(use a smaller range)"
    )


def _expand_one(part: str, whole: str) -> Iterator[str]:
    """The names of one operator-free pattern; its size is checked before any is generated."""
    if part.startswith("@"):
        raise ConfigError(
            f"host range {_show(whole)}: node groups like {_show(part)} are not supported "
            "(list the hosts, or write a range like gpu[1-8])"
        )
    outside = re.sub(r"\[[^\]]*\]", "", part)
    if "*" in outside or "?" in outside:
        raise ConfigError(
            f"host range {_show(whole)}: wildcards like {_show(part)} are not supported "
            "(ClusterShell matches them against the hosts of a group source, and there is none "
            "here: list the hosts, or write a range like gpu[1-8])"
        )
    pieces: list[str | _Bracket] = []
    pos = 0
    while pos < len(part):
        open_at = part.find("[", pos)
        close_at = part.find("]", pos)
        if close_at != -1 and (open_at == -1 or close_at < open_at):
            raise ConfigError(
                f"host range {_show(whole)}: ']' without a matching '[' "
                "(write ranges like gpu[1-4])"
            )
        if open_at == -1:
            pieces.append(part[pos:])
            break
        if open_at == pos and pieces and isinstance(pieces[-1], _Bracket):
            raise ConfigError(
                f"host range {_show(whole)}: two brackets next to each other, which ClusterShell "
                "refuses too (put text between them, like r[1-2]n[1-4])"
            )
        between = part[pos:open_at]
        if pieces and isinstance(pieces[-1], _Bracket) and _ALL_DIGITS.fullmatch(between):
            raise ConfigError(
                f"host range {_show(whole)}: only digits ({_show(between)}) between two "
                "brackets, which ClusterShell refuses too (put a letter between them, like "
                "r[1-2]n[1-4], or write the digits inside the brackets)"
            )
        if open_at > pos or not pieces:
            pieces.append(part[pos:open_at])
        close_at = part.find("]", open_at + 1)
        if close_at == -1:
            raise ConfigError(
                f"host range {_show(whole)}: '[' is never closed (add the ']', like gpu[1-4])"
            )
        body = part[open_at + 1 : close_at]
        if "[" in body:
            raise ConfigError(
                f"host range {_show(whole)}: brackets cannot be nested "
                "(write ranges like r[1-2]n[1-4])"
            )
        bracket = _parse_bracket(body, whole)
        crossing = bracket.crossing() if part[:open_at][-1:] in _DIGITS else None
        if crossing is not None:
            raise ConfigError(
                f"host range {_show(whole)}: a digit right before a range that goes from "
                f"{crossing - 1} to {crossing} is not supported (ClusterShell reads "
                f"x1[{crossing - 1}-{crossing}] as x1{crossing - 1} to x1{crossing}, every "
                "number between; split the range where the numbers grow a digit, or put the "
                "digit inside the brackets)"
            )
        pieces.append(bracket)
        pos = close_at + 1
    size = 1
    for piece in pieces:
        if isinstance(piece, _Bracket):
            size *= piece.count()
            if size > MAX_EXPANSION:
                raise _too_many(whole, None if len(pieces) > 2 else size)
    choices = [[p] if isinstance(p, str) else p.values() for p in pieces]
    return ("".join(combo) for combo in itertools.product(*choices))


def expand(pattern: str) -> list[str]:
    """Expand a host range pattern into the list of names it stands for (see module doc)."""
    if not pattern.strip():
        raise ConfigError("empty host pattern (give a name or a range like gpu[1-8,12])")
    # name -> when it joined: the set changes in place, each operator touching only the names
    # of its own operand (copying the set per operator made "n[1-100000]!x!x..." quadratic)
    result: dict[str, int] = {}
    joined = itertools.count()
    parts = _split_operators(pattern)
    for index, (operator, raw) in enumerate(parts):
        part = raw.strip()
        if not part:
            near = operator or parts[index + 1][0]
            what = "empty name between commas" if near == "," else f"nothing beside '{near}'"
            raise ConfigError(f"host range {_show(pattern)}: {what} (remove the extra '{near}')")
        names = dict.fromkeys(_expand_one(part, pattern))
        if operator in ("", ","):
            for name in names:
                if name not in result:
                    result[name] = next(joined)
        elif operator == "!":
            for name in names:
                result.pop(name, None)
        elif operator == "&":
            if len(result) <= len(names):
                result = {n: when for n, when in result.items() if n in names}
            else:  # keep the set's order, walking only the operand
                kept = sorted((result[n], n) for n in names if n in result)
                result = {n: when for when, n in kept}
        else:  # "^"
            for name in names:
                if name in result:
                    del result[name]
                else:
                    result[name] = next(joined)
        if len(result) > MAX_EXPANSION:
            raise _too_many(pattern)
    if not result:
        raise ConfigError(
            f"host range {_show(pattern)} leaves no host (check the '!', '&' or '^' parts)"
        )
    return list(result)


def _natural_key(text: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders digit runs numerically (``r2n`` before ``r10n``)."""
    key: list[tuple[int, int, str]] = []
    for chunk in re.split(r"([0-9]+)", text):
        if not chunk:
            continue
        if chunk.isascii() and chunk.isdigit():
            key.append((0, int(chunk), chunk))
        else:
            key.append((1, 0, chunk))
    return tuple(key)


def _fold_numbers(numbers: Iterable[str]) -> str:
    """``["1","2","3","5"]`` -> ``"1-3,5"``, as ClusterShell folds: numbers ordered by length
    then value; a run continues with the next value when it is written alike (a padded run only
    with numbers of its width, so ``08 .. 99, 100`` is ``08-99,100``)."""
    ordered = sorted(set(numbers), key=lambda s: (len(s), int(s)))
    runs: list[tuple[str, str]] = []
    first = last = ordered[0]
    for text in ordered[1:]:
        width = len(first) if _padded(first) else 0
        alike = len(text) == width if width else not _padded(text)
        if int(text) == int(last) + 1 and alike:
            last = text
            continue
        runs.append((first, last))
        first = last = text
    runs.append((first, last))
    return ",".join(a if a == b else f"{a}-{b}" for a, b in runs)


def fold(names: Iterable[str]) -> str:
    """Fold host names into a compact range string, for display.

    ``gpu1 gpu2 gpu3 gpu5`` -> ``gpu[1-3,5]``.  Names are grouped by the text before and after
    their *last* number (ASCII digits); a group of one name is shown as that name; names without
    digits are shown as they are.  Groups are joined with ``,`` and sorted by prefix (digit runs
    compared as numbers), then suffix, then number.  Duplicates are dropped.  Padding is kept:
    ``n08 n09 n10`` -> ``n[08-10]`` while ``n8 n9 n10`` -> ``n[8-10]``.
    """
    groups: dict[tuple[str, str], list[str]] = {}
    plain: set[str] = set()
    for name in names:
        m = _LAST_NUMBER.match(name)
        if m is None:
            plain.add(name)
            continue
        groups.setdefault((m.group(1), m.group(3)), []).append(m.group(2))

    entries: list[tuple[tuple[tuple[tuple[int, int, str], ...], str, int], str]] = []
    for name in plain:
        entries.append(((_natural_key(name), "", -1), name))
    for (prefix, suffix), numbers in groups.items():
        distinct = set(numbers)
        first = min(int(n) for n in distinct)
        if len(distinct) == 1:
            shown = f"{prefix}{next(iter(distinct))}{suffix}"
        else:
            shown = f"{prefix}[{_fold_numbers(distinct)}]{suffix}"
        entries.append(((_natural_key(prefix), suffix, first), shown))
    entries.sort()
    return ",".join(shown for _, shown in entries)
