"""The real ``ssh -G`` as a reference, run hermetically.

``ssh`` takes the local user and home from the password database, not from ``$HOME``, so each
call runs under nss_wrapper (``libnss-wrapper``, installed by scripts/test) with a passwd file
that names a made-up user whose home is a temporary folder.  ``-F`` names the only config file,
so neither the machine's ``/etc/ssh/ssh_config`` nor anybody's ``~/.ssh/config`` is read (unless
a test asks for the system file on purpose).
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ssh_scheduler.machines.ssh_tokens import LocalAccount

NSS_WRAPPER = "libnss_wrapper.so"


@dataclass(frozen=True)
class Reference:
    account: LocalAccount
    env: dict[str, str]

    def run(
        self, host: str, config: Path | None, *args: str
    ) -> tuple[int, dict[str, list[str]], str]:
        """``ssh -G [-F config] args host``: (exit status, keyword -> values, stderr)."""
        command = ["ssh", "-G", *(["-F", str(config)] if config is not None else []), *args, host]
        done = subprocess.run(
            command,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        values: dict[str, list[str]] = {}
        for line in done.stdout.splitlines():
            key, _, value = line.partition(" ")
            values.setdefault(key, []).append(value)
        return done.returncode, values, done.stderr


def account_env(root: Path, home: Path, user: str) -> dict[str, str]:
    """Environment that makes a process see a passwd entry ``user`` with our uid (so ssh's
    permission checks pass) and home ``home``, through nss_wrapper; also sets ``$HOME``."""
    passwd = root / "nss_passwd"
    group = root / "nss_group"
    uid, gid = os.getuid(), os.getgid()
    passwd.write_text(f"{user}:x:{uid}:{gid}:Test User:{home}:/bin/sh\n")
    group.write_text(f"{user}:x:{gid}:\n")
    return {
        "LD_PRELOAD": NSS_WRAPPER,
        "NSS_WRAPPER_PASSWD": str(passwd),
        "NSS_WRAPPER_GROUP": str(group),
        "HOME": str(home),
    }


def make_reference(root: Path, user: str = "localuser") -> Reference:
    """``ssh -G`` as ``user`` with home ``root/home``; ``$USER``/``$LOGNAME`` lie on purpose."""
    home = root / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "USER": "somebody-else",
        "LOGNAME": "somebody-else",
        "LANG": "C",
        **account_env(root, home, user),
    }
    account = LocalAccount(user, str(home), os.getuid(), socket.gethostname())
    return Reference(account, env)
