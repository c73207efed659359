"""glibc's ``fnmatch(pattern, name, FNM_PERIOD)`` for one file name: how ssh's ``Include``
globs (``glob(3)``) match the entries of a folder.

A translation to a regular expression cannot be faithful here: inside ``[...]`` glibc reads the
items one by one for the character at hand, and the end of the set it finds depends on which
item matched.  A character that matches none reads the set to its ``]`` item by item (a class
name that is not one makes ``[`` an ordinary character; an unknown class, a ``[.xy.]`` or an
escape cut off by the end fails the match there).  A character that matches an item skips the
rest another way, in which ``[=x`` without its ``=]``, or no ``]`` at all, fails the match.  So
this walks the pattern as glibc does, with the same two readings.  In the C locale's classes,
and with byte order for ranges, as ssh (which sets no ``LC_COLLATE``) runs it.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

__all__ = ["fnmatch"]

END = "\0"
"""The pattern's end, as C sees it (neither a file name nor an ssh config line holds a NUL)."""
CLASS_NAME_LIMIT = 256
"""``CHAR_CLASS_MAX_LENGTH``: a longer ``[:name:]`` fails the match."""


def _ascii_or(test: Callable[[str], bool], ascii_test: Callable[[str], bool]) -> Callable[[str], bool]:
    return lambda ch: ascii_test(ch) if ch.isascii() else test(ch)


CLASSES: dict[str, Callable[[str], bool]] = {
    "alnum": _ascii_or(str.isalnum, lambda c: c.isalnum()),
    "alpha": _ascii_or(str.isalpha, lambda c: c.isalpha()),
    "blank": _ascii_or(lambda c: unicodedata.category(c) == "Zs", lambda c: c in " \t"),
    "cntrl": _ascii_or(lambda c: unicodedata.category(c) == "Cc", lambda c: ord(c) < 32 or ord(c) == 127),
    "digit": lambda c: "0" <= c <= "9",
    "graph": _ascii_or(lambda c: c.isprintable() and not c.isspace(), lambda c: "!" <= c <= "~"),
    "lower": _ascii_or(str.islower, lambda c: "a" <= c <= "z"),
    "print": _ascii_or(str.isprintable, lambda c: " " <= c <= "~"),
    "punct": _ascii_or(
        lambda c: c.isprintable() and not c.isalnum() and not c.isspace(),
        lambda c: "!" <= c <= "~" and not c.isalnum(),
    ),
    "space": _ascii_or(str.isspace, lambda c: c in " \t\n\r\f\v"),
    "upper": _ascii_or(str.isupper, lambda c: "A" <= c <= "Z"),
    "xdigit": lambda c: c in "0123456789abcdefABCDEF",
}
"""What each ``[:class:]`` holds: the C locale's for ASCII (each class's characters there)."""


def fnmatch(pattern: str, name: str) -> bool:
    """Whether ``name`` (one folder entry) matches ``pattern`` (one component of a glob)."""
    return _match(pattern + END, 0, name, 0, True)


def _match(pat: str, p: int, name: str, n: int, no_leading_period: bool) -> bool:
    while (c := pat[p]) != END:
        p += 1
        if c == "?":
            if n == len(name) or (name[n] == "." and no_leading_period):
                return False
        elif c == "\\":
            c = pat[p]
            p += 1
            if c == END:  # a trailing backslash loses
                return False
            if n == len(name) or name[n] != c:
                return False
        elif c == "*":
            return _star(pat, p, name, n, no_leading_period)
        elif c == "[":
            if n == len(name) or (name[n] == "." and no_leading_period):
                return False
            after = _bracket(pat, p, name[n])
            if after is None:
                return False
            if after < 0:  # an unterminated '[' is the character itself
                if name[n] != "[":
                    return False
            else:
                p = after
        elif n == len(name) or name[n] != c:
            return False
        no_leading_period = False
        n += 1
    return n == len(name)


def _star(pat: str, p: int, name: str, n: int, no_leading_period: bool) -> bool:
    if n < len(name) and name[n] == "." and no_leading_period:
        return False
    c = pat[p]
    while c in "?*":  # a run of them: each '?' one character
        p += 1
        if c == "?":
            if n == len(name):
                return False
            n += 1
        c = pat[p]
    if c == END:
        return True
    first = pat[p + 1] if c == "\\" else c
    return any(
        (c == "[" or name[k] == first) and _match(pat, p, name, k, no_leading_period and k == n)
        for k in range(n, len(name))
    )


def _bracket(pat: str, p: int, ch: str) -> int | None:
    """``[...]`` from ``p`` (after its ``[``) for the character ``ch``: the index after its
    ``]`` when it matches, None when not (or when glibc fails the match there), -1 when the
    set has no end and no item took ``ch`` (then the ``[`` is a character)."""
    negated = pat[p] == "!" or pat[p] == "^"
    p += negated
    c = pat[p]
    p += 1
    while True:
        if c == "\\":
            if pat[p] == END:
                return None
            c = pat[p]
            p += 1
            item = _single(pat, p, c, ch)
        elif c == "[" and pat[p] == ":":
            start, length, named = p, 0, True
            while True:
                if length == CLASS_NAME_LIMIT:
                    return None
                p += 1
                c = pat[p]
                if c == ":" and pat[p + 1] == "]":
                    p += 2
                    break
                if not "a" <= c < "z":  # no class name: this '[' is a character
                    p, named = start, False
                    item = _single(pat, p, "[", ch)
                    break
                length += 1
            if named:
                test = CLASSES.get(pat[start + 1 : p - 2])
                if test is None:  # no such class: no match
                    return None
                if test(ch):
                    return _skip(pat, p, negated)
                c = pat[p]
                p += 1
                if c == "]":
                    break
                continue
        elif c == "[" and pat[p] == "=":
            if pat[p + 1] != END and pat[p + 2] == "=" and pat[p + 3] == "]":
                if ch == pat[p + 1]:
                    return _skip(pat, p + 4, negated)
                c = pat[p + 4]
                p += 5
                if c == "]":
                    break
                continue
            item = _single(pat, p, "[", ch)
        elif c == END:  # unterminated: the '[' is a character
            return -1
        elif c == "[" and pat[p] == ".":
            close = pat.find(".]", p + 1)
            if close == -1 or close - p - 1 != 1:  # no end, or not one character
                return None
            symbol, p = pat[p + 1], close + 2
            ranged = pat[p] == "-" and pat[p + 1] != END
            if not ranged and ch == symbol:
                return _skip(pat, p, negated)
            item = (symbol, p)
        else:
            item = _single(pat, p, c, ch)
        if isinstance(item, int):  # matched
            return _skip(pat, item, negated)
        low, p = item
        c = pat[p]
        p += 1
        if c == "-" and pat[p] != "]":
            high = pat[p]
            p += 1
            if high == "[" and pat[p] == ".":
                close = pat.find(".]", p + 1)
                if close == -1 or close - p - 1 != 1:
                    return None
                high, p = pat[p + 1], close + 2
            else:
                if high == "\\":
                    high = pat[p]
                    p += 1
                if high == END:
                    return None
            if low <= ch <= high:
                return _skip(pat, p, negated)
            c = pat[p]
            p += 1
        if c == "]":
            break
    return p if negated else None


def _single(pat: str, p: int, c: str, ch: str) -> int | tuple[str, int]:
    """One character ``c`` read, ``p`` after it: the index to skip from when it is ``ch`` (and
    no range starts here), else ``(c, p)`` for a range to consider."""
    ranged = pat[p] == "-" and pat[p + 1] != END and pat[p + 1] != "]"
    if not ranged and c == ch:
        return p
    return c, p


def _skip(pat: str, p: int, negated: bool) -> int | None:
    """The rest of a set whose item matched, read as glibc skips it: the index after its ``]``
    (None when negated: a matched character is excluded), None when glibc fails there."""
    while (c := pat[p]) != "]":
        p += 1
        if c == END:
            return None
        if c == "\\":
            if pat[p] == END:
                return None
            p += 1
        elif c == "[" and pat[p] == ":":
            start, length = p, 0
            while True:
                p += 1
                length += 1
                if length == CLASS_NAME_LIMIT:
                    return None
                if pat[p] == ":" and pat[p + 1] == "]":
                    p += 2
                    break
                if not "a" <= pat[p] < "z":  # no class name: go on from its ':'
                    p = start
                    break
        elif c == "[" and pat[p] == "=":
            if pat[p + 1] == END or pat[p + 2] != "=" or pat[p + 3] != "]":
                return None
            p += 4
        elif c == "[" and pat[p] == ".":
            while True:
                p += 1
                if pat[p] == END:
                    return None
                if pat[p] == "." and pat[p + 1] == "]":
                    break
            p += 2
    return None if negated else p + 1
