"""The warm interpreter of Python calls: ``call_runner.py --serve KEY`` runs :func:`serve`.

Staged beside the runner as ``ssh_scheduler_call_warm.py`` (executors/python_call.py: a name no
user module has, since the interpreter keeps it imported) and loaded only by a warm interpreter:
a call started afresh never reads it.  Its calls then run the runner's ``main``, which it is
given.  Runs on the host's Python (3.8 or newer): stdlib only, no 3.9+ syntax.
"""

import gc
import hashlib
import importlib
import json
import marshal
import os
import stat
import sys
import types
from importlib import machinery
from importlib.util import MAGIC_NUMBER

LIB = "lib"  # cloudpickle's sources, beside the runner


def open_own(name, folder):
    """The file ``name`` of the folder descriptor ``folder``, opened to read, where it is a
    regular file of this user's that nobody else may write; else None.  (Never blocks: a FIFO
    planted under the name is refused, not waited on.)"""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def below(path, folder):
    return path == folder or path.startswith(folder + os.sep)


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
        self.fd = fd
        self.suffix = "-%s-%d" % (MAGIC_NUMBER.hex(), sys.flags.optimize)
        self.folder = None
        self.finder = None
        self.ahead = LoadedAhead(fd)

    def forget_old(self):
        import time

        old = time.time() - self.KEEP_DAYS * 86400
        for name in os.listdir(self.fd):
            try:
                if os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mtime < old:
                    os.unlink(name, dir_fd=self.fd)
            except OSError:
                pass

    def use(self, folder, ours):
        """Modules found below ``folder`` (the call's; ``ours``, the runner's, in it) load
        through the kept code."""
        self.ahead.use([p for p in sys.path if below(p, folder) and not below(p, ours)])
        kept = self
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
            if not below(path, folder) or not os.path.isdir(path):  # (a .zip: zipimport's)
                raise ImportError("not a folder of the call")
            return machinery.FileFinder(path, (machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
                                        (Loader, machinery.SOURCE_SUFFIXES),
                                        (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES))

        self.folder, self.finder = folder, finder
        sys.path_hooks.insert(0, finder)
        self._forget_finders()

    def close(self):
        """The call loaded: later imports as a fresh Python's, and the folder's descriptor gone."""
        self.ahead.note()
        if self.finder is not None:
            sys.path_hooks.remove(self.finder)
            self._forget_finders()
            self.finder = None
        os.close(self.fd)

    def _forget_finders(self):
        for path in [p for p in sys.path_importer_cache if below(p, self.folder)]:
            del sys.path_importer_cache[path]

    def name(self, source):
        return hashlib.sha256(source).hexdigest()[:40] + self.suffix

    def load(self, source):
        name = self.name(source)
        f = open_own(name, self.fd)
        if f is None:
            return None
        try:
            with f:
                code = marshal.load(f)
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
                    f.write(marshal.dumps(code))
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except BaseException:
                os.unlink(tmp, dir_fd=self.fd)
                raise
        except (OSError, ValueError):  # a full disk: compiled again next time
            pass


class LoadedAhead(object):
    """Standard modules the calls loaded, loaded once here: a call's module that imports typing,
    argparse or shutil imported them again in every call (5 ms of a trivial call's 10 here).
    A call notes, once loaded, the standard modules it loaded that this interpreter had not (only
    those whose file is in the standard library's folder: never a module of the call's folders
    under such a name) in the ``imports`` file beside the kept code; this loads what was noted
    as it starts and, after each fork, what was noted since.  A call whose folders hold a module
    under the name of one of them (its own ``random.py``) gets none of them: it loads them as a
    fresh Python would.  Python 3.10 or newer (``sys.stdlib_module_names``); never the modules
    below, whose import does something."""

    FILE = "imports"
    LIMIT = 1 << 16  # bytes of names: past it, nothing more is noted
    NEVER = frozenset(("__main__", "this", "antigravity", "idlelib", "tkinter", "turtle", "turtledemo",
                       "readline", "rlcompleter", "pydoc", "webbrowser", "pdb", "code", "ensurepip", "venv"))

    def __init__(self, fd):
        self.fd = fd
        self.names = getattr(sys, "stdlib_module_names", frozenset())
        self.home = os.path.dirname(os.__file__) + os.sep  # the standard library's folder
        self.read_to = 0
        self.tops = set()  # the names of what was loaded ahead (their first part)
        self.loaded = set()  # and every module that came with them
        self.before = set()

    def wanted(self, name):
        top = name.partition(".")[0]
        return top in self.names and top not in self.NEVER and all(p.isidentifier() for p in name.split("."))

    def load(self):
        """In the interpreter (as it starts, after each fork): what the calls noted since."""
        f = open_own(self.FILE, self.fd)
        if f is None:
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            if not self.read_to < size <= self.LIMIT:
                return
            data = os.pread(f.fileno(), size - self.read_to, self.read_to)
        data = data[:data.rfind(b"\n") + 1]
        self.read_to += len(data)
        before = set(sys.modules)
        for name in data.decode("ascii", "replace").split():
            if name not in sys.modules and self.wanted(name):
                try:
                    importlib.import_module(name)
                except Exception:
                    pass
        new = set(sys.modules) - before
        if new:
            self.loaded |= new
            self.tops |= set(n.partition(".")[0] for n in new)
            gc.freeze()

    def use(self, folders):
        """In a call, before it loads from ``folders``."""
        if self.tops:
            for folder in folders:
                try:
                    names = os.listdir(folder)
                except OSError:
                    continue
                if any(n.partition(".")[0] in self.tops for n in names):
                    for name in self.loaded:
                        sys.modules.pop(name, None)
                    break
        self.before = set(sys.modules)

    def note(self):
        """In a call, loaded: the standard modules it loaded that the interpreter had not."""
        new = []
        for name, module in list(sys.modules.items()):
            origin = getattr(getattr(module, "__spec__", None), "origin", None)
            if name not in self.before and self.wanted(name) and (origin in ("built-in", "frozen") or (
                    isinstance(origin, str) and below(origin, self.home[:-1]) and "-packages" not in origin)):
                new.append(name)
        if not new:
            return
        text = ("\n".join(sorted(new)) + "\n").encode()
        try:
            fd = os.open(self.FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self.fd)
            try:
                if os.fstat(fd).st_size + len(text) <= self.LIMIT:
                    os.write(fd, text)
            finally:
                os.close(fd)
        except OSError:
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


def serve(main):
    import array
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
            kept.ahead.load()  # what calls here loaded before: the first call finds it loaded
        except Exception:  # (a folder it cannot list): its calls compile their modules
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
            in_child(list(fds), request, launched_as, (sock.fileno(), wake_r, wake_w), main, kept)
        for fd in fds:
            os.close(fd)
        if pid > 0:
            say({"n": request["n"], "pid": pid})
        elif len(fds) != 3:
            say({"n": request["n"], "error": "the call came without its 3 descriptors"})
        if kept is not None:  # after the fork: this call is not kept waiting, the next ones gain
            kept.ahead.load()


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


def in_child(fds, request, launched_as, theirs, main, kept=None):
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
