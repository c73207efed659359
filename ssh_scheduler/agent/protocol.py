"""The agent protocol: every request, reply and event, defined once.

The machinery (records, encoding, checking a line) is wire.py; here is what is said.  Both
travel to the hosts with the agent and run there on python3 >= 3.8 (see wire.py).

Adding a request: a ``Request`` subclass here (with its ``Reply`` if it has one) and an
``op_<tag>`` method on the agent (main.py and its parts: jobs.py, files.py);
tests/test_protocol.py fails until both exist.
"""

from __future__ import annotations

from ssh_scheduler.agent.wire import Event, Message, ProtocolError, Record, Reply, Request

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

MAX_LINE = 16 << 20
"""The longest line the agent sends, and the longest the coordinator reads from a host (each host
holds one line at a time, so this bounds what a host can make us hold).  A real agent stays far
below: output comes 256 KiB at a time, files in bulk 4 MiB at a time, Slurm output by a budget
(slurm.py); a listing that would not fit is refused with the reason (:func:`too_long`)."""
MAX_OUTPUT_LINE = 1 << 20
"""The longest ``out`` event: the agent sends at most 256 KiB of a job's output in one (asyncio
reads a pipe 256 KiB at a time), 4/3 of it in base64."""


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
        shown = "null" if raw is None else type(raw).__name__
        raise ProtocolError("the results listing is %s, not a list" % shown)
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
    root: str  # the work root as configured (expanded): what the coordinator checks
    # Where the root really is: every folder on the way ours or root's (boot.open_root).  Every
    # path the coordinator names there (jobs, uploads) starts with it.
    real: Optional[str] = None
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


class AdoptReply(Reply):
    TAG = "adopt"
    ok: bool
    why: str = ""  # when not ok: why this agent cannot be the batch's (its caller starts one)


class Adopt(Request):
    """Become the agent of batch ``token``, as if started with it: its reattachment socket, its
    jobs' process tags, what a lapsed lease sweeps.  Asked of an agent started without a token
    that holds no job (the hub's spare, transport/hub_agent.py); refused otherwise, and when the
    socket of that token is there (a coordinator coming back reaches the agent behind it)."""

    TAG = "adopt"
    REPLY = AdoptReply
    token: str


class ProbeReply(Reply):
    TAG = "probe"
    out: str
    rc: int
    own: Dict[str, JobUsage] = {}  # per running job: its processes and their memory


class Probe(Request):
    """Run ``cmd`` with ``/bin/sh``.  ``alone``, when not empty, is its first argument for a
    probe while the agent holds no running job (machines/probe.py ALONE: fewer and overlapped
    ``nvidia-smi`` runs); should a job start before it ends, the probe is taken again without
    it, so the reply's ``own`` is empty whenever it ran alone."""

    TAG = "probe"
    REPLY = ProbeReply
    cmd: str
    alone: str = ""


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
    """A job's end.  ``code`` None: it never ran (staging failed, unknown job).  ``missing``:
    it never ran because these cache entries were gone (the coordinator sends them again).
    ``lost``: part of its output exists nowhere (the host could not keep it while no
    coordinator listened): it cannot count as good."""

    TAG = "exit"
    code: Optional[int] = None
    message: Optional[str] = None
    entries: Any = None  # the results listing when the run asked for one (decode_listing)
    missing: Optional[List[str]] = None
    lost: Optional[str] = None


class Notice(Event):
    """Something about a job the coordinator should say once per host (its host copy of the
    output could not be written, say); it changes nothing of the job."""

    TAG = "notice"
    message: str


OUTPUT_LIMIT = "the output limit was reached"  # Exit.message of a job killed for it


class Warm(Record):
    """A warm interpreter a job may be forked from (a Python call: agent/warm.py): ``start``,
    the shell text that starts it, in the job's folder; ``env``, what of the job's environment
    it starts with (the machine's ``env:``, never a job's own); ``argv``, what the forked call
    runs with.  The agent keeps one per distinct ``start`` and ``env``."""

    start: str
    env: Dict[str, str] = {}
    argv: List[str] = []


class Run(Request):
    """Start a job; Started, Output... and Exit events follow (one round trip per job).

    ``stage``: inputs to link first.  ``listing``: send the results listing with the exit
    (``listing_paths`` None: what the job created or changed).  ``warm``: fork the job from a
    warm interpreter instead of running ``cmd`` (which runs where none can be had).
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
    warm: Optional[Warm] = None


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


# --- a Slurm login node (executors/slurm.py): where many jobs stand, in one request ------------


class OutputAt(Record):
    """A Slurm job's output files, ``<base><rest>.out`` and ``.err``, and how many bytes of
    each are already home (what follows is sent)."""

    POSITIONAL = True
    job: str
    rest: str
    out: int
    err: int


class OutputChunk(Record):
    """New bytes (base64) of a job's stdout (``fd`` 1) or stderr (2)."""

    POSITIONAL = True
    job: str
    fd: int
    data: str


class SlurmReply(Reply):
    TAG = "slurm"
    rc: int  # squeue's exit status; not 0: ``squeue`` says why, and nothing else was asked
    squeue: str  # its lines, "id|name|state|reason"
    detail: Dict[str, str] = {}  # Slurm id -> its ``scontrol -o`` line, or "sacct " + sacct's
    data: List[OutputChunk] = []
    more: List[str] = []  # jobs whose new output did not fit this reply: it comes with the next


class SlurmQuery(Request):
    """Where this user's jobs stand in Slurm, and what they wrote since (agent/slurm.py):
    ``squeue`` for every job of ours; for those of ``follow`` whose state is one of ``done``
    or that squeue no longer shows, ``scontrol`` -- else ``sacct`` -- for how they ended; then
    up to ``chunk`` new bytes of each output file.  Every Slurm command runs after ``prefix``
    (``module load slurm``).  A request, not a command: nothing here is on a command line, so
    no argument grows with the number of jobs."""

    TAG = "slurm"
    REPLY = SlurmReply
    prefix: Optional[str] = None
    follow: List[str] = []
    done: List[str] = []
    base: str = ""  # what every output path starts with (sent once)
    outputs: List[OutputAt] = []
    chunk: int = 1 << 20


# --- the line limit ------------------------------------------------------------------------


def too_long(message: Message, size: int) -> Message:
    """What the agent sends instead of ``message`` when its line (``size`` bytes) would pass
    MAX_LINE (the coordinator would take the host for lost): an Exit without its listing (the
    coordinator then asks for it and learns why), or an error saying why."""
    if isinstance(message, Exit):
        message.entries = None
        return message
    why = "its answer to %r is %d MiB, over the agent protocol's limit of %d MiB per message" % (
        message.TAG, size >> 20, MAX_LINE >> 20)
    if isinstance(message, ManifestReply):
        why += "; bring back fewer files (--copy-backwards)"
    return Error(id=message.id, job=getattr(message, "job", None), message=why)
