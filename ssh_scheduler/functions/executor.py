"""``ssh_scheduler.Executor``: Python functions run on the machines, as jobs of one batch.

A ``concurrent.futures.Executor``::

    with Executor(machines=["gpu[1-4]"], gpu_memory_required=7000) as ex:
        losses = list(ex.map(train, configs))          # in order, placed by live GPU memory
        big = ex.options(gpus_per_job=2).submit(train, large)

Each call is pickled (:mod:`ssh_scheduler.functions.payload`) and joins the executor's open batch
as a job whose work is the call: the same planner places it (GPUs by live free memory), the same
pipeline stages it, runs it in its own folder with ``CUDA_VISIBLE_DEVICES`` set, streams its
output into ``job_results/<job>.out``/``.err`` and brings its files home, the same journal
records it; retries, requeue from a lost host, ``timeout``, the live view (through ``bus``) and
``ssh-scheduler status``/``cancel`` work as for shell jobs.  The coordinator runs in a thread of
its own (:mod:`ssh_scheduler.functions.runtime`); each future is resolved from its job's end
(:mod:`ssh_scheduler.functions.outcome`).

Resume: a call's job name is its function's identity and its arguments' hash, so a rerun of a
script that was killed half-way gets the calls that finished from the results folder instead of
running them again (``resume=False``: every call runs, under a name of this run).  A call that
failed runs again (``retry_failed=False``: its exception is raised again instead).

The options are ``execute_batch``'s, by their table names (``jobs.options``): ``gpus_per_job``,
``gpu_memory_required``, ``gpu_utilization``, ``num_cpus``, ``memory_required``, ``reserve``,
``no_gpu_required``, ``retries``, ``timeout``, ``results_dir``, ``copy_forwards``... each checked
as the command line checks it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import concurrent.futures.thread
import dataclasses
import difflib
import itertools
import secrets
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from ssh_scheduler.coordinator.batch_run import batch_options
from ssh_scheduler.coordinator.preflight import check_numbers, check_results_dir
from ssh_scheduler.errors import ConfigError
from ssh_scheduler.events import EventBus
from ssh_scheduler.functions.payload import RUN_BATCH, Call, pickle_call
from ssh_scheduler.functions.runtime import CallBatch, CallFuture
from ssh_scheduler.jobs.batch_file import Job
from ssh_scheduler.jobs.needs import Needs, NeedsOverride, flag_needs
from ssh_scheduler.jobs.options import BATCH, Option, need_options, option, options_of
from ssh_scheduler.jobs.python_call import INFO, RESULT
from ssh_scheduler.machines.config import load_machines
from ssh_scheduler.machines.machine import Machine, local_machine
from ssh_scheduler.planner.policy import parse_halt
from ssh_scheduler.view.terminal import Printer, TerminalLines

__all__ = ["CallOptions", "Executor"]

DEFAULT_BUFFERSIZE = 4096
"""Calls :meth:`Executor.map` submits ahead of the result it yields: enough to keep a large
fleet busy, few enough that a map over 100,000 items pickles as it goes."""

_GROUPS = ("options", "limits", "forward", "needs")
_REFUSED = {"dry_run": "an executor runs its calls; plan a batch file with execute_batch --dry-run"}
OPTIONS: dict[str, Option] = {
    o.name: o
    for o in options_of(BATCH)
    if (o.to.partition(".")[0] in _GROUPS or o.name == "exclude_hosts") and o.name not in _REFUSED
}
"""The options an :class:`Executor` takes, by name (the option table's, with its checks)."""
NEEDS: dict[str, Option] = {o.name: o for o in need_options()}
"""What one call may ask for itself (:meth:`Executor.options`)."""


def _checked(given: Mapping[str, Any], allowed: Mapping[str, Option], where: str) -> dict[str, Any]:
    """The given option values, each of the kind its table entry says (a single path for a
    repeatable option becomes a list); an unknown name is refused with the closest known one."""
    values: dict[str, Any] = {}
    for name, value in given.items():
        found = allowed.get(name)
        if found is None:
            why = _REFUSED.get(name)
            close = difflib.get_close_matches(name, list(allowed), n=1)
            hint = why or (f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(allowed))}")
            raise ConfigError(f"{where}: unknown option {name!r} ({hint})")
        if value is None:
            continue
        if found.many:
            value = [value] if isinstance(value, str | Path) else list(value)
            if not all(isinstance(v, str | Path) for v in value):
                raise ConfigError(f"{where}: {name} must be paths, got {value!r}")
            value = [str(v) for v in value]
        elif found.kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{where}: {name} must be True or False, got {value!r}")
        elif found.kind in (int, float) and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ConfigError(f"{where}: {name} must be a number, got {value!r}")
        elif found.kind is int and not isinstance(value, int):
            raise ConfigError(f"{where}: {name} must be a whole number, got {value!r}")
        elif found.kind in (str, Path) and not isinstance(value, str | Path):
            raise ConfigError(f"{where}: {name} must be text, got {value!r}")
        values[name] = value
    return values


def _needs_override(values: Mapping[str, Any]) -> NeedsOverride:
    """What a call asks for itself, from the needs options given (a switch only when True; "no
    GPU" wins over a number of GPUs, as on the command line), checked at once."""
    fields: dict[str, Any] = {}
    for entry in sorted((NEEDS[name] for name in values), key=lambda o: o.switch):
        field = entry.to.partition(".")[2]
        if not entry.switch:
            fields[field] = values[entry.name]
        elif values[entry.name]:
            fields[field] = entry.sets
    override = NeedsOverride(**fields)
    try:
        override.apply(Needs())
    except ConfigError as err:  # "gpus must be..." in the words of the option: "gpus_per_job must be..."
        message = str(err)
        for entry in NEEDS.values():
            field = entry.to.partition(".")[2]
            if not entry.switch and message.startswith(field + " "):
                message = entry.name + message[len(field) :]
        raise ConfigError(message) from None
    return override


class CallOptions:
    """Calls with needs of their own (:meth:`Executor.options`): ``submit`` and ``map`` as the
    executor's, into the same batch."""

    def __init__(self, executor: Executor, needs: NeedsOverride, copy_backwards: tuple[str, ...] | None) -> None:
        self.executor = executor
        self.needs = needs
        self.copy_backwards = copy_backwards

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> CallFuture:
        return self.executor.submit_call(fn, args, kwargs, self)

    def map(
        self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None, chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[Any]:
        return self.executor.map_calls(
            fn, iterables, self, timeout=timeout, buffersize=buffersize, chunksize=chunksize
        )


class Executor(concurrent.futures.Executor):
    """Run Python calls on ``machines`` (specs as ``execute_batch --machines`` takes them, or
    :class:`Machine` values; none: this machine, with this Python).  Keyword options: see the
    module docstring.  ``resume``: reuse the results of calls an earlier run of the script
    finished (the default).  ``bus``: subscribe to the batch's events there (the live view,
    ``--json`` lines); ``out``/``err``: printers for the plain ``started:``/``finished:`` lines
    (nothing is printed otherwise).  ``base_dir``: the folder copied forward (default: the
    current one).  Raises :class:`~ssh_scheduler.errors.SchedulerError` (one line) when the
    options, the machines or the results folder are unusable."""

    def __init__(
        self,
        machines: Sequence[str | Machine] = (),
        *,
        resume: bool = True,
        bus: EventBus | None = None,
        out: Printer | None = None,
        err: Printer | None = None,
        base_dir: str | Path | None = None,
        buffersize: int = DEFAULT_BUFFERSIZE,
        **options: Any,
    ) -> None:
        values = _checked(options, OPTIONS, "Executor")
        check_numbers(**{k: v for k, v in values.items() if option(k).check})
        flag_needs(values)  # a need out of range is refused here, not in the batch's thread
        parse_halt(values.get("halt"))
        base = Path(base_dir or ".").resolve()
        results = base / Path(values.pop("results_dir", "job_results"))
        check_results_dir(results)
        defaults = {"retry_failed": True}  # a call that failed runs again, unless asked not to
        batch = batch_options({**defaults, **values}, base_dir=base, results_dir=results)
        self.results_dir = results
        self.bus = bus or EventBus()
        if out is not None or err is not None:
            self.bus.subscribe(TerminalLines(out or (lambda _: None), err or (lambda _: None)))
        if isinstance(machines, str | Machine):
            machines = [machines]
        specs = [m for m in machines if isinstance(m, str)]
        hosts = [m for m in machines if isinstance(m, Machine)]
        if specs:
            hosts += load_machines(specs, exclude=values.get("exclude_hosts") or ())
        if not hosts:  # this machine, with the Python running this script: its packages, its version
            hosts = [dataclasses.replace(local_machine(), python=sys.executable)]
        self.machines = hosts
        """The machines the calls run on (a :meth:`sweep` runs its batch on them too)."""
        self.batch_options = batch
        """The options of the executor's batch (a :meth:`sweep`'s batch takes them too)."""
        self._defaults = CallOptions(self, NeedsOverride(), batch.copy_backwards)
        self._base = base
        self._salt = "" if resume else secrets.token_hex(8)
        self._buffersize = buffersize
        self._lock = threading.Lock()
        self._names: Counter[str] = Counter()
        self._submitted = 0
        self._shut_down = False
        self._folder = Path(tempfile.mkdtemp(prefix="ssh_scheduler-calls-"))
        self._calls = CallBatch(hosts, batch, self.bus, self._folder)
        try:
            self._calls.start()
        except BaseException:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        _LIVE.add(self)

    # -- concurrent.futures.Executor ------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> CallFuture:
        """Run ``fn(*args, **kwargs)`` on a machine; its future resolves to what it returns, or
        raises what it raised (as itself, with the remote traceback as its cause)."""
        return self.submit_call(fn, args, kwargs, self._defaults)

    def map(
        self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None, chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[Any]:
        """Like ``concurrent.futures.Executor.map`` (results in order; ``timeout`` counted from
        this call), but lazy: at most ``buffersize`` calls (or chunks) are submitted ahead of the
        result being read.  ``chunksize``: that many calls run as one job, in one process on the
        host (for calls much shorter than a process's start; the function then travels by value
        inside the chunk, so the host needs this minor version of Python); a call that raises
        ends its chunk, which raises it where the chunk's results begin (as
        ``ProcessPoolExecutor.map`` does)."""
        return self.map_calls(
            fn, iterables, self._defaults, timeout=timeout, buffersize=buffersize, chunksize=chunksize
        )

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; ``cancel_futures``: cancel those not running yet.  ``wait``: return
        once every call has ended (the batch's hosts are then closed)."""
        with self._lock:
            self._shut_down = True
        if cancel_futures:
            for future in self._calls.open_futures():
                if not future.running():
                    future.cancel()
        self._calls.close()
        if wait:
            self._calls.join()
            shutil.rmtree(self._folder, ignore_errors=True)
            _LIVE.discard(self)

    def stop(self) -> None:
        """Kill every call now, on its host too (Ctrl-C in a ``with`` block does this)."""
        with self._lock:
            self._shut_down = True
        self._calls.stop()
        self._calls.join()
        shutil.rmtree(self._folder, ignore_errors=True)
        _LIVE.discard(self)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> Literal[False]:
        if exc_type is not None and not issubclass(exc_type, Exception):  # Ctrl-C, SystemExit
            self.stop()
        else:
            self.shutdown(wait=True)
        return False

    def sweep(
        self, fn: Callable[..., Any], grid: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        default: Mapping[str, Any] | None = None, **how: Any,
    ) -> list[tuple[dict[str, Any], Any]]:
        """``fn(**params)`` for every combination of ``grid`` (a dict of lists, or a list of
        them: the union), each in its combination's folder, as ``ssh-scheduler sweep`` runs a
        template; ``[(params, value), ...]`` in the combination order.  See
        :func:`ssh_scheduler.functions.call_sweep.run_sweep` for ``results_dir``, ``force``,
        ``return_exceptions``."""
        from ssh_scheduler.functions.call_sweep import run_sweep

        return run_sweep(self.machines, self.batch_options, fn, grid, default, **how)

    # -- what submit, map and options() share ---------------------------------------------------

    def options(self, **needs: Any) -> CallOptions:
        """Calls that ask for their own needs (``gpus_per_job=2``, ``gpu_memory_required=...``,
        ``num_cpus``, ``memory_required``, ``reserve``, ``no_gpu_required``...) or
        ``copy_backwards``, in this executor's batch: ``ex.options(gpus_per_job=2).submit(f)``."""
        copy_backwards = needs.pop("copy_backwards", None)
        values = _checked(needs, NEEDS, "Executor.options")
        if copy_backwards is not None:
            copy_backwards = tuple(_checked({"copy_backwards": copy_backwards}, OPTIONS, "Executor.options")["copy_backwards"])
        return CallOptions(self, _needs_override(values), copy_backwards or self._defaults.copy_backwards)

    def submit_call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], how: CallOptions
    ) -> CallFuture:
        """One call into the batch, with ``how``'s needs (the seam for a joblib backend or a
        sweep of functions: each is a call with needs of its own)."""
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
        if self._calls.over.is_set():  # the batch ended on its own: why it did
            raise self._calls.ended()
        pickled = pickle_call(fn, args, kwargs, self._folder, self._base, self._salt)
        with self._lock:
            self._names[pickled.name] += 1
            seen = self._names[pickled.name]
            self._submitted += 1
            number = self._submitted
        # The same call again is a call of its own (it may have effects): its name says which.
        name = pickled.name if seen == 1 else f"{pickled.name}.{seen}"
        back = how.copy_backwards
        if back is not None:  # the paths asked for, and the call's result
            back = (*back, RESULT, INFO)
        job = Job(name, pickled.description, number, copy_backwards=back, needs=how.needs, call=pickled.work)
        future = CallFuture(name, self._calls.cancel)
        try:
            self._calls.add(job, future, pickled.work.path)
        except BaseException:
            pickled.work.path.unlink(missing_ok=True)
            raise
        return future

    def map_calls(
        self, fn: Callable[..., Any], iterables: Sequence[Iterable[Any]], how: CallOptions, *,
        timeout: float | None = None, buffersize: int | None = None, chunksize: int = 1,
    ) -> Iterator[Any]:
        """:meth:`map` with ``how``'s needs.  The first ``buffersize`` jobs are submitted now."""
        if not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be a whole number >= 1, not {chunksize!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        arguments = zip(*iterables, strict=False)

        def submit_next() -> CallFuture | None:
            if chunksize == 1:
                args = next(arguments, None)
                return None if args is None else how.submit(fn, *args)
            chunk: list[Call] = [(fn, args, {}) for args in itertools.islice(arguments, chunksize)]
            return how.submit(RUN_BATCH, chunk) if chunk else None

        window: deque[CallFuture] = deque()
        for _ in range(buffersize or self._buffersize):
            if (future := submit_next()) is None:
                break
            window.append(future)

        def results() -> Iterator[Any]:
            try:
                while window:
                    future = window.popleft()
                    if (following := submit_next()) is not None:
                        window.append(following)
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if chunksize == 1:
                        yield future.result(left)
                    else:
                        yield from future.result(left)
            finally:
                for future in window:
                    future.cancel()

        return results()


_LIVE: weakref.WeakSet[Executor] = weakref.WeakSet()


def _at_exit() -> None:
    """The script ends with executors still open: wait for their calls, as
    ``concurrent.futures`` does, unless it ends on an uncaught exception (Ctrl-C): then kill
    them, so nothing is left running on a host."""
    crashed = getattr(sys, "last_type", None) is not None
    for executor in list(_LIVE):
        if crashed:
            executor.stop()
        else:
            executor.shutdown(wait=True)


# At exit, before Python stops its thread pools (the batch copies files through them) and joins
# its threads: threading's own exit hooks run first, in reverse order (concurrent.futures.thread,
# imported above, registered its hook already).  Where that hook is missing, atexit's.
getattr(threading, "_register_atexit", atexit.register)(_at_exit)
