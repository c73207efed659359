"""The agent protocol's machinery: typed records, whole-line messages, and decoding a line.

The coordinator (executors/session.py), the host agent (main.py) and the hostile test server
speak newline-delimited JSON.  Each message is a small class (the vocabulary is protocol.py);
``encode`` writes one line and ``decode`` turns one line into an instance, checking every field
against its annotation, so a malformed line from a host is a ``ProtocolError`` naming the message
and field, never a crash.

This module travels to the hosts with the agent (boot.py, the first stage, loads it) and runs
there on python3 >= 3.8 with ``-I -S``: standard library only, no 3.9+ syntax, and nothing slow
to import (no dataclasses or typing at run time: the agent's start-up time is benchmarked).  The
annotations are strings (``from __future__``); at run time they are parsed once per class into
checkers, for mypy ``dataclass_transform`` makes every message a keyword-only dataclass.

Wire format: a request is ``{"op": TAG, "id": n?, fields...}``, a reply or event
``{"ev": TAG, "id": n?, fields...}``; fields that are None are left out.  Records marked
``POSITIONAL`` (a results listing can hold 10^5 entries) travel as JSON arrays in field order.
"""

from __future__ import annotations

import json
import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import (
        Any,
        Callable,
        ClassVar,
        Dict,
        List,
        Optional,
        Tuple,
        TypeVar,
        dataclass_transform,
    )

    R = TypeVar("R", bound="Record")
else:

    def dataclass_transform(**_options):
        return lambda cls: cls


class ProtocolError(ValueError):
    """A line that is not a well-formed message.  ``id``/``job``: what the line said it was
    about, when that much could be read (so the answer can go to the right waiter)."""

    def __init__(self, message: str, id: object = None, job: object = None) -> None:
        ValueError.__init__(self, message)
        self.id = id if isinstance(id, int) and not isinstance(id, bool) else None
        self.job = job if isinstance(job, str) else None


_REQUIRED = object()
_TOKENS = re.compile(r"\w+|[\[\],]")
RECORDS = {}  # type: Dict[str, type[Record]]
"""Every record class by name: what a field annotated with a record's name holds."""


@dataclass_transform(kw_only_default=True)
class Record(object):
    """Named, typed fields (declared as annotations, defaults as class attributes)."""

    POSITIONAL = False
    _fields: ClassVar[Tuple[Tuple[str, Any], ...]] = ()
    _codecs: ClassVar[Optional[List[Tuple[str, Any, Callable[..., Any], Any]]]] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__annotations__", {})
        fields = [f for f in cls._fields if f[0] not in own]
        fields.extend((name, cls.__dict__.get(name, _REQUIRED)) for name in own)
        cls._fields = tuple(fields)
        cls._codecs = None
        RECORDS[cls.__name__] = cls

    def __init__(self, **values: Any) -> None:
        for name, default in self._fields:
            if name in values:
                value = values.pop(name)
            elif default is _REQUIRED:
                raise TypeError("%s needs %r" % (type(self).__name__, name))
            else:
                value = default.copy() if isinstance(default, (list, dict)) else default
            setattr(self, name, value)
        if values:
            raise TypeError("%s has no field %r" % (type(self).__name__, sorted(values)[0]))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n, _ in self._fields)

    def __repr__(self) -> str:
        shown = ", ".join("%s=%r" % (n, getattr(self, n)) for n, _ in self._fields)
        return "%s(%s)" % (type(self).__name__, shown)

    @classmethod
    def codecs(cls) -> List[Tuple[str, Any, Callable[..., Any], Any]]:
        """(name, default, check, encode) per field, built from the annotations once."""
        if cls._codecs is None:
            hints = {}
            for klass in reversed(cls.__mro__):
                hints.update(klass.__dict__.get("__annotations__", {}))
            built = []
            for name, default in cls._fields:
                tokens = _TOKENS.findall(hints[name])
                check, encode, _ = _parse_type(tokens, 0)
                built.append((name, default, check, encode))
            cls._codecs = built
        return cls._codecs

    def to_wire(self) -> Any:
        if self.POSITIONAL:
            return [_encoded(enc, getattr(self, n)) for n, _, _, enc in self.codecs()]
        out = {}
        for name, _, _, encode in self.codecs():
            value = getattr(self, name)
            if value is not None:
                out[name] = _encoded(encode, value)
        return out

    @classmethod
    def from_wire(cls: type[R], raw: Any, where: str = "") -> R:
        where = where or cls.__name__
        codecs = cls.codecs()
        values = {}
        if cls.POSITIONAL:
            if not isinstance(raw, list) or len(raw) != len(codecs):
                raise ProtocolError("%s: expected a list of %d items" % (where, len(codecs)))
            for (name, _, check, _), value in zip(codecs, raw):
                values[name] = check(value, "%s.%s" % (where, name))
            return cls(**values)
        if not isinstance(raw, dict):
            raise ProtocolError("%s: expected an object, got %s" % (where, _kind(raw)))
        for name, default, check, _ in codecs:
            if name in raw and raw[name] is not None:
                values[name] = check(raw[name], "%s.%s" % (where, name))
            elif default is _REQUIRED:
                raise ProtocolError("%s: %r is missing" % (where, name))
        return cls(**values)


def _encoded(encode: Any, value: Any) -> Any:
    return value if encode is None or value is None else encode(value)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _simple(name: str, test: Callable[[Any], bool], convert: Optional[Callable[[Any], Any]] = None) -> Any:
    def check(value: Any, where: str) -> Any:
        if not test(value):
            raise ProtocolError("%s: expected %s, got %s" % (where, name, _kind(value)))
        return value if convert is None else convert(value)

    return check


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SIMPLE = {
    "str": _simple("str", lambda v: isinstance(v, str)),
    "int": _simple("int", _is_int),
    "bool": _simple("bool", lambda v: isinstance(v, bool)),
    "float": _simple("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), float),
    "Any": lambda value, where: value,
}


def _parse_type(tokens: List[str], pos: int) -> Tuple[Callable[..., Any], Any, int]:
    """A checker (value, where) -> value and an encoder (or None) for the annotation at pos."""
    name = tokens[pos]
    pos += 1
    args = []
    if pos < len(tokens) and tokens[pos] == "[":
        while tokens[pos] != "]":
            check, encode, pos = _parse_type(tokens, pos + 1)
            args.append((check, encode))
        pos += 1
    if name == "Optional":
        (inner, encode), = args
        return (lambda v, where: None if v is None else inner(v, where)), encode, pos
    if name == "List":
        (inner, item_encode), = args

        def check_list(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise ProtocolError("%s: expected a list, got %s" % (where, _kind(value)))
            return [inner(item, "%s[%d]" % (where, i)) for i, item in enumerate(value)]

        list_encode = None if item_encode is None else (lambda v: [item_encode(x) for x in v])
        return check_list, list_encode, pos
    if name == "Dict":
        (_, _), (inner, item_encode) = args  # keys are always str in JSON

        def check_dict(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise ProtocolError("%s: expected an object, got %s" % (where, _kind(value)))
            return dict((k, inner(v, "%s[%r]" % (where, k))) for k, v in value.items())

        dict_encode = None if item_encode is None else (
            lambda v: dict((k, item_encode(x)) for k, x in v.items()))
        return check_dict, dict_encode, pos
    if name in _SIMPLE:
        return _SIMPLE[name], None, pos
    record = RECORDS[name]  # a Record subclass (protocol.py)
    return (lambda v, where: record.from_wire(v, where)), (lambda v: v.to_wire()), pos


class Message(Record):
    """A whole line.  ``TAG`` names it on the wire; ``id`` pairs a reply with its request."""

    KIND = ""  # "op" for requests, "ev" for replies and events
    TAG = ""
    id: Optional[int] = None

    def encode(self) -> bytes:
        wire = self.to_wire()
        wire[self.KIND] = self.TAG
        return (json.dumps(wire, separators=(",", ":")) + "\n").encode()


REQUESTS = {}  # type: Dict[str, type[Request]]
ANSWERS = {}  # type: Dict[str, type[Message]]
# ANSWERS: replies and events, what the agent sends


class Request(Message):
    KIND = "op"
    REPLY = None  # type: Optional[type[Reply]]  # None: nothing answers it (or events do)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "TAG" in cls.__dict__:
            REQUESTS[cls.TAG] = cls


class Reply(Message):
    """The answer to one request, carrying its ``id``."""

    KIND = "ev"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "TAG" in cls.__dict__:
            ANSWERS[cls.TAG] = cls


class Event(Reply):
    """Unsolicited news about a job (output, start, end), sent while the job runs."""

    job: str


def decode(line: bytes, table: Dict[str, type[Message]], kind: str) -> Message:
    """One line -> a message of ``table``; ProtocolError when it is anything else."""
    try:
        raw = json.loads(line)
    except ValueError:
        raise ProtocolError("not JSON: %r" % line[:80]) from None
    if not isinstance(raw, dict):
        raise ProtocolError("expected an object, got %s" % _kind(raw))
    tag = raw.get(kind)
    cls = table.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError("unknown %s %r" % (kind, tag), raw.get("id"), raw.get("job"))
    try:
        return cls.from_wire(raw, repr(tag))
    except ProtocolError as exc:
        raise ProtocolError(str(exc), raw.get("id"), raw.get("job")) from None


def decode_request(line: bytes) -> Request:
    return decode(line, REQUESTS, "op")  # type: ignore[arg-type,return-value]


def decode_answer(line: bytes) -> Message:
    return decode(line, ANSWERS, "ev")
