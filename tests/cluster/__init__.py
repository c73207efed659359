"""A real, disposable SSH test cluster for ssh_scheduler.

Each simulated host is a real OpenSSH ``sshd`` (``/usr/sbin/sshd``, own host key and
sshd_config, key-only login with a generated ed25519 key) that the suite starts itself.

Namespaced mode (root; the default when possible)
    * host *i* lives in network namespace ``sshs-<cid>-h<i>``, connected by a veth pair to
      bridge ``sshs<cid>`` (10.213.(57+slot).1/24) in the root namespace, and is reached at
      ``10.213.(57+slot).(10+i):22``; the first live cluster gets slot 0 = 10.213.57.0/24.
      Hosts past the 240th (up to 480) are ``10.214.(57+slot).(10+i-240)`` on the same bridge.
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

API (see the docstrings in ``_impl.py``)
    start_cluster(specs: list[HostSpec] | int, *, base_dir=None, cluster_id=None, mode=None,
                  persistent=False, timeout=30) -> Cluster
    Cluster: hosts, base, known_hosts, key_path, ssh_wrapper, machine_files, machines_dir,
        cluster_id, namespaces, subnet, started_s; cluster["h2"] / cluster[1] / iter / len;
        stop() (idempotent), reset(wipe_homes=False), Cluster.load(base), context manager
    Host: name, index, ip, port, user, uid, home, workdir, machine_file, dir, spec, gpu_uuids;
        ssh_argv(cmd=None, *, options=()), ssh(cmd, *, timeout=30, options=()),
        run(cmd, user=None, *, timeout=60, input=None, check=False), processes(),
        is_running(), sshd_running(), start(), restart(), crash(power_off=False),
        stop_sshd(), start_sshd(), set_sshd_limits(max_sessions=None, max_startups=None),
        freeze(whole_host=False), thaw(), cut_network(), heal_network(),
        set_latency(ms, loss_percent=0), clear_latency(), set_memory(available_mb=None,
        total_mb=None), set_loadavg(load), hold_gpu(index, mb, util=100, *, user=None,
        name="python3", oversubscribe=False) -> GpuHold (.pid, .release()),
        kill_user_processes(), wipe_home(), reset(wipe_home=False),
        mount_small_fs(path, size_kb=1024), fill_fs(path, user=None), free_fs(path),
        unmount(path)  (a tmpfs inside the host that really fills up)
    Cluster.other_user() -> a second unix user on every host (namespaced mode), for attacks
    cleanup_leftovers(*, include_persistent=False, only=None), namespaces_available(),
    sshd_available(), skip_or_fail(reason), in_ci()

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
