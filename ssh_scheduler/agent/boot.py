"""The agent's first stage: all that travels on the command line; the agent follows on stdin.

The coordinator (transport/bootstrap.py) runs ``python3 -u -I -S -c`` with this file's text as
ONE line (``exec`` of a string literal: tcsh and fish, as login shells, refuse a newline inside
quotes) and four short arguments: the work root, the batch token, the key of the agent's code
(the sha256 of what follows) and its size.  Then it writes on our stdin, before the protocol
begins, the agent's modules (:data:`MODULES`), their sources joined by NUL and compressed.  So
the command line stays the same few KB however large the agent grows (Linux refuses one argument
over 128 KiB), and nothing is installed on the host.

The code is read with ``os.read`` on fd 0, exactly that many bytes: a buffered read could take
some of the protocol that follows with it.  Compiling the sources cost more than the rest of
the agent's start, so the code objects are kept in the work root (``code-<key>-<python's cache
tag>``, written by the agent).  Nothing is loaded from the work root before it is verified:
:func:`open_root` opens it one name at a time from ``/`` (every folder on the way ours or
root's, writable by others only when sticky; a symlink followed only when it is ours or root's,
so nobody else can change where it leads; the root itself a real folder of ours that nobody else
may write), and the kept code is read relative to that descriptor, never through a link, only
when it is ours and private; otherwise what arrived is checked against its key, then compiled.
The agent works through the same descriptor (hostguard.WorkRoot): a path someone renames or
re-links later changes nothing it opens.  The modules are run in order under their package
names (``ssh_scheduler.agent.protocol``...), so they import each other as they do in the
package (this module too, as ``ssh_scheduler.agent.boot``), and the last, main.py, serves.

This runs on whatever python3 the host has: it must parse on old ones (no f-strings, no
``from __future__``, only annotations that evaluate anywhere) to say, in one line the
coordinator shows with the fix, that the python3 is too old.
"""

import errno
import os
import stat
import sys
from types import CodeType

MODULES = ("wire", "protocol", "rooted", "hostguard", "plumbing", "relay", "slurm", "files", "warm", "jobs", "main")
"""The agent's modules, in the order they run (each imports only those before it)."""
OLDEST = (3, 8)
REFUSED = "ssh_scheduler agent refused to start: "  # how agent.main words it too


def refuse(why: str) -> None:
    """One plain line for the coordinator (it shows it as the reason), then exit 2."""
    sys.stdout.write(REFUSED + why + "\n")
    sys.stdout.flush()
    sys.exit(2)


def read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes of ``fd`` (fewer only at its end), never one more."""
    chunks = []
    left = size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def private(fd: int) -> bool:
    """Ours and writable by nobody else."""
    st = os.fstat(fd)
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


# --- the work root, opened through verified descriptors -------------------------------------------

FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A folder above the root is only passed through: O_PATH needs no read permission (a home of
# mode 0711), and still gives a descriptor to check and to open the next name from.
PASSAGE = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OWN_FOLDER = "put the work root in a folder of your own (workdir: ~/.ssh_scheduler, the default)"
MAX_LINKS = 40  # as the kernel: more symlinks on one path is a loop


class Refused(Exception):
    """The work root is not safe to use; the message is one line naming the place and the fix."""


def check_passage(fd: int, shown: str) -> None:
    """A folder on the way to the root: ours or root's, and writable by others only when sticky
    (otherwise its owner, or anyone, could swap what comes next)."""
    st = os.fstat(fd)
    if st.st_uid not in (0, os.getuid()):
        raise Refused("%s belongs to another user (uid %d); %s" % (shown, st.st_uid, OWN_FOLDER))
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise Refused("%s is writable by other users (mode %o); %s"
                      % (shown, stat.S_IMODE(st.st_mode), OWN_FOLDER))


def check_root(fd: int, shown: str) -> None:
    """The root itself (and each folder the agent keeps in it): ours, a folder nobody else may
    write; readable by others is only a leak, closed here."""
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        raise Refused("%s belongs to another user (uid %d); choose another workdir (the default "
                      "~/.ssh_scheduler is private)" % (shown, st.st_uid))
    if st.st_mode & 0o022:
        raise Refused("%s is writable by other users (mode %o); run `chmod 700 %s` if it is "
                      "yours, or choose another workdir" % (shown, stat.S_IMODE(st.st_mode), shown))
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o700)


def joined(real: str, name: str) -> str:
    return real.rstrip("/") + "/" + name


def made(name: str, parent: int, shown: str) -> None:
    """mkdir ``name`` (0700) in ``parent``; an error names the whole path."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        pass
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, shown) from None


def walk(path: str, create: bool) -> "tuple[int, str] | None":
    """A descriptor of the folder ``path`` (absolute), reached from / one name at a time, each
    checked (:func:`check_passage`), and the path it really has.  A symlink on the way is
    followed only when it is ours or root's: a link someone else owns could lead elsewhere at
    the next look.  None when a folder is missing and not ``create`` (else it is made, 0700)."""
    names = [n for n in path.split("/") if n not in ("", ".")]
    fd = os.open("/", PASSAGE)
    real = "/"
    links = 0
    try:
        check_passage(fd, real)
        while names:
            name = names.pop(0)
            shown = joined(real, name)
            if name == "..":
                up = os.open("..", PASSAGE, dir_fd=fd)
                os.close(fd)
                fd, real = up, os.path.dirname(real)
                check_passage(fd, real)
                continue
            try:
                nxt = os.open(name, PASSAGE, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    if not create:
                        os.close(fd)
                        return None
                    made(name, fd, shown)
                    names.insert(0, name)  # opened (and checked) like any other
                    continue
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(exc.errno, exc.strerror, shown) from None
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise Refused("%s is not a folder; choose another workdir" % shown) from None
                if st.st_uid not in (0, os.getuid()):
                    raise Refused("%s is a symlink of another user (uid %d), who could change where it "
                                  "leads; %s" % (shown, st.st_uid, OWN_FOLDER)) from None
                links += 1
                if links > MAX_LINKS:
                    raise Refused("%s: too many symbolic links; choose another workdir" % shown) from None
                target = os.readlink(name, dir_fd=fd)
                names[:0] = [n for n in target.split("/") if n not in ("", ".")]
                if target.startswith("/"):
                    os.close(fd)
                    fd, real = os.open("/", PASSAGE), "/"
                    check_passage(fd, real)
                continue
            os.close(fd)
            fd, real = nxt, shown
            check_passage(fd, real)
    except BaseException:
        os.close(fd)
        raise
    return fd, real


def open_private(parent: int, name: str, shown: str, create: bool) -> "int | None":
    """A descriptor of the folder ``name`` of ``parent``: a real folder (no link) of ours that
    nobody else may write (:func:`check_root`), made (0700) when missing and ``create``; None
    when missing and not ``create``."""
    try:
        try:
            fd = os.open(name, FOLDER, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            made(name, parent, shown)
            fd = os.open(name, FOLDER, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused("%s is not a folder (a symlink or a file); remove it, or choose another "
                          "workdir" % shown) from None
        raise OSError(exc.errno, exc.strerror, shown) from None
    try:
        check_root(fd, shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_root(path: str, create: bool) -> "tuple[int, str] | None":
    """The work root ``path`` (absolute, as configured): (a descriptor, the path it really has),
    its folder reached through :func:`walk`, itself opened by :func:`open_private`.  None when
    it is missing and not ``create``.  Raises Refused, or OSError when it cannot be made."""
    parent = walk(os.path.dirname(path) or "/", create)
    if parent is None:
        return None
    folder, real = parent
    name = os.path.basename(path)
    try:
        fd = open_private(folder, name, path, create)
    finally:
        os.close(folder)
    return None if fd is None else (fd, joined(real, name))


def opened_or_refused(root: str, path: str) -> "tuple[int, str]":
    """The work root, made if missing (:func:`open_root`); what stops it is said with the fix."""
    try:
        opened = open_root(path, True)
    except Refused as exc:
        refuse(str(exc))
    except OSError as exc:  # a read-only home, a workdir nobody may create: say which and the fix
        where = "" if exc.filename in (None, path) else " (at %s)" % exc.filename
        shown = root if root == path else "%s (%s)" % (root, path)
        refuse("cannot create the work root %s: %s%s; fix: set workdir: in the machine YAML to a "
               "folder this user can write" % (shown, exc.strerror, where))
    assert opened is not None
    return opened


def kept_code(root: int, name: str) -> "list[CodeType] | None":
    """The code objects kept in the (verified) work root as ``name``, when the file is ours and
    private; never through a link."""
    import marshal

    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        with os.fdopen(fd, "rb") as f:
            code = marshal.load(f) if private(fd) else None
    except (OSError, ValueError, EOFError, TypeError):
        return None
    return code if isinstance(code, list) and len(code) == len(MODULES) else None


def compiled(blob: bytes, key: str) -> "list[CodeType]":
    """The modules compiled from what arrived on stdin, once it is checked against its key."""
    import hashlib
    import zlib

    if hashlib.sha256(blob).hexdigest() != key:
        refuse("the agent's code arrived damaged (its sha256 is not %s); is something on the "
               "host writing to the session, like a login script?" % key)
    sources = zlib.decompress(blob).split(b"\0")
    if len(sources) != len(MODULES):
        refuse("the agent's code holds %d modules, not %d" % (len(sources), len(MODULES)))
    return [compile(source, "ssh_scheduler/agent/%s.py" % name, "exec")
            for name, source in zip(MODULES, sources)]


def run_modules(code: "list[CodeType]") -> "dict[str, object]":
    """Run each module under its package name; the namespace of the last (main.py)."""
    package = type(sys)("ssh_scheduler")
    agent = type(sys)("ssh_scheduler.agent")
    package.__path__ = agent.__path__ = []  # packages, with nothing more to find
    package.agent = agent  # type: ignore[attr-defined]
    sys.modules.update({"ssh_scheduler": package, "ssh_scheduler.agent": agent})
    # This first stage is a module of the agent too (main.py opens the root with it when it is
    # started without us): here it runs as __main__.
    sys.modules["ssh_scheduler.agent.boot"] = agent.boot = sys.modules["__main__"]  # type: ignore[attr-defined]
    module = agent
    for name, module_code in zip(MODULES, code):
        module = type(sys)("ssh_scheduler.agent." + name)
        sys.modules[module.__name__] = module
        setattr(agent, name, module)
        exec(module_code, module.__dict__)
    return module.__dict__


def main(argv: "list[str]") -> None:
    if sys.version_info < OLDEST:
        refuse("the host's python3 is %s, the agent needs %d.%d or newer; fix: install a newer "
               "python3, or put one first on the PATH of non-interactive ssh logins"
               % (sys.version.split()[0], OLDEST[0], OLDEST[1]))
    root, token, key, size = argv
    blob = read_exactly(0, int(size))
    if len(blob) != int(size):  # the coordinator went away while sending it
        refuse("the agent's code did not arrive (%d of %s bytes)" % (len(blob), size))
    path = os.path.abspath(os.path.expanduser(root))
    try:
        opened = open_root(path, False)  # checked before anything is loaded from it
    except Refused as exc:
        refuse(str(exc))
    except OSError:
        opened = None  # said with the fix below, once the code is known good
    name = "code-%s-%s" % (key, sys.implementation.cache_tag)
    code = (kept_code(opened[0], name) if opened else None) or compiled(blob, key)
    # The agent speaks on its stdin and stdout, never TLS: asyncio imports ssl only to offer it,
    # 2.5 ms of the agent's ~25 ms start on every host of a cold batch.  (Its jobs are processes
    # of their own, with every module.)
    sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]
    opened = opened or opened_or_refused(root, path)
    run_modules(code)["main"](root, token, (name, code), opened)  # type: ignore[operator]


if __name__ == "__main__":
    main(sys.argv[1:])
