"""``~/.ssh/config`` and ``/etc/ssh/ssh_config``, read the way OpenSSH 9.2's ``ssh`` reads them.

The differential tests (``tests/test_ssh_config_differential.py``) hold this module to the real
``ssh -G``.  What it follows, as ``readconf.c`` does:

* Files are read in order (the user's config, then the system config; an explicit config file
  alone, like ``ssh -F``) and every line is processed in order; a ``Host`` or ``Match`` line
  switches the following lines on or off for the host; the first value obtained for a keyword
  wins, except ``IdentityFile``/``CertificateFile`` which accumulate.
* ``Host`` patterns (``*``, ``?``, ``!negation``) are matched case-sensitively against the name
  as typed; ``Match host``/``originalhost`` lower-case both sides, ``Match user``/``localuser``
  do not.  ``Match all``, ``host``, ``originalhost``, ``user``, ``localuser`` are evaluated.
* ``Include`` globs; a relative path is under ``~/.ssh/`` (user config) or ``/etc/ssh/`` (system
  config); an included ``Host``/``Match`` does not leak into the including file.
* Every line is checked whether it applies or not: an unknown keyword is an error unless it
  matches ``IgnoreUnknown``; the keywords used here have their values checked as ssh does.

Refused with one line naming the file, line and keyword, because ``ssh`` would need something we
cannot reproduce exactly: ``Match exec`` (when it would run), ``Match canonical``/``final`` and
``CanonicalizeHostname yes|always`` (DNS canonicalization, a second pass).
"""

from __future__ import annotations

import functools
import glob
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ssh_scheduler.errors import ConfigError, plain_text, show_value
from ssh_scheduler.ssh_tokens import JumpHop, a2port, convtime, parse_jump, percent_dollar_expand

__all__ = [
    "KEYWORDS",
    "SYSTEM_SSH_CONFIG",
    "ConfigFile",
    "Evaluated",
    "SshLine",
    "evaluate",
    "parse_config_text",
    "read_config_file",
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
_ALIASES = {"identityfile2": "identityfile"}
_ONE_ARG = frozenset({"hostname", "user", "hostkeyalias", "ignoreunknown", "port", "identityfile"})
_FILE_LISTS = frozenset({"userknownhostsfile", "globalknownhostsfile"})
_ACCUMULATE = frozenset({"identityfile", "certificatefile"})
_CANONICALIZE = {"yes": True, "true": True, "always": True, "no": False, "false": False}
_WHITESPACE = " \t\r\n"
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


def _strdelim(text: str) -> tuple[str, str] | None:
    """``strdelim``: the next word (``"quoted"`` allowed, one ``=`` may separate) and the rest."""
    cut = next((i for i, ch in enumerate(text) if ch in _WHITESPACE + '"='), -1)
    if cut == -1:
        return text, ""
    if text[cut] == '"':
        close = text.find('"', cut + 1)
        if close == -1:
            return None
        word = text[:cut] + text[cut + 1 : close]
        return word, text[close + 1 :].lstrip(_WHITESPACE)
    word, rest = text[:cut], text[cut + 1 :].lstrip(_WHITESPACE)
    if text[cut] != "=" and rest.startswith("="):
        rest = rest[1:].lstrip(_WHITESPACE)
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
            if ch == "\\" and i + 1 < n and (
                text[i + 1] in "'\"\\" or (not quote and text[i + 1] == " ")
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
        line = raw.rstrip(_WHITESPACE + "\f")
        where = f"{plain_text(source)} line {number}"
        first = _strdelim(line)
        if first is None:
            raise ConfigError(f"{where}: unbalanced \" quote (close it)")
        keyword, rest = first
        if not keyword:
            nxt = _strdelim(rest)
            if nxt is None:
                raise ConfigError(f"{where}: unbalanced \" quote (close it)")
            keyword, rest = nxt
        if not keyword or keyword.startswith("#"):
            continue
        if _CONTROL_RE.search(line):
            raise ConfigError(f"{where}: the line contains a control character (remove it)")
        rest = rest.lstrip(_WHITESPACE)
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
        raise ConfigError(f"{plain_text(path)}: larger than {MAX_CONFIG_BYTES} bytes, not an ssh config")
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


# --------------------------------------------------------------------------------------------
# evaluation for one host


@functools.lru_cache(maxsize=4096)
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = ["(?s)"]
    parts.extend(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    return re.compile("".join(parts))


def match_pattern(text: str, pattern: str) -> bool:
    """``match_pattern``: ``*`` and ``?`` only, case-sensitive."""
    return _pattern_regex(pattern).fullmatch(text) is not None


def match_pattern_list(text: str, patterns: str, lower: bool) -> int:
    """``match_pattern_list``: 1 matched, -1 matched a negated pattern, 0 no match."""
    found = 0
    for sub in patterns.split(","):
        negated = sub.startswith("!")
        body = sub[1:] if negated else sub
        if lower:
            body = body.lower()
        if match_pattern(text, body):
            if negated:
                return -1
            found = 1
    return found


@dataclass
class Evaluated:
    """The values obtained for one host: keyword -> the line that set it (first wins)."""

    first: dict[str, SshLine] = field(default_factory=dict)
    identity_files: list[SshLine] = field(default_factory=list)
    jump: tuple[str, SshLine] | None = None
    """The ProxyJump value (``none`` included) and its line."""
    proxy_command: tuple[str, SshLine] | None = None
    matched_literal: bool = False
    """A ``Host`` pattern with a literal character, or a ``Match`` other than ``all``, applied."""

    def value(self, keyword: str) -> str | None:
        line = self.first.get(keyword)
        return line.args[0] if line is not None else None


@dataclass
class _State:
    host_arg: str
    local_user: str
    result: Evaluated
    preset_user: str | None
    preset_port: int | None
    ignore_unknown: str | None = None


def _refuse(line: SshLine, what: str) -> ConfigError:
    return ConfigError(f"{line.where}: {what}")


def _current_host(state: _State) -> str:
    hostname = state.result.value("hostname")
    if hostname is None:
        return state.host_arg
    try:
        return percent_dollar_expand(hostname, {"h": state.host_arg})
    except ValueError as err:
        raise _refuse(state.result.first["hostname"], f"HostName: {err}") from None


def _match(line: SshLine, state: _State) -> bool:
    """``match_cfg_line`` for the criteria we can evaluate exactly."""
    rest = line.rest
    result = True
    attributes = 0
    while rest:
        word = _strdelim(rest)
        if word is None:
            raise _refuse(line, "unbalanced \" quote in Match (close it)")
        attrib, rest = word
        if not attrib or attrib.startswith("#"):
            break
        negate = attrib.startswith("!")
        name = attrib[1:].lower() if negate else attrib.lower()
        if name == "all":
            after = _strdelim(rest) if rest else None
            if attributes > 1 or (after is not None and after[0] and not after[0].startswith("#")):
                raise _refuse(line, "Match 'all' cannot be combined with other criteria")
            return result and not negate
        attributes += 1
        if name in ("canonical", "final"):
            raise _refuse(
                line,
                f"Match {name} is not supported (it needs ssh's DNS canonicalization and "
                "second pass; use Match host or originalhost)",
            )
        nxt = _strdelim(rest) if rest else None
        if nxt is None or not nxt[0] or nxt[0].startswith("#"):
            raise _refuse(line, f"Match {name} needs an argument")
        arg, rest = nxt
        if name == "exec":
            if result:
                raise _refuse(
                    line,
                    "Match exec is not supported (we do not run commands from the ssh config; "
                    "use Match host, originalhost, user or localuser)",
                )
            continue
        if name == "host":
            hit = match_pattern_list(_current_host(state).lower(), arg, True) == 1
        elif name == "originalhost":
            hit = match_pattern_list(state.host_arg.lower(), arg, True) == 1
        elif name == "user":
            user = state.result.value("user") or state.local_user
            hit = match_pattern_list(user, arg, False) == 1
        elif name == "localuser":
            hit = match_pattern_list(state.local_user, arg, False) == 1
        else:
            raise _refuse(line, f"unsupported Match criterion {show_value(attrib)}")
        if hit == negate:
            result = False
    if attributes == 0:
        raise _refuse(line, "Match needs at least one criterion")
    return result


def _host_line(line: SshLine, host: str) -> tuple[bool, bool]:
    """(active, matched through a pattern with a literal character)."""
    active = literal = False
    for arg in line.args:
        if not arg:
            raise _refuse(line, "Host has an empty pattern")
        negated = arg.startswith("!")
        body = arg[1:] if negated else arg
        if match_pattern(host, body):
            if negated:
                return False, False
            active = True
            literal = literal or bool(body.strip("*?"))
    return active, literal


def _check_values(line: SshLine, keyword: str) -> None:
    """The value checks ssh makes on every line, applied or not, for the keywords we use."""
    args = line.args
    if keyword in _ONE_ARG and len(args) > 1:
        raise _refuse(line, f"{keyword} takes one value, got {len(args)} (ssh refuses this too)")
    if keyword == "port" and a2port(args[0]) <= 0:
        raise _refuse(line, f"Port {show_value(args[0])} is not a port number or service name")
    if keyword in _FILE_LISTS:
        if any(not a for a in args):
            raise _refuse(line, f"{keyword} has an empty argument")
        if any(a.lower() == "none" for a in args) and len(args) > 1:
            raise _refuse(line, f"{keyword} 'none' must appear alone")
    if keyword == "connecttimeout" and args[0] != "none" and convtime(args[0]) < 0:
        raise _refuse(line, f"ConnectTimeout {show_value(args[0])} is not a time (like 10 or 1m)")
    if keyword == "canonicalizehostname" and args[0].lower() not in _CANONICALIZE:
        raise _refuse(line, f"CanonicalizeHostname {show_value(args[0])} is not yes, no or always")
    if keyword == "proxyjump":
        try:
            parse_jump(line.rest.lstrip(_WHITESPACE + "="))
        except ValueError as err:
            raise _refuse(line, f"invalid ProxyJump: {err}") from None


def _apply(line: SshLine, state: _State, active: bool) -> None:
    keyword = _ALIASES.get(line.keyword, line.keyword)
    if keyword not in KEYWORDS:
        ignored = state.ignore_unknown
        if ignored is not None and match_pattern_list(keyword, ignored, True) == 1:
            return
        raise _refuse(
            line, f"unknown keyword {show_value(line.spelled)} (ssh refuses it too; fix the "
            "spelling, or list it in IgnoreUnknown)"
        )
    _check_values(line, keyword)
    if not active:
        return
    result = state.result
    if keyword == "ignoreunknown" and state.ignore_unknown is None:
        state.ignore_unknown = line.args[0]
    if keyword in _ACCUMULATE:
        if keyword == "identityfile":
            result.identity_files.append(line)
        return
    if keyword == "proxyjump":
        value = line.rest.lstrip(_WHITESPACE + "=")
        if result.proxy_command is None and result.jump is None:
            result.jump = (value, line)
        return
    if keyword == "proxycommand":
        jump_real = result.jump is not None and result.jump[0].lower() != "none"
        if result.proxy_command is None and not jump_real:
            result.proxy_command = (line.rest.lstrip(_WHITESPACE + "="), line)
        return
    if keyword == "user" and state.preset_user is not None:
        return
    if keyword == "port" and state.preset_port is not None:
        return
    result.first.setdefault(keyword, line)


def _walk(config: ConfigFile, state: _State, active: list[bool], never: bool) -> None:
    for line in config.lines:
        if line.keyword == "host":
            hit, literal = _host_line(line, state.host_arg)
            active[0] = hit and not never
            state.result.matched_literal |= active[0] and literal
        elif line.keyword == "match":
            hit = _match(line, state)
            active[0] = hit and not never
            state.result.matched_literal |= active[0] and [a.lower() for a in line.args] != ["all"]
        elif line.keyword == "include":
            outer = active[0]
            for sub in line.includes:
                _walk(sub, state, active, never or not outer)
                active[0] = outer
        else:
            _apply(line, state, active[0])


def evaluate(
    host_arg: str,
    configs: Sequence[ConfigFile],
    *,
    local_user: str,
    preset_user: str | None = None,
    preset_port: int | None = None,
    preset_jump: str | None = None,
) -> Evaluated:
    """Process the config files for ``host_arg`` as ``ssh [-l user] [-p port] [-J jump] host``.

    A preset user/port/jump (from the command line in ssh) wins over the files, as in ssh.
    """
    result = Evaluated()
    state = _State(host_arg, local_user, result, preset_user, preset_port)
    if preset_user is not None:
        result.first["user"] = SshLine("user", (preset_user,), preset_user, "command line", 0)
    if preset_port is not None:
        text = str(preset_port)
        result.first["port"] = SshLine("port", (text,), text, "command line", 0)
    if preset_jump is not None:
        result.jump = (preset_jump, SshLine("proxyjump", (preset_jump,), preset_jump, "-J", 0))
    for config in configs:
        _walk(config, state, [True], False)
    line = result.first.get("canonicalizehostname")
    if line is not None and _CANONICALIZE[line.args[0].lower()]:
        raise _refuse(
            line,
            "CanonicalizeHostname is not supported (it rewrites host names through DNS; write "
            "the full name in HostName instead)",
        )
    return result


def jump_hops(evaluated: Evaluated) -> tuple[tuple[JumpHop, ...], SshLine | None]:
    if evaluated.jump is None:
        return (), None
    value, line = evaluated.jump
    return parse_jump(value), line
