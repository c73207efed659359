"""The ``--json`` schema in the README against the event classes, and the JSON lines subscriber."""

from __future__ import annotations

import dataclasses
import json

from ssh_scheduler import events
from ssh_scheduler.events import GpuReading, HostProbed, JobFailed
from ssh_scheduler.machines.host_state import GpuState, HostState, probed
from ssh_scheduler.view.display import JsonLines
from tests.event_schema import COMMON, load_schema, problems


def event_classes() -> list[type[events.Event]]:
    found = []
    for name in events.__all__:
        value = getattr(events, name)
        if isinstance(value, type) and issubclass(value, events.Event) and value is not events.Event:
            found.append(value)
    return found


def test_readme_documents_every_event_and_exactly_its_fields() -> None:
    schema = load_schema()
    classes = event_classes()
    assert len(classes) >= 20
    assert {cls.kind for cls in classes} == set(schema)
    for cls in classes:
        fields = {f.name for f in dataclasses.fields(cls)} - {"t"}
        assert set(schema[cls.kind]) - set(COMMON) == fields, cls.kind


def test_host_probed_carries_load_memory_and_each_gpu() -> None:
    state = HostState(
        4, 1.5, 16384, 12000,
        (GpuState(0, "G0", "sim", 16000, 480, 15520, 0.25), GpuState(1, "G1", "sim", 16000, 9000, 7000, 1.0)),
    )
    data = probed("h1", state).to_json()
    assert data["gpus"] == [
        {"index": 0, "memory_used_mb": 480, "memory_total_mb": 16000, "utilization": 0.25, "ours_mb": 0},
        {"index": 1, "memory_used_mb": 9000, "memory_total_mb": 16000, "utilization": 1.0, "ours_mb": 0},
    ]
    assert (data["load"], data["memory_free_mb"], data["cpus"]) == (1.5, 12000, 4)
    assert problems(data, load_schema()) == []


def test_checker_rejects_what_the_schema_does_not_allow() -> None:
    schema = load_schema()
    good = JobFailed(job="j", host="h", command="c", code=None, reason="host lost", seconds=1.0).to_json()
    assert problems(good, schema) == []
    assert problems({**good, "code": "3"}, schema) == ["job_failed.code: '3' is not int"]
    assert problems({k: v for k, v in good.items() if k != "host"}, schema) == ["job_failed: missing field 'host'"]
    assert problems({**good, "extra": 1}, schema) == ["job_failed: undocumented field 'extra'"]
    assert problems({**good, "event": "nope"}, schema) == ["undocumented event 'nope'"]
    probed = HostProbed(host="h", cpus=1, load=0.0, memory_free_mb=1, memory_total_mb=2, gpus=(GpuReading(0, 1, 2, 0.5),)).to_json()
    probed["gpus"][0]["utilization"] = "high"
    assert problems(probed, schema) == ["host_probed.gpus[0].utilization: 'high' is not float"]


def test_json_lines_prints_one_compact_object_per_event() -> None:
    printed: list[str] = []
    subscriber = JsonLines(printed.append)
    subscriber(events.JobRequeued(job="j", host="h2", reason="host h2 was lost", t=1.0))
    subscriber(events.BatchPaused(t=2.0))
    assert [json.loads(line) for line in printed] == [
        {"version": 1, "event": "job_requeued", "t": 1.0, "job": "j", "host": "h2", "reason": "host h2 was lost"},
        {"version": 1, "event": "paused", "t": 2.0},
    ]
    assert all("\n" not in line for line in printed)


def test_each_kind_is_written_with_its_own_fields_in_order_as_json_dumps_writes_them() -> None:
    """``to_json`` reads each kind's field names once and the files are written through one
    prebuilt encoder: kinds written one after another (a subclass with a field of its own among
    them) each keep their own fields, in declaration order, and every line is what
    ``json.dumps(..., separators=(",", ":"))`` writes (non-ASCII, NaN and nesting included)."""

    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class FailedWithNote(JobFailed):
        note: str = "é\u2028"

    written = [
        JobFailed(job="j", host="h", command="c", code=None, reason="host lost", seconds=1.0),
        HostProbed(host="h", cpus=1, load=float("nan"), memory_free_mb=1, memory_total_mb=2, gpus=(GpuReading(0, 1, 2, 0.5),)),
        FailedWithNote(job="j", host="h", command="ü", code=3, reason="exit 3", seconds=2.0),
        JobFailed(job="k", host="h", command="c", code=1, reason="exit 1", seconds=3.0),
    ]
    for event in written:
        data = event.to_json()
        names = [f.name for f in dataclasses.fields(event)]  # "t" first, as Event declares it
        assert list(data) == ["version", "event", *names], type(event).__name__
        assert events.COMPACT_JSON.encode(data) == json.dumps(data, separators=(",", ":"))
