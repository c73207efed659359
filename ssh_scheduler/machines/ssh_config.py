"""``~/.ssh/config`` and ``/etc/ssh/ssh_config`` files, split into lines the way OpenSSH 9.2's
``readconf.c`` splits them (``strdelim`` for the keyword, ``argv_split`` for the arguments:
quotes, backslash escapes, ``#`` comments, ``Key=value``), with their ``Include`` files read:
globs, relative paths under ``~/.ssh/`` (user config) or ``/etc/ssh/`` (system config), nested
at most 16 deep, group- or world-writable included files refused as ssh refuses them.

Which lines apply to a host is :mod:`ssh_scheduler.machines.ssh_evaluate`; the values ssh then connects
with, :mod:`ssh_scheduler.machines.ssh_resolve`.  ``tests/test_ssh_config_differential.py`` holds the
three to the real ``ssh -G``.
"""

from __future__ import annotations

import glob
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ssh_scheduler.errors import ConfigError, plain_text, show_value

__all__ = [
    "KEYWORDS",
    "SYSTEM_SSH_CONFIG",
    "WHITESPACE",
    "ConfigFile",
    "SshLine",
    "parse_config_text",
    "read_config_file",
    "strdelim",
]

SYSTEM_SSH_CONFIG = Path("/etc/ssh/ssh_config")
MAX_INCLUDE_DEPTH = 16
MAX_CONFIG_BYTES = 1 << 20

# Every keyword of OpenSSH 9.2 as Debian builds it (checked against the real binary).
_KEYWORD_LIST = """
    addkeystoagent addressfamily afstokenpassing batchmode bindaddress bindinterface
    canonicaldomains canonicalizefallbacklocal canonicalizehostname canonicalizemaxdots
    canonicalizepermittedcnames casignaturealgorithms certificatefile
    challengeresponseauthentication checkhostip cipher ciphers clearallforwardings compression
    compressionlevel connectionattempts connecttimeout controlmaster controlpath controlpersist
    dsaauthentication dynamicforward enableescapecommandline enablesshkeysign escapechar
    exitonforwardfailure fallbacktorsh fingerprinthash forkafterauthentication forwardagent
    forwardx11 forwardx11timeout forwardx11trusted gatewayports globalknownhostsfile
    globalknownhostsfile2 gssapiauthentication gssapiclientidentity gssapidelegatecredentials
    gssapikexalgorithms gssapikeyexchange gssapirenewalforcesrekey gssapiserveridentity
    gssapitrustdns hashknownhosts host hostbasedacceptedalgorithms hostbasedauthentication
    hostbasedkeytypes hostkeyalgorithms hostkeyalias hostname identitiesonly identityagent
    identityfile identityfile2 ignoreunknown include ipqos kbdinteractiveauthentication
    kbdinteractivedevices keepalive kerberosauthentication kerberostgtpassing knownhostscommand
    localcommand localforward loglevel logverbose macs match nohostauthenticationforlocalhost
    numberofpasswordprompts passwordauthentication permitlocalcommand permitremoteopen
    pkcs11provider port preferredauthentications protocol protocolkeepalives proxycommand proxyjump
    proxyusefdpass pubkeyacceptedalgorithms pubkeyacceptedkeytypes pubkeyauthentication rekeylimit
    remotecommand remoteforward requesttty requiredrsasize revokedhostkeys rhostsauthentication
    rhostsrsaauthentication securitykeyprovider sendenv serveralivecountmax serveraliveinterval
    sessiontype setenv setuptimeout skeyauthentication smartcarddevice stdinnull streamlocalbindmask
    streamlocalbindunlink stricthostkeychecking syslogfacility tcpkeepalive tisauthentication tunnel
    tunneldevice updatehostkeys useblacklistedkeys useprivilegedport user userknownhostsfile
    userknownhostsfile2 useroaming usersh verifyhostkeydns visualhostkey xauthlocation
"""
KEYWORDS = frozenset(_KEYWORD_LIST.split())
WHITESPACE = " \t\r\n"
_CONTROL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class SshLine:
    """One ``Keyword args...`` line."""

    keyword: str
    """Lower-cased, as written (aliases not folded)."""
    args: tuple[str, ...]
    """Split as ``argv_split`` does (quotes, backslash escapes, ``#`` comments)."""
    rest: str
    """The raw text after the keyword (``ProxyCommand``, ``ProxyJump`` and ``Match`` use it)."""
    source: str
    number: int
    includes: tuple[ConfigFile, ...] = ()
    """For ``Include``: the files it named, parsed, in glob order."""
    spelled: str = ""
    """The keyword as written, for messages."""

    @property
    def where(self) -> str:
        return f"{plain_text(self.source)} line {self.number}"


@dataclass(frozen=True, slots=True)
class ConfigFile:
    source: str
    lines: tuple[SshLine, ...]
    user_config: bool = True
    """Relative ``Include`` paths are under ``~/.ssh/`` (user) or ``/etc/ssh/`` (system)."""


def strdelim(text: str) -> tuple[str, str] | None:
    """``strdelim``: the next word (``"quoted"`` allowed, one ``=`` may separate) and the rest."""
    cut = next((i for i, ch in enumerate(text) if ch in WHITESPACE + '"='), -1)
    if cut == -1:
        return text, ""
    if text[cut] == '"':
        close = text.find('"', cut + 1)
        if close == -1:
            return None
        word = text[:cut] + text[cut + 1 : close]
        return word, text[close + 1 :].lstrip(WHITESPACE)
    word, rest = text[:cut], text[cut + 1 :].lstrip(WHITESPACE)
    if text[cut] != "=" and rest.startswith("="):
        rest = rest[1:].lstrip(WHITESPACE)
    return word, rest


def _argv_split(text: str) -> list[str] | None:
    """``argv_split`` with comments: ``None`` when a quote is not closed."""
    args: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] in " \t":
            i += 1
            continue
        if text[i] == "#":
            break
        quote = ""
        word: list[str] = []
        while i < n:
            ch = text[i]
            if (
                ch == "\\"
                and i + 1 < n
                and (text[i + 1] in "'\"\\" or (not quote and text[i + 1] == " "))
            ):
                word.append(text[i + 1])
                i += 2
                continue
            if not quote and ch in " \t":
                break
            if not quote and ch in "\"'":
                quote = ch
            elif quote and ch == quote:
                quote = ""
            else:
                word.append(ch)
            i += 1
        if quote:
            return None
        args.append("".join(word))
    return args


IncludeReader = Callable[[str, str], Sequence[tuple[str, str]]]
"""``(glob pattern, including file)`` -> ``[(path, text), ...]``."""


def parse_config_text(
    text: str,
    *,
    source: str,
    user_config: bool = True,
    home: str = "~",
    read_include: IncludeReader | None = None,
    _depth: int = 0,
) -> ConfigFile:
    """Split a config file into lines; ``Include`` files are read (and parsed) right away."""
    if _depth > MAX_INCLUDE_DEPTH:
        raise ConfigError(
            f"{plain_text(source)}: Include nested more than {MAX_INCLUDE_DEPTH} deep "
            "(an Include loop? remove it)"
        )
    lines: list[SshLine] = []
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip(WHITESPACE + "\f")
        where = f"{plain_text(source)} line {number}"
        first = strdelim(line)
        if first is None:
            raise ConfigError(f'{where}: unbalanced " quote (close it)')
        keyword, rest = first
        if not keyword:
            nxt = strdelim(rest)
            if nxt is None:
                raise ConfigError(f'{where}: unbalanced " quote (close it)')
            keyword, rest = nxt
        if not keyword or keyword.startswith("#"):
            continue
        if _CONTROL_RE.search(line):
            raise ConfigError(f"{where}: the line contains a control character (remove it)")
        rest = rest.lstrip(WHITESPACE)
        if not rest:
            raise ConfigError(f"{where}: no value after {show_value(keyword)} (give one)")
        args = _argv_split(rest)
        if args is None:
            raise ConfigError(f"{where}: unbalanced quote in {show_value(keyword)} (close it)")
        lowered = keyword.lower()
        includes: tuple[ConfigFile, ...] = ()
        if lowered == "include" and read_include is not None:
            includes = tuple(
                parse_config_text(
                    sub_text,
                    source=sub_source,
                    user_config=user_config,
                    home=home,
                    read_include=read_include,
                    _depth=_depth + 1,
                )
                for pattern in _include_patterns(args, user_config, home, where)
                for sub_source, sub_text in read_include(pattern, source)
            )
        lines.append(SshLine(lowered, tuple(args), rest, source, number, includes, keyword))
    return ConfigFile(source, tuple(lines), user_config)


def _include_patterns(args: Sequence[str], user_config: bool, home: str, where: str) -> list[str]:
    patterns = []
    for arg in args:
        if not arg:
            raise ConfigError(f"{where}: Include has an empty argument (remove it)")
        if arg.startswith("~") and not user_config:
            raise ConfigError(
                f"{where}: Include {show_value(arg)}: '~' is not allowed in the system config"
            )
        if arg.startswith("~"):
            arg = home.rstrip("/") + arg[1:] if arg == "~" or arg.startswith("~/") else arg
        elif not arg.startswith("/"):
            arg = (f"{home.rstrip('/')}/.ssh/" if user_config else "/etc/ssh/") + arg
        patterns.append(arg)
    return patterns


def _read_config_bytes(path: str, check_permissions: bool) -> str | None:
    """A config file's text; ``None`` when it does not exist (ssh skips it)."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            if stat.S_ISDIR(info.st_mode):
                return ""
            if check_permissions and (
                (info.st_uid not in (0, os.getuid())) or info.st_mode & 0o022
            ):
                raise ConfigError(
                    f"{plain_text(path)}: bad owner or permissions (ssh refuses it too; make it "
                    "yours and not writable by group or others: chmod go-w)"
                )
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return ""
    except OSError as err:
        raise ConfigError(
            f"cannot read ssh config {plain_text(path)}: {err.strerror or err} (check it is "
            "readable)"
        ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{plain_text(path)}: larger than {MAX_CONFIG_BYTES} bytes, not an ssh config"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{plain_text(path)}: not valid UTF-8 at byte {err.start} (save it as UTF-8)"
        ) from None


def _glob_include(pattern: str, _including: str) -> list[tuple[str, str]]:
    out = []
    for path in sorted(glob.glob(pattern)):
        text = _read_config_bytes(path, check_permissions=True)
        if text is not None:
            out.append((path, text))
    return out


def read_config_file(
    path: Path, *, home: str, user_config: bool = True, check_permissions: bool = False
) -> ConfigFile | None:
    """Read and parse one config file with its Includes; ``None`` if it does not exist."""
    text = _read_config_bytes(str(path), check_permissions)
    if text is None:
        return None
    return parse_config_text(
        text, source=str(path), user_config=user_config, home=home, read_include=_glob_include
    )
