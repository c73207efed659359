"""The state of one benchmark run: its temporary folder, the test clusters, the environment the
measured commands get, where the measured package lives (--ref), the key exchange every peer is
pinned to (ours), and the commands every scenario family shares (machine files, the peers'
command lines, the floors, the hosts' work folders, making a host cold again)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_kex import matched

from bench_driver.base import PY, REPO, VENV_BIN, log
from bench_driver.disk import Disk
from bench_driver.measure import Cmd, host_tcp
from ssh_scheduler.cli.warm_place import loading_launchers, running_launchers
from ssh_scheduler.transport.hub_ask import hub_status
from tests.cluster import Cluster, GpuSpec, HostSpec, start_cluster


class Bench:
    """One benchmark run; each scenario family's makers take it and build on its clusters."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.disk = Disk(Path(args.workdir), args.disk)  # before any cluster: see disk.py
        self.root = Path(tempfile.mkdtemp(prefix="sshs-bench-", dir=self.disk.path))
        self.cluster: Cluster | None = None
        self.gpu_cluster: Cluster | None = None
        self.gpu_fallback: str | None = None
        self.env = dict(os.environ)
        self.env.pop("SSH_AUTH_SOCK", None)
        self.env["PARALLEL_HOME"] = str(self.root / "parallel_home")
        # Our hash memo (jobs/hash_memo.py) starts empty in every benchmark, whatever ran before.
        self.env["XDG_CACHE_HOME"] = str(self.root / "cache_home")
        (self.root / "parallel_home").mkdir()
        (self.root / "parallel_home" / "will-cite").touch()
        self.cluster_info: dict[str, Any] = {}
        # What ssh_scheduler negotiates (bench_kex.matched), read once from the first cluster:
        # every OpenSSH peer and asyncssh floor is pinned to it.
        self.ssh_match: dict[str, Any] | None = None
        self.code_root = REPO  # where the measured ssh_scheduler package lives
        if args.ref:
            self.code_root = export_ref(args.ref, self.root / "code")
            self.env["PYTHONPATH"] = str(self.code_root)
        # An installed package has its bytecode; the measured tree, run where
        # PYTHONDONTWRITEBYTECODE=1 is set, would compile ~40 modules at every start (~0.09 s of
        # CPU) that no user pays: compile them once, as pip does at install.
        subprocess.run(
            [PY, "-m", "compileall", "-q", str(self.code_root / "ssh_scheduler")],
            check=False,
            capture_output=True,
        )
        # Likewise the code of its dataclasses (cli/class_code.py), kept from the first command
        # on: every later cold command finds it, as every measured one would but the very first.
        subprocess.run(
            [PY, "-m", "ssh_scheduler.cli.class_code"], env=self.env, cwd=self.code_root, check=False, capture_output=True
        )

    # ----- cluster
    def start_small_cluster(self) -> Cluster:
        # h1..h32: 4 CPUs, 16 GiB (12000 MiB available), no GPU -- except h15, h16 with 2 GPUs
        # (scenario 7: the ancestor's example ran on a 2-GPU machine); h17..h32 for scenario 4's
        # 32-host fan-out.
        specs = (
            [HostSpec(cpus=4) for _ in range(14)]
            + [HostSpec(cpus=4, gpus=[GpuSpec(), GpuSpec()]) for _ in range(2)]
            + [HostSpec(cpus=4) for _ in range(16)]
        )
        t0 = time.monotonic()
        cluster = start_cluster(specs, timeout=60, base_dir=self.disk.cluster_base("small"))
        self.cluster_info["small"] = {
            "hosts": len(specs),
            "start_s": round(time.monotonic() - t0, 2),
            "mode": "netns" if cluster.namespaces else "loopback",
            "base": str(cluster.base),
        }
        log(f"cluster up: {len(specs)} hosts in {time.monotonic() - t0:.1f} s at {cluster.base}")
        if not cluster.namespaces:
            log(
                "warning: loopback cluster (not root?): set_latency is unavailable, scenario 5 will be skipped"
            )
        self.match_ssh(cluster)
        self.write_peer_files(cluster)
        return cluster

    def match_ssh(self, cluster: Cluster) -> dict[str, Any]:
        """Learn (once) the key exchange and cipher ssh_scheduler negotiates with this cluster's
        hosts, and check that OpenSSH pinned to them negotiates the same.  Every test host runs
        the same sshd with the same configuration, so one host answers for all."""
        if self.ssh_match is None:
            host = cluster.hosts[0]
            found = matched(PY, str(cluster.machines_dir / f"{host.name}.yaml"), self.env, host.ssh_argv())
            self.ssh_match = found
            if found["same"]:
                log(f"key exchange: {found['kex']}, cipher {found['cipher']}: ours, and every OpenSSH peer and floor pinned to it")
            else:
                log(f"warning: key exchange not matched (ours {found['ours']}, OpenSSH pinned {found['openssh']}): peers keep their defaults")
        return self.ssh_match

    def openssh_options(self, cluster: Cluster | None = None) -> list[str]:
        """A plain OpenSSH client's options for the cluster's hosts (its key and known_hosts,
        strict host keys) and our key exchange and cipher; no port, no destination."""
        cluster = cluster or self.cluster
        assert cluster is not None
        argv = cluster.hosts[0].ssh_argv()
        base = argv[1 : argv.index("-p")]
        return [*base, *self.match_ssh(cluster)["options"]]

    def asyncssh_options(self, cluster: Cluster | None = None) -> list[str]:
        """The floors' options pinning asyncssh to the same key exchange and cipher as ours."""
        cluster = cluster or self.cluster
        assert cluster is not None
        found = self.match_ssh(cluster)
        return ["--kex", found["kex"], "--cipher", found["cipher"]] if found["same"] else []

    def write_peer_files(self, cluster: Cluster) -> None:
        # GNU parallel's --ssh: the cluster's options and our key exchange, then its arguments.
        wrapper = self.root / "ssh"
        wrapper.write_text("#!/bin/sh\nexec ssh " + shlex.join(self.openssh_options(cluster)) + ' "$@"\n')
        wrapper.chmod(0o755)
        for n in (4, 16):
            hosts = cluster.hosts[:n]
            (self.root / f"sshlogins{n}").write_text(
                "".join(
                    f"{h.user}@{h.ip}\n" if h.port == 22 else f"-p {h.port} {h.user}@{h.ip}\n"
                    for h in hosts
                )
            )

    def machines(self, names: Sequence[str], cluster: Cluster | None = None) -> list[str]:
        cluster = cluster or self.cluster
        assert cluster is not None
        return [str(cluster.machines_dir / f"{n}.yaml") for n in names]

    def host(self, name: str) -> Any:
        assert self.cluster is not None
        return self.cluster[name]

    def wipe_workdirs(self, names: Sequence[str], extra: Sequence[str] = ()) -> None:
        """Take the hosts' ssh_scheduler work roots (caches, job dirs) and other leftovers out
        of the way: moved into a folder in the host's home that the benchmark removes as it ends
        (close), not removed here, right before the run measured next (see runner.set_aside:
        the inodes freed then made that run's own files cost several times the CPU)."""
        for n in names:
            h = self.host(n)
            # Nothing of ours may go on working in what is set aside: the hub's spare agent there
            # holds the work root open (its descriptors follow the rename), so the next run would
            # find the old cache.  The login user's processes end, but not its sshd sessions:
            # the hub's connection must not be left for the run measured next to find dead (a
            # killed session's socket stays open in sshd's monitor: 2 s before it is given up).
            if h.init_pid:
                h.kill_user_processes(keep=("sshd",))
            trash = h.home / ".bench-trash"
            for path in (h.workdir, *(h.home / sub for sub in extra)):
                if os.path.lexists(path):
                    trash.mkdir(exist_ok=True)
                    os.rename(path, Path(tempfile.mkdtemp(dir=trash)) / path.name)

    def cache_bytes(self, names: Sequence[str]) -> int:
        total = 0
        for n in names:
            cache = self.host(n).workdir / "cache"
            if cache.is_dir():
                for p in cache.rglob("*"):
                    with contextlib.suppress(OSError):
                        if p.is_file() and not p.is_symlink():
                            total += p.stat().st_size
        return total

    def rundir(self, sid: str, tool: str) -> Path:
        base = self.root / f"s{sid}" / re.sub(r"[^A-Za-z0-9_.-]+", "_", tool)
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="r", dir=base))

    # ----- common commands
    def ssh_wrapper(self) -> str:
        """``ssh`` for GNU parallel: pinned to our key exchange (write_peer_files)."""
        return str(self.root / "ssh")

    def pdsh_cmd(self, cwd: Path, cluster: Cluster, names: Sequence[str], command: str, fanout: int) -> Cmd:
        """``pdsh -R ssh -f FANOUT -w user@ip,... COMMAND`` with OpenSSH pinned to our key
        exchange (PDSH_SSH_ARGS: the options, then pdsh's own -l%u %h)."""
        env = dict(self.env)
        env["PDSH_RCMD_TYPE"] = "ssh"
        env["PDSH_SSH_ARGS"] = shlex.join(self.openssh_options(cluster)) + " -l%u %h"
        hosts = ",".join(f"{cluster[n].user}@{cluster[n].ip}" for n in names)
        return Cmd(["pdsh", "-R", "ssh", "-f", str(fanout), "-w", hosts, command], cwd, env=env)

    def settle(self) -> float:
        """Wait (up to 30 s) until this user's hub starts no spare agent and no launcher of
        ours is still loading: the spares a batch leaves are started after it ended, a command
        that used the hub starts its launcher as it ends, and that work must not land in the
        next tool's measurement (a peer's, measured next).  Returns the seconds waited."""
        began = time.monotonic()
        while time.monotonic() - began < 30 and (
            any(held.get("spare_starting") for hub in hub_status() for held in hub.get("held", ()))
            or loading_launchers()
        ):
            time.sleep(0.02)
        return time.monotonic() - began

    def make_cold(self, cluster: Cluster | None = None, names: Sequence[str] | None = None) -> int:
        """End every SSH connection something still holds open to these hosts (a hub keeping
        them warm for the next command), from the host's side: the login user's processes
        there, sessions included, are killed; and end this user's hub and warm launcher here
        (``ssh-scheduler hub stop``, waited for).  A cold run then starts as a first command
        does: it starts the hub, connects, and loads every module itself.  Returns how many
        connections were held (0 while nothing keeps any)."""
        cluster = cluster or self.cluster
        assert cluster is not None
        subprocess.run([str(VENV_BIN / "ssh-scheduler"), "hub", "stop"], env=self.env, capture_output=True, timeout=60, check=False)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (hub_status() or running_launchers()):
            time.sleep(0.05)
        held = 0
        for h in cluster.hosts:
            if (names is None or h.name in names) and h.init_pid:
                n = host_tcp(h.init_pid)[1]
                if n:
                    h.kill_user_processes()
                    held += n
        return held

    def parallel_cmd(
        self, cwd: Path, batch: Path, hosts: int, jobs_per_host: int, extra: Sequence[str] = ()
    ) -> Cmd:
        argv = [
            "parallel",
            "--ssh", self.ssh_wrapper(),
            "--sshloginfile", str(self.root / f"sshlogins{hosts}"),
            "--controlmaster",
            "-j", str(jobs_per_host),
            *extra,
        ]  # fmt: skip
        return Cmd(argv, cwd, stdin=batch, env=self.env)

    def floor_cmd(self, cwd: Path, batch: Path, names: Sequence[str], per_host: int, script: str = "bench_floor.py") -> Cmd:
        """A floor (scripts/bench_floor.py: a channel and a login shell per job; or
        scripts/bench_agent_floor.py: one agent per host) running ``batch`` on ``names``,
        ``per_host`` jobs at once on each, with our key exchange and cipher."""
        assert self.cluster is not None
        hosts = [f"{self.host(n).user}@{self.host(n).ip}:{self.host(n).port}" for n in names]
        argv = [
            PY, str(REPO / "scripts" / script), str(batch), *hosts,
            "--key", str(self.cluster.key_path),
            "--known-hosts", str(self.cluster.known_hosts),
            "--per-host", str(per_host),
            *self.asyncssh_options(),
        ]  # fmt: skip
        return Cmd(argv, cwd, env=self.env)

    def close(self) -> None:
        for c in (self.gpu_cluster, self.cluster):
            for h in c.hosts if c is not None else ():
                shutil.rmtree(h.home / ".bench-trash", ignore_errors=True)
            if c is not None:
                with contextlib.suppress(Exception):
                    t0 = time.monotonic()
                    c.stop()
                    log(f"cluster {c.cluster_id} removed in {time.monotonic() - t0:.1f} s")
        self.gpu_cluster = self.cluster = None
        shutil.rmtree(self.root, ignore_errors=True)
        self.disk.close()


def export_ref(ref: str, dest: Path) -> Path:
    """``git archive`` the package at ``ref`` into ``dest`` (imported first via PYTHONPATH; the
    editable install's finder comes after the path finder).  bench_combine.py comes from the ref
    when it has one, else from the working tree."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "ssh_scheduler"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    (dest / "scripts").mkdir()
    found = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{ref}:scripts/bench_combine.py"], capture_output=True
    )
    if found.returncode == 0:
        (dest / "scripts" / "bench_combine.py").write_bytes(found.stdout)
    else:
        shutil.copy(REPO / "scripts" / "bench_combine.py", dest / "scripts" / "bench_combine.py")
    return dest
