#!/usr/bin/python3 -IS
"""Make this process "hold" simulated GPU memory on a test-cluster host (stdlib only).

    gpu_hold --mb 3000 [--util 40] [--seconds N] [--gpu INDEX] [--name NAME]
             [--oversubscribe] [--ready]

The GPU is ``--gpu INDEX`` (physical index of the host's simulated GPUs) or else the first
entry of ``CUDA_VISIBLE_DEVICES`` (an index or a ``GPU-...`` uuid / uuid prefix; unset means
GPU 0, empty means no device -> exit 1 like CUDA).  Registers ``<state>/procs/<own pid>``
(read by the fake ``nvidia-smi``), sleeps forever or ``--seconds``, and deregisters on exit
(SIGTERM/SIGINT/SIGHUP too; a SIGKILLed holder is ignored by nvidia-smi because its PID is
gone).  Refuses (exit 1, "CUDA out of memory") if the GPU lacks free memory unless
``--oversubscribe``.  ``--ready`` prints ``READY <pid>`` once registered.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import sys
import time

STATE_DIR = None  # replaced per host by the cluster


def state_dir() -> str:
    return os.environ.get("FAKE_NVSMI_STATE") or STATE_DIR or ""


def read_gpus(sdir: str) -> list[tuple[int, str, int, int]]:
    out = []
    try:
        with open(os.path.join(sdir, "gpus")) as f:
            for line in f.read().splitlines():
                if line.strip():
                    index, uuid, total, reserved, _name = line.split("\t", 4)
                    out.append((int(index), uuid, int(total), int(reserved)))
    except OSError:
        pass
    return out


def starttime(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] in ("Z", "X", "x"):
        return ""
    return fields[19]


def used_mb(sdir: str, gpu: int) -> int:
    pdir = os.path.join(sdir, "procs")
    total = 0
    for fname in os.listdir(pdir):
        if not fname.isdigit():
            continue
        try:
            with open(os.path.join(pdir, fname)) as f:
                g, mb, _util, start, _name = f.readline().rstrip("\n").split("\t", 4)
        except (OSError, ValueError):
            continue
        if int(g) == gpu and starttime(int(fname)) == start:
            total += int(mb)
    return total


def pick_gpu(args: argparse.Namespace, gpus: list[tuple[int, str, int, int]]) -> int:
    if args.gpu is not None:
        ident = str(args.gpu)
    else:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        if cvd is None:
            ident = "0"
        else:
            ident = cvd.split(",")[0].strip()
            if not ident or ident == "-1" or ident == "NoDevFiles":
                raise SystemExit("gpu_hold: CUDA error: no CUDA-capable device is detected")
    for index, uuid, _total, _reserved in gpus:
        if ident == str(index) or (ident.startswith("GPU-") and uuid.startswith(ident)):
            return index
    raise SystemExit(f"gpu_hold: CUDA error: invalid device ordinal ({ident!r})")


def main() -> int:
    ap = argparse.ArgumentParser(prog="gpu_hold")
    ap.add_argument("--mb", type=int, required=True, help="MiB of GPU memory to hold")
    ap.add_argument("--util", type=int, default=0, help="GPU utilization percent to add")
    ap.add_argument("--seconds", type=float, default=None, help="hold this long (default forever)")
    ap.add_argument(
        "--gpu", default=None, help="physical GPU index (overrides CUDA_VISIBLE_DEVICES)"
    )
    ap.add_argument("--name", default=None, help="process name nvidia-smi shows (default: comm)")
    ap.add_argument("--oversubscribe", action="store_true", help="skip the out-of-memory check")
    ap.add_argument("--ready", action="store_true", help="print 'READY <pid>' once registered")
    args = ap.parse_args()

    sdir = state_dir()
    gpus = read_gpus(sdir)
    if not gpus:
        raise SystemExit("gpu_hold: CUDA error: no CUDA-capable device is detected")
    gpu = pick_gpu(args, gpus)
    pid = os.getpid()
    name = args.name
    if name is None:
        try:
            with open("/proc/self/comm") as f:
                name = f.read().strip()
        except OSError:
            name = "python3"
    pdir = os.path.join(sdir, "procs")
    path = os.path.join(pdir, str(pid))
    lock_fd = os.open(os.path.join(sdir, "lock"), os.O_RDONLY)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if not args.oversubscribe:
            _i, _u, total, reserved = next(g for g in gpus if g[0] == gpu)
            free = total - reserved - used_mb(sdir, gpu)
            if args.mb > free:
                raise SystemExit(
                    f"gpu_hold: CUDA out of memory. Tried to allocate {args.mb} MiB "
                    f"(GPU {gpu}; {free} MiB free)"
                )
        tmp = os.path.join(pdir, f".{pid}.tmp")
        with open(tmp, "w") as f:
            f.write(f"{gpu}\t{args.mb}\t{args.util}\t{starttime(pid)}\t{name}\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)

    def leave(signo: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os._exit(128 + signo)

    for signo in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signo, leave)
    try:
        if args.ready:
            sys.stdout.write(f"READY {pid}\n")
            sys.stdout.flush()
        if args.seconds is None:
            while True:
                signal.pause()
        else:
            time.sleep(args.seconds)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
