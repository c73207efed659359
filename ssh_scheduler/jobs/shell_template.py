"""Sweep templates: where each ``{name}`` stands in the shell's reading, and how a value is
written there so that it is one literal piece of text, whatever quoting surrounds it (pure).

A value cannot simply be ``shlex.quote``d wherever it stands: inside ``"..."`` the quotes of
``'$(id)'`` are literal and the ``$(id)`` runs; inside ``'...'`` the value's own quote closes the
template's.  So the template is read as bash reads it (quotes, ``$(...)``, comments, here-documents,
``case`` patterns, ``[[ ]]``), and each placeholder is filled for the place it stands:

* in a plain word: the value as one shell word (``shlex.quote``; bare when it is made of
  ``A-Za-z0-9_.,/:+@-`` only, is no reserved word, and no digits just before a redirection);
* inside ``'...'``: as it is, or, holding a ``'``, by closing the quote, one quoted word, reopening;
* inside ``"..."``: as it is, or, holding ``$ ` " \\``, by closing, one quoted word, reopening;
* inside a comment: as it is, newlines made spaces (a newline would end the comment).

Where no writing can keep a value literal, the template is refused when the sweep is read, with
the place and the way out: inside backquotes, ``$((...))`` / ``((...))`` / ``$[...]`` and the
arithmetic operands of ``[[ ... -eq ... ]]`` or an array subscript (bash evaluates those as code
even quoted), ``${...}``, ``$'...'``, a here-document's body or end word, right after a backslash,
after a construct bash and ``sh`` read differently, or in a template whose quote is never closed.

What a command does with its arguments is its own affair: a value handed to ``eval``,
``bash -c``, ``ssh`` or ``python -c`` is code again there.

Placeholders are ``{name}`` for any name the seed runner's ``str.format`` can address, ``{{name}}``
a literal ``{name}``; ``${VAR}`` and braces around anything that is not a known name or a plain
identifier (JSON, ``awk '{print $1}'``) are left alone.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["Slot", "TemplateError", "check_template", "placeholders", "render"]

WORD, SINGLE, DOUBLE, COMMENT = "word", "single", "double", "comment"

_BRACES = re.compile(r"\{\{([^{}]*)\}\}|(?<!\$)\{([^{}]*)\}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_INERT = re.compile(r"[A-Za-z0-9_.,/:+@-]+\Z")
_SUBSCRIPT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\[[^\]]*\Z")
RESERVED = frozenset({
    "if", "then", "else", "elif", "fi", "case", "esac", "for", "select", "while", "until", "do", "done",
    "in", "function", "time", "coproc",
})  # fmt: skip
_ARITH_TESTS = frozenset({"-eq", "-ne", "-lt", "-le", "-gt", "-ge"})
_LEADERS = frozenset({"then", "do", "else", "elif", "if", "while", "until", "!", "{", "time"})
"""Words after which the next word is again a command's first."""
_BREAKS = frozenset(" \t\n;&|<>()")


class TemplateError(ValueError):
    """A placeholder stands where no writing of a value can keep it literal."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One placeholder: its name, where it is in the template, where it stands for the shell."""

    name: str
    start: int
    context: str
    redirect_follows: bool = False


def _where(template: str, offset: int) -> str:
    line = template.count("\n", 0, offset) + 1
    column = offset - (template.rfind("\n", 0, offset) + 1) + 1
    return f"line {line}, column {column}" if "\n" in template else f"column {column}"


def _is_name(text: str, names: Collection[str]) -> bool:
    return text in names or _IDENTIFIER.match(text) is not None


def _pieces(template: str, names: Collection[str]) -> list[str | tuple[str, int]]:
    """Literal text (``{{name}}`` already ``{name}``) and ``(name, offset)`` placeholders, in order."""
    pieces: list[str | tuple[str, int]] = []
    last = 0
    for match in _BRACES.finditer(template):
        escaped, name = match.groups()
        if escaped is not None and _is_name(escaped, names):
            pieces.append(template[last : match.start()] + "{" + escaped + "}")
        elif name is not None and _is_name(name, names):
            pieces.append(template[last : match.start()])
            pieces.append((name, match.start()))
        else:
            pieces.append(template[last : match.end()])
        last = match.end()
    pieces.append(template[last:])
    merged: list[str | tuple[str, int]] = []
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        elif piece != "":
            merged.append(piece)
    return merged


def placeholders(template: str, names: Collection[str] = ()) -> list[str]:
    """The names a template refers to, in order of first use: plain identifiers, and any of
    ``names`` (the sweep's parameters, ``early-stop`` say)."""
    return list(dict.fromkeys(p[0] for p in _pieces(template, names) if isinstance(p, tuple)))


@dataclass(slots=True)
class _Frame:
    kind: str  # cmd, sq, dq, ansi, bq, arith, param, comment
    opened: int  # offset in the rendered literal stream, for "never closed"
    closer: str = ""  # cmd: ")" inside $( or <(; arith: "))" or "]"
    word: str = ""
    word_has_slot: bool = False
    depth: int = 0  # parentheses (cmd, arith) or braces (param)
    cases: int = 0  # case ... esac open here: a ')' ends a pattern, not this $(...)
    at_start: bool = True  # the next word is a command's first (where 'case' is a keyword)
    test: list[Slot] | None = None  # inside [[ ]]: the slots seen there
    test_arith: bool = False


_WHY = {
    "bq": "is inside backquotes (`...`), where no quoting of a value holds; use $(...) instead",
    "arith": "is inside an arithmetic expression ($((...)), ((...)), $[...]), which the shell evaluates as "
    "code even quoted; pass the value as an argument or through a variable instead",
    "param": "is inside a ${...} expansion; put it outside the braces",
    "ansi": "is inside a $'...' string; write '...' or \"...\" around it instead",
}


class _Reader:
    """Reads a template's literal text as bash does, told where each placeholder comes."""

    def __init__(self, template: str) -> None:
        self.template = template
        self.stack = [_Frame("cmd", 0)]
        self.slots: list[Slot] = []
        self.heredocs: list[tuple[str, bool]] = []  # (end word, tabs stripped) waiting for a newline
        self.body: tuple[str, bool, str] | None = None  # the here-document being read, its line so far
        self.divergent: str = ""  # why bash and sh read what follows differently
        self.divergent_at_newline: str = ""

    def fail(self, offset: int, name: str, why: str) -> TemplateError:
        return TemplateError(f"{{{name}}} at {_where(self.template, offset)} {why}")

    # --- placeholders --------------------------------------------------------------------------

    def slot(self, name: str, offset: int, after: str, before: str) -> None:
        fail = functools.partial(self.fail, offset, name)
        if self.body is not None:
            raise fail("is inside a here-document, where no quoting applies; pass it as an argument or write it to a file first")
        if self.divergent:
            raise fail(f"follows {self.divergent}, which bash and sh read differently; write that another way")
        for frame in self.stack:
            if frame.kind in _WHY:
                raise fail(_WHY[frame.kind])
        if after.endswith("\\") and self.stack[-1].kind in ("cmd", "dq") and _escaping(after):
            raise fail("follows a backslash, which would take the first character of its value")
        kind = {"cmd": WORD, "sq": SINGLE, "dq": DOUBLE, "comment": COMMENT}[self.stack[-1].kind]
        slot = Slot(name, offset, kind, before[:1] in ("<", ">"))
        commands = [f for f in self.stack if f.kind == "cmd"]
        if self.heredocs and commands[-1].word == "<<":
            raise fail("is the end word of a here-document; write the word itself")
        # A value inside $(...) comes back as that command's output: where an enclosing command
        # evaluates a word as arithmetic, the output is evaluated too.
        for frame in commands:
            if _SUBSCRIPT.match(frame.word):
                raise fail("is inside an array subscript, which bash evaluates as arithmetic even quoted")
            if frame.test is not None:
                if frame.test_arith:
                    raise fail(_ARITH_TEST)
                frame.test.append(slot)
        commands[-1].word_has_slot = True
        self.slots.append(slot)

    # --- literal text --------------------------------------------------------------------------

    def text(self, text: str, base: int) -> None:
        i = 0
        while i < len(text):
            i = self._step(text, i, base)

    def _step(self, text: str, i: int, base: int) -> int:
        c = text[i]
        if self.body is not None:
            return self._heredoc_body(text, i)
        frame = self.stack[-1]
        rest = text[i + 1 :]
        if frame.kind == "comment":
            if c == "\n":
                self.stack.pop()
                return i  # the newline is the command's
            return i + 1
        if frame.kind == "sq":
            if c == "'":
                self.stack.pop()
            return i + 1
        if c == "\\" and frame.kind != "sq":
            if frame.kind == "ansi" and rest[:1] == "'":
                self.divergent = "a $'...' string holding \\'"
            if frame.kind == "cmd" and rest[:1] != "\n":
                frame.word += c + rest[:1]
            return i + 2
        if frame.kind == "ansi":
            if c == "'":
                self.stack.pop()
            return i + 1
        if frame.kind == "bq":
            if c == "`":
                self.stack.pop()
            return i + 1
        if c == "$" and self._dollar(rest, base + i):
            return i + (3 if rest[:2] == "((" else 2)
        if frame.kind == "dq":
            if c == '"':
                self.stack.pop()
            elif c == "`":
                self.stack.append(_Frame("bq", base + i))
            return i + 1
        if c in "'\"`":
            self.stack.append(_Frame({"'": "sq", '"': "dq", "`": "bq"}[c], base + i))
            if frame.kind == "cmd":
                frame.word += c
            return i + 1
        if frame.kind == "param":
            if c == "{":
                frame.depth += 1
            elif c == "}":
                if frame.depth == 0:
                    self.stack.pop()
                else:
                    frame.depth -= 1
            return i + 1
        if frame.kind == "arith":
            return self._arith(frame, c, rest, i)
        return self._command(frame, c, rest, i, base)

    def _dollar(self, rest: str, offset: int) -> bool:
        """``$`` opening something (pushed); False for a plain ``$``."""
        frame = self.stack[-1]
        if frame.kind == "cmd" and rest[:1] == "'":
            self.stack.append(_Frame("ansi", offset))
        elif frame.kind == "cmd" and rest[:1] == '"':
            self.stack.append(_Frame("dq", offset))
        elif rest[:2] == "((":
            self.stack.append(_Frame("arith", offset, "))"))
        elif rest[:1] == "(":
            self.stack.append(_Frame("cmd", offset, ")"))
        elif rest[:1] == "[":
            self.stack.append(_Frame("arith", offset, "]"))
        elif rest[:1] == "{":
            self.stack.append(_Frame("param", offset))
        else:
            return False
        if frame.kind == "cmd":
            frame.word += "$"
        return True

    def _arith(self, frame: _Frame, c: str, rest: str, i: int) -> int:
        if c == "(":
            frame.depth += 1
        elif c == ")" and frame.depth > 0:
            frame.depth -= 1
        elif c == ")" and frame.closer == "))":
            self.stack.pop()
            return i + (2 if rest[:1] == ")" else 1)
        elif c == "]" and frame.closer == "]":
            self.stack.pop()
        return i + 1

    def _command(self, frame: _Frame, c: str, rest: str, i: int, base: int) -> int:
        if c == "#" and not frame.word and not frame.word_has_slot:
            self.stack.append(_Frame("comment", base + i))
            return i + 1
        if c in "<>" and rest[:1] == "(":  # process substitution
            self._end_word(frame)
            self.stack.append(_Frame("cmd", base + i, ")"))
            return i + 2
        if c == "(" and not frame.word and not frame.word_has_slot and rest[:1] == "(":
            self.stack.append(_Frame("arith", base + i, "))"))
            return i + 2
        if c == "<" and rest[:1] == "<":
            self._end_word(frame)
            if rest[1:2] == "<":
                self.divergent_at_newline = "a <<< here-string on an earlier line"
                return i + 3
            strip = rest[1:2] == "-"
            end = i + (3 if strip else 2)
            delimiter, after = _delimiter(rest[(2 if strip else 1) :])
            if delimiter is None:  # the word runs into a placeholder: slot() refuses it
                frame.word = "<<"
                self.heredocs.append(("", strip))
                return len(rest) + i + 1
            self.heredocs.append((delimiter, strip))
            return end + after
        if c in _BREAKS:
            self._end_word(frame)
            if c in ";&|()\n":
                frame.at_start = True
            if c == "(":
                frame.depth += 1
            elif c == ")":
                if frame.depth > 0:
                    frame.depth -= 1
                elif frame.cases == 0 and frame.closer == ")":
                    self.stack.pop()
            elif c == "\n":
                self._newline()
            return i + 1
        frame.word += c
        return i + 1

    def _end_word(self, frame: _Frame) -> None:
        word, frame.word = frame.word, ""
        had_slot, frame.word_has_slot = frame.word_has_slot, False
        if not word and not had_slot:
            return
        at_start, frame.at_start = frame.at_start, not had_slot and word in _LEADERS
        if had_slot:
            return
        if word == "case" and at_start:
            frame.cases += 1
        elif word == "esac" and at_start and frame.cases:
            frame.cases -= 1
        elif word == "[[":
            frame.test, frame.test_arith = [], False
        elif word == "]]":
            frame.test = None
        elif frame.test is not None and word in _ARITH_TESTS:
            frame.test_arith = True
            if frame.test:
                first = frame.test[0]
                raise self.fail(first.start, first.name, _ARITH_TEST)

    def _newline(self) -> None:
        if self.divergent_at_newline:
            self.divergent = self.divergent_at_newline
        if self.heredocs:
            delimiter, strip = self.heredocs.pop(0)
            self.body = (delimiter, strip, "")

    def _heredoc_body(self, text: str, i: int) -> int:
        assert self.body is not None
        delimiter, strip, line = self.body
        c = text[i]
        if c != "\n":
            self.body = (delimiter, strip, line + c)
            return i + 1
        if (line.lstrip("\t") if strip else line) == delimiter:
            self.body = None
            if self.heredocs:
                self._newline()
        else:
            self.body = (delimiter, strip, "")
        return i + 1

    def finish(self) -> None:
        open_frames = [f for f in self.stack[1:] if f.kind != "comment"]
        if open_frames and self.slots:
            frame = open_frames[-1]
            what = {"sq": "'", "dq": '"', "ansi": "$'", "bq": "`", "arith": "arithmetic",
                    "param": "${", "cmd": "$("}[frame.kind]
            raise TemplateError(
                f"the {what} at {_where(self.template, frame.opened)} is never closed, so where its "
                "placeholders stand cannot be told; close it"
            )


_ARITH_TEST = (
    "is an operand of an arithmetic test in [[ ... ]] (-eq, -lt...), which bash evaluates as code even "
    "quoted; compare with = or use [ ... ] instead"
)


def _escaping(text: str) -> bool:
    """Whether the backslashes ending ``text`` end in one that escapes what follows."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1


def _delimiter(text: str) -> tuple[str | None, int]:
    """A here-document's end word at the start of ``text`` (blanks first), quotes removed, and
    how many characters it took; None when the text ends inside the word (a placeholder follows)."""
    i = 0
    while i < len(text) and text[i] in " \t":
        i += 1
    word = ""
    while i < len(text) and text[i] not in _BREAKS:
        c = text[i]
        if c in "'\"":
            end = text.find(c, i + 1)
            if end < 0:
                return None, len(text)
            word += text[i + 1 : end]
            i = end + 1
        elif c == "\\":
            word += text[i + 1 : i + 2]
            i += 2
        else:
            word += c
            i += 1
    if i == len(text):
        return None, i
    return word, i


@functools.lru_cache(maxsize=256)
def _read(template: str, names: frozenset[str]) -> tuple[tuple[str | Slot, ...], str | None]:
    """The template as literal text and slots, or why it cannot take values."""
    pieces = _pieces(template, names)
    reader = _Reader(template)
    out: list[str | Slot] = []
    base = 0
    try:
        for k, piece in enumerate(pieces):
            if isinstance(piece, str):
                reader.text(piece, base)
                base += len(piece)
                out.append(piece)
                continue
            after = out[-1] if out and isinstance(out[-1], str) else ""
            following = pieces[k + 1] if k + 1 < len(pieces) else ""
            reader.slot(piece[0], piece[1], after, following if isinstance(following, str) else "")
            out.append(reader.slots[-1])
        reader.finish()
    except TemplateError as err:
        return (), str(err)
    return tuple(out), None


def check_template(template: str, names: Collection[str]) -> None:
    """Refuse a template where a value could not be kept literal (:class:`TemplateError`, the
    place and the way out)."""
    _, problem = _read(template, frozenset(names))
    if problem is not None:
        raise TemplateError(problem)


def _quote(value: str) -> str:
    """One single-quoted shell word, whatever the value (``shlex.quote`` leaves ``A=1`` or
    ``if`` bare, which an assignment or a reserved word would read)."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def fill(slot: Slot, value: str) -> str:
    """``value`` written for where ``slot`` stands: one literal piece of text for the shell."""
    if slot.context == SINGLE:
        return value if "'" not in value else "'" + _quote(value) + "'"
    if slot.context == DOUBLE:
        return value if not any(c in value for c in '$`"\\') else '"' + _quote(value) + '"'
    if slot.context == COMMENT:
        return value.replace("\n", " ")
    inert = _INERT.match(value) and value not in RESERVED and not (slot.redirect_follows and value.isdigit())
    return value if inert else _quote(value)


def render(template: str, values: Mapping[str, str]) -> str:
    """Fill a template; each value stays one literal piece of text wherever it stands.  A name
    without a value, or a template :func:`check_template` refuses, is an error (a parsed sweep
    was checked, so this does not happen for one)."""
    pieces, problem = _read(template, frozenset(values))
    if problem is not None:
        raise TemplateError(problem)
    return "".join(p if isinstance(p, str) else fill(p, values[p.name]) for p in pieces)
