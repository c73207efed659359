"""The host agent: a small stdlib-only program the coordinator runs on each host over ONE channel.

It is sent as source on the command line (``python3 -c``), so nothing is installed on the host.
The coordinator and the agent speak newline-delimited JSON over the channel's stdin/stdout.

Why an agent instead of one SSH channel per job: a channel costs sshd a fork and a login shell,
counts against ``MaxSessions`` and dies with the connection.  The agent costs one fork per job,
starts each job in its own session/process group, tags it (``SSH_SCHEDULER_TAG`` in its
environment) so that even descendants that escape the group can be found and killed, and keeps
each job's output and exit status on the host as well as streaming them back.

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
import sys
import threading
import time

if "ssh_scheduler_protocol" in sys.modules:  # shipped with us (transport.agent_bootstrap)
    P = sys.modules["ssh_scheduler_protocol"]
else:  # imported from the package (tests)
    from ssh_scheduler import protocol as P

CACHE_DIR = "cache"
JOBS_DIR = "jobs"
TAG_VAR = "SSH_SCHEDULER_TAG"


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
        self.reap_tags = set()
        self.reap_handle = None
        self.closing = False
        self.idle = None
        self.tasks = set()
        self.shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        for sub in (self.cache, os.path.join(self.root, JOBS_DIR)):
            os.makedirs(sub, mode=0o700, exist_ok=True)

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
            threading.Thread(target=feed_from_file, args=(loop, reader), daemon=True).start()
        try:
            transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, sys.stdout
            )
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        except ValueError:
            writer = BlockingWriter(sys.stdout.fileno())
        # A thread, not a task: it must fire even if the event loop were stuck.
        threading.Thread(target=self.watchdog, daemon=True).start()
        self.done = loop.create_future()
        await self.attach(reader, writer)
        if not self.closing and self.jobs:
            await self.done  # detached: wait for a coordinator to come back, or the lease
        await self.wait_jobs()
        if self.tasks:  # requests that came before "bye" (a last remove, say) still run,
            await asyncio.wait(list(self.tasks), timeout=2.0)  # but a hung probe cannot hold us
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
            task = asyncio.ensure_future(self.guard(handler, req))
            self.tasks.add(task)  # keep a reference until it ends (the loop holds weak ones)
            task.add_done_callback(self.tasks.discard)
        if self.client is writer:
            self.client = None
            for job in self.jobs.values():
                job.subscribed = False

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
    def kill_tree(self, job, sig):
        """Signal the job's process group and every process carrying its tag (descendants that
        called setsid or double-forked out of the group)."""
        if job.pid is not None:
            try:
                os.killpg(job.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in tagged_pids(job.tag, job.pid or 0):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill_orphans(self):
        """Processes tagged with our batch token that no live agent owns (their agent was
        killed): a fresh agent for the token ends them."""
        prefix = self.token + ":"
        for pid, tag in tagged_processes():
            if tag.startswith(prefix):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def reap_later(self, tag):
        """Kill what is left of ended jobs, scanning /proc once for all jobs that ended within
        the same few milliseconds (one scan per job end would cost O(jobs x processes))."""
        self.reap_tags.add(tag)
        if self.reap_handle is None:
            self.reap_handle = asyncio.get_event_loop().call_later(0.05, self.reap)

    def reap(self):
        self.reap_handle = None
        tags, self.reap_tags = self.reap_tags, set()
        for pid, tag in tagged_processes():
            if tag in tags:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

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
        jobs = dict((j.name, P.JobState(running=j.running, code=j.code)) for j in self.jobs.values())
        self.send(P.HelloReply(id=req.id, pid=os.getpid(), root=self.root,
                               python=sys.version.split()[0], jobs=jobs))

    async def op_ping(self, req):
        pass

    def op_bye(self, req):
        """Orderly end (called in line: nothing after it on this connection is read)."""
        self.closing = True
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    async def op_probe(self, req):
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", req.cmd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await proc.communicate()
        self.send(P.ProbeReply(id=req.id, out=out.decode("utf-8", "replace"),
                               rc=proc.returncode, own=self.own_usage()))

    def own_usage(self):
        """PIDs and resident memory of every process of each running job (found by its tag)."""
        by_tag = dict((j.tag, j.name) for j in self.running_jobs())
        usage = dict((name, P.JobUsage()) for name in by_tag.values())
        if not by_tag:
            return usage
        page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
        for pid, tag in tagged_processes():
            name = by_tag.get(tag)
            if name is None:
                continue
            usage[name].pids.append(pid)
            try:
                with open("/proc/%d/statm" % pid) as f:
                    usage[name].rss_mb += int(f.read().split()[1]) * page_kb // 1024
            except (OSError, IndexError, ValueError):
                pass
        return usage

    async def op_have(self, req):
        missing = []
        sizes = req.sizes
        for key in req.hashes:
            path = os.path.join(self.cache, key)
            try:
                st = os.lstat(path)
            except OSError:
                missing.append(key)
                continue
            if not stat.S_ISREG(st.st_mode) or (key in sizes and st.st_size != sizes[key]):
                os.unlink(path)
                missing.append(key)
        self.send(P.HaveReply(id=req.id, missing=missing))

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
        job.ended = asyncio.get_event_loop().create_future()
        self.jobs[name] = job
        if req.stage is not None:
            try:
                self.stage(req.cwd, req.stage.files, req.stage.dirs)
            except Exception as exc:
                job.code = -1
                self.send(P.Exit(job=name, message="staging failed: %s: %s" % (type(exc).__name__, exc)))
                return
        env = dict(os.environ)
        env.update(req.env)
        env[TAG_VAR] = job.tag
        loop = asyncio.get_event_loop()
        protocol = JobProtocol(self, job, loop)
        try:
            transport, _ = await loop.subprocess_exec(
                lambda: protocol, self.shell, "-c", req.cmd, cwd=req.cwd, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            protocol.close_files()
            job.code = 127
            self.send(P.Exit(job=name, code=127, message=str(exc)))
            return
        job.transport = transport
        job.pid = transport.get_pid()
        self.send(P.Started(job=name, pid=job.pid))
        await protocol.exited
        # The shell is gone, but a background grandchild may live on (and hold the pipes open):
        # end its group now, then drain what it wrote before reporting the exit.  Descendants
        # that left the group are found by their tag in one coalesced /proc scan (see reap).
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.reap_later(job.tag)
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

    def send_exit(self, job):
        entries = None
        if job.listing and job.jobdir:
            entries = P.encode_listing(self.list_results(job.jobdir, job.listing_paths))
        self.send(P.Exit(job=job.name, code=job.code, entries=entries))

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
            for rel, st in walk(start, jobdir):
                if rel in seen:
                    continue
                seen.add(rel)
                kind = kind_of(st.st_mode)
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

    def pipe_data_received(self, fd, data):
        copy = self.files.get(fd)
        if copy is None and self.paths.get(fd):
            copy = self.files[fd] = open(self.paths[fd], "ab")
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


class BlockingWriter(object):
    def __init__(self, fd):
        self.fd = fd

    def write(self, data):
        while data:
            data = data[os.write(self.fd, data):]


def feed_from_file(loop, reader):
    for line in iter(sys.stdin.buffer.readline, b""):
        loop.call_soon_threadsafe(reader.feed_data, line)
    loop.call_soon_threadsafe(reader.feed_eof)


async def start_unix_server(agent, path):
    async def on_client(reader, writer):
        await agent.attach(reader, writer)
        try:
            writer.close()
        except Exception:
            pass

    if os.path.exists(path):
        os.unlink(path)  # a dead agent's socket (connecting to it failed)
    old_umask = os.umask(0o077)
    try:
        return await asyncio.start_unix_server(on_client, path=path, limit=1 << 26)
    finally:
        os.umask(old_umask)


def tagged_processes(after=0):
    """(pid, tag) of every process we may read whose environment carries our tag.

    ``after``: only pids above it (a job's descendants were born after it; skipping the rest
    keeps this cheap on the hot path of every job's end).
    """
    needle = (TAG_VAR + "=").encode()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == me or pid <= after:
            continue
        try:
            with open("/proc/%s/environ" % entry, "rb") as f:
                data = f.read()
        except OSError:
            continue
        start = data.find(needle)
        if start < 0 or (start > 0 and data[start - 1:start] != b"\0"):
            continue
        end = data.find(b"\0", start)
        value = data[start + len(needle):end if end >= 0 else len(data)]
        yield int(entry), value.decode("utf-8", "replace")


def tagged_pids(tag, after=0):
    # Pids wrap around; when the job's pid is near the top, scan everything.
    after = after if after < 4000000 - 100000 else 0
    return [pid for pid, value in tagged_processes(after) if value == tag]


def kind_of(mode):
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "special"


def walk(start, base):
    """Yield (relative path, lstat) below ``start`` without following symlinks."""
    try:
        st = os.lstat(start)
    except OSError:
        return
    rel = os.path.relpath(start, base)
    if rel != ".":
        yield rel, st
    if not stat.S_ISDIR(st.st_mode):
        return
    stack = [start]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as it:
                for entry in it:
                    try:
                        est = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    yield os.path.relpath(entry.path, base), est
                    if stat.S_ISDIR(est.st_mode):
                        stack.append(entry.path)
        except OSError:
            continue


def socket_path(root, token):
    path = os.path.join(root, "agents", token + ".sock")
    if len(path.encode()) < 100:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        return path
    short = "/tmp/ssh_scheduler-%d" % os.getuid()  # unix socket paths are short
    os.makedirs(short, mode=0o700, exist_ok=True)
    return os.path.join(short, token + ".sock")


def relay(path):
    """If an agent for this token is alive, become a pipe between it and our channel.

    Returns False (nothing done) when no agent answers on the socket.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return False
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


def use_pidfd_watcher(loop):
    """Before 3.12 asyncio waits for each child in a thread of its own; a pidfd watcher costs
    no thread per job (3.12+ picks it by itself)."""
    if sys.version_info >= (3, 12) or not hasattr(asyncio, "PidfdChildWatcher"):
        return
    try:
        watcher = asyncio.PidfdChildWatcher()
        asyncio.get_event_loop_policy().set_child_watcher(watcher)
        watcher.attach_loop(loop)
        os.close(os.pidfd_open(os.getpid()))  # the kernel must support pidfds
    except (AttributeError, OSError, RuntimeError):
        asyncio.get_event_loop_policy().set_child_watcher(asyncio.ThreadedChildWatcher())


def main(root="~/.ssh_scheduler", token=""):
    root_abs = os.path.abspath(os.path.expanduser(root))
    os.makedirs(root_abs, mode=0o700, exist_ok=True)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the session that started us
    path = socket_path(root_abs, token) if token else None
    if path and relay(path):
        return
    agent = Agent(root_abs, token)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    use_pidfd_watcher(loop)
    try:
        loop.run_until_complete(agent.serve(path))
    finally:
        loop.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
