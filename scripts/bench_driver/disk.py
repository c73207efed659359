"""Where a benchmark run writes: an ext4 filesystem with a journal, made for the run on a loop
device (``--disk loop``, the default as root), or the folder ``--workdir`` is on (``--disk here``).

Why not this machine's own disk: its root filesystem is ext4 *without* a journal (and mounted
with ``discard``).  There the kernel's inode allocator passes over every inode freed in the last
minute (five while its inode table block is dirty), reading each one it passes (``ext4``'s
``recently_deleted()``, which only runs without a journal), so creating thousands of files soon
after thousands were removed costs a scan per file.  Measured with one job writing 5,000 result
files, removed again before each run: 3.4-4.9 s on that disk, 0.59-0.64 s on ext4 with a journal.
The test cluster's hosts share the disk with the coordinator, so which tool paid depended on which
one had removed files last (a host's job folder, a peer's ``rm -rf``, a cluster stopped): a whole
round of one scenario now and then.  Most users' disks have a journal and no ``discard``; the run
says which filesystem it measured on.

The cluster's hosts (their homes and work roots) and the runs' folders go on it.  Its mount must
exist before a cluster starts: every host gets a copy of the mounts of that moment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench_driver.base import log

PREFIX = "ssh-scheduler-bench-disk-"
SIZE = "12G"  # sparse: the largest scenario writes a few GB (big-back's 200 MB files, scale256)
MOUNTS = Path("/var/lib")  # hosts get their own /tmp: a cluster's base must not be under it


class Disk:
    """The filesystem of one run: ``path`` to write under, ``info`` for the report."""

    def __init__(self, workdir: Path, mode: str) -> None:
        self.image: Path | None = None
        self.device: str | None = None
        self.mount: Path | None = None
        self.path = workdir
        self.info: dict[str, Any] = {"mode": mode}
        if mode == "loop":
            self._make(workdir)
        self.info.update(describe(self.path))

    def _make(self, workdir: Path) -> None:
        missing = [tool for tool in ("mkfs.ext4", "losetup", "mount", "umount", "findmnt") if shutil.which(tool) is None]
        if os.geteuid() != 0 or missing:
            why = "not root" if os.geteuid() != 0 else f"{', '.join(missing)} missing"
            log(f"warning: --disk loop: {why}; measuring on {workdir} as it is")
            self.info["mode"] = f"here ({why})"
            return
        clear_leftovers(workdir)
        prefix = f"{PREFIX}{os.getpid()}-"  # whose it is: a killed run's is cleared by the next
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".img", dir=workdir)
        os.close(fd)
        self.image = Path(name)
        mount = Path(tempfile.mkdtemp(prefix=prefix, dir=MOUNTS))
        try:
            subprocess.run(["truncate", "-s", SIZE, str(self.image)], check=True)
            # Inode tables and journal written now: done lazily, a kernel thread would do it
            # during the measurements.
            subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                            str(self.image)], check=True, capture_output=True)  # fmt: skip
            # Direct I/O: the loop device writes to the image file as a disk would be written,
            # not through a second page cache (each byte cached twice, copied once more).
            self.device = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(self.image)],
                                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
            subprocess.run(["mount", self.device, str(mount)], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            log(f"warning: --disk loop failed ({exc}; {err.decode(errors='replace').strip()}); measuring on {workdir}")
            self.info["mode"] = "here (the loop filesystem could not be made)"
            mount.rmdir()
            self._detach()
            self.image.unlink(missing_ok=True)
            self.image = None
            return
        os.chmod(mount, 0o755)  # the hosts' users pass through it to their homes
        self.mount = self.path = mount
        self.info["direct_io"] = True
        log(f"measuring on ext4 with a journal, {SIZE} on a loop device at {mount}")

    def cluster_base(self, name: str) -> Path | None:
        """Where a cluster's hosts live: on the run's filesystem (None: the cluster's default)."""
        return None if self.mount is None else self.mount / f"cluster-{name}"

    def close(self) -> None:
        if self.mount is not None:
            done = subprocess.run(["umount", str(self.mount)], check=False, capture_output=True)
            if done.returncode != 0:  # something still holds it: detach now, freed when let go
                subprocess.run(["umount", "-l", str(self.mount)], check=False, capture_output=True)
            with contextlib.suppress(OSError):
                self.mount.rmdir()
            self.mount = None
        self._detach()
        if self.image is not None:
            self.image.unlink(missing_ok=True)
            self.image = None

    def _detach(self) -> None:
        if self.device is not None:  # a lazy unmount frees the device later, then this is a no-op
            subprocess.run(["losetup", "-d", self.device], check=False, capture_output=True)
            self.device = None


def _out(argv: list[str]) -> str:
    """What ``argv`` printed on stdout; empty when it failed or is not installed (the report
    then says less, the run goes on)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def describe(path: Path) -> dict[str, Any]:
    """The filesystem under ``path``: its type, mount options and whether it has a journal."""
    found = _out(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", str(path)]).split()
    if len(found) < 3:
        return {}
    source, fstype, options = found[:3]
    info: dict[str, Any] = {"fstype": fstype, "options": options}
    if fstype.startswith("ext"):
        header = _out(["dumpe2fs", "-h", source])
        features = next((line.split(":", 1)[1].split() for line in header.splitlines()
                         if line.startswith("Filesystem features:")), [])  # fmt: skip
        info["journal"] = "has_journal" in features if features else None
    return info


def clear_leftovers(workdir: Path) -> None:
    """Unmount, detach and remove what a benchmark killed before its end (SIGKILL, a lost
    machine) left: its mount under MOUNTS and its image in ``workdir``, named with its pid."""
    for path in [*MOUNTS.glob(PREFIX + "*"), *workdir.glob(PREFIX + "*.img")]:
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue  # not ours to judge, or its benchmark still runs
        if path.is_dir():
            source = _out(["findmnt", "-n", "-o", "SOURCE", "--mountpoint", str(path)]).strip()
            if source:
                subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
                subprocess.run(["losetup", "-d", source], check=False, capture_output=True)
            with contextlib.suppress(OSError):
                path.rmdir()
            log(f"removed a killed benchmark's disk at {path}")
        else:
            path.unlink(missing_ok=True)
