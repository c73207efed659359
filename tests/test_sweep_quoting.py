"""Sweep values can never inject shell syntax, whatever quoting the template puts around a
placeholder: each template below is rendered with hostile and random values and run by real
shells (bash, as the agent runs jobs, and dash, the ``sh`` of hosts without bash); what they
print must be the value exactly, and no value may run anything.  Templates where no writing of a
value could stay literal are refused when the sweep is read, naming the spot and the way out.
Parameter names are the ones the seed runner's ``str.format`` can address (issue 24)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.jobs.shell_template import render
from ssh_scheduler.jobs.sweep import expand, parse_sweep

REPO = Path(__file__).resolve().parents[1]
SHELLS = [s for s in ("bash", "dash") if shutil.which(s)]
END = "@@END@@"

HOSTILE = [
    "plain", "", " ", "a b", "0.01", "2", "-n", "--", "A=1", "if", "!", "{", "}", "time", "#", "# x",
    "'", "''", '"', '""', "\\", "\\'", '\\"', "\\\\", "$", "$$", "${HOME}", "$HOME", "$(id)", "`id`",
    "$((1+1))", "a'b", 'a"b', "it's \"quoted\"", "x\ny", "\n", "x\n", "\nx", "\t", "*", "?", "[a]", "~",
    "~root", "a;b", "a&&b", "a||b", "a|b", "a>b", "a<b", "(a)", "a)b", "esac", "EOF", "]]", "))", "\\\n",
    "é ünï €", "a\x01b", "'; touch {pwn}; '", '"; touch {pwn}; "', "$(touch {pwn})", "`touch {pwn}`",
    "'$(touch {pwn})'", '"$(touch {pwn})"', "\n touch {pwn}\n", "' \n touch {pwn} #",
]
ALPHABET = "ab01 -_=.,:/'\"\\`$(){}[];|&<>*?~#!%^@+\n\té"

# (template, what a shell prints for value v); every command prints fields ending in '|'.
TEMPLATES: list[tuple[str, Callable[[str], str]]] = [
    ("printf '%s|' {x}", lambda v: f"{v}|"),
    ("printf '%s|' '{x}'", lambda v: f"{v}|"),
    ('printf \'%s|\' "{x}"', lambda v: f"{v}|"),
    ('printf \'%s|\' "a-{x}-b" \'c-{x}-d\' e-{x}-f', lambda v: f"a-{v}-b|c-{v}-d|e-{v}-f|"),
    ("printf '%s|' --lr={x} '--lr={x}' \"--lr={x}\"", lambda v: f"--lr={v}|" * 3),
    ('printf \'%s|\' "$(printf \'%s|\' "{x}")"', lambda v: f"{v}||"),
    ("printf '%s|' \"$(printf '%s|' {x} '{x}')\"", lambda v: f"{v}|{v}||"),
    ("printf '%s|' ok # {x}\nprintf '%s|' {x}", lambda v: f"ok|{v}|"),
    ("case a in a) printf '%s|' {x} \"{x}\";; esac", lambda v: f"{v}|{v}|"),
    ('x="$(case a in (a) printf \'%s|\' \'{x}\';; b) :;; esac)"; printf \'%s|\' "$x"', lambda v: f"{v}||"),
    ("cat <<'E'\nstatic '\nE\nprintf '%s|' {x}", lambda v: f"static '\n{v}|"),
    ("printf '%s|' {x} | cat; printf '%s|' {x}>&1", lambda v: f"{v}|{v}|"),
    ("printf '%s|' {{x}} '{{x}}' ${{x}}", lambda v: "{x}|{x}|"),  # ${x}: the shell's own, unset
]
COMMAND_POSITION = "printf '%s|' start; {x} >/dev/null 2>&1; printf '%s|' end"


def _values(pwn: Path, count: int = 150) -> list[str]:
    rng = random.Random(23)
    made = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 12))) for _ in range(count)]
    return [v.replace("{pwn}", str(pwn)) for v in HOSTILE] + made


def _run_all(shell: str, commands: list[str], cwd: Path) -> list[str]:
    """One shell runs every command, each followed by a marker; the output of each."""
    script = "".join(f"{c}\nprintf '\\n{END}\\n'\n" for c in commands)
    done = subprocess.run([shell, "-c", script], cwd=cwd, capture_output=True, timeout=120,
                          env={"PATH": os.environ["PATH"], "HOME": str(cwd)})
    parts = done.stdout.decode("utf-8", "surrogateescape").split(f"\n{END}\n")
    assert parts[-1] == "", (shell, done.stderr[-2000:])
    return parts[:-1]


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize(("template", "expected"), TEMPLATES, ids=[t for t, _ in TEMPLATES])
def test_every_value_stays_literal_whatever_quoting_surrounds_it(
    shell: str, template: str, expected: Callable[[str], str], tmp_path: Path
) -> None:
    pwn = tmp_path / "pwned"
    values = _values(pwn)
    rendered = [render(template, {"x": v}) for v in values]
    outputs = _run_all(shell, rendered, tmp_path)
    assert len(outputs) == len(values), "a value ended the script early"
    for value, command, output in zip(values, rendered, outputs, strict=True):
        assert output == expected(value), (value, command)
    assert not pwn.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing was created, not even a redirect


@pytest.mark.parametrize("shell", SHELLS)
def test_a_value_in_command_position_is_never_a_keyword_or_an_assignment(shell: str, tmp_path: Path) -> None:
    pwn = tmp_path / "pwned"
    values = ["if", "then", "!", "{", "time", "A=1", "PATH=/nowhere", "case", "((", f"touch {pwn}", "2>x", "#"]
    outputs = _run_all(shell, [render(COMMAND_POSITION, {"x": v}) for v in values], tmp_path)
    assert outputs == ["start|end|"] * len(values)
    assert not pwn.exists() and not (tmp_path / "x").exists()


def test_plain_values_read_as_written() -> None:
    # The rendering that the recorded commands (param.json) keep: values that need no quoting
    # have none, so a rerun finds the same text as before.
    assert render("python t.py --lr {lr} --out {_output}/m.pt", {"lr": "0.01", "_output": "job_results/lr_0.01"}) == (
        "python t.py --lr 0.01 --out job_results/lr_0.01/m.pt"
    )
    assert render("echo '--lr={lr}' \"{lr}\"", {"lr": "0.01"}) == "echo '--lr=0.01' \"0.01\""
    assert render("echo {v}", {"v": "a b; rm -rf /"}) == "echo 'a b; rm -rf /'"
    assert render("echo {v}", {"v": "A=1"}) == "echo 'A=1'"
    assert render("echo {v}>f", {"v": "2"}) == "echo '2'>f"


SWEEP = "template:\n  run: {template}\n---\nx: [1]\n"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("echo `echo {x}`", r"\{x\} at column 12 is inside backquotes .* use \$\(\.\.\.\) instead"),
        ("echo $(( {x} + 1 ))", r"\{x\} at column 10 is inside an arithmetic expression"),
        ("(( {x} > 1 )) && echo", r"\{x\} at column 4 is inside an arithmetic expression"),
        ("echo $[{x}+1]", r"is inside an arithmetic expression"),
        ("echo ${HOME:-{x}}", r"\{x\} at column 14 is inside a \$\{\.\.\.\} expansion"),
        ("echo $'a{x}'", r"is inside a \$'\.\.\.' string"),
        ("echo $'a\\'b' {x}", r"follows a \$'\.\.\.' string holding \\', which bash and sh read differently"),
        ("cat <<<here\necho {x}", r"follows a <<< here-string on an earlier line"),
        ("cat <<E\nvalue {x}\nE", r"\{x\} at line 2, column 7 is inside a here-document"),
        ("cat <<-{x}\nE", r"is the end word of a here-document"),
        ("echo \\{x}", r"\{x\} at column 7 follows a backslash"),
        ('echo "\\{x}"', r"follows a backslash"),
        ("echo '{x}", r"the ' at column 6 is never closed"),
        ("echo $(echo {x}", r"the \$\( at column 6 is never closed"),
        ("[[ {x} -eq 1 ]]", r"is an operand of an arithmetic test in \[\[ \.\.\. \]\]"),
        ("[[ 1 -lt $(echo {x}) ]]", r"is an operand of an arithmetic test"),
        ("a[{x}]=1", r"is inside an array subscript"),
    ],
)
def test_spots_where_no_quoting_holds_are_refused_when_the_sweep_is_read(template: str, message: str) -> None:
    text = "template:\n  run: |-\n" + "".join(f"    {line}\n" for line in template.split("\n")) + "---\nx: [1]\n"
    with pytest.raises(ConfigError, match=message) as caught:
        parse_sweep(text, "s.yaml")
    assert str(caught.value).startswith("s.yaml: command 'run': ") and "\n" not in str(caught.value)


def test_what_looks_like_a_placeholder_but_is_the_shell_s_is_left_alone() -> None:
    template = "awk '{print $1}' ${HOME}/x '{\"a\": {\"b\": 1}}' {{lr}} $((1+1)) # {{lr}}"
    spec = parse_sweep(f"template:\n  run: {json.dumps(template)}\n---\nlr: [1]\n", "s.yaml")
    assert spec.commands == (("run", template),)
    assert render(template, {"lr": "1"}) == "awk '{print $1}' ${HOME}/x '{\"a\": {\"b\": 1}}' {lr} $((1+1)) # {lr}"


def test_any_name_str_format_can_address_is_a_parameter() -> None:
    text = (
        "template: train --early-stop={early-stop} --warm up={warm up} --lr={lr}\n"
        "default: {lr: 0.1}\n---\nearly-stop: [true, false]\nwarm up: ['a b']\n"
    )
    combos = expand(parse_sweep(text, "s.yaml"))
    assert [c.name for c in combos] == ["early-stop_true", "early-stop_false"]
    values = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in combos[0].values.items()}
    assert render(parse_sweep(text, "s.yaml").commands[0][1], values) == (
        "train --early-stop=true --warm up='a b' --lr=0.1"
    )
    for bad, why in (("a.b", "cannot reach it"), ("'1'", "cannot reach it"), ("a[0]", "cannot reach it"),
                     ("a:b", "cannot reach it"), ("_seed", "reserved")):
        with pytest.raises(ConfigError, match=why) as caught:
            parse_sweep(f"template: echo x\n---\n{bad}: [1]\n", "s.yaml")
        assert "\n" not in str(caught.value)


def test_a_value_with_a_nul_byte_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"document 2, key 'x': contains a NUL byte"):
        parse_sweep('template: echo {x}\n---\nx: ["a\\0b"]\n', "s.yaml")


LOCAL = ["--no-gpu-required", "--memory-required", "0", "--num-cpus", "0"]


def test_a_sweep_run_by_the_agent_writes_each_hostile_value_exactly(tmp_path: Path) -> None:
    # End to end on this machine: the agent's bash runs the rendered commands.
    pwn = tmp_path / "pwned"
    values = [f"$(touch {pwn})", f"'; touch {pwn}; '", f'"; touch {pwn}; "', "`id`", "a b", "it's"]
    (tmp_path / "s.yaml").write_text(
        "template:\n"
        "  run: printf '%s|%s|%s' {x} \"{x}\" '{x}' > {_output}/got.txt\n"
        f"---\nx: {json.dumps(values)}\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-m", "ssh_scheduler", "sweep", "s.yaml", *LOCAL], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    got = sorted((p / "got.txt").read_text() for p in (tmp_path / "job_results").iterdir() if not p.name.startswith("."))
    assert got == sorted(f"{v}|{v}|{v}" for v in values)
    assert not pwn.exists()


def test_case_as_an_argument_is_no_case_statement() -> None:
    # 'case' counts only where a command starts: as an argument its ')' would otherwise be taken
    # for a pattern's, and the $(...) around it never closed.
    assert render('echo "$(echo case) {x}"', {"x": "$(id)"}) == 'echo "$(echo case) "\'$(id)\'""'
    assert render("x=$(case a in a) echo;; esac) {x}", {"x": "a b"}) == "x=$(case a in a) echo;; esac) 'a b'"
