"""The agent's jobs: starting each in its own session, following its output and exit, and
killing everything it started (with it, or with the agent).

A part of the agent (main.py): :class:`JobSupervision` is mixed into its ``Agent``, whose state
(``jobs``, ``token``, ``children``, ``spawning``...) it uses; staging a job's inputs is
files.py's.  Runs on the hosts' python3 (3.8 or newer): stdlib only, no 3.9+ syntax.

Containment (see hostguard.py): the agent is a child subreaper, so whatever a job starts
(``setsid``, double forks, ``env -i``) stays below the agent and is found through its parent
chain or its working folder and killed with the job; where ``prctl`` is missing, the process
group and a tag in the environment (``SSH_SCHEDULER_TAG``) are what remain.
"""

import asyncio
import base64
import os
import signal
import subprocess

from ssh_scheduler.agent import hostguard as G
from ssh_scheduler.agent import plumbing as IO
from ssh_scheduler.agent import protocol as P


class Job(object):
    def __init__(self, name, tag, out_path, err_path):
        self.name = name
        self.tag = tag
        self.out_path = out_path
        self.err_path = err_path
        self.transport = None
        self.pid = None
        self.code = None
        self.ended = None  # a future resolved with the exit, for kills that wait on it
        self.subscribed = True
        self.files = {}
        self.jobdir = None
        self.listing = False  # list the results with the exit event
        self.listing_paths = None  # ...only these (None: what the job created or changed)
        self.max_output = None  # bytes of stdout + stderr kept and sent; then the job is killed
        self.over_limit = False

    @property
    def running(self):
        return self.code is None


class JobSupervision(object):
    """The agent's requests and duties about jobs (mixed into main.Agent)."""

    def jobs_changed(self):
        if self.idle is not None and not self.idle.done() and not self.running_jobs():
            self.idle.set_result(None)

    def running_jobs(self):
        return [j for j in self.jobs.values() if j.running]

    async def wait_jobs(self):
        if self.running_jobs():
            self.idle = asyncio.get_event_loop().create_future()
            await self.idle

    # -- killing ----------------------------------------------------------------------------------
    def contain(self):
        """Make this agent a child subreaper (once, at the first job): whatever a job leaves
        behind is re-parented to us, never to init (see hostguard)."""
        if self.subreaper is None:
            self.subreaper = G.set_subreaper()
        return self.subreaper

    def orphans(self, table, kids):
        """{pid: working folder} of our children that are neither a running job's shell nor one
        of our own commands: what jobs left behind (re-parented to us)."""
        keep = set(j.pid for j in self.running_jobs()) | self.children
        return dict((pid, G.working_folder(pid)) for pid in kids.get(os.getpid(), ())
                    if pid not in keep and table[pid][2] != b"Z")

    def processes_of(self, job, table=None):
        """Every process of the job: the tree below its shell and below each orphan working in
        its folder; or, where prctl is missing, its process group and what carries its tag."""
        if job.pid is None:
            return []
        if not self.subreaper:
            return [job.pid, *G.tagged_pids(job.tag, job.pid)]
        table = table if table is not None else G.process_table()
        kids = G.children_map(table)
        pids = G.subtree(kids, job.pid)
        for pid, folder in self.orphans(table, kids).items():
            if job.jobdir and G.inside(folder, job.jobdir):
                pids.extend(G.subtree(kids, pid))
        return pids

    def kill_tree(self, job, sig):
        if job.pid is not None:
            try:
                os.killpg(job.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        G.signal_all(self.processes_of(job), sig)

    def kill_orphans(self):
        """Processes tagged with our batch token that no live agent owns (their agent was
        killed, so they went to init): a fresh agent for the token ends them."""
        prefix = self.token + ":"
        G.signal_all([pid for pid, tag in G.tagged_processes() if tag.startswith(prefix)],
                     signal.SIGKILL)

    def sweep_later(self, job):
        """Kill what ended jobs left, scanning /proc once for all jobs that ended within the
        same few milliseconds (one scan per job end would cost O(jobs x processes))."""
        self.ended_jobs.append(job)
        if self.sweep_handle is None:
            self.sweep_handle = asyncio.get_event_loop().call_later(0.05, self.sweep_leftovers)

    def sweep_leftovers(self):
        self.sweep_handle = None
        ended, self.ended_jobs = self.ended_jobs, []
        if not self.subreaper:
            tags = set(j.tag for j in ended)
            G.signal_all([pid for pid, tag in G.tagged_processes() if tag in tags], signal.SIGKILL)
            return
        table = G.process_table()
        kids = G.children_map(table)
        me = os.getpid()
        # Zombies among our children that asyncio does not wait for: orphans that ended.
        keep = set(j.pid for j in self.running_jobs()) | self.children
        ended_orphans = set() if self.spawning else set(
            pid for pid in kids.get(me, ()) if pid not in keep and table[pid][2] == b"Z")
        self.zombies = G.reap(set(self.zombies) | ended_orphans)
        left = [pid for pid, folder in self.orphans(table, kids).items()
                if any(j.jobdir and G.inside(folder, j.jobdir) for j in ended)]
        for pid in left:
            G.signal_all(G.subtree(kids, pid), signal.SIGKILL)
        self.zombies.extend(left)
        if self.zombies or self.spawning:  # reaped once they are dead (or the spawn is done)
            self.sweep_handle = asyncio.get_event_loop().call_later(0.05, self.sweep_leftovers)

    def end_all(self):
        """The agent ends: nothing any job started may outlive it."""
        if self.subreaper:
            G.kill_below(os.getpid(), include_top=False)
            G.reap([pid for pid, (ppid, _, _) in G.process_table().items() if ppid == os.getpid()])

    async def kill_job(self, job, grace):
        """TERM the job's tree, wait (for its exit, not by polling) up to ``grace``, then KILL."""
        self.kill_tree(job, signal.SIGTERM)
        if job.running and job.ended is not None:
            try:
                await asyncio.wait_for(asyncio.shield(job.ended), grace)
            except asyncio.TimeoutError:
                pass
        self.kill_tree(job, signal.SIGKILL)

    # -- requests ---------------------------------------------------------------------------------
    async def op_run(self, req):
        """Start a job (staging its inputs first when asked: one round trip instead of two)."""
        name = req.job
        old = self.jobs.get(name)
        if old is not None and old.running:
            raise ValueError("job %s is already running" % name)
        job = Job(name, "%s:%s" % (self.token, name), req.out, req.err)
        job.jobdir = req.cwd
        job.listing = req.listing
        job.listing_paths = req.listing_paths
        job.max_output = req.max_output
        job.ended = asyncio.get_event_loop().create_future()
        self.jobs[name] = job
        if req.stage is not None:
            try:
                self.stage(req.cwd, req.stage.files, req.stage.dirs)
            except Exception as exc:
                job.code = -1
                self.send(P.Exit(job=name, message="staging failed: %s: %s" % (type(exc).__name__, exc)))
                return
        for path in (job.out_path, job.err_path):  # an earlier attempt's (created afresh below)
            if path and self.inside_root(path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        env = dict(os.environ)
        env.update(req.env)
        env[G.TAG_VAR] = job.tag
        loop = asyncio.get_event_loop()
        protocol = JobProtocol(self, job, loop)
        self.contain()
        self.spawning += 1
        try:
            transport = await self.spawn(loop, protocol, req.cmd, req.cwd, env)
        except (OSError, subprocess.SubprocessError) as exc:
            self.spawning -= 1
            protocol.close_files()
            job.code = 127
            self.send(P.Exit(job=name, code=127, message=str(exc)))
            return
        job.transport = transport
        job.pid = transport.get_pid()
        self.spawning -= 1
        self.send(P.Started(job=name, pid=job.pid))
        await protocol.exited
        # The shell is gone, but a background grandchild may live on (and hold the pipes open):
        # end its group now, then drain what it wrote before reporting the exit.  The rest of
        # its tree is now ours (we are its subreaper): one coalesced /proc scan ends it.
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.sweep_later(job)
        try:
            await asyncio.wait_for(asyncio.shield(protocol.drained), 2.0)
        except asyncio.TimeoutError:
            pass
        protocol.close_files()
        code = transport.get_returncode()
        transport.close()
        if code is None:
            code = 255
        elif code < 0:
            code = 128 - code
        job.code = code
        if not job.ended.done():
            job.ended.set_result(code)
        self.jobs_changed()
        if job.subscribed:
            self.send_exit(job)

    async def spawn(self, loop, protocol, cmd, cwd, env):
        """Start ``bash --norc -c cmd``, or the program itself where that is the same
        (IO.without_shell); an exec the kernel refuses is bash's to run (and to explain)."""
        direct = IO.without_shell(cmd, cwd, env) if self.shell[0] == "/bin/bash" else None
        if direct is not None:
            argv, program, direct_env = direct
            try:
                transport, _ = await loop.subprocess_exec(
                    lambda: protocol, *argv, executable=program, cwd=cwd, env=direct_env,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, start_new_session=True)
                return transport
            except OSError:
                pass
        transport, _ = await loop.subprocess_exec(
            lambda: protocol, *self.shell, "-c", cmd, cwd=cwd, env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        return transport

    def send_exit(self, job):
        entries = None
        if job.listing and job.jobdir:
            entries = P.encode_listing(self.list_results(job.jobdir, job.listing_paths))
        self.send(P.Exit(job=job.name, code=job.code, entries=entries,
                         message=P.OUTPUT_LIMIT if job.over_limit else None))

    async def op_resume(self, req):
        """A coordinator that came back takes up a job: what it missed, then live output."""
        job = self.jobs.get(req.job)
        if job is None:
            self.send(P.Exit(job=req.job, message="unknown job"))
            return
        offsets = [*req.offsets, 0, 0][:2]
        # No await between reading the files and subscribing: nothing is lost or doubled.
        for fd, path, offset in ((1, job.out_path, offsets[0]), (2, job.err_path, offsets[1])):
            if not path:
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(int(offset))
                    while True:
                        chunk = f.read(1 << 16)
                        if not chunk:
                            break
                        self.send(P.Output(job=job.name, fd=fd,
                                           data=base64.b64encode(chunk).decode()))
            except OSError:
                pass
        job.subscribed = True
        if not job.running:
            self.send_exit(job)

    async def op_kill(self, req):
        job = self.jobs.get(req.job)
        if job is not None and job.running:
            await self.kill_job(job, req.grace)


class JobProtocol(asyncio.SubprocessProtocol):
    """Output of one job: to files on the host and, while subscribed, to the coordinator.

    ``process_exited`` fires when the shell exits, even if a grandchild still holds the pipes,
    which is why this is a protocol rather than ``Process.wait()``.
    """

    def __init__(self, agent, job, loop):
        self.agent = agent
        self.job = job
        # Opened at the first byte: most short jobs print little, and two creates per job
        # were a fifth of the agent's time on a batch of 1000 'true's.
        self.files = {}
        self.paths = {1: job.out_path, 2: job.err_path}
        self.exited = loop.create_future()
        self.drained = loop.create_future()
        self.open_pipes = set([1, 2])
        self.room = job.max_output  # bytes of output left before the job is killed

    def pipe_data_received(self, fd, data):
        if self.room is not None:
            if self.room <= 0:
                return  # over the limit: the job is being killed, its output dropped
            if len(data) >= self.room:
                data = data[:self.room]
                self.job.over_limit = True
                self.agent.keep(asyncio.ensure_future(self.agent.kill_job(self.job, 1.0)))
            self.room -= len(data)
        copy = self.files.get(fd)
        if copy is None and self.paths.get(fd):
            # Never through a planted link, never into a file someone else made.
            copy = self.files[fd] = os.fdopen(G.create_private(self.paths[fd], append=True), "ab")
        if copy is not None:
            copy.write(data)
            copy.flush()
        if self.job.subscribed:
            self.agent.send(P.Output(job=self.job.name, fd=fd,
                                     data=base64.b64encode(data).decode()))

    def pipe_connection_lost(self, fd, exc):
        self.open_pipes.discard(fd)
        if not self.open_pipes and not self.drained.done():
            self.drained.set_result(None)

    def process_exited(self):
        if not self.exited.done():
            self.exited.set_result(None)

    def close_files(self):
        for f in self.files.values():
            if f is not None:
                f.close()
