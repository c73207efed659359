"""The measured programs of the functions benchmark (scenario ``functions``): N calls of a trivial
Python function on the hosts, from this process's start (a cold start: nothing connected, no
worker running) to the last result here.

    bench_functions.py ours N MACHINE_YAML...        ssh_scheduler.Executor.map over the machines
                                                     (the function in a module copied forward);
                                                     --joblib-batch K: joblib's Parallel with
                                                     batch_size K instead (K calls per job);
                                                     --chunksize K: Executor.map's chunksize K
    bench_functions.py dask N --key K --known-hosts F USER@IP... [--python P] [--interface I]
                                                     dask.distributed.SSHCluster: its scheduler on
                                                     the first host, one worker of 4 threads on
                                                     each host, client.map, gather, close

Each prints one JSON line: ``{"ok": ..., "calls": N, "sum": ..., "hosts": {host: calls},
"started_s": ..., "first_result_s": ...}`` (seconds from the process's start).  Run by the bench
with the package's venv (``ours``) and with the Dask peer's venv (``dask``, built from the hosts'
own python3, which runs its workers there); so the module imports neither at its top.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from collections import Counter
from typing import Any

T0 = time.monotonic()
CPUS_PER_HOST = 4  # the bench's hosts (scripts/bench_driver/bench.py: HostSpec(cpus=4))


def trivial(x: int) -> tuple[int, str]:
    """The call: its argument back, and where it ran (the bench checks the spread)."""
    return x, socket.gethostname()


def report(values: list[tuple[int, str]], n: int, first: float | None, **more: Any) -> None:
    total = sum(v for v, _ in values)
    print(json.dumps({
        "ok": total == n * (n - 1) // 2 and len(values) == n, "calls": len(values), "sum": total,
        "hosts": dict(sorted(Counter(h for _, h in values).items())),
        "first_result_s": None if first is None else round(first - T0, 3),
        "end_s": round(time.monotonic() - T0, 3), **more,
    }), flush=True)  # fmt: skip


def ours(n: int, machines: list[str], batch_size: int = 0, chunksize: int = 1) -> None:
    # The function as a user's usually is: in a module of the folder, which is copied forward
    # (this file, as bench_calls.py), so it travels by name.
    shutil.copy(__file__, "bench_calls.py")
    sys.path.insert(0, os.getcwd())
    from bench_calls import trivial as by_name  # type: ignore[import-not-found]

    from ssh_scheduler import Executor

    first = None
    values = []
    # 4 calls at once per 4-CPU host, as Dask's one worker of 4 threads per host (the same
    # concurrency for every tool, as the other scenarios give every tool).
    options: dict[str, Any] = {"no_gpu_required": True, "num_cpus": 1, "memory_required": 0, "resume": False,
                               "copy_forwards": ["bench_calls.py"]}  # fmt: skip
    if batch_size:  # joblib's Parallel over the backend, batch_size calls per job
        import joblib

        import ssh_scheduler.functions.joblib_backend  # noqa: F401  (registers it)

        with joblib.parallel_config(backend="ssh_scheduler", machines=machines, **options):
            out = joblib.Parallel(n_jobs=-1, batch_size=batch_size, pre_dispatch="all", return_as="generator")(
                joblib.delayed(by_name)(x) for x in range(n)
            )
            for value in out:
                first = first or time.monotonic()
                values.append(value)
        report(values, n, first)
        return
    with Executor(machines, **options) as ex:
        for value in ex.map(by_name, range(n), chunksize=chunksize):
            first = first or time.monotonic()
            values.append(value)
    report(values, n, first)


def dask(n: int, hosts: list[str], key: str, known_hosts: str, python: str, interface: str) -> None:
    from dask.distributed import Client, SSHCluster, as_completed

    users = [h.partition("@")[0] for h in hosts]
    ips = [h.partition("@")[2] for h in hosts]
    # The scheduler on the first host, beside its worker (SSHCluster's first host is the
    # scheduler's); each login has its own user, so one set of connect options per host.
    options = [{"username": u, "client_keys": [key], "known_hosts": known_hosts} for u in [users[0], *users]]
    started = None
    with SSHCluster(
        [ips[0], *ips], connect_options=options, remote_python=python,
        # eth0: the host's one interface; without it dask takes the address its route to the
        # internet has, which a host without one lacks (127.0.0.1: unreachable from the others)
        worker_options={"nthreads": CPUS_PER_HOST, "n_workers": 1, "interface": interface},
        scheduler_options={"port": 0, "dashboard_address": None, "interface": interface},
    ) as cluster, Client(cluster) as client:  # fmt: skip
        started = time.monotonic()
        futures = client.map(trivial, range(n), pure=False)
        first = None
        for _ in as_completed(futures):
            first = first or time.monotonic()
            break
        values = client.gather(futures)
    report(values, n, first, cluster_up_s=round(started - T0, 3))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="tool", required=True)
    mine = sub.add_parser("ours")
    mine.add_argument("n", type=int)
    mine.add_argument("machines", nargs="+")
    mine.add_argument("--joblib-batch", type=int, default=0, help="through joblib, this many calls per job")
    mine.add_argument("--chunksize", type=int, default=1, help="Executor.map's chunksize: this many calls per job")
    peer = sub.add_parser("dask")
    peer.add_argument("n", type=int)
    peer.add_argument("hosts", nargs="+", help="USER@IP of each host")
    peer.add_argument("--key", required=True)
    peer.add_argument("--known-hosts", required=True)
    peer.add_argument("--python", default="python3", help="the Python that runs dask on the hosts")
    peer.add_argument("--interface", default="eth0", help="the hosts' network interface dask listens on")
    args = parser.parse_args(argv)
    if args.tool == "ours":
        ours(args.n, args.machines, args.joblib_batch, args.chunksize)
    else:
        dask(args.n, args.hosts, args.key, args.known_hosts, args.python, args.interface)


if __name__ == "__main__":
    main(sys.argv[1:])
