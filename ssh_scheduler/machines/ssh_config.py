"""``~/.ssh/config`` and ``/etc/ssh/ssh_config`` files, split into lines the way OpenSSH 9.2's
``readconf.c`` splits them (``strdelim`` for the keyword, ``argv_split`` for the arguments:
quotes, backslash escapes, ``#`` comments, ``Key=value``), with their ``Include`` files read:
globs, relative paths under ``~/.ssh/`` (user config) or ``/etc/ssh/`` (system config), nested
at most 16 deep, included files (and ``~/.ssh/config``) with unsafe owner or permissions refused
as Debian's ssh refuses them (:mod:`ssh_scheduler.machines.ssh_include`).

Like ssh, this reads bytes: lines end at ``\n`` only (a file with ``\r`` endings alone is one
long line), bytes that are not UTF-8 are kept (``surrogateescape``) for the evaluation to refuse
only where a value is used, and a UTF-8 byte order mark is part of the first keyword (which ssh
then refuses).

Which lines apply to a host is :mod:`ssh_scheduler.machines.ssh_evaluate`; the values ssh then connects
with, :mod:`ssh_scheduler.machines.ssh_resolve`.  ``tests/test_ssh_config_differential.py`` holds the
three to the real ``ssh -G``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.machines.ssh_glob import unended_set
from ssh_scheduler.machines.ssh_include import glob_home, include_glob, secure_permissions
from ssh_scheduler.machines.ssh_tokens import ascii_lower

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

# Every keyword of OpenSSH 9.2 as Debian builds it: tests/test_ssh_config_differential.py
# derives the list from the ssh binary and asks ssh about each, both ways.
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
    kbdinteractivedevices keepalive kerberosauthentication kerberostgtpassing kexalgorithms
    knownhostscommand localcommand localforward loglevel logverbose macs match
    nohostauthenticationforlocalhost numberofpasswordprompts passwordauthentication
    permitlocalcommand permitremoteopen pkcs11provider port preferredauthentications protocol
    protocolkeepalives proxycommand proxyjump proxyusefdpass pubkeyacceptedalgorithms
    pubkeyacceptedkeytypes pubkeyauthentication rekeylimit remotecommand remoteforward
    requesttty requiredrsasize revokedhostkeys rhostsauthentication rhostsrsaauthentication
    rsaauthentication securitykeyprovider sendenv serveralivecountmax serveraliveinterval
    sessiontype setenv setuptimeout skeyauthentication smartcarddevice stdinnull
    streamlocalbindmask streamlocalbindunlink stricthostkeychecking syslogfacility tcpkeepalive
    tisauthentication tunnel tunneldevice updatehostkeys useblacklistedkeys useprivilegedport
    user userknownhostsfile userknownhostsfile2 useroaming usersh verifyhostkeydns visualhostkey
    xauthlocation
"""
KEYWORDS = frozenset(_KEYWORD_LIST.split())
WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class SshLine:
    """One ``Keyword args...`` line."""

    keyword: str
    """Lower-cased (ASCII only, as ssh), as written (aliases not folded)."""
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
    user_config: bool = True
    """From a user file (``~/.ssh/config``, ``-F``, their Includes), not the system one: ssh
    keeps the same IdentityFile from both."""

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


def _trim_line(raw: str) -> str:
    """Trailing white space and form feeds off, as ``process_config_line`` strips them: never
    the first character (a line of one form feed stays, and ssh complains about it)."""
    return raw[:1] + raw[1:].rstrip(WHITESPACE + "\f")


def _no_value(keyword: str) -> str:
    if keyword.startswith("\ufeff"):
        return (
            "the file starts with a UTF-8 byte order mark, which ssh refuses too (save the file "
            "without it)"
        )
    if not keyword.isprintable():
        return f"a stray {show_value(keyword)} on the line, which ssh refuses too (remove it)"
    return f"no value after {show_value(keyword)} (give one)"


def parse_config_text(
    text: str,
    *,
    source: str,
    user_config: bool = True,
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
        line = _trim_line(raw)
        where = f"{plain_text(source)} line {number}"
        # an unbalanced quote in the keyword: ssh skips the line, without a word
        first = strdelim(line)
        if first is None:
            continue
        keyword, rest = first
        if not keyword:
            nxt = strdelim(rest)
            if nxt is None:
                continue
            keyword, rest = nxt
        if not keyword or keyword.startswith("#"):
            continue
        rest = rest.lstrip(WHITESPACE)
        if not rest:
            raise ConfigError(f"{where}: {_no_value(keyword)}")
        args = _argv_split(rest)
        if args is None:
            raise ConfigError(f"{where}: unbalanced quote in {show_value(keyword)} (close it)")
        lowered = ascii_lower(keyword)
        includes: tuple[ConfigFile, ...] = ()
        if lowered == "include" and read_include is not None:
            includes = tuple(
                parse_config_text(
                    sub_text,
                    source=sub_source,
                    user_config=user_config,
                    read_include=read_include,
                    _depth=_depth + 1,
                )
                for pattern in _include_patterns(args, user_config, where)
                for sub_source, sub_text in read_include(pattern, source)
            )
        lines.append(
            SshLine(lowered, tuple(args), rest, source, number, includes, keyword, user_config)
        )
    return ConfigFile(source, tuple(lines), user_config)


def _include_patterns(args: Sequence[str], user_config: bool, where: str) -> list[str]:
    """The patterns ssh globs: relative ones under ``~/.ssh/`` (its ``~`` is glob's: $HOME)
    or ``/etc/ssh/``."""
    patterns = []
    for arg in args:
        if not arg:
            raise ConfigError(f"{where}: Include has an empty argument (remove it)")
        if arg.startswith("~") and not user_config:
            raise ConfigError(
                f"{where}: Include {show_value(arg)}: '~' is not allowed in the system config"
            )
        if unended_set(arg):
            raise ConfigError(
                f"{where}: Include {show_value(arg)}: a [:class:] takes the ']' that would end its "
                "[...] set, so the set never ends (ssh itself crashes reading it); end the set "
                "with one more ']'"
            )
        if not arg.startswith(("/", "~")):
            arg = ("~/.ssh/" if user_config else "/etc/ssh/") + arg
        patterns.append(arg)
    return patterns


def _read_config_bytes(path: str, check_permissions: bool) -> str | None:
    """A config file's text; ``None`` when it does not exist (ssh skips it)."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            if check_permissions and not secure_permissions(info, os.getuid()):
                raise ConfigError(
                    f"{plain_text(path)}: bad owner or permissions (ssh refuses it too; make it "
                    "yours and not writable by others, nor by a group that holds anybody else: "
                    "chmod go-w)"
                )
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:  # (python's open refuses it) ssh opens it and reads no line
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
    return data.decode("utf-8", "surrogateescape")


def read_config_file(
    path: Path,
    *,
    environ: Mapping[str, str] | None = None,
    user_config: bool = True,
    check_permissions: bool = False,
) -> ConfigFile | None:
    """Read and parse one config file with its Includes; ``None`` if it does not exist.

    ``environ`` (default: this process's) gives the ``$HOME`` that ``~`` means in an Include,
    as glob(3) reads it for ssh; included files are always checked as ssh checks them."""
    home = glob_home(os.environ if environ is None else environ)

    def read_include(pattern: str, _including: str) -> list[tuple[str, str]]:
        out = []
        for found in include_glob(pattern, home):
            text = _read_config_bytes(found, check_permissions=True)
            if text is not None:
                out.append((found, text))
        return out

    text = _read_config_bytes(str(path), check_permissions)
    if text is None:
        return None
    return parse_config_text(
        text, source=str(path), user_config=user_config, read_include=read_include
    )
