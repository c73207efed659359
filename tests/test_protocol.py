"""The agent protocol (ssh_scheduler/agent/protocol.py): every message has its handler and decoder,
round-trips, and a malformed line is a ProtocolError naming what is wrong, never a crash."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from typing import Any

import pytest

from ssh_scheduler.agent import main as agent
from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.executors import job_events
from ssh_scheduler.transport.bootstrap import agent_start
from tests.hostile_server import HostileServer

REQUESTS = sorted(W.REQUESTS.values(), key=lambda c: c.TAG)
ANSWERS = sorted(W.ANSWERS.values(), key=lambda c: c.TAG)
EVENTS = [c for c in ANSWERS if issubclass(c, W.Event)]
REPLIES = [c for c in ANSWERS if not issubclass(c, W.Event)]

# One well-formed value per annotation, to build an instance of every message.
SAMPLES: dict[str, Any] = {
    "str": "a\u00e9\n\x00b",
    "int": 7,
    "float": 2.5,
    "bool": True,
    "Any": [["x", "file", 1, 0o644, None]],
    "Optional[str]": "o",
    "Optional[int]": 0,
    "Optional[List[str]]": ["p", "q"],
    "List[str]": ["k1", "k2"],
    "List[int]": [1, 2],
    "Dict[str, str]": {"A": "1"},
    "Dict[str, int]": {"k1": 3},
    "Dict[str, JobState]": {"j": P.JobState(running=False, code=3)},
    "Dict[str, JobUsage]": {"j": P.JobUsage(pids=[5, 6], rss_mb=12)},
    "List[StagedFile]": [P.StagedFile(rel="a/b", key="h-r")],
    "Optional[Probe]": P.Probe(id=12, cmd="echo p"),
    "Optional[Staging]": P.Staging(files=[P.StagedFile(rel="c", key="h-x")], dirs=["d"]),
    "Optional[Warm]": P.Warm(start="exec python3 r.py --serve k", env={"A": "1"}, argv=["p", "r", "i"]),
    "List[Blob]": [P.Blob(name="k1", data="aGk="), P.Blob(name="k2", error="gone")],
    "List[OutputAt]": [P.OutputAt(job="j", rest="a", out=1, err=2)],
    "List[OutputChunk]": [P.OutputChunk(job="j", fd=2, data="aGk=")],
}


def sample(cls: type[W.Message]) -> W.Message:
    hints: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        hints.update(inspect.get_annotations(klass))
    values = {name: SAMPLES[hints[name]] for name, _ in cls._fields if name != "id"}
    return cls(id=11, **values)


def test_every_request_has_a_handler_in_the_agent() -> None:
    missing = [c.TAG for c in REQUESTS if not callable(getattr(agent.Agent, f"op_{c.TAG}", None))]
    assert missing == []
    assert {c.TAG for c in REQUESTS} >= {"hello", "ping", "probe", "have", "stage", "run", "resume",
                                         "kill", "manifest", "remove", "sweep", "bye"}


def test_every_answer_is_decoded_by_the_coordinator() -> None:
    # Replies are what some request waits for; events each have their handler in executors/job_events.py.
    awaited = {c.REPLY for c in REQUESTS if c.REPLY is not None}
    assert [c.TAG for c in REPLIES if c not in awaited and c is not P.Error] == []
    handled = job_events.JOB_EVENTS
    assert [c.TAG for c in EVENTS if c not in handled] == []
    assert all(issubclass(reply, W.Reply) for reply in awaited)


def test_the_hostile_server_answers_every_request(tmp_path: Any) -> None:
    server = HostileServer(tmp_path)
    for cls in REQUESTS:
        message = sample(cls)
        if cls is P.Run:
            message = P.Run(job="j", cmd="c", cwd="/x/jobs/t-j", listing=True)
        for answer in server._answer(message):  # type: ignore[arg-type]
            assert not isinstance(answer, P.Error), cls.TAG
            assert W.decode_answer(answer.encode()) == answer or answer.TAG == "probe"


@pytest.mark.parametrize("cls", REQUESTS + ANSWERS, ids=lambda c: f"{c.KIND}:{c.TAG}")
def test_round_trip(cls: type[W.Message]) -> None:
    message = sample(cls)
    line = message.encode()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    decode = W.decode_request if issubclass(cls, W.Request) else W.decode_answer
    assert decode(line) == message
    raw = json.loads(line)
    assert raw[cls.KIND] == cls.TAG and raw["id"] == 11


def test_records_and_listings_use_named_fields() -> None:
    entry = P.ManifestEntry(path="d/f", kind="file", size=3, mode=0o640)
    assert entry.to_wire() == ["d/f", "file", 3, 0o640, None]  # compact on the wire
    good, bad = P.decode_listing([entry.to_wire(), ["l", "link", 0, 0o777, "f"], ["short"], 5,
                                  ["m", "file", 1, True, None]])
    assert good == [entry, P.ManifestEntry(path="l", kind="link", size=0, mode=0o777, link="f")]
    assert bad == 3
    with pytest.raises(W.ProtocolError, match="not a list"):
        P.decode_listing({"not": "a list"})


@pytest.mark.parametrize(
    ("line", "needle", "rid", "job"),
    [
        (b"nonsense", "not JSON", None, None),
        (b"[1, 2]", "expected an object, got list", None, None),
        (b'{"ev": "nope", "id": 3}', "unknown ev 'nope'", 3, None),
        (b'{"ev": 5}', "unknown ev 5", None, None),
        (b'{"ev": "have", "id": 4, "missing": 5}', "'have'.missing: expected a list, got int", 4, None),
        (b'{"ev": "have", "id": 4, "missing": ["a", 2]}', "missing[1]: expected str, got int", 4, None),
        (b'{"ev": "hello", "id": true, "pid": 1, "root": "/", "python": "3"}', "'hello'.id: expected int, got bool", None, None),
        (b'{"ev": "hello", "id": 1, "root": "/", "python": "3"}', "'pid' is missing", 1, None),
        (b'{"ev": "hello", "id": 1, "pid": 1, "root": "/", "python": "3", "jobs": {"j": {"running": 1}}}',
         "jobs['j'].running: expected bool, got int", 1, None),
        (b'{"ev": "out", "job": "j", "fd": "1", "data": ""}', "'out'.fd: expected int, got str", None, "j"),
        (b'{"ev": "exit", "job": 5, "code": 0}', "'exit'.job: expected str, got int", None, None),
        (b'{"ev": "exit", "job": "j", "code": 1.5}', "'exit'.code: expected int, got float", None, "j"),
        (b'{"ev": "probe", "id": 2, "out": "", "rc": 0, "own": {"j": {"pids": ["x"]}}}', "own['j'].pids[0]", 2, None),
    ],
)
def test_malformed_answers_are_protocol_errors(line: bytes, needle: str, rid: int | None, job: str | None) -> None:
    with pytest.raises(W.ProtocolError) as info:
        W.decode_answer(line)
    assert needle in str(info.value)
    assert (info.value.id, info.value.job) == (rid, job)


def test_malformed_requests_are_protocol_errors() -> None:
    with pytest.raises(W.ProtocolError, match=r"'run'.stage.files\[0\]: expected a list of 2 items"):
        W.decode_request(b'{"op": "run", "job": "j", "cmd": "c", "cwd": "/", "stage": {"files": [["a"]]}}')
    with pytest.raises(W.ProtocolError, match=r"'kill'\.grace: expected a number, got str"):
        W.decode_request(b'{"op": "kill", "job": "j", "grace": "5"}')
    assert W.decode_request(b'{"op": "kill", "job": "j", "grace": 5}') == P.Kill(job="j", grace=5.0)


def test_the_agent_answers_a_malformed_request_with_an_error(tmp_path: Any) -> None:
    """The shipped agent (started as a host starts it) reads requests from stdin."""
    requests = b"".join([
        b'{"op": "probe", "id": 1, "cmd": 5}\n',
        b'{"op": "fly", "id": 2}\n',
        P.Probe(id=3, cmd="echo hi").encode(),
    ])
    start = agent_start(sys.executable, str(tmp_path / "root"))
    with subprocess.Popen(["/bin/sh", "-c", start.command], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(start.payload + requests)
        proc.stdin.flush()
        answers = [W.decode_answer(proc.stdout.readline()) for _ in range(3)]
        proc.stdin.write(P.Bye().encode())
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    by_id = {a.id: a for a in answers}
    assert isinstance(by_id[1], P.Error) and "'probe'.cmd: expected str, got int" in by_id[1].message
    assert isinstance(by_id[2], P.Error) and "unknown op 'fly'" in by_id[2].message
    reply = by_id[3]
    assert isinstance(reply, P.ProbeReply) and (reply.out, reply.rc) == ("hi\n", 0)
