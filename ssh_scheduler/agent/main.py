"""The host agent: a small stdlib-only program the coordinator runs on each host over ONE channel.

It is sent as source on the command line (``python3 -c``), so nothing is installed on the host.
The coordinator and the agent speak newline-delimited JSON over the channel's stdin/stdout.

Why an agent instead of one SSH channel per job: a channel costs sshd a fork and a login shell,
counts against ``MaxSessions`` and dies with the connection.  The agent costs one fork per job,
starts each job in its own session/process group, and keeps each job's output and exit status on
the host as well as streaming them back.  It is a child subreaper (hostguard.py), so whatever a
job starts (``setsid``, double forks, ``env -i``) stays below the agent and is found through its
parent chain or its working folder and killed with the job; where ``prctl`` is missing, the
process group and a tag in the environment (``SSH_SCHEDULER_TAG``) are what remain.

Leases and reattachment (the model is HTCondor's job lease): the agent outlives its channel.
When the coordinator goes quiet (its process killed, its connection cut) the jobs keep running
for ``lease`` seconds.  A coordinator that comes back starts the bootstrap again with the same
batch token; finding this agent's unix socket, the new process turns into a byte relay and the
coordinator talks to the old agent again, which lists its jobs so they can be resumed.  If nobody
comes back within the lease, the agent kills every job it started and exits: no orphans.

This file must run on the remote python3 (3.8 or newer), so: stdlib only, no 3.9+ syntax, and no
imports from the rest of the package.

The requests, replies and events are defined in protocol.py, which travels with this file;
each request ``X`` with tag ``x`` is served by the method ``op_x``.
"""

import asyncio
import base64
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

if "ssh_scheduler_protocol" in sys.modules:  # shipped with us (transport.agent_bootstrap)
    P = sys.modules["ssh_scheduler_protocol"]
    G = sys.modules["ssh_scheduler_hostguard"]
    IO = sys.modules["ssh_scheduler_plumbing"]
else:  # imported from the package (tests)
    from ssh_scheduler.agent import hostguard as G
    from ssh_scheduler.agent import plumbing as IO
    from ssh_scheduler.agent import protocol as P

CACHE_DIR = "cache"
JOBS_DIR = "jobs"
AGENTS_DIR = "agents"


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


class Agent(object):
    def __init__(self, root, token):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.token = token or ("t%d" % os.getpid())
        self.cache = os.path.join(self.root, CACHE_DIR)
        self.jobs = {}  # job name -> Job (kept after exit until removed)
        self.staged = {}  # job dir -> {rel: (ino, mtime_ns, size, key)}
        self.lease = 60.0
        self.last_heard = time.monotonic()
        self.client = None  # the coordinator we answer now
        self.done = None  # resolved by "bye"
        self.ended_jobs = []  # ended since the last sweep
        self.closing = False
        self.idle = None
        self.tasks = set()
        # The one shell rule (execute_to's watchdog in fleet.py follows it too): bash, without
        # ~/.bashrc (which Debian's bash reads when it sees SSH_CLIENT, printing into every job's
        # output); /bin/sh only where bash is missing.  Environment comes from env:/setup:.
        self.shell = ["/bin/bash", "--norc"] if os.path.exists("/bin/bash") else ["/bin/sh"]
        self.subreaper = None  # prctl's answer, asked at the first job (see hostguard)
        self.children = set()  # pids of our own children besides job shells (probes)
        # Children being started: their pid is not known to us until the spawn returns, and a
        # fast one may already be a zombie then; asyncio must reap it, never the sweep (it would
        # then report 255 for the job), so the sweep leaves unknown zombies alone meanwhile.
        self.spawning = 0
        self.sweep_handle = None
        self.zombies = []
        self.trust = None  # which cache entries hashed true (G.CacheTrust), at the first "have"

    # -- plumbing ---------------------------------------------------------------------------------
    def send(self, message):
        client = self.client
        if client is None:
            return
        data = message.encode()
        try:
            client.write(data)
        except Exception:
            self.client = None

    def inside_root(self, path):
        # normpath, not realpath: the paths come from our coordinator under a root we made; the
        # check stops a wrong path, and a realpath per job cost more than the job's own setup.
        real = os.path.normpath(path)
        return real == self.root or real.startswith(self.root + os.sep)

    async def serve(self, sock_path):
        loop = asyncio.get_event_loop()
        server = None
        if sock_path:
            server = await start_unix_server(self, sock_path)
        self.kill_orphans()
        reader = asyncio.StreamReader(limit=1 << 26)
        try:
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        except ValueError:  # stdin is a plain file (tests, debugging): read it in a thread
            threading.Thread(target=IO.feed_from_file, args=(loop, reader), daemon=True).start()
        try:
            transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, sys.stdout
            )
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        except ValueError:
            writer = IO.BlockingWriter(sys.stdout.fileno())
        # A thread, not a task: it must fire even if the event loop were stuck.
        threading.Thread(target=self.watchdog, daemon=True).start()
        self.done = loop.create_future()
        await self.attach(reader, writer)
        if not self.closing and self.jobs:
            await self.done  # detached: wait for a coordinator to come back, or the lease
        await self.wait_jobs()
        if self.tasks:  # requests that came before "bye" (a last remove, say) still run,
            await asyncio.wait(list(self.tasks), timeout=2.0)  # but a hung probe cannot hold us
        self.end_all()
        if server is not None:
            server.close()
            try:
                os.unlink(sock_path)
            except OSError:
                pass

    async def attach(self, reader, writer):
        """Serve one coordinator connection until it ends; a newer one replaces it."""
        self.client = writer
        for job in self.jobs.values():
            job.subscribed = False  # until the new coordinator resumes it
        self.last_heard = time.monotonic()
        while True:
            try:
                line = await reader.readline()
            except Exception:
                line = b""
            if not line:
                break
            if self.client is not writer:
                return  # replaced by a newer connection
            self.last_heard = time.monotonic()
            try:
                req = P.decode_request(line)
            except P.ProtocolError as exc:
                self.send(P.Error(id=exc.id, job=exc.job, message=str(exc)))
                continue
            if isinstance(req, P.Bye):
                self.op_bye(req)
                break
            handler = getattr(self, "op_" + req.TAG)
            self.keep(asyncio.ensure_future(self.guard(handler, req)))
        if self.client is writer:
            self.client = None
            for job in self.jobs.values():
                job.subscribed = False

    def keep(self, task):
        self.tasks.add(task)  # keep a reference until it ends (the loop holds weak ones)
        task.add_done_callback(self.tasks.discard)

    async def guard(self, handler, req):
        try:
            await handler(req)
        except Exception as exc:  # report, never die: one bad request must not kill other jobs
            self.send(P.Error(id=req.id, job=getattr(req, "job", None),
                              message="%s: %s" % (type(exc).__name__, exc)))

    def watchdog(self):
        # Cut networks never deliver EOF and killed coordinators never say bye: the lease is
        # what frees the host then.
        while True:
            time.sleep(max(0.2, min(1.0, self.lease / 4.0)))
            if time.monotonic() - self.last_heard > self.lease:
                running = [j for j in self.jobs.values() if j.running]
                for job in running:
                    self.kill_tree(job, signal.SIGTERM)
                if running:
                    time.sleep(2.0)
                for job in running:
                    self.kill_tree(job, signal.SIGKILL)
                self.end_all()  # and whatever ended jobs left behind
                # Nobody came back for the results: a later run of the batch starts these jobs
                # afresh, so their folders are only litter now.
                self.sweep(self.token + "-")
                os._exit(3)

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
    async def op_hello(self, req):
        self.lease = req.lease
        if req.probe is not None:  # answered under its own id, exactly like a Probe request
            self.keep(asyncio.ensure_future(self.guard(self.op_probe, req.probe)))
        jobs = dict((j.name, P.JobState(running=j.running, code=j.code)) for j in self.jobs.values())
        self.send(P.HelloReply(id=req.id, pid=os.getpid(), root=self.root,
                               python=sys.version.split()[0], jobs=jobs,
                               probing=req.probe is not None))

    async def op_ping(self, req):
        pass

    def op_bye(self, req):
        """Orderly end (called in line: nothing after it on this connection is read)."""
        self.closing = True
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    async def op_probe(self, req):
        self.spawning += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", req.cmd, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
            self.children.add(proc.pid)
        finally:
            self.spawning -= 1
        try:
            out, _ = await proc.communicate()
        finally:
            self.children.discard(proc.pid)
        self.send(P.ProbeReply(id=req.id, out=out.decode("utf-8", "replace"),
                               rc=proc.returncode, own=self.own_usage()))

    def own_usage(self):
        """PIDs and resident memory of every process of each running job."""
        running = self.running_jobs()
        usage = dict((j.name, P.JobUsage()) for j in running)
        if not running:
            return usage
        page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
        table = G.process_table()
        for job in running:
            found = [pid for pid in self.processes_of(job, table) if pid in table]
            usage[job.name].pids = found
            usage[job.name].rss_mb = sum(table[pid][1] for pid in found) * page_kb // 1024
        return usage

    async def op_have(self, req):
        """Which cache entries are missing.  An entry is trusted only when it is ours, a plain
        file, and its content hashes to its name (checked once per agent; in a thread, since
        inputs can be large); anything else is removed and reported missing."""
        loop = asyncio.get_event_loop()
        missing = await loop.run_in_executor(None, self.missing_from_cache, req.hashes, req.sizes)
        self.send(P.HaveReply(id=req.id, missing=missing))

    def missing_from_cache(self, keys, sizes):
        trust = self.trust
        if trust is None:
            trust = self.trust = G.CacheTrust(self.cache, os.path.join(self.root, "cache-trusted.json"))
        missing = [key for key in keys if not trust.check(key, sizes.get(key))]
        trust.save()
        return missing

    async def op_stage(self, req):
        self.stage(req.dir, req.files, req.dirs)
        self.send(P.Staged(id=req.id))

    def stage(self, jobdir, files, dirs):
        """Give a job its private directory, its inputs hard-linked from the cache.

        Cache files are read-only, so a job that rewrites an input in place gets EACCES (as a
        non-root user) rather than silently corrupting the copy every later job links to; the
        manifest check below catches the root case and evicts the entry.
        """
        if not self.inside_root(os.path.dirname(jobdir)):
            raise ValueError("job directory outside the work root")
        if os.path.lexists(jobdir):
            shutil.rmtree(jobdir, ignore_errors=True)  # left by an earlier, abandoned attempt
        os.makedirs(jobdir, mode=0o700)
        record = {}
        for rel in dirs:
            os.makedirs(os.path.join(jobdir, rel), exist_ok=True)
        for staged in files:
            rel, key = staged.rel, staged.key
            target = os.path.join(jobdir, rel)
            parent = os.path.dirname(target)
            if parent:
                os.makedirs(parent, exist_ok=True)
            source = os.path.join(self.cache, key)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
            st = os.lstat(target)
            record[rel] = (st.st_ino, st.st_mtime_ns, st.st_size, key)
        self.staged[jobdir] = record

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

    async def op_manifest(self, req):
        entries = self.list_results(req.dir, req.paths)
        self.send(P.ManifestReply(id=req.id, entries=P.encode_listing(entries)))

    def list_results(self, jobdir, explicit):
        """What to bring home from a job directory, never following a link.

        Without explicit paths: everything the job created or changed, i.e. not the untouched
        hard links to staged inputs.
        """
        staged = self.staged.get(jobdir, {})
        roots = explicit if explicit else ["."]
        entries = []
        seen = set()
        for top in roots:
            start = os.path.normpath(os.path.join(jobdir, top))
            if not (start == jobdir or start.startswith(jobdir + os.sep)):
                continue
            for rel, st in IO.walk(start, jobdir):
                if rel in seen:
                    continue
                seen.add(rel)
                kind = IO.kind_of(st.st_mode)
                link = None
                if kind == "link":
                    link = os.readlink(os.path.join(jobdir, rel))
                if kind == "file" and not explicit:
                    before = staged.get(rel)
                    if before is None and st.st_nlink > 1 and st.st_mode & 0o222 == 0:
                        continue  # an input staged by an agent that is gone (resumed batch)
                    if before is not None and before[0] == st.st_ino:
                        if before[1] == st.st_mtime_ns and before[2] == st.st_size:
                            continue  # an untouched input
                        # Rewritten in place through the shared link: the cache is spoiled.
                        try:
                            os.unlink(os.path.join(self.cache, before[3]))
                        except OSError:
                            pass
                if kind == "dir" and not explicit:
                    continue  # directories come along with the files in them
                entries.append(P.ManifestEntry(path=rel, kind=kind, size=st.st_size,
                                               mode=stat.S_IMODE(st.st_mode), link=link))
        return entries

    async def op_remove(self, req):
        path = req.dir
        job = self.jobs.get(req.job or "")
        if job is not None:
            if job.running:
                await self.kill_job(job, 2.0)
            for extra in (job.out_path, job.err_path):
                if extra and self.inside_root(os.path.dirname(extra)):
                    try:
                        os.unlink(extra)
                    except OSError:
                        pass
            self.jobs.pop(job.name, None)
        if self.inside_root(os.path.dirname(path)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        self.staged.pop(path, None)
        if req.id is not None:
            self.send(P.Removed(id=req.id))


    async def op_sweep(self, req):
        """The batch is over: remove every job folder and output file it left here."""
        self.sweep(req.prefix)
        self.send(P.Swept(id=req.id))

    def sweep(self, prefix):
        jobs_dir = os.path.join(self.root, JOBS_DIR)
        busy = set(prefix + j.name for j in self.running_jobs())
        for name in os.listdir(jobs_dir):
            stem = name[:-4] if name.endswith((".out", ".err")) else name
            if not name.startswith(prefix) or stem in busy:
                continue
            path = os.path.join(jobs_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # -- small files in bulk (transfer.py, bulk.py): many files per message, not per SFTP trip ---
    async def op_put(self, req):
        """Keep small inputs in the cache; each is checked against its hash before it counts."""
        trust = self.trust
        if trust is None:
            trust = self.trust = G.CacheTrust(self.cache, os.path.join(self.root, "cache-trusted.json"))
        failed = []
        for blob in req.files:
            try:
                why = G.keep_in_cache(self.cache, blob.name, base64.b64decode(blob.data or ""))
            except (OSError, ValueError) as exc:
                why = "%s: %s" % (type(exc).__name__, exc)
            if why is None:
                trust.learn(blob.name)
            else:
                failed.append("%s: %s" % (blob.name, why))
        trust.save()
        self.send(P.PutReply(id=req.id, failed=failed))

    async def op_fetch(self, req):
        """The bytes of small result files, in the order asked, ``limit`` + 1 bytes at most."""
        jobdir = os.path.normpath(req.dir)
        if not self.inside_root(os.path.dirname(jobdir)):
            raise ValueError("job directory outside the work root")
        left = req.limit + 1
        blobs = []
        for rel in req.paths:
            if left <= 0:
                break
            if rel.startswith("/") or "\0" in rel or ".." in rel.split("/"):
                blobs.append(P.Blob(name=rel, error="not a path inside the job folder"))
                continue
            data, error = G.read_regular(os.path.join(jobdir, rel), left)
            if data is not None:
                left -= len(data)
                data = base64.b64encode(data).decode()
            blobs.append(P.Blob(name=rel, data=data, error=error))
        self.send(P.Fetched(id=req.id, files=blobs))


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


async def start_unix_server(agent, name):
    """Listen on ``name`` in the current folder (our private agents folder: no path length
    limit to work around, nobody else can reach or replace it); only our own uid may talk."""
    async def on_client(reader, writer):
        sock = writer.get_extra_info("socket")
        try:
            if sock is not None and G.peer_uid(sock) == os.getuid():
                await agent.attach(reader, writer)
        finally:
            try:
                writer.close()
            except Exception:
                pass

    if os.path.lexists(name):
        os.unlink(name)  # a dead agent's socket (connecting to it failed)
    old_umask = os.umask(0o077)
    try:
        return await asyncio.start_unix_server(on_client, path=name, limit=1 << 26)
    finally:
        os.umask(old_umask)


def relay(name):
    """If an agent for this token is alive, become a pipe between it and our channel.

    Returns False (nothing done) when no agent answers on the socket ``name`` (in the current
    folder).  Raises Refused when the process answering is not ours.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        return False
    uid = G.peer_uid(sock)
    if uid != os.getuid():
        sock.close()
        raise G.Refused("the agent socket %s is held by another user (uid %d)"
                        % (os.path.abspath(name), uid))
    import selectors

    sel = selectors.DefaultSelector()
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    in_fd = stdin.fileno()
    out_fd = sys.stdout.fileno()
    sel.register(in_fd, selectors.EVENT_READ, "in")
    sel.register(sock, selectors.EVENT_READ, "sock")
    while True:
        for key, _ in sel.select():
            if key.data == "in":
                data = os.read(in_fd, 1 << 16)
                if not data:
                    return True  # closing the socket detaches us from the agent
                sock.sendall(data)
            else:
                data = sock.recv(1 << 16)
                if not data:
                    return True
                view = memoryview(data)
                while view:
                    view = view[os.write(out_fd, view):]


def main(root="~/.ssh_scheduler", token=""):
    root_abs = os.path.abspath(os.path.expanduser(root))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the session that started us
    try:
        if token and not G.TOKEN.match(token):
            raise G.Refused("batch token %r is not a plain name" % token[:80])
        try:
            G.private_root(root_abs, (CACHE_DIR, JOBS_DIR, AGENTS_DIR))
        except OSError as exc:  # a read-only home, a workdir nobody may create: say which and the fix
            where = "" if exc.filename in (None, root_abs) else " (at %s)" % exc.filename
            shown = root if root == root_abs else "%s (%s)" % (root, root_abs)
            raise G.Refused("cannot create the work root %s: %s%s; fix: set workdir: in the machine "
                            "YAML to a folder this user can write" % (shown, exc.strerror, where)) from None
        if "CODE" in globals():  # shipped by transport.agent_bootstrap
            G.keep_code(root_abs, *CODE)  # noqa: F821
        # The socket is named relative to its folder: no path length limit to work around.
        os.chdir(os.path.join(root_abs, AGENTS_DIR))
        name = token + ".sock" if token else None
        if name and relay(name):
            return
    except (G.Refused, OSError) as exc:
        # One plain line: the coordinator shows it as the reason the host is unusable.
        sys.stdout.write("ssh_scheduler agent refused to start: %s\n" % exc)
        sys.stdout.flush()
        sys.exit(2)
    agent = Agent(root_abs, token)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    IO.use_pidfd_watcher(loop)
    try:
        loop.run_until_complete(agent.serve(name))
    finally:
        loop.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
