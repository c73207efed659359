"""Command-line layer: thin typer commands over the Python API.

The ancestor took several values after one flag (``--machines a.yaml b.yaml``); click does not,
so ``expand_multi_value`` rewrites such argv into the repeated-flag form before typer sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from ssh_scheduler.errors import SchedulerError

if TYPE_CHECKING:
    from ssh_scheduler.coordinator.batch import Batch
    from ssh_scheduler.coordinator.batch_run import BatchSummary
    from ssh_scheduler.coordinator.early_hosts import EarlyHosts
    from ssh_scheduler.machines.config import Machine
    from ssh_scheduler.planner.allocate import Needs

DETACHED_ENV = "SSH_SCHEDULER_DETACHED"  # detach.DETACHED_ENV, without importing it at start-up
invoked_args: list[str] = []
"""The command's arguments as run_app passed them on: ``--detach`` runs them again."""
MULTI_VALUE = ("--machines", "--copy-forwards", "--copy-backwards", "--exclude-hosts", "-x")
T = TypeVar("T")


def expand_multi_value(argv: Sequence[str], options: Sequence[str] = MULTI_VALUE) -> list[str]:
    """``--machines a b --x`` -> ``--machines a --machines b --x``.  Values run until the next
    token that starts with ``-`` (or ``--``, which ends them and is dropped)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in options:
            i += 1
            values = []
            while i < len(argv) and not argv[i].startswith("-"):
                values.append(argv[i])
                i += 1
            if i < len(argv) and argv[i] == "--" and values:
                i += 1
            if not values:
                out.append(token)  # let typer report the missing value
            for value in values:
                out.extend([token, value])
            continue
        out.append(token)
        i += 1
    return out


def fail(exc: SchedulerError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(exc.exit_code)


def run_async(factory: Callable[[], Coroutine[Any, Any, T]], on_interrupt: Callable[[], None] | None = None) -> T:
    """Run a coroutine; SIGINT/SIGTERM call ``on_interrupt`` (drain, then kill) when given."""

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        handler = on_interrupt or task.cancel
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, handler)
        return await factory()

    # Handled here too, not only around the app: click would turn a bare EPIPE into exit 1.
    with quiet_on_broken_pipe():
        return asyncio.run(main())


def out_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def err_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# --- execute_batch -------------------------------------------------------------------------------

MachinesOpt = Annotated[
    list[str] | None,
    typer.Option("--machines", help="machine YAML files, ~/.ssh/config aliases or ranges like gpu[1-4]; none = this machine"),
]


# The flags execute_batch shares with sweep (cli_sweep.py).
ExcludeOpt = Annotated[list[str] | None, typer.Option("--exclude-hosts", "-x", help="hosts to leave out")]
NumCpusOpt = Annotated[float, typer.Option("--num-cpus", help="CPU cores per job")]
MemoryOpt = Annotated[int, typer.Option("--memory-required", help="RAM per job, MB")]
ReserveOpt = Annotated[bool, typer.Option("--reserve", help="each job gets a whole machine")]
NoGpuOpt = Annotated[bool, typer.Option("--no-gpu-required", help="jobs need no GPU")]
GpusPerJobOpt = Annotated[int | None, typer.Option("--gpus-per-job", help="GPUs per job (default 1 where hosts have GPUs)")]
GpuMemoryOpt = Annotated[int, typer.Option("--gpu-memory-required", help="GPU memory per job and GPU, MB")]
GpuUtilizationOpt = Annotated[float, typer.Option("--gpu-utilization", help="fraction of a GPU's compute per job")]
NoReserveGpuOpt = Annotated[bool, typer.Option("--no-reserve-gpu", help="let jobs share a GPU")]
AcceptNewOpt = Annotated[bool, typer.Option("--accept-new", help="trust and record unknown host keys")]
ProbeIntervalOpt = Annotated[float, typer.Option("--probe-interval", help="seconds between re-probes")]
LeaseOpt = Annotated[float, typer.Option("--lease", help="seconds a host keeps jobs alive without hearing from us")]
HaltOpt = Annotated[str | None, typer.Option("--halt", help="now,fail=N | soon,fail=N | soon,fail=N%: stop after failures")]
KeepaliveOpt = Annotated[float | None, typer.Option("--keepalive", help="seconds between SSH keepalives; 3 missed = host lost")]


def flag_needs(
    num_cpus: float, memory_required: int, reserve: bool, no_gpu_required: bool,
    gpus_per_job: int | None, gpu_memory_required: int, gpu_utilization: float, no_reserve_gpu: bool,
) -> tuple[Needs, bool]:
    """The needs flags as one :class:`Needs`, and whether GPUs were asked for explicitly."""
    from ssh_scheduler.planner.allocate import Needs

    gpus = 0 if no_gpu_required else (gpus_per_job if gpus_per_job is not None else 1)
    needs = Needs(
        cpus=num_cpus,
        memory_mb=memory_required,
        gpus=gpus,
        gpu_memory_mb=gpu_memory_required if gpus else 0,
        gpu_utilization=gpu_utilization if gpus else 0.0,
        reserve_machine=reserve,
        reserve_gpu=not no_reserve_gpu,
    )
    return needs, no_gpu_required or gpus_per_job is not None


def execute_batch(
    batch_file: Annotated[Path, typer.Argument(help="one shell command per line")],
    machines: MachinesOpt = None,
    exclude_hosts: ExcludeOpt = None,
    commands: Annotated[bool, typer.Option("--commands", help="lines are partial execute_remote commands")] = False,
    copy_forwards: Annotated[list[str] | None, typer.Option("--copy-forwards", help="paths to send (default: .)")] = None,
    copy_backwards: Annotated[list[str] | None, typer.Option("--copy-backwards", help="paths to bring back (default: what the job created or changed)")] = None,
    num_cpus: NumCpusOpt = 1.0,
    memory_required: MemoryOpt = 1000,
    reserve: ReserveOpt = False,
    no_gpu_required: NoGpuOpt = False,
    gpus_per_job: GpusPerJobOpt = None,
    gpu_memory_required: GpuMemoryOpt = 1000,
    gpu_utilization: GpuUtilizationOpt = 0.0,
    no_reserve_gpu: NoReserveGpuOpt = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the placement plan, run nothing")] = False,
    accept_new: AcceptNewOpt = False,
    results_dir: Annotated[Path, typer.Option("--results-dir")] = Path("job_results"),
    probe_interval: ProbeIntervalOpt = 15.0,
    max_connecting: Annotated[int, typer.Option("--max-connecting", min=1, help="hosts connecting at once (keep it below the hosts' sshd MaxStartups, 10 by default)")] = 8,
    lease: LeaseOpt = 60.0,
    max_result_bytes: Annotated[int, typer.Option("--max-result-bytes")] = 10 * 1024**3,
    max_result_files: Annotated[int, typer.Option("--max-result-files")] = 100_000,
    max_output_bytes: Annotated[int | None, typer.Option("--max-output-bytes", help="stdout + stderr a job may send back; past it the job is killed")] = None,
    retries: Annotated[int, typer.Option("--retries", help="run a failed job again up to N times, on another host if possible")] = 0,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="rerun jobs an earlier run recorded as failed (their results move to job_results/.failed/)")] = False,
    allow_changed: Annotated[bool, typer.Option("--allow-changed", help="run jobs whose command changed since the journal recorded them")] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", help="seconds a job may run before its processes are killed")] = None,
    halt: HaltOpt = None,
    keepalive: KeepaliveOpt = None,
    yes_copy_all: Annotated[bool, typer.Option("--yes-copy-all", help="send the default copy forward (.) even above --forward-max-bytes/--forward-max-files")] = False,
    forward_max_bytes: Annotated[int | None, typer.Option("--forward-max-bytes", help="the default copy forward (.) stops above this many bytes (default 1 GiB)")] = None,
    forward_max_files: Annotated[int | None, typer.Option("--forward-max-files", help="the default copy forward (.) stops above this many files (default 10000)")] = None,
    allow_secret_copies: Annotated[bool, typer.Option("--allow-secret-copies", help="send secret paths you name (.ssh, .aws, private keys...); a walk still withholds them")] = False,
    allow_outside_copies: Annotated[bool, typer.Option("--allow-outside-copies", help="let --commands lines copy paths outside the batch's folder")] = False,
    json_events: Annotated[bool, typer.Option("--json", help="one JSON object per event on stdout (schema in the README)")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="plain lines even on a terminal (no live view)")] = False,
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="also show probes, connections and transfers")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only failures and the summary")] = False,
    detach: Annotated[bool, typer.Option("--detach", help="return once the batch is under way; it runs on in the background (ssh-scheduler status, attach, cancel)")] = False,
) -> None:
    """Run every line of BATCH_FILE as a job, placed where its needs fit.

    execute_batch --sweep SWEEP.yaml runs a parameter sweep instead (ssh-scheduler sweep --help).
    """
    from ssh_scheduler.coordinator.early_hosts import suits as early_start_suits
    from ssh_scheduler.coordinator.preflight import check_numbers, check_results_dir
    from ssh_scheduler.jobs.batch_file import parse_batch
    from ssh_scheduler.machines.config import load_machines, local_machine

    # --- detach (cli_detach.py): start the batch in the background, or be that background run ---
    if detach:
        from ssh_scheduler.cli.detach import start_detached

        raise typer.Exit(start_detached(invoked_args, results_dir, json_events=json_events, dry_run=dry_run))
    session = None
    if DETACHED_ENV in os.environ:
        from ssh_scheduler.coordinator.detach import CoordinatorSession

        session = CoordinatorSession.from_environment(results_dir)
    # --- end detach ---
    try:
        check_numbers(timeout=timeout, keepalive=keepalive, retries=retries, lease=lease, probe_interval=probe_interval)
        if not dry_run:
            check_results_dir(results_dir)
        try:
            data = batch_file.read_bytes()
        except OSError as exc:
            raise SchedulerError(f"cannot read batch file {batch_file}: {exc.strerror}") from None
        jobs = parse_batch(data, str(batch_file), commands_mode=commands)
        hosts = load_machines(machines, exclude=exclude_hosts or ()) if machines else [local_machine()]
        needs, gpus_explicit = flag_needs(
            num_cpus, memory_required, reserve, no_gpu_required, gpus_per_job,
            gpu_memory_required, gpu_utilization, no_reserve_gpu,
        )
        if halt:  # a bad --halt is refused before any host is contacted
            from ssh_scheduler.planner.policy import parse_halt

            parse_halt(halt)
        verbosity = -1 if quiet else verbose
        # The hosts can start their agents while we import and set the batch up (early_hosts.py);
        # not with -v, whose connection log would start before it is wired to the display.
        early = bool(machines) and not dry_run and session is None and verbosity <= 0 and early_start_suits(results_dir)

        def prepare(early_hosts: EarlyHosts | None) -> tuple[Batch, contextlib.AbstractContextManager[Any]]:
            from ssh_scheduler.coordinator.batch import Batch, BatchOptions
            from ssh_scheduler.executors.transfer import CopyLimits
            from ssh_scheduler.jobs.forward import (
                DEFAULT_MAX_BYTES,
                DEFAULT_MAX_FILES,
                ForwardPolicy,
            )
            from ssh_scheduler.planner.policy import parse_halt

            options = BatchOptions(
                needs=needs,
                gpus_explicit=gpus_explicit,
                copy_forwards=tuple(copy_forwards or (".",)),
                copy_backwards=tuple(copy_backwards) if copy_backwards else None,
                results_dir=results_dir,
                dry_run=dry_run,
                accept_new=accept_new,
                probe_interval=probe_interval,
                max_connecting=max_connecting,
                lease=lease,
                limits=CopyLimits(max_result_bytes, max_result_files, max_output_bytes),
                retries=retries,
                retry_failed=retry_failed,
                allow_changed=allow_changed,
                timeout=timeout,
                halt=parse_halt(halt),
                keepalive=keepalive,
                forward=ForwardPolicy(
                    allow_secrets=allow_secret_copies,
                    allow_outside=allow_outside_copies,
                    confirmed=yes_copy_all or bool(copy_forwards),
                    max_bytes=DEFAULT_MAX_BYTES if forward_max_bytes is None else forward_max_bytes,
                    max_files=DEFAULT_MAX_FILES if forward_max_files is None else forward_max_files,
                ),
            )
            batch = Batch(jobs, hosts, options, early=early_hosts)
            display = detached_display(session, batch, verbosity) if session else batch_display(
                batch, json_events=json_events, plain=plain, verbosity=verbosity
            )
            return batch, display

        if early:
            summary = run_with_early_hosts(hosts, prepare, accept_new=accept_new, keepalive=keepalive,
                                           lease=lease, max_connecting=max_connecting)
        else:
            batch, display = prepare(None)
            with display:
                summary = run_async(batch.run, batch.request_stop)
    except SchedulerError as exc:
        raise fail(exc) from None
    except asyncio.CancelledError:
        err_line("cancelled: running jobs were killed")
        raise typer.Exit(130) from None
    if not dry_run:
        from ssh_scheduler.view.display import summary_lines

        for line in summary_lines(summary, results_dir):
            err_line(line)
    raise typer.Exit(summary.exit_code)


def run_with_early_hosts(
    machines: Sequence[Machine],
    prepare: Callable[[EarlyHosts | None], tuple[Batch, contextlib.AbstractContextManager[Any]]],
    **connect: Any,
) -> BatchSummary:
    """Start the hosts (early_hosts.py), set the batch up while they start their agents, run it."""
    from ssh_scheduler.coordinator.early_hosts import EarlyHosts

    batch: Batch | None = None
    main_task: asyncio.Task[Any] | None = None

    def interrupted() -> None:  # before the batch exists, a signal ends the start-up
        if batch is not None:
            batch.request_stop()
        elif main_task is not None:
            main_task.cancel()

    async def run() -> BatchSummary:
        nonlocal batch, main_task
        main_task = asyncio.current_task()
        early = EarlyHosts(machines, **connect)
        early.start()
        try:
            await early.agents_starting()  # the handshakes first, then our set-up beside the agents
            batch, display = prepare(early)
        except BaseException:
            await early.close()
            raise
        with display:
            return await batch.run()

    return run_async(run, interrupted)


def detached_display(session: Any, batch: Any, verbosity: int) -> contextlib.AbstractContextManager[Any]:
    """The detached coordinator's display (cli_detach.py)."""
    from ssh_scheduler.cli.detach import DetachedDisplay

    return DetachedDisplay(session, batch, verbosity)


def batch_display(batch: Any, *, json_events: bool, plain: bool, verbosity: int) -> contextlib.AbstractContextManager[Any]:
    """Subscribe what the user sees: ``--json`` events, the live view on a terminal, or the plain
    lines (not a terminal, ``--plain``, ``NO_COLOR``, ``TERM=dumb``)."""
    from ssh_scheduler.view.display import JsonLines, plain_subscriber, wire_logging

    if json_events:
        batch.bus.subscribe(JsonLines(out_line))
        batch.bus.subscribe(plain_subscriber(lambda _: None, err_line, min(verbosity, 0)))
        wire_logging(verbosity, err_line)
        return contextlib.nullcontext()
    tty = sys.stdout.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
    if plain or not tty or batch.options.dry_run:
        batch.bus.subscribe(plain_subscriber(out_line, err_line, verbosity))
        wire_logging(verbosity, err_line)
        return contextlib.nullcontext()
    from ssh_scheduler.view.live import LiveView

    view = LiveView(verbosity=verbosity)
    batch.bus.subscribe(view)
    wire_logging(verbosity, view.print_err)  # above the live area, not through it
    return view


# --- execute_remote ------------------------------------------------------------------------------


def execute_remote(
    command: Annotated[str, typer.Argument(help="the shell command to run")],
    machine: Annotated[str | None, typer.Option("--machine", help="machine YAML or ~/.ssh/config alias; none = this machine")] = None,
    copy_forwards: Annotated[list[str] | None, typer.Option("--copy-forwards")] = None,
    copy_backwards: Annotated[list[str] | None, typer.Option("--copy-backwards")] = None,
    job_name: Annotated[str | None, typer.Option("--job-name")] = None,
    gpus: Annotated[str | None, typer.Option("--gpus", help="set CUDA_VISIBLE_DEVICES to this")] = None,
    accept_new: Annotated[bool, typer.Option("--accept-new", help="trust and record an unknown host key")] = False,
    results_dir: Annotated[Path, typer.Option("--results-dir")] = Path("job_results"),
    timeout: Annotated[float | None, typer.Option("--timeout", help="seconds the job may run before its processes are killed (exit 124)")] = None,
    max_output_bytes: Annotated[int | None, typer.Option("--max-output-bytes", help="stdout + stderr the job may send back; past it the job is killed")] = None,
) -> None:
    """Run one command on one machine, streaming its output; exits with its exit status."""
    from ssh_scheduler.coordinator.remote import RemoteOptions
    from ssh_scheduler.coordinator.remote import execute_remote as run_remote
    from ssh_scheduler.executors.transfer import CopyLimits
    from ssh_scheduler.jobs.job_names import validate_job_name
    from ssh_scheduler.machines.config import load_machine, local_machine

    try:
        if job_name is not None:
            validate_job_name(job_name)
        target = load_machine(machine) if machine else local_machine()
        options = RemoteOptions(
            copy_forwards=tuple(copy_forwards or (".",)),
            copy_backwards=tuple(copy_backwards) if copy_backwards else None,
            job_name=job_name,
            results_dir=results_dir,
            accept_new=accept_new,
            gpus=gpus,
            timeout=timeout,
            limits=CopyLimits(max_output_bytes=max_output_bytes),
        )
        code = run_async(lambda: run_remote(target, command, options, warn=lambda w: err_line(f"warning: {w}")))
    except SchedulerError as exc:
        raise fail(exc) from None
    except asyncio.CancelledError:
        err_line("cancelled: the remote job was killed")
        raise typer.Exit(130) from None
    raise typer.Exit(code)


# --- combine_folders -----------------------------------------------------------------------------


def combine_folders(
    dest: Annotated[Path, typer.Argument(help="folder to merge into")],
    sources: Annotated[list[Path], typer.Argument(help="folders to merge")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would be copied")] = False,
) -> None:
    """Merge result folders: identical files collapse, conflicting ones are an error."""
    from ssh_scheduler.results.combine import combine_folders as combine

    try:
        report = combine(dest, sources, dry_run=dry_run, out=out_line, warn=err_line)
    except SchedulerError as exc:
        raise fail(exc) from None
    if not dry_run:
        err_line(f"combined: {report.copied} copied, {report.identical} identical")


# --- wiring --------------------------------------------------------------------------------------

COMMANDS: dict[str, Callable[..., None]] = {
    "execute_batch": execute_batch,
    "execute_remote": execute_remote,
    "combine_folders": combine_folders,
}


LAZY_COMMANDS = ("execute_to", "sweep", "results")
CONTROL_COMMANDS = ("status", "jobs", "pause", "resume", "cancel", "doctor", "attach")
"""Commands of cli_status: read a batch's journal, steer its coordinator, check the hosts."""


def command(name: str) -> Callable[..., None]:
    """The typer function of a command; execute_to's and the sweep's modules load only when they
    are wanted (start-up time is part of every run)."""
    if name == "execute_to":
        from ssh_scheduler.cli.fleet import execute_to_command

        return execute_to_command
    if name in ("sweep", "results"):
        from ssh_scheduler.cli.sweep import COMMANDS as SWEEP_COMMANDS

        return SWEEP_COMMANDS[name]
    if name == "attach":
        from ssh_scheduler.cli.detach import attach

        return attach
    if name in CONTROL_COMMANDS:
        from ssh_scheduler.cli.status import COMMANDS as control

        return control[name]
    return COMMANDS[name]


def route(name: str, args: list[str]) -> tuple[str, list[str]]:
    """``execute_batch --sweep FILE ...`` is ``sweep FILE ...``."""
    if name == "execute_batch" and any(a == "--sweep" or a.startswith("--sweep=") for a in args):
        from ssh_scheduler.cli.sweep import sweep_args

        return "sweep", sweep_args(args)
    return name, args


class _LowerLevel(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


def show_library_logs(level: int = logging.WARNING) -> None:
    """Library modules log (logger ``ssh_scheduler``); on the command line their warnings
    appear on stderr as ``warning: ...`` lines."""
    logger = logging.getLogger("ssh_scheduler")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_LowerLevel())
        logger.addHandler(handler)
        logger.setLevel(level)


def run_app(app: typer.Typer, args: Sequence[str], prog_name: str) -> None:
    show_library_logs()
    invoked_args[:] = expand_multi_value(args)
    with quiet_on_broken_pipe():
        app(args=list(invoked_args), prog_name=prog_name)


@contextlib.contextmanager
def quiet_on_broken_pipe() -> Iterator[None]:
    """A reader that went away (``execute_to ... | head``) ends us quietly with 141, as it ends
    any Unix filter, instead of with a traceback (asyncio may wrap the error in a group)."""
    try:
        yield
    except (BrokenPipeError, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and exc.subgroup(
            lambda e: not isinstance(e, (BrokenPipeError, BaseExceptionGroup))
        ):
            raise
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None  # 128 + SIGPIPE, what a shell reports for a filter


def single(name: str) -> Callable[[], None]:
    def entry() -> None:
        app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        wanted, args = route(name, sys.argv[1:])
        app.command(name=name)(command(wanted))
        run_app(app, args, name)

    return entry


execute_batch_main = single("execute_batch")
execute_remote_main = single("execute_remote")
combine_folders_main = single("combine_folders")
execute_to_main = single("execute_to")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    wanted = args[0].replace("-", "_") if args else ""
    if wanted in (*COMMANDS, *LAZY_COMMANDS, *CONTROL_COMMANDS):
        # Build only the command asked for: the others' modules need not load (start-up time).
        app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        target, rest = route(wanted, args[1:])
        app.command(name=wanted)(command(target))
        run_app(app, rest, f"ssh-scheduler {args[0]}")
        return
    app = typer.Typer(
        add_completion=False,
        pretty_exceptions_enable=False,
        help="Run batches of shell commands across many machines and GPUs over plain SSH.",
        no_args_is_help=True,
    )
    for name in (*COMMANDS, *LAZY_COMMANDS, *CONTROL_COMMANDS):
        func = command(name)
        app.command(name=name)(func)
        if "_" in name:  # a hidden twin with the same name would hide the command itself
            app.command(name=name.replace("_", "-"), hidden=True)(func)
    run_app(app, args, "ssh-scheduler")
