"""A Slurm cluster as a place to run jobs: its login node, reached over SSH through our agent.

Inputs go once into the cluster's shared filesystem through the login node (the agent's
content-addressed cache, as on any host); each job is one ``sbatch`` whose batch script runs
the command in the job's folder, Slurm writes its output next to that folder, and we stream it
home while the job runs, then bring its results back as from any host.  Slurm picks the nodes and
sets ``CUDA_VISIBLE_DEVICES``; the planner sees the machine as a queue of ``max_queued`` slots.

Slurm tells a client nothing by itself (no event stream to a submitter: ``strigger`` is for
administrators and fires programs on the controller), so following jobs needs polling.  It is
bounded: ONE query per interval for the whole machine (``slurm_jobs.status_query``, a request the
login node's agent serves: squeue for every job of ours, which also tells how those that ended
ended; one scontrol or sacct only for those squeue no longer lists; and the new output of every
running job), never one per job, and none at all while nothing of ours is in Slurm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os.path
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ssh_scheduler.agent.protocol import SlurmReply
from ssh_scheduler.errors import ConnectionLostError, TransportError
from ssh_scheduler.executors import slurm_jobs as S
from ssh_scheduler.executors.base import OutputSink, RunRequest, shell_line
from ssh_scheduler.executors.host import AgentExecutor, open_executor
from ssh_scheduler.executors.job_events import JobExit
from ssh_scheduler.executors.python_call import work_inputs
from ssh_scheduler.executors.slurm_array import ARRAY_MARK, parse_array_script, task_outputs
from ssh_scheduler.executors.slurm_submit import Submitter
from ssh_scheduler.executors.stage_plan import StagePlan
from ssh_scheduler.jobs.needs import Needs
from ssh_scheduler.machines.host_state import HostState, OwnUsage
from ssh_scheduler.machines.machine import Machine
from ssh_scheduler.machines.slurm import SlurmSettings, queue_state
from ssh_scheduler.transport.base import stopped

__all__ = ["SlurmExecutor", "open_slurm_executor"]

log = logging.getLogger(__name__)

START_TRIES = 3
"""Submissions of a job Slurm keeps failing before its script begins (see _never_began)."""
QUERY_FAILURES_TOLERATED = 5
"""Status queries in a row that may fail (slurmctld restarting, a timeout) before the jobs are
given up as lost."""


@dataclass(slots=True)
class _Tracked:
    """One job of ours in Slurm."""

    name: str
    slurm_id: str
    output: str  # the path of its output before .out/.err (an array task's: slurm_array.py)
    on_output: OutputSink
    offsets: list[int]
    done: asyncio.Future[JobExit]
    ended: S.JobStatus | None = None
    state: str = "PENDING"
    missing: int = 0  # queries in a row that did not show it
    room: int | None = None  # bytes of output still accepted (--max-output-bytes)


class SlurmExecutor(AgentExecutor):
    """Jobs through ``sbatch`` on a login node (see the module docstring)."""

    def __init__(self, inner: AgentExecutor, settings: SlurmSettings, token: str) -> None:
        # The login node is a host like any other (its agent stages inputs and fetches results);
        # this class takes over running, following and ending the jobs it hands to Slurm.
        super().__init__(inner.transport, inner.session)
        self.cache = inner.cache
        self.settings = settings
        self.token = token
        self.submitted: dict[str, str] = {}  # job -> Slurm job id, of this batch
        self.found: dict[str, tuple[str, S.JobStatus]] = {}  # left by an earlier coordinator
        self._found_outputs: dict[str, str] = {}  # where those of them in arrays have their output
        self._tracked: dict[str, _Tracked] = {}
        self._poller: asyncio.Task[None] | None = None
        self._failures = 0
        self._answered = False  # squeue ran once on the login node
        self._submitter = Submitter(self.name, settings, token, self._command, self._scancel, self.jobdir)
        self._on_running: dict[str, Callable[[], None]] = {}
        """Each submitted job's started hook (its request's, with its Slurm id), called once when
        Slurm first runs the job (or it ended unseen between two queries)."""

    # -- what differs from a plain host (the rest is AgentExecutor's: staging, fetching...) ----

    @property
    def agent_jobs(self) -> dict[str, dict[str, Any]]:
        """Jobs of this batch an earlier coordinator submitted and Slurm still knows."""
        return {job: {"running": not status.done} for job, (_id, status) in self.found.items()}

    # -- probing: the queue, not the cluster's resources -----------------------------------

    async def probe(self) -> tuple[HostState, dict[str, OwnUsage]]:
        """The queue (:func:`slurm.queue_state`), once squeue answers on the login node.  It
        does not change, so only the first probe asks (re-probes follow every job's end)."""
        if not self._answered:
            text, rc, _own = await self.session.probe(self._sh("squeue --version 2>&1"))
            if rc != 0:
                raise TransportError(
                    f"{self.name}: squeue does not run on the login node: {text.strip()[-200:]}"
                )
            self._answered = True
        state = queue_state(self.settings)
        return state, {}

    def _sh(self, command: str) -> str:
        prefix = self.settings.command_prefix
        return f"{prefix}\n{command}" if prefix else command

    # -- running -------------------------------------------------------------------------------

    async def run(self, request: RunRequest, on_output: OutputSink) -> JobExit:
        """Submit the job (its needs and timeout become sbatch's options) and follow it to its
        end; its started hook is called with its Slurm id once Slurm runs it (or at once, with
        none, when sbatch refuses it: its end follows).  Cancelling this scancels it."""
        job, jobdir = request.name, request.jobdir
        try:
            # Slurm runs the work on a node of its choosing: the inputs go into the job's folder
            # on the shared filesystem now, not as the job starts.
            try:
                staged = await work_inputs(self.cache, request)  # a Python call's runner and pickle too
                await self.session.stage(jobdir, *(staged or StagePlan([], [])))
            except TransportError as exc:  # as for a host's inputs (JobRun's staging)
                return JobExit(None, host_lost=True, message=str(exc))
            needs = request.needs or Needs()
            argv = S.sbatch_argv(
                self.settings,
                name=S.job_name(self.token, job),
                jobdir=jobdir,
                needs=needs,
                timeout=request.timeout,
            )
            script = S.batch_script(
                shell_line(request, self.machine.python), request.env, gpus=needs.gpus, jobdir=jobdir
            )
            read: dict[str, tuple[int, int]] = {}  # output path -> bytes of it already home
            for tries in range(1, START_TRIES + 1):
                submitted = await self._submitter.submit(job, jobdir, argv, script)
                slurm_id, said = submitted.slurm_id, submitted.said
                if submitted.lost:
                    return JobExit(None, host_lost=True, message=said)
                if slurm_id is None:
                    said = " ".join(said.split())[-400:]
                    on_output(2, f"ssh_scheduler: sbatch refused it: {said}\n".encode())
                    request.on_started("")
                    return JobExit(1, message=f"sbatch refused it: {said}")
                self.submitted[job] = slurm_id
                if tries == 1:  # announced once: a job sent again is the same attempt
                    self._on_running[job] = partial(request.on_started, slurm_id)
                log.info("submitted: %s is Slurm job %s on %s", job, slurm_id, self.name)
                # (A single job sent again appends to the same files: followed from where it was.)
                ended, state, read[submitted.output] = await self._follow(
                    job, slurm_id, submitted.output, on_output, read.get(submitted.output, (0, 0)),
                    request.limits.max_output_bytes,
                )
                if tries == START_TRIES or not await self._never_began(jobdir, state):
                    return ended
                said = f"Slurm ended job {slurm_id} ({state}, exit {ended.code}) before its script began"
                log.warning("%s: %s of %s; submitting it again", self.name, said, job)
                on_output(2, f"ssh_scheduler: {said}; submitting it again\n".encode())
            raise AssertionError("unreachable")
        finally:  # a job that never started (lost, cancelled) has nothing to announce later
            self._on_running.pop(job, None)

    async def _never_began(self, jobdir: str, state: str | None) -> bool:
        """Slurm failed the job before its batch script made its mark (S.batch_script): its
        command never ran, so sending it again is safe (slurmd can lose a starting job's script
        to its own race, and the job then fails with execve's ENOENT).  A job cancelled,
        timed out or failed by its node is not one: it is told as it ended."""
        if state != "FAILED":
            return False
        marker = shlex.quote(S.began_marker(jobdir))
        try:
            out, rc, _ = await self.session.probe(f"test -e {marker} && echo began || echo never", timeout=60)
        except TransportError:
            return False
        return rc == 0 and out.strip() == "never"

    async def resume(self, request: RunRequest, offsets: tuple[int, int], on_output: OutputSink) -> JobExit:
        """Follow a job an earlier coordinator submitted (found in squeue by its name)."""
        slurm_id, _status = self.found.pop(request.name)
        self.submitted[request.name] = slurm_id
        output = self._found_outputs.pop(request.name, request.jobdir)
        ended, _state, _read = await self._follow(request.name, slurm_id, output, on_output, offsets)
        return ended

    async def _follow(
        self,
        job: str,
        slurm_id: str,
        output: str,
        on_output: OutputSink,
        offsets: tuple[int, int],
        max_output: int | None = None,
    ) -> tuple[JobExit, str | None, tuple[int, int]]:
        """Follow the job to its end; ``output``: where Slurm writes its ``.out``/``.err``.
        Returns how it ended, the state Slurm ended it in (None: we never saw it end) and the
        bytes of its .out and .err read."""
        loop = asyncio.get_running_loop()
        tracked = _Tracked(
            job, slurm_id, output, on_output, list(offsets), loop.create_future(), room=max_output
        )
        self._tracked[job] = tracked
        self._start_poller()
        try:
            ended = await asyncio.shield(tracked.done)
            state = None if tracked.ended is None else tracked.ended.state
            return ended, state, (tracked.offsets[0], tracked.offsets[1])
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._scancel([slurm_id]))
            raise
        finally:
            self._tracked.pop(job, None)
            self._on_running.pop(job, None)

    async def kill(self, job: str) -> None:
        slurm_id = self.submitted.get(job)
        if slurm_id is not None:
            await self._scancel([slurm_id])

    async def _command(self, command: str) -> tuple[str, int]:
        out, rc, _ = await self.session.probe(command, timeout=120)
        return out, rc

    async def _scancel(self, ids: list[str]) -> None:
        for command in S.scancel_commands(self.settings, ids):  # ids batched: no line grows
            out, rc, _ = await self.session.probe(command, timeout=60)
            if rc != 0:
                log.warning("%s: scancel: %s", self.name, out.strip())

    async def remove(self, jobdir: str, job: str | None = None, *, wait: bool = True) -> None:
        if job is not None and job in self.found:  # a leftover of an earlier run: stop it too
            slurm_id, status = self.found.pop(job)
            if not status.done:
                await self._scancel([slurm_id])
        await super().remove(jobdir, job, wait=wait)

    async def close(self) -> None:
        """Leave nothing of this batch queued or running in Slurm (a cancelled batch, or an
        sbatch whose answer a cancel cut off), then close the agent.  A coordinator that is
        SIGKILLed never gets here: its jobs stay in Slurm for its rerun to reattach to."""
        try:
            await self._submitter.close()
            if self._poller is not None:
                await stopped(self._poller)
            if self.lost is None:
                with contextlib.suppress(TransportError, TimeoutError):
                    left = [
                        job_id
                        for job_id, status in (await self._ours()).values()
                        if not status.done
                    ]
                    if left:
                        log.info("%s: cancelling Slurm jobs %s", self.name, " ".join(left))
                        await self._scancel(left)
        finally:
            await super().close()

    # -- following: one query per interval for every job ---------------------------------------

    async def find_earlier(self) -> None:
        """What this batch's token already has in Slurm (a rerun after a killed coordinator)."""
        self.found = await self._ours()

    async def _ours(self) -> dict[str, tuple[str, S.JobStatus]]:
        """This batch's jobs that Slurm knows: job -> (Slurm id, status).  An array task is
        named by its array's dispatch script (task -> job folder); one whose script is gone
        (swept) is listed under its Slurm id."""
        reply = await self._query([], {})
        prefix = S.job_name(self.token, "")
        arrays: dict[str, tuple[list[str], list[str]]] = {}  # name -> job folders, outputs by task
        found: dict[str, tuple[str, S.JobStatus]] = {}
        for entry in reply.queue.values():
            if not entry.name.startswith(prefix):
                continue
            status = S.queue_status(entry)
            job = entry.name[len(prefix) :]
            if job.startswith(ARRAY_MARK):
                if job not in arrays:
                    arrays[job] = await self._array_tasks(job)
                task = entry.job_id.rpartition("_")[2]
                folders, outputs = arrays[job]
                at = int(task) if task.isdigit() and int(task) < len(folders) else None
                if at is None:
                    job = f"{ARRAY_MARK}{entry.job_id}"
                else:
                    job = os.path.basename(folders[at])[len(self.token) + 1 :]
                    self._found_outputs[job] = outputs[at]
            found[job] = (entry.job_id, status)
        return found

    async def _array_tasks(self, array: str) -> tuple[list[str], list[str]]:
        """The job folders of the array's tasks and where each has its output, by task."""
        stem = self.jobdir(self.token, array)
        with contextlib.suppress(TransportError):
            text, rc, _ = await self.session.probe(f"cat {shlex.quote(stem + '.array')} 2>/dev/null")
            if rc == 0:
                return parse_array_script(text), task_outputs(text, stem)
        return [], []

    async def _query(self, ids: list[str], outputs: dict[str, tuple[str, int, int]]) -> S.PollReply:
        """One request to the login node's agent, however many jobs: nothing of it travels
        on a command line."""
        request = S.status_query(self.settings, ids, outputs)
        answer = await self.session.call(request, SlurmReply, 120)
        try:
            return S.poll_reply(answer)
        except ValueError as exc:
            raise TransportError(f"{self.name}: the Slurm status query failed: {exc}") from None

    def _start_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        await asyncio.sleep(0.2)  # jobs submitted together are seen by one query
        loop = asyncio.get_running_loop()
        while self._tracked:
            began = loop.time()
            try:
                await self._poll_once()
                self._failures = 0
            except ConnectionLostError as exc:
                self._end_all(JobExit(None, host_lost=True, message=str(exc)))
                return
            except TransportError as exc:
                self._failures += 1
                log.warning("%s", exc)
                if self._failures > QUERY_FAILURES_TOLERATED:
                    self._end_all(JobExit(None, host_lost=True, message=str(exc)))
                    return
            # one query per interval, however long a query takes (a slow one is not added to
            # the time a finished job waits to be seen, and its slot to be filled again)
            await asyncio.sleep(max(0.0, began + self.settings.poll_interval - loop.time()))

    def _end_all(self, exit_: JobExit) -> None:
        for tracked in self._tracked.values():
            if not tracked.done.done():
                tracked.done.set_result(exit_)

    async def _poll_once(self) -> None:
        jobs = list(self._tracked.values())
        outputs = {t.name: (t.output, t.offsets[0], t.offsets[1]) for t in jobs}
        reply = await self._query([t.slurm_id for t in jobs if t.ended is None], outputs)
        for t in jobs:
            full = t.name in reply.more  # its output is not all home yet
            for fd, data in reply.data.get(t.name, {}).items():
                t.offsets[fd - 1] += len(data)
                full = full or len(data) >= S.READ_CHUNK
                if t.room is not None:  # past the limit: the rest is dropped and the job ended
                    if len(data) > t.room and t.ended is None:
                        t.ended = S.JobStatus(
                            "CANCELLED",
                            done=True,
                            code=1,
                            message="output over --max-output-bytes; the job was cancelled",
                        )
                        with contextlib.suppress(TransportError):
                            await self._scancel([t.slurm_id])
                    data = data[: t.room]
                    t.room -= len(data)
                if data:
                    t.on_output(fd, data)
            entry = reply.queue.get(t.slurm_id)
            if entry is not None:
                if t.state in S.RUNNING_STATES and entry.state in S.WAITING_STATES:
                    log.warning(
                        "%s: Slurm requeued %s (job %s): %s",
                        self.name,
                        t.name,
                        t.slurm_id,
                        entry.reason,
                    )
                t.state, t.missing = entry.state, 0
                if t.ended is None and entry.state in S.DONE_STATES and entry.wait_status.isdigit():
                    t.ended = S.queue_status(entry)  # told whole by squeue: nothing more asked
            elif reply.squeue_ok:
                t.missing += 1
            if t.ended is None and t.slurm_id in reply.detail:
                status = S.final_status(reply.detail[t.slurm_id])
                if status is not None and status.done:
                    t.ended = status
                elif status is None and t.missing > 2:
                    t.ended = S.JobStatus(
                        "UNKNOWN",
                        done=True,
                        code=1,
                        message=f"Slurm no longer knows job {t.slurm_id}",
                    )
            if t.ended is not None or t.state in S.RUNNING_STATES:
                self._on_running.pop(t.name, lambda: None)()
            # the job's whole output is home before it counts as ended
            if t.ended is not None and not full and not t.done.done():
                log.info(
                    "%s: Slurm job %s of %s ended %s", self.name, t.slurm_id, t.name, t.ended.state
                )
                t.done.set_result(JobExit(t.ended.code, message=t.ended.message))


async def open_slurm_executor(
    machine: Machine, *, settings: SlurmSettings, token: str, **kwargs: Any
) -> SlurmExecutor:
    """Connect to the login node (our agent there) and look for this batch's jobs in Slurm."""
    inner = await open_executor(machine, token=token, **kwargs)
    executor = SlurmExecutor(inner, settings, token)
    try:
        await executor.find_earlier()
    except BaseException:
        await executor.close()
        raise
    return executor
