"""ssh_scheduler: run batches of shell commands across many machines and GPUs over plain SSH.

The Python API, loaded on first use (``import ssh_scheduler`` alone stays cheap and loads
neither asyncio nor asyncssh)::

    from ssh_scheduler import run_batch, BatchOptions, parse_batch, load_machines
    summary = asyncio.run(run_batch(parse_batch(data, "batch.sh"), load_machines(["gpu[1-4]"]), BatchOptions()))

    from ssh_scheduler import Executor          # Python functions as jobs
    with Executor(machines=["gpu[1-4]"]) as ex:
        results = list(ex.map(train, configs))
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's own costs every command's start 2 ms: mypy reads this alike
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    "run_batch": "coordinator.batch",
    "Batch": "coordinator.batch",
    "BatchOptions": "coordinator.batch_run",
    "BatchSummary": "results.summary",
    "JobOutcome": "results.summary",
    "execute_remote": "coordinator.remote",
    "RemoteOptions": "coordinator.remote",
    "execute_to": "coordinator.fleet",
    "FleetOptions": "coordinator.fleet",
    "FleetResult": "coordinator.fleet_output",
    "HostResult": "coordinator.fleet_output",
    "combine_folders": "results.combine",
    "parse_batch": "jobs.batch_file",
    "Job": "jobs.batch_file",
    "Needs": "jobs.needs",
    "NeedsOverride": "jobs.needs",
    "Machine": "machines.machine",
    "load_machine": "machines.config",
    "load_machines": "machines.config",
    "local_machine": "machines.machine",
    "Ended": "events",
    "EventBus": "events",
    "Planner": "planner.plan",
    "SchedulerError": "errors",
    "Executor": "functions.executor",
    "CallError": "functions.outcome",
    "RemoteError": "functions.outcome",
    "RemoteTraceback": "functions.outcome",
}

__all__ = ("__version__", *sorted(_API))


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'ssh_scheduler' has no attribute {name!r}")
    import importlib  # (only here: importlib/__init__ loads warnings, 2 ms of every command's start)

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
