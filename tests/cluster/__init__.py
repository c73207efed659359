"""A real, disposable SSH test cluster for ssh_scheduler.

Each simulated host is a real OpenSSH ``sshd`` (``/usr/sbin/sshd``, own host key and
sshd_config, key-only login with a generated ed25519 key) that the suite starts itself.

Namespaced mode (root; the default when possible)
    * host *i* lives in network namespace ``sshs-<cid>-h<i>``, connected by a veth pair to
      bridge ``sshs<cid>`` (10.213.(57+slot).1/24) in the root namespace, and is reached at
      ``10.213.(57+slot).(10+i):22``; the first live cluster gets slot 0 = 10.213.57.0/24.
    * sshd runs under a tiny init (``host_init.py``) that is PID 1 of the host's own PID
      namespace, inside its own mount/UTS/IPC namespaces.  ``crash()`` SIGKILLs that init:
      every process of the host dies at once.  ``stop_sshd()`` only stops the listener.
    * the mount namespace gives each host: /proc/meminfo (MemTotal/MemFree/MemAvailable from
      the spec), /proc/cpuinfo, /proc/loadavg (static, from the spec), /sys/devices/system/cpu/
      {online,possible,present} and /usr/bin/nproc (a script) saying ``cpus``, its own /tmp,
      /var/tmp, /dev/shm and /run, a hostname = host name, and an overlay of the host's ``bin`` dir on
      /usr/local/bin (first on sshd's default PATH) holding ``nvidia-smi`` (GPU hosts only)
      and ``gpu_hold``.  Other hosts' directories (and so their homes) are hidden.
    * login user ``sshs_<cid>_h<i>`` (password field ``*``, shell /bin/bash) with home
      ``<base>/hosts/h<i>/home`` (0700); ``host.home`` is that path on the real filesystem.
    * faults: ``cut_network`` = iptables DROP inside the host's netns (connects hang);
      ``freeze`` = SIGSTOP the sshd listener (TCP connects, no banner);
      ``set_latency`` = NFQUEUE helper (no tc netem in this kernel) delaying the host's
      outgoing packets.  All rules live in the host's netns and vanish with it.

Loopback mode (not root, or ``SSHS_CLUSTER_MODE=loopback``)
    sshd on ``127.0.0.(10+i):<free port>`` as the current user; the machine YAML sets a
    per-host ``workdir``; nvidia-smi via ``SetEnv PATH=...``.  Namespace-only controls raise
    :class:`Unsupported`; tests should call :func:`skip_or_fail` (a failure under CI=true).

Teardown (``Cluster.stop()``, also at interpreter exit and on SIGTERM) removes processes,
netns, veths, bridge, users and the base dir; ``start_cluster`` first removes leftovers of
dead owners (machine-wide lock: an abstract unix socket, so nothing is left on disk).
"""

from __future__ import annotations

import os

from ._impl import (
    DEFAULT_GPU_NAME,
    Cluster,
    ClusterError,
    GpuHold,
    GpuSpec,
    Host,
    HostSpec,
    Unsupported,
    cleanup_leftovers,
    namespaces_available,
    sshd_available,
    start_cluster,
)

__all__ = [
    "DEFAULT_GPU_NAME",
    "Cluster",
    "ClusterError",
    "GpuHold",
    "GpuSpec",
    "Host",
    "HostSpec",
    "Unsupported",
    "cleanup_leftovers",
    "in_ci",
    "namespaces_available",
    "skip_or_fail",
    "sshd_available",
    "start_cluster",
]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def skip_or_fail(reason: str) -> None:
    """Skip the current test, or fail it when ``CI=true`` (CI must run everything)."""
    import pytest

    if in_ci():
        pytest.fail(f"CI=true but the test cluster cannot run this: {reason}", pytrace=False)
    pytest.skip(reason)
