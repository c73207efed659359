"""Copy forward, before anything is sent: gitignore patterns, secrets withheld, the size stop and
the paths a ``--commands`` line may copy (pure: plain folders, no SSH)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ssh_scheduler.errors import TransferError
from ssh_scheduler.jobs.batch_file import parse_batch
from ssh_scheduler.jobs.forward import (
    ForwardPolicy,
    Hasher,
    check_forward_size,
    check_job_copies,
    collect_forward,
    describe_forward,
)
from ssh_scheduler.jobs.ignore import IgnoreRules, compile_pattern

FAKE_KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"

# --- gitignore patterns (expected values checked against `git check-ignore --no-index`) ----------

IGNORE_CASES = [
    # (patterns, path, is_dir, ignored)
    (["*.log"], "x.log", False, True),
    (["*.log"], "d/e/x.log", False, True),
    (["*.log"], "x.logs", False, False),
    (["*.log", "!keep.log"], "keep.log", False, False),
    (["*.log", "!keep.log"], "d/keep.log", False, False),
    (["*.log", "!keep.log"], "d/other.log", False, True),
    (["!keep.log", "*.log"], "keep.log", False, True),  # the last matching line wins
    (["/build"], "build", True, True),
    (["/build"], "s/build", True, False),  # leading '/': anchored
    (["build/"], "build", True, True),
    (["build/"], "build", False, False),  # trailing '/': folders only
    (["build/"], "s/build", True, True),  # ...at any depth
    (["doc/frotz/"], "doc/frotz", True, True),
    (["doc/frotz/"], "x/doc/frotz", True, False),  # a middle '/' anchors too
    (["d/*.txt"], "d/a.txt", False, True),
    (["d/*.txt"], "e/d/a.txt", False, False),
    (["a/*"], "a/c", False, True),
    (["a/*"], "a/c/d", False, False),  # '*' never crosses '/' (a/c would be pruned first)
    (["*/x"], "q/x", True, True),
    (["*/x"], "x", True, False),
    (["a/**/b"], "a/b", False, True),  # '/**/': zero folders...
    (["a/**/b"], "a/x/y/b", False, True),  # ...or several
    (["a/**/b"], "c/a/b", False, False),
    (["**/foo"], "foo", False, True),
    (["**/foo"], "q/r/foo", False, True),
    (["abc/**"], "abc/x/y", False, True),  # '/**' at the end: everything inside
    (["abc/**"], "abc", False, False),
    (["**"], "any/thing", False, True),
    (["a**b"], "aXb", False, True),  # '**' inside a segment is a plain '*'
    (["a**b"], "aX/b", False, False),
    (["foo?"], "foo1", False, True),
    (["foo?"], "fooab", False, False),
    (["foo?"], "foo/", False, False),
    (["[a-c]x"], "bx", False, True),
    (["[a-c]x"], "dx", False, False),
    (["[!a-c]x"], "dx", False, True),
    (["[!a-c]x"], "ax", False, False),
    (["[^a-c]x"], "dx", False, True),
    (["[]]z"], "]z", False, True),
    (["[ab"], "[ab", False, True),  # an unclosed '[' is a literal
    (["\\#hash"], "#hash", False, True),
    (["#hash"], "#hash", False, False),  # a comment
    (["\\!bang"], "!bang", False, True),
    (["sp "], "sp", False, True),  # trailing spaces dropped...
    (["sp\\ "], "sp ", False, True),  # ...unless escaped
    (["sp\\ "], "sp", False, False),
    (["a\\*b"], "a*b", False, True),
    (["a\\*b"], "axb", False, False),
    (["", "# comment", "   "], "x", False, False),
    # escapes and edges inside a class, and names holding a newline (the mutation run's finds)
    (["[\\]]x"], "]x", False, True),
    (["[a\\-c]"], "-", False, True),  # an escaped '-' is no range
    (["[a\\-c]"], "b", False, False),
    (["[a-]"], "-", False, True),
    (["[\\!a]"], "!", False, True),  # an escaped '!' is no negation
    (["[\\!a]"], "b", False, False),
    (["[\\a]"], "a", False, True),
    (["[\\\\]"], "\\", False, True),
    (["[]a]"], "a", False, True),
    (["[!a]x"], "bx", False, True),
    (["[!a]x"], "ax", False, False),
    (["a**b"], "axyb", False, True),
    (["*.log"], "a\nb.log", False, True),  # '*' and '?' match a newline in a name, as git's do
    (["a?b"], "a\nb", False, True),
    (["abc/**"], "abc/a\nb", False, True),  # ...and '**' does too
    (["**/foo"], "a\nb/foo", False, True),
    (["a/**/b"], "a/x\ny/b", False, True),
    (["x", "abc/**"], "abc/a\nb", False, True),  # (all rules at once: one regex)
]


@pytest.mark.parametrize(("patterns", "path", "is_dir", "ignored"), IGNORE_CASES)
def test_gitignore_patterns(patterns: list[str], path: str, is_dir: bool, ignored: bool) -> None:
    assert IgnoreRules(patterns).ignored(path, is_dir) is ignored


def test_negation_names_the_rule_that_decided() -> None:
    rules = IgnoreRules(["data/*", "!data/keep.csv"])
    rule = rules.match("data/keep.csv", False)
    assert rule is not None and rule.negate and rule.pattern == "!data/keep.csv"
    assert compile_pattern("# only a comment") is None
    assert compile_pattern("!") is None


# --- the walk -------------------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _sent(base: Path, paths: tuple[str, ...] = (".",), **policy: bool) -> set[str]:
    forward = collect_forward(paths, base, Hasher(), policy=ForwardPolicy(**policy))
    return {f.rel for f in forward.files}


def test_default_copy_withholds_secrets(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "train.py": b"print(1)\n",
            ".ssh/id_ed25519": FAKE_KEY,
            ".ssh/config": b"Host x\n",
            ".gnupg/pubring.kbx": b"x",
            ".aws/credentials": b"[default]\n",
            ".kube/config": b"x",
            ".netrc": b"machine x login y password z\n",
            ".pgpass": b"*:*:*:*:pw\n",
            ".docker/config.json": b"{}",
            ".docker/buildx/current": b"x",
            "sub/.config/gcloud/credentials.db": b"x",
            "deploy/id_rsa": b"not even a key",
            "certs/server.pem": b"Bag Attributes\n" + FAKE_KEY.replace(b"OPENSSH ", b"RSA "),
            "certs/ca.pem": b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
            "renamed_key": FAKE_KEY,
            "store.p12": b"x",
            "src/app.py": b"KEY = '-----BEGIN RSA PRIVATE KEY-----'\n",  # not at a line start
        },
    )
    forward = collect_forward((".",), tmp_path, Hasher())
    sent = {f.rel for f in forward.files}
    assert sent == {"train.py", ".docker/buildx/current", "certs/ca.pem", "src/app.py"}
    assert set(forward.withheld) == {
        ".ssh", ".gnupg", ".aws", ".kube", ".netrc", ".pgpass", ".docker/config.json",
        "sub/.config/gcloud", "deploy/id_rsa", "certs/server.pem", "renamed_key", "store.p12",
    }  # fmt: skip
    line = describe_forward(forward, (".",), ForwardPolicy())
    assert "withheld as secrets: " in line


def test_a_symlink_to_a_key_is_withheld(tmp_path: Path) -> None:
    secret_home = tmp_path / "home"
    _tree(secret_home, {".ssh/deploy": b"opaque token, no key header"})
    project = tmp_path / "project"
    _tree(project, {"run.sh": b"true\n"})
    (project / "token").symlink_to(secret_home / ".ssh" / "deploy")
    assert _sent(project) == {"run.sh"}


def test_named_secrets_are_refused_unless_allowed(tmp_path: Path) -> None:
    _tree(tmp_path, {".ssh/id_ed25519": FAKE_KEY, ".ssh/id_ed25519.pub": b"ssh-ed25519 AAAA x\n",
                     ".aws/credentials": b"x", "k.txt": FAKE_KEY})  # fmt: skip
    for named in (".ssh", ".ssh/id_ed25519", ".aws/credentials", "k.txt", "./.ssh/../.aws"):
        with pytest.raises(TransferError, match="--allow-secret-copies") as err:
            _sent(tmp_path, (named,))
        assert "\n" not in str(err.value)
    # Allowed: the named secret is sent, whole.
    assert _sent(tmp_path, (".aws",), allow_secrets=True) == {".aws/credentials"}
    assert _sent(tmp_path, (".ssh",), allow_secrets=True) == {".ssh/id_ed25519", ".ssh/id_ed25519.pub"}
    # A public key is not a secret, even from .ssh.
    assert _sent(tmp_path, (".ssh/id_ed25519.pub",)) == {".ssh/id_ed25519.pub"}
    # The flag lets named secrets through, never the ones a walk finds.
    assert ".ssh/id_ed25519" not in _sent(tmp_path, (".",), allow_secrets=True)


def test_ignore_file(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            ".sshschedulerignore": b"# big things\n/data/\n*.ckpt\n!best.ckpt\nlogs/**\n",
            "data/a.bin": b"x",
            "src/data/b.py": b"x",  # '/data/' is anchored: this one stays
            "m/1.ckpt": b"x",
            "m/best.ckpt": b"x",
            "logs/x/y.txt": b"x",
            "train.py": b"x",
        },
    )
    assert _sent(tmp_path) == {".sshschedulerignore", "src/data/b.py", "m/best.ckpt", "train.py"}
    # A path named explicitly is sent even when the ignore file matches it.
    assert _sent(tmp_path, ("data",)) == {"data/a.bin"}


def test_default_excludes_and_symlinked_folders_stay_home(tmp_path: Path) -> None:
    _tree(tmp_path, {"job_results/x.out": b"x", ".git/HEAD": b"x", "a.py": b"x", "elsewhere/f": b"x"})
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "a.py").write_bytes(b"x")
    (tmp_path / "proj" / "linked").symlink_to(tmp_path / "elsewhere")
    assert _sent(tmp_path / "proj") == {"a.py"}
    assert "job_results/x.out" not in _sent(tmp_path)


# --- size -----------------------------------------------------------------------------------------


def test_a_big_default_copy_stops_before_anything_is_sent(tmp_path: Path) -> None:
    _tree(tmp_path, {f"data/{i}.bin": bytes(100) for i in range(30)} | {"train.py": b"x" * 10})
    forward = collect_forward((".",), tmp_path, Hasher())
    small = ForwardPolicy(max_bytes=1000)
    with pytest.raises(TransferError) as err:
        check_forward_size(forward, (".",), small)
    message = str(err.value)
    assert "31 files" in message and "data (2.9 KiB)" in message and "--yes-copy-all" in message
    with pytest.raises(TransferError, match="--forward-max-files 10 files"):
        check_forward_size(forward, (".",), ForwardPolicy(max_files=10))
    # Confirmed, or named explicitly: sent.
    check_forward_size(forward, (".",), ForwardPolicy(max_bytes=1000, confirmed=True))
    check_forward_size(forward, ("data", "train.py"), small)
    line = describe_forward(forward, (".",), small)
    assert line.startswith("copy forward (.): 31 files, 2.9 KiB (3010 bytes); largest: data (2.9 KiB), train.py (10 bytes)")
    assert "a run would stop" in line


# --- --commands lines -----------------------------------------------------------------------------


def _jobs(text: str) -> list:  # type: ignore[type-arg]
    return parse_batch(text.encode(), "b.sh", commands_mode=True)


def test_commands_lines_copy_only_inside_the_base(tmp_path: Path) -> None:
    base = tmp_path / "proj"
    _tree(base, {"in.txt": b"x", ".ssh/id_ed25519": FAKE_KEY})
    _tree(tmp_path, {"outside/secret.txt": b"x"})
    (base / "out_link").symlink_to(tmp_path / "outside")
    os.symlink(tmp_path / "outside" / "secret.txt", base / "file_link")
    cases = {
        "--copy-forwards /etc/hostname 'cat hostname'": "is an absolute path",
        "--copy-forwards ../outside 'ls'": "contains '..'",
        "--copy-forwards in.txt ../../etc/hostname 'ls'": "contains '..'",
        "--copy-forwards out_link 'ls'": "leads out of it through a symlink",
        "--copy-forwards file_link 'ls'": "leads out of it through a symlink",
        "--copy-backwards ../../x 'ls'": "contains '..'",
        "--copy-backwards /tmp 'ls'": "is an absolute path",
        "--copy-forwards .ssh/id_ed25519 'ls'": "--allow-secret-copies",
    }
    for line, reason in cases.items():
        jobs = _jobs(f"--copy-forwards in.txt 'true'\n{line}\n")
        with pytest.raises(TransferError) as err:
            check_job_copies(jobs, base, ForwardPolicy())
        message = str(err.value)
        assert message.startswith("batch line 2 (job b.sh.2): "), message
        assert reason in message and "\n" not in message
    check_job_copies(_jobs("--copy-forwards in.txt 'true'\n--copy-backwards out 'true'\n"), base, ForwardPolicy())
    allowed = _jobs("--copy-forwards ../outside /etc/hostname 'ls'\n")
    check_job_copies(allowed, base, ForwardPolicy(allow_outside=True))


def test_the_file_this_command_writes_its_output_to_stays_home(tmp_path: Path) -> None:
    """``execute_batch b.sh > log.txt`` in the folder it copies: log.txt grows while it is
    hashed and sent, so it is left out (by the file, not its name); a file of the same name
    elsewhere in the folder, and a copy of it, still go."""
    (tmp_path / "b.sh").write_text("true\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "log.txt").write_text("another log\n")
    log_file = tmp_path / "log.txt"
    saved = os.dup(1)
    try:
        with open(log_file, "w") as out:
            os.dup2(out.fileno(), 1)
        (tmp_path / "copy.txt").write_bytes(log_file.read_bytes())
        found = collect_forward(["."], tmp_path, Hasher())
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert sorted(f.rel for f in found.files) == ["b.sh", "copy.txt", "sub/log.txt"]

    found = collect_forward(["."], tmp_path, Hasher())  # stdout elsewhere again: it goes
    assert "log.txt" in {f.rel for f in found.files}


def test_a_file_that_vanishes_while_the_folder_is_read_is_not_sent(tmp_path: Path) -> None:
    """Another program's temporary file (an agent on this machine writing its record, an editor's
    swap file) can go between the listing and the look at it: the walk leaves it out instead of
    failing the batch with a traceback (CI: FileNotFoundError from os.lstat of a
    ``cache-trusted.json.<pid>`` in a home copied forward)."""
    _tree(tmp_path, {"a.txt": b"a", "b.tmp": b"b", "c.tmp": b"c", "d.txt": b"d"})

    class Racing(Hasher):
        def inspect(self, path: Path, st: os.stat_result) -> tuple[str, bool]:
            if path.name == "a.txt":  # gone after the listing, before its lstat
                (tmp_path / "b.tmp").unlink()
            if path.name == "c.tmp":  # gone after its lstat, before it is read
                path.unlink()
            return super().inspect(path, st)

    found = collect_forward(["."], tmp_path, Racing())
    assert sorted(f.rel for f in found.files) == ["a.txt", "d.txt"]


def test_an_agents_work_root_in_the_folder_is_not_sent(tmp_path: Path) -> None:
    """A home copied forward holds ``~/.ssh_scheduler``, where an agent on this machine keeps its
    cache and job folders: never sent (it changes while it is walked, and would be sent into
    itself)."""
    _tree(tmp_path, {".ssh_scheduler/cache-trusted.json": b"{}", ".ssh_scheduler/cache/x": b"x", "a.txt": b"a"})
    assert _sent(tmp_path) == {"a.txt"}


def _walked_by_a_stranger(base: Path, paths: tuple[str, ...]) -> str:
    """What collect_forward says for a user who may not read what is closed to others: as root
    (CI), a forked child that became uid 65534 walks; as anyone else, the walk is ours."""

    def walk() -> str:
        try:
            return " ".join(sorted(f.rel for f in collect_forward(paths, base, Hasher()).files))
        except TransferError as exc:
            return f"refused: {exc}"
        except Exception as exc:  # what a user would have seen as a traceback
            return f"crashed: {exc!r}"

    if os.geteuid() != 0:
        return walk()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write_end, walk().encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as got:
        said = got.read().decode()
    os.waitpid(pid, 0)
    return said


def test_what_cannot_be_read_is_refused_in_one_line_not_sent_without() -> None:
    """A file or folder this user may not read (a colleague's, root's) in the folder copied
    forward: one line naming it and the fix, never a traceback (PermissionError from the hash)
    and never the rest sent without it (os.walk skips a folder it cannot list, so the job
    would find it empty)."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's folders are closed to other users
    closed = 0o700 if os.geteuid() == 0 else 0o000  # root's walk is a stranger's (see above)
    try:
        _tree(base, {"a.txt": b"a", "closed/x": b"x", "secret.dat": b"s"})
        os.chmod(base, 0o755)
        os.chmod(base / "a.txt", 0o644)
        os.chmod(base / "closed", closed)
        os.chmod(base / "secret.dat", closed & 0o600)
        fix = "fix: make it readable, or leave it out with a line in .sshschedulerignore"
        assert _walked_by_a_stranger(base, (".",)) in (
            f"refused: --copy-forwards: cannot read closed (Permission denied); {fix}",
            f"refused: --copy-forwards: cannot read secret.dat (Permission denied); {fix}",
        )
        assert _walked_by_a_stranger(base, ("closed",)) == (
            f"refused: --copy-forwards: cannot read closed (Permission denied); {fix}"
        )
        assert _walked_by_a_stranger(base, ("a.txt",)) == "a.txt"
        (base / ".sshschedulerignore").write_text("closed/\nsecret.dat\n")
        os.chmod(base / ".sshschedulerignore", 0o644)
        assert _walked_by_a_stranger(base, (".",)) == ".sshschedulerignore a.txt"
    finally:
        os.chmod(base / "closed", 0o700)
        shutil.rmtree(base)


# --- what the mutation run (scripts/mutation forward) found no test for ----------------------------


def test_what_a_walk_meets_besides_plain_files(tmp_path: Path) -> None:
    """A link under an innocent name to a secret place (withheld, and listed as withheld), a
    dangling link and a FIFO (nothing to send), folders (listed: the host makes them) and the
    executable bit (the cache key's suffix, so the host's copy runs): none of them ends the walk
    before the entries after it."""
    home = tmp_path / "home"
    _tree(home, {".aws/credentials": b"[default]\n"})  # no key in it: a secret by where it is
    project = tmp_path / "p"
    _tree(project, {"a/run.sh": b"#!/bin/sh\n", "b/c/data.txt": b"d", "z.txt": b"z"})
    os.chmod(project / "a" / "run.sh", 0o755)
    (project / "a" / "creds").symlink_to(home / ".aws" / "credentials")
    (project / "a" / "dangling").symlink_to(project / "nowhere")
    os.mkfifo(project / "a" / "fifo")  # each sorts before run.sh, the file after them
    forward = collect_forward((".",), project, Hasher())
    assert [(f.rel, f.path, f.key.rsplit("-", 1)[1], f.size) for f in forward.files] == [
        ("a/run.sh", project / "a" / "run.sh", "x", 10),
        ("b/c/data.txt", project / "b" / "c" / "data.txt", "r", 1),
        ("z.txt", project / "z.txt", "r", 1),
    ]
    assert forward.withheld == ("a/creds",)
    assert forward.dirs == ("a", "b", "b/c")
    assert collect_forward(("b",), project, Hasher()).dirs == ("b", "b/c")


def test_the_messages_name_the_path_and_the_fix(tmp_path: Path) -> None:
    _tree(tmp_path, {".aws/credentials": b"[default]\n", "a.txt": b"a"})
    with pytest.raises(TransferError) as err:
        _sent(tmp_path, ("nothere",))
    assert str(err.value) == f"--copy-forwards: nothere does not exist (relative to {tmp_path})"
    with pytest.raises(TransferError) as err:
        _sent(tmp_path, (str(tmp_path / ".aws" / "credentials"),))  # named by its absolute path
    assert str(err.value) == (
        f"--copy-forwards {tmp_path}/.aws/credentials matches the secret pattern .aws/; secrets are "
        "not sent to hosts unless you pass --allow-secret-copies"
    )
    (tmp_path / ".sshschedulerignore").mkdir()  # cannot be read as a file
    with pytest.raises(TransferError) as err:
        _sent(tmp_path)
    assert str(err.value) == f"cannot read {tmp_path}/.sshschedulerignore: Is a directory"


def test_an_ignore_file_that_is_not_utf8_still_applies(tmp_path: Path) -> None:
    # A Latin-1 name in a comment (an editor's choice) must not cost the rules after it.
    (tmp_path / ".sshschedulerignore").write_bytes(b"# caf\xe9 data\n*.bin\n")
    _tree(tmp_path, {"x.bin": b"x", "y.txt": b"y"})
    assert _sent(tmp_path) == {".sshschedulerignore", "y.txt"}


def test_the_size_limits_are_inclusive(tmp_path: Path) -> None:
    _tree(tmp_path, {"a": b"x" * 600, "b": b"x" * 400})
    forward = collect_forward((".",), tmp_path, Hasher())
    check_forward_size(forward, (".",), ForwardPolicy(max_bytes=1000, max_files=2))  # exactly at both
    with pytest.raises(TransferError, match=r"more than --forward-max-bytes 999 bytes"):
        check_forward_size(forward, (".",), ForwardPolicy(max_bytes=999))
    with pytest.raises(TransferError, match=r"more than --forward-max-files 1 files"):
        check_forward_size(forward, (".",), ForwardPolicy(max_files=1))


def test_a_commands_line_refusal_says_the_line_the_option_and_the_folder(tmp_path: Path) -> None:
    base = tmp_path / "proj"
    _tree(base, {"in.txt": b"x", ".ssh/id_ed25519": FAKE_KEY})
    (base / "out_link").symlink_to(tmp_path)
    (base / "dangling").symlink_to(base / "nowhere")
    with pytest.raises(TransferError) as err:
        check_job_copies(_jobs("--copy-backwards /tmp 'ls'\n"), base, ForwardPolicy())
    assert str(err.value) == (
        f"batch line 1 (job b.sh.1): --copy-backwards /tmp is an absolute path; a batch line may copy "
        f"only paths inside its folder {base.resolve()} unless you pass --allow-outside-copies"
    )
    with pytest.raises(TransferError) as err:
        check_job_copies(_jobs("--copy-forwards .ssh 'ls'\n"), base, ForwardPolicy())
    assert str(err.value) == (
        "batch line 1 (job b.sh.1): --copy-forwards .ssh matches the secret pattern .ssh/; secrets are "
        "not sent to hosts unless you pass --allow-secret-copies"
    )
    # What comes back is named on the host: a local link or secret of that name does not matter.
    check_job_copies(_jobs("--copy-backwards out_link .ssh nothere 'ls'\n"), base, ForwardPolicy())
    # What goes must be there, said before anything starts (a dangling link is nothing to send).
    for missing in ("nothere", "dangling"):
        with pytest.raises(TransferError) as err:
            check_job_copies(_jobs(f"'true'\n--copy-forwards in.txt {missing} 'ls'\n"), base, ForwardPolicy())
        assert str(err.value) == (
            f"batch line 2 (job b.sh.2): --copy-forwards {missing} does not exist (relative to {base})"
        )


def test_a_path_outside_the_folder_is_sent_under_its_own_name(tmp_path: Path) -> None:
    """``--copy-forwards /data/set`` (allowed on the command line): its files land under
    ``set/`` in the job's folder, whatever the base."""
    _tree(tmp_path, {"elsewhere/set/a.txt": b"a", "elsewhere/set/sub/b.txt": b"b"})
    base = tmp_path / "proj"
    base.mkdir()
    found = collect_forward([str(tmp_path / "elsewhere" / "set")], base, Hasher())
    assert [f.rel for f in found.files] == ["set/a.txt", "set/sub/b.txt"]
    assert found.dirs == ("set", "set/sub")
