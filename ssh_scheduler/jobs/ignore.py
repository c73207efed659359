"""gitignore patterns: the rules of ``.sshschedulerignore`` and of the secrets never sent.

The common subset of gitignore(5), matched against posix paths relative to the folder the
patterns belong to:

* blank lines and lines starting with ``#`` are skipped; ``\\#`` and ``\\!`` start a pattern
  with a literal ``#`` or ``!``; trailing spaces are dropped unless escaped (``\\ ``);
* ``!pattern`` re-includes what an earlier pattern excluded (the last matching line wins); as in
  git, nothing inside an excluded folder can be re-included, because the walk never enters it;
* ``pattern/`` matches folders only;
* a pattern with a ``/`` at its start or in its middle is anchored to the folder; one without
  matches a name at any depth;
* ``*`` matches anything but ``/``, ``?`` one character but ``/``, ``[a-z]`` / ``[!a-z]`` /
  ``[^a-z]`` a class (never ``/``), ``\\x`` the character ``x``;
* ``**/`` at the start matches in every folder, ``/**`` at the end everything inside, ``/**/``
  zero or more folders; any other ``**`` is an ordinary ``*``.

Not supported (treated literally): POSIX classes like ``[[:alpha:]]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["IgnoreRule", "IgnoreRules", "compile_pattern"]


@dataclass(frozen=True, slots=True)
class IgnoreRule:
    pattern: str
    """The line as written, for messages."""
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _class(segment: str, start: int) -> tuple[str, int] | None:
    """The regex of a ``[...]`` class starting at ``segment[start]``, and the index after it;
    None when the bracket is never closed (then ``[`` is a literal)."""
    i = start + 1
    negate = i < len(segment) and segment[i] in "!^"
    if negate:
        i += 1
    body: list[str] = []
    first = True
    while i < len(segment):
        ch = segment[i]
        if ch == "]" and not first:
            inner = "".join(body)
            # A class never matches '/', negated or not (git matches with WM_PATHNAME).
            return (f"(?!/)[^{inner}]" if negate else f"[{inner}]"), i + 1
        if ch == "\\" and i + 1 < len(segment):
            i += 1
            ch = segment[i]
            body.append("\\" + ch if not ch.isalnum() else ch)
        elif ch == "-":
            body.append("-")  # a range, or a literal '-' at either end (the same in a regex)
        else:
            body.append("\\" + ch if ch in "\\]^[" else ch)
        first = False
        i += 1
    return None


def _segment(segment: str) -> str:
    """The regex of one path segment (no '/')."""
    out: list[str] = []
    i = 0
    while i < len(segment):
        ch = segment[i]
        if ch == "*":
            while i + 1 < len(segment) and segment[i + 1] == "*":
                i += 1  # '**' inside a segment is a plain '*'
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            found = _class(segment, i)
            if found is not None:
                regex, i = found
                out.append(regex)
                continue
            out.append(re.escape(ch))
        elif ch == "\\" and i + 1 < len(segment):
            i += 1
            out.append(re.escape(segment[i]))
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


def _strip_trailing_spaces(line: str) -> str:
    while line.endswith(" ") and not line.endswith("\\ "):
        line = line[:-1]
    return line


def compile_pattern(line: str) -> IgnoreRule | None:
    """One gitignore line as a rule; None for a blank line or a comment."""
    text = _strip_trailing_spaces(line.rstrip("\r\n"))
    if not text or text.startswith("#"):
        return None
    negate = text.startswith("!")
    body = text[1:] if negate else text
    dir_only = body.endswith("/") and not body.endswith("\\/")
    if dir_only:
        body = body[:-1]
    if not body:
        return None
    anchored = "/" in body
    body = body.removeprefix("/")
    parts = body.split("/")
    regex: list[str] = [] if anchored else ["(?:.*/)?"]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            regex.append(".*" if last else "(?:.*/)?")
            continue
        regex.append(_segment(part))
        if not last:
            regex.append("/")
    return IgnoreRule(text, re.compile("".join(regex), re.DOTALL), negate, dir_only)


def _union(rules: list[IgnoreRule]) -> re.Pattern[str] | None:
    if not rules:
        return None
    return re.compile("|".join(f"(?:{r.regex.pattern})" for r in rules), re.DOTALL)


class IgnoreRules:
    """An ordered list of patterns; :meth:`ignored` applies them as git does."""

    def __init__(self, lines: Iterable[str] = ()) -> None:
        rules = (compile_pattern(line) for line in lines)
        self.rules: tuple[IgnoreRule, ...] = tuple(r for r in rules if r is not None)
        # Most paths match no rule: one combined regex per kind says so in a single match,
        # instead of one match per rule (a 10,000-file walk times 30 patterns).
        self._any = {
            is_dir: _union([r for r in self.rules if is_dir or not r.dir_only])
            for is_dir in (False, True)
        }

    def __bool__(self) -> bool:
        return bool(self.rules)

    def match(self, rel: str, is_dir: bool) -> IgnoreRule | None:
        """The last rule matching ``rel`` (a posix path relative to the rules' folder)."""
        quick = self._any[is_dir]
        if quick is None or quick.fullmatch(rel) is None:
            return None
        for rule in reversed(self.rules):
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.fullmatch(rel):
                return rule
        return None

    def ignored(self, rel: str, is_dir: bool) -> bool:
        rule = self.match(rel, is_dir)
        return rule is not None and not rule.negate
