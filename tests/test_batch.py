from __future__ import annotations

import pytest

from ssh_scheduler.errors import BatchError
from ssh_scheduler.jobs.batch_file import Job, parse_batch
from ssh_scheduler.jobs.command_line import parse_remote_command_line
from ssh_scheduler.jobs.job_names import MAX_JOB_NAME_BYTES, job_name_prefix, validate_job_name

ANCESTOR_BATCH = b"""\
echo "one job"
echo "another job"
echo "another job" && echo "a combined job (bash syntax applies)"
bash examples/local.sh && echo "you can also call local files because they are copied by the remote by the default value of --copy-forwards"
"""

ANCESTOR_COMMANDS = b"""\
execute_remote --copy-forwards example1 test.py --copy-backwards example1 --job-name example1 'python test.py example1'
execute_remote --copy-forwards example2 test.py --copy-backwards example2 --job-name example2 'python test.py example2'
"""


def batch_error(data: bytes, path: str = "b.sh", *, commands_mode: bool = False) -> str:
    with pytest.raises(BatchError) as info:
        parse_batch(data, path, commands_mode=commands_mode)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def line_error(line: str) -> str:
    with pytest.raises(BatchError) as info:
        parse_remote_command_line(line)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("path", "prefix"),
    [
        ("example/batch_script.sh", "example_batch_script.sh"),
        ("./example/batch_script.sh", "example_batch_script.sh"),
        ("././b.sh", "b.sh"),
        (".//b.sh", "b.sh"),
        ("b.sh", "b.sh"),
        ("../x.sh", ".._x.sh"),
        ("/abs/b.sh", "_abs_b.sh"),
        ("a/./b", "a_._b"),
    ],
)
def test_job_name_prefix(path: str, prefix: str) -> None:
    assert job_name_prefix(path) == prefix


def test_ancestor_batch() -> None:
    jobs = parse_batch(ANCESTOR_BATCH, "example/batch_script.sh")
    assert [j.name for j in jobs] == [f"example_batch_script.sh.{i}" for i in range(1, 5)]
    assert jobs[0] == Job("example_batch_script.sh.1", 'echo "one job"', 1)
    assert jobs[2].command == 'echo "another job" && echo "a combined job (bash syntax applies)"'
    assert all(j.copy_forwards is None and j.copy_backwards is None for j in jobs)


def test_blank_and_comment_lines_count_for_numbering() -> None:
    data = b"# header\n\necho a\n   # indented comment\n  \t \necho b  \n  echo c\n"
    jobs = parse_batch(data, "./b.sh")
    assert [(j.name, j.line_number, j.command) for j in jobs] == [
        ("b.sh.3", 3, "echo a"),
        ("b.sh.6", 6, "echo b  "),  # trailing whitespace kept
        ("b.sh.7", 7, "  echo c"),
    ]


def test_crlf_bom_and_missing_final_newline() -> None:
    jobs = parse_batch(b"\xef\xbb\xbfecho a\r\necho b\r\necho c", "b.sh")
    assert [j.command for j in jobs] == ["echo a", "echo b", "echo c"]


def test_backslash_continuation_is_not_joined() -> None:
    jobs = parse_batch(b"echo a \\\necho b\n", "b.sh")
    assert [j.command for j in jobs] == ["echo a \\", "echo b"]


def test_unicode_commands() -> None:
    jobs = parse_batch("echo héllo ✓\n".encode(), "b.sh")
    assert jobs[0].command == "echo héllo ✓"


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (b"echo a\necho \x00b\n", ["b.sh line 2", "NUL"]),
        (b"echo a\n\necho \xff\n", ["b.sh line 3", "UTF-8", "0xff"]),
        (b"# \xff in a comment\necho a\n", ["b.sh line 1", "UTF-8"]),  # checked before skipping
        (b"echo a\recho b\n", ["b.sh line 1", "carriage return"]),
        (b"\xff\n\xfe\n\x00\n", ["b.sh line 1", "2 more bad line(s)"]),
        (b"", ["b.sh", "no commands"]),
        (b"# nothing\n\n", ["b.sh", "no commands"]),
    ],
)
def test_file_errors(data: bytes, needles: list[str]) -> None:
    message = batch_error(data)
    for needle in needles:
        assert needle in message


def test_bad_line_stops_everything_even_late_in_file() -> None:
    data = b"".join(b"echo %d\n" % i for i in range(1000)) + b"\x00\n"
    assert "line 1001" in batch_error(data)


@pytest.mark.parametrize(
    "name",
    [
        "job1",
        "a.out.2",
        ".._x.sh.1",
        ".hidden",
        "with space",
        "ünï",
        "x" * MAX_JOB_NAME_BYTES,
        "a-b_c.d",
    ],
)
def test_valid_job_names(name: str) -> None:
    validate_job_name(name)


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("", "empty"),
        (".", "not allowed"),
        ("..", "not allowed"),
        ("a/b", "'/'"),
        ("../escape", "'/'"),
        ("a\\b", "'\\'"),
        ("a\x00b", "control character"),
        ("a\nb", "control character"),
        ("a\tb", "control character"),
        ("-rf", "starts with '-'"),
        (" a", "whitespace"),
        ("a ", "whitespace"),
        ("x" * (MAX_JOB_NAME_BYTES + 1), "bytes long"),
        ("é" * 101, "202 bytes long"),
        ("\udcff", "Unicode"),
        (".journal.jsonl", "reserved"),
        (".partial-x", "reserved"),
    ],
)
def test_invalid_job_names(name: str, needle: str) -> None:
    with pytest.raises(BatchError) as info:
        validate_job_name(name)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert "--job-name" in message or "bytes long" in message


def test_default_name_problems_point_at_the_file() -> None:
    message = batch_error(b"echo a\n", "-weird.sh")
    assert "-weird.sh line 1" in message and "rename or move the file" in message
    long_path = "d/" * 120 + "b.sh"
    assert "bytes long" in batch_error(b"echo a\n", long_path)


# ---------------------------------------------------------------------------------------------
# --commands mode


def test_ancestor_commands() -> None:
    jobs = parse_batch(ANCESTOR_COMMANDS, "cmds.sh", commands_mode=True)
    assert jobs == [
        Job("example1", "python test.py example1", 1, ("example1", "test.py"), ("example1",)),
        Job("example2", "python test.py example2", 2, ("example2", "test.py"), ("example2",)),
    ]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("'echo hi'", ("echo hi", None, None, None)),
        ("execute_remote 'echo hi'", ("echo hi", None, None, None)),
        ("--job-name=j 'echo hi'", ("echo hi", None, None, "j")),
        ("--copy-forwards a --copy-forwards b 'c'", ("c", ("a", "b"), None, None)),
        ("--copy-forwards=a --copy-backwards=out 'c'", ("c", ("a",), ("out",), None)),
        ("--copy-forwards=a b", ("b", ("a",), None, None)),
        ("--copy-forwards --job-name j 'c'", ("c", (), None, "j")),  # empty list = copy nothing
        ("--copy-backwards out 'python x.py'", ("python x.py", None, ("out",), None)),
        ("--copy-forwards a b 'python x.py'", ("python x.py", ("a", "b"), None, None)),
        ("'python x.py' --copy-forwards a b", ("python x.py", ("a", "b"), None, None)),
        ("--copy-forwards a -- 'c'", ("c", ("a",), None, None)),
        ("-- '--weird command'", ("--weird command", None, None, None)),
        ('"echo \\"q\\" $HOME"', ('echo "q" $HOME', None, None, None)),
    ],
)
def test_parse_remote_command_line(
    line: str,
    expected: tuple[str, tuple[str, ...] | None, tuple[str, ...] | None, str | None],
) -> None:
    assert parse_remote_command_line(line) == expected


@pytest.mark.parametrize(
    ("line", "needles"),
    [
        ("--machine m.yaml 'c'", ["unknown option '--machine'", "--copy-forwards"]),
        ("--gpu 0 'c'", ["unknown option '--gpu'"]),
        ("-x 'c'", ["unknown option '-x'"]),
        ("'a' 'b'", ["expected one command, found 2 words", "quote the whole command"]),
        ("python test.py", ["found 2 words"]),
        ("--job-name j", ["no command found"]),
        ("execute_remote", ["no command found"]),
        ("--copy-forwards a", ["no command found"]),
        ("--job-name", ["--job-name needs a value"]),
        ("--job-name a --job-name b 'c'", ["--job-name is given twice"]),
        ("--job-name a/b 'c'", ["'a/b'", "'/'"]),
        ("--job-name .. 'c'", ["'..'"]),
        ("--copy-forwards= 'c'", ["empty value"]),
        ("--copy-forwards '' 'c'", ["empty path"]),
        ("'unclosed", ["no closing quotation", "close the quote"]),
        ("'c' \\", ["no escaped character", "trailing backslash"]),
        ("--copy-forward a 'c'", ["'--copy-forward'", "did you mean --copy-forwards?"]),
        ("''", ["command is empty"]),
    ],
)
def test_parse_remote_command_line_errors(line: str, needles: list[str]) -> None:
    message = line_error(line)
    for needle in needles:
        assert needle in message, (needle, message)


def test_commands_mode_errors_name_file_and_line() -> None:
    data = b"# c\n--job-name a 'x'\n--machine m 'y'\n"
    message = batch_error(data, "cmds.sh", commands_mode=True)
    assert message.startswith("cmds.sh line 3: unknown option '--machine'")


def test_commands_mode_default_names_and_mixture() -> None:
    data = b"'echo a'\n--job-name named 'echo b'\n"
    jobs = parse_batch(data, "dir/c.sh", commands_mode=True)
    assert [j.name for j in jobs] == ["dir_c.sh.1", "named"]


# ---------------------------------------------------------------------------------------------
# name collisions


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (b"--job-name a 'x'\n--job-name a 'y'\n", ["line 2", "same job name 'a'", "also line 1"]),
        (
            b"--job-name a 'x'\n\n--job-name A 'y'\n",
            ["line 3", "'a' and 'A'", "differ only in case"],
        ),
        (
            b"--job-name a 'x'\n--job-name a.out 'y'\n",
            ["line 2", "'a.out'", "stdout file job_results/a.out", "job 'a' (line 1;"],
        ),
        (
            b"--job-name a.err 'x'\n--job-name a 'y'\n",
            ["line 1", "'a.err'", "stderr file job_results/a.err", "job 'a' (line 2;"],
        ),
        (b"--job-name A.OUT 'x'\n--job-name a 'y'\n", ["'A.OUT'", "stdout file"]),
        (b"--job-name b.sh.2 'x'\n'y'\n", ["line 2", "same job name 'b.sh.2'", "also line 1"]),
        (
            "--job-name caf\u00e9 'x'\n--job-name cafe\u0301 'y'\n".encode(),
            ["line 2", "differ only in case"],
        ),
    ],
)
def test_name_collisions(data: bytes, needles: list[str]) -> None:
    message = batch_error(data, "b.sh", commands_mode=True)
    for needle in needles:
        assert needle in message, (needle, message)


def test_no_false_collisions() -> None:
    data = (
        b"--job-name a 'x'\n--job-name a.outx 'y'\n--job-name a.o 'z'\n--job-name b.out.out 'w'\n"
    )
    assert len(parse_batch(data, "b.sh", commands_mode=True)) == 4
