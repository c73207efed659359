"""The agent's plumbing that knows nothing of jobs: blocking writes, reading a stream in a thread,
the pidfd child watcher, and which command lines start without a shell (:func:`without_shell`).

Runs on the hosts' python3 (3.8 or newer) as part of the agent (loaded with it by boot.py,
the first stage): stdlib only, no 3.9+ syntax.
"""

import asyncio
import os
import re
import stat
import sys


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


# ---- starting a job line without bash, where that is provably the same -----------------------
# A bash start costs the host about 0.6 ms of CPU on top of the program's own exec (1.1 ms against
# 0.5 ms for /bin/true here), a quarter of the host's cost per job in a batch of short jobs.  A
# line of plain words (no quotes, expansions, globs, redirections, operators or assignments)
# whose first word is no builtin or keyword is, for ``bash --norc -c LINE``, one simple command
# that bash execs in its own place; doing that exec ourselves is the same as long as we give the
# program the environment bash would have given it, and leave everything else to bash:
# a program not found or not executable on PATH (bash's 127/126 and their messages), a file
# exec(2) refuses (a script without #!: bash runs it itself), and environments that change
# what bash does (BASH_ENV, exported functions, shell options).
_PLAIN_WORDS = re.compile(r"[A-Za-z0-9_./:=,+@%-]+(?:[ \t]+[A-Za-z0-9_./:=,+@%-]+)*\Z")
_BASH_WORDS = frozenset(
    """
    . : [ alias bg bind break builtin caller cd command compgen complete compopt continue declare
    dirs disown echo enable eval exec exit export false fc fg getopts hash help history jobs kill
    let local logout mapfile popd printf pushd pwd read readarray readonly return set shift shopt
    source suspend test times trap true type typeset ulimit umask unalias unset wait
    if then else elif fi case esac for select while until do done in function time coproc
    """.split()  # noqa: SIM905 (bash's own listing, compgen -b and compgen -k, reads better)
)
# true/false alone do what /bin/true and /bin/false do (with arguments, --help differs).
_SAME_AS_PROGRAM = frozenset(["true", "false"])
_BASH_ENVIRONMENT = frozenset(["BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "POSIXLY_CORRECT", "IFS"])


def without_shell(line, cwd, env):
    """``(argv, program, env)`` to exec in place of ``bash --norc -c line`` with the same effect,
    or None where only bash can say (then the caller runs bash, as always)."""
    line = line.strip(" \t")
    if not _PLAIN_WORDS.match(line):
        return None
    argv = line.split()
    first = argv[0]
    if "=" in first or (first in _BASH_WORDS and not (first in _SAME_AS_PROGRAM and len(argv) == 1)):
        return None
    if any(name in _BASH_ENVIRONMENT or name.startswith("BASH_FUNC_") for name in env):
        return None
    program = _find_program(first, cwd, env.get("PATH"))
    if program is None:
        return None
    shell_level = env.get("SHLVL", "0")
    if not shell_level.isdigit() or int(shell_level) >= 999:
        return None
    env = dict(env)
    # What bash puts in its environment before exec'ing the command in its own place: the
    # level it was started at (raised at start, lowered for the exec), PWD (kept when it names
    # the working folder, else the physical path), OLDPWD only if it is a folder, and _.
    env["SHLVL"] = str(int(shell_level))
    pwd = env.get("PWD")
    if not (pwd and pwd.startswith("/") and _same_folder(pwd, cwd)):
        env["PWD"] = os.path.realpath(cwd)
    old = env.get("OLDPWD")
    if old is not None and not os.path.isdir(os.path.join(cwd, old)):
        del env["OLDPWD"]
    env["_"] = program
    return argv, program, env


def _same_folder(a, b):
    try:
        return os.path.samestat(os.stat(a), os.stat(b))
    except OSError:
        return False


def _find_program(word, cwd, path):
    """The file bash would exec for ``word``, named as bash names it in ``$_``; None when bash
    would fail (not found, not executable) or the search needs bash's own rules (relative or
    empty PATH entries)."""
    if "/" in word:
        return word if _executable(os.path.join(cwd, word)) else None
    if not path:
        return None
    for folder in path.split(":"):
        if not folder.startswith("/"):
            return None  # '' and '.' mean the working folder, and bash says so as ./word
        candidate = folder + word if folder.endswith("/") else folder + "/" + word  # as bash joins
        if _executable(candidate):
            return candidate
    return None


def _executable(path):
    try:
        return stat.S_ISREG(os.stat(path).st_mode) and os.access(path, os.X_OK)
    except OSError:
        return False
