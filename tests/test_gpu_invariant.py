"""The GPU memory invariant under randomized interleavings of probes, starts, growth and exits.

A small simulated world stands in for the hosts: GPUs whose memory is held by other users
(listed processes, and memory no process accounts for, as in another container) and by our jobs'
processes, which start, grow towards their reservation and exit.  A probe is what the real one
is: the process list at one moment, ``memory.used``/``memory.free`` at a later one (the order the
probe runs them in, checked below), with anything happening in between, landing later still.  Exits reach the coordinator some time after the
process is gone.  After every step, for every GPU, what other users really hold plus the
reservation of every job of ours that really still has a process there must fit in the GPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.host_state import GpuProcess, GpuState, HostState, OwnUsage
from ssh_scheduler.machines.probe import PROBE_SCRIPT
from ssh_scheduler.planner.allocate import MachineResources, choose

TOTAL = 16384
DRIVER_RESERVED = 480  # memory.total - (used + free) on a real H100 capture
CAPACITY = TOTAL - DRIVER_RESERVED
NEEDS = Needs(cpus=0.1, memory_mb=1, gpus=1, gpu_memory_mb=7000, gpu_utilization=0.3, reserve_gpu=False)


@dataclass
class Proc:
    pid: int
    host: int
    gpu: int
    mb: int
    job: str | None = None  # ours, or another user's


@dataclass
class World:
    rng: random.Random
    hosts: int = 2
    gpus: int = 2
    procs: dict[int, Proc] = field(default_factory=dict)
    unlisted: dict[tuple[int, int], int] = field(default_factory=dict)  # (host, gpu) -> MiB
    next_pid: int = 100

    def uuid(self, gpu: int) -> str:
        return f"GPU-{gpu}"

    def used(self, host: int, gpu: int) -> int:
        listed = sum(p.mb for p in self.procs.values() if (p.host, p.gpu) == (host, gpu))
        return listed + self.unlisted.get((host, gpu), 0)

    def apps(self, host: int) -> tuple[GpuProcess, ...]:
        return tuple(
            GpuProcess(p.pid, self.uuid(p.gpu), p.mb) for p in self.procs.values() if p.host == host
        )

    def gpu_states(self, host: int) -> tuple[GpuState, ...]:
        states = []
        for g in range(self.gpus):
            used = self.used(host, g)
            states.append(
                GpuState(g, self.uuid(g), "sim", TOTAL, used, max(0, CAPACITY - used), 0.0)
            )
        return tuple(states)

    def spawn(self, host: int, gpu: int, mb: int, job: str | None) -> Proc:
        self.next_pid += 1
        proc = Proc(self.next_pid, host, gpu, mb, job)
        self.procs[proc.pid] = proc
        return proc


@dataclass
class Probe:
    host: int
    generation: int
    apps: tuple[GpuProcess, ...] | None = None
    gpus: tuple[GpuState, ...] | None = None

    def take(self, world: World) -> None:
        """The next of the two nvidia-smi calls."""
        if self.apps is None:
            self.apps = world.apps(self.host)
        else:
            self.gpus = world.gpu_states(self.host)

    @property
    def complete(self) -> bool:
        return self.apps is not None and self.gpus is not None


def host_state(gpus: tuple[GpuState, ...], apps: tuple[GpuProcess, ...]) -> HostState:
    return HostState(64, 0.0, 1_000_000, 1_000_000, gpus, apps)


def simulate(seed: int, steps: int) -> int:
    """Run one random history; returns how many jobs were placed (so the test can see the
    history was not trivially empty)."""
    rng = random.Random(seed)
    world = World(rng)
    # Other users: a listed process and some unlisted memory on a few GPUs.  The unlisted part
    # may go away during the batch (that is what makes the process list and memory.used disagree).
    for h in range(world.hosts):
        for g in range(world.gpus):
            if rng.random() < 0.5:
                world.spawn(h, g, rng.choice([0, 1500, 4000]), None)
            if rng.random() < 0.5:
                world.unlisted[(h, g)] = rng.choice([500, 2500])
    machines = [
        MachineResources(f"h{h}", host_state(world.gpu_states(h), world.apps(h)))
        for h in range(world.hosts)
    ]
    target: dict[str, int] = {}  # job -> MiB its process grows to (at most the reservation)
    pids: dict[str, Proc] = {}
    booked: dict[str, int] = {}  # job -> host index, while the coordinator counts it running
    exited: list[str] = []  # processes gone, exit not yet reported to the coordinator
    probes: list[Probe] = []
    placed = 0
    for step in range(steps):
        action = rng.random()
        if action < 0.25:  # place as many jobs as fit
            while True:
                machine = choose(machines, NEEDS)
                if machine is None:
                    break
                name = f"j{step}-{placed}"
                placement = machine.allocate(name, NEEDS)
                capacity, others, ours = machine.gpu_promises()[placement.gpu_indices[0]]
                assert others + ours <= capacity, (seed, step, machine.gpu_promises())
                host = machines.index(machine)
                pids[name] = world.spawn(host, placement.gpu_indices[0], 0, name)
                target[name] = rng.choice([6500, 7000, 3000, 0])
                booked[name] = host
                placed += 1
        elif action < 0.40:  # a job's process allocates its memory
            growing = [j for j, p in pids.items() if p.pid in world.procs and p.mb < target[j]]
            if growing:
                proc = pids[rng.choice(growing)]
                proc.mb = target[proc.job or ""]
        elif action < 0.52:  # a job's process exits (the coordinator hears later)
            alive = [j for j, p in pids.items() if p.pid in world.procs]
            if alive:
                job = rng.choice(alive)
                del world.procs[pids[job].pid]
                exited.append(job)
        elif action < 0.62:  # an exit reaches the coordinator
            if exited:
                job = exited.pop(rng.randrange(len(exited)))
                machines[booked.pop(job)].release(job)
        elif action < 0.67:  # another user's unlisted memory goes away
            if world.unlisted:
                del world.unlisted[rng.choice(sorted(world.unlisted))]
        elif action < 0.77:  # a probe is requested
            h = rng.randrange(world.hosts)
            probes.append(Probe(h, machines[h].probe_started()))
        elif action < 0.93:  # a probe runs one of its two queries
            waiting = [p for p in probes if not p.complete]
            if waiting:
                rng.choice(waiting).take(world)
        else:  # a probe's answer lands, with what the agent knows of our jobs' pids
            ready = [p for p in probes if p.complete]
            if ready:
                probe = ready[0]  # answers of one host arrive in order
                probes.remove(probe)
                assert probe.apps is not None and probe.gpus is not None
                own = {
                    job: OwnUsage(frozenset({proc.pid}))
                    for job, proc in pids.items()
                    if booked.get(job) == probe.host
                }
                machines[probe.host].update(
                    host_state(probe.gpus, probe.apps), own, probe.generation
                )
        # The physical invariant: what others hold now + the reservation of every job of ours
        # whose process is still there fits each GPU.
        for h in range(world.hosts):
            for g in range(world.gpus):
                others = world.unlisted.get((h, g), 0) + sum(
                    p.mb for p in world.procs.values() if (p.host, p.gpu) == (h, g) and p.job is None
                )
                ours = sum(
                    max(NEEDS.gpu_memory_mb, p.mb)
                    for p in world.procs.values()
                    if (p.host, p.gpu) == (h, g) and p.job is not None
                )
                assert others + ours <= CAPACITY, (
                    f"seed {seed} step {step}: host {h} GPU {g}: others {others} + ours {ours} "
                    f"> {CAPACITY}"
                )
    return placed


@pytest.mark.parametrize("block", range(4))
def test_no_gpu_is_ever_over_committed(block: int) -> None:
    placed = sum(simulate(seed, 400) for seed in range(block * 100, (block + 1) * 100))
    assert placed > 1000  # thousands of starts, ends and racing probes were interleaved


def test_the_probe_lists_processes_before_it_reads_memory() -> None:
    """The accounting relies on this order: a process that grows between the two calls then
    makes memory.used larger (counted as someone else's), instead of hiding memory that no
    listed process accounts for."""
    assert PROBE_SCRIPT.index("--query-compute-apps") < PROBE_SCRIPT.index("--query-gpu")


@pytest.mark.parametrize("late", ["memory", "processes"])
def test_the_over_commit_case_of_the_issue(late: str) -> None:
    """One 16384 MiB GPU, jobs holding 6500 MiB with 7000 reserved.  Job b starts between the
    two nvidia-smi calls: whichever of them saw it, there is no room for a third job (the old
    rule, memory.free + observed - max(reservation, observed), made room for one)."""
    gpus = (GpuState(0, "G0", "sim", TOTAL, 0, CAPACITY, 0.0),)
    machine = MachineResources("h", host_state(gpus, ()))
    machine.allocate("a", NEEDS)
    machine.allocate("b", NEEDS)
    assert choose([machine], NEEDS) is None
    generation = machine.probe_started()
    a, b = GpuProcess(11, "G0", 6500), GpuProcess(12, "G0", 6500)
    if late == "processes":  # memory read before b allocated, process list after
        apps, used = (a, b), 6500
    else:  # process list before b started, memory after
        apps, used = (a,), 13000
    seen = (GpuState(0, "G0", "sim", TOTAL, used, CAPACITY - used, 0.6),)
    own = {"a": OwnUsage(frozenset({11})), "b": OwnUsage(frozenset({12}))}
    machine.update(host_state(seen, apps), own, generation)
    _capacity, others, ours = machine.gpu_promises()[0]
    assert ours == 14000
    # Seen in memory.used but not (yet) in the list, b's 6500 MiB count as someone else's until
    # the next probe: too much, never too little.
    assert others == (6500 if late == "memory" else 0)
    assert choose([machine], NEEDS) is None  # never a third 7000 MiB job on 15904 MiB
