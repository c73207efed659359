"""What a coordinator checks of an agent that answers, or does not: why it ended before its first
answer (and the fix), and whether the work root it reports is the one configured (and where it
really is).  Pure."""

from __future__ import annotations

import posixpath

from ssh_scheduler.transport.base import printable

NO_PYTHON_FIX = "install python3 (Debian/Ubuntu: apt install python3) or put it on the PATH of non-interactive ssh logins"


def agent_start_cause(status: int | None, stderr: str, refusal: str, workdir: str) -> str:
    """Why an agent ended before its first answer, and the fix: from its refusal line, or else
    its exit status and what the login shell or python3 wrote on stderr."""
    if refusal:
        return refusal
    said = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = printable(said[-1], 200) if said else ""
    if status == 127 or any("python3" in line and "not found" in line for line in said):
        return f"python3 was not found on the host{f' ({last})' if last else ''}; fix: {NO_PYTHON_FIX}"
    ended = f"the agent exited with status {status}" if status is not None else "the agent exited"
    if last:
        return f"{ended} before answering: {last}"
    return f"{ended} before answering, saying nothing; is python3 on the host working? (workdir: {printable(workdir)})"


def root_matches(root: str, workdir: str) -> bool:
    """Is the work root an agent reports the one configured?  A coordinator never takes a path
    from a host on trust: a false agent (once, one listening on a socket we reached) answered
    ``/tmp/evilroot`` and received our inputs.  ``~`` cannot be checked here (the home folder
    is the host's to know), so the root must at least end with the rest of the path."""
    if not root.startswith("/") or posixpath.normpath(root) != root or "\x00" in root:
        return False
    if workdir.startswith("~"):
        rest = workdir.split("/", 1)[1] if "/" in workdir else ""
        rest = posixpath.normpath(rest) if rest else ""
        return not rest or root.endswith("/" + rest)
    if workdir.startswith("/"):
        return root == posixpath.normpath(workdir)
    return root.endswith("/" + posixpath.normpath(workdir))


def work_root(root: str, real: str | None, workdir: str) -> str | None:
    """The folder every path we name on a host starts with, from the agent's hello: ``root``,
    the workdir as the host expanded it (:func:`root_matches`), and ``real``, where it really is
    (the agent resolved the links above it, each ours or root's); None when either is wrong.
    The root itself is never a link, so ``real`` ends with the same name."""
    if not root_matches(root, workdir):
        return None
    if real is None:  # an agent that does not say
        return root
    if not real.startswith("/") or "\x00" in real or posixpath.normpath(real) != real:
        return None
    return real if posixpath.basename(real) == posixpath.basename(root) else None
