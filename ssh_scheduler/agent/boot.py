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
tag>``, written by the agent once the root is checked private) and loaded only when the root
and that file are ours and writable by nobody else, checked through descriptors, never
following a link; otherwise what arrived is checked against its key, then compiled.  The
modules are run in order under their package names (``ssh_scheduler.agent.protocol``...), so
they import each other as they do in the package, and the last, main.py, serves.

This runs on whatever python3 the host has: it must parse on old ones (no f-strings, no
``from __future__``, only annotations that evaluate anywhere) to say, in one line the
coordinator shows with the fix, that the python3 is too old.
"""

import os
import sys
from types import CodeType

MODULES = ("wire", "protocol", "hostguard", "plumbing", "relay", "slurm", "files", "jobs", "main")
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


def kept_code(root: str, name: str) -> "list[CodeType] | None":
    """The code objects kept in the work root as ``name``, when both are private."""
    import marshal

    try:
        folder = os.open(os.path.expanduser(root), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
            with os.fdopen(fd, "rb") as f:
                code = marshal.load(f) if private(folder) and private(fd) else None
        finally:
            os.close(folder)
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
    name = "code-%s-%s" % (key, sys.implementation.cache_tag)
    code = kept_code(root, name) or compiled(blob, key)
    run_modules(code)["main"](root, token, (name, code))  # type: ignore[operator]


if __name__ == "__main__":
    main(sys.argv[1:])
