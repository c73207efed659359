"""A real Slurm for the test suite: Debian's slurm-wlm, started and stopped by the tests themselves.

One :class:`SlurmCluster` is a private munged, one slurmctld and several slurmd posing as nodes
``n1..nK`` (Debian builds Slurm with MULTIPLE_SLURMD: ``slurmd -N nK``), each node with fake GPUs
(character devices, as gres.conf demands).  Its daemons listen on the root-namespace address of a
test cluster's bridge, so a host of that SSH cluster is a *login node* (:meth:`attach_login`):
``sbatch``/``squeue``/``scancel`` work there over SSH, with the config bind-mounted on
``/etc/slurm`` in that host's mount namespace and the munge socket visible in it.  The host's
home lies at the same path in the root namespace, where slurmd runs the jobs: a shared home,
as on a real cluster.

Measured facts behind every setting: ../shared/notes/slurm-in-a-box.md (and the comments below).
Daemons bind 0.0.0.0 in 22.05, so an iptables chain accepts their ports only from ``lo`` and the
test bridge.  Each slurmd runs in its own pids cgroup: a node "dies" by killing that whole group
(slurmstepd and the jobs outlive slurmd otherwise), and teardown leaves no process behind.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.cluster import Cluster, Host

PREFIX = "sshs-slurm"
BIN = "/usr/sbin"
PACKAGES = "slurmctld slurmd slurm-client munge"
CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class SlurmError(RuntimeError):
    """The test Slurm could not do what was asked (the message carries the daemon logs)."""


def slurm_available() -> str | None:
    """None when the test Slurm can run here, else why not (with the fix)."""
    if os.geteuid() != 0:
        return "the test Slurm needs root"
    missing = [p for p in ("slurmctld", "slurmd", "munged") if not Path(BIN, p).exists()]
    missing += [p for p in ("sbatch", "squeue", "scontrol") if shutil.which(p) is None]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install {PACKAGES} (scripts/test does)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cgroup_root() -> Path | None:
    """A cgroup hierarchy we may create groups in (v1 pids, else v2)."""
    for root in CGROUP_ROOTS:
        if (root / "cgroup.procs").exists() and os.access(root, os.W_OK):
            return root
    return None


def _cgroup_kill(group: Path) -> None:
    """SIGKILL every process of ``group`` until it is empty (processes may fork meanwhile)."""
    deadline = time.monotonic() + 10
    while group.exists():
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise SlurmError(f"processes of {group} would not die: {pids}")
        time.sleep(0.02)


class SlurmCluster:
    """A private Slurm whose daemons listen on ``addr`` (see the module docstring)."""

    def __init__(
        self,
        addr: str,
        iface: str,
        *,
        nodes: int = 4,
        gpus_per_node: int = 2,
        cpus_per_node: int = 4,
    ) -> None:
        self.cid = secrets.token_hex(3)
        self.base = Path(f"/var/lib/{PREFIX}-{self.cid}")
        self.addr, self.iface = addr, iface
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.gpus_per_node, self.cpus_per_node = gpus_per_node, cpus_per_node
        self.ctld_port = _free_port()
        self.node_ports = {n: _free_port() for n in self.nodes}
        self.conf = self.base / "etc" / "slurm.conf"
        self.munge_socket = self.base / "munge" / "socket"
        self.chain = f"{PREFIX}-{self.cid}"
        cg = _cgroup_root()
        self.cgroup = cg / f"{PREFIX}-{self.cid}" if cg is not None else None
        self.env = {**ENV, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logins: list[Host] = []

    # ----- files
    def _slurm_conf(self) -> str:
        b = self.base
        lines = [
            f"# test Slurm {self.cid}: every setting here was found by a failure (see the notes)",
            f"ClusterName=sshs{self.cid}",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({self.addr})",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: a requeued job may start only cred_expire + 1 s after the requeue
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={b}/state",
            f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/run/slurmctld.pid",
            f"SlurmdPidFile={b}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={b}/log/slurmctld.log",
            f"SlurmdLogFile={b}/log/slurmd-%n.log",
            # no cgroups: --mem is bookkeeping here, OUT_OF_MEMORY cannot happen
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            # the default batch delay runs an array in 3 s waves
            "SchedulerParameters=batch_sched_delay=0,bf_interval=5",
            # a killed node is DOWN (and its jobs requeued) 12-15 s later
            "SlurmdTimeout=5",
            "MessageTimeout=5",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=2",
            # finished jobs stay in `scontrol show job` (JobState, ExitCode) for 5 minutes
            "MinJobAge=300",
            "MailProg=/bin/true",
            "SlurmdParameters=config_overrides",
            # without it a job is given the whole node's memory: one job per node at a time
            "DefMemPerCPU=100",
            "GresTypes=gpu",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr={self.addr} Port={self.node_ports[node]} "
                f"CPUs={self.cpus_per_node} RealMemory=16000 Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _gres_conf(self) -> str:
        lines = ["AutoDetect=off"]
        last = self.gpus_per_node - 1
        for node in self.nodes:
            files = (
                f"{self.base}/dev/{node}/gpu[0-{last}]"
                if last > 0
                else f"{self.base}/dev/{node}/gpu0"
            )
            lines.append(f"NodeName={node} Name=gpu File={files}")
        return "\n".join(lines) + "\n"

    def _prepare(self) -> None:
        b = self.base
        for sub in ("etc", "state", "spool", "run", "log", "dev"):
            (b / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(b, 0o755)
        os.chmod(b / "etc", 0o755)
        (b / "owner").write_text(
            json.dumps({"pid": os.getpid(), "chain": self.chain, "cgroup": str(self.cgroup)})
        )
        (b / "munge").mkdir(mode=0o755)  # "Socket is inaccessible" unless 0755
        os.chmod(b / "munge", 0o755)
        (b / "munge-key").mkdir(mode=0o700)
        (b / "munge-key" / "munge.key").write_bytes(secrets.token_bytes(1024))
        os.chmod(b / "munge-key" / "munge.key", 0o400)
        for node in self.nodes:
            (b / "spool" / node).mkdir()
            (b / "dev" / node).mkdir()
            for i in range(self.gpus_per_node):
                # gres.conf wants a character device; this is /dev/null's (1, 3)
                os.mknod(b / "dev" / node / f"gpu{i}", 0o666 | 0o020000, os.makedev(1, 3))
                os.chmod(b / "dev" / node / f"gpu{i}", 0o666)
        self.conf.write_text(self._slurm_conf())
        (b / "etc" / "gres.conf").write_text(self._gres_conf())
        os.chmod(self.conf, 0o644)
        os.chmod(b / "etc" / "gres.conf", 0o644)

    # ----- firewall
    def _firewall(self) -> None:
        ports = ",".join(str(p) for p in [self.ctld_port, *self.node_ports.values()])
        _run(["iptables", "-w", "-N", self.chain])
        _run(["iptables", "-w", "-A", self.chain, "-i", "lo", "-j", "RETURN"])
        _run(["iptables", "-w", "-A", self.chain, "-i", self.iface, "-j", "RETURN"])
        _run(["iptables", "-w", "-A", self.chain, "-j", "DROP"])
        _run(
            [
                "iptables",
                "-w",
                "-I",
                "INPUT",
                "-p",
                "tcp",
                "-m",
                "multiport",
                "--dports",
                ports,
                "-j",
                self.chain,
            ]
        )
        (self.base / "ports").write_text(ports)

    # ----- daemons
    def _spawn(
        self, argv: list[str], log: str, cgroup: Path | None = None
    ) -> subprocess.Popen[bytes]:
        if cgroup is not None:  # join the group before exec, so every descendant is in it
            argv = ["/bin/sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *argv]
        with open(self.base / "log" / log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=self.env,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def _node_group(self, node: str) -> Path | None:
        return self.cgroup / node if self.cgroup is not None else None

    def start_node(self, node: str) -> None:
        group = self._node_group(node)
        if group is not None:
            group.mkdir(parents=True, exist_ok=True)
        self._spawn(
            [f"{BIN}/slurmd", "-D", "-f", str(self.conf), "-N", node], f"slurmd-{node}.out", group
        )

    def kill_node(self, node: str) -> None:
        """Power a node off: SIGKILL slurmd, its slurmstepd and the jobs running there."""
        group = self._node_group(node)
        if group is None:
            raise SlurmError("killing a node needs a writable cgroup hierarchy")
        _cgroup_kill(group)

    def start(self, timeout: float = 60) -> None:
        self._prepare()
        try:
            self._firewall()
            if self.cgroup is not None:
                self.cgroup.mkdir(exist_ok=True)
            b = self.base
            self._spawn(
                [f"{BIN}/munged", "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={b}/munge-key/munge.key",
                 f"--pid-file={b}/run/munged.pid", f"--log-file={b}/log/munged.log", f"--seed-file={b}/munge-key/seed"],
                "munged.out", self.cgroup,
            )  # fmt: skip
            self._wait(
                lambda: self.munge_socket.exists(), timeout, "munged did not create its socket"
            )
            self._spawn(
                [f"{BIN}/slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out", self.cgroup
            )
            for node in self.nodes:
                self.start_node(node)
            self._wait(self._all_idle, timeout, "the nodes did not come up idle")
            # slurmctld starts no job in its first seconds: let one job through before any test
            self.run_job("true", timeout)
        except BaseException:
            self.stop()
            raise

    def _all_idle(self) -> bool:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
        )
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise SlurmError(f"{what}\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        out = []
        for p in sorted((self.base / "log").glob("*")):
            out.append(f"--- {p}\n{p.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)

    # ----- commands (root namespace)
    def command(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise SlurmError(
                f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}{proc.stdout}"
            )
        return proc.stdout

    def run_job(self, wrap: str, timeout: float = 60) -> str:
        """Submit ``wrap`` as root and wait for it to end; returns its JobState."""
        job = self.command("sbatch", "--parsable", "-o", "/dev/null", "--wrap", wrap).strip()
        state = ""

        def ended() -> bool:
            nonlocal state
            state = self.job_field(job, "JobState")
            return state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "")

        self._wait(ended, timeout, f"job {job} did not end")
        return state

    def job_field(self, job: str, field: str) -> str:
        for item in self.command("scontrol", "-o", "show", "job", job, check=False).split():
            key, _, value = item.partition("=")
            if key == field:
                return value
        return ""

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld still knows (``scontrol -o show job``), as field dicts."""
        out = self.command("scontrol", "-o", "show", "job", check=False)
        rows = []
        for line in out.splitlines():
            if line.startswith("JobId="):
                rows.append(dict(item.partition("=")[::2] for item in line.split()))
        return rows

    def active_jobs(self) -> list[str]:
        """Ids of jobs pending or running (what `squeue` shows)."""
        return self.command("squeue", "-h", "-o", "%i").split()

    # ----- login nodes
    def attach_login(self, host: Host) -> None:
        """Make ``host`` a login node: /etc/slurm in its mount namespace is our config folder."""
        host.run(f"mkdir -p /etc/slurm && mount --bind '{self.base}/etc' /etc/slurm", check=True)
        self._logins.append(host)

    def machine_yaml(self, host: Host, **slurm: object) -> dict[str, object]:
        """The machine YAML of ``host`` as a Slurm login node."""
        return {**host.machine_yaml(), "slurm": {"partition": "debug", **slurm}}

    # ----- teardown
    def stop(self) -> None:
        for host in self._logins:
            with contextlib.suppress(Exception):
                host.run("umount -l /etc/slurm")
        self._logins.clear()
        _stop_base(self.base)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs.clear()


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, env=ENV, check=False)
    if proc.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} failed: {proc.stderr}")


def _stop_base(base: Path) -> None:
    """Kill every process of the instance at ``base``, drop its firewall chain, remove its files."""
    try:
        owner = json.loads((base / "owner").read_text())
    except (OSError, ValueError):
        owner = {}
    cgroup = Path(owner["cgroup"]) if owner.get("cgroup") not in (None, "None") else None
    if cgroup is not None and cgroup.exists():
        for group in [*sorted(p for p in cgroup.iterdir() if p.is_dir()), cgroup]:
            _cgroup_kill(group)
            with contextlib.suppress(OSError):
                group.rmdir()
    chain = owner.get("chain")
    if chain:
        with contextlib.suppress(OSError):
            ports = (base / "ports").read_text().strip()
            subprocess.run(["iptables", "-w", "-D", "INPUT", "-p", "tcp", "-m", "multiport", "--dports", ports, "-j", chain],
                           capture_output=True, env=ENV, check=False)  # fmt: skip
        for op in ("-F", "-X"):
            subprocess.run(["iptables", "-w", op, chain], capture_output=True, env=ENV, check=False)
    shutil.rmtree(base, ignore_errors=True)


def cleanup_leftovers() -> None:
    """Stop instances whose owning process is gone (a SIGKILLed test run)."""
    for base in Path("/var/lib").glob(f"{PREFIX}-*"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(json.loads((base / "owner").read_text())["pid"])
            if _pid_alive(pid) and pid != os.getpid():
                continue
        _stop_base(base)


@contextlib.contextmanager
def slurm_cluster(
    cluster: Cluster, *, nodes: int = 4, gpus_per_node: int = 2, cpus_per_node: int = 4
) -> Iterator[SlurmCluster]:
    """A Slurm whose daemons listen on ``cluster``'s bridge, with the first host of ``cluster`` as login node."""
    cleanup_leftovers()
    slurm = SlurmCluster(
        f"10.213.{cluster.subnet.split('.')[2]}.1",
        cluster.bridge,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        cpus_per_node=cpus_per_node,
    )
    atexit.register(slurm.stop)
    slurm.start()
    try:
        slurm.attach_login(cluster.hosts[0])
        yield slurm
    finally:
        slurm.stop()
        atexit.unregister(slurm.stop)
