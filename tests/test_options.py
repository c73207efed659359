"""One table for every option (ssh_scheduler/jobs/options.py): the commands, the ``--commands``
line parser, a sweep document's needs and the coordinator's options all read it, and ``--detach``
runs a command again from its parsed values."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from ssh_scheduler.cli.main import command
from ssh_scheduler.cli.params import MULTI_VALUE, command_argv, expand_multi_value, takes_options
from ssh_scheduler.coordinator.batch_run import BatchOptions, batch_options
from ssh_scheduler.coordinator.remote import RemoteOptions
from ssh_scheduler.errors import BatchError, ConfigError
from ssh_scheduler.executors.transfer import CopyLimits
from ssh_scheduler.jobs.command_line import parse_command_line
from ssh_scheduler.jobs.forward import ForwardPolicy
from ssh_scheduler.jobs.needs import Needs, flag_needs
from ssh_scheduler.jobs.options import (
    BATCH,
    LINE,
    OPTIONS,
    REMOTE,
    SWEEP,
    Option,
    destined,
    need_options,
    options_of,
)
from ssh_scheduler.jobs.sweep import parse_sweep
from ssh_scheduler.planner.policy import parse_halt

REPO = Path(__file__).resolve().parents[1]

NOT_FOR_SWEEP = {
    "--commands": "a sweep's jobs are its template's commands, not lines of a batch file",
    "--retry-failed": "a sweep reruns every command that failed anyway (stat.json says which)",
    "--allow-changed": "a sweep reruns a command whose text changed anyway (param.json says which)",
}
"""The execute_batch options a sweep refuses, and why."""


def click_command(name: str) -> Any:
    """The click command typer builds for ``name`` (typer vendors click: no type to name here)."""
    app = typer.Typer(add_completion=False)
    app.command(name=name)(command(name))
    return typer.main.get_command(app)


def click_options(name: str) -> dict[str, Any]:
    params = click_command(name).params
    return {p.name: p for p in params if p.param_type_name == "option" and p.name and p.name != "help"}


def sample(option: Option) -> tuple[list[str], Any]:
    """Words that give ``option`` a value other than its default, and that value as the command
    receives it."""
    if option.count:
        return [option.flag, option.flags[-1]], 2
    if option.switch:
        return [option.flag], True
    text, value = {int: ("7", 7), float: ("2.5", 2.5), Path: ("-odd dir", Path("-odd dir"))}.get(option.kind, ("-x y", "-x y"))
    if option.many:
        return [f"{option.flag}={text}", option.flag, "b"], [value, option.kind("b")]
    return [f"{option.flag}={text}"], value


def test_each_command_s_options_are_the_table_s() -> None:
    for name in (BATCH, SWEEP, REMOTE):
        shown = click_options(name)
        taken = {o.name: o for o in options_of(name)}
        refused = {o.name for o in OPTIONS if o.refused_by(name)}
        assert set(shown) == set(taken) | refused, name
        for key, option in taken.items():
            assert tuple(shown[key].opts) == option.flags and shown[key].hidden == option.hidden, key
            assert (shown[key].help or "") == option.help_for(name), key
    assert set(MULTI_VALUE) == {"--machines", "--exclude-hosts", "-x", "--copy-forwards", "--copy-backwards"}


def test_the_sweep_accepts_every_execute_batch_option_that_makes_sense(tmp_path: Path) -> None:
    """Walks execute_batch's options, from the table and from the typer command: the sweep takes
    each (parsed into the same value), but for the few listed in NOT_FOR_SWEEP with the reason."""
    batch, sweep = click_command(BATCH), click_command(SWEEP)
    walked = set(click_options(BATCH))
    assert walked == {o.name for o in options_of(BATCH)}
    runner = CliRunner()
    app = typer.Typer(add_completion=False)
    app.command(name=SWEEP)(command(SWEEP))
    for option in options_of(BATCH):
        if option.flag in NOT_FOR_SWEEP:
            assert SWEEP not in option.commands and option.refused_by(SWEEP) == NOT_FOR_SWEEP[option.flag]
            refused = runner.invoke(app, [str(tmp_path / "s.yaml"), *sample(option)[0]])
            assert refused.exit_code == 2
            assert refused.output == f"error: {option.flag} does not go with a sweep: {NOT_FOR_SWEEP[option.flag]}\n"
            continue
        assert SWEEP in option.commands, option.flag
        words, _ = sample(option)
        as_batch = batch.make_context(BATCH, ["b.sh", *expand_multi_value(words)]).params[option.name]
        as_sweep = sweep.make_context(SWEEP, ["s.yaml", *expand_multi_value(words)]).params[option.name]
        assert as_sweep == as_batch and as_sweep not in (None, option.default), option.flag
    assert set(NOT_FOR_SWEEP) <= {o.flag for o in options_of(BATCH)}


def capture(name: str) -> tuple[typer.Typer, dict[str, Any]]:
    """A command with ``name``'s options that keeps the values it receives."""
    seen: dict[str, Any] = {}

    @takes_options(name)
    def run(target: Annotated[str, typer.Argument()], **values: Any) -> None:
        seen.update(values, target=target)

    app = typer.Typer(add_completion=False)
    app.command(name=name)(run)
    return app, seen


@pytest.mark.parametrize("name", [BATCH, SWEEP])
def test_detach_runs_the_command_again_with_the_same_values(name: str) -> None:
    app, seen = capture(name)
    given: list[str] = []
    for option in options_of(name):
        given += sample(option)[0]
    assert CliRunner().invoke(app, [*expand_multi_value(given), "--", "-a file"]).exit_code == 0
    first = dict(seen)
    again = command_argv(name, first, [first.pop("target")], leave_out=("detach",))
    assert again[0] == name and "--detach" not in again
    seen.clear()
    result = CliRunner().invoke(app, expand_multi_value(again[1:]))
    assert result.exit_code == 0, result.output
    assert seen.pop("target") == "-a file"
    assert seen == {**first, "detach": False}
    assert command_argv(BATCH, {}, ["b.sh"]) == [BATCH, "--", "b.sh"]  # defaults are not repeated


def test_each_value_goes_where_the_table_says() -> None:
    defaults = {o.name: o.default for o in options_of(BATCH)}
    assert batch_options(defaults) == BatchOptions()
    assert RemoteOptions(**destined({o.name: o.default for o in options_of(REMOTE)}, "options")) == RemoteOptions()
    base = BatchOptions()
    for option in options_of(BATCH):
        group = option.to.partition(".")[0]
        if group not in ("options", "limits", "forward", "needs"):
            continue
        value = {"halt": "now,fail=1", "copy_backwards": ["out"], "copy_forwards": ["a"]}.get(option.name, sample(option)[1])
        changed = batch_options({**defaults, option.name: value})
        assert changed != base, option.flag  # the value arrived somewhere
    options = batch_options({**defaults, "max_result_bytes": 5, "max_result_files": 6, "max_output_bytes": 7,
                             "forward_max_bytes": 8, "allow_outside_copies": True, "halt": "soon,fail=2",
                             "copy_forwards": ["src"], "lease": 9.0, "max_connecting": 3})
    assert options.limits == CopyLimits(5, 6, 7) and options.lease == 9.0 and options.max_connecting == 3
    assert options.forward == dataclasses.replace(ForwardPolicy(), max_bytes=8, allow_outside=True, confirmed=True)
    assert options.halt == parse_halt("soon,fail=2") and options.copy_forwards == ("src",)
    assert batch_options(defaults, allow_changed=True).allow_changed  # what a sweep decides itself


def test_the_batch_needs_keep_their_rules() -> None:
    assert flag_needs({}) == (Needs(), False)
    assert flag_needs({"no_gpu_required": True, "gpus_per_job": 2, "gpu_memory_required": 5}) == (
        Needs(1.0, 1000, 0, 0, 0.0, False, True), True,  # no GPU wins, and GPU memory means nothing
    )
    assert flag_needs({"gpus_per_job": 2, "no_reserve_gpu": True, "reserve": True}) == (
        Needs(gpus=2, reserve_gpu=False, reserve_machine=True), True,
    )
    with pytest.raises(ConfigError, match=r"^--num-cpus must be a finite number >= 0, not -1"):
        flag_needs({"num_cpus": -1.0})


@pytest.mark.parametrize("need", list(need_options()), ids=lambda o: o.flag)
def test_a_need_means_the_same_as_a_flag_a_batch_line_and_a_sweep_document_key(need: Option) -> None:
    words, value = sample(need)
    if need.name == "gpu_utilization":
        words, value = [need.flag, "0.5"], 0.5
    from_flag, _ = flag_needs({need.name: value})
    from_line = parse_command_line(" ".join([*words, "x"])).needs.apply(Needs())
    key = f"{need.name}: {str(value).lower()}"
    from_sweep = parse_sweep(f"template: x\n---\na: 1\n{key}\n", "s.yaml").documents[0].needs.apply(Needs())
    field = need.to.partition(".")[2]
    assert getattr(from_flag, field) == getattr(from_line, field) == getattr(from_sweep, field) != getattr(Needs(), field)


def test_a_batch_line_takes_exactly_the_table_s_line_flags() -> None:
    line_flags = [f for o in options_of(LINE) for f in o.flags]
    with pytest.raises(BatchError) as caught:
        parse_command_line("--machines a 'x'")
    assert f"in a batch only {', '.join(line_flags)} are allowed" in str(caught.value)
    for flag in ("--machine", "--gpus", "--timeout", "--results-dir", "-x"):  # execute_remote's, or a batch's
        with pytest.raises(BatchError, match="unknown option"):
            parse_command_line(f"{flag} v 'x'")


def test_refused_and_out_of_range_options_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("template: echo {a}\n---\na: [1, 2]\n")
    run = CliRunner().invoke
    app = typer.Typer(add_completion=False)
    app.command(name=SWEEP)(command(SWEEP))
    for args, message in (
        (["--timeout", "0"], "error: --timeout must be a positive number of seconds, not 0\n"),
        (["--retries", "-1"], "error: --retries must be 0 or more, not -1\n"),
        (["--num-cpus", "-2"], "error: --num-cpus must be a finite number >= 0, not -2.0\n"),
        (["--halt", "sometimes"], "error: --halt 'sometimes': expected never, now,fail=N, soon,fail=N or "
                                  "soon,fail=N% (e.g. --halt now,fail=1)\n"),
        (["-d", "--detach"], "error: -d shows the jobs' output on this terminal; it does not go with --detach\n"),
        (["-d", "--json"], "error: -d copies the jobs' output to stdout, where --json writes events; choose one\n"),
        (["--dry-run", "--json"], "error: a sweep's --dry-run lists its commands as text; drop --json\n"),
    ):
        result = run(app, [str(tmp_path / "s.yaml"), "--results-dir", "out", *args])
        assert (result.exit_code, result.output) == (2, message), args
    assert not (tmp_path / "out").exists()


def test_the_entry_loads_only_typer_and_the_table_until_the_command_is_known() -> None:
    code = "import sys, ssh_scheduler.cli.main; print(' '.join(sorted(m for m in sys.modules if m.startswith('ssh_scheduler'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout.split()
    assert loaded == [
        "ssh_scheduler", "ssh_scheduler.cli", "ssh_scheduler.cli.common", "ssh_scheduler.cli.main",
        "ssh_scheduler.cli.params", "ssh_scheduler.errors", "ssh_scheduler.jobs", "ssh_scheduler.jobs.options",
    ]
