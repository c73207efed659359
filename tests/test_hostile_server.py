"""Copy-back against a hostile host: an in-process asyncssh server that impersonates the agent.

Everything goes through the real code paths (``execute_remote``, ``run_batch``, the SSH
transport with host-key checking, the runner's JSON-lines protocol, SFTP downloads); only the
host lies.  The invariant checked everywhere: nothing is created or changed outside
``job_results/<job>/`` (besides the job's own ``.out``/``.err`` and the journal), no symlink from
the host leads outside the job folder, and the limits stop a flood with a clear message.
"""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.coordinator.batch import run_batch
from ssh_scheduler.coordinator.batch_run import BatchOptions
from ssh_scheduler.coordinator.remote import RemoteOptions, execute_remote
from ssh_scheduler.errors import TransferError, TransportError
from ssh_scheduler.executors.transfer import CopyLimits, link_stays_inside, safe_relpath
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.transport import ssh
from tests.hostile_server import ENDLESS, STALL, HostileServer, Scenario, hostile_server

# Paths a careless client would create when following the hostile names literally.
OUTSIDE = ["/evil", "/abs", "/x", "/tmp/evil", "/tmp/evil.txt", "/tmp/x", "/tmp/pwned"]

EVIL_ENTRIES: list[object] = [
    ["../evil", "file", 5, 0o644, None],
    ["../../../../../../tmp/evil.txt", "file", 5, 0o644, None],
    ["/abs/path", "file", 5, 0o644, None],
    ["/tmp/evil", "file", 5, 0o644, None],
    ["a/../../x", "file", 5, 0o644, None],
    ["./x", "file", 5, 0o644, None],
    ["x/./y", "file", 5, 0o644, None],
    ["x//y", "file", 5, 0o644, None],
    ["trailing/", "file", 5, 0o644, None],
    ["..", "dir", 0, 0o755, None],
    ["../up", "dir", 0, 0o755, None],
    ["nul\x00name", "file", 5, 0o644, None],
    ["nul/\x00", "file", 5, 0o644, None],
    ["bad\ud800surrogate", "file", 5, 0o644, None],
    ["", "file", 5, 0o644, None],
    [None, "file", 5, 0o644, None],
    [42, "file", 5, 0o644, None],
    ["too", "few"],
    "abcde",  # five characters: must not be unpacked as an entry
    {"rel": "dict"},
    # links
    ["link", "link", 0, 0o777, "/etc/passwd"],
    ["up", "link", 0, 0o777, "../../.."],
    ["up1", "link", 0, 0o777, ".."],  # the job folder's parent: job_results/
    ["sub/upsub", "link", 0, 0o777, "../.."],
    ["sub/top", "link", 0, 0o777, ".."],  # the job folder itself: fine
    ["nul_link", "link", 0, 0o777, "in\x00side"],
    ["int_link", "link", 0, 0o777, 7],
    ["empty_link", "link", 0, 0o777, ""],
    # a link that stays inside by itself, then links that leave *through* it
    ["a/b/x", "link", 0, 0o777, "../.."],
    ["chain1", "link", 0, 0o777, "a/b/x/.."],
    ["chain2", "link", 0, 0o777, "a/b/x/../.."],
    ["chain3", "link", 0, 0o777, "a/b/x/../../../../../../../etc"],
    # a symlink, then a directory and a file of the same name
    ["d", "link", 0, 0o777, "/tmp"],
    ["d/file", "file", 5, 0o644, None],
    ["d/sub/file", "file", 5, 0o644, None],
    # an inside link, then a file *through* it (would be written via the link)
    ["in", "link", 0, 0o777, "real"],
    ["real/keep", "file", 5, 0o644, None],
    ["in/through", "file", 5, 0o644, None],
    # duplicates
    ["dup", "file", 5, 0o644, None],
    ["dup", "file", 5, 0o644, None],
    ["dup", "link", 0, 0o777, "real"],
    # special files
    ["fifo", "special", 0, 0o644, None],
    ["dev", "special", 0, 0o644, None],
    ["sock", "socket", 0, 0o644, None],
    # modes: setuid/sticky bits dropped; a bool is not a mode (a malformed entry, skipped)
    ["suid", "file", 5, 0o4755, None],
    ["boolmode", "file", 5, True, None],
    # names a terminal would interpret
    ["esc\x1b[2Jname", "file", 5, 0o644, None],
    ["new\nline", "file", 5, 0o644, None],
    # fine
    ["ok.txt", "file", 5, 0o644, None],
    ["deep/er/ok.txt", "file", 5, 0o644, None],
    ["inside", "link", 0, 0o777, "ok.txt"],
    ["deep/er/back", "link", 0, 0o777, "../../ok.txt"],
    ["deep/er/sib", "link", 0, 0o777, "../er/../er/ok.txt"],
    ["non\udcffutf8", "file", 5, 0o644, None],
]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root (links not followed) -> kind and, for links, the target."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            else:
                out[rel] = f"file:{st.st_size}:{stat.S_IMODE(st.st_mode):o}"
    return out


def outside_state() -> dict[str, bool]:
    return {p: os.path.lexists(p) for p in OUTSIDE}


def assert_only_job_changes(before: dict[str, str], after: dict[str, str], jobs: list[str]) -> None:
    """Everything new or changed under tmp_path belongs to one of the jobs' results."""
    allowed_files = {"job_results", os.path.join("job_results", ".journal.jsonl"), os.path.join("job_results", ".lock")}
    for job in jobs:
        allowed_files |= {os.path.join("job_results", job + s) for s in (".out", ".err")}
    for rel, kind in after.items():
        if before.get(rel) == kind:
            continue
        if rel in allowed_files:
            continue
        assert any(
            rel == os.path.join("job_results", job) or rel.startswith(os.path.join("job_results", job) + os.sep)
            for job in jobs
        ), f"{rel} ({kind}) was created outside job_results/<job>/"
    for rel in before:
        assert rel in after, f"{rel} disappeared"


def assert_links_inside(folder: Path) -> None:
    top = os.path.realpath(folder)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                real = os.path.realpath(path)
                assert real == top or real.startswith(top + os.sep), f"{path} -> {real} leaves {top}"


@pytest.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[HostileServer]:
    async with hostile_server(tmp_path) as server:
        yield server


def workspace(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "input.txt").write_text("input\n")
    return src, tmp_path / "job_results"


async def test_hostile_names_links_and_specials_stay_inside(
    hostile: HostileServer, tmp_path: Path
) -> None:
    hostile.scenarios["evil"] = Scenario(entries=EVIL_ENTRIES, output=b"ran\n")
    warned: list[str] = []
    src, results = workspace(tmp_path)
    before, outside_before = snapshot(tmp_path), outside_state()
    parent_before = sorted(os.listdir(tmp_path.parent))

    code = await execute_remote(
        hostile.machine(),
        "true",
        RemoteOptions(job_name="evil", results_dir=results, base_dir=src),
        stdout=(),
        stderr=(),
        warn=warned.append,
    )

    assert code == 0
    after = snapshot(tmp_path)
    assert_only_job_changes(before, after, ["evil"])
    assert outside_state() == outside_before
    assert sorted(os.listdir(tmp_path.parent)) == parent_before
    job = results / "evil"
    assert_links_inside(job)
    got = {k[len("job_results/evil/") :]: v for k, v in after.items() if k.startswith("job_results/evil/")}

    def f(rel: str, mode: str = "644") -> str:
        return f"file:{len(f'data of {rel}'.encode('utf-8', 'surrogateescape'))}:{mode}"

    assert got == {
        "ok.txt": f("ok.txt"),
        "deep": "dir",
        "deep/er": "dir",
        "deep/er/ok.txt": f("deep/er/ok.txt"),
        "inside": "link:ok.txt",
        "deep/er/back": "link:../../ok.txt",
        "a": "dir",
        "a/b": "dir",
        "a/b/x": "link:../..",
        "sub": "dir",
        "sub/top": "link:..",
        "d": "dir",  # the link to /tmp was refused; a real folder holds d/file
        "d/file": f("d/file"),
        "d/sub": "dir",
        "d/sub/file": f("d/sub/file"),
        "in": "link:real",
        "real": "dir",
        "real/keep": f("real/keep"),
        "dup": f("dup"),
        "suid": f("suid", "755"),
        "esc\x1b[2Jname": f("esc\x1b[2Jname"),
        "new\nline": f("new\nline"),
        "non\udcffutf8": f("non\udcffutf8"),
    }
    assert (job / "ok.txt").read_bytes() == b"data of ok.txt"
    assert (job / "inside").read_bytes() == b"data of ok.txt"
    assert (job / "deep" / "er" / "back").read_bytes() == b"data of ok.txt"
    assert (results / "evil.out").read_bytes() == b"ran\n"
    # the host was never even asked for a name we refuse
    asked = [p.split("/", 4)[-1] for p in hostile.opened]
    assert all(safe_relpath(rel) == rel for rel in asked), asked
    assert "in/through" not in asked or not (job / "real" / "through").exists()
    assert not (job / "real" / "through").exists()
    err = "\n".join(warned)
    for needle in ("unsafe name '../evil' refused", "symlink to '/etc/passwd' leaves the job folder",
                   "symlink to 'a/b/x/../..' leaves", "fifo: special file skipped", "malformed manifest entry"):
        assert needle in err, err
    assert "\x1b" not in err  # escape sequences from the host never reach the terminal


async def test_endless_file_is_stopped_by_the_byte_limit(hostile: HostileServer, tmp_path: Path) -> None:
    hostile.scenarios["endless"] = Scenario(
        entries=[["small", "file", 5, 0o644, None], ["zero", "file", 0, 0o644, None]],
        contents={"zero": ENDLESS},  # /dev/zero or a FIFO on the host's side: never ends
    )
    src, results = workspace(tmp_path)
    before = snapshot(tmp_path)
    limit = 3 * 1024 * 1024 + 17
    with pytest.raises(TransferError) as info:
        await execute_remote(
            hostile.machine(),
            "true",
            RemoteOptions(job_name="endless", results_dir=results, base_dir=src,
                          limits=CopyLimits(max_bytes=limit)),
            stdout=(),
            stderr=(),
        )
    message = str(info.value)
    assert f"copy-back limit of {limit} bytes" in message
    assert "--max-result-bytes" in message and "stay on the host" in message
    after = snapshot(tmp_path)
    assert_only_job_changes(before, after, ["endless"])
    # nothing half-copied is left: no result folder, no staging folder
    assert not_output(os.listdir(results)) == []
    # the host keeps its results: they were never removed
    assert not any(isinstance(r, P.Remove) for r in hostile.requests)


async def test_a_stalled_download_is_abandoned(
    hostile: HostileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that never delivers (an idle FIFO on the host) times out; the rest still comes."""
    warned: list[str] = []
    monkeypatch.setattr(ssh, "SFTP_READ_TIMEOUT", 0.5)
    hostile.scenarios["stall"] = Scenario(
        entries=[["fifo_as_file", "file", 0, 0o644, None], ["after", "file", 5, 0o644, None]],
        contents={"fifo_as_file": STALL},
    )
    src, results = workspace(tmp_path)
    code = await execute_remote(
        hostile.machine(), "true",
        RemoteOptions(job_name="stall", results_dir=results, base_dir=src),
        stdout=(), stderr=(), warn=warned.append,
    )
    assert code == 0
    assert os.listdir(results / "stall") == ["after"]  # no empty stand-in for the stalled file
    assert (results / "stall" / "after").read_bytes() == b"data of after"
    assert any("fifo_as_file: not copied" in w for w in warned), warned


async def test_an_unreadable_file_is_skipped_and_its_error_escaped(
    hostile: HostileServer, tmp_path: Path
) -> None:
    warned: list[str] = []
    hostile.scenarios["denied"] = Scenario(
        entries=[["secret", "file", 5, 0o644, None], ["fine", "file", 5, 0o644, None]],
        contents={"secret": asyncssh.SFTPPermissionDenied("\x1b[2J\x1b]0;owned\x07 no")},
    )
    src, results = workspace(tmp_path)
    code = await execute_remote(
        hostile.machine(), "true",
        RemoteOptions(job_name="denied", results_dir=results, base_dir=src),
        stdout=(), stderr=(), warn=warned.append,
    )
    assert code == 0
    assert os.listdir(results / "denied") == ["fine"]
    err = "\n".join(warned)
    assert "secret: not copied" in err and "\\x1b[2J" in err
    assert "\x1b" not in err and "\x07" not in err


async def test_manifest_flood_is_stopped_by_max_files(hostile: HostileServer, tmp_path: Path) -> None:
    count = 100_001  # one more than the default limit
    hostile.scenarios["flood"] = Scenario(
        entries=lambda: [[f"f{i}", "file", 1, 0o644, None] for i in range(count)]
    )
    src, results = workspace(tmp_path)
    with pytest.raises(TransferError) as info:
        await execute_remote(
            hostile.machine(), "true",
            RemoteOptions(job_name="flood", results_dir=results, base_dir=src),
            stdout=(), stderr=(),
        )
    assert f"holds {count} entries, over the copy-back limit of 100000 files" in str(info.value)
    assert "--max-result-files" in str(info.value)
    assert hostile.opened == []  # refused before a single download
    assert not_output(os.listdir(results)) == []


async def test_malformed_manifest_is_a_copy_failure(hostile: HostileServer, tmp_path: Path) -> None:
    hostile.scenarios["weird"] = Scenario(entries=5)  # type: ignore[arg-type]
    src, results = workspace(tmp_path)
    with pytest.raises(TransferError, match="malformed"):
        await execute_remote(
            hostile.machine(), "true",
            RemoteOptions(job_name="weird", results_dir=results, base_dir=src),
            stdout=(), stderr=(),
        )
    assert not_output(os.listdir(results)) == []


async def test_an_endless_agent_line_is_refused(hostile: HostileServer, tmp_path: Path) -> None:
    hostile.endless_hello = True
    src, results = workspace(tmp_path)
    with pytest.raises(TransportError, match="longer than"):
        await execute_remote(
            hostile.machine(), "true",
            RemoteOptions(job_name="line", results_dir=results, base_dir=src),
            stdout=(), stderr=(),
        )


async def test_a_malformed_cache_answer_is_a_transport_error(hostile: HostileServer, tmp_path: Path) -> None:
    hostile.bad_have = True
    src, results = workspace(tmp_path)
    with pytest.raises(TransportError, match="malformed answer"):
        await execute_remote(
            hostile.machine(), "true",
            RemoteOptions(job_name="have", results_dir=results, base_dir=src),
            stdout=(), stderr=(),
        )


async def test_uploads_go_only_into_the_host_cache(hostile: HostileServer, tmp_path: Path) -> None:
    hostile.missing_all = True
    hostile.scenarios["up"] = Scenario(entries=[["out.txt", "file", 3, 0o644, None]])
    src, results = workspace(tmp_path)
    code = await execute_remote(
        hostile.machine(), "true",
        RemoteOptions(job_name="up", results_dir=results, base_dir=src),
        stdout=(), stderr=(),
    )
    assert code == 0
    assert list(hostile.uploaded) == [next(iter(hostile.uploaded))]
    (path,) = hostile.uploaded
    assert path.startswith("/evil/cache/") and hostile.uploaded[path] == b"input\n"
    assert (results / "up" / "out.txt").read_bytes() == b"data of out.txt"


async def test_batch_goes_on_when_one_copy_back_fails(hostile: HostileServer, tmp_path: Path) -> None:
    hostile.scenarios.update(
        {
            "ok1": Scenario(entries=[["r.txt", "file", 5, 0o644, None]], output=b"one\n"),
            "flood": Scenario(entries=lambda: [[f"f{i}", "file", 1, 0o644, None] for i in range(1001)]),
            "endless": Scenario(entries=[["zero", "file", 0, 0o644, None]], contents={"zero": ENDLESS}),
            "evil": Scenario(entries=EVIL_ENTRIES),
            "weird": Scenario(entries={"not": "a list"}),  # type: ignore[arg-type]
            "ok2": Scenario(entries=[["r.txt", "file", 5, 0o644, None]], output=b"two\n"),
        }
    )
    src, results = workspace(tmp_path)
    names = ["ok1", "flood", "endless", "evil", "weird", "ok2"]
    jobs = [Job(name, f"echo {name}", i + 1) for i, name in enumerate(names)]
    before, outside_before = snapshot(tmp_path), outside_state()
    out: list[str] = []
    err: list[str] = []
    summary = await run_batch(
        jobs,
        [hostile.machine()],
        BatchOptions(
            needs=Needs(cpus=0.01, memory_mb=1, gpus=0, gpu_memory_mb=0),
            gpus_explicit=True,
            results_dir=results,
            base_dir=src,
            limits=CopyLimits(max_bytes=1 << 20, max_files=1000),
            probe_interval=3600,
        ),
        out=out.append,
        err=err.append,
    )
    outcomes = summary.outcomes
    assert set(outcomes) == set(names)
    assert outcomes["ok1"].ok and outcomes["ok2"].ok and outcomes["evil"].ok
    assert not outcomes["flood"].ok and "over the copy-back limit of 1000 files" in (outcomes["flood"].message or "")
    assert not outcomes["endless"].ok and "copy-back limit of 1048576 bytes" in (outcomes["endless"].message or "")
    assert not outcomes["weird"].ok and "malformed list of results" in (outcomes["weird"].message or "")
    assert (results / "ok1" / "r.txt").read_bytes() == b"data of r.txt"
    assert (results / "ok2" / "r.txt").read_bytes() == b"data of r.txt"
    assert not any((results / name).exists() for name in ("flood", "endless", "weird"))
    after = snapshot(tmp_path)
    assert_only_job_changes(before, after, names)
    assert outside_state() == outside_before
    for name in names:
        if (results / name).exists():
            assert_links_inside(results / name)
    assert any("copy back failed" in line and "flood" in line for line in err), err


@pytest.mark.parametrize(
    ("rel", "target", "ok"),
    [
        ("l", "x", True),
        ("l", "x/y/../z", False),  # '..' after a name: resolved after following x
        ("l", "..", False),
        ("a/l", "..", True),
        ("a/l", "../..", False),
        ("a/b/l", "../../c", True),
        ("a/b/l", "../../../c", False),
        ("a/b/l", "./../.././c/./d/", True),
        ("l", "/etc/passwd", False),
        ("l", "", False),
        ("l", "a\x00b", False),
        ("l", "\ud800", False),
        ("l", "\udcff", True),
    ],
)
def test_link_rule(rel: str, target: str, ok: bool) -> None:
    assert link_stays_inside(rel, target) is ok


# --- small files in bulk (the agent's fetch): the same checks as SFTP, whatever the host answers --


async def test_bulk_answers_name_no_place(hostile: HostileServer, tmp_path: Path) -> None:
    """A fetch answer carrying files nobody asked for (escaping names among them) writes none of
    them: answers are matched to what was asked, never trusted to name a place."""
    hostile.fetch_lies = True
    hostile.scenarios["liar"] = Scenario(entries=[["a.txt", "file", 14, 0o644, None], ["sub/b.txt", "file", 18, 0o600, None]])
    src, results = workspace(tmp_path)
    before, outside_before = snapshot(tmp_path), outside_state()
    code = await execute_remote(
        hostile.machine(), "true", RemoteOptions(job_name="liar", results_dir=results, base_dir=src), stdout=(), stderr=(),
    )
    assert code == 0
    fetches = [r for r in hostile.requests if isinstance(r, P.Fetch)]
    assert fetches and fetches[0].paths == ["a.txt", "sub/b.txt"]  # the files came in bulk
    assert hostile.opened == [f"{fetches[0].dir}/a.txt", f"{fetches[0].dir}/sub/b.txt"]  # no SFTP
    after = snapshot(tmp_path)
    assert_only_job_changes(before, after, ["liar"])
    assert outside_state() == outside_before
    job = results / "liar"
    assert sorted(str(p.relative_to(job)) for p in job.rglob("*")) == ["a.txt", "sub", "sub/b.txt"]
    assert (job / "a.txt").read_bytes() == b"data of a.txt"
    assert (job / "sub" / "b.txt").read_bytes() == b"data of sub/b.txt"
    assert stat.S_IMODE((job / "sub" / "b.txt").stat().st_mode) == 0o600


async def test_a_result_folder_replaced_by_a_link_mid_copy(hostile: HostileServer, tmp_path: Path) -> None:
    """While the copy runs, a folder already made in the staging area is swapped for a symlink
    to a folder outside: files still to come for it are refused, nothing lands outside."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    big = b"B" * 300_000  # above bulk.SMALL_FILE: it comes by SFTP, between the small ones
    hostile.scenarios["swap"] = Scenario(
        entries=[["sub/first", "file", 14, 0o644, None], ["big", "file", len(big), 0o644, None],
                 ["sub/second", "file", 15, 0o644, None], ["other/third", "file", 16, 0o644, None]],
        contents={"big": big},
    )
    swapped: list[Path] = []

    def swap(path: str) -> None:
        if path.endswith("/big"):
            (staging,) = results.glob(".partial-swap-*")
            os.rename(staging / "sub", tmp_path / "moved-away")
            os.symlink(elsewhere, staging / "sub")
            swapped.append(staging)

    hostile.on_read = swap
    warned: list[str] = []
    src, results = workspace(tmp_path)
    code = await execute_remote(
        hostile.machine(), "true", RemoteOptions(job_name="swap", results_dir=results, base_dir=src),
        stdout=(), stderr=(), warn=warned.append,
    )
    assert code == 0
    assert swapped  # the swap really happened mid-copy
    assert any(isinstance(r, P.Fetch) for r in hostile.requests)
    assert os.listdir(elsewhere) == []  # nothing went through the link
    assert (tmp_path / "moved-away" / "first").read_bytes() == b"data of sub/first"
    job = results / "swap"
    assert (job / "big").read_bytes() == big
    assert (job / "other" / "third").read_bytes() == b"data of other/third"
    assert os.readlink(job / "sub") == str(elsewhere)  # the planted link itself, not followed
    assert any("sub/second: refused" in w for w in warned), warned


async def test_an_agent_without_bulk_requests_gets_files_by_sftp(hostile: HostileServer, tmp_path: Path) -> None:
    """A reattached agent of an older version answers put / fetch with an error: every file
    still goes out and comes back, one by one by SFTP."""
    hostile.without_bulk = True
    hostile.missing_all = True
    hostile.scenarios["old"] = Scenario(entries=[["r1.txt", "file", 15, 0o644, None], ["r2.txt", "file", 15, 0o644, None]])
    src, results = workspace(tmp_path)
    code = await execute_remote(
        hostile.machine(), "true", RemoteOptions(job_name="old", results_dir=results, base_dir=src), stdout=(), stderr=(),
    )
    assert code == 0
    assert {type(r) for r in hostile.requests} >= {P.Put, P.Fetch}  # asked, refused
    (uploaded,) = hostile.uploaded.values()
    assert uploaded == b"input\n"  # by SFTP after the refused put
    assert [p.rsplit("/", 1)[-1] for p in hostile.opened] == ["r1.txt", "r2.txt"]  # by SFTP
    assert (results / "old" / "r1.txt").read_bytes() == b"data of r1.txt"
    assert (results / "old" / "r2.txt").read_bytes() == b"data of r2.txt"


def not_output(names: list[str]) -> list[str]:
    """What is left in job_results besides the job's .out/.err (each there only if it printed)."""
    return sorted(n for n in names if not n.endswith((".out", ".err")))
