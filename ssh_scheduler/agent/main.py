"""The host agent: a small stdlib-only program the coordinator runs on each host over ONE channel.

Nothing is installed on the host: the coordinator starts a small first stage (boot.py) on the
``python3 -c`` command line, sends this module and the rest of the agent on its stdin, and the
first stage runs :func:`main`.  The coordinator and the agent then speak newline-delimited JSON
over the channel's stdin/stdout (protocol.py).

Why an agent instead of one SSH channel per job: a channel costs sshd a fork and a login shell,
counts against ``MaxSessions`` and dies with the connection.  The agent costs one fork per job,
starts each job in its own session/process group, and keeps each job's output and exit status on
the host as well as streaming them back (jobs.py); it keeps inputs in a content-addressed cache
and lists and sends back what jobs leave (files.py); on a Slurm login node it asks Slurm where
our jobs stand (slurm.py).

Leases and reattachment (the model is HTCondor's job lease): the agent outlives its channel.
When the coordinator goes quiet (its process killed, its connection cut) the jobs keep running
for ``lease`` seconds.  A coordinator that comes back starts the agent again with the same batch
token; finding this agent's unix socket, the new process turns into a byte relay and the
coordinator talks to the old agent again, which lists its jobs so they can be resumed (relay.py).
If nobody comes back within the lease, the agent kills every job it started and exits: no
orphans.

This file must run on the remote python3 (3.8 or newer), so: stdlib only, no 3.9+ syntax, and no
imports from the rest of the package but the agent's own modules.

Each request ``X`` with tag ``x`` is served by the method ``op_x`` (here, or in the parts mixed
into :class:`Agent`).
"""

import asyncio
import os
import signal
import sys
import threading
import time

from ssh_scheduler.agent import boot, slurm
from ssh_scheduler.agent import hostguard as G
from ssh_scheduler.agent import plumbing as IO
from ssh_scheduler.agent import protocol as P
from ssh_scheduler.agent.files import FileOperations
from ssh_scheduler.agent.jobs import JobSupervision
from ssh_scheduler.agent.relay import relay, start_unix_server
from ssh_scheduler.agent.wire import ProtocolError, decode_request

SLURM_COMMAND_TIMEOUT = 60.0  # seconds one squeue, scontrol or sacct may take
REFUSED = "ssh_scheduler agent refused to start: "  # as boot.py says it (session.AGENT_REFUSED)


class Agent(JobSupervision, FileOperations):
    """One host's agent: its jobs, its files, and the coordinator it answers now.

    ``work``: the work root as the first stage opened it (G.WorkRoot); without it (tests,
    debugging) the agent opens ``root`` the same way."""

    def __init__(self, root, token, work=None):
        self.use_work(work if work is not None else G.WorkRoot.open(root))
        self.token = token or ("t%d" % os.getpid())
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
        # The one shell rule (execute_to's watchdog, watchdog.sh, follows it too): bash, without
        # ~/.bashrc (which Debian's bash reads when it sees SSH_CLIENT, printing into every job's
        # output); /bin/sh only where bash is missing.  Environment comes from env:/setup:.
        self.shell = ["/bin/bash", "--norc"] if os.path.exists("/bin/bash") else ["/bin/sh"]
        self.subreaper = None  # prctl's answer, asked at the first job (see hostguard)
        self.children = set()  # pids of our own children besides job shells (probes)
        self.warm = {}  # (start, env) -> warm.WarmPython: the interpreters calls are forked from
        # Children being started: their pid is not known to us until the spawn returns, and a
        # fast one may already be a zombie then; asyncio must reap it, never the sweep (it would
        # then report 255 for the job), so the sweep leaves unknown zombies alone meanwhile.
        self.spawning = 0
        self.sweep_handle = None
        self.zombies = []
        self.trust = None  # which cache entries hashed true (G.CacheTrust), at the first "have"
        self.putting = 0  # puts being kept now (files.py: the record is saved after the last)
        self.server = None  # the reattachment socket's server, once the agent has a token
        self.sock_name = None

    # -- plumbing ---------------------------------------------------------------------------------
    def send(self, message):
        client = self.client
        if client is None:
            return
        data = message.encode()
        if len(data) > P.MAX_LINE:  # the coordinator would take the host for lost: say why instead
            data = P.too_long(message, len(data)).encode()
        try:
            client.write(data)
        except Exception:
            self.client = None

    def inside_root(self, path):
        """Is ``path`` (as the coordinator names it) below the work root?  Only a check of the
        name: what it names is opened below the root's descriptor (rooted.py)."""
        real = os.path.normpath(path)
        return real == self.root or real.startswith(self.root + os.sep)

    def below_root(self, path):
        """``path`` (below the root, as the coordinator names it) relative to the root; raises
        ValueError for any other path."""
        if not isinstance(path, str) or not path.startswith(self.root + "/"):
            raise ValueError("%r is outside the work root" % (path,))
        return path[len(self.root) + 1:]

    async def serve(self, sock_path):
        loop = asyncio.get_event_loop()
        if sock_path:
            await self.listen(sock_path)
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
        threading.Thread(target=self.keep_lease, daemon=True).start()
        self.done = loop.create_future()
        await self.attach(reader, writer)
        if not self.closing and self.jobs:
            await self.done  # detached: wait for a coordinator to come back, or the lease
        await self.wait_jobs()
        if self.tasks:  # requests that came before "bye" (a last remove, say) still run,
            await asyncio.wait(list(self.tasks), timeout=2.0)  # but a hung probe cannot hold us
        await self.end_warm()
        self.end_all()
        if self.server is not None:
            self.server.close()
            try:
                os.unlink(self.sock_name)
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
                req = decode_request(line)
            except ProtocolError as exc:
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

    def keep_lease(self):
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

    def use_work(self, work):
        self.work = work
        # Where the root really is: every path the coordinator names lies below it, and each
        # is opened below the verified descriptors (files.py, rooted.py), never as a path.
        self.root = work.path
        self.cache = os.path.join(self.root, G.CACHE_DIR)

    async def renew_work(self):
        """A kept agent (between two commands: nothing of a batch's runs) whose work root was
        removed or moved meanwhile opens it afresh, made as a fresh agent makes it: otherwise
        its inputs went into folders nobody sees (the coordinator's file transfers name the
        root's path) and each job failed for it.  An agent with running jobs or a batch's
        socket keeps what it has: they live there."""
        if self.server is not None or self.spawning or any(j.running for j in self.jobs.values()):
            return
        if not self.work.moved():
            return
        await self.end_warm()  # forked from folders that are gone
        work = G.WorkRoot.open(self.work.shown)
        os.fchdir(work.agents)  # where a batch's socket is named (listen)
        # The old descriptors stay open (four, once): a thread of the last command may still
        # hold one, and a number closed under it could name a new file by the time it writes.
        self.use_work(work)
        self.jobs, self.staged, self.warm, self.trust = {}, {}, {}, None

    # -- requests ---------------------------------------------------------------------------------
    async def op_hello(self, req):
        await self.renew_work()  # each command's session starts with a hello
        self.lease = req.lease
        if req.probe is not None:  # answered under its own id, exactly like a Probe request
            self.keep(asyncio.ensure_future(self.guard(self.op_probe, req.probe)))
        jobs = dict((j.name, P.JobState(running=j.running, code=j.code)) for j in self.jobs.values())
        self.send(P.HelloReply(id=req.id, pid=os.getpid(), root=self.work.shown, real=self.root,
                               python=sys.version.split()[0], jobs=jobs,
                               probing=req.probe is not None))

    async def op_ping(self, req):
        pass

    async def listen(self, name):
        """The batch's reattachment socket (relay.py), removed when we end (serve)."""
        self.server = await start_unix_server(self, name)
        self.sock_name = name

    async def op_adopt(self, req):
        """Take batch ``req.token`` as ours, as main() does for an agent started with it."""
        await self.renew_work()  # a spare kept since the last batch: its root may be gone
        name = req.token + ".sock"
        if not G.TOKEN.match(req.token):
            why = "batch token %r is not a plain name" % req.token[:80]
        elif self.server is not None or self.jobs:
            why = "this agent already serves a batch, or holds jobs"
        elif os.path.lexists(name):
            # Its agent may run (connecting to ask would take it from its coordinator): a
            # fresh start with the token relays to it, or replaces a dead one's socket.
            why = "the socket of this batch's agent exists"
        else:
            why = None
            self.token = req.token
            await self.listen(name)
            self.kill_orphans()  # what a killed agent of the token left, as a fresh start does
        self.send(P.AdoptReply(id=req.id, ok=why is None, why=why or ""))

    def op_bye(self, req):
        """Orderly end (called in line: nothing after it on this connection is read)."""
        self.closing = True
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    async def op_probe(self, req):
        # Alone (P.Probe): no job of ours ran from the probe's start to its end, so none of
        # the processes it lists is ours.  A job that started meanwhile (it is in the reply's
        # own usage) has the probe taken again the usual way.
        alone = bool(req.alone) and not self.running_jobs()
        out, rc = await self.probe_once(req.cmd, req.alone if alone else "")
        own = self.own_usage()
        if alone and own:
            out, rc = await self.probe_once(req.cmd, "")
            own = self.own_usage()
        self.send(P.ProbeReply(id=req.id, out=out.decode("utf-8", "replace"), rc=rc, own=own))

    async def probe_once(self, cmd, mode):
        """Run the probe script with ``mode`` as its first argument: (stdout, exit status)."""
        self.spawning += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", cmd, "sh", mode, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
            self.children.add(proc.pid)
        finally:
            self.spawning -= 1
        try:
            out, _ = await proc.communicate()
        finally:
            self.children.discard(proc.pid)
        return out, proc.returncode

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

    async def op_slurm(self, req):
        """Where our Slurm jobs stand (slurm.py); their output is read in a thread, after."""
        reply = await slurm.query(req, self.run_command)
        loop = asyncio.get_event_loop()
        reply.data, reply.more = await loop.run_in_executor(None, slurm.new_output, req, self.below_root,
                                                            self.work.fd)
        self.send(reply)

    async def run_command(self, argv, timeout=SLURM_COMMAND_TIMEOUT):
        """Run one of our own commands (argv, no job): (exit status, stdout then stderr); 127
        and why when it cannot start or does not end within ``timeout`` (it is killed then)."""
        self.spawning += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            self.children.add(proc.pid)
        except OSError as exc:
            return 127, "%s: %s" % (argv[0], exc)
        finally:
            self.spawning -= 1
        # asyncio.wait, not wait_for: wait_for (up to Python 3.11) can swallow this task's
        # cancellation when it comes as the output does.
        reading = asyncio.ensure_future(proc.communicate())
        try:
            done, _ = await asyncio.wait({reading}, timeout=timeout)
            if not done:
                reading.cancel()
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
                await proc.wait()
                return 127, "%s: no answer within %g s" % (argv[0], timeout)
        except asyncio.CancelledError:
            reading.cancel()
            raise
        finally:
            self.children.discard(proc.pid)
        out, err = reading.result()
        return proc.returncode, (out + err).decode("utf-8", "replace")


def main(root="~/.ssh_scheduler", token="", code=None, opened=None):
    """Serve the coordinator on stdin/stdout.  ``code``: (file name, code objects) of the agent
    as the first stage compiled or loaded them, kept in the work root for the next start;
    ``opened``: the work root as the first stage opened it (boot.open_root)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the session that started us
    try:
        if token and not G.TOKEN.match(token):
            raise boot.Refused("batch token %r is not a plain name" % token[:80])
        shown = os.path.abspath(os.path.expanduser(root))
        work = G.WorkRoot(opened, shown) if opened is not None else G.WorkRoot.open(root)
        if code is not None:  # started by boot.py, which compiled (or loaded) it
            G.keep_code(work.fd, *code)
        # The socket is named relative to its folder (no path length limit to work around),
        # and that folder is the verified descriptor, not a path.
        os.fchdir(work.agents)
        name = token + ".sock" if token else None
        if name and relay(name):
            return
    except (boot.Refused, OSError) as exc:
        # One plain line: the coordinator shows it as the reason the host is unusable.
        sys.stdout.write("%s%s\n" % (REFUSED, exc))
        sys.stdout.flush()
        sys.exit(2)
    agent = Agent(root, token, work)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    IO.use_pidfd_watcher(loop)
    try:
        loop.run_until_complete(agent.serve(name))
    finally:
        loop.close()
    leave()


def leave():
    """The agent's end, without the interpreter's own: tearing down its modules and objects one
    by one cost ~15 ms of CPU on every host at every batch's end, inside the batch's time (the
    coordinator waits for the channel to close).  What that end would do that matters is done
    first: the threads that are no daemons (a put's, in the loop's executor) are waited for, as
    at any exit, and the standard streams flushed."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
