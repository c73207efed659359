"""The agent's jobs: starting each in its own session, following its output and exit, and
killing everything it started (with it, or with the agent).

A part of the agent (main.py): :class:`JobSupervision` is mixed into its ``Agent``, whose state
(``jobs``, ``token``, ``children``, ``spawning``...) it uses; staging a job's inputs is
files.py's.  Runs on the hosts' python3 (3.8 or newer): stdlib only, no 3.9+ syntax.

Containment (see hostguard.py): the agent is a child subreaper, so whatever a job starts
(``setsid``, double forks, ``env -i``) stays below the agent and is found through its parent
chain or its working folder and killed with the job; where ``prctl`` is missing, the process
group and a tag in the environment (``SSH_SCHEDULER_TAG``) are what remain.

What a job runs is on no command line: ``ps`` shows every process's arguments to every user of
the host, so the command (with the machine's ``setup:`` lines) reaches the job's shell in its
environment (readable only by us and root), and the shell's own arguments are always the same
few words (:data:`SHELL_LINE`).  The job starts in its folder as opened below the verified work
root (a descriptor, through /proc/self/fd), never by a path.

Output goes home first, then into the host's copy (``<job>.out``/``.err``, kept for a
coordinator that reattaches): a copy that cannot be written (a full disk) is dropped and said
once (a Notice), never the output itself; what neither reached home nor the copy is known, so a
coordinator that comes back after it learns the job's output is incomplete (Exit.lost).
"""

import asyncio
import base64
import os
import signal
import subprocess

from ssh_scheduler.agent import hostguard as G
from ssh_scheduler.agent import plumbing as IO
from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent import rooted as R
from ssh_scheduler.agent import warm as W

COMMAND_VAR = "SSH_SCHEDULER_COMMAND"
SHELL_LINE = 'eval "$SSH_SCHEDULER_COMMAND"'
"""The job shell's whole command line: it runs what the environment holds (which first removes
itself from the environment the job's programs get)."""
PROC_FD = os.path.isdir("/proc/self/fd")  # where a folder descriptor can be a working folder
STREAMS = {1: "stdout", 2: "stderr"}
COPY_FAILED = ("cannot keep job output on the host (%s): it goes home only, and a coordinator "
               "that reattaches cannot catch up on what it missed")


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
        self.produced = [0, 0, 0]  # bytes of stdout, stderr the job wrote (by fd)
        self.kept = [0, 0, 0]  # ...of which in the host's copy
        self.broken = {}  # fd -> why its host copy could not be written
        self.lost = None  # what of its output is neither home nor on the host (see op_resume)

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
            # asyncio.wait leaves job.ended alone, as a shield would, and never swallows this
            # task's cancellation, as wait_for can (up to Python 3.11) when both come at once.
            await asyncio.wait({job.ended}, timeout=grace)
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
                self.send(P.Exit(job=name, message="staging failed: %s: %s" % (type(exc).__name__, exc),
                                 missing=getattr(exc, "keys", None)))
                return
        for path in (job.out_path, job.err_path):  # an earlier attempt's (created afresh below)
            if path:
                try:
                    os.unlink(self.job_folder(path), dir_fd=self.work.jobs)
                except (OSError, ValueError):
                    pass
        env = dict(os.environ)
        env.update(req.env)
        env[G.TAG_VAR] = job.tag
        loop = asyncio.get_event_loop()
        protocol = JobProtocol(self, job, loop)
        self.contain()
        self.spawning += 1
        folder = -1
        try:
            folder = R.open_child(self.work.jobs, self.job_folder(req.cwd))
            # The job's folder as opened below the root, not a path someone could re-link.
            cwd = "/proc/self/fd/%d" % folder if PROC_FD else req.cwd
            transport = None
            if req.warm is not None:
                transport = await self.warm_spawn(req.warm, protocol, folder, cwd, env)
            if transport is None:
                transport = await self.spawn(loop, protocol, req.cmd, cwd, env)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self.spawning -= 1
            protocol.close_files()
            job.code = 127
            self.send(P.Exit(job=name, code=127, message=str(exc)))
            return
        finally:
            if folder >= 0:
                os.close(folder)
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
        await asyncio.wait({protocol.drained}, timeout=2.0)
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
        """Start ``bash --norc -c SHELL_LINE`` with the command in its environment, or the
        program itself where that is the same (IO.without_shell: its arguments are its own, as
        ``ps`` would show them once bash had exec'd it); an exec the kernel refuses is bash's to
        run (and to explain)."""
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
        return await self.by_shell(loop, protocol, cmd, cwd, env, stdout=asyncio.subprocess.PIPE,
                                   stderr=asyncio.subprocess.PIPE)

    async def by_shell(self, loop, protocol, cmd, cwd, env, **pipes):
        """``cmd`` run by the job shell rule (the shell's own arguments always the same, the
        command in its environment), in a session of its own, stdin from /dev/null."""
        env = dict(env)
        env[COMMAND_VAR] = "unset %s; %s" % (COMMAND_VAR, cmd)  # its first line stays line 1
        transport, _ = await loop.subprocess_exec(
            lambda: protocol, *self.shell, "-c", SHELL_LINE, cwd=cwd, env=env,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True, **pipes)
        return transport

    async def warm_spawn(self, warm, protocol, folder, cwd, env):
        """The job forked from the warm interpreter its request names (started now if it is the
        first of its kind), or None: the job then runs its own command (see warm.py)."""
        key = (warm.start, tuple(sorted(warm.env.items())))
        python = self.warm.get(key)
        if python is None:
            python = self.warm[key] = W.WarmPython(key)
        loop = asyncio.get_event_loop()

        async def spawn(watched, extra, fd):
            # By the job shell rule, in this job's folder, with the machine's environment but
            # none of this job's own (nor its tag: killing this job must not end it).
            start_env = dict(os.environ)
            start_env.update(warm.env)
            start_env.update(extra)
            fds = (fd,)
            code = self.work.open_code()  # (its calls' module code, kept: call_warm.KeptCode)
            if code is not None:
                start_env[W.CODE_FD] = str(code)
                fds = (fd, code)
            try:
                transport = await self.by_shell(loop, watched, warm.start, cwd, start_env, pass_fds=fds,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            finally:
                if code is not None:
                    os.close(code)
            self.children.add(transport.get_pid())  # never swept as something a job left
            return transport

        try:
            if await python.start(spawn):
                return await python.fork(protocol, folder, env, warm.argv)
        except Exception as exc:  # never the job's failure: it runs its own command instead
            python.fail("%s: %s" % (type(exc).__name__, exc))
        return None

    async def end_warm(self):
        """Before the agent's end: each warm interpreter ends with its socket, waited for as
        asyncio waits for it (end_all would reap it under asyncio, which then complains)."""
        await asyncio.gather(*[python.end(2.0) for python in self.warm.values()])

    def send_exit(self, job):
        entries = None
        if job.listing and job.jobdir:
            entries = P.encode_listing(self.list_results(job.jobdir, job.listing_paths))
        self.send(P.Exit(job=job.name, code=job.code, entries=entries, lost=job.lost,
                         message=P.OUTPUT_LIMIT if job.over_limit else None))

    def copy_failed(self, job, fd, why):
        """The host's copy of a stream of the job cannot be written: dropped, and said (the
        coordinator says it once per host)."""
        job.broken[fd] = why
        self.send(P.Notice(job=job.name, message=COPY_FAILED % why))

    async def op_resume(self, req):
        """A coordinator that came back takes up a job: what it missed, then live output.
        Output it missed that the host's copy does not hold either (the copy failed while no
        coordinator listened) exists nowhere: the job's Exit says so (``lost``)."""
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
                with open(os.open(self.job_folder(path), R.READ, dir_fd=self.work.jobs), "rb") as f:
                    f.seek(int(offset))
                    while True:
                        chunk = f.read(1 << 16)
                        if not chunk:
                            break
                        self.send(P.Output(job=job.name, fd=fd,
                                           data=base64.b64encode(chunk).decode()))
            except (OSError, ValueError):
                pass
            gap = max(int(offset), job.kept[fd])
            if job.produced[fd] > gap and job.lost is None:
                job.lost = "its output after byte %d of %s was lost on the host (%s)" % (
                    gap, STREAMS[fd], job.broken.get(fd, "not kept"))
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
        self.files = {}  # fd -> descriptor of the host's copy (keep_copy)
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
        self.job.produced[fd] += len(data)
        if self.job.subscribed:  # home first: whatever becomes of the host's copy
            self.agent.send(P.Output(job=self.job.name, fd=fd,
                                     data=base64.b64encode(data).decode()))
        if self.paths.get(fd) and fd not in self.job.broken:
            self.keep_copy(fd, data)

    def keep_copy(self, fd, data):
        """Append to the host's copy of the stream (made at its first byte: most short jobs
        print little, and two creates per job were a fifth of the agent's time on a batch of
        1000 'true's); never through a planted link, never into a file someone else made."""
        try:
            out = self.files.get(fd)
            if out is None:
                name = self.agent.job_folder(self.paths[fd])
                out = self.files[fd] = G.create_private(self.agent.work.jobs, name, append=True)
            view = memoryview(data)
            while view:
                written = os.write(out, view)
                self.job.kept[fd] += written
                view = view[written:]
        except (OSError, ValueError) as exc:
            self.close_file(fd)
            self.agent.copy_failed(self.job, fd, getattr(exc, "strerror", None) or str(exc))

    def pipe_connection_lost(self, fd, exc):
        self.open_pipes.discard(fd)
        if not self.open_pipes and not self.drained.done():
            self.drained.set_result(None)

    def process_exited(self):
        if not self.exited.done():
            self.exited.set_result(None)

    def close_file(self, fd):
        out = self.files.pop(fd, None)
        if out is not None:
            try:
                os.close(out)
            except OSError:
                pass

    def close_files(self):
        for fd in list(self.files):
            self.close_file(fd)
