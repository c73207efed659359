"""The open-file limit a batch needs: each host holds a connection, each running job its output
files.  Raised at the start as far as the hard limit allows; beyond it, one line with the fix."""

from __future__ import annotations

import logging
import resource

from ssh_scheduler.errors import ConfigError

__all__ = ["files_needed", "raise_open_files_limit"]

log = logging.getLogger(__name__)

BASE_FILES = 64  # the interpreter, the journal, the control socket, hashing, logs
FILES_PER_HOST = 4  # its connection, and the .out/.err of a job or two starting or ending


def files_needed(hosts: int) -> int:
    return BASE_FILES + FILES_PER_HOST * hosts


def raise_open_files_limit(hosts: int) -> int:
    """Make sure ``hosts`` hosts fit under RLIMIT_NOFILE: raise the soft limit to the hard one
    when it is too low; returns the soft limit now in force."""
    need = files_needed(hosts)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(
            f"{hosts} hosts need about {need} open files, but this shell allows at most {hard} "
            f"(hard limit): run 'ulimit -n {need}' as root first (or raise nofile in "
            "/etc/security/limits.conf), or use fewer hosts"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log.info("open-file limit raised from %d to %s for %d hosts", soft, hard, hosts)
    return hard
