"""Commands, names and machine values can never inject shell syntax; commands arrive verbatim.

Table-driven, on the SSH test cluster, through the real CLIs:

* one batch of hostile payloads, each wrapped as ``printf '%s\\n' <quoted payload>``: the job's
  ``.out`` must be the payload exactly (so quoting survived every hop), plus raw commands whose
  shell meaning is checked (the command reaches bash exactly as written);
* one ``--commands`` batch of hostile but valid job names: each job prints its own
  ``$SSH_SCHEDULER_JOB`` (names travel as data: environment, file and folder names);
* hostile batch lines, job names and machine files that must be refused before anything runs:
  exit 2, a one-line error, nothing on the host, nothing in ``job_results``.

Every payload that *would* create a file if injected names ``pwn_*`` (in the job folder or /tmp);
the tests check that none exists on the host or here.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ssh_scheduler.coordinator.remote import RemoteOptions, execute_remote
from ssh_scheduler.machines.config import load_machine
from tests.cluster import Cluster, Host

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "ssh_scheduler"]

PAYLOADS: list[str] = [
    "'; touch /tmp/pwn_semicolon #",
    "; touch /tmp/pwn_plain",
    "$(touch /tmp/pwn_subst)",
    "`touch /tmp/pwn_backtick`",
    "$(touch pwn_subst_here)",
    "$(id)",
    "`id`",
    "${HOME}",
    "$HOME",
    "$((1+1))",
    "${IFS}",
    "$$ $! $? $# $@ $* $0 $1",
    '"; touch /tmp/pwn_dq; echo "',
    "'",
    '"',
    "''",
    "\\",
    "\\'",
    '\\"',
    "\\n and \\t stay backslashes",
    "%s%n%x%%",
    "a && touch /tmp/pwn_and",
    "a || touch /tmp/pwn_or",
    "a | tee /tmp/pwn_pipe",
    "> /tmp/pwn_redirect",
    "< /etc/passwd",
    "<(touch /tmp/pwn_procsub)",
    "& touch /tmp/pwn_bg &",
    "\ttab\tseparated\t",
    "  leading and trailing spaces  ",
    "*",
    "~",
    "~root/x",
    "!!",
    "!$",
    "#not a comment",
    "-rf",
    "--machines h1.yaml",
    "-- --help",
    "-e",
    "-n",
    "ünïcødé ✓ 日本語 🚀",
    "\u202eRTL override",
    "\x1b[31mred\x1b[0m",
    "\x7f\x01\x02",
    "{a,b}",
    "[abc]",
    "x=1 y=2",
    "eval touch /tmp/pwn_eval",
    "\\$(touch /tmp/pwn_escaped)",
    "x" * 100_000,  # a very long line (the shell gets it as one argument, under 128 KiB)
]

# (command, expected stdout): raw commands, checking that bash sees exactly what was written.
RAW: list[tuple[str, str]] = [
    ("echo $((6*7))", "42\n"),
    ('printf "[%s]\\n" "$CUDA_VISIBLE_DEVICES"', "[]\n"),
    ("echo 'single'\"double\"\\escaped", "singledoubleescaped\n"),
    ("echo `echo backtick` $(echo dollar)", "backtick dollar\n"),
    ('a=1; b=2; echo "$a$b"', "12\n"),
    ("printf '%s' $'a\\tb\\nc'", "a\tb\nc"),
    ('cat <<< "here string"', "here string\n"),
    ('echo "ünï ✓"', "ünï ✓\n"),
    ("true # ; touch /tmp/pwn_comment", ""),
    ("   echo leading-space", "leading-space\n"),
    ("(echo sub; echo shell) | sort", "shell\nsub\n"),
    ("echo a\\;b", "a;b\n"),
    ("printf '%s\\n' \"$(printf '%s' \"it's\")\"", "it's\n"),
]

# Files a job creates on the host with hostile names; copy-back must bring exactly the plain ones.
HOSTILE_FILES_JOB = (
    "touch -- -rf '$(id)' 'a b' $'new\\nline' ünï '*' && echo ok > ok && ln -s ok rel && "
    "ln -s /etc/passwd abs && ln -s ../../.. up && mkfifo fifo"
)

VALID_NAMES = [
    "a b",
    "ünïcødé",
    ".hidden",
    "...",
    "a..b",
    "$(touch pwn_jobname)",
    "`touch pwn_bt`",
    ";touch pwn_semi #",
    "x'y\"z",
    "100%",
    "*",
    "~root",
    "&&",
    "|tee pwn_pipe",
]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def cli(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def host_state(host: Host) -> tuple[str, str]:
    """What could change on a host if something were injected: /tmp and the login's home."""
    tmp = host.run("ls -A /tmp", check=True).stdout
    home = host.run(f"ls -A {shlex.quote(str(host.home))}", check=True).stdout
    return tmp, home


def jobs_on(host: Host) -> list[str]:
    jobs = host.workdir / "jobs"
    return sorted(os.listdir(jobs)) if jobs.exists() else []


def no_pwn_anywhere(host: Host, *local_roots: Path) -> None:
    found = host.run(
        f"find /tmp {shlex.quote(str(host.home))} -name 'pwn*' 2>/dev/null", user=None
    ).stdout
    assert found == "", f"injected files on {host.name}: {found}"
    for root in (Path("/tmp"), *local_roots):
        if root == Path("/tmp"):
            assert not [p for p in os.listdir("/tmp") if p.startswith("pwn")]
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            assert not [n for n in dirnames + filenames if n.startswith("pwn")], dirpath


def test_hostile_commands_run_verbatim(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[0]
    tmp_before, _ = host_state(host)
    lines = [f"printf '%s\\n' {shlex.quote(p)}" for p in PAYLOADS]
    lines += [cmd for cmd, _ in RAW]
    lines.append('printf "%s\\n" "$SSH_SCHEDULER_JOB"')
    lines.append(HOSTILE_FILES_JOB)
    # The batch file's own name is hostile too: it becomes every job's name prefix.
    batch_name = "inj;batch $(touch pwn_prefix) `id`.sh"
    (tmp_path / batch_name).write_text("\n".join(lines) + "\n", encoding="utf-8")

    result = cli(
        tmp_path, "execute_batch", batch_name, "--machines", str(host.machine_file),
        "--no-gpu-required", "--num-cpus", "0.1", "--memory-required", "10",
        "--copy-forwards", batch_name,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = tmp_path / "job_results"

    def out(line_number: int) -> bytes:
        path = results / f"{batch_name}.{line_number}.out"  # none for a job that printed nothing
        return path.read_bytes() if path.exists() else b""

    for number, payload in enumerate(PAYLOADS, start=1):
        assert out(number) == (payload + "\n").encode(), f"line {number}: {payload[:80]!r}"
    for offset, (command, expected) in enumerate(RAW, start=len(PAYLOADS) + 1):
        assert out(offset).decode() == expected, command
    name_line = len(PAYLOADS) + len(RAW) + 1
    assert out(name_line).decode() == f"{batch_name}.{name_line}\n"

    files_job = results / f"{batch_name}.{name_line + 1}"
    got = sorted(os.listdir(files_job))
    assert got == sorted(["-rf", "$(id)", "a b", "new\nline", "ünï", "*", "ok", "rel"]), got
    assert os.readlink(files_job / "rel") == "ok"
    assert (files_job / "ok").read_text() == "ok\n"

    # the journal holds each job once per state, as valid JSON, with the command verbatim
    journal = [json.loads(line) for line in (results / ".journal.jsonl").read_text().splitlines()]
    placed = {e["job"]: e["command"] for e in journal if e["state"] == "placed"}
    assert placed[f"{batch_name}.1"] == lines[0]
    assert len(placed) == len(lines)

    no_pwn_anywhere(host, tmp_path)
    tmp_after, _ = host_state(host)
    assert tmp_after == tmp_before


def test_hostile_job_names_are_data(cluster4: Cluster, tmp_path: Path) -> None:
    host = cluster4.hosts[1]
    tmp_before, _ = host_state(host)
    lines = [
        f"--job-name {shlex.quote(name)} 'printf \"%s\\n\" \"$SSH_SCHEDULER_JOB\"; touch made'"
        for name in VALID_NAMES
    ]
    (tmp_path / "names.sh").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = cli(
        tmp_path, "execute_batch", "names.sh", "--commands", "--machines", str(host.machine_file),
        "--no-gpu-required", "--num-cpus", "0.1", "--memory-required", "10", "--copy-forwards", "names.sh",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = tmp_path / "job_results"
    expected = {".journal.jsonl", ".lock", ".events.jsonl"}  # every run keeps its event file
    for name in VALID_NAMES:
        assert (results / f"{name}.out").read_text() == name + "\n"
        assert os.listdir(results / name) == ["made"]
        assert (results / f"{name}.err").read_text() == ""  # silent on stderr: an empty .err
        expected |= {name, f"{name}.out", f"{name}.err"}
    assert set(os.listdir(results)) == expected
    assert sorted(os.listdir(tmp_path)) == ["job_results", "names.sh"]
    no_pwn_anywhere(host, tmp_path)
    assert host_state(host)[0] == tmp_before


# Each case: files to write in a fresh folder, then the CLI arguments.  All must be refused
# before anything runs: exit 2, one line on stderr, nothing on the host, no job_results.
def _batch(text: bytes | str, *extra: str) -> tuple[dict[str, bytes], list[str]]:
    data = text.encode() if isinstance(text, str) else text
    return {"b.sh": data}, ["execute_batch", "b.sh", "--machines", "{h1}", "--no-gpu-required", *extra]


def _commands(line: str) -> tuple[dict[str, bytes], list[str]]:
    return _batch(line + "\n", "--commands")


def _machine(spec: dict[str, object] | str) -> tuple[dict[str, bytes], list[str]]:
    text = spec if isinstance(spec, str) else yaml.safe_dump(spec)
    return {"m.yaml": text.encode()}, ["execute_remote", "--machine", "m.yaml", "touch /tmp/pwn_machine"]


REFUSED: dict[str, tuple[dict[str, bytes], list[str]]] = {
    "NUL in a batch line": _batch(b"echo a\x00; touch /tmp/pwn_nul\n"),
    "CR inside a batch line": _batch(b"echo a\rtouch /tmp/pwn_cr\n"),
    "invalid UTF-8": _batch(b"echo \xff\xfe\n"),
    "empty batch": _batch("\n# only a comment\n"),
    "name with ..": _commands("--job-name ../x 'touch pwn_dotdot'"),
    "name with /": _commands("--job-name a/b 'touch pwn_slash'"),
    "name ..": _commands("--job-name .. 'touch pwn_dd'"),
    "name .": _commands("--job-name . 'touch pwn_d'"),
    "name is the journal": _commands("--job-name .journal.jsonl 'touch pwn_journal'"),
    "name is the journal, other case": _commands("--job-name .JOURNAL.JSONL 'touch pwn_journal2'"),
    "name is a staging folder": _commands("--job-name .partial-x 'touch pwn_partial'"),
    "name starts with -": _commands("--job-name -rf 'touch pwn_dash'"),
    "name with backslash": _commands("--job-name 'a\\b' 'touch pwn_bs'"),
    "name with leading space": _commands("--job-name ' x' 'touch pwn_space'"),
    "name with a tab": _commands("--job-name 'a\tb' 'touch pwn_tab'"),
    "name too long": _commands(f"--job-name {'n' * 201} 'touch pwn_long'"),
    "--machines inside a line": _commands("--machines h2.yaml 'touch pwn_machines'"),
    "-x inside a line": _commands("-x h1 'touch pwn_x'"),
    "unclosed quote": _commands("'touch pwn_quote"),
    "two commands": _commands("touch pwn_two words"),
    "same name twice (case)": _batch("--job-name A 'touch pwn_a'\n--job-name a 'touch pwn_b'\n", "--commands"),
    "name is another job's .out": _batch("--job-name x 'touch pwn_c'\n--job-name x.out 'touch pwn_d'\n", "--commands"),
    "execute_remote name with ..": ({}, ["execute_remote", "--machine", "{h1}", "--job-name", "../pwn_up", "touch /tmp/pwn_er"]),
    "execute_remote name with /": ({}, ["execute_remote", "--machine", "{h1}", "--job-name", "a/b", "touch /tmp/pwn_er2"]),
    "host starting with -": _machine({"ip": "-oProxyCommand=touch /tmp/pwn_host", "username": "u"}),
    "host with spaces": _machine({"ip": "h1 -oProxyCommand=x", "username": "u"}),
    "host with shell characters": _machine({"ip": "$(touch /tmp/pwn_ip)", "username": "u"}),
    "user starting with -": _machine({"ip": "127.0.0.1", "username": "-oProxyCommand=touch /tmp/pwn_user"}),
    "user with shell characters": _machine({"ip": "127.0.0.1", "username": "u;touch /tmp/pwn_user2"}),
    "port with shell characters": _machine({"ip": "127.0.0.1", "port": "22; touch /tmp/pwn_port"}),
    "port out of range": _machine({"ip": "127.0.0.1", "port": 70000}),
    "port zero": _machine({"ip": "127.0.0.1", "port": 0}),
    "yaml python tag": _machine('ip: !!python/object/apply:os.system ["touch /tmp/pwn_yaml"]\n'),
    "yaml python name tag": _machine("ip: !!python/name:os.system\n"),
    "unknown machine key": _machine({"ip": "127.0.0.1", "proxy_command": "touch /tmp/pwn_pc"}),
    "spec user@-host": ({}, ["execute_remote", "--machine", "u@-oProxyCommand=x", "touch /tmp/pwn_spec"]),
}


# Runs each case's command line through ``ssh_scheduler.cli.main.main`` (what ``python -m
# ssh_scheduler`` runs) in a forked child of one preloaded interpreter: the exit status and the
# stdout/stderr are the real CLI's, without paying an interpreter start per case.
FORK_DRIVER = r"""
import json, os, sys, traceback
from ssh_scheduler.cli.main import main
results = []
for case in json.load(sys.stdin):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.chdir(case["cwd"])
            for fd, path in ((1, case["out"]), (2, case["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            try:
                main(case["argv"])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    results.append(os.waitstatus_to_exitcode(status))
print(json.dumps(results))
"""


def test_hostile_input_is_refused_before_dispatch(cluster4: Cluster, tmp_path: Path) -> None:
    h1 = cluster4.hosts[0]
    before, jobs_before = host_state(h1), jobs_on(h1)
    cases = []
    for index, (case, (files, args)) in enumerate(REFUSED.items()):
        cwd = tmp_path / f"case{index}"
        cwd.mkdir()
        for name, data in files.items():
            (cwd / name).write_bytes(data)
        argv = [a.replace("{h1}", str(h1.machine_file)) for a in args]
        cases.append({"name": case, "cwd": str(cwd), "argv": argv, "files": sorted(files),
                      "out": str(tmp_path / f"case{index}.stdout"), "err": str(tmp_path / f"case{index}.stderr")})
    driver = subprocess.run(
        [sys.executable, "-c", FORK_DRIVER], input=json.dumps(cases), cwd=tmp_path, env=env(),
        capture_output=True, text=True, timeout=120,
    )
    assert driver.returncode == 0, driver.stderr
    codes = json.loads(driver.stdout)
    for case, code in zip(cases, codes, strict=True):
        stderr = Path(case["err"]).read_text()
        assert code == 2, f"{case['name']}: exit {code}: {stderr}"
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{case['name']}: {stderr!r}"
        assert Path(case["out"]).read_text() == "", case["name"]
        assert sorted(os.listdir(case["cwd"])) == case["files"], case["name"]
    assert host_state(h1) == before
    assert jobs_on(h1) == jobs_before
    no_pwn_anywhere(h1, tmp_path)


async def test_multiline_commands_and_environment_values(cluster4: Cluster, tmp_path: Path) -> None:
    """Through the Python API a command may span lines (a heredoc, a script): it arrives whole.
    Values the tool adds (the job name, CUDA_VISIBLE_DEVICES) travel as environment, without
    AcceptEnv on the host and without passing through a shell."""
    host = cluster4.hosts[2]
    machine = load_machine(str(host.machine_file))
    (tmp_path / "src").mkdir()
    command = (
        "cat <<'EOF'\n"
        "$(touch /tmp/pwn_heredoc) `id` $HOME '\"\n"
        "EOF\n"
        'printf "%s|%s\\n" "$SSH_SCHEDULER_JOB" "$CUDA_VISIBLE_DEVICES"\n'
    )
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        code = await execute_remote(
            machine,
            command,
            RemoteOptions(
                job_name="$(touch pwn_api) multi",
                results_dir=tmp_path / "job_results",
                base_dir=tmp_path / "src",
                gpus="0; touch /tmp/pwn_gpus $(touch /tmp/pwn_gpus2)",
            ),
            stdout=(fd,),
            stderr=(),
        )
    finally:
        os.close(fd)
    assert code == 0
    lines = out.read_text().splitlines()
    assert lines[0] == "$(touch /tmp/pwn_heredoc) `id` $HOME '\""
    assert lines[1] == "$(touch pwn_api) multi|0; touch /tmp/pwn_gpus $(touch /tmp/pwn_gpus2)"
    no_pwn_anywhere(host, tmp_path)


@pytest.mark.parametrize("workdir", ["~/wd; touch pwn_wd; x", "~/$(touch pwn_wd2)x/`touch pwn_wd3`y"])
def test_remote_workdir_is_quoted(cluster4: Cluster, tmp_path: Path, workdir: str) -> None:
    if not cluster4.namespaces:
        pytest.skip("the loopback cluster gives every host its own absolute workdir")
    host = cluster4.hosts[3]
    spec = yaml.safe_load(host.machine_file.read_text())
    spec["workdir"] = workdir
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    result = cli(tmp_path, "execute_remote", "--machine", "m.yaml", "pwd")
    assert result.returncode == 0, result.stderr
    expected = str(host.home) + workdir[1:] + "/jobs/"
    assert result.stdout.startswith(expected), result.stdout
    no_pwn_anywhere(host, tmp_path)
    top = str(host.home) + "/" + workdir[2:].split("/")[0]
    assert os.path.isdir(top)
    host.run(f"rm -rf -- {shlex.quote(top)}", check=True)
