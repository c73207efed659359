"""Host ranges like clush/pdsh: ``expand("gpu[1-8,12]")`` and its inverse ``fold``.

Syntax accepted by :func:`expand`:

* ``gpu[1-8,12]`` -> ``gpu1 .. gpu8, gpu12``: a bracket holds comma-separated numbers and
  ``lo-hi`` ranges (``lo <= hi``, decimal digits only).
* Zero padding is kept: the width of ``lo`` is kept when ``lo`` has a leading zero
  (``n[01-10]`` -> ``n01 .. n10``; ``n[1-10]`` -> ``n1 .. n10``).
* Several brackets give the cartesian product, leftmost bracket varying slowest
  (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``).
* Commas outside brackets separate patterns (``a,b[1-2]`` -> ``a b1 b2``); whitespace around
  each pattern is ignored.
* Everything outside brackets is literal text, so ``ben@gpu[1-2]:2222`` and
  ``machines/gpu[1-2].yaml`` work too.
* The result keeps the order of the pattern and drops repeated names (first one wins).
* At most :data:`MAX_EXPANSION` names; more is a :class:`ConfigError`, checked before anything
  is generated.

Anything malformed (``gpu[3-1]``, ``gpu[``, ``gpu[a-b]``, ``gpu[]``, an empty pattern) raises
:class:`ConfigError` with a one-line message.

:func:`fold` is the inverse used for display; ``expand(fold(names))`` gives back the same set of
names (without duplicates, in fold's sorted order).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

from ssh_scheduler.errors import ConfigError

__all__ = ["MAX_EXPANSION", "expand", "fold"]

MAX_EXPANSION = 100_000
"""Most names one pattern (all its comma-separated parts together) may expand to."""

_RANGE_ITEM = re.compile(r"(\d+)(?:-(\d+))?")
_LAST_NUMBER = re.compile(r"^(.*?)(\d+)(\D*)$", re.DOTALL)
_MAX_SHOWN = 60


def _show(text: str) -> str:
    """A pattern for an error message: quoted, control characters escaped, long ones cut."""
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return repr(text)


def _split_top_level(pattern: str) -> list[str]:
    """Split on commas that are not inside brackets; bracket balance is checked later."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(pattern):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
    parts.append(pattern[start:])
    return parts


def _parse_bracket(body: str, whole: str) -> list[str]:
    """``1-3,07`` -> the list of number strings it stands for (ranges stay lazy-free: small)."""
    if not body.strip():
        raise ConfigError(
            f"host range {_show(whole)}: empty brackets '[]' (write numbers inside, like gpu[1-4])"
        )
    items: list[tuple[int, int, int]] = []  # (lo, hi, width); width 0 = no padding
    for raw in body.split(","):
        item = raw.strip()
        m = _RANGE_ITEM.fullmatch(item)
        if m is None:
            raise ConfigError(
                f"host range {_show(whole)}: {_show(item)} is not a number or a lo-hi range "
                "of numbers (write it like gpu[1-8,12])"
            )
        lo_text, hi_text = m.group(1), m.group(2)
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if hi < lo:
            raise ConfigError(
                f"host range {_show(whole)}: range {_show(item)} goes down "
                f"(write the smaller number first: {hi_text}-{lo_text})"
            )
        width = len(lo_text) if len(lo_text) > 1 and lo_text.startswith("0") else 0
        items.append((lo, hi, width))
    total = sum(hi - lo + 1 for lo, hi, _ in items)
    if total > MAX_EXPANSION:
        raise ConfigError(
            f"host range {_show(whole)} expands to {total} names, more than the limit of "
            f"{MAX_EXPANSION} (use a smaller range)"
        )
    out: list[str] = []
    for lo, hi, width in items:
        out.extend(f"{n:0{width}d}" if width else str(n) for n in range(lo, hi + 1))
    return out


def _expand_one(part: str, whole: str) -> list[str]:
    """Expand one comma-free (at top level) pattern into its names."""
    pieces: list[list[str]] = []  # alternating literal / choices; literals are 1-element lists
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
            pieces.append([part[pos:]])
            break
        pieces.append([part[pos:open_at]])
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
        pieces.append(_parse_bracket(body, whole))
        pos = close_at + 1
    size = 1
    for choices in pieces:
        size *= len(choices)
    if size > MAX_EXPANSION:
        raise ConfigError(
            f"host range {_show(whole)} expands to {size} names, more than the limit of "
            f"{MAX_EXPANSION} (use a smaller range)"
        )
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand(pattern: str) -> list[str]:
    """Expand a host range pattern into the list of names it stands for (see module doc)."""
    if not pattern.strip():
        raise ConfigError("empty host pattern (give a name or a range like gpu[1-8,12])")
    names: list[str] = []
    seen: set[str] = set()
    for raw in _split_top_level(pattern):
        part = raw.strip()
        if not part:
            raise ConfigError(
                f"host range {_show(pattern)}: empty name between commas (remove the extra ',')"
            )
        for name in _expand_one(part, pattern):
            if name not in seen:
                seen.add(name)
                names.append(name)
                if len(names) > MAX_EXPANSION:
                    raise ConfigError(
                        f"host range {_show(pattern)} expands to more than the limit of "
                        f"{MAX_EXPANSION} names (use a smaller range)"
                    )
    return names


def _natural_key(text: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders digit runs numerically (``r2n`` before ``r10n``)."""
    key: list[tuple[int, int, str]] = []
    for chunk in re.split(r"(\d+)", text):
        if not chunk:
            continue
        if chunk.isdigit():
            key.append((0, int(chunk), chunk))
        else:
            key.append((1, 0, chunk))
    return tuple(key)


def _format_number(value: int, width: int) -> str:
    return f"{value:0{width}d}" if width else str(value)


def _fold_numbers(numbers: list[str]) -> str:
    """``["1","2","3","5"]`` -> ``"1-3,5"``; runs only join numbers written the same way."""
    ordered = sorted(set(numbers), key=lambda s: (int(s), len(s), s))
    runs: list[tuple[str, str]] = []  # (first text, last text)
    run_first = run_last = ordered[0]
    width = len(run_first) if len(run_first) > 1 and run_first.startswith("0") else 0
    for text in ordered[1:]:
        expected = _format_number(int(run_last) + 1, width)
        if text == expected:
            run_last = text
            continue
        runs.append((run_first, run_last))
        run_first = run_last = text
        width = len(text) if len(text) > 1 and text.startswith("0") else 0
    runs.append((run_first, run_last))
    return ",".join(first if first == last else f"{first}-{last}" for first, last in runs)


def fold(names: Iterable[str]) -> str:
    """Fold host names into a compact range string, for display.

    ``gpu1 gpu2 gpu3 gpu5`` -> ``gpu[1-3,5]``.  Names are grouped by the text before and after
    their *last* number; a group of one name is shown as that name; names without digits are
    shown as they are.  Groups are joined with ``,`` and sorted by prefix (digit runs compared as
    numbers), then suffix, then number.  Duplicates are dropped.  Padding is kept: ``n08 n09
    n10`` -> ``n[08-10]`` while ``n8 n9 n10`` -> ``n[8-10]``.
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
            shown = f"{prefix}[{_fold_numbers(numbers)}]{suffix}"
        entries.append(((_natural_key(prefix), suffix, first), shown))
    entries.sort()
    return ",".join(shown for _, shown in entries)
