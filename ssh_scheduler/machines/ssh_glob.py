"""One component of an ``Include`` pattern as OpenSSH's own ``glob(3)`` reads and matches it.

ssh does not call the C library's glob: OpenSSH builds its bundled copy of OpenBSD's
(``openbsd-compat/glob.c``, as ``nm -D`` on ssh shows no glob import), which differs from glibc's
where users can meet it: ``[^a]`` is the set of ``^`` and ``a`` (only ``!`` negates), there is no
``[=a=]`` or ``[.a.]``, an unknown ``[:class:]`` makes the whole pattern match nothing, a ``[``
with no ``]`` after it is itself, and a name is compared byte by byte (``?`` is one byte of a
UTF-8 name).  A backslash protects the next character (a trailing one is itself), and a name
that starts with a dot is matched only by a pattern that starts with one.  Its faults are kept
too: ``[:alnum:]`` ends the pattern after its set (:attr:`Component.last`), and a set whose
``]`` a class took is read past the pattern's end (ssh crashes: :class:`UnendedSet`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Component", "UnendedSet", "compile_component", "matches", "unended_set"]

CLASSES: dict[str, Callable[[str], bool]] = {
    "alnum": lambda c: c.isascii() and c.isalnum(),
    "alpha": lambda c: c.isascii() and c.isalpha(),
    "blank": lambda c: c in " \t",
    "cntrl": lambda c: ord(c) < 32 or ord(c) == 127,
    "digit": lambda c: "0" <= c <= "9",
    "graph": lambda c: "!" <= c <= "~",
    "lower": lambda c: "a" <= c <= "z",
    "print": lambda c: " " <= c <= "~",
    "punct": lambda c: "!" <= c <= "~" and not c.isalnum(),
    "space": lambda c: c in " \t\n\r\f\v",
    "upper": lambda c: "A" <= c <= "Z",
    "xdigit": lambda c: c in "0123456789abcdefABCDEF",
}
"""``cclasses``: the C library's ``is*`` of ssh's locale, which for a UTF-8 one holds no byte
above 127."""

# A token: ("c", byte) a character, ("*",), ("?",), or ("[", negated, items) where an item is
# ("c", byte), ("-", low, high) or (":", class name).
Token = tuple[Any, ...]


class UnendedSet(ValueError):
    """A ``[...]`` whose ``]`` a ``[:class:]`` took: ssh reads on past the pattern's end (and
    crashes, SIGSEGV, in OpenSSH 9.2)."""


def unended_set(pattern: str) -> bool:
    """Whether ``pattern`` holds a set ssh reads past its end.  OpenBSD's glob parses the whole
    pattern before it splits it at '/', so a set goes on across a '/' (to a ']' in a later
    component, or past the end: the crash), and the whole pattern is read here as one.  (What
    such a set then matches is not modelled: a component whose set has no ']' in it matches
    nothing here.)"""
    try:
        compile_component(pattern)
    except UnendedSet:
        return True
    return False


@dataclass(frozen=True)
class Component:
    """A component that has wildcards (``tokens``), or the literal name of one that has none."""

    literal: str | None
    tokens: tuple[Token, ...] = ()
    dot_first: bool = False
    """It starts with a (literal) dot: it may match a name that starts with one."""
    last: bool = False
    """The pattern ends with this component's first set that holds ``[:alnum:]``: the class is
    number 0 in OpenBSD's table, stored as the 0 that ends the pattern, so what follows the set
    (in this component and after it) is never read, though the set's own items are."""


def _bytes(text: str) -> str:
    """``text`` as its bytes, one character each (how OpenBSD's glob sees a name)."""
    return text.encode("utf-8", "surrogateescape").decode("latin-1")


def _text(data: str) -> str:
    return data.encode("latin-1").decode("utf-8", "surrogateescape")


def compile_component(part: str) -> Component | None:
    """``glob0`` for one component; None when the pattern can match nothing (an unknown class)."""
    quoted: list[tuple[str, bool]] = []  # (byte, protected by a backslash)
    data = _bytes(part)
    i = 0
    while i < len(data):
        if data[i] == "\\":
            if i + 1 < len(data):
                quoted.append((data[i + 1], True))
                i += 2
                continue
            quoted.append(("\\", True))  # a trailing backslash is itself
            i += 1
            continue
        quoted.append((data[i], False))
        i += 1
    tokens: list[Token] = []
    magic = False
    i = 0
    while i < len(quoted):
        ch, protected = quoted[i]
        i += 1
        if protected:
            tokens.append(("c", ch))
        elif ch == "*":
            magic = True
            if not tokens or tokens[-1] != ("*",):
                tokens.append(("*",))
        elif ch == "?":
            magic = True
            tokens.append(("?",))
        elif ch == "[":
            parsed = _set(quoted, i)
            if parsed is None:
                return None
            token, i = parsed
            if token is None:  # no ']' after it: the '[' is a character
                tokens.append(("c", "["))
                continue
            tokens.append(token)
            magic = True
            if (":", "alnum") in token[2]:
                return Component(None, tuple(tokens), tokens[0] == ("c", "."), last=True)
        else:
            tokens.append(("c", ch))
    if not magic:
        return Component(_text("".join(t[1] for t in tokens)))
    return Component(None, tuple(tokens), tokens[0] == ("c", "."))


def _set(quoted: list[tuple[str, bool]], i: int) -> tuple[Token | None, int] | None:
    """A ``[...]`` from ``i`` (after its ``[``): its token and the index after its ``]``; no
    token when no ``]`` follows (then the ``[`` is a character, and ``i`` is where to go on);
    None for an unknown class."""
    negated = i < len(quoted) and quoted[i] == ("!", False)
    j = i + negated
    if j >= len(quoted) or ("]", False) not in quoted[j + 1 :]:
        return None, i
    items: list[Token] = []

    def at(k: int) -> tuple[str, bool]:
        if k >= len(quoted):
            raise UnendedSet(f"a set of {len(quoted)} characters read past its end")
        return quoted[k]

    c = quoted[j]
    j += 1
    while True:
        if c == ("[", False) and j < len(quoted) and quoted[j] == (":", False):
            status = 1
            while True:
                status, name, after = _class(quoted, j)
                if status:
                    break
                items.append((":", name))
                c, j = at(after), after + 1
                if not (c == ("[", False) and j < len(quoted) and quoted[j] == (":", False)):
                    break
            if status == -1:
                return None
            if c == ("]", False):
                break
        if j + 1 < len(quoted) and quoted[j] == ("-", False) and quoted[j + 1] != ("]", False):
            items.append(("-", c[0], quoted[j + 1][0]))
            j += 2
        else:
            items.append(("c", c[0]))
        c = at(j)
        j += 1
        if c == ("]", False):
            break
    return ("[", negated, tuple(items)), j


def _class(quoted: list[tuple[str, bool]], j: int) -> tuple[int, str, int]:
    """``g_charclass`` at ``j`` (a ``:`` after ``[``): (0, name, index after its ``:]``), (1, "",
    j) when it is no class (a ``[`` then), (-1, "", j) for a name that is not a class."""
    start = j + 1
    colon = next((k for k in range(start, len(quoted)) if quoted[k] == (":", False)), -1)
    if colon == -1 or colon + 1 >= len(quoted) or quoted[colon + 1] != ("]", False):
        return 1, "", j
    name = quoted[start:colon]
    text = "".join(ch for ch, protected in name)
    if any(protected for _, protected in name) or text not in CLASSES:
        return -1, "", j
    return 0, text, colon + 2


def matches(component: Component, name: str) -> bool:
    """Whether a folder entry's ``name`` matches a component that has wildcards."""
    if name.startswith(".") and not component.dot_first:
        return False
    return _match(component.tokens, 0, _bytes(name), 0)


def _match(tokens: tuple[Token, ...], t: int, name: str, n: int) -> bool:
    while t < len(tokens):
        token = tokens[t]
        t += 1
        if token[0] == "*":
            if t == len(tokens):
                return True
            return any(_match(tokens, t, name, k) for k in range(n, len(name) + 1))
        if n == len(name):
            return False
        ch = name[n]
        n += 1
        if token[0] == "c" and ch != token[1]:
            return False
        if token[0] == "[" and _in_set(token[2], ch) == token[1]:
            return False
    return n == len(name)


def _in_set(items: tuple[Token, ...], ch: str) -> bool:
    for item in items:
        if item[0] == ":" and CLASSES[item[1]](ch):
            return True
        if item[0] == "-" and item[1] <= ch <= item[2]:
            return True
        if item[0] == "c" and item[1] == ch:
            return True
    return False
