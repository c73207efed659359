"""Warm interpreters: Python calls forked from a Python kept loaded, instead of a Python started
for each call.

A part of the agent (main.py, jobs.py).  A Python's own start is most of a trivial call's cost
(tens of ms of CPU, where the agent's part of a job is about one), so for a job whose run
request carries a :class:`~ssh_scheduler.agent.protocol.Warm`, the agent starts that
interpreter once (``call_runner.py --serve``, by the job's shell rule, in the job's folder, with
the machine's environment) and then has it fork each call (agent/call_warm.py: ``serve``).
The forked call gets the job's stdout and stderr pipes and its folder as descriptors, sent over a
SOCK_SEQPACKET socket pair (no path anyone else could connect to), and the job's whole
environment; it calls ``setsid`` as a job's shell would be started, so killing a job, its
process tree and its leftovers work as for any job.  The job's process is the forked call:
:class:`ForkedProcess` stands for asyncio's subprocess transport in jobs.py, its exit status
reported by the interpreter that reaps it.

Nothing here is needed for a job to run: an interpreter that does not start (a Python missing
there, a bad ``python:``), or that ends, marks its kind broken, and those jobs run their own
``cmd`` as before, which says what is wrong in the job's own output.  A call running when its
interpreter ended is now the agent's child (the agent is the jobs' subreaper): its exit status is
waited for here.

Runs on the hosts' python3 (3.8 or newer): stdlib only, no 3.9+ syntax.
"""

import array
import asyncio
import json
import os
import socket

WARM_FD = "SSH_SCHEDULER_WARM_FD"  # where the interpreter finds its socket (as call_runner.py)
CODE_FD = "SSH_SCHEDULER_CODE_FD"  # and the folder of kept module code (call_warm.KeptCode)
READY_WAIT = 30.0  # seconds an interpreter may take to start (a slow NFS home, a big site)
FORK_WAIT = 10.0  # seconds to answer a fork
POLL = 0.05  # seconds between looks at a call whose interpreter ended


class ForkedProcess(object):
    """A call forked by a warm interpreter, as jobs.py uses a subprocess transport."""

    def __init__(self, protocol):
        self.protocol = protocol
        self.pid = None
        self.returncode = None
        self.pipes = []

    def get_pid(self):
        return self.pid

    def get_returncode(self):
        return self.returncode

    def ended(self, code):
        if self.returncode is None:
            self.returncode = code
            self.protocol.process_exited()

    def close(self):
        for pipe in self.pipes:
            pipe.close()


class Watched(asyncio.SubprocessProtocol):
    """The interpreter's own process, as asyncio runs (and reaps) it: its end noted, so the
    agent's end waits for it rather than reaping it under asyncio (which then warns)."""

    def __init__(self):
        self.gone = asyncio.get_event_loop().create_future()

    def process_exited(self):
        if not self.gone.done():
            self.gone.set_result(None)


class _Stream(asyncio.Protocol):
    """One of the call's output pipes, fed to the job's protocol as a subprocess pipe is."""

    def __init__(self, protocol, fd):
        self.protocol = protocol
        self.fd = fd

    def data_received(self, data):
        self.protocol.pipe_data_received(self.fd, data)

    def connection_lost(self, exc):
        self.protocol.pipe_connection_lost(self.fd, exc)


class WarmPython(object):
    """One warm interpreter and the calls it forked."""

    def __init__(self, key):
        self.key = key
        self.sock = None
        self.pid = None
        self.transport = None  # its process's (asyncio's), with its Watched protocol
        self.watched = None
        self.broken = None  # why it cannot serve: its jobs run their own command
        self.started = None  # a future: resolved once it is ready (or broken)
        self.asked = {}  # request number -> (ForkedProcess, future of its pid)
        self.forked = {}  # pid -> ForkedProcess, until its exit
        self.count = 0

    async def start(self, spawn):
        """Start it with ``spawn(protocol, extra_env, fd)`` (jobs.py runs the start text by the
        job shell rule, passing ``fd`` on; returns asyncio's transport); True once it is ready
        to fork."""
        loop = asyncio.get_event_loop()
        if self.started is None:
            self.started = loop.create_future()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.watched = Watched()
                self.transport = await spawn(self.watched, {WARM_FD: str(theirs.fileno())}, theirs.fileno())
                self.pid = self.transport.get_pid()
                ours.setblocking(False)
                self.sock = ours
                loop.add_reader(ours.fileno(), self.readable)
                loop.call_later(READY_WAIT, self.too_slow)
            except Exception as exc:
                ours.close()
                self.fail("it did not start: %s" % exc)
            finally:
                theirs.close()
        await asyncio.shield(self.started)
        return self.broken is None

    def too_slow(self):
        if not self.started.done():
            self.fail("it did not start in %g s" % READY_WAIT)

    async def fork(self, protocol, folder, env, argv):
        """The call forked in ``folder`` (a descriptor) with ``env`` and ``argv``: its
        :class:`ForkedProcess`, or None where the interpreter cannot (the job then runs its own
        command)."""
        loop = asyncio.get_event_loop()
        if self.broken is not None:
            return None
        proc = ForkedProcess(protocol)
        ends = []
        try:
            for fd in (1, 2):
                read_end, write_end = os.pipe()
                ends.append(write_end)
                pipe, _ = await loop.connect_read_pipe(
                    lambda fd=fd: _Stream(protocol, fd), os.fdopen(read_end, "rb", 0))
                proc.pipes.append(pipe)
            if self.sock is None:  # it ended while the pipes were made
                raise ValueError(self.broken)
            self.count += 1
            number = self.count
            answer = loop.create_future()
            self.asked[number] = (proc, answer)
            message = json.dumps({"n": number, "env": env, "argv": argv}).encode()
            fds = array.array("i", [*ends, folder]).tobytes()
            self.sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except (OSError, ValueError) as exc:
            proc.close()
            self.fail("a call could not be handed to it: %s" % exc)
            return None
        finally:
            for fd in ends:
                os.close(fd)
        done, _ = await asyncio.wait({answer}, timeout=FORK_WAIT)  # (see jobs.kill_job)
        error = answer.result() if done else "no answer in %g s" % FORK_WAIT
        if error is not None:
            self.asked.pop(number, None)
            proc.close()
            self.fail("a fork failed: %s" % error)
            return None
        return proc

    def readable(self):
        while self.sock is not None:
            try:
                data = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.fail("its socket failed: %s" % exc)
                return
            if not data:
                self.fail("it ended")
                return
            try:
                self.heard(json.loads(data.decode("utf-8")))
            except (ValueError, KeyError, TypeError) as exc:
                self.fail("it said something unreadable: %s" % exc)
                return

    def heard(self, message):
        if message.get("ready"):
            if not self.started.done():
                self.started.set_result(None)
        elif "exit" in message:
            proc = self.forked.pop(message["exit"], None)
            if proc is not None:
                proc.ended(int(message["code"]))
        else:
            proc, answer = self.asked.pop(message["n"])
            if "pid" in message:
                proc.pid = int(message["pid"])
                self.forked[proc.pid] = proc  # now: its exit may be in the next message
            if not answer.done():
                answer.set_result(None if "pid" in message else str(message.get("error")))

    def fail(self, why):
        """It cannot serve any more: later calls run their own command; calls it forked that
        still run are waited for here (they are the agent's children now)."""
        if self.broken is not None:
            return
        self.broken = why
        if self.sock is not None:
            asyncio.get_event_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.started is not None and not self.started.done():
            self.started.set_result(None)
        for _proc, answer in list(self.asked.values()):
            if not answer.done():
                answer.set_result(why)
        self.asked.clear()
        if self.forked:
            asyncio.get_event_loop().call_later(POLL, self.orphaned)

    def orphaned(self):
        for pid, proc in list(self.forked.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not (yet) ours: gone, or still being re-parented
                if os.path.exists("/proc/%d" % pid):
                    continue
                done, status = pid, None
            if done:
                del self.forked[pid]
                if status is None:
                    proc.ended(255)
                elif os.WIFSIGNALED(status):
                    proc.ended(-os.WTERMSIG(status))
                else:
                    proc.ended(os.WEXITSTATUS(status))
        if self.forked:
            asyncio.get_event_loop().call_later(POLL, self.orphaned)

    async def end(self, wait):
        """The agent ends: the socket closed, the interpreter exits (up to ``wait`` seconds;
        then the agent's end kills what is left)."""
        if self.sock is not None:
            asyncio.get_event_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.watched is not None:
            await asyncio.wait({self.watched.gone}, timeout=wait)
        if self.transport is not None:
            self.transport.close()
