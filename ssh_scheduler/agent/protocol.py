"""The agent protocol: every request, reply and event, defined once.

The coordinator (runner.py), the host agent (agent.py) and the hostile test server speak
newline-delimited JSON.  Each message is a small class here; ``encode`` writes one line and
``decode`` turns one line into an instance, checking every field against its annotation, so a
malformed line from a host is a ``ProtocolError`` naming the message and field, never a crash.

This module travels to the hosts with agent.py (one compressed blob, see
``transport.agent_bootstrap``) and runs there on python3 >= 3.8 with ``-I -S``: standard library
only, no 3.9+ syntax, and nothing slow to import (no dataclasses or typing at run time: the agent's
start-up time is benchmarked).  The annotations are strings (``from __future__``); at run time
they are parsed once per class into checkers, for mypy ``dataclass_transform`` makes every
message a keyword-only dataclass.

Adding a request: a ``Request`` subclass here (with its ``Reply`` if it has one) and an
``op_<tag>`` method in agent.py; tests/test_protocol.py fails until both exist.

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
    record = globals()[name]  # a Record defined in this module
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


# --- records ---------------------------------------------------------------------------------


class JobState(Record):
    running: bool
    code: Optional[int] = None


class JobUsage(Record):
    pids: List[int] = []
    rss_mb: int = 0


class StagedFile(Record):
    """An input to link into a job folder: ``rel`` inside it, from cache entry ``key``."""

    POSITIONAL = True
    rel: str
    key: str


class Staging(Record):
    files: List[StagedFile] = []
    dirs: List[str] = []


class ManifestEntry(Record):
    """One thing a job left in its folder.  ``link``: a symlink's target."""

    POSITIONAL = True
    path: str
    kind: str  # file, dir, link, special
    size: int
    mode: int
    link: Optional[str] = None


def encode_listing(entries: List[ManifestEntry]) -> List[Any]:
    return [entry.to_wire() for entry in entries]


def decode_listing(raw: object) -> Tuple[List[ManifestEntry], int]:
    """A results listing -> (the well-formed entries, how many were not).

    Checked here rather than with the message: a bad entry is skipped with a warning and a bad
    listing fails that job's copy back, while the host stays usable for other jobs.
    """
    if not isinstance(raw, list):
        raise ProtocolError("the results listing is %s, not a list" % _kind(raw))
    entries = []
    bad = 0
    for item in raw:
        try:
            entries.append(ManifestEntry.from_wire(item))
        except ProtocolError:
            bad += 1
    return entries, bad


# --- requests and their replies --------------------------------------------------------------


class HelloReply(Reply):
    TAG = "hello"
    pid: int
    root: str
    python: str
    jobs: Dict[str, JobState] = {}  # jobs this agent already had (a reattached coordinator)
    # True: the agent started the probe the hello carried; its ProbeReply follows under that
    # probe's id.  Absent (an older agent ignores the field): the coordinator sends a Probe.
    probing: bool = False


class Hello(Request):
    """The first request: sets the lease (seconds without a word before the jobs are killed).

    ``probe``: a probe to start at once, answered as if it had been sent on its own (a
    ProbeReply or Error with its id), so placing the first job costs no extra round trip."""

    TAG = "hello"
    REPLY = HelloReply
    lease: float
    probe: Optional[Probe] = None


class Ping(Request):
    """Renews the lease."""

    TAG = "ping"


class ProbeReply(Reply):
    TAG = "probe"
    out: str
    rc: int
    own: Dict[str, JobUsage] = {}  # per running job: its processes and their memory


class Probe(Request):
    TAG = "probe"
    REPLY = ProbeReply
    cmd: str


class HaveReply(Reply):
    TAG = "have"
    missing: List[str]


class Have(Request):
    """Which of these cache entries (content hashes) are missing or do not match?"""

    TAG = "have"
    REPLY = HaveReply
    hashes: List[str]
    sizes: Dict[str, int] = {}


class Staged(Reply):
    TAG = "staged"


class Stage(Request):
    TAG = "stage"
    REPLY = Staged
    dir: str
    files: List[StagedFile] = []
    dirs: List[str] = []


class Started(Event):
    TAG = "started"
    pid: int


class Output(Event):
    TAG = "out"
    fd: int  # 1 or 2
    data: str  # base64


class Exit(Event):
    """A job's end.  ``code`` None: it never ran (staging failed, unknown job)."""

    TAG = "exit"
    code: Optional[int] = None
    message: Optional[str] = None
    entries: Any = None  # the results listing when the run asked for one (decode_listing)


OUTPUT_LIMIT = "the output limit was reached"  # Exit.message of a job killed for it


class Run(Request):
    """Start a job; Started, Output... and Exit events follow (one round trip per job).

    ``stage``: inputs to link first.  ``listing``: send the results listing with the exit
    (``listing_paths`` None: what the job created or changed).
    """

    TAG = "run"
    job: str
    cmd: str
    cwd: str
    env: Dict[str, str] = {}
    out: Optional[str] = None  # where the host keeps the job's stdout / stderr
    err: Optional[str] = None
    stage: Optional[Staging] = None
    listing: bool = False
    listing_paths: Optional[List[str]] = None
    max_output: Optional[int] = None  # bytes of stdout + stderr; past it the job is killed


class Resume(Request):
    """Take up a job again: its output after these byte offsets, then as Run."""

    TAG = "resume"
    job: str
    offsets: List[int] = [0, 0]


class Kill(Request):
    """TERM the job's processes, KILL after ``grace`` seconds; its Exit event follows."""

    TAG = "kill"
    job: str
    grace: float = 5.0


class ManifestReply(Reply):
    TAG = "manifest"
    entries: Any = None  # decode_listing


class Manifest(Request):
    TAG = "manifest"
    REPLY = ManifestReply
    dir: str
    paths: Optional[List[str]] = None


class Removed(Reply):
    TAG = "removed"


class Remove(Request):
    """Delete a job folder (and, naming the job, its output files and record).  Answered only
    when it carries an id."""

    TAG = "remove"
    REPLY = Removed
    dir: str
    job: Optional[str] = None


class Swept(Reply):
    TAG = "swept"


class Sweep(Request):
    """Remove every job folder and output file whose name starts with ``prefix``."""

    TAG = "sweep"
    REPLY = Swept
    prefix: str


class Bye(Request):
    """Orderly end: the agent exits once its jobs are done."""

    TAG = "bye"


class Error(Reply):
    """A request failed (``id``), or a job could not be started (``job``)."""

    TAG = "error"
    message: str
    job: Optional[str] = None


# --- small files in bulk (transfer.py): one message for many files instead of SFTP round trips --


class Blob(Record):
    """One small file's bytes (base64) in a bulk transfer, or why it could not be read.
    ``name``: a cache key (Put) or a path relative to the job folder (Fetch)."""

    POSITIONAL = True
    name: str
    data: Optional[str] = None
    error: Optional[str] = None


class PutReply(Reply):
    TAG = "put"
    failed: List[str] = []  # "key: reason" of each file not kept


class Put(Request):
    """Keep these files in the host's cache, each only if its content hashes to its key."""

    TAG = "put"
    REPLY = PutReply
    files: List[Blob]


class Fetched(Reply):
    TAG = "fetched"
    files: List[Blob] = []  # in the order asked; a file past ``limit`` cut short, the rest left out


class Fetch(Request):
    """The bytes of these regular files of a job folder (a link, a FIFO, a device: an error,
    never followed or read); at most ``limit`` bytes in all plus one, so going over shows."""

    TAG = "fetch"
    REPLY = Fetched
    dir: str
    paths: List[str]
    limit: int
