"""The call runner: one Python call of ``ssh_scheduler.Executor``, run on its host.

Not part of the agent's own process: the executors stage this file into the call's job folder
(through the host's content-addressed cache, with cloudpickle's sources beside it) and the job's
shell line runs it with the machine's Python, after the machine's ``setup:`` lines, in the job's
folder and with the job's environment (``CUDA_VISIBLE_DEVICES`` set)::

    <python> -B -u .ssh_scheduler_call/call_runner.py PAYLOAD RESULT INFO

``PAYLOAD`` (written by ``functions/payload.py``) is one JSON header line, then two pickles: the
function, then its ``(args, kwargs)``.  The runner checks that this Python can load them before
it unpickles anything: a function that travels as code (a lambda, a closure, a function of
``__main__``) is bytecode of the Python that pickled it, which another minor version cannot run;
a function that travels by name needs its module here.  Either failure is one line naming both
versions, or the missing module, and the fix, never a pickle traceback.

It leaves ``RESULT``, the pickled return value (or exception), and then ``INFO``, one JSON object
saying what happened (``kind``: ``value``, ``raised`` or ``refused``, this Python, whether the
pickle holds code, the exception's type and the traceback text).  ``INFO`` is written last and
renamed into place, so its presence means the call ended and ``RESULT`` is whole.  Both come
home with the job's other results.  The value is pickled straight into the file: a 50 MB value
is not held twice.  Exit status: 0 value, 1 raised, 3 refused.

Runs on the host's Python (3.8 or newer): stdlib only, plus the cloudpickle it was sent with
(first on ``sys.path``: the same version as the coordinator's, whatever the host has).  It is
imported only when needed (a call that travels as code, a value or exception plain ``pickle``
cannot write): importing it costs more CPU than the rest of a trivial call, once per call
(a warm interpreter loads it once, for all the calls it forks: :func:`preload`).
A function that travels by name, with plain arguments, loads with ``pickle`` alone.
"""

import json
import os
import pickle
import sys
import types

RAISED = 1
REFUSED = 3
LIB = "lib"  # cloudpickle's sources, beside this file


def this_python():
    return "%s (Python %s)" % (sys.executable or "python", sys.version.split()[0])


def write_info(path, info):
    """``INFO`` whole or not at all: written beside it, then renamed into place."""
    info["python"] = list(sys.version_info[:3])
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def refuse(info_path, message):
    """The call cannot load here: one line on stderr and in ``INFO``, exit 3."""
    sys.stderr.write("ssh_scheduler: %s\n" % message)
    write_info(info_path, {"kind": "refused", "message": message})
    sys.exit(REFUSED)


def code_pickler(cloudpickle):
    """cloudpickle's pickler, noting whether what it pickles holds code (bytecode runs only on
    the minor version that made it)."""

    class CodePickler(cloudpickle.Pickler):
        def __init__(self, file):
            cloudpickle.Pickler.__init__(self, file, protocol=5)
            self.holds_code = False

        def reducer_override(self, obj):
            if isinstance(obj, types.CodeType):
                self.holds_code = True
            return cloudpickle.Pickler.reducer_override(self, obj)

    return CodePickler


def set_path(here, header):
    """sys.path as the call's own script had it: the folders of its ``sys.path`` that were in
    the copied-forward folder, here in the job's folder; our cloudpickle first."""
    cwd = os.getcwd()
    if sys.path and os.path.abspath(sys.path[0]) == here:
        del sys.path[0]  # this file's folder: nothing of the user's
    folders = [os.path.normpath(os.path.join(cwd, rel)) for rel in header.get("path") or ["."]]
    sys.path[:0] = [os.path.join(here, LIB)] + folders


def load_call(payload, info_path, header):
    """The function and its arguments, or a refusal naming what this Python lacks."""
    wanted = header.get("python") or [0, 0, 0]
    shown = ".".join(str(n) for n in wanted)
    if header.get("code") and tuple(wanted[:2]) != tuple(sys.version_info[:2]):
        refuse(info_path, (
            "cannot run this call here: %s travels as code (a lambda, a closure or a function of "
            "__main__), pickled by Python %s, and this host's Python is %s, another minor "
            "version, which cannot load it; fix: set python: in the machine's YAML to a Python "
            "%d.%d there, or define the function in a module of the copied-forward folder, so it "
            "travels by name") % (header.get("function", "the function"), shown, this_python(),
            wanted[0], wanted[1]))
    try:  # (a pickle that holds code names cloudpickle's helpers: pickle imports it then)
        function = pickle.load(payload)
        args, kwargs = pickle.load(payload)
    except ModuleNotFoundError as exc:
        refuse(info_path, (
            "cannot load this call here: %s needs the module %r, which %s does not find on this "
            "host; fix: put the module in the copied-forward folder (copy_forwards) or install "
            "it for that Python") % (header.get("function", "the function"), exc.name, this_python()))
    except Exception as exc:
        refuse(info_path, "cannot load this call here with %s (pickled by Python %s): %s: %s" % (
            this_python(), shown, type(exc).__name__, str(exc)[:300]))
    return function, args, kwargs


def dump(value, path):
    """Pickle ``value`` into ``path``; whether the pickle holds code.  Plain ``pickle`` first
    (it writes no code); what only cloudpickle can write (a lambda, a class made at run time)
    is written again by cloudpickle."""
    try:
        with open(path, "wb") as f:
            pickle.Pickler(f, protocol=5).dump(value)
        return False
    except Exception:
        import cloudpickle

        with open(path, "wb") as f:
            pickler = code_pickler(cloudpickle)(f)
            pickler.dump(value)
        return pickler.holds_code


def keep_exception(result_path, info_path, exc):
    """The exception the call raised: pickled when it pickles, its traceback as text (from the
    call down: this runner's own frame is not the user's)."""
    import traceback

    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is main.__code__ and tb.tb_next is not None:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    sys.stderr.write(text)
    info = {
        "kind": "raised", "type": "%s.%s" % (type(exc).__module__, type(exc).__qualname__),
        "message": str(exc)[:2000], "traceback": text[-20000:], "pickled": False,
    }
    try:
        info["code"] = dump(exc, result_path)
        info["pickled"] = True
    except Exception as problem:  # an attribute that does not pickle: the text still goes
        info["unpickled"] = "%s: %s" % (type(problem).__name__, str(problem)[:300])
    write_info(info_path, info)
    sys.exit(RAISED)


def main(argv, here=None, kept=None):
    """The call; ``kept``: a warm call's :class:`KeptCode`, used while the call loads."""
    payload_path, result_path, info_path = argv
    here = here or os.path.dirname(os.path.abspath(__file__))
    with open(payload_path, "rb") as payload:
        try:
            header = json.loads(payload.readline().decode("utf-8"))
        except ValueError:
            refuse(info_path, "the call arrived damaged (its header is not JSON)")
        set_path(here, header)
        if header.get("code"):  # code: cloudpickle's helpers load it
            try:
                import cloudpickle  # noqa: F401
            except Exception as exc:
                refuse(info_path, "cloudpickle, sent with the call, does not load on %s: %s: %s" % (
                    this_python(), type(exc).__name__, exc))
        if kept is not None:
            kept.use(os.getcwd())
        try:
            function, args, kwargs = load_call(payload, info_path, header)
        finally:
            if kept is not None:
                kept.close()
    if header.get("cwd"):  # a function sweep's combination folder: what the call writes lands there
        result_path, info_path = os.path.abspath(result_path), os.path.abspath(info_path)
        if not os.path.isdir(header["cwd"]):
            os.makedirs(header["cwd"])
        os.chdir(header["cwd"])
    try:
        value = function(*args, **kwargs)
    except Exception as exc:
        del args, kwargs
        keep_exception(result_path, info_path, exc)
    del function, args, kwargs  # what they held may be large: free it before pickling the value
    try:
        holds_code = dump(value, result_path)
    except Exception as exc:  # the value does not pickle: that is the call's error
        keep_exception(result_path, info_path, exc)
    write_info(info_path, {"kind": "value", "code": holds_code})


# --- the code of the user's modules, kept ------------------------------------------------------


class KeptCode(object):
    """What warm calls compiled of the modules in their folders, kept in the work root's
    ``code`` folder (a descriptor the agent opened and verified), named by the source's SHA-256
    and this Python's bytecode magic: a call's folder is new each time, so no ``__pycache__``
    was ever there to reuse (and ``-B`` keeps one out of its results), and each call compiled
    the same modules again (a 200-line module: 3 ms, a large one tens).  Used only while the
    call loads (its function's module and what that imports); the files are the user's own
    (this user's alone, else not read); one unreadable is compiled again.  Entries nobody used
    for KEEP_DAYS go when an interpreter starts."""

    KEEP_DAYS = 30

    def __init__(self, fd):
        import hashlib
        import marshal
        from importlib import machinery
        from importlib.util import MAGIC_NUMBER

        self.fd = fd
        self.hashlib, self.marshal, self.machinery = hashlib, marshal, machinery
        self.suffix = "-%s-%d" % (MAGIC_NUMBER.hex(), sys.flags.optimize)
        self.folder = None
        self.finder = None

    def forget_old(self):
        import time

        old = time.time() - self.KEEP_DAYS * 86400
        for name in os.listdir(self.fd):
            try:
                if os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mtime < old:
                    os.unlink(name, dir_fd=self.fd)
            except OSError:
                pass

    def use(self, folder):
        """Modules found below ``folder`` (the call's) load through the kept code."""
        machinery, kept = self.machinery, self
        try:
            import _imp

            fix = _imp._fix_co_filename  # what a __pycache__ file's code gets: its source's path
        except (ImportError, AttributeError):
            return

        class Loader(machinery.SourceFileLoader):
            def get_code(self, fullname):
                path = self.get_filename(fullname)
                source = self.get_data(path)
                code = kept.load(source)
                if code is None:
                    code = self.source_to_code(source, path)
                    kept.store(source, code)
                else:
                    fix(code, path)
                return code

        def finder(path):
            if not (path == folder or path.startswith(folder + os.sep)):
                raise ImportError("not a folder of the call")
            return machinery.FileFinder(path, (machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
                                        (Loader, machinery.SOURCE_SUFFIXES),
                                        (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES))

        self.folder, self.finder = folder, finder
        sys.path_hooks.insert(0, finder)
        self._forget_finders()

    def close(self):
        """The call loaded: later imports as a fresh Python's, and the folder's descriptor gone."""
        if self.finder is not None:
            sys.path_hooks.remove(self.finder)
            self._forget_finders()
            self.finder = None
        os.close(self.fd)

    def _forget_finders(self):
        for path in [p for p in sys.path_importer_cache if p == self.folder or p.startswith(self.folder + os.sep)]:
            del sys.path_importer_cache[path]

    def name(self, source):
        return self.hashlib.sha256(source).hexdigest()[:40] + self.suffix

    def load(self, source):
        name = self.name(source)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                    return None
                code = self.marshal.load(f)
            os.utime(name, dir_fd=self.fd)  # in use: not forgotten
        except (OSError, EOFError, ValueError, TypeError):
            return None
        return code if isinstance(code, types.CodeType) else None

    def store(self, source, code):
        name = self.name(source)
        tmp = ".%s.%d" % (name, os.getpid())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(self.marshal.dumps(code))
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except BaseException:
                os.unlink(tmp, dir_fd=self.fd)
                raise
        except (OSError, ValueError):  # a full disk: compiled again next time
            pass


# --- the warm interpreter ---------------------------------------------------------------------
# ``call_runner.py --serve KEY``: started once by the host's agent (agent/warm.py) for the calls
# of one Python, it keeps this interpreter loaded and forks a child for each call, which then
# is what ``python call_runner.py PAYLOAD RESULT INFO`` would have been in the call's folder:
# a Python's own start cost more than the rest of a trivial call.  The agent sends each call on
# a SOCK_SEQPACKET socket (its descriptor number in WARM_FD): one JSON message (the call's whole
# environment and its arguments) with three descriptors, the call's stdout, its stderr and its
# folder; this answers the child's pid, then its exit status when it ends.  KEY (the hash of
# the runner and the cloudpickle sent with it) tells servers of different ones apart: a server
# has the cloudpickle of its first call loaded.  The socket's end (the agent gone) ends
# this; the children are the agent's jobs, for it to end.

WARM_FD = "SSH_SCHEDULER_WARM_FD"  # as agent/warm.py names it
CODE_FD = "SSH_SCHEDULER_CODE_FD"


def serve():
    import array
    import gc
    import select
    import signal
    import socket

    sock = socket.socket(fileno=int(os.environ.pop(WARM_FD)))
    code_fd = int(os.environ.pop(CODE_FD, "-1"))
    launched_as = sys.argv[0]  # relative to the folder of the call it was started in
    preload(os.path.dirname(os.path.abspath(launched_as)))
    kept = None
    if code_fd >= 0:
        try:
            kept = KeptCode(code_fd)
            kept.forget_old()
        except Exception:  # (an old Python's importlib): its calls compile their modules
            os.close(code_fd)
            kept, code_fd = None, -1
    gc.freeze()  # what is loaded stays out of the calls' collections (its pages shared, not copied)
    os.chdir("/")  # never inside a job's folder (the agent sweeps what works in an ended one)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake select
    int_size = array.array("i").itemsize

    def say(message):
        sock.sendall(json.dumps(message).encode())

    def reap():
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            say({"exit": pid, "code": code})

    say({"ready": True})
    while True:
        readable = select.select([sock, wake_r], [], [])[0]
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
            reap()
        if sock not in readable:
            continue
        data, ancillary, _flags, _addr = sock.recvmsg(1 << 20, socket.CMSG_SPACE(3 * int_size))
        if not data:
            os._exit(0)
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % int_size])
        request = json.loads(data.decode("utf-8"))
        pid = -1
        try:
            if len(fds) == 3:
                pid = os.fork()
        except OSError as exc:
            say({"n": request["n"], "error": "fork: %s" % exc})
        if pid == 0:
            in_child(list(fds), request, launched_as, (sock.fileno(), wake_r, wake_w), kept)
        for fd in fds:
            os.close(fd)
        if pid > 0:
            say({"n": request["n"], "pid": pid})
        elif len(fds) != 3:
            say({"n": request["n"], "error": "the call came without its 3 descriptors"})


def preload(here):
    """cloudpickle, loaded once here rather than by each call that travels as code (a lambda, a
    notebook's function): its import, from sources no Python had compiled, was about 50 ms of
    CPU of every such call, five times the rest of a trivial one.  The one sent with the calls,
    from the first call's folder: the serve key covers its files, so every call this
    interpreter forks came with the same.  Where it does not load, nothing of it stays: the
    call that needs it imports it and says what is wrong."""
    folder = os.path.join(here, LIB)
    sys.path.insert(0, folder)
    try:
        import cloudpickle  # noqa: F401
    except Exception:
        for name in [n for n in sys.modules if n == "cloudpickle" or n.startswith("cloudpickle.")]:
            del sys.modules[name]
    finally:
        sys.path.remove(folder)


def in_child(fds, request, launched_as, theirs, kept=None):
    """The forked call: its own session, its descriptors, folder, environment and arguments;
    then :func:`main`, and the ends a Python's own exit would have (threads joined, atexit
    functions run, streams flushed)."""
    import signal

    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in theirs:
            os.close(fd)
        out, err, folder = fds
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.fchdir(folder)
        for fd in (null, out, err, folder):
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        if "PWD" in os.environ:  # as the job's shell would have set it, starting there
            os.environ["PWD"] = os.getcwd()
        here = os.path.abspath(os.path.dirname(launched_as))
        sys.argv = [launched_as] + request["argv"]
        sys.path[0] = here  # as a fresh start of this file in this folder has it
        main(request["argv"], here, kept)
        code = 0
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    try:
        threading = sys.modules.get("threading")
        if threading is not None and hasattr(threading, "_shutdown"):
            threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = code or 1
    os._exit(code)


def exit_code(value):
    """What ``sys.exit(value)`` makes a Python's exit status."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    sys.stderr.write("%s\n" % (value,))
    return 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1:])
