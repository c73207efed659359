"""Every option of ``execute_batch``, ``sweep``, ``execute_remote`` and a ``--commands`` line, once.

Plain data, so every layer may read it: the command line (``cli/``) turns each entry into a typer
parameter, the ``--commands`` line parser (:mod:`ssh_scheduler.jobs.command_line`) takes its
flags from it, a sweep document's needs keys are its needs' names, and the coordinator builds
``BatchOptions`` from where each value goes (:func:`destined`).  A flag, its default or its help
is written here and nowhere else, so the commands that share an option cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BATCH",
    "LINE",
    "OPTIONS",
    "REMOTE",
    "SWEEP",
    "Option",
    "destined",
    "need_options",
    "option",
    "options_of",
]

BATCH = "execute_batch"
SWEEP = "sweep"
REMOTE = "execute_remote"
LINE = "line"
"""A line of an ``execute_batch --commands`` batch: a job's own flags."""


@dataclass(frozen=True, slots=True)
class Option:
    """One option: its flags, what one value is, its default and help, which commands take it,
    and where its value goes."""

    name: str
    """The value's name: the command's parameter and the key of the parsed values."""
    flags: tuple[str, ...]
    """The long flag first (messages name it), then its short form."""
    kind: type
    """What one value is: ``bool`` (a switch), ``int``, ``float``, ``str`` or ``Path``."""
    default: Any
    help: str
    commands: tuple[str, ...]
    to: str
    """Where the value goes: ``options.F`` (a field of ``BatchOptions`` / ``RemoteOptions``),
    ``limits.F`` (``CopyLimits``), ``forward.F`` (``ForwardPolicy``), ``needs.F`` (``Needs``),
    ``job.F`` (a ``--commands`` line's own), ``sweep`` (which combinations and commands run) or
    ``run`` (read by the command itself: the hosts, what is printed, detaching)."""
    many: bool = False
    """Repeatable: the value is a list (``None`` when the flag is not given)."""
    greedy: bool = False
    """The ancestor's form: several values after one flag (``--machines a.yaml b.yaml``)."""
    sets: Any = None
    """A switch's value at ``to`` when given (``--no-gpu-required``: ``needs.gpus`` is 0)."""
    count: bool = False
    """Counted (``-vv``): the value is how often the flag was given."""
    minimum: int | None = None
    check: str = ""
    """Checked before anything connects: ``seconds`` (a positive number) or ``count`` (0 or more)."""
    helps: tuple[tuple[str, str], ...] = ()
    """``(command, help)`` where a command words the help its own way."""
    refused: tuple[tuple[str, str], ...] = ()
    """``(command, why)``: the command knows the flag and refuses it with this reason."""
    hidden: bool = False

    @property
    def flag(self) -> str:
        return self.flags[0]

    @property
    def switch(self) -> bool:
        return self.kind is bool and not self.count

    def help_for(self, command: str) -> str:
        return dict(self.helps).get(command, self.help)

    def refused_by(self, command: str) -> str | None:
        """Why ``command`` refuses this option, if it does."""
        return dict(self.refused).get(command)


_ALL = (BATCH, SWEEP, REMOTE, LINE)
_RUNS = (BATCH, SWEEP)  # the commands that run a batch
_SWEEP_ONLY = (SWEEP,)


def _sweep(name: str, flags: tuple[str, ...], kind: type, default: Any, help: str, **more: Any) -> Option:
    return Option(name, flags, kind, default, help, _SWEEP_ONLY, "sweep", **more)


OPTIONS: tuple[Option, ...] = (
    # --- where the jobs run ---
    Option("machines", ("--machines",), str, None,
           "machine YAML files, ~/.ssh/config aliases or ranges like gpu[1-4]; none = this machine",
           _RUNS, "run", many=True, greedy=True),
    Option("machine", ("--machine",), str, None, "machine YAML or ~/.ssh/config alias; none = this machine",
           (REMOTE,), "run"),
    Option("exclude_hosts", ("--exclude-hosts", "-x"), str, None, "hosts to leave out", _RUNS, "run",
           many=True, greedy=True),
    # --- which jobs: a sweep's choice of documents, commands and combinations ---
    _sweep("titles", ("--title", "-t"), str, None, "only the documents with this _title", many=True),
    _sweep("only_commands", ("--command", "-c"), str, None, "only this command of the template", many=True),
    _sweep("debug", ("--debug", "-d"), bool, False, "run only the first combination, its output on the console"),
    _sweep("force", ("--force", "-f"), bool, False, "rerun commands that already succeeded"),
    _sweep("no_param_dir", ("--no-param-dir",), bool, False, "no folder per combination: {_output} is the results folder"),
    _sweep("sample_count", ("--sample",), int, None, "run N combinations drawn at random"),
    _sweep("seed", ("--seed",), int, 0, "random seed of --sample"),
    Option("commands", ("--commands",), bool, False, "lines are partial execute_remote commands", (BATCH,), "run",
           refused=((SWEEP, "a sweep's jobs are its template's commands, not lines of a batch file"),)),
    # --- what a job takes along, and a job's own name and order ---
    Option("copy_forwards", ("--copy-forwards",), str, None, "paths to send (default: .)", _ALL,
           "options.copy_forwards", many=True, greedy=True, helps=((REMOTE, ""),)),
    Option("copy_backwards", ("--copy-backwards",), str, None,
           "paths to bring back (default: what the job created or changed)", _ALL, "options.copy_backwards",
           many=True, greedy=True,
           helps=((SWEEP, "paths to bring back besides {_output}"), (REMOTE, ""))),
    Option("job_name", ("--job-name",), str, None, "", (REMOTE, LINE), "options.job_name"),
    Option("after", ("--after",), str, None, "start only once job NAME finished with exit 0", (LINE,),
           "job.after", many=True),
    Option("gpus", ("--gpus",), str, None, "set CUDA_VISIBLE_DEVICES to this", (REMOTE,), "options.gpus"),
    # --- what a job needs (a --commands line and a sweep document set their own) ---
    Option("num_cpus", ("--num-cpus",), float, 1.0, "CPU cores per job", (*_RUNS, LINE), "needs.cpus"),
    Option("memory_required", ("--memory-required",), int, 1000, "RAM per job, MB", (*_RUNS, LINE), "needs.memory_mb"),
    Option("reserve", ("--reserve",), bool, False, "each job gets a whole machine", (*_RUNS, LINE),
           "needs.reserve_machine", sets=True),
    Option("no_gpu_required", ("--no-gpu-required",), bool, False, "jobs need no GPU", (*_RUNS, LINE),
           "needs.gpus", sets=0),
    Option("gpus_per_job", ("--gpus-per-job",), int, None, "GPUs per job (default 1 where hosts have GPUs)",
           (*_RUNS, LINE), "needs.gpus"),
    Option("gpu_memory_required", ("--gpu-memory-required",), int, 1000, "GPU memory per job and GPU, MB",
           (*_RUNS, LINE), "needs.gpu_memory_mb"),
    Option("gpu_utilization", ("--gpu-utilization",), float, 0.0, "fraction of a GPU's compute per job",
           (*_RUNS, LINE), "needs.gpu_utilization"),
    Option("no_reserve_gpu", ("--no-reserve-gpu",), bool, False, "let jobs share a GPU", (*_RUNS, LINE),
           "needs.reserve_gpu", sets=False),
    # --- how the batch runs ---
    Option("dry_run", ("--dry-run",), bool, False, "print the placement plan, run nothing", _RUNS, "options.dry_run",
           helps=((SWEEP, "list the commands that would run, run nothing"),)),
    Option("accept_new", ("--accept-new",), bool, False, "trust and record unknown host keys", (*_RUNS, REMOTE),
           "options.accept_new", helps=((REMOTE, "trust and record an unknown host key"),)),
    Option("results_dir", ("--results-dir",), Path, Path("job_results"), "", (*_RUNS, REMOTE), "options.results_dir",
           helps=((SWEEP, "where the combination folders go"),)),
    Option("probe_interval", ("--probe-interval",), float, 15.0, "seconds between re-probes", _RUNS,
           "options.probe_interval", check="seconds"),
    Option("max_connecting", ("--max-connecting",), int, 8,
           "hosts connecting at once (keep it below the hosts' sshd MaxStartups, 10 by default)", _RUNS,
           "options.max_connecting", minimum=1),
    Option("lease", ("--lease",), float, 60.0, "seconds a host keeps jobs alive without hearing from us", _RUNS,
           "options.lease", check="seconds"),
    Option("max_result_bytes", ("--max-result-bytes",), int, 10 * 1024**3, "", _RUNS, "limits.max_bytes"),
    Option("max_result_files", ("--max-result-files",), int, 100_000, "", _RUNS, "limits.max_files"),
    Option("max_result_depth", ("--max-result-depth",), int, 64, "folders deep a job's result may be", _RUNS,
           "limits.max_depth", minimum=1),
    Option("max_batch_result_files", ("--max-batch-result-files",), int, 10_000_000,
           "files all the batch's jobs together may bring back", _RUNS, "limits.batch_files", minimum=0),
    Option("max_batch_result_bytes", ("--max-batch-result-bytes",), int, 10 * 1024**4,
           "bytes all the batch's jobs together may bring back", _RUNS, "limits.batch_bytes", minimum=0),
    Option("max_output_bytes", ("--max-output-bytes",), int, None,
           "stdout + stderr a job may send back; past it the job is killed", (*_RUNS, REMOTE),
           "limits.max_output_bytes",
           helps=((REMOTE, "stdout + stderr the job may send back; past it the job is killed"),)),
    Option("retries", ("--retries",), int, 0, "run a failed job again up to N times, on another host if possible",
           _RUNS, "options.retries", check="count",
           helps=((SWEEP, "run a failed command again up to N times"),)),
    Option("retry_failed", ("--retry-failed",), bool, False,
           "rerun jobs an earlier run recorded as failed (their results move to job_results/.failed/)", (BATCH,),
           "options.retry_failed",
           refused=((SWEEP, "a sweep reruns every command that failed anyway (stat.json says which)"),)),
    Option("allow_changed", ("--allow-changed",), bool, False,
           "run jobs whose command changed since the journal recorded them", (BATCH,), "options.allow_changed",
           refused=((SWEEP, "a sweep reruns a command whose text changed anyway (param.json says which)"),)),
    Option("timeout", ("--timeout",), float, None, "seconds a job may run before its processes are killed",
           (*_RUNS, REMOTE), "options.timeout", check="seconds",
           helps=((SWEEP, "seconds a command may run"),
                  (REMOTE, "seconds the job may run before its processes are killed (exit 124)"))),
    Option("halt", ("--halt",), str, None, "now,fail=N | soon,fail=N | soon,fail=N%: stop after failures", _RUNS,
           "options.halt"),
    Option("keepalive", ("--keepalive",), float, None, "seconds between SSH keepalives; 3 missed = host lost",
           _RUNS, "options.keepalive", check="seconds"),
    # --- what the copy forward may send ---
    Option("yes_copy_all", ("--yes-copy-all",), bool, False,
           "send the default copy forward (.) even above --forward-max-bytes/--forward-max-files", _RUNS,
           "forward.confirmed"),
    Option("forward_max_bytes", ("--forward-max-bytes",), int, None,
           "the default copy forward (.) stops above this many bytes (default 1 GiB)", _RUNS, "forward.max_bytes"),
    Option("forward_max_files", ("--forward-max-files",), int, None,
           "the default copy forward (.) stops above this many files (default 10000)", _RUNS, "forward.max_files"),
    Option("allow_secret_copies", ("--allow-secret-copies",), bool, False,
           "send secret paths you name (.ssh, .aws, private keys...); a walk still withholds them", _RUNS,
           "forward.allow_secrets"),
    Option("allow_outside_copies", ("--allow-outside-copies",), bool, False,
           "let --commands lines copy paths outside the batch's folder", _RUNS, "forward.allow_outside",
           helps=((SWEEP, "let --copy-forwards/--copy-backwards name paths outside this folder"),)),
    # --- what the user sees, and where the coordinator runs ---
    Option("json_events", ("--json",), bool, False, "one JSON object per event on stdout (schema in the README)",
           _RUNS, "run"),
    Option("plain", ("--plain",), bool, False, "plain lines even on a terminal (no live view)", _RUNS, "run"),
    Option("verbose", ("--verbose", "-v"), int, 0, "also show probes, connections and transfers", _RUNS, "run",
           count=True),
    Option("quiet", ("--quiet", "-q"), bool, False, "print only failures and the summary", _RUNS, "run"),
    Option("detach", ("--detach",), bool, False,
           "return once the batch is under way; it runs on in the background (ssh-scheduler status, attach, cancel)",
           _RUNS, "run",
           helps=((SWEEP, "return once the sweep is under way; it runs on in the background "
                          "(ssh-scheduler status, attach, cancel)"),)),
    Option("status_fd", ("--detached-status-fd",), int, None,
           "set by --detach on the coordinator it starts: the pipe that tells it the batch is under way",
           _RUNS, "run", hidden=True),
)

_BY_NAME = {o.name: o for o in OPTIONS}


def option(name: str) -> Option:
    return _BY_NAME[name]


def options_of(command: str) -> Iterator[Option]:
    """The options ``command`` takes, in the table's order (its ``--help`` order)."""
    return (o for o in OPTIONS if command in o.commands)


def need_options() -> Iterator[Option]:
    """The needs flags: one ``Needs`` field each, a switch setting it or a value."""
    return (o for o in OPTIONS if o.to.startswith("needs."))


def destined(values: Mapping[str, Any], group: str) -> dict[str, Any]:
    """The given values whose option goes to ``group.FIELD``, by field: a list as a tuple, and
    ``None`` (not given) left out, so the field keeps its own default."""
    fields: dict[str, Any] = {}
    for name, value in values.items():
        found = _BY_NAME.get(name)
        if found is None or value is None:
            continue
        where, _, field = found.to.partition(".")
        if where == group:
            fields[field] = tuple(value) if isinstance(value, list) else value
    return fields
