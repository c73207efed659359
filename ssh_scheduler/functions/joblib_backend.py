"""The joblib backend ``ssh_scheduler``: ``joblib.Parallel`` across the machines.

Importing this module registers it (joblib stays optional: nothing else imports this module)::

    import ssh_scheduler.functions.joblib_backend  # registers "ssh_scheduler"
    from joblib import Parallel, delayed, parallel_config

    with parallel_config(backend="ssh_scheduler", machines=["gpu[1-4]"], num_cpus=1):
        squares = Parallel(n_jobs=-1)(delayed(pow)(x, 2) for x in range(1000))

What ``parallel_config`` is given besides ``backend`` and ``n_jobs`` goes to
:class:`~ssh_scheduler.Executor` as is (``machines``, ``gpus_per_job``, ``gpu_memory_required``,
``num_cpus``, ``resume``, ``bus``, ``results_dir``...; checked as the executor checks them), or
``executor=`` names one of the script's own executors to use (it is then not shut down).  An
executor the backend made lives as long as one ``Parallel`` call (or ``with Parallel(...)``
block): its hosts are reached at the first task and left when the call ends.

Each task joblib hands over is a batch of ``delayed`` calls.  A batch of one call (joblib's
default here: this backend does not auto-batch) is a call of the executor, a job of its own:
placed, retried and resumed as ``Executor.submit`` does, no joblib needed on the hosts.  A larger
batch, asked for with ``Parallel(batch_size=50, pre_dispatch="all")`` (joblib's default
``pre_dispatch`` counts calls, and cuts the first batches down to fit it), is one job that runs its calls one after
another in one Python process: a process per call costs tens of milliseconds of a host's CPU,
which for trivial calls is most of the work.  Such a job is a call of a small function that
travels by value (:data:`RUN_BATCH`), so its hosts need the coordinator's minor version of
Python (a host with another refuses it, in one line); its calls fail, retry and resume together,
as a joblib batch does anywhere.

``n_jobs``: a positive number is the most jobs (calls, or batches of them) on the fleet at once (those beyond wait here,
as a process pool's tasks wait for a worker); ``-1`` (or any negative number) is no bound of
ours: the planner runs as many as the machines' free CPUs, memory and GPUs take, and joblib is
told :data:`UNBOUNDED` (its ``pre_dispatch`` hands over twice that many calls ahead), or, with
a ``batch_size``, the number of machines (so that joblib keeps the batches that size).
``n_jobs=1`` runs on the machines too, one call at a time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

try:
    from joblib.parallel import ParallelBackendBase, register_parallel_backend
except ImportError:  # the one line a user sees, not a traceback into our package
    raise ImportError(
        "the ssh_scheduler joblib backend needs joblib, which this Python lacks; fix: pip install joblib"
    ) from None

from ssh_scheduler.functions.executor import Executor
from ssh_scheduler.functions.payload import RUN_BATCH, Call

__all__ = ["NAME", "UNBOUNDED", "SshSchedulerBackend"]

NAME = "ssh_scheduler"
"""The backend's name for ``parallel_config(backend=...)``."""
UNBOUNDED = 1024
"""What ``effective_n_jobs`` says for ``n_jobs=-1``: joblib hands over ``2 * UNBOUNDED`` calls
ahead, enough to keep a large fleet busy; how many run at once is the planner's choice."""

class _Batch(concurrent.futures.Future[list[Any]]):
    """One joblib task: its calls' futures, done (with their values in order, or the first
    failed call's exception in order) when every call has ended."""

    def __init__(self, size: int, whole: bool = False) -> None:
        """``whole``: one call ran the batch (:data:`RUN_BATCH`); its value is the batch's."""
        super().__init__()
        self.whole = whole
        self.parts: list[concurrent.futures.Future[Any] | None] = [None] * size
        self.left = size
        self.lock = threading.Lock()

    def part_done(self, index: int, part: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self.parts[index] = part
            self.left -= 1
            if self.left or self.done():
                return
        for future in self.parts:
            assert future is not None
            if future.cancelled():
                self.set_exception(concurrent.futures.CancelledError("the call was cancelled (joblib aborted the run)"))
                return
            if future.exception() is not None:
                self.set_exception(future.exception())
                return
        values = [future.result() for future in self.parts if future is not None]
        self.set_result(values[0] if self.whole else values)


class SshSchedulerBackend(ParallelBackendBase):  # type: ignore[misc]
    """joblib's backend over an :class:`~ssh_scheduler.Executor` (see the module docstring)."""

    default_n_jobs = -1
    supports_retrieve_callback = True
    uses_threads = False
    supports_sharedmem = False

    def __init__(self, nesting_level: int | None = None, inner_max_num_threads: int | None = None,
                 executor: Executor | None = None, **options: Any) -> None:
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        self.options = options
        self.executor = executor
        self.owned = False
        self.limit: int | None = None
        self.fleet_n_jobs = UNBOUNDED
        self.lock = threading.Lock()
        self.waiting: deque[tuple[Call, _Batch, int]] = deque()
        self.running: set[concurrent.futures.Future[Any]] = set()

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None or n_jobs < 0:
            return self.fleet_n_jobs
        return max(2, n_jobs)  # (1 would make joblib run the calls here, one after another)

    def configure(self, n_jobs: int | None = 1, parallel: Any = None, **backend_kwargs: Any) -> int:
        self.parallel = parallel
        if self.executor is None:
            self.executor = Executor(**self.options)
            self.owned = True
        # joblib cuts the calls into n_jobs slices of batch_size: with batches asked for, -1 is
        # the number of machines (else joblib, told UNBOUNDED, would cut them back to single calls)
        batch_size = getattr(parallel, "batch_size", "auto")
        batched = isinstance(batch_size, int) and batch_size > 1
        self.fleet_n_jobs = max(2, len(self.executor.machines)) if batched else UNBOUNDED
        self.limit = None if n_jobs is None or n_jobs < 0 else n_jobs
        return self.effective_n_jobs(n_jobs)

    def submit(self, func: Callable[[], Any], callback: Callable[[Any], None] | None = None) -> _Batch:
        """A batch of one call as that call, a larger one as one call of :data:`RUN_BATCH` (a
        ``BatchedCalls`` holds its calls in ``items``; anything else is one call of itself)."""
        items: list[Call] = list(getattr(func, "items", None) or [(func, (), {})])
        if len(items) > 1:
            batch = _Batch(1, whole=True)
            items = [(RUN_BATCH, (items,), {})]
        else:
            batch = _Batch(len(items))
        if callback is not None:
            batch.add_done_callback(callback)
        with self.lock:
            self.waiting.extend((item, batch, i) for i, item in enumerate(items))
        self._start_waiting()
        if not items:
            batch.set_result([])
        return batch

    def retrieve_result_callback(self, out: _Batch) -> list[Any]:
        return out.result()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """A call raised: the calls not started are dropped, those under way killed."""
        with self.lock:
            dropped, self.waiting = list(self.waiting), deque()
            running = list(self.running)
        for future in running:
            future.cancel()
        for _, batch, _ in dropped:
            if not batch.done():
                batch.cancel()

    def terminate(self) -> None:
        if self.owned and self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None
            self.owned = False

    def _start_waiting(self) -> None:
        """Hand calls to the executor while the bound allows (called again as each ends)."""
        while True:
            with self.lock:
                if not self.waiting or (self.limit is not None and len(self.running) >= self.limit):
                    return
                (function, args, kwargs), batch, index = self.waiting.popleft()
                assert self.executor is not None
                future: concurrent.futures.Future[Any]
                try:
                    future = self.executor.submit(function, *args, **kwargs)
                except Exception as exc:  # it does not pickle, the executor is over: this call's error
                    future = concurrent.futures.Future()
                    future.set_exception(exc)
                self.running.add(future)
            future.add_done_callback(functools.partial(self._ended, batch, index))

    def _ended(self, batch: _Batch, index: int, future: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self.running.discard(future)
        batch.part_done(index, future)
        self._start_waiting()


register_parallel_backend(NAME, SshSchedulerBackend)
