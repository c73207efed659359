"""Implementation of the SSH test cluster (see ``tests/cluster/__init__.py`` for the overview)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pwd
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "sshs"
SSHD = "/usr/sbin/sshd"
HERE = Path(__file__).resolve().parent
SUBNET_BASE = 57  # cluster slot k uses 10.213.(57+k).0/24; the first cluster gets 10.213.57.0/24
MAX_SLOTS = 64
# Hosts beyond the first 240 of a cluster live in 10.214.(57+k).0/24 on the same bridge (and
# 127.0.1.x in loopback mode): a /24 holds no more.
HOSTS_PER_NET = 240
MAX_HOSTS = 2 * HOSTS_PER_NET


def _host_net(index: int) -> tuple[int, int]:
    """(which /24 of the cluster, last octet) of host ``index`` (1-based)."""
    second = index > HOSTS_PER_NET
    return int(second), 10 + index - HOSTS_PER_NET * second
DEFAULT_GPU_NAME = "NVIDIA H100 80GB HBM3"
CLEAN_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
_CID_RE = re.compile(r"^[a-z0-9]{1,6}$")
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_LOCK_NAME = b"\0sshs-test-cluster-lock"
_SHARED_TOOLS = ("host_init.py", "nfq_delay.py", "fake_nvidia_smi.py", "gpu_hold.py")


class ClusterError(RuntimeError):
    """The cluster could not do what was asked (message says why; logs are attached)."""


class Unsupported(ClusterError):
    """The operation needs namespaces (root); the loopback fallback cannot do it."""


# --------------------------------------------------------------------------- specs


@dataclass
class GpuSpec:
    """One simulated GPU.  ``uuid=None`` derives a stable uuid from cluster/host/index."""

    name: str = DEFAULT_GPU_NAME
    memory_mb: int = 81559
    uuid: str | None = None
    reserved_mb: int = 480


@dataclass
class HostSpec:
    """One simulated machine.  ``name=None`` means ``h<i>`` (1-based)."""

    gpus: list[GpuSpec] = field(default_factory=list)
    mem_total_mb: int = 16384
    mem_available_mb: int = 12000
    cpus: int = 4
    max_sessions: int = 10
    max_startups: str = "10:30:100"
    loadavg: float = 0.0
    name: str | None = None
    sftp_server: str = "internal-sftp"
    """sshd's ``Subsystem sftp``: another command makes an sftp server that never answers."""


def _spec_from_dict(d: dict[str, Any]) -> HostSpec:
    d = dict(d)
    d["gpus"] = [GpuSpec(**g) for g in d.get("gpus", [])]
    return HostSpec(**d)


# --------------------------------------------------------------------------- small helpers


def _run(
    argv: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 30,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(argv),
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else CLEAN_ENV,
        check=False,
    )
    if check and proc.returncode != 0:
        raise ClusterError(
            f"command failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr}{proc.stdout}"
        )
    return proc


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the comm field (index 0 = state), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(")") + 2 :].split()


def _starttime(pid: int) -> str | None:
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return None
    return st[19]


def _alive(pid: int | None, start: str | None = None) -> bool:
    if not pid:
        return False
    st = _starttime(pid)
    return st is not None and (start is None or st == start)


def _all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _children(ppid: int) -> list[int]:
    out = []
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is not None and st[1] == str(ppid):
            out.append(pid)
    return out


def _ns_inode(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _nspid(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return []


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _reap(child: subprocess.Popen[Any], timeout: float) -> None:
    """Wait for a child we started and close its pipes (an unclosed pipe is a ResourceWarning,
    an error in this suite)."""
    try:
        child.wait(timeout=timeout)
    finally:
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None:
                stream.close()


def _wait_gone(pids: Sequence[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if _starttime(p) is not None]
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _tcp_accepts(ip: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def _owner_token() -> str:
    pid = os.getpid()
    return f"{pid}:{_starttime(pid)}"


def _owner_alive(token: str) -> bool:
    pid_s, _, start = token.partition(":")
    if pid_s == "0":
        return True  # persistent (scripts/cluster up): only `down` removes it
    try:
        return _alive(int(pid_s), start or None)
    except ValueError:
        return False


def _host_python() -> str:
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return shutil.which("python3") or sys.executable


def _gpu_uuid(seed: str) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _yaml_str(value: object) -> str:
    if isinstance(value, int):
        return str(value)
    s = str(value)
    if re.fullmatch(r"[A-Za-z_/][A-Za-z0-9_./-]*", s) and s.lower() not in (
        "yes",
        "no",
        "true",
        "false",
        "null",
        "on",
        "off",
    ):
        return s
    return json.dumps(s)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    os.chmod(path, mode)


def _rewrite_in_place(path: Path, text: str) -> None:
    """Rewrite keeping the inode (the file is bind-mounted inside a host)."""
    with open(path, "r+") as f:
        f.write(text)
        f.truncate()


@contextlib.contextmanager
def _global_lock(timeout: float = 60.0) -> Iterator[None]:
    """Machine-wide mutex: an abstract unix socket name (vanishes with its holder, no file)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.bind(_LOCK_NAME)
            break
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                sock.close()
                raise ClusterError(f"cannot take the cluster lock: {exc}") from exc
            time.sleep(0.05)
    try:
        yield
    finally:
        sock.close()


def namespaces_available() -> bool:
    """True when clusters can use network/PID/mount namespaces (root with ip/unshare/nsenter)."""
    if os.geteuid() != 0:
        return False
    return all(
        shutil.which(t, path=CLEAN_ENV["PATH"])
        for t in ("ip", "unshare", "nsenter", "useradd", "iptables")
    )


def sshd_available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh-keygen", path=CLEAN_ENV["PATH"]) is not None


def _sshd_version() -> tuple[int, int]:
    proc = subprocess.run([SSHD, "-V"], capture_output=True, text=True, check=False)
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", proc.stderr + proc.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _traversable(path: Path) -> bool:
    return all(not p.exists() or os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


# --------------------------------------------------------------------------- GPU holds


class GpuHold:
    """A simulated process holding GPU memory on a host (see ``Host.hold_gpu``)."""

    def __init__(
        self, host: Host, popen: subprocess.Popen[str], pid: int, gpu: int, mb: int
    ) -> None:
        self.host = host
        self.pid = pid  # as seen inside the host (what nvidia-smi prints)
        self.gpu = gpu
        self.mb = mb
        self._popen = popen

    @property
    def alive(self) -> bool:
        return self._popen.poll() is None

    def release(self) -> None:
        """Stop holding (SIGTERM the holder, which deregisters); idempotent."""
        if self._popen.poll() is None:
            for child in self.host._global_pids_of(self.pid):
                _kill(child, signal.SIGTERM)
            try:
                self._popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                for child in self.host._global_pids_of(self.pid):
                    _kill(child, signal.SIGKILL)
                _kill(self._popen.pid, signal.SIGKILL)
        _reap(self._popen, 5)
        with contextlib.suppress(ValueError):
            self.host._holds.remove(self)

    def __enter__(self) -> GpuHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------- hosts


class Host:
    """One simulated machine: a real sshd in its own network, PID and mount namespaces.

    Namespaced mode (root): reachable at ``ip:22`` (10.213.x.(10+i)) from the root namespace.
    Loopback mode (not root): a plain sshd on ``127.0.0.(10+i):port``; the namespace-only
    controls raise :class:`Unsupported`.
    """

    def __init__(
        self, cluster: Cluster, index: int, spec: HostSpec, data: dict[str, Any] | None = None
    ) -> None:
        self.cluster = cluster
        self.index = index
        self.spec = spec
        self.name = spec.name or f"h{index}"
        cid = cluster.cluster_id
        self.dir = cluster.base / "hosts" / self.name
        self.machine_file = cluster.base / "machines" / f"{self.name}.yaml"
        self.netns = f"{PREFIX}-{cid}-{self.name}"
        self.veth = f"{PREFIX}{cid}h{index}"
        self._orig = dataclasses.replace(spec, gpus=[dataclasses.replace(g) for g in spec.gpus])
        self.gpu_uuids = [
            g.uuid or _gpu_uuid(f"{cid}/{self.name}/{i}") for i, g in enumerate(spec.gpus)
        ]
        self._launcher: subprocess.Popen[bytes] | None = None
        self._nfq: subprocess.Popen[str] | None = None
        self._holds: list[GpuHold] = []
        self._frozen: list[int] = []
        self._cut = False
        self._cut_by_crash = False
        self._latency: tuple[float, float] | None = None
        data = data or {}
        if cluster.namespaces:
            net, octet = _host_net(index)
            self.ip = f"10.{213 + net}.{SUBNET_BASE + cluster.slot}.{octet}"
            self.port = 22
            self.user = f"{PREFIX}_{cid}_{self.name}"
            self.home = self.dir / "home"
        else:
            net, octet = _host_net(index)
            self.ip = f"127.0.{net}.{octet}"
            self.port = int(data.get("port", 0))
            self.user = pwd.getpwuid(os.getuid()).pw_name
            self.home = Path(pwd.getpwuid(os.getuid()).pw_dir)
        self.uid = int(data.get("uid", -1))
        self.gid = int(data.get("gid", -1))
        self.init_pid: int | None = data.get("init_pid")
        self._init_start: str | None = data.get("init_start")

    # ----- descriptive
    def __repr__(self) -> str:
        return f"<Host {self.name} {self.user}@{self.ip}:{self.port}>"

    @property
    def workdir(self) -> Path:
        """Where the project's default remote work root lands, on the real filesystem."""
        if self.cluster.namespaces:
            return self.home / ".ssh_scheduler"
        return self.dir / "work"

    @property
    def gpu_state_dir(self) -> Path:
        return self.dir / "gpu"

    def machine_yaml(self) -> dict[str, object]:
        d: dict[str, object] = {
            "name": self.name,
            "username": self.user,
            "ip": self.ip,
            "port": self.port,
            "ssh_key_path": str(self.cluster.key_path),
            "known_hosts": str(self.cluster.known_hosts),
        }
        if not self.cluster.namespaces:
            d["workdir"] = str(self.workdir)
        return d

    def ssh_argv(self, cmd: str | None = None, *, options: Sequence[str] = ()) -> list[str]:
        """argv for a plain OpenSSH client logging into this host (strict host key checking)."""
        argv = [
            "ssh",
            "-F", "/dev/null",
            "-i", str(self.cluster.key_path),
            "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={self.cluster.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes",
            "-o", "LogLevel=ERROR",
            "-p", str(self.port),
            *options,
            f"{self.user}@{self.ip}",
        ]  # fmt: skip
        if cmd is not None:
            argv.append(cmd)
        return argv

    def ssh(
        self, cmd: str, *, timeout: float = 30, options: Sequence[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` over a real ssh login (returns the CompletedProcess; no check)."""
        return subprocess.run(
            self.ssh_argv(cmd, options=options),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    # ----- files
    def _sshd_config(self) -> str:
        s = self.spec
        lines = [
            f"# sshd for simulated host {self.name} of test cluster {self.cluster.cluster_id}",
            f"HostKey {self.dir}/ssh_host_ed25519_key",
            f"PidFile {self.dir}/sshd.pid",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            f"AllowUsers {self.user}",
            f"MaxSessions {s.max_sessions}",
            f"MaxStartups {s.max_startups}",
            "LogLevel ERROR",
            f"Subsystem sftp {s.sftp_server}",
        ]
        if self.cluster.sshd_version >= (9, 8):
            lines.append("PerSourcePenalties no")
        if self.cluster.namespaces:
            lines += [
                "Port 22",
                "ListenAddress 0.0.0.0",
                "AuthorizedKeysFile .ssh/authorized_keys",
                "StrictModes yes",
                "PermitRootLogin no",
            ]
        else:
            lines += [
                f"ListenAddress {self.ip}:{self.port}",
                f"AuthorizedKeysFile {self.dir}/authorized_keys",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                f"SetEnv PATH={self.dir}/bin:/usr/local/bin:/usr/bin:/bin SSHS_HOST={self._marker}",
            ]
        return "\n".join(lines) + "\n"

    @property
    def _marker(self) -> str:
        return f"{self.cluster.cluster_id}/{self.name}"

    def _meminfo(self) -> str:
        s = self.spec
        out = []
        with open("/proc/meminfo") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key == "MemTotal":
                    line = f"MemTotal:       {s.mem_total_mb * 1024:>8} kB\n"
                elif key == "MemFree":
                    line = f"MemFree:        {s.mem_available_mb * 1024:>8} kB\n"
                elif key == "MemAvailable":
                    line = f"MemAvailable:   {s.mem_available_mb * 1024:>8} kB\n"
                out.append(line)
        return "".join(out)

    def _cpuinfo(self) -> str:
        with open("/proc/cpuinfo") as f:
            block = f.read().split("\n\n")[0]
        n = self.spec.cpus
        blocks = []
        for i in range(n):
            b = re.sub(
                r"(?m)^(processor|core id|apicid|initial apicid)(\s*): \d+$",
                rf"\g<1>\g<2>: {i}",
                block,
            )
            b = re.sub(r"(?m)^(siblings|cpu cores)(\s*): \d+$", rf"\g<1>\g<2>: {n}", b)
            blocks.append(b)
        return "\n\n".join(blocks) + "\n\n"

    def _loadavg(self) -> str:
        x = self.spec.loadavg
        return f"{x:.2f} {x:.2f} {x:.2f} 1/64 1\n"

    def _install_tool(self, src: str, dest: Path) -> None:
        text = (HERE / src).read_text()
        text = text.replace("#!/usr/bin/python3 -IS", f"#!{self.cluster.python} -IS", 1)
        text = text.replace(
            "STATE_DIR = None  # replaced per host by the cluster",
            f"STATE_DIR = {str(self.gpu_state_dir)!r}",
            1,
        )
        _write(dest, text, 0o755)

    def _prepare(self) -> None:
        """Create the host's directory, keys are made by the cluster; users exist already."""
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        (d / "bin").mkdir(exist_ok=True)
        os.chmod(d / "bin", 0o755)
        gdir = self.gpu_state_dir
        (gdir / "procs").mkdir(parents=True, exist_ok=True)
        os.chmod(gdir, 0o755)
        os.chmod(gdir / "procs", 0o1777)
        _write(gdir / "lock", "")
        _write(
            gdir / "gpus",
            "".join(
                f"{i}\t{self.gpu_uuids[i]}\t{g.memory_mb}\t{g.reserved_mb}\t{g.name}\n"
                for i, g in enumerate(self.spec.gpus)
            ),
        )
        if self.spec.gpus:
            self._install_tool("fake_nvidia_smi.py", d / "bin" / "nvidia-smi")
        self._install_tool("gpu_hold.py", d / "bin" / "gpu_hold")
        _write(d / "sshd_config", self._sshd_config())
        key = self.cluster.key_path.with_suffix(".pub").read_text()
        if self.cluster.namespaces:
            _write(d / "meminfo", self._meminfo(), 0o444)
            _write(d / "cpuinfo", self._cpuinfo(), 0o444)
            _write(d / "loadavg", self._loadavg(), 0o444)
            _write(
                d / "cpu_online",
                f"0-{self.spec.cpus - 1}\n" if self.spec.cpus > 1 else "0\n",
                0o444,
            )
            _write(d / "nproc", self._nproc_script(), 0o755)
            for sub in ("tmp", "vartmp"):
                (d / sub).mkdir(exist_ok=True)
                os.chmod(d / sub, 0o1777)
            home = self.home
            (home / ".ssh").mkdir(parents=True, exist_ok=True)
            _write(home / ".ssh" / "authorized_keys", key, 0o600)
            for p in (home, home / ".ssh", home / ".ssh" / "authorized_keys"):
                os.chown(p, self.uid, self.gid)
            os.chmod(home, 0o700)
            os.chmod(home / ".ssh", 0o700)
            _write(d / "setup.sh", self._setup_script(), 0o755)
        else:
            (d / "work").mkdir(exist_ok=True)
            _write(d / "authorized_keys", key, 0o600)

    def _nproc_script(self) -> str:
        return (
            "#!/bin/sh\n"
            f"# nproc of simulated host {self.name}: {self.spec.cpus} CPUs (real nproc uses sched_getaffinity)\n"
            f"n={self.spec.cpus}\n"
            'while [ $# -gt 0 ]; do case "$1" in\n'
            "  --ignore=*) n=$((n - ${1#--ignore=}));;\n"
            "  --ignore) shift; n=$((n - $1));;\n"
            "esac; shift; done\n"
            '[ "$n" -lt 1 ] && n=1\n'
            'echo "$n"\n'
        )

    def _setup_script(self) -> str:
        base = self.cluster.base
        return f"""#!/bin/sh
# Runs as PID 1 of host {self.name}'s new PID/mount/UTS/IPC namespaces (inside its netns).
set -e
H='{self.dir}'
echo '{self.name}' > /proc/sys/kernel/hostname
# drop our copies of /run/netns/* (they would pin other hosts' network namespaces)
umount -R -l /run/netns 2>/dev/null || true
# a sysfs that shows this host's network devices (what `ip netns exec` does)
umount -l /sys
mount -t sysfs {PREFIX}-sys /sys
mount -t tmpfs -o mode=0755,size=16m {PREFIX}-run /run
mkdir -m 0755 /run/sshd /run/{PREFIX}-self
# hide the other hosts of the cluster: keep only this host's directory visible
mount --bind "$H" /run/{PREFIX}-self
mount -t tmpfs -o mode=0755,size=1m {PREFIX}-hosts '{base}/hosts'
mkdir -m 0755 "$H"
mount --move /run/{PREFIX}-self "$H"
rmdir /run/{PREFIX}-self
mount --bind "$H/meminfo" /proc/meminfo
mount --bind "$H/cpuinfo" /proc/cpuinfo
mount --bind "$H/loadavg" /proc/loadavg
for f in online possible present; do mount --bind "$H/cpu_online" /sys/devices/system/cpu/$f; done
mount --bind "$H/nproc" /usr/bin/nproc
mount -t overlay -o lowerdir="$H/bin":/usr/local/bin {PREFIX}-bin /usr/local/bin 2>/dev/null || mount --bind "$H/bin" /usr/local/bin
mount --bind "$H/tmp" /tmp
mount --bind "$H/vartmp" /var/tmp
mount -t tmpfs -o mode=1777,size=256m {PREFIX}-shm /dev/shm
{SSHD} -f "$H/sshd_config" -E "$H/sshd.log"
exec {self.cluster.python} -IS '{base}/shared/host_init.py'
"""

    # ----- process bookkeeping
    def _pidns(self) -> str | None:
        if self.init_pid and _alive(self.init_pid, self._init_start):
            return _ns_inode(self.init_pid, "pid")
        return None

    def processes(self) -> list[tuple[int, int]]:
        """(global pid, pid inside the host) of every live process of the host."""
        if not self.cluster.namespaces:
            return [(p, p) for p in self._loopback_pids()]
        ns = self._pidns()
        if ns is None:
            return []
        out = []
        for pid in _all_pids():
            if _ns_inode(pid, "pid") == ns and _starttime(pid) is not None:
                nsp = _nspid(pid)
                if nsp:
                    out.append((pid, nsp[-1]))
        return out

    def _global_pids_of(self, nspid: int) -> list[int]:
        if not self.cluster.namespaces:
            return [nspid] if _alive(nspid) else []
        return [g for g, n in self.processes() if n == nspid]

    def is_running(self) -> bool:
        """The host is up (its init lives; sshd may still be stopped)."""
        if self.cluster.namespaces:
            return self.init_pid is not None and _alive(self.init_pid, self._init_start)
        return self._sshd_pid() is not None

    def _sshd_nspid(self) -> int | None:
        try:
            return int((self.dir / "sshd.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _sshd_pid(self) -> int | None:
        """Global pid of the sshd listener, if it runs."""
        nspid = self._sshd_nspid()
        if nspid is None:
            return None
        if not self.cluster.namespaces:
            st = _proc_stat(nspid)
            if st is None or st[0] == "Z":
                return None
            try:
                exe = os.readlink(f"/proc/{nspid}/exe")
            except OSError:
                return None
            return nspid if exe.endswith("sshd") else None
        pids = self._global_pids_of(nspid)
        return pids[0] if pids else None

    def sshd_running(self) -> bool:
        return self._sshd_pid() is not None

    def _nsenter(self, *, user: str | None = None) -> tuple[list[str], dict[str, str]]:
        if not self.is_running():
            raise ClusterError(f"host {self.name} is down")
        argv = ["nsenter", "-t", str(self.init_pid), "-m", "-u", "-i", "-n", "-p"]
        env = dict(CLEAN_ENV)
        env["PATH"] = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
        if user is None or user == "root":
            argv.append("--wd=/")
            env.update(HOME="/root", USER="root", LOGNAME="root")
        else:
            pw = pwd.getpwnam(user)
            # Another host's user (or the cluster's other_user) has no home on this host.
            home = pw.pw_dir if user == self.user else "/tmp"
            argv += [
                f"--wd={home}",
                "setpriv",
                f"--reuid={pw.pw_uid}",
                f"--regid={pw.pw_gid}",
                "--init-groups",
            ]
            env.update(HOME=home, USER=user, LOGNAME=user, SHELL=pw.pw_shell)
        return argv, env

    def run(
        self,
        cmd: str,
        user: str | None = None,
        *,
        timeout: float = 60,
        input: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` with /bin/sh inside the host (its namespaces), as root by default.

        Pass ``user=host.user`` to run as the host's login user.  Loopback mode runs it
        locally (as the current user) with the host's PATH.
        """
        if self.cluster.namespaces:
            argv, env = self._nsenter(user=user)
        else:
            argv, env = (
                [],
                dict(
                    CLEAN_ENV,
                    PATH=f"{self.dir}/bin:/usr/local/bin:/usr/bin:/bin",
                    SSHS_HOST=self._marker,
                ),
            )
        proc = subprocess.run(
            [*argv, "/bin/sh", "-c", cmd],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"{self.name}: {cmd!r} failed ({proc.returncode}): {proc.stderr}{proc.stdout}"
            )
        return proc

    # ----- lifecycle
    def _logs(self) -> str:
        out = []
        for name in ("launch.log", "sshd.log"):
            p = self.dir / name
            if p.exists():
                out.append(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def _launch(self) -> None:
        """Start the host (async); ``_wait_ready`` waits for sshd."""
        if self.is_running():
            return
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "sshd.pid").unlink()
        self._clear_gpu_registrations()
        with open(self.dir / "launch.log", "ab") as log:
            if self.cluster.namespaces:
                argv = [
                    *self._in_netns(),
                    "unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--mount-proc",
                    "--propagation", "private", "/bin/sh", str(self.dir / "setup.sh"),
                ]  # fmt: skip
            else:
                argv = [
                    SSHD,
                    "-D",
                    "-f",
                    str(self.dir / "sshd_config"),
                    "-E",
                    str(self.dir / "sshd.log"),
                ]
                if os.geteuid() == 0:  # root sshd needs /run/sshd: give it a private /run
                    script = (
                        "umount -R -l /run/netns 2>/dev/null; "
                        'mount -t tmpfs -o mode=0755,size=1m sshs-run /run && mkdir -m 0755 /run/sshd && exec "$@"'
                    )
                    argv = [
                        "unshare",
                        "--mount",
                        "--propagation",
                        "private",
                        "/bin/sh",
                        "-c",
                        script,
                        "sh",
                        *argv,
                    ]
            self._launcher = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=CLEAN_ENV,
                start_new_session=True,
            )
        if self.cluster.namespaces:
            deadline = time.monotonic() + 10
            while True:
                kids = _children(self._launcher.pid)
                if kids:
                    self.init_pid = kids[0]
                    self._init_start = _starttime(kids[0])
                    break
                if self._launcher.poll() is not None or time.monotonic() > deadline:
                    raise ClusterError(f"host {self.name} failed to start\n{self._logs()}")
                time.sleep(0.002)

    def _wait_ready(self, timeout: float = 60) -> None:
        # Generous: on a shared 2-core box at load 35 a healthy sshd took over 15 s to accept;
        # a host that really fails says so through its launcher's exit, not this deadline.
        deadline = time.monotonic() + timeout
        while not _tcp_accepts(self.ip, self.port):
            if self._launcher is not None and self._launcher.poll() is not None:
                raise ClusterError(f"host {self.name} exited during start\n{self._logs()}")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"host {self.name}: sshd did not accept on {self.ip}:{self.port}\n{self._logs()}"
                )
            time.sleep(0.01)

    def start(self, timeout: float = 60) -> None:
        """Boot the host (after ``crash()``): same IP, host key, user and home contents."""
        if self._cut_by_crash:
            self.heal_network()
            self._cut_by_crash = False
        if self.is_running():
            if not self.sshd_running():
                self.start_sshd()
            return
        self._launch()
        self._wait_ready(timeout)
        self.cluster._save()

    def crash(self, power_off: bool = False) -> None:
        """Kill every process of the host at once (SIGKILL its PID-namespace init).

        The host's kernel is the machine's, so peers see their TCP connections closed.
        ``power_off=True`` first cuts the network (until ``start()``), so peers see nothing
        at all and their connections hang, like a machine losing power.  Network faults set
        with ``cut_network``/``set_latency`` stay in place, like a switch would keep them.
        """
        if power_off:
            self._need_ns("crash(power_off=True)")
            if not self._cut:
                self.cut_network()
                self._cut_by_crash = True
        self._frozen = []
        if self.cluster.namespaces:
            if self.init_pid and _alive(self.init_pid, self._init_start):
                _kill(self.init_pid, signal.SIGKILL)
                _wait_gone([self.init_pid], 10)
            self.init_pid = None
            self._init_start = None
        else:
            pids = self._loopback_pids()
            for p in pids:
                _kill(p, signal.SIGKILL)
            _wait_gone(pids, 10)
        children: list[subprocess.Popen[Any]] = [h._popen for h in self._holds]
        if self._launcher is not None:
            children.append(self._launcher)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                _reap(child, 10)
        self._launcher = None
        self._holds.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "sshd.pid").unlink()
        self._clear_gpu_registrations()

    def restart(self, timeout: float = 60) -> None:
        """``crash()`` then ``start()``."""
        self.crash()
        self.start(timeout)

    def _loopback_pids(self) -> list[int]:
        """Loopback mode: the sshd listener, its descendants and anything carrying our env marker."""
        marker = f"SSHS_HOST={self._marker}".encode()
        found: set[int] = set()
        root = self._sshd_nspid()
        if root is not None and _alive(root):
            found.add(root)
        parents: dict[int, int] = {}
        for pid in _all_pids():
            st = _proc_stat(pid)
            if st is None:
                continue
            parents[pid] = int(st[1])
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.add(pid)
            except OSError:
                pass
        changed = True
        while changed:
            changed = False
            for pid, ppid in parents.items():
                if ppid in found and pid not in found:
                    found.add(pid)
                    changed = True
        found.discard(os.getpid())
        return sorted(found)

    def _clear_gpu_registrations(self) -> None:
        pdir = self.gpu_state_dir / "procs"
        if pdir.is_dir():
            for p in pdir.iterdir():
                with contextlib.suppress(OSError):
                    p.unlink()

    # ----- sshd control
    def stop_sshd(self) -> None:
        """Stop the sshd listener: new connections are refused.  Established sessions and
        the jobs they started keep running (the host's init, not sshd, is PID 1)."""
        pid = self._sshd_pid()
        if pid is not None:
            _kill(pid, signal.SIGTERM)
            _kill(pid, signal.SIGCONT)
            if not _wait_gone([pid], 5):
                _kill(pid, signal.SIGKILL)
                _wait_gone([pid], 5)
            if self._launcher is not None and not self.cluster.namespaces:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._launcher.wait(timeout=5)
                self._launcher = None
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "sshd.pid").unlink()
        if pid in self._frozen:
            self._frozen.remove(pid)

    def start_sshd(self, timeout: float = 60) -> None:
        """Start the sshd listener again (no-op if it runs)."""
        if self.sshd_running():
            return
        if not self.cluster.namespaces:
            self._launch()
        else:
            argv, env = self._nsenter()
            _run(
                [
                    *argv,
                    SSHD,
                    "-f",
                    str(self.dir / "sshd_config"),
                    "-E",
                    str(self.dir / "sshd.log"),
                ],
                env=env,
            )
        self._wait_ready(timeout)

    def set_sshd_limits(
        self, max_sessions: int | None = None, max_startups: str | int | None = None
    ) -> None:
        """Rewrite sshd_config with new MaxSessions/MaxStartups and restart the listener
        (established connections keep their old limits)."""
        if max_sessions is not None:
            self.spec.max_sessions = int(max_sessions)
        if max_startups is not None:
            self.spec.max_startups = str(max_startups)
        _write(self.dir / "sshd_config", self._sshd_config())
        if self.sshd_running():
            self.stop_sshd()
            self.start_sshd()
        self.cluster._save()

    # ----- faults
    def freeze(self, whole_host: bool = False) -> None:
        """SIGSTOP the sshd listener: TCP connects still complete (kernel backlog) but no
        SSH banner is ever sent; established sessions keep working.  ``whole_host=True``
        stops every process of the host (except its init), so sessions hang too."""
        pids = (
            [g for g, n in self.processes() if n != 1]
            if whole_host
            else [p for p in [self._sshd_pid()] if p]
        )
        for p in pids:
            _kill(p, signal.SIGSTOP)
            if p not in self._frozen:
                self._frozen.append(p)

    def thaw(self) -> None:
        for p in self._frozen:
            _kill(p, signal.SIGCONT)
        self._frozen = []

    def _in_netns(self) -> list[str]:
        # not `ip netns exec`: that makes a mount namespace holding copies of every
        # /run/netns/* mount, which would keep other clusters' namespaces alive
        return ["nsenter", f"--net=/run/netns/{self.netns}"]

    def _iptables(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([*self._in_netns(), "iptables", "-w", *args], check=check)

    def _need_ns(self, what: str) -> None:
        if not self.cluster.namespaces:
            raise Unsupported(f"{what} needs network namespaces (run as root)")

    def cut_network(self) -> None:
        """Silently drop every packet to/from the host (connects and sessions hang, no RST)."""
        self._need_ns("cut_network")
        if not self._cut:
            self._iptables("-I", "INPUT", "-i", "eth0", "-j", "DROP")
            self._iptables("-I", "OUTPUT", "-o", "eth0", "-j", "DROP")
            self._cut = True

    def heal_network(self) -> None:
        self._cut_by_crash = False
        if self._cut:
            self._iptables("-D", "INPUT", "-i", "eth0", "-j", "DROP", check=False)
            self._iptables("-D", "OUTPUT", "-o", "eth0", "-j", "DROP", check=False)
            self._cut = False

    def set_latency(self, ms: float, loss_percent: float = 0) -> None:
        """Hold every packet the host sends for ``ms`` (so each round trip gets ``ms``
        longer) and drop ``loss_percent`` % of them.  No netem here: an NFQUEUE helper
        (tests/cluster/nfq_delay.py) in the host's netns does it."""
        self._need_ns("set_latency")
        self.clear_latency()
        if ms <= 0 and loss_percent <= 0:
            return
        self._nfq = subprocess.Popen(
            [*self._in_netns(), self.cluster.python, "-IS", str(self.cluster.base / "shared" / "nfq_delay.py"),
             "--delay-ms", str(ms), "--loss", str(loss_percent)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=CLEAN_ENV, start_new_session=True,
        )  # fmt: skip
        assert self._nfq.stdout is not None
        ready, _, _ = select.select([self._nfq.stdout], [], [], 10)
        line = self._nfq.stdout.readline() if ready else ""
        if line.strip() != "READY":
            self._nfq.kill()
            err = self._nfq.communicate(timeout=5)[1]
            self._nfq = None
            raise ClusterError(f"latency helper failed on {self.name}: {err}")
        self._iptables(
            "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"
        )
        self._latency = (ms, loss_percent)

    def clear_latency(self) -> None:
        if self._latency is not None:
            self._iptables(
                "-D",
                "OUTPUT",
                "-o",
                "eth0",
                "-j",
                "NFQUEUE",
                "--queue-num",
                "0",
                "--queue-bypass",
                check=False,
            )
            self._latency = None
        if self._nfq is not None:
            self._nfq.terminate()
            try:
                self._nfq.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                self._nfq.kill()
                self._nfq.communicate(timeout=5)
            self._nfq = None

    # ----- simulated resources
    def set_memory(self, available_mb: int | None = None, total_mb: int | None = None) -> None:
        """Change what /proc/meminfo says inside the host (MemAvailable/MemFree, MemTotal)."""
        self._need_ns("set_memory")
        if available_mb is not None:
            self.spec.mem_available_mb = int(available_mb)
        if total_mb is not None:
            self.spec.mem_total_mb = int(total_mb)
        _rewrite_in_place(self.dir / "meminfo", self._meminfo())

    def set_loadavg(self, load: float) -> None:
        """Change what /proc/loadavg says inside the host (static, all three averages)."""
        self._need_ns("set_loadavg")
        self.spec.loadavg = float(load)
        _rewrite_in_place(self.dir / "loadavg", self._loadavg())

    # ----- a small file system that really fills up
    def mount_small_fs(self, path: str, size_kb: int = 1024) -> None:
        """Mount a tmpfs of ``size_kb`` KiB at ``path`` inside the host (mode 1777, like /tmp).
        It lives in the host's own mount namespace (nobody outside sees it) and really runs out
        of space, for full-disk tests; :meth:`fill_fs` fills it, :meth:`unmount` removes it (so
        does the host's end)."""
        self._need_ns("a small file system inside the host")
        quoted = shlex.quote(path)
        self.run(f"mkdir -p {quoted} && mount -t tmpfs -o size={int(size_kb)}k,mode=1777 "
                 f"{PREFIX}-small {quoted}", check=True)

    def fill_fs(self, path: str, user: str | None = None) -> None:
        """Fill the file system holding ``path`` with one file at ``path`` written as ``user``
        (root by default) until the kernel says ENOSPC."""
        self.run(f"cat /dev/zero > {shlex.quote(path)} 2>/dev/null; true", user=user, check=True)

    def free_fs(self, path: str) -> None:
        """Remove the file :meth:`fill_fs` wrote (as root): the space is back."""
        self.run(f"rm -f {shlex.quote(path)}", check=True)

    def unmount(self, path: str) -> None:
        """Undo :meth:`mount_small_fs` (lazily: a process still working there keeps it until it
        leaves)."""
        self._need_ns("a small file system inside the host")
        self.run(f"umount -l {shlex.quote(path)} 2>/dev/null; rmdir {shlex.quote(path)} 2>/dev/null; true")

    def hold_gpu(
        self, index: int, mb: int, util: int = 100, *, user: str | None = None, name: str = "python3",
        oversubscribe: bool = False,
    ) -> GpuHold:  # fmt: skip
        """Make "someone else's" process (root inside the host by default) hold ``mb`` MiB
        and ``util`` % on GPU ``index``.  Returns once nvidia-smi shows it."""
        args = [
            "gpu_hold",
            "--gpu",
            str(index),
            "--mb",
            str(mb),
            "--util",
            str(util),
            "--name",
            name,
            "--ready",
        ]
        if oversubscribe:
            args.append("--oversubscribe")
        if self.cluster.namespaces:
            prefix, env = self._nsenter(user=user)
        else:
            prefix, env = (
                [],
                dict(CLEAN_ENV, PATH=f"{self.dir}/bin:/usr/bin:/bin", SSHS_HOST=self._marker),
            )
        popen = subprocess.Popen(
            [*prefix, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, start_new_session=True,
        )  # fmt: skip
        assert popen.stdout is not None
        ready, _, _ = select.select([popen.stdout], [], [], 10)
        line = popen.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            popen.kill()
            err = popen.communicate(timeout=5)[1]
            raise ClusterError(f"gpu_hold on {self.name} failed: {err.strip()}")
        hold = GpuHold(self, popen, int(line.split()[1]), index, mb)
        self._holds.append(hold)
        return hold

    # ----- reset (used between tests sharing a cluster)
    def kill_user_processes(self, keep: Sequence[str] = ()) -> None:
        """SIGKILL every process of the login user on this host (sessions, jobs), but those
        whose name (``comm``) is in ``keep``."""
        if self.cluster.namespaces:
            pids = [g for g, _ in self.processes() if _uid_of(g) == self.uid]
        else:
            root = self._sshd_nspid()
            pids = [p for p in self._loopback_pids() if p != root]
        pids = [p for p in pids if _comm(p) not in keep] if keep else pids
        for p in pids:
            _kill(p, signal.SIGKILL)
        _wait_gone(pids, 5)

    def wipe_home(self) -> None:
        """Empty the login user's home (keeps ~/.ssh) or, in loopback mode, the workdir."""
        target = self.home if self.cluster.namespaces else self.workdir
        for p in target.iterdir():
            if p.name == ".ssh" and self.cluster.namespaces:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def reset(self, wipe_home: bool = False) -> None:
        """Undo faults and simulated-resource changes, kill the login user's leftover
        processes (jobs of the previous test) and restart the host if it is down.
        Home contents are kept unless ``wipe_home``."""
        self.thaw()
        for hold in list(self._holds):
            hold.release()
        if self.is_running():
            self.kill_user_processes()
        if wipe_home:
            self.wipe_home()
        if self.cluster.namespaces:
            self.heal_network()
            self.clear_latency()
        o = self._orig
        if (self.spec.max_sessions, self.spec.max_startups) != (o.max_sessions, o.max_startups):
            self.set_sshd_limits(o.max_sessions, o.max_startups)
        if self.cluster.namespaces:
            if (self.spec.mem_available_mb, self.spec.mem_total_mb) != (
                o.mem_available_mb,
                o.mem_total_mb,
            ):
                self.set_memory(o.mem_available_mb, o.mem_total_mb)
            if self.spec.loadavg != o.loadavg:
                self.set_loadavg(o.loadavg)
        if not self.is_running():
            self.start()
        elif not self.sshd_running():
            self.start_sshd()

    def _to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "spec": dataclasses.asdict(self.spec),
            "ip": self.ip,
            "port": self.port,
            "user": self.user,
            "uid": self.uid,
            "gid": self.gid,
            "init_pid": self.init_pid,
            "init_start": self._init_start,
        }


# --------------------------------------------------------------------------- clusters

_LIVE: list[Cluster] = []
_ATEXIT = False


def _stop_live() -> None:
    for c in list(_LIVE):
        c.stop()


def _install_exit_handlers() -> None:
    """Stop clusters on interpreter exit, and turn SIGTERM into KeyboardInterrupt so ``finally``
    blocks (and atexit) run; SIGKILLed owners are cleaned by the next ``start_cluster``."""
    global _ATEXIT
    if _ATEXIT:
        return
    _ATEXIT = True
    atexit.register(_stop_live)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):

        def on_term(signo: int, _frame: object) -> None:
            raise KeyboardInterrupt(f"signal {signo}")  # pytest then tears fixtures down

        signal.signal(signal.SIGTERM, on_term)


class Cluster:
    """A set of simulated hosts plus the client key, known_hosts and machine YAMLs."""

    def __init__(
        self, cluster_id: str, base: Path, namespaces: bool, slot: int, persistent: bool = False
    ) -> None:
        self.cluster_id = cluster_id
        self.base = base
        self.namespaces = namespaces
        self.slot = slot
        self.persistent = persistent
        self.bridge = f"{PREFIX}{cluster_id}"
        self.key_path = base / "id_ed25519"
        self.known_hosts = base / "known_hosts"
        self.ssh_wrapper = (
            base / "ssh"
        )  # `ssh` with the key/known_hosts options: base/ssh user@ip cmd
        self.hosts: list[Host] = []
        self.python = _host_python()
        self.sshd_version = _sshd_version()
        self.started_s: float | None = None
        self._stopped = False

    def __repr__(self) -> str:
        return f"<Cluster {self.cluster_id} {len(self.hosts)} hosts at {self.base}>"

    def other_user(self) -> str:
        """A second unprivileged unix user, present on every host (namespaced mode): the
        "someone else" of shared-machine tests.  ``host.run(cmd, user=cluster.other_user())``
        runs as them inside a host (in /tmp: they have no home).  Created on first use, removed
        with the cluster (its name carries the cluster's prefix)."""
        if not self.namespaces:
            raise Unsupported("a second unix user needs the namespaced (root) cluster")
        name = f"{PREFIX}_{self.cluster_id}_other"
        try:
            pwd.getpwnam(name)
        except KeyError:
            _run(["useradd", "-M", "-l", "-U", "-d", "/nonexistent", "-s", "/bin/bash", "-p", "*",
                  "-c", f"sshs test other user {self.cluster_id}", name])  # fmt: skip
        return name

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __getitem__(self, key: int | str) -> Host:
        if isinstance(key, int):
            return self.hosts[key]
        for h in self.hosts:
            if h.name == key:
                return h
        raise KeyError(key)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def machine_files(self) -> list[Path]:
        return [h.machine_file for h in self.hosts]

    @property
    def machines_dir(self) -> Path:
        return self.base / "machines"

    @property
    def subnet(self) -> str:
        return f"10.213.{SUBNET_BASE + self.slot}.0/24" if self.namespaces else "127.0.0.0/8"

    def reset(self, wipe_homes: bool = False) -> None:
        """``Host.reset`` on every host: undo faults and resource changes, kill leftover
        jobs of the login users, restart hosts that are down; homes are kept unless
        ``wipe_homes``."""
        for h in self.hosts:
            h.reset(wipe_home=wipe_homes)

    def _save(self) -> None:
        if self._stopped:
            return
        data = {
            "cluster_id": self.cluster_id,
            "namespaces": self.namespaces,
            "slot": self.slot,
            "persistent": self.persistent,
            "hosts": [h._to_dict() for h in self.hosts],
        }
        tmp = self.base / ".cluster.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.base / "cluster.json")

    @classmethod
    def load(cls, base: Path | str) -> Cluster:
        """Re-attach to a running cluster (e.g. one made by ``scripts/cluster up``)."""
        base = Path(base)
        data = json.loads((base / "cluster.json").read_text())
        c = cls(
            data["cluster_id"],
            base,
            data["namespaces"],
            data["slot"],
            data.get("persistent", False),
        )
        for hd in data["hosts"]:
            c.hosts.append(Host(c, hd["index"], _spec_from_dict(hd["spec"]), hd))
        return c

    # ----- teardown
    def stop(self) -> None:
        """Remove everything the cluster made (processes, netns, veths, bridge, users, files).

        Idempotent; errors are collected and re-raised at the end as one ClusterError."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)
        children = [p for h in self.hosts for p in (h._launcher, h._nfq) if p is not None]
        children += [hold._popen for h in self.hosts for hold in h._holds]
        problems = _teardown(
            self.cluster_id,
            self.base,
            self.namespaces,
            [h.user for h in self.hosts] if self.namespaces else [],
            launchers=children,
            loopback_hosts=[] if self.namespaces else self.hosts,
        )
        if problems:
            raise ClusterError("cluster teardown incomplete:\n" + "\n".join(problems))


def _netns_list() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _bridges() -> dict[str, str]:
    """Our bridges -> their alias ("sshs <owner> <base>")."""
    out = {}
    proc = _run(["ip", "-d", "-o", "link", "show", "type", "bridge"], check=False)
    for line in proc.stdout.splitlines():
        m = re.match(r"\d+: ([^:@]+)[:@]", line)
        if not m or not m.group(1).startswith(PREFIX):
            continue
        am = re.search(r"\balias (.*?)(?:\\|$)", line)
        out[m.group(1)] = am.group(1).strip() if am else ""
    return out


def _veths() -> dict[str, list[str]]:
    """cluster id -> our root-side veth names (sshs<cid>h<i>)."""
    out: dict[str, list[str]] = {}
    proc = _run(["ip", "-o", "link", "show", "type", "veth"], check=False)
    for line in proc.stdout.splitlines():
        m = re.match(rf"\d+: ({PREFIX}([a-z0-9]+)h\d+)[:@]", line)
        if m:
            out.setdefault(m.group(2), []).append(m.group(1))
    return out


def _our_users() -> list[pwd.struct_passwd]:
    return [p for p in pwd.getpwall() if p.pw_name.startswith(f"{PREFIX}_")]


def _kill_netns(ns: str) -> None:
    for _ in range(50):
        proc = _run(["ip", "netns", "pids", ns], check=False)
        pids = [int(x) for x in proc.stdout.split() if x.isdigit() and int(x) != os.getpid()]
        if not pids:
            return
        for p in pids:
            _kill(p, signal.SIGKILL)
        _wait_gone(pids, 2)


def _remove_base(base: Path) -> str | None:
    if not base.exists():
        return None
    if not (base / f".{PREFIX}-cluster").exists():
        return f"not removing {base}: no .{PREFIX}-cluster marker"
    try:
        shutil.rmtree(base)
    except OSError as exc:
        return f"removing {base}: {exc}"
    return None


def _teardown(
    cid: str,
    base: Path | None,
    namespaces: bool,
    users: Sequence[str],
    launchers: Sequence[subprocess.Popen[Any]] = (),
    loopback_hosts: Sequence[Host] = (),
) -> list[str]:
    problems: list[str] = []
    if namespaces:
        for ns in [n for n in _netns_list() if n.startswith(f"{PREFIX}-{cid}-")]:
            _kill_netns(ns)
        for link in _veths().get(cid, []):  # gone with the netns, unless something pins it
            _run(["ip", "link", "del", link], check=False)
        for ns in [n for n in _netns_list() if n.startswith(f"{PREFIX}-{cid}-")]:
            proc = _run(["ip", "netns", "del", ns], check=False)
            if proc.returncode != 0:
                problems.append(f"ip netns del {ns}: {proc.stderr.strip()}")
        names = set(users) | {
            p.pw_name for p in _our_users() if p.pw_name.startswith(f"{PREFIX}_{cid}_")
        }
        for name in sorted(names):
            try:
                uid = pwd.getpwnam(name).pw_uid
            except KeyError:
                continue
            left = [p for p in _all_pids() if _uid_of(p) == uid]
            for p in left:
                _kill(p, signal.SIGKILL)
            _wait_gone(left, 2)
            proc = _run(["userdel", name], check=False)
            if proc.returncode not in (0, 6):
                proc = _run(["userdel", "-f", name], check=False)
                if proc.returncode not in (0, 6):
                    problems.append(f"userdel {name}: {proc.stderr.strip()}")
    else:
        for h in loopback_hosts:
            pids = h._loopback_pids()
            for p in pids:
                _kill(p, signal.SIGKILL)
            _wait_gone(pids, 5)
    for child in launchers:
        with contextlib.suppress(Exception):
            if child.poll() is None:
                child.kill()
            _reap(child, 5)
    if base is not None:
        err = _remove_base(base)
        if err:
            problems.append(err)
    if namespaces:
        bridge = f"{PREFIX}{cid}"
        if bridge in _bridges():
            proc = _run(["ip", "link", "del", bridge], check=False)
            if proc.returncode != 0:
                problems.append(f"ip link del {bridge}: {proc.stderr.strip()}")
    return problems


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def cleanup_leftovers(*, include_persistent: bool = False, only: str | None = None) -> list[str]:
    """Remove what crashed earlier runs left: clusters whose owning process is dead (and
    orphaned ``sshs-*`` netns, ``sshs_*`` users, ``sshs-*`` base dirs).  Live clusters of
    other processes are left alone.  ``only=CID`` removes that cluster whatever its owner.
    Returns a description of what was removed."""
    with _global_lock():
        return _cleanup(include_persistent=include_persistent, only=only)


def _cleanup(*, include_persistent: bool = False, only: str | None = None) -> list[str]:
    removed: list[str] = []
    if namespaces_available():
        bridges = _bridges()
        live: set[str] = set()
        bases: dict[str, Path | None] = {}
        for br, alias in bridges.items():
            cid = br[len(PREFIX) :]
            parts = alias.split(" ", 2)
            owner = parts[1] if len(parts) > 1 else ""
            base = Path(parts[2]) if len(parts) > 2 else None
            bases[cid] = base
            dead = not (parts and parts[0] == PREFIX and _owner_alive(owner))
            persistent = owner.startswith("0:")
            if only is not None:
                dead = cid == only
            elif persistent and include_persistent:
                dead = True
            if not dead:
                live.add(cid)
        cids = set(bridges_cid for bridges_cid in (b[len(PREFIX) :] for b in bridges))
        cids |= {
            n.split("-")[1]
            for n in _netns_list()
            if n.startswith(f"{PREFIX}-") and n.count("-") >= 2
        }
        cids |= {p.pw_name.split("_")[1] for p in _our_users() if p.pw_name.count("_") >= 2}
        cids |= set(_veths())
        for p in Path("/var/lib").glob(f"{PREFIX}-*"):
            cids.add(p.name.split("-", 1)[1])
        cids = {c for c in cids if _CID_RE.match(c)}
        for cid in sorted(cids - live):
            if only is not None and cid != only:
                continue
            base = bases.get(cid)
            if base is None:
                homes = [
                    Path(p.pw_dir) for p in _our_users() if p.pw_name.startswith(f"{PREFIX}_{cid}_")
                ]
                base = homes[0].parents[2] if homes else Path(f"/var/lib/{PREFIX}-{cid}")
            problems = _teardown(cid, base, True, [])
            if base != Path(f"/var/lib/{PREFIX}-{cid}"):
                err = _remove_base(Path(f"/var/lib/{PREFIX}-{cid}"))
                if err:
                    problems.append(err)
            removed.append(f"cluster {cid}" + (f" ({'; '.join(problems)})" if problems else ""))
    # loopback-mode leftovers: /tmp/sshs-<uid>-<cid> whose owner is dead
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for base in tmp.glob(f"{PREFIX}-{os.getuid()}-*"):
        try:
            data = json.loads((base / "owner").read_text())
        except (OSError, ValueError):
            data = {}
        cid = base.name.rsplit("-", 1)[1]
        if (only is None or cid == only) and (only is not None or not _owner_alive(data.get("owner", "")) or
                                              (include_persistent and data.get("owner", "").startswith("0:"))):  # fmt: skip
            try:
                c = Cluster.load(base)
                c.stop()
            except Exception:
                _remove_base(base)
            removed.append(f"loopback cluster {cid}")
    return removed


def find_cluster_base(cluster_id: str) -> Path | None:
    """Base dir of a running cluster (from its bridge alias, or the loopback default)."""
    if namespaces_available():
        parts = _bridges().get(f"{PREFIX}{cluster_id}", "").split(" ", 2)
        if len(parts) == 3:
            return Path(parts[2])
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"{PREFIX}-{os.getuid()}-{cluster_id}"
    return tmp if (tmp / "cluster.json").exists() else None


def _pick_slot() -> int:
    used = set()
    proc = _run(["ip", "-o", "-4", "addr", "show"], check=False)
    for m in re.finditer(r"inet 10\.213\.(\d+)\.", proc.stdout):
        used.add(int(m.group(1)) - SUBNET_BASE)
    for slot in range(MAX_SLOTS):
        if slot not in used:
            return slot
    raise ClusterError("no free 10.213.x.0/24 subnet for another cluster")


def _keygen(path: Path, comment: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=CLEAN_ENV,
    )  # fmt: skip


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def start_cluster(
    specs: Sequence[HostSpec] | int,
    *,
    base_dir: Path | str | None = None,
    cluster_id: str | None = None,
    mode: str | None = None,
    persistent: bool = False,
    timeout: float = 60,
) -> Cluster:
    """Start a cluster of ``specs`` hosts (an int means that many default ``HostSpec()``).

    ``mode``: "netns" (root: namespaces, the default when possible), "loopback" (plain sshd
    on 127.0.0.x ports), or None/"auto" (env ``SSHS_CLUSTER_MODE`` may force one).
    ``persistent``: survive the creating process (``scripts/cluster up``); otherwise the
    cluster is stopped at interpreter exit and counts as a leftover once its owner dies.
    """
    if isinstance(specs, int):
        specs = [HostSpec() for _ in range(specs)]
    specs = [dataclasses.replace(s, gpus=[dataclasses.replace(g) for g in s.gpus]) for s in specs]
    if not specs:
        raise ValueError("a cluster needs at least one host")
    if not sshd_available():
        raise Unsupported(
            f"{SSHD} or ssh-keygen missing (install Debian packages openssh-server openssh-client)"
        )
    mode = mode or os.environ.get("SSHS_CLUSTER_MODE") or "auto"
    if mode == "auto":
        mode = "netns" if namespaces_available() else "loopback"
    if mode not in ("netns", "loopback"):
        raise ValueError(f"unknown cluster mode {mode!r}")
    namespaces = mode == "netns"
    if namespaces and not namespaces_available():
        raise Unsupported("namespaced cluster needs root and iproute2/util-linux/iptables")
    cid = cluster_id or secrets.choice("abcdefghijklmnopqrstuvwxyz") + secrets.token_hex(2)
    if not _CID_RE.match(cid):
        raise ValueError(f"cluster_id must match {_CID_RE.pattern}")
    names = [s.name or f"h{i}" for i, s in enumerate(specs, 1)]
    for n in names:
        if not _NAME_RE.match(n):
            raise ValueError(f"host name {n!r} must match {_NAME_RE.pattern}")
    if len(set(names)) != len(names):
        raise ValueError("host names must be unique")
    if len(specs) > MAX_HOSTS:
        raise ValueError(f"at most {MAX_HOSTS} hosts")
    if namespaces and not _host_python().startswith("/usr/"):
        raise Unsupported("hosts need a python3 every user can run: install Debian package python3")

    t0 = time.monotonic()
    if base_dir is None:
        base = (
            Path(f"/var/lib/{PREFIX}-{cid}")
            if namespaces
            else Path(os.environ.get("TMPDIR", "/tmp")) / f"{PREFIX}-{os.getuid()}-{cid}"
        )
    else:
        base = Path(base_dir).absolute()
    if namespaces:
        for bad in ("/tmp", "/run", "/dev/shm", "/proc", "/sys", "/usr/local/bin"):
            if base == Path(bad) or Path(bad) in base.parents:
                raise ValueError(
                    f"base_dir {base} must not be under {bad} (hosts get their own {bad})"
                )
        if not _traversable(base.parent):
            raise ValueError(
                f"base_dir {base}: every parent directory must be world-searchable (o+x)"
            )

    cluster: Cluster | None = None
    try:
        with _global_lock():
            _cleanup()
            if namespaces and f"{PREFIX}{cid}" in _bridges():
                if not persistent:
                    raise ClusterError(f"cluster id {cid!r} is in use")
                _cleanup(only=cid)
            if base.exists():
                if (base / f".{PREFIX}-cluster").exists():
                    err = _remove_base(base)
                    if err:
                        raise ClusterError(err)
                elif any(base.iterdir()):
                    raise ClusterError(f"base_dir {base} exists and is not empty")
            slot = _pick_slot() if namespaces else 0
            cluster = Cluster(cid, base, namespaces, slot, persistent)
            owner = "0:0" if persistent else _owner_token()
            base.mkdir(parents=True, exist_ok=True)
            os.chmod(base, 0o755)
            _write(
                base / f".{PREFIX}-cluster",
                f"test cluster {cid}; safe to delete when no sshd uses it\n",
            )
            _write(base / "owner", json.dumps({"owner": owner}))
            if namespaces:
                alias = f"{PREFIX} {owner} {base}"
                if len(alias) > 250:
                    alias = f"{PREFIX} {owner}"
                br = cluster.bridge
                _run(["ip", "link", "add", br, "type", "bridge"])
                _run(["ip", "link", "set", br, "addrgenmode", "none"])
                _run(["ip", "link", "set", br, "alias", alias])
                _run(["ip", "addr", "add", f"10.213.{SUBNET_BASE + slot}.1/24", "dev", br])
                if len(specs) > HOSTS_PER_NET:
                    _run(["ip", "addr", "add", f"10.214.{SUBNET_BASE + slot}.1/24", "dev", br])
                _run(["ip", "link", "set", br, "up"])
        if not persistent:
            _LIVE.append(cluster)
            _install_exit_handlers()

        for sub in ("machines", "shared", "hosts"):
            (base / sub).mkdir(exist_ok=True)
            os.chmod(base / sub, 0o755)
        for tool in _SHARED_TOOLS:
            shutil.copy(HERE / tool, base / "shared" / tool)
            os.chmod(base / "shared" / tool, 0o755)
        for i, spec in enumerate(specs, 1):
            cluster.hosts.append(Host(cluster, i, spec))
        hosts = cluster.hosts
        # keys (in parallel)
        jobs = [_keygen(cluster.key_path, f"{PREFIX}-{cid}-client")]
        for h in hosts:
            h.dir.mkdir(parents=True)
            jobs.append(_keygen(h.dir / "ssh_host_ed25519_key", f"{PREFIX}-{cid}-{h.name}"))
        for j in jobs:
            _, keygen_err = j.communicate(timeout=30)
            if j.returncode != 0:
                raise ClusterError(f"ssh-keygen failed: {keygen_err.decode()}")
        if namespaces:
            for h in hosts:
                _run(["useradd", "-M", "-l", "-U", "-d", str(h.home), "-s", "/bin/bash", "-p", "*",
                      "-c", f"sshs test host {h.name} ({cid})", h.user])  # fmt: skip
                pw = pwd.getpwnam(h.user)
                h.uid, h.gid = pw.pw_uid, pw.pw_gid
                h.home.mkdir(parents=True, exist_ok=True)
        else:
            for h in hosts:
                h.uid, h.gid = os.getuid(), os.getgid()
                h.port = _free_port(h.ip)
        for h in hosts:
            h._prepare()
        if namespaces:
            for h in hosts:
                _run(["ip", "netns", "add", h.netns])
                _run(
                    [
                        "ip",
                        "link",
                        "add",
                        h.veth,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        "eth0",
                        "netns",
                        h.netns,
                    ]
                )
                _run(["ip", "link", "set", h.veth, "addrgenmode", "none"])
                _run(["ip", "link", "set", h.veth, "master", cluster.bridge, "up"])
                _run(
                    ["ip", "-n", h.netns, "-batch", "-"],
                    input=f"link set eth0 addrgenmode none\naddr add {h.ip}/24 dev eth0\nlink set eth0 up\nlink set lo up\n",
                )
        # known_hosts and machine files
        lines = []
        for h in hosts:
            key = " ".join((h.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2])
            hostpat = h.ip if h.port == 22 else f"[{h.ip}]:{h.port}"
            lines.append(f"{hostpat} {key}\n")
        _write(cluster.known_hosts, "".join(lines))
        for h in hosts:
            _write(
                h.machine_file,
                "".join(f"{k}: {_yaml_str(v)}\n" for k, v in h.machine_yaml().items()),
            )
        ssh_opts = " ".join(hosts[0].ssh_argv()[1:-3])  # everything but "-p PORT user@ip"
        _write(
            cluster.ssh_wrapper,
            f'#!/bin/sh\n# plain OpenSSH client set up for test cluster {cid}\nexec ssh {ssh_opts} "$@"\n',
            0o755,
        )
        _write(
            base / "sshlogins",
            "".join(
                f"{h.user}@{h.ip}\n" if h.port == 22 else f"-p {h.port} {h.user}@{h.ip}\n"
                for h in hosts
            ),
        )
        # boot
        for h in hosts:
            h._launch()
        deadline = time.monotonic() + max(timeout, 0.25 * len(hosts))  # hundreds boot slower
        for h in hosts:
            h._wait_ready(max(1.0, deadline - time.monotonic()))
        cluster._save()
        cluster.started_s = time.monotonic() - t0
        return cluster
    except BaseException:
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.stop()
        else:
            with contextlib.suppress(Exception):
                _remove_base(base)
        raise
