"""The agent's defences on a shared host: private folders, safe file creation, containment.

Runs on the hosts with main.py (shipped with it, python3 >= 3.8, standard library only,
plain unannotated code).  Other unix users on the host are assumed hostile:

* Folders: the work root and every folder under it must be ours, a real folder (not a symlink)
  and writable by nobody else; every folder above it must belong to us or to root and be
  writable by others only when sticky (like /tmp).  Otherwise the agent refuses to start, with
  one line naming the folder and the fix; nothing is ever created inside someone else's folder.
* Files are created with O_EXCL | O_NOFOLLOW and mode 0600: a planted symlink cannot redirect
  them.
* Containment: the agent is a child subreaper (prctl PR_SET_CHILD_SUBREAPER).  An orphan
  (after setsid, a double fork, ``env -i``: nothing a job does changes this) is re-parented to
  the nearest living subreaper above it, the agent, never to init: every process any job starts
  stays in the process tree below the agent, found through the parent links in /proc.  A job's
  own processes are the tree below its shell plus the orphans working in its folder (a working
  folder survives setsid, env -i and forks); an orphan that also left the job's folder cannot be
  told apart and is killed when the agent ends (the batch's end, the lease), not with its job.
  Making each job's shell a subreaper instead would need a fork (not vfork) of the agent per
  job: about 4 ms of copy-on-write faults each, three times the cost of a short job.
  Where prctl is missing (not Linux, or a kernel older than 3.4) orphans escape to init; the
  agent then falls back to the process group and an environment tag (which ``env -i`` drops).
"""

import json
import os
import re
import signal
import socket
import stat
import struct

PR_SET_CHILD_SUBREAPER = 36
TAG_VAR = "SSH_SCHEDULER_TAG"  # in every job's environment: the fallback where prctl is missing
TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Refused(Exception):
    """The host is not safe to work in; the message is one line with the fix."""


# --- folders and files ---------------------------------------------------------------------------


def check_ancestors(path):
    """Every folder above ``path`` must be ours or root's, and writable by others only when
    sticky: otherwise its owner could swap our folder for a link to theirs."""
    me = os.getuid()
    current = os.path.realpath(os.path.dirname(path))
    while True:
        st = os.stat(current)
        if st.st_uid not in (0, me):
            raise Refused("%s belongs to another user (uid %d); put the work root in a folder of "
                          "your own (workdir: ~/.ssh_scheduler, the default)" % (current, st.st_uid))
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise Refused("%s is writable by other users (mode %o); put the work root in a folder "
                          "of your own (workdir: ~/.ssh_scheduler, the default)"
                          % (current, stat.S_IMODE(st.st_mode)))
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def private_dir(path):
    """Make ``path`` (mode 0700) or check that the existing one is ours and private."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise Refused("%s is not a folder (a symlink or a file); remove it, or choose another "
                      "workdir" % path)
    if st.st_uid != os.getuid():
        raise Refused("%s belongs to another user (uid %d); choose another workdir (the default "
                      "~/.ssh_scheduler is private)" % (path, st.st_uid))
    if st.st_mode & 0o022:
        raise Refused("%s is writable by other users (mode %o); run `chmod 700 %s` if it is "
                      "yours, or choose another workdir" % (path, stat.S_IMODE(st.st_mode), path))
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours and not writable by others: readable is only a leak


def private_root(root, subdirs):
    """The work root and its first-level folders, private; raises Refused."""
    parent = os.path.dirname(root)
    if not os.path.isdir(parent):
        os.makedirs(parent, 0o700)
    check_ancestors(root)
    private_dir(root)
    for sub in subdirs:
        private_dir(os.path.join(root, sub))


def keep_code(root, name, code):
    """Keep the agent's compiled code in the (checked) root for the next start, replacing any
    other version's (see boot.py, which loads it)."""
    path = os.path.join(root, name)
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return  # the one the bootstrap loaded (or could have)
    except OSError:
        pass
    import marshal

    tmp = "%s.%d" % (path, os.getpid())
    try:
        fd = create_private(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(marshal.dumps(code))
        os.replace(tmp, path)
        for other in os.listdir(root):
            if other.startswith("code-") and other != name:
                os.unlink(os.path.join(root, other))
    except OSError:
        pass  # only costs compiling again next time


def create_private(path, append=False):
    """A new file only we can read; never follows a link, never reuses a planted name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags | (os.O_APPEND if append else 0), 0o600)


def peer_uid(sock):
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class CacheTrust(object):
    """A cache entry is used only once its content hashed to its name (``<sha256>-<r|x>``),
    it is a plain file of ours and of the size the coordinator expects; anything else is removed
    and reported missing.  What hashed true is remembered in the private root (nobody else can
    write there) with the file's inode, size and change times, so a large input is hashed again
    only when it changed, not at every batch."""

    def __init__(self, cache, record):
        self.cache = cache
        self.record = record
        self.changed = False
        try:
            with open(record) as f:
                self.known = json.load(f)
        except (OSError, ValueError):
            self.known = {}
        if not isinstance(self.known, dict):
            self.known = {}

    def check(self, key, size):
        path = os.path.join(self.cache, key)
        if "/" in key or key.startswith("."):
            return False
        try:
            st = os.lstat(path)
        except OSError:
            return False
        seen = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and size in (None, st.st_size):
            if self.known.get(key) == seen:
                return True
            if hash_matches(path, key):
                self.known[key] = seen
                self.changed = True
                return True
        try:
            os.unlink(path)
        except OSError:
            pass
        if self.known.pop(key, None) is not None:
            self.changed = True
        return False

    def learn(self, key):
        """An entry the agent wrote itself after checking its hash (see keep_in_cache)."""
        try:
            st = os.lstat(os.path.join(self.cache, key))
        except OSError:
            return
        self.known[key] = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        self.changed = True

    def save(self):
        if not self.changed:
            return
        self.changed = False
        tmp = "%s.%d" % (self.record, os.getpid())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(self.known, f)
            os.replace(tmp, self.record)
        except OSError:
            pass  # only costs hashing again next time


def hash_matches(path, key):
    """Cache keys are ``<sha256 of the content>-<r|x>``."""
    import hashlib

    digest = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        while True:
            block = f.read(1 << 20)
            if not block:
                break
            digest.update(block)
    return key.split("-", 1)[0] == digest.hexdigest()


# --- small files in bulk (the agent's put and fetch) --------------------------------------------

CACHE_KEY = re.compile(r"^[0-9a-f]{64}-[rx]$")


def keep_in_cache(cache, key, data):
    """Write ``data`` as the cache entry ``key``, private and read-only (0500 for ``-x``), only
    when it hashes to the key; returns why it was not kept, or None.  Written under a name of
    its own first (O_EXCL, no link followed) and renamed, so no reader sees half a file."""
    import hashlib

    if not CACHE_KEY.match(key):
        return "not a cache key"
    if hashlib.sha256(data).hexdigest() != key[:64]:
        return "the content does not match its hash"
    path = os.path.join(cache, key)
    tmp = "%s.put-%d" % (path, os.getpid())
    try:
        fd = create_private(tmp)
    except FileExistsError:  # an earlier agent's, killed mid-write (the cache is private)
        os.unlink(tmp)
        fd = create_private(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, 0o500 if key.endswith("-x") else 0o400)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return None


def read_regular(path, limit):
    """``(bytes, None)``: at most ``limit`` bytes of a regular file; ``(None, reason)`` for
    anything else.  A link is never followed (O_NOFOLLOW), a FIFO never waited on (O_NONBLOCK,
    then refused as not a regular file), so a job's leftovers cannot stall or redirect it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "not a regular file"
        chunks = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), None
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        os.close(fd)


# --- processes -----------------------------------------------------------------------------------


_prctl = []


def set_subreaper():
    """Make the calling process a child subreaper; False where the kernel cannot.  Also runs
    in a job's child between fork and exec, so after the first call it only calls prctl."""
    if not _prctl:
        try:
            import ctypes

            _prctl.append(ctypes.CDLL(None, use_errno=True).prctl)
        except (OSError, AttributeError, ImportError):
            _prctl.append(None)
    prctl = _prctl[0]
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def process_table():
    """{pid: (parent pid, resident pages, state letter)} of every process we can see."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()  # the name may hold spaces and ')'
        try:
            table[int(entry)] = (int(fields[1]), int(fields[21]), fields[0])
        except (IndexError, ValueError):
            continue
    return table


def children_map(table):
    kids = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    return kids


def subtree(kids, top):
    """``top`` and every process below it."""
    found = [top]
    i = 0
    while i < len(found):
        found.extend(kids.get(found[i], ()))
        i += 1
    return found


def working_folder(pid):
    """Where a process works (None when it is gone); a removed folder still names itself."""
    try:
        where = os.readlink("/proc/%d/cwd" % pid)
    except OSError:
        return None
    return where[:-len(" (deleted)")] if where.endswith(" (deleted)") else where


def inside(path, folder):
    return path is not None and (path == folder or path.startswith(folder + "/"))


def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_below(top, include_top=True, rounds=20):
    """SIGKILL the whole tree below ``top`` until nothing is left (a process may fork between
    a scan and the kill; its children then hang below a subreaper we scan again)."""
    for _ in range(rounds):
        pids = subtree(children_map(process_table()), top)
        if not include_top:
            pids = pids[1:]
        if not pids:
            return
        signal_all(pids, signal.SIGKILL)


def reap(pids):
    """Collect the exit status of children we killed (no zombies left), never blocking and
    never touching children asyncio waits for (only these pids)."""
    left = []
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done == 0:
            left.append(pid)
    return left


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
