"""A shared host, round three (issue 23, items 1 and 8): what the agent opens on a host it opens
relative to folders it verified, never by a path someone can change; what a job runs is nowhere
on a command line; a host cannot claim another host's job.

The attacker is ``cluster.other_user()``, a real second unix user inside the test hosts.  Each
attack is set up as the red team reproduced it, then the test shows what now holds.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import wire as W
from ssh_scheduler.agent.boot import MODULES
from ssh_scheduler.transport.bootstrap import agent_start
from tests.cluster import Cluster, Host
from tests.live_batch import LiveBatch, batch_processes, journal, run_batch, wait_until

pytestmark = pytest.mark.namespaces

NO_GPU = ["--no-gpu-required", "--memory-required", "100"]


def machine_file(host: Host, tmp_path: Path, **extra: object) -> str:
    path = tmp_path / f"{host.name}-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({**host.machine_yaml(), **extra}))
    return str(path)


def cache_key(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest() + "-r"


# Two jobs, one after the other (each needs every CPU of the host): the first waits for ``flag``
# (the attacker acts meanwhile), the second stages the input and keeps what it read.  One batch
# file, so the inputs are asked about once and the second job only links what is cached.
SEQUENCE = "while [ ! -e {flag} ]; do sleep 0.1; done\ncat in.txt > result.txt\n"


def one_at_a_time(host: Host) -> list[str]:
    return ["--no-gpu-required", "--memory-required", "100", "--num-cpus", str(host.spec.cpus)]


# --- item 1: the work root's path --------------------------------------------------------------


def test_a_link_of_another_user_above_the_work_root_is_refused(cluster4: Cluster, tmp_path: Path) -> None:
    """The red team's attack: ``workdir`` two levels below a shared sticky folder that is
    group-writable (the kernel's protected_symlinks does not cover it); the other user plants
    ``<lab>/alice -> /tmp`` (root's and sticky, so the old check, which resolved the link, took
    it), lets the batch start, then swaps the link to a tree of theirs: later jobs staged their
    cache file and ran it as us.  Now a link on the way is followed only when it is ours or
    root's, so the batch is refused before anything is made, naming the link and the fix."""
    host, other = cluster4["h2"], cluster4.other_user()
    pid = os.getpid()
    lab, evil, flag = f"/tmp/lab-{pid}", f"/tmp/evil-{pid}", f"/tmp/go-{pid}"
    host.run(f"mkdir {lab} && chgrp {other} {lab} && chmod 1771 {lab}", check=True)
    host.run(
        f"ln -s /tmp {lab}/alice && mkdir -p {evil}/work/cache {evil}/work/jobs {evil}/work/agents"
        f" && printf 'evil\\n' > {evil}/work/cache/{cache_key(b'good' + bytes([10]))} && chmod -R 777 {evil}",
        user=other, check=True,
    )  # fmt: skip
    (tmp_path / "in.txt").write_text("good\n")
    (tmp_path / "b.sh").write_text(SEQUENCE.format(flag=flag))
    machines = ["--machines", machine_file(host, tmp_path, workdir=f"{lab}/alice/work")]
    batch = LiveBatch(tmp_path, "b.sh", *machines, *one_at_a_time(host))
    try:
        code = _attack(batch, host, other, f"ln -sfn {evil} {lab}/alice && touch {flag}")
        result = tmp_path / "job_results" / "b.sh.2" / "result.txt"
        assert not (result.exists() and result.read_text() == "evil\n"), "ran the other user's input"
        assert code == 255, batch.text()  # no usable host: nothing was run
        said = [line for line in batch.err if f"{lab}/alice" in line]
        assert said and "h2" in said[0] and "another user" in said[0] and "workdir" in said[0], batch.text()
        assert host.run(f"find /tmp -user {host.user} -name work").stdout == ""  # nothing made
    finally:
        if batch.proc.poll() is None:
            batch.kill()
        host.run(f"rm -rf {lab} {evil} {flag} /tmp/work")


def _attack(batch: LiveBatch, host: Host, other: str, swap: str) -> int:
    """Let the batch start its first job (if it starts at all), swap as ``other``, let it end."""
    wait_until(lambda: batch.proc.poll() is not None or any(line.startswith("started:") for line in batch.out),
               "the batch starts or is refused")
    if batch.proc.poll() is None:
        host.run(swap, user=other, check=True)
    return batch.finish()


def test_the_agent_keeps_to_the_folders_it_verified_when_the_path_changes(
    cluster4: Cluster, tmp_path: Path
) -> None:
    """The class, not the instance: a link on the way that may be followed (ours) is swapped in
    the middle of a batch to a tree holding a forged cache; the agent works through the folder
    descriptors it verified at its start, so later jobs stage our input, and everything the
    coordinator names (SFTP included) is under the resolved root it verified."""
    host = cluster4["h2"]
    pid = os.getpid()
    home, flag = host.home, f"/tmp/go-{pid}"
    link, real, forged = f"{home}/link-{pid}", f"{home}/real-{pid}", f"{home}/forged-{pid}"
    host.run(
        f"mkdir -p {real} {forged}/work/cache {forged}/work/jobs {forged}/work/agents && ln -s {real} {link}"
        f" && printf 'evil\\n' > {forged}/work/cache/{cache_key(b'good' + bytes([10]))}"
        f" && chmod 400 {forged}/work/cache/* && chmod 700 {forged}/work/*",
        user=host.user, check=True,
    )  # fmt: skip
    (tmp_path / "in.txt").write_text("good\n")
    (tmp_path / "b.sh").write_text(SEQUENCE.format(flag=flag))
    machines = ["--machines", machine_file(host, tmp_path, workdir=f"{link}/work")]
    batch = LiveBatch(tmp_path, "b.sh", *machines, *one_at_a_time(host))
    try:
        code = _attack(batch, host, host.user, f"ln -sfn {forged} {link} && touch {flag}")
        assert code == 0, batch.text()
        assert (tmp_path / "job_results" / "b.sh.2" / "result.txt").read_text() == "good\n"
        assert host.run(f"ls {forged}/work/jobs").stdout == ""  # nothing of the batch went there
    finally:
        if batch.proc.poll() is None:
            batch.kill()
        host.run(f"rm -rf {link} {real} {forged} {flag}")


def test_kept_code_is_never_loaded_before_the_folders_above_are_checked(tmp_path: Path) -> None:
    """The first stage loaded the compiled code kept in the work root before the folders above
    it were checked: a root below a folder anyone may write (not sticky) ran a planted file,
    then refused.  Now nothing is loaded from a root that is refused."""
    shared = tmp_path / "shared"
    shared.mkdir()
    root = shared / "root"
    start = agent_start(sys.executable, str(tmp_path / "first"))
    first = subprocess.run(["/bin/sh", "-c", start.command], input=start.payload + P.Hello(id=1, lease=5).encode()
                           + P.Bye().encode(), capture_output=True, timeout=60, check=False)
    assert first.returncode == 0, first.stderr
    (kept,) = [p for p in (tmp_path / "first").iterdir() if p.name.startswith("code-")]
    marker = tmp_path / "pwned"
    evil = compile(f"open({str(marker)!r}, 'w').close()", "evil", "exec")
    root.mkdir(mode=0o700)
    (root / kept.name).write_bytes(marshal.dumps([evil] * len(MODULES)))
    (root / kept.name).chmod(0o600)  # ours and private: what the old first stage asked of it
    shared.chmod(0o777)  # ...but anyone may swap the root itself: it must be refused first
    start = agent_start(sys.executable, str(root))
    done = subprocess.run(["/bin/sh", "-c", start.command], input=start.payload, capture_output=True, timeout=60, check=False)
    assert not marker.exists()
    assert done.returncode == 2 and f"{shared} is writable by other users" in done.stdout.decode(), done


# --- item 8: what others see, and what a host may claim --------------------------------------------


def test_command_text_and_setup_lines_are_on_no_command_line(cluster4: Cluster, tmp_path: Path) -> None:
    """`ps` (any /proc/<pid>/cmdline) showed every job's command and the machine's setup lines
    to every user of the host; they now reach the job's shell through its environment, which
    only we (and root) can read."""
    host, other = cluster4["h3"], cluster4.other_user()
    flag = f"/tmp/go-{os.getpid()}"
    (tmp_path / "b.sh").write_text(f": command-secret-4712; while [ ! -e {flag} ]; do sleep 0.1; done\n")
    machines = ["--machines", machine_file(host, tmp_path, setup=["export TOKEN=setup-secret-4711"])]
    batch = LiveBatch(tmp_path, "b.sh", *machines, *NO_GPU)
    try:
        batch.wait_for("started:")
        wait_until(lambda: any("sleep 0.1" in p for p in batch_processes(host)), "the job runs")
        seen: list[str] = []

        def listed() -> bool:
            seen.append(host.run("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done", user=other).stdout)
            return "sleep 0.1" in seen[-1]

        # Until a listing caught one of the job's sleeps (each lives 0.1 s, and a listing takes
        # longer on a loaded machine: CI at 2e2ea00 read none in its one listing): the job's
        # programs are there, as they would be anyway, but its command and setup are not.
        wait_until(listed, "another user sees the job's programs")
        assert not [text for text in seen if "secret-471" in text]
        host.run(f"touch {flag}", check=True)
        assert batch.finish() == 0, batch.text()
    finally:
        if batch.proc.poll() is None:
            batch.kill()
        host.run(f"rm -f {flag}")


def test_a_host_cannot_claim_another_hosts_job_at_reattachment(cluster4: Cluster, tmp_path: Path) -> None:
    """An earlier run left b.sh.1 running on h1; on the rerun, h2's agent (hostile) claims a job
    of that name too, and answers first.  Its claim must not take the job from h1: h1's job is
    taken up there, never killed and run again."""
    h1, h2 = cluster4["h1"], cluster4["h2"]
    starts = f"/tmp/starts-{os.getpid()}"
    (tmp_path / "b.sh").write_text(f"echo start >> {starts}; sleep 6; echo end\n")
    first = LiveBatch(tmp_path, "b.sh", "--machines", machine_file(h1, tmp_path), *NO_GPU, "--lease", "120")
    claim = None
    try:
        first.wait_for("started:")
        wait_until(lambda: h1.run(f"cat {starts}").stdout == "start\n", "the job runs on h1")
        first.kill()  # h1's agent keeps the job for the lease
        token = next(str(e["token"]) for e in journal(tmp_path / "job_results") if e["state"] == "batch")
        claim = claim_job(h2, token, "b.sh.1")
        h1.set_latency(150)  # h2 answers first
        rerun = run_batch(tmp_path, "b.sh", "--machines", machine_file(h1, tmp_path), machine_file(h2, tmp_path), *NO_GPU)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert h1.run(f"cat {starts}").stdout == "start\n"  # taken up, not run again
        assert h2.run(f"cat {starts}").returncode != 0
        assert "reattached: b.sh.1 on h1" in rerun.stdout, rerun.stdout
        states = [(e["state"], e.get("host")) for e in journal(tmp_path / "job_results") if e.get("job") == "b.sh.1"]
        assert states[-1] == ("finished", "h1") and ("started", "h2") not in states, states
        assert (tmp_path / "job_results" / "b.sh.1.out").read_text() == "end\n"
    finally:
        h1.clear_latency()
        if claim is not None:
            claim.kill()
            claim.communicate()
        for host in (h1, h2):
            host.kill_user_processes()
            host.run(f"rm -f {starts}")


def claim_job(host: Host, token: str, job: str) -> subprocess.Popen[bytes]:
    """An agent of batch ``token`` on ``host`` holding a job named ``job`` (a sleep), left
    detached so the next coordinator's agent start reaches it: what a hostile host answers."""
    start = agent_start("python3", "~/.ssh_scheduler", token)
    proc = subprocess.Popen(host.ssh_argv(start.command), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(start.payload + P.Hello(id=1, lease=120).encode())
    proc.stdin.flush()
    hello = W.decode_answer(proc.stdout.readline())
    assert isinstance(hello, P.HelloReply), hello
    cwd = f"{getattr(hello, 'real', None) or hello.root}/jobs/{token}-{job}"
    proc.stdin.write(P.Run(job=job, cmd="sleep 60", cwd=cwd, stage=P.Staging()).encode())
    proc.stdin.flush()
    started = json.loads(proc.stdout.readline())
    assert started.get("ev") == "started", started
    return proc
