"""combine_folders: merging result folders without ever clobbering DEST or leaking through links."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError, ConflictError, SchedulerError, TransferError
from ssh_scheduler.results.combine import _execute, combine_folders
from ssh_scheduler.results.combine_plan import CombineConflictError, CombineReport, plan_combine


def write(path: Path, content: str | bytes = "x", mode: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    if mode is not None:
        path.chmod(mode)
    return path


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything observable about a tree, links not followed: type, mode, size, mtime, content."""
    if not os.path.lexists(root):
        return {}
    result: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                body: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                body = Path(path).read_bytes()
            else:
                body = None
            result[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, body)
    return result


def files_in(root: Path) -> set[str]:
    return set(snapshot(root))


def run(
    dest: Path, *sources: Path, dry_run: bool = False
) -> tuple[CombineReport, list[str], list[str]]:
    out: list[str] = []
    warnings: list[str] = []
    report = combine_folders(
        dest, list(sources), dry_run=dry_run, out=out.append, warn=warnings.append
    )
    return report, out, warnings


# ------------------------------------------------------------------------------------------
# Merging
# ------------------------------------------------------------------------------------------


def test_identical_files_collapse(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    write(a / "same.txt", "hello")
    write(b / "same.txt", "hello")
    report, _, warnings = run(dest, a, b)
    assert (dest / "same.txt").read_text() == "hello"
    assert files_in(dest) == {"same.txt"}
    assert (report.copied, report.identical, report.links, report.skipped) == (1, 1, 0, ())
    assert warnings == []


def test_different_paths_all_included_with_nested_dirs(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    write(a / "job1" / "out" / "log.txt", "1")
    write(a / "shared" / "x.txt", "x")
    write(b / "job2" / "deep" / "er" / "log.txt", "2")
    write(b / "shared" / "y.txt", "y")
    (b / "empty").mkdir()
    report, _, _ = run(dest, a, b)
    assert files_in(dest) == {
        "job1",
        "job1/out",
        "job1/out/log.txt",
        "shared",
        "shared/x.txt",
        "shared/y.txt",
        "job2",
        "job2/deep",
        "job2/deep/er",
        "job2/deep/er/log.txt",
        "empty",
    }
    assert (dest / "job2" / "deep" / "er" / "log.txt").read_text() == "2"
    assert report.copied == 4
    assert not any(".tmp" in name for name in files_in(dest))


def test_conflicts_all_listed_and_dest_untouched(tmp_path: Path) -> None:
    a, b, c, dest = tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "dest"
    write(dest / "keep.txt", "old")
    write(dest / "sub" / "kept.txt", "old too")
    write(a / "one.txt", "A")
    write(b / "one.txt", "B")  # same size, different bytes: found by hash
    write(a / "sub" / "two.txt", "short")
    write(c / "sub" / "two.txt", "much longer")  # found by size
    write(a / "new.txt", "would be new")  # would be fine, but nothing may be written
    write(b / "keep.txt", "new")
    before = snapshot(dest)

    with pytest.raises(CombineConflictError) as info:
        run(dest, a, b, c)

    assert snapshot(dest) == before
    err = info.value
    assert isinstance(err, ConflictError) and isinstance(err, SchedulerError)
    by_path = {conflict.path: conflict for conflict in err.conflicts}
    assert set(by_path) == {"one.txt", "sub/two.txt", "keep.txt"}
    assert by_path["one.txt"].sources == (str(a), str(b))
    assert by_path["sub/two.txt"].sources == (str(a), str(c))
    assert by_path["keep.txt"].sources == (str(dest), str(b))
    message = str(err)
    assert "\n" not in message
    for path in by_path:
        assert path in message


def test_conflict_into_missing_dest_creates_nothing(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    write(a / "f", "1")
    write(b / "f", "2")
    with pytest.raises(ConflictError):
        run(dest, a, b)
    assert not os.path.lexists(dest)


def test_many_conflicts_message_is_capped_but_list_complete(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    for i in range(30):
        write(a / f"f{i:02}", "1")
        write(b / f"f{i:02}", "2")
    with pytest.raises(CombineConflictError) as info:
        run(dest, a, b)
    assert len(info.value.conflicts) == 30
    assert "30 conflicting" in str(info.value)
    assert "and 10 more" in str(info.value)
    assert "f29" not in str(info.value)


def test_dest_with_same_content_is_fine_and_not_rewritten(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(a / "r" / "result.txt", "42")
    write(a / "other.txt", "new")
    existing = write(dest / "r" / "result.txt", "42")
    os.utime(existing, ns=(1_000_000_000, 1_000_000_000))
    inode = existing.stat().st_ino

    report, _, _ = run(dest, a)

    assert existing.stat().st_ino == inode
    assert existing.stat().st_mtime_ns == 1_000_000_000
    assert (dest / "other.txt").read_text() == "new"
    assert (report.copied, report.identical) == (1, 1)


def test_dest_with_different_content_is_a_conflict(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(a / "result.txt", "42")
    write(dest / "result.txt", "41")
    before = snapshot(dest)
    with pytest.raises(CombineConflictError) as info:
        run(dest, a)
    assert [c.path for c in info.value.conflicts] == ["result.txt"]
    assert snapshot(dest) == before


def test_file_versus_directory_is_a_conflict(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    write(a / "out", "a file")
    write(b / "out" / "inside.txt", "a dir")
    write(a / "d", "file here")
    (dest / "d").mkdir(parents=True)  # ...but a directory in DEST
    before = snapshot(dest)
    with pytest.raises(CombineConflictError) as info:
        run(dest, a, b)
    reasons = {c.path: c.reason for c in info.value.conflicts}
    assert set(reasons) == {"out", "d"}
    assert "directory" in reasons["out"] and "file" in reasons["out"]
    assert "directory" in reasons["d"]
    assert snapshot(dest) == before


def test_executable_bit_and_mtime_kept_setuid_dropped(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    script = write(a / "run.sh", "#!/bin/sh\n", mode=0o755)
    private = write(a / "secret", "s", mode=0o600)
    setuid = write(a / "suid", "s", mode=0o4755)
    os.utime(script, ns=(2_000_000_000, 3_000_000_000))
    run(dest, a)
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o755
    assert (dest / "run.sh").stat().st_mtime_ns == 3_000_000_000
    assert stat.S_IMODE((dest / "secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((dest / "suid").stat().st_mode) == 0o755
    assert private.read_text() == "s" and setuid.exists()


def test_read_only_source_directory_mode_is_kept(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(a / "ro" / "f.txt", "x")
    (a / "ro").chmod(0o555)
    try:
        run(dest, a)
        assert (dest / "ro" / "f.txt").read_text() == "x"
        assert stat.S_IMODE((dest / "ro").stat().st_mode) == 0o555
    finally:
        (a / "ro").chmod(0o755)
        if (dest / "ro").exists():
            (dest / "ro").chmod(0o755)


def test_unrelated_dest_content_is_left_alone(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(dest / "old_batch" / "r.txt", "old")
    write(a / "new_batch" / "r.txt", "new")
    before = snapshot(dest)
    run(dest, a)
    after = snapshot(dest)
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) - set(before) == {"new_batch", "new_batch/r.txt"}


def test_large_file_is_copied_exactly(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    blob = os.urandom(3 * 1024 * 1024 + 17)
    write(a / "big.bin", blob)
    write(b / "big.bin", blob)
    report, _, _ = run(dest, a, b)
    assert (dest / "big.bin").read_bytes() == blob
    assert (report.copied, report.identical) == (1, 1)


def test_conflict_message_stays_one_line_for_odd_names(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    write(a / "odd\nname", "1")
    write(b / "odd\nname", "2")
    with pytest.raises(CombineConflictError) as info:
        run(dest, a, b)
    assert "\n" not in str(info.value)
    assert info.value.conflicts[0].path == "odd\nname"


def test_symlinked_source_root_is_used(tmp_path: Path) -> None:
    real, dest = tmp_path / "real", tmp_path / "dest"
    write(real / "r.txt", "r")
    (tmp_path / "alias").symlink_to(real)
    run(dest, tmp_path / "alias")
    assert (dest / "r.txt").read_text() == "r"


# ------------------------------------------------------------------------------------------
# Symlinks and special files
# ------------------------------------------------------------------------------------------


def test_symlink_to_etc_passwd_does_not_leak(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(a / "ok.txt", "fine")
    (a / "passwd").symlink_to("/etc/passwd")
    depth = len(a.parts)
    (a / "sneaky").symlink_to("../" * depth + "etc/passwd")  # relative, but leaves the tree

    report, _, warnings = run(dest, a)

    assert files_in(dest) == {"ok.txt"}
    assert not os.path.lexists(dest / "passwd") and not os.path.lexists(dest / "sneaky")
    assert len(warnings) == 2
    assert any("passwd" in w and "absolute" in w for w in warnings)
    assert any("sneaky" in w and "leaves the tree" in w for w in warnings)
    assert report.skipped == tuple(warnings)
    for path in dest.rglob("*"):
        if path.is_file():
            assert b"root:" not in path.read_bytes()


def test_relative_in_tree_symlinks_are_recreated(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(a / "data" / "result.txt", "r")
    (a / "latest").symlink_to("data/result.txt")
    (a / "data" / "self").symlink_to("../data")  # a directory link: recreated, never walked
    (a / "dangling").symlink_to("not/there")

    report, _, warnings = run(dest, a)

    assert os.readlink(dest / "latest") == "data/result.txt"
    assert (dest / "latest").read_text() == "r"
    assert os.readlink(dest / "data" / "self") == "../data"
    assert os.readlink(dest / "dangling") == "not/there"
    assert report.links == 3 and warnings == []


def test_symlink_escaping_through_another_in_tree_symlink_is_skipped(tmp_path: Path) -> None:
    # Textually "s/../x" stays inside; physically s is the tree root, so s/.. is outside it.
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(tmp_path / "x", "outside")
    (a / "p" / "q").mkdir(parents=True)
    (a / "p" / "q" / "s").symlink_to("../..")
    (a / "p" / "q" / "l").symlink_to("s/../x")
    (a / "loop").symlink_to("loop")

    report, _, warnings = run(dest, a)

    assert os.readlink(dest / "p" / "q" / "s") == "../.."
    assert not os.path.lexists(dest / "p" / "q" / "l")
    assert not os.path.lexists(dest / "loop")
    assert len(warnings) == 2 and report.links == 1


def test_same_link_collapses_different_targets_conflict(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    for src in (a, b):
        write(src / "data.txt", "d")
        (src / "same").symlink_to("data.txt")
    (a / "differs").symlink_to("data.txt")
    (b / "differs").symlink_to("same")
    with pytest.raises(CombineConflictError) as info:
        run(dest, a, b)
    assert [(c.path, c.reason) for c in info.value.conflicts] == [
        ("differs", "different symlink targets")
    ]
    (b / "differs").unlink()
    report, _, _ = run(dest, a, b)
    assert os.readlink(dest / "same") == "data.txt"
    assert (report.links, report.identical) == (2, 2)


def test_symlinked_directory_pointing_outside_is_not_followed(tmp_path: Path) -> None:
    a, dest, outside = tmp_path / "a", tmp_path / "dest", tmp_path / "outside"
    write(outside / "secret.txt", "secret")
    write(a / "ok.txt", "fine")
    (a / "abs").symlink_to(outside)
    (a / "rel").symlink_to("../outside")

    _, _, warnings = run(dest, a)

    assert files_in(dest) == {"ok.txt"}
    assert len(warnings) == 2
    assert not any(p.name == "secret.txt" for p in dest.rglob("*"))


def test_symlink_planted_in_dest_is_never_written_through(tmp_path: Path) -> None:
    a, dest, elsewhere = tmp_path / "a", tmp_path / "dest", tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest.mkdir()
    (dest / "sub").symlink_to(elsewhere)
    (dest / "file.txt").symlink_to(elsewhere / "target.txt")
    write(a / "sub" / "result.txt", "r")
    write(a / "file.txt", "f")
    before = snapshot(dest)

    with pytest.raises(CombineConflictError) as info:
        run(dest, a)

    assert {c.path for c in info.value.conflicts} == {"sub", "file.txt"}
    assert list(elsewhere.iterdir()) == []
    assert snapshot(dest) == before


def test_source_link_through_dest_symlink_is_not_recreated(tmp_path: Path) -> None:
    # Inside its own source the link dangles harmlessly; in DEST it would lead out through DEST's
    # own planted link.
    a, dest = tmp_path / "a", tmp_path / "dest"
    dest.mkdir()
    (dest / "m").symlink_to("/etc")
    (a / "d").mkdir(parents=True)
    (a / "d" / "l").symlink_to("../m/passwd")

    _, _, warnings = run(dest, a)

    assert not os.path.lexists(dest / "d" / "l")
    assert len(warnings) == 1 and "absolute" in warnings[0]


def test_symlink_planted_in_dest_after_planning_is_not_written_through(tmp_path: Path) -> None:
    a, dest, elsewhere = tmp_path / "a", tmp_path / "dest", tmp_path / "elsewhere"
    elsewhere.mkdir()
    write(a / "sub" / "result.txt", "r")
    dest.mkdir()
    plan = plan_combine(dest, [a])
    (dest / "sub").symlink_to(elsewhere)  # the race: swapped in between plan and write
    with pytest.raises(TransferError):
        _execute(plan, lambda line: None)
    assert list(elsewhere.iterdir()) == []


def test_file_appearing_after_planning_is_not_overwritten(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(a / "f.txt", "from source")
    write(a / "g.txt", "g")
    plan = plan_combine(dest, [a])
    write(dest / "f.txt", "someone else's")
    warnings: list[str] = []
    report = _execute(plan, warnings.append)
    assert (dest / "f.txt").read_text() == "someone else's"
    assert (dest / "g.txt").read_text() == "g"
    assert report.copied == 1 and len(warnings) == 1 and "not overwritten" in warnings[0]
    assert files_in(dest) == {"f.txt", "g.txt"}  # no temp file left behind


def test_fifo_is_skipped_with_a_warning(tmp_path: Path) -> None:
    a, dest = tmp_path / "a", tmp_path / "dest"
    write(a / "ok.txt", "fine")
    os.mkfifo(a / "pipe")
    report, _, warnings = run(dest, a)
    assert files_in(dest) == {"ok.txt"}
    assert len(warnings) == 1 and "pipe" in warnings[0] and "FIFO" in warnings[0]
    assert report.skipped == tuple(warnings)


# ------------------------------------------------------------------------------------------
# Dry run, arguments, scale
# ------------------------------------------------------------------------------------------


def test_dry_run_lists_copies_and_writes_nothing(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    write(a / "x" / "1.txt", "1")
    write(b / "2.txt", "2")
    write(b / "x" / "1.txt", "1")
    (b / "ln").symlink_to("2.txt")

    report, out, _ = run(dest, a, b, dry_run=True)

    assert not os.path.lexists(dest)
    assert out == [
        f"copy {b}/2.txt -> {dest}/2.txt",
        f"copy {a}/x/1.txt -> {dest}/x/1.txt",
        f"link {dest}/ln -> 2.txt",
    ]
    assert (report.copied, report.identical, report.links) == (2, 1, 1)


def test_missing_source_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        run(tmp_path / "dest", tmp_path / "nope")
    write(tmp_path / "file", "x")
    with pytest.raises(ConfigError, match="not a directory"):
        run(tmp_path / "dest", tmp_path / "file")
    assert not os.path.lexists(tmp_path / "dest")


def test_source_and_dest_nesting_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    write(dest / "inner" / "f", "x")
    write(tmp_path / "src" / "f", "x")
    with pytest.raises(ConfigError, match="inside destination"):
        run(dest, dest / "inner")
    with pytest.raises(ConfigError, match="is the destination"):
        run(dest, dest)
    with pytest.raises(ConfigError, match="inside source"):
        run(tmp_path / "src" / "out", tmp_path / "src")
    with pytest.raises(ConfigError, match="given twice"):
        run(tmp_path / "d2", tmp_path / "src", tmp_path / "src")


def test_dest_that_is_a_file_or_dangling_link_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "src" / "f", "x")
    write(tmp_path / "dest_file", "x")
    with pytest.raises(ConfigError, match="not a directory"):
        run(tmp_path / "dest_file", tmp_path / "src")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="dangling"):
        run(tmp_path / "dangling", tmp_path / "src")
    assert not os.path.lexists(tmp_path / "nowhere")


def test_smoke_two_thousand_files(tmp_path: Path) -> None:
    sources = [tmp_path / f"s{i}" for i in range(3)]
    for i in range(2000):
        content = f"file {i}\n"
        if i % 3 == 0:  # a third shared by every source, byte-identical
            for source in sources:
                write(source / f"d{i % 17}" / f"f{i}.txt", content)
        else:
            write(sources[i % 3] / f"d{i % 17}" / f"f{i}.txt", content)
    dest = tmp_path / "dest"

    report, _, warnings = run(dest, *sources)

    expected = {f"d{i % 17}/f{i}.txt" for i in range(2000)}
    copied = {p for p in files_in(dest) if "/" in p}
    assert copied == expected
    assert report.copied == 2000
    assert report.identical == 2 * len(range(0, 2000, 3))
    assert warnings == []
    assert (dest / f"d{1999 % 17}" / "f1999.txt").read_text() == "file 1999\n"


def test_copy_falls_back_to_read_write_without_sendfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_sendfile(*args: object) -> int:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sendfile", no_sendfile)
    a, dest = tmp_path / "a", tmp_path / "dest"
    blob = os.urandom(2 * 1024 * 1024 + 3)
    write(a / "big.bin", blob)
    write(a / "empty", b"")
    run(dest, a)
    assert (dest / "big.bin").read_bytes() == blob
    assert (dest / "empty").read_bytes() == b""


def test_dry_run_escapes_what_a_host_named(tmp_path: Path) -> None:
    # A result file named by a hostile host: an escape sequence and a newline in it.
    a = tmp_path / "a"
    write(a / "x\x1b]0;pwned\x07\nfake line", "1")
    (a / "l\x1b[2J").symlink_to("x\x1b[31m")
    _, out, _ = run(tmp_path / "dest", a, dry_run=True)
    assert len(out) == 2 and all(line.isprintable() for line in out), out
    assert out[0] == f"copy {a}/x\\x1b]0;pwned\\x07\\nfake line -> {tmp_path}/dest/x\\x1b]0;pwned\\x07\\nfake line"
    assert out[1] == f"link {tmp_path}/dest/l\\x1b[2J -> x\\x1b[31m"


@pytest.mark.parametrize("git", [".git", ".GIT", "sub/.git"])
def test_nothing_named_git_is_merged(tmp_path: Path, git: str) -> None:
    """A source's .git/hooks would become DEST's: the next git command in DEST runs them."""
    dest = tmp_path / "dest"
    write(dest / ".git" / "HEAD", "ref: refs/heads/main\n")
    write(dest / "sub" / ".git", "gitdir: ../.git\n")
    a = tmp_path / "a"
    write(a / git / "hooks" / "post-checkout", "#!/bin/sh\ntouch /tmp/pwned\n", mode=0o755)
    write(a / git / "config", "[core]\n\tfsmonitor = touch /tmp/pwned\n")
    write(a / "result.txt", "kept")
    before = snapshot(dest)
    report, out, warnings = run(dest, a, dry_run=True)
    assert out == [f"copy {a}/result.txt -> {dest}/result.txt"]
    report, _, warnings = run(dest, a)
    assert report.copied == 1 and warnings == [f"skipped {a}/{git}: a .git is never merged (its hooks would run in DEST)"]
    after = snapshot(dest)
    assert set(after) - set(before) == {"result.txt"}
    assert {k: v for k, v in after.items() if k != "result.txt"} == before
