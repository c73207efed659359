"""The host agent: a small stdlib-only program the coordinator runs on each host over ONE channel.

It is sent as source on the command line (``python3 -c``), so nothing is installed on the host.
The coordinator and the agent speak newline-delimited JSON over the channel's stdin/stdout.

Why an agent instead of one SSH channel per job: a channel costs sshd a fork and a login shell,
counts against ``MaxSessions`` and dies with the connection.  The agent costs one fork per job,
starts each job in its own session/process group (so the whole tree can be killed), writes the
job's output to files on the host as well as streaming it back, and keeps a *lease*: when the
coordinator stops talking (connection cut, coordinator killed) for longer than the lease, the
agent kills every job it started, so no orphan keeps burning a GPU.

This file must run on the remote python3 (3.8 or newer), so: stdlib only, no 3.9+ syntax, and no
imports from the rest of the package.

Requests (coordinator -> agent), one JSON object per line, all with an ``op``:
  hello {lease}                          -> hello {pid, root, python}
  ping                                   -> (renews the lease; no answer)
  probe {id, cmd}                        -> probe {id, out, rc, own: {job: {pids, rss_mb}}}
  have {id, hashes: [h...], sizes}       -> have {id, missing: [h...]}
  stage {id, dir, files: [[rel, key]]}   -> staged {id} | error {id, message}
  run {job, cmd, cwd, env, out, err}     -> started {job, pid} ; out {job, fd, data(b64)} ... ;
                                            exit {job, code}
  kill {job, grace}                      -> (the job's exit event follows)
  manifest {id, dir, job, paths|null}    -> manifest {id, entries: [[rel, kind, size, mode, link]]}
  remove {id, dir}                       -> removed {id}
  bye                                    -> kills nothing, exits once jobs are done (orderly end)
"""

import asyncio
import base64
import json
import os
import shutil
import signal
import stat
import sys
import threading
import time

CACHE_DIR = "cache"
JOBS_DIR = "jobs"


class Agent:
    def __init__(self, root):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.cache = os.path.join(self.root, CACHE_DIR)
        self.jobs = {}  # job name -> asyncio.subprocess.Process
        self.staged = {}  # job dir -> {rel: (ino, mtime_ns, size)}
        self.lease = 60.0
        self.last_heard = time.monotonic()
        self.out = None  # asyncio.StreamWriter-like with write()
        self.closing = False
        self.idle = None  # a future resolved when the last job ends, while saying goodbye
        self.tasks = set()
        self.shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        for sub in (self.cache, os.path.join(self.root, JOBS_DIR)):
            os.makedirs(sub, mode=0o700, exist_ok=True)

    # -- plumbing ---------------------------------------------------------------------------------
    def send(self, obj):
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        try:
            self.out.write(data)
        except Exception:
            pass

    def inside_root(self, path):
        real = os.path.realpath(path)
        return real == self.root or real.startswith(self.root + os.sep)

    async def serve(self):
        loop = asyncio.get_event_loop()
        reader = asyncio.StreamReader(limit=1 << 26)
        try:
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        except ValueError:  # stdin is a plain file (tests, debugging): read it in a thread
            threading.Thread(target=feed_from_file, args=(loop, reader), daemon=True).start()
        try:
            transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, sys.stdout
            )
            self.out = asyncio.StreamWriter(transport, protocol, reader, loop)
        except ValueError:
            self.out = BlockingWriter(sys.stdout.fileno())
        # A thread, not a task: it must fire even if the event loop were stuck on a write.
        threading.Thread(target=self.watchdog, daemon=True).start()
        while True:
            line = await reader.readline()
            if not line:
                break  # the coordinator (or its connection) is gone
            self.last_heard = time.monotonic()
            try:
                req = json.loads(line)
            except ValueError:
                continue
            op = req.get("op")
            if op == "bye":
                self.closing = True
                break
            handler = getattr(self, "op_" + str(op), None)
            if handler is None:
                self.send({"ev": "error", "id": req.get("id"), "message": "unknown op %r" % op})
                continue
            task = asyncio.ensure_future(self.guard(handler, req))
            self.tasks.add(task)  # keep a reference until it ends (the loop holds only weak ones)
            task.add_done_callback(self.tasks.discard)
        if self.closing:
            await self.wait_jobs()
        else:
            await self.kill_all(grace=min(self.lease, 5.0))

    async def guard(self, handler, req):
        try:
            await handler(req)
        except Exception as exc:  # report, never die: one bad request must not kill other jobs
            self.send({"ev": "error", "id": req.get("id"), "job": req.get("job"),
                       "message": "%s: %s" % (type(exc).__name__, exc)})

    def watchdog(self):
        # A cut network never delivers EOF; the lease is what frees the host then.
        while True:
            time.sleep(max(0.2, min(1.0, self.lease / 4.0)))
            if time.monotonic() - self.last_heard > self.lease:
                procs = list(self.jobs.values())
                for proc in procs:
                    self.signal_group(proc, signal.SIGTERM)
                time.sleep(2.0)
                for proc in procs:
                    self.signal_group(proc, signal.SIGKILL)
                os._exit(3)

    def jobs_changed(self):
        if not self.jobs and self.idle is not None and not self.idle.done():
            self.idle.set_result(None)

    async def wait_jobs(self):
        if self.jobs:
            self.idle = asyncio.get_event_loop().create_future()
            await self.idle

    async def kill_all(self, grace):
        procs = list(self.jobs.values())
        for proc in procs:
            self.signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.returncode is None for p in procs):
            await asyncio.sleep(0.05)
        for proc in procs:
            self.signal_group(proc, signal.SIGKILL)

    @staticmethod
    def signal_group(proc, sig):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # -- requests ---------------------------------------------------------------------------------
    async def op_hello(self, req):
        self.lease = float(req.get("lease", self.lease))
        self.send({"ev": "hello", "id": req.get("id"), "pid": os.getpid(), "root": self.root,
                   "python": sys.version.split()[0]})

    async def op_ping(self, req):
        pass

    async def op_probe(self, req):
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", req["cmd"], stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        out, _ = await proc.communicate()
        self.send({"ev": "probe", "id": req["id"], "out": out.decode("utf-8", "replace"),
                   "rc": proc.returncode, "own": self.own_usage()})

    def own_usage(self):
        """PIDs and resident memory of every process in each of our jobs' sessions."""
        sessions = dict((p.pid, name) for name, p in self.jobs.items())
        usage = dict((name, {"pids": [], "rss_mb": 0}) for name in self.jobs)
        if not sessions:
            return usage
        page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % entry) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                sid = int(fields[3])
                rss_pages = int(fields[21])
            except (OSError, IndexError, ValueError):
                continue
            name = sessions.get(sid)
            if name is not None:
                usage[name]["pids"].append(int(entry))
                usage[name]["rss_mb"] += rss_pages * page_kb // 1024
        return usage

    async def op_have(self, req):
        missing = []
        sizes = req.get("sizes") or {}
        for key in req["hashes"]:
            path = os.path.join(self.cache, key)
            try:
                st = os.lstat(path)
            except OSError:
                missing.append(key)
                continue
            if not stat.S_ISREG(st.st_mode) or (key in sizes and st.st_size != sizes[key]):
                os.unlink(path)
                missing.append(key)
        self.send({"ev": "have", "id": req["id"], "missing": missing})

    async def op_stage(self, req):
        """Give a job its private directory, its inputs hard-linked from the cache.

        Cache files are read-only, so a job that rewrites an input in place gets EACCES (as a
        non-root user) rather than silently corrupting the copy every later job links to; the
        manifest check below catches the root case and evicts the entry.
        """
        jobdir = req["dir"]
        if not self.inside_root(os.path.dirname(jobdir)):
            raise ValueError("job directory outside the work root")
        os.makedirs(jobdir, mode=0o700, exist_ok=True)
        record = {}
        for rel, key in req["files"]:
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
        for rel in req.get("dirs", ()):
            os.makedirs(os.path.join(jobdir, rel), exist_ok=True)
        self.staged[jobdir] = record
        self.send({"ev": "staged", "id": req["id"]})

    async def op_run(self, req):
        name = req["job"]
        env = dict(os.environ)
        env.update(req.get("env") or {})
        loop = asyncio.get_event_loop()
        protocol = JobProtocol(self, name, req.get("out"), req.get("err"), loop)
        try:
            transport, _ = await loop.subprocess_exec(
                lambda: protocol, self.shell, "-c", req["cmd"], cwd=req["cwd"], env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            protocol.close_files()
            self.send({"ev": "exit", "job": name, "code": 127, "message": str(exc)})
            return
        proc = JobHandle(transport)
        self.jobs[name] = proc
        self.send({"ev": "started", "job": name, "pid": proc.pid})
        await protocol.exited
        # The shell is gone, but a background grandchild may live on in its group (and hold the
        # pipes open): end it too, then drain what it wrote before reporting the exit.
        self.signal_group(proc, signal.SIGKILL)
        try:
            await asyncio.wait_for(asyncio.shield(protocol.drained), 2.0)
        except TimeoutError:
            pass  # something left the group (setsid) holding our pipe: don't wait for it
        protocol.close_files()
        code = transport.get_returncode()
        transport.close()
        self.jobs.pop(name, None)
        self.jobs_changed()
        if code is None:
            code = 255
        elif code < 0:
            code = 128 - code
        self.send({"ev": "exit", "job": name, "code": code})

    async def op_kill(self, req):
        proc = self.jobs.get(req["job"])
        if proc is None:
            return
        self.signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + float(req.get("grace", 5.0))
        while proc.returncode is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.signal_group(proc, signal.SIGKILL)

    async def op_manifest(self, req):
        """List what to bring home from a job directory, never following a link.

        Without explicit paths: everything the job created or changed, i.e. not the untouched
        hard links to staged inputs.
        """
        jobdir = req["dir"]
        staged = self.staged.get(jobdir, {})
        explicit = req.get("paths")
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
                entries.append([rel, kind, st.st_size, stat.S_IMODE(st.st_mode), link])
        self.send({"ev": "manifest", "id": req["id"], "entries": entries})

    async def op_remove(self, req):
        path = req["dir"]
        if self.inside_root(os.path.dirname(path)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        self.staged.pop(path, None)
        self.send({"ev": "removed", "id": req["id"]})


class JobHandle:
    """What the kill paths need of a running job: its pid (= its process group and session)."""

    def __init__(self, transport):
        self.transport = transport
        self.pid = transport.get_pid()

    @property
    def returncode(self):
        return self.transport.get_returncode()


class JobProtocol(asyncio.SubprocessProtocol):
    """Output of one job: to files on the host and, live, to the coordinator.

    ``process_exited`` fires when the shell exits, even if a grandchild still holds the pipes,
    which is why this is a protocol rather than ``Process.wait()``.
    """

    def __init__(self, agent, name, out_path, err_path, loop):
        self.agent = agent
        self.name = name
        self.files = {1: open(out_path, "ab") if out_path else None,
                      2: open(err_path, "ab") if err_path else None}
        self.exited = loop.create_future()
        self.drained = loop.create_future()
        self.open_pipes = set([1, 2])

    def pipe_data_received(self, fd, data):
        copy = self.files.get(fd)
        if copy is not None:
            copy.write(data)
            copy.flush()
        self.agent.send({"ev": "out", "job": self.name, "fd": fd,
                         "data": base64.b64encode(data).decode()})

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


class BlockingWriter:
    def __init__(self, fd):
        self.fd = fd

    def write(self, data):
        while data:
            data = data[os.write(self.fd, data):]

    async def drain(self):
        pass


def feed_from_file(loop, reader):
    for line in iter(sys.stdin.buffer.readline, b""):
        loop.call_soon_threadsafe(reader.feed_data, line)
    loop.call_soon_threadsafe(reader.feed_eof)


def main(root="~/.ssh_scheduler"):
    agent = Agent(root)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(agent.serve())
    finally:
        loop.close()


if __name__ == "__main__":
    main(*sys.argv[1:2])
