"""The agent's defences on a shared host: private folders, safe file creation, containment.

Runs on the hosts with main.py (shipped with it, python3 >= 3.8, standard library only,
plain unannotated code).  Other unix users on the host are assumed hostile:

* Folders: the work root is opened once through verified descriptors (boot.open_root: every
  folder on the way ours or root's and writable by others only when sticky, a symlink followed
  only when ours or root's, the root a real folder of ours nobody else may write); its folders
  (cache, jobs, agents) must be real folders of ours nobody else may write.  Otherwise the agent
  refuses to start, with one line naming the folder and the fix; nothing is ever created inside
  someone else's folder.  The agent keeps them as descriptors (:class:`WorkRoot`) and opens
  everything below through them (rooted.py), never by a path someone could change.
* Files are created with O_EXCL | O_NOFOLLOW and mode 0600: a planted symlink cannot redirect
  them.
* The cache: an entry is used only once its content hashed to its name, and again whenever it
  changed since (a job that rewrote an input in place through its link spoils only that entry,
  which is then replaced, never linked to a later job) (:class:`CacheTrust`).
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
import threading

from ssh_scheduler.agent import boot
from ssh_scheduler.agent import rooted as R

PR_SET_CHILD_SUBREAPER = 36
TAG_VAR = "SSH_SCHEDULER_TAG"  # in every job's environment: the fallback where prctl is missing
TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CACHE_DIR = "cache"
JOBS_DIR = "jobs"
AGENTS_DIR = "agents"
CODE_DIR = "code"  # what Python calls compiled of the user's modules (call_warm.KeptCode)
TRUST_RECORD = "cache-trusted.json"


# --- folders and files ---------------------------------------------------------------------------


class WorkRoot(object):
    """The work root and the folders the agent keeps in it, as descriptors verified once (see
    boot.open_root): ``fd``, ``cache``, ``jobs``, ``agents``; ``path`` is where the root really
    is (every folder on the way to it ours or root's), what the coordinator names in its
    requests and SFTP transfers; ``shown`` the root as configured, for messages."""

    def __init__(self, opened, shown):
        self.fd, self.path = opened
        self.shown = shown
        # Each a real folder of ours nobody else may write (made if missing).
        self.cache = boot.open_private(self.fd, CACHE_DIR, os.path.join(shown, CACHE_DIR), True)
        self.jobs = boot.open_private(self.fd, JOBS_DIR, os.path.join(shown, JOBS_DIR), True)
        self.agents = boot.open_private(self.fd, AGENTS_DIR, os.path.join(shown, AGENTS_DIR), True)

    def open_code(self):
        """A new descriptor of the folder where warm Python calls keep the code of the user's
        modules (call_warm.KeptCode), made if missing; None where it cannot be: they compile."""
        try:
            return boot.open_private(self.fd, CODE_DIR, os.path.join(self.shown, CODE_DIR), True)
        except (OSError, boot.Refused):
            return None

    @classmethod
    def open(cls, root):
        """Open (and make) ``root`` as the first stage does, for an agent started without it."""
        path = os.path.abspath(os.path.expanduser(root))
        return cls(boot.open_root(path, True), path)

    def moved(self):
        """Whether the root's path names another folder than the one opened, or none, or one of
        its folders was removed or replaced: what someone cleaning the host does while an agent
        is kept between commands (its descriptors would go on naming folders nobody sees)."""
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        if not same_file(now, os.fstat(self.fd)):
            return True
        for fd, name in ((self.cache, CACHE_DIR), (self.jobs, JOBS_DIR), (self.agents, AGENTS_DIR)):
            st = R.lstat(self.fd, name)
            if st is None or not same_file(st, os.fstat(fd)):
                return True
        return False


def same_file(a, b):
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def keep_code(root, name, code):
    """Keep the agent's compiled code in the (verified) root folder ``root`` for the next start,
    replacing any other version's (see boot.py, which loads it)."""
    st = R.lstat(root, name)
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
        return  # the one the first stage loaded (or could have)
    import marshal

    tmp = "%s.%d" % (name, os.getpid())
    try:
        fd = create_private(root, tmp)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(marshal.dumps(code))
        except BaseException:
            os.unlink(tmp, dir_fd=root)
            raise
        os.replace(tmp, name, src_dir_fd=root, dst_dir_fd=root)
        for other in os.listdir(root):
            if other.startswith("code-") and other != name:
                os.unlink(other, dir_fd=root)
    except OSError:
        pass  # only costs compiling again next time (a full disk, say)


def create_private(dir_fd, name, append=False):
    """A new file ``name`` in the folder ``dir_fd`` that only we can read; never follows a
    link, never reuses a planted name."""
    return os.open(name, R.CREATE | (os.O_APPEND if append else 0), 0o600, dir_fd=dir_fd)


def peer_uid(sock):
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def identity(st):
    """What changes whenever a file's content or mode does: a write moves its mtime.  Not its
    ctime, which every hard link made to it (each staging) or removed moves too."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode]


class CacheTrust(object):
    """A cache entry is used only once its content hashed to its name (``<sha256>-<r|x>``),
    it is a plain file of ours and of the size the coordinator expects; anything else is removed
    and reported missing.  What hashed true is remembered in the private root (nobody else can
    write there) with the file's identity (:func:`identity`), so a large input is hashed again
    only when it changed, not at every batch, nor at every job that links it.

    ``cache``: the cache folder's descriptor; the record is ``record`` in the folder
    ``record_dir``.  Used from the event loop and from threads (large inputs are hashed off the
    loop): one lock."""

    def __init__(self, cache, record_dir, record=TRUST_RECORD):
        self.cache = cache
        self.record_dir = record_dir
        self.record = record
        self.changed = False
        self.lock = threading.RLock()
        try:
            with os.fdopen(os.open(record, R.READ, dir_fd=record_dir)) as f:
                self.known = json.load(f)
        except (OSError, ValueError):
            self.known = {}
        if not isinstance(self.known, dict):
            self.known = {}

    def check(self, key, size):
        """Is the entry ``key`` good to use (``size``: what the coordinator expects, or None)?
        Hashed unless it is what hashed true before (not under the lock: a large input takes a
        while); a bad one is removed."""
        if not CACHE_KEY.match(key):
            return False
        st = R.lstat(self.cache, key)
        if st is None:
            return self.forget(key)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and size in (None, st.st_size):
            with self.lock:
                if self.known.get(key) == identity(st):
                    return True
            if hash_matches(self.cache, key):
                with self.lock:
                    self.remember(key, st)
                return True
        self.evict(key, st.st_ino)
        return False

    def usable(self, key):
        """May the entry ``key`` be linked into a job now?  Asked at every staging, so cheap:
        one lstat.  An entry as it was checked is; one never checked is what our coordinator
        uploaded since it asked (by SFTP), taken as it is; one that changed in place since it was
        checked (a job wrote through its link, or made it writable) is removed, to be sent again.
        One that is another file under the same name was put there by another agent sharing the
        cache (a home folder on NFS, or one machine under two names: each put is a rename), and
        is hashed before it is used or removed: evicting it would evict that agent's good copy,
        and the two would go on sending and evicting each other's."""
        if not CACHE_KEY.match(key):
            return False
        st = R.lstat(self.cache, key)
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return self.forget(key)
        now = identity(st)
        with self.lock:
            seen = self.known.get(key)
            if seen is None:
                self.remember(key, st)
            if seen is None or seen == now:
                return True
        if seen[0] != now[0] and hash_matches(self.cache, key):
            with self.lock:
                self.remember(key, st)
            return True
        self.evict(key, now[0])
        return False

    def learn(self, key):
        """An entry the agent wrote itself after checking its hash (see keep_in_cache)."""
        st = R.lstat(self.cache, key)
        if st is not None:
            with self.lock:
                self.remember(key, st)

    def remember(self, key, st):
        """(under the lock)"""
        self.known[key] = identity(st)
        self.changed = True

    def forget(self, key):
        with self.lock:
            if self.known.pop(key, None) is not None:
                self.changed = True
        return False

    def evict(self, key, inode=None):
        """A spoiled entry: removed (the coordinator sends it again) and forgotten.  With
        ``inode``, only while the entry is still that file: another agent sharing the cache may
        have put a good copy in its place since."""
        st = R.lstat(self.cache, key) if inode is not None else None
        if inode is None or (st is not None and st.st_ino == inode):
            try:
                os.unlink(key, dir_fd=self.cache)
            except OSError:
                pass
        self.forget(key)

    def save(self):
        # Saved from the loop and from threads (puts, hashing): under the lock to the end, so an
        # older record never replaces a newer one, nor one save's file another's.
        with self.lock:
            if not self.changed:
                return
            self.changed = False
            data = json.dumps(self.known)
            tmp = "%s.%d" % (self.record, os.getpid())
            try:
                try:
                    os.unlink(tmp, dir_fd=self.record_dir)
                except FileNotFoundError:
                    pass
                fd = create_private(self.record_dir, tmp)
                with os.fdopen(fd, "w") as f:
                    f.write(data)
                os.replace(tmp, self.record, src_dir_fd=self.record_dir, dst_dir_fd=self.record_dir)
            except OSError:
                try:
                    os.unlink(tmp, dir_fd=self.record_dir)
                except OSError:
                    pass  # only costs hashing again next time


def hash_matches(cache, key):
    """Cache keys are ``<sha256 of the content>-<r|x>``; ``cache`` is the folder's descriptor."""
    import hashlib

    digest = hashlib.sha256()
    try:
        fd = os.open(key, R.READ, dir_fd=cache)
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
    """Write ``data`` as the cache entry ``key`` in the cache folder ``cache`` (a descriptor),
    private and read-only (0500 for ``-x``), only when it hashes to the key; returns why it was
    not kept, or None.  Written under a name of its own first (O_EXCL, no link followed) and
    renamed, so no reader sees half a file; a write that fails (a full disk) leaves nothing."""
    import hashlib

    if not CACHE_KEY.match(key):
        return "not a cache key"
    if hashlib.sha256(data).hexdigest() != key[:64]:
        return "the content does not match its hash"
    # The host's name too: agents on several hosts may share the cache (NFS), and pids repeat.
    tmp = "%s.put-%s-%d-%d" % (key, socket.gethostname().replace("/", "_"), os.getpid(), threading.get_ident())
    try:
        fd = create_private(cache, tmp)
    except FileExistsError:  # an earlier agent's, killed mid-write (the cache is private)
        os.unlink(tmp, dir_fd=cache)
        fd = create_private(cache, tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, 0o500 if key.endswith("-x") else 0o400)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=cache)
        raise
    os.close(fd)
    os.replace(tmp, key, src_dir_fd=cache, dst_dir_fd=cache)
    return None


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
