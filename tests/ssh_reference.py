"""The real ``ssh -G`` as a reference, run hermetically.

``ssh`` takes the local user and home from the password database, not from ``$HOME``, so each
call runs under nss_wrapper (``libnss-wrapper``, installed by scripts/test) with a passwd file
that names a made-up user whose home is a temporary folder.  ``-F`` names the only config file,
so neither the machine's ``/etc/ssh/ssh_config`` nor anybody's ``~/.ssh/config`` is read (unless
a test asks for the system file on purpose).

Where the answer depends on the account database itself (``Include ~user/...``, Debian's
group-writable rule), our side must see the same made-up database: :meth:`Reference.ours` runs
our resolution in a child Python under the same nss_wrapper environment (``python -m
tests.ssh_reference HOST [CONFIG]`` prints it as JSON).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines.config import SshConfigs
from ssh_scheduler.machines.ssh_tokens import LocalAccount

NSS_WRAPPER = "libnss_wrapper.so"
REPO = Path(__file__).resolve().parent.parent
_IDENTITY_LINE = re.compile(r"^debug1: identity file (.*) type -?[0-9]+$", re.MULTILINE)


@dataclass(frozen=True)
class Reference:
    account: LocalAccount
    env: dict[str, str]

    def run(
        self, host: str, config: Path | None, *args: str, env: dict[str, str] | None = None
    ) -> tuple[int, dict[str, list[str]], str]:
        """``ssh -G [-F config] args host``: (exit status, keyword -> values, stderr)."""
        command = ["ssh", "-G", *(["-F", str(config)] if config is not None else []), *args, host]
        done = subprocess.run(
            command,
            env=self.env if env is None else env,
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
            errors="surrogateescape",
        )
        values: dict[str, list[str]] = {}
        for line in done.stdout.splitlines():
            key, _, value = line.partition(" ")
            values.setdefault(key, []).append(value)
        return done.returncode, values, done.stderr

    def identity_paths(self, host: str, config: Path, env: dict[str, str] | None = None) -> list[str]:
        """The key files ssh tries when it connects, expanded as it expands them then: ``ssh -v``
        through a ProxyCommand that ends at once, after ssh has loaded its identities (a
        ProxyCommand given on the command line wins over the config's ProxyJump/ProxyCommand,
        which leaves the values compared here alone)."""
        done = subprocess.run(
            ["ssh", "-v", "-F", str(config), "-o", "ProxyCommand=true",
             "-o", "BatchMode=yes", host, "true"],
            env=self.env if env is None else env,
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
            errors="surrogateescape",
        )
        # each key is followed by its "-cert" companion
        return _IDENTITY_LINE.findall(done.stderr)[0::2]

    def ours(self, host: str, config: Path | None = None) -> dict[str, object]:
        """Our resolution (``ssh -F config host``, or ~/.ssh/config then /etc/ssh/ssh_config),
        computed in a child under this reference's environment: the SshHost fields, or
        ``{"error": message}``."""
        done = subprocess.run(
            [sys.executable, "-m", "tests.ssh_reference", host,
             *([str(config)] if config is not None else [])],
            env={**self.env, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stderr
        result: dict[str, object] = json.loads(done.stdout)
        return result


def account_env(
    root: Path,
    home: Path,
    user: str,
    *,
    gid: int | None = None,
    passwd: Sequence[str] = (),
    group: Sequence[str] = (),
) -> dict[str, str]:
    """Environment that makes a process see a passwd entry ``user`` with our uid (so ssh's
    permission checks pass) and home ``home``, through nss_wrapper; also sets ``$HOME``.
    ``gid`` is its primary group (default ours, as its private group); ``passwd``/``group``
    are further lines of those files."""
    passwd_file = root / "nss_passwd"
    group_file = root / "nss_group"
    uid = os.getuid()
    gid = os.getgid() if gid is None else gid
    passwd_file.write_text(
        "".join(f"{line}\n" for line in (f"{user}:x:{uid}:{gid}:Test User:{home}:/bin/sh", *passwd))
    )
    private = [] if any(line.split(":")[2] == str(gid) for line in group) else [f"{user}:x:{gid}:"]
    group_file.write_text("".join(f"{line}\n" for line in (*private, *group)))
    return {
        "LD_PRELOAD": NSS_WRAPPER,
        "NSS_WRAPPER_PASSWD": str(passwd_file),
        "NSS_WRAPPER_GROUP": str(group_file),
        "HOME": str(home),
    }


def make_reference(
    root: Path,
    user: str = "localuser",
    *,
    gid: int | None = None,
    passwd: Sequence[str] = (),
    group: Sequence[str] = (),
) -> Reference:
    """``ssh -G`` as ``user`` with home ``root/home``; ``$USER``/``$LOGNAME`` lie on purpose."""
    home = root / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "USER": "somebody-else",
        "LOGNAME": "somebody-else",
        "LANG": "C",
        **account_env(root, home, user, gid=gid, passwd=passwd, group=group),
    }
    account = LocalAccount(user, str(home), os.getuid(), socket.gethostname())
    return Reference(account, env)


def _main(argv: list[str]) -> int:
    host = argv[0]
    config = Path(argv[1]) if len(argv) > 1 else None
    try:
        resolved = SshConfigs(config).resolve(host)
    except ConfigError as err:
        print(json.dumps({"error": str(err)}))
    else:
        print(json.dumps(dataclasses.asdict(resolved)))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
