"""job_results/<job>.out / .err: created at a stream's first byte (the other at the job's end),
never through a link, and what is there after an attempt is that attempt's output only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ssh_scheduler.coordinator.jobrun import OutputFiles
from ssh_scheduler.errors import TransferError


def test_a_silent_stream_has_no_file_until_the_end_and_a_printing_one_gets_exactly_its_bytes(tmp_path: Path) -> None:
    output = OutputFiles(tmp_path, "job.1")
    output.open()
    assert sorted(os.listdir(tmp_path)) == []  # nothing created before the first byte
    assert output.offsets == (0, 0)
    output.write(2, b"warn")
    output.write(2, b"ing\n")
    output.close()
    assert sorted(os.listdir(tmp_path)) == ["job.1.err"]
    assert (tmp_path / "job.1.err").read_bytes() == b"warning\n"
    output.complete()  # the job's end: both files
    assert sorted(os.listdir(tmp_path)) == ["job.1.err", "job.1.out"]
    assert (tmp_path / "job.1.out").read_bytes() == b"" and (tmp_path / "job.1.err").read_bytes() == b"warning\n"


def test_an_earlier_attempts_files_are_emptied_even_when_this_attempt_prints_nothing(tmp_path: Path) -> None:
    (tmp_path / "job.1.out").write_text("old stdout\n")
    (tmp_path / "job.1.err").write_text("old stderr\n")
    output = OutputFiles(tmp_path, "job.1")
    output.open()
    output.write(1, b"new\n")
    output.close()
    assert (tmp_path / "job.1.out").read_text() == "new\n"
    assert (tmp_path / "job.1.err").read_text() == ""


def test_resuming_appends_after_what_arrived_and_reports_it(tmp_path: Path) -> None:
    (tmp_path / "job.1.out").write_text("12345")
    output = OutputFiles(tmp_path, "job.1", append=True)
    output.open()
    assert output.offsets == (5, 0)
    output.write(1, b"678")
    output.close()
    assert (tmp_path / "job.1.out").read_text() == "12345678"
    assert (tmp_path / "job.1.err").read_text() == ""  # the append mode keeps its files


def test_a_planted_link_is_refused_before_the_job_and_never_written_through(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious\n")
    (tmp_path / "job.1.err").symlink_to(target)
    output = OutputFiles(tmp_path, "job.1")
    with pytest.raises(TransferError, match="a symbolic link is in the way"):
        output.open()
    assert target.read_text() == "precious\n"


def test_a_link_planted_while_the_job_runs_is_refused_at_the_first_byte(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious\n")
    said: list[str] = []
    output = OutputFiles(tmp_path, "job.1", on_failure=said.append)
    output.open()
    (tmp_path / "job.1.out").symlink_to(target)  # after open(): the file did not exist yet
    output.write(1, b"pwned\n")  # no exception: that would end the host's reader
    output.write(1, b"again\n")
    output.write(2, b"stderr is fine\n")
    assert output.complete() == output.failure
    output.close()
    assert target.read_text() == "precious\n"
    assert (tmp_path / "job.1.out").is_symlink()
    assert (tmp_path / "job.1.err").read_text() == "stderr is fine\n"
    assert said == [output.failure]  # said once, as the batch's failure
    assert output.failure is not None and output.failure.startswith(f"cannot write in {tmp_path}/: writing job.1.out (")
    assert output.failure.endswith("(a symbolic link is in the way: remove it)")


def test_every_job_that_ended_has_both_files_and_what_it_printed_stays(tmp_path: Path) -> None:
    output = OutputFiles(tmp_path, "job.1")
    output.open()
    output.write(1, b"printed\n")
    output.close()  # the run ended; the files are completed when its end is final
    assert output.complete() is None
    assert (tmp_path / "job.1.out").read_text() == "printed\n"  # not emptied again
    assert (tmp_path / "job.1.err").read_text() == ""


def test_mirrors_get_every_byte_even_before_the_file_exists(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    output = OutputFiles(tmp_path, "job.1", mirror={1: [write_end]})
    output.open()
    output.write(1, b"live\n")
    output.close()
    os.close(write_end)
    assert os.read(read_end, 100) == b"live\n"
    os.close(read_end)
    assert (tmp_path / "job.1.out").read_text() == "live\n"
