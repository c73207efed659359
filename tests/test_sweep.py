"""Sweep files: parsing, validation, expansion, names, commands, jobs, and what a rerun runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ssh_scheduler.cli.main import sweep_args
from ssh_scheduler.errors import ConfigError
from ssh_scheduler.jobs.needs import NeedsOverride
from ssh_scheduler.jobs.shell_template import placeholders, render
from ssh_scheduler.jobs.sweep import (
    MAX_NAME_CHARS,
    Combination,
    build_jobs,
    expand,
    parse_sweep,
    sample,
    select_commands,
)
from ssh_scheduler.results.sweep_store import (
    Layout,
    collect,
    job_stats,
    plan_runs,
    prepare,
    read_json,
    recover,
)

# The seed runner's format: template, default, then two sweep documents that share (0.01, 2).
SEED_GRID = """\
default:
  lr: 0.1
  seed: 1
  epochs: 10
---
lr: [0.1, 0.01]
seed: [1, 2]
---
_title: small
lr: [0.01, 0.001]
seed: 2
"""
SEED_EXAMPLE = """\
template:
  train: python train.py --lr {lr} --seed {seed} --epochs {epochs} --out {_output}
  test: python test.py --model {_output}/model.pt --name {_name}
""" + SEED_GRID + "gpus_per_job: 2\n"


def spec(text: str = SEED_EXAMPLE, path: str = "sweep.yaml"):  # type: ignore[no-untyped-def]
    return parse_sweep(text, path)


def test_union_of_documents_with_the_duplicate_dropped() -> None:
    combos = expand(spec())
    assert [c.name for c in combos] == [
        "lr_0.1-seed_1", "lr_0.1-seed_2", "lr_0.01-seed_1", "lr_0.01-seed_2", "lr_0.001-seed_2",
    ]
    assert [c.index for c in combos] == [1, 2, 3, 4, 5]
    assert combos[4].values == {"lr": 0.001, "seed": 2, "epochs": 10}
    assert combos[4].title == "small" and combos[4].document == 3
    assert combos[4].needs == NeedsOverride(gpus=2)
    # The duplicate (0.01, 2) keeps its first document's needs and title.
    assert combos[3].document == 2 and combos[3].title is None and combos[3].needs.empty


def test_title_selects_documents_and_names_stay_the_same() -> None:
    every = {c.values["lr"]: c.name for c in expand(spec())}
    small = expand(spec(), ["small"])
    # Every combination of the titled document, with its needs, under its usual name and index.
    assert [(c.name, c.index) for c in small] == [("lr_0.01-seed_2", 4), ("lr_0.001-seed_2", 5)]
    assert small[1].name == every[0.001] and small[0].name == every[0.01]
    assert all(c.needs == NeedsOverride(gpus=2) and c.title == "small" for c in small)
    with pytest.raises(ConfigError, match=r"^sweep.yaml: -t 'big' matches no _title \(titles: small\)$"):
        expand(spec(), ["big"])


def test_only_defaults_is_one_combination_named_default() -> None:
    combos = expand(spec("template: echo {x}\ndefault: {x: 1}\n"))
    assert [(c.name, c.values) for c in combos] == [("default", {"x": 1})]


def test_long_and_unsafe_values_get_a_stable_hash() -> None:
    text = "template: echo {p} {q}\n---\np: ['data/a b.txt', 'data/a_b.txt']\nq: ['" + "x" * 150 + "']\n"
    names = [c.name for c in expand(spec(text))]
    assert len(set(names)) == 2
    assert names[0].startswith("p_data_a_b.txt-") and re.search(r"-[0-9a-f]{8}$", names[0])
    assert names == [c.name for c in expand(spec(text))]  # stable across runs
    long = expand(spec("template: echo {q}\n---\nq: ['" + "y" * 300 + "', z]\n"))
    assert len(long[0].name) == MAX_NAME_CHARS and re.search(r"-[0-9a-f]{8}$", long[0].name)
    assert long[1].name == "q_z"


def test_names_equal_ignoring_case_both_get_a_hash() -> None:
    names = [c.name for c in expand(spec("template: echo {m}\n---\nm: [Adam, adam, sgd]\n"))]
    assert names[2] == "m_sgd"
    assert names[0].startswith("m_Adam-") and names[1].startswith("m_adam-")
    assert names[0].lower() != names[1].lower()


def test_placeholders_and_rendering() -> None:
    template = "awk '{print $1}' ${HOME}/x {lr} {{lr}} '{\"a\": {\"b\": 1}}' {_output}"
    assert placeholders(template) == ["lr", "_output"]
    values = {"lr": "0.01", "_output": "job_results/lr_0.01"}
    assert render(template, values) == (
        "awk '{print $1}' ${HOME}/x 0.01 {lr} '{\"a\": {\"b\": 1}}' job_results/lr_0.01"
    )
    # A value is one shell word and cannot inject shell syntax.
    assert render("echo {v}", {"v": "a b; rm -rf /"}) == "echo 'a b; rm -rf /'"


def test_commands_are_rendered_into_chained_jobs() -> None:
    s = spec()
    combos = expand(s)
    layout = Layout.create("job_results")
    runs, skipped = plan_runs(combos, select_commands(s, ()), layout)
    assert skipped == []
    jobs = build_jobs(runs, layout.copies((".",), None), "sweep.yaml")
    assert [j.name for j in jobs[:2]] == ["lr_0.1-seed_1.train", "lr_0.1-seed_1.test"]
    assert jobs[0].command == (
        "python train.py --lr 0.1 --seed 1 --epochs 10 --out job_results/lr_0.1-seed_1"
    )
    assert jobs[1].command == (
        "python test.py --model job_results/lr_0.1-seed_1/model.pt --name lr_0.1-seed_1"
    )
    assert jobs[0].after == () and jobs[1].after == ("lr_0.1-seed_1.train",)
    # The second command's copy paths differ from the first's, so they are collected when it is
    # sent (after the first command's files arrived); both name the combination's folder.
    assert jobs[0].copy_forwards == (".", "job_results/lr_0.1-seed_1")
    assert jobs[1].copy_forwards == (".", "job_results/lr_0.1-seed_1/.")
    assert jobs[0].copy_backwards is None
    with_back = build_jobs(runs[:1], layout.copies(("src",), ("logs",)), "s")
    assert (with_back[0].copy_forwards, with_back[0].copy_backwards) == (
        ("src", "job_results/lr_0.1-seed_1"), ("logs", "job_results/lr_0.1-seed_1"),
    )
    assert jobs[-1].needs == NeedsOverride(gpus=2) and jobs[-1].after == ("lr_0.001-seed_2.train",)
    # -c test alone: nothing to wait for in this batch.
    only_test = build_jobs(plan_runs(combos, select_commands(s, ["test"]), layout)[0], layout.copies((), None), "s")
    assert all(j.after == () for j in only_test) and len(only_test) == 5


def test_sample_is_seeded_and_keeps_file_order() -> None:
    combos = expand(spec())
    first = sample(combos, 3, seed=7)
    assert first == sample(combos, 3, seed=7)
    assert [c.index for c in first] == sorted(c.index for c in first) and len(first) == 3
    assert sample(combos, 10, seed=0) == combos
    with pytest.raises(ConfigError, match="at least 1"):
        sample(combos, 0, seed=0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("template:\n  train: python t.py {lr} {typo}\ndefault: {lr: 1}\n---\nlr: [1, 2]\n",
         r"^s.yaml: command 'train' uses \{typo\}, which has no value in document 2 \(add typo to 'default' or to that document\)$"),
        ("template: echo {a}\n---\na: [1]\n---\nb: [2]\n",
         r"^s.yaml: command 'run' uses \{a\}, which has no value in document 3 "),
        ("template: echo x\ndefault: {lr: 1\n", r"^s.yaml line 3: not valid YAML: "),
        ("template: echo x\nresource: [0, 1]\n", r"^s.yaml: document 1, key 'resource': GPUs are not listed by hand"),
        ("template: echo x\nlr: [1]\n", r"^s.yaml: document 1, key 'lr': unknown key in the header"),
        ("default: {a: 1}\n", r"^s.yaml: document 1: no 'template'"),
        ("template: echo {a}\n---\na: []\n", r"^s.yaml: document 2, key 'a': is an empty list"),
        ("template: echo {a}\n---\na: [{b: 1}]\n", r"^s.yaml: document 2, key 'a': is a mapping;"),
        ("template: echo {a}\ndefault: {a: }\n", r"^s.yaml: document 1, key 'a': has no value"),
        ("template: echo {a}\ndefault: {a: [1, 2]}\n", r"^s.yaml: document 1, key 'a': a default is one value"),
        ("template: echo {a}\n---\na: 1\ngpus_per_job: two\n", r"^s.yaml: document 2, key 'gpus_per_job': must be a whole number"),
        ("template: echo {a}\n---\na: 1\ngpu_utilization: -1\n", r"^s.yaml: document 2: gpu_utilization must be"),
        ("template: echo {a}\n---\n_seed: 1\n", r"^s.yaml: document 2: '_seed' is not a parameter name.*reserved"),
        ("template:\n  'bad name': echo\n", r"^s.yaml: document 1, key 'template': 'bad name' is not a command name"),
        ("- a\n- b\n", r"^s.yaml: the first document must be a mapping"),
    ],
)
def test_errors_are_one_line_and_name_file_and_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        parse_sweep(text, "s.yaml")
    assert "\n" not in str(caught.value)


def test_unknown_command_for_dash_c() -> None:
    with pytest.raises(ConfigError, match=r"-c 'eval' is not a command of the template \(train, test\)"):
        select_commands(spec(), ["eval"])


def test_results_dir_must_be_relative_and_inside() -> None:
    for bad in ("/tmp/out", "../out", "."):
        with pytest.raises(ConfigError, match="a sweep needs a folder below the current one"):
            Layout.create(bad)
    assert Layout.create("out/./sweep").results == "out/sweep"


def test_execute_batch_sweep_becomes_the_sweep_command() -> None:
    assert sweep_args(["--machines", "a", "--sweep", "s.yaml", "-t", "x"]) == ["s.yaml", "--machines", "a", "-t", "x"]
    assert sweep_args(["--sweep=s.yaml"]) == ["s.yaml"]


# --- what a rerun runs ---------------------------------------------------------------------------


def _journal(results: Path, *entries: dict[str, object]) -> None:
    jobs = results / ".jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    with open(jobs / ".journal.jsonl", "a") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")


def _finish(layout: Layout, combo: str, command: str, code: int, t0: float) -> None:
    """What the batch leaves for one job, then collect it (as the CLI does when it ends)."""
    results = Path(layout.results)
    job = f"{combo}.{command}"
    (results / ".jobs" / job / layout.output(combo)).mkdir(parents=True)
    (results / ".jobs" / job / layout.output(combo) / f"{command}.txt").write_text(command)
    (results / ".jobs" / job / "elsewhere.txt").write_text("outside {_output}")
    (results / ".jobs" / f"{job}.out").write_text(f"{command} says hi\n")
    (results / ".jobs" / f"{job}.err").write_text("")
    _journal(results,
             {"t": t0, "job": job, "state": "started", "host": "h2", "gpus": [1]},
             {"t": t0 + 1.5, "job": job, "state": "finished" if code == 0 else "failed", "code": code})
    stats = job_stats(json.loads(line) for line in (results / ".jobs" / ".journal.jsonl").read_text().splitlines())
    collect(layout, combo, command, stats.get(job), ["train", "test"])


Prepared = tuple[Layout, list[Combination], list[tuple[str, str]]]


@pytest.fixture
def prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Prepared:
    """The seed example's first two combinations, ready to run in ``tmp_path/job_results``."""
    monkeypatch.chdir(tmp_path)
    s = spec()
    combos, commands = expand(s)[:2], select_commands(s, ())
    layout = Layout.create("job_results")
    prepare(plan_runs(combos, commands, layout)[0], layout)
    return layout, combos, commands


def test_folder_stat_and_rerun_of_only_the_failed_command(prepared: Prepared) -> None:
    layout, combos, commands = prepared
    runs, _ = plan_runs(combos, commands, layout)
    param = read_json(Path("job_results/lr_0.1-seed_1/param.json"))
    assert param["_commands"]["train"] == runs[0][2] and param["lr"] == 0.1 and param["epochs"] == 10
    assert param["_output"] == "job_results/lr_0.1-seed_1" and param["_varying"] == ["lr", "seed"]
    _finish(layout, "lr_0.1-seed_1", "train", 0, 100.0)
    _finish(layout, "lr_0.1-seed_1", "test", 0, 110.0)
    _finish(layout, "lr_0.1-seed_2", "train", 0, 100.0)
    _finish(layout, "lr_0.1-seed_2", "test", 3, 110.0)
    folder = Path("job_results/lr_0.1-seed_2")
    assert sorted(p.name for p in folder.iterdir()) == [
        ".files.json", "param.json", "stat.json", "test.err", "test.out", "test.txt", "train.err", "train.out", "train.txt",
    ]
    assert (folder / "train.out").read_text() == "train says hi\n"
    assert (Path("job_results/.jobs/lr_0.1-seed_2.train/elsewhere.txt")).is_file()
    stat = read_json(folder / "stat.json")
    assert stat["train"] == {"host": "h2", "gpus": [1], "started": 100.0, "code": 0, "ended": 101.5, "seconds": 1.5}
    assert stat["test"]["code"] == 3
    # Collecting twice changes nothing and leaves no temporary files.
    collect(layout, "lr_0.1-seed_2", "test", stat["test"], ["train", "test"])
    assert not any(p.name.endswith(".tmp") for p in folder.iterdir())
    assert read_json(folder / ".files.json") == {"train": ["train.txt"], "test": ["test.txt"]}

    runs, skipped = plan_runs(combos, commands, layout)
    assert [(c.name, cmd) for c, cmd, _ in runs] == [("lr_0.1-seed_2", "test")]
    assert len(skipped) == 3
    prepare(runs, layout)
    assert "test" not in read_json(folder / "stat.json") and "train" in read_json(folder / "stat.json")
    aside = Path("job_results/.jobs/.previous/lr_0.1-seed_2.test.1")
    assert (aside / "lr_0.1-seed_2.test.out").is_file()
    # What the failed test wrote is set aside too (it arrives read-only in the rerun's folder).
    assert (aside / "output" / "test.txt").is_file() and not (folder / "test.txt").exists()
    assert (folder / "train.txt").is_file() and read_json(folder / ".files.json") == {"train": ["train.txt"]}
    assert not Path("job_results/.jobs/lr_0.1-seed_2.test").exists()
    # -f reruns everything; a changed command reruns itself and what follows it.
    assert len(plan_runs(combos, commands, layout, force=True)[0]) == 4
    changed = [(n, t + " --fast" if n == "train" else t) for n, t in commands]
    assert [(c.name, cmd) for c, cmd, _ in plan_runs(combos[:1], changed, layout)[0]] == [
        ("lr_0.1-seed_1", "train"), ("lr_0.1-seed_1", "test"),
    ]


def test_a_job_that_ended_unwatched_is_gathered_not_rerun(prepared: Prepared) -> None:
    layout, combos, commands = prepared
    combos = combos[:1]
    _finish(layout, "lr_0.1-seed_1", "train", 0, 100.0)
    # The coordinator stopped after the test's results came home, before gathering them.
    job = Path("job_results/.jobs/lr_0.1-seed_1.test")
    (job / "job_results/lr_0.1-seed_1").mkdir(parents=True)
    (job / "job_results/lr_0.1-seed_1/metrics.json").write_text('{"acc": 1}')
    _journal(Path("job_results"), {"t": 200.0, "job": job.name, "state": "started", "host": "h3", "gpus": [0]},
             {"t": 203.0, "job": job.name, "state": "finished", "code": 0})
    entries = [json.loads(line) for line in Path("job_results/.jobs/.journal.jsonl").read_text().splitlines()]
    assert recover(layout, combos, ["train", "test"], job_stats(entries)) == ["lr_0.1-seed_1.test"]
    assert read_json(Path("job_results/lr_0.1-seed_1/stat.json"))["test"]["host"] == "h3"
    assert read_json(Path("job_results/lr_0.1-seed_1/metrics.json")) == {"acc": 1}
    assert plan_runs(combos, commands, layout)[0] == []
    assert recover(layout, combos, ["train", "test"], job_stats(entries)) == []  # once only


def test_a_job_cannot_replace_the_sweeps_own_files(prepared: Prepared, caplog: pytest.LogCaptureFixture) -> None:
    layout = prepared[0]
    source = Path("job_results/.jobs/lr_0.1-seed_1.train/job_results/lr_0.1-seed_1")
    source.mkdir(parents=True)
    (source / "param.json").write_text("{}")
    (source / "sub").mkdir()
    (source / "sub" / "ok.txt").write_text("fine")
    collect(layout, "lr_0.1-seed_1", "train", None, ["train", "test"])
    assert read_json(Path("job_results/lr_0.1-seed_1/param.json"))["_name"] == "lr_0.1-seed_1"
    assert Path("job_results/lr_0.1-seed_1/sub/ok.txt").read_text() == "fine"
    assert "keeps for itself" in caplog.text
    assert Path("job_results/.jobs/lr_0.1-seed_1.train/job_results/lr_0.1-seed_1/param.json").read_text() == "{}"


def test_no_param_dir_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = parse_sweep("template:\n  run: parse {file} > {_output}/{file}.out\n---\nfile: [a.txt, b.txt]\n", "p.yaml")
    layout = Layout.create("out", param_dir=False)
    runs, _ = plan_runs(expand(s), select_commands(s, ()), layout)
    assert runs[0][2] == "parse a.txt > out/a.txt.out"
    prepare(runs, layout)
    assert read_json(Path("out/file_a.txt.param.json"))["file"] == "a.txt"
    assert layout.forwards("file_a.txt") == "out/file_a.txt.param.json"
    source = Path("out/.jobs/file_a.txt.run/out")
    source.mkdir(parents=True)
    (source / "a.txt.out").write_text("parsed")
    Path("out/.jobs/file_a.txt.run.out").write_text("log")
    collect(layout, "file_a.txt", "run", {"code": 0}, ["run"])
    assert Path("out/a.txt.out").read_text() == "parsed"
    assert Path("out/file_a.txt.run.out").read_text() == "log"
    assert read_json(Path("out/file_a.txt.stat.json")) == {"run": {"code": 0}}


# --- the command on this machine (no SSH) --------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
LOCAL = ["--no-gpu-required", "--memory-required", "0", "--num-cpus", "0"]
SMALL = """\
template:
  train: echo "training {lr}"; echo "weights {lr}" > {_output}/w.txt
  test: cat {_output}/w.txt
default: {lr: 1}
---
lr: [1, 2, 3]
"""


def local_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(cwd / "home"))
    return subprocess.run([sys.executable, "-m", "ssh_scheduler", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_placeholder_without_value_stops_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("template: echo {lr} {momentum}\n---\nlr: [1, 2]\n")
    result = local_cli(tmp_path, "execute_batch", "--sweep", "s.yaml", "--machines", "missing.yaml")
    assert result.returncode == 2
    assert result.stderr == (
        "error: s.yaml: command 'run' uses {momentum}, which has no value in document 2 "
        "(add momentum to 'default' or to that document)\n"
    )
    assert not (tmp_path / "job_results").exists()


def test_dry_run_and_sample_list_without_running(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(SMALL)
    result = local_cli(tmp_path, "sweep", "s.yaml", "--dry-run", "--sample", "2", "--seed", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5 and lines[-1] == "2 combinations: 4 commands to run, 0 skipped"
    assert all(line.startswith("would run: lr_") for line in lines[:4])
    assert local_cli(tmp_path, "sweep", "s.yaml", "--dry-run", "--sample", "2", "--seed", "3").stdout == result.stdout
    assert not (tmp_path / "job_results").exists()


def test_debug_runs_the_first_combination_with_its_output_on_the_console(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(SMALL)
    result = local_cli(tmp_path, "sweep", "s.yaml", "-d", *LOCAL)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr  # job_results is never sent with "."
    assert "training 1\n" in result.stdout and "training 2" not in result.stdout
    assert sorted(p.name for p in (tmp_path / "job_results").iterdir()) == [".jobs", "lr_1"]
    assert json.loads((tmp_path / "job_results/lr_1/stat.json").read_text())["train"]["code"] == 0


def test_no_param_dir_run_on_this_machine(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(
        "template:\n  run: echo {file} > {_output}/{file}.done; echo ran {file}\n---\nfile: [a, b]\n"
    )
    result = local_cli(tmp_path, "sweep", "s.yaml", "--no-param-dir", "--results-dir", "out", *LOCAL)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    assert (out / "a.done").read_text() == "a\n" and (out / "b.done").read_text() == "b\n"
    assert json.loads((out / "file_a.stat.json").read_text())["run"]["code"] == 0
    assert (out / "file_b.run.out").read_text() == "ran b\n"  # the log, named for the combination
    assert "warning: --results-dir out lies inside --copy-forwards .: every job" in result.stderr
    table = local_cli(tmp_path, "results", "out", "--tsv")
    assert table.stdout.splitlines() == ["name\tfile\tstate", "file_a\ta\tdone", "file_b\tb\tdone"]


def test_sweep_and_results_are_listed_commands(tmp_path: Path) -> None:
    listed = local_cli(tmp_path, "--help").stdout
    assert re.search(r"│ sweep\s+Run every combination", listed)
    assert re.search(r"│ results\s+One row per combination", listed)
