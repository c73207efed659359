"""The ``slurm`` fixture: a real Slurm (tests/slurm_cluster.py) with an SSH login node.

Session-scoped: one SSH test cluster of two hosts (``login``, the Slurm login node, and ``plain``,
an ordinary host for mixed batches) and one Slurm of 4 nodes x 2 fake GPUs whose daemons listen
on that cluster's bridge.  Imported by tests/conftest.py so every test file can ask for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.cluster import (
    Cluster,
    GpuSpec,
    Host,
    HostSpec,
    namespaces_available,
    skip_or_fail,
    sshd_available,
    start_cluster,
)
from tests.slurm_cluster import SlurmCluster, slurm_available, slurm_cluster


@dataclass
class SlurmSite:
    cluster: Cluster
    slurm: SlurmCluster

    @property
    def login(self) -> Host:
        return self.cluster.hosts[0]

    @property
    def plain(self) -> Host:
        return self.cluster.hosts[1]


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmSite]:
    if not sshd_available() or not namespaces_available():
        skip_or_fail(
            "the Slurm login node needs the namespaced SSH test cluster (root, openssh-server)"
        )
    why = slurm_available()
    if why is not None:
        skip_or_fail(why)
    cluster = start_cluster(
        [HostSpec(name="login"), HostSpec(name="plain", gpus=[GpuSpec(memory_mb=16000)])]
    )
    try:
        with slurm_cluster(cluster) as instance:
            yield SlurmSite(cluster, instance)
    finally:
        cluster.stop()
