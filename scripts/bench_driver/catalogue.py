"""Every scenario the command line knows, in the order they run, and the makers that build them
for a run (each family's module builds its own)."""

from __future__ import annotations

from collections.abc import Callable

from bench_driver.bench import Bench
from bench_driver.records import Scenario
from bench_driver.scenarios.combine import scenario_combine
from bench_driver.scenarios.dry_run import scenario6
from bench_driver.scenarios.example import scenario7, scenario_remote
from bench_driver.scenarios.fanout import scenario4
from bench_driver.scenarios.files import FILE_SCENARIOS, file_makers
from bench_driver.scenarios.functions import scenario_functions
from bench_driver.scenarios.scale import SCALE_SCENARIOS, scale_makers
from bench_driver.scenarios.shared_input import scenario3
from bench_driver.scenarios.slurm import scenario_slurm
from bench_driver.scenarios.throughput import scenario1, scenario2, scenario5

ORDER = (
    "1", "2", "3", "4", "5", "6", "7", "remote", "combine", *FILE_SCENARIOS, "functions", *SCALE_SCENARIOS, "slurm"
)  # fmt: skip
# Every scenario with a target, so that one run judges them all side by side; churn and combine
# (no target; combine is a file-system benchmark that a busy disk stretches past the run
# timeout) only when asked.
DEFAULT = ",".join(sid for sid in ORDER if sid not in ("churn", "combine"))
# The scenarios that run on the small cluster (h1..h32); the others start clusters of their own.
ON_SMALL_CLUSTER = ("1", "2", "3", "4", "5", "7", "remote", *FILE_SCENARIOS, "functions")


def makers(bench: Bench) -> dict[str, Callable[[], Scenario]]:
    found: dict[str, Callable[[], Scenario]] = {
        "1": lambda: scenario1(bench), "2": lambda: scenario2(bench), "3": lambda: scenario3(bench),
        "4": lambda: scenario4(bench), "5": lambda: scenario5(bench), "6": lambda: scenario6(bench),
        "7": lambda: scenario7(bench), "remote": lambda: scenario_remote(bench),
        "combine": lambda: scenario_combine(bench),
        "slurm": lambda: scenario_slurm(bench), "functions": lambda: scenario_functions(bench),
    }  # fmt: skip
    found.update(file_makers(bench))
    found.update(scale_makers(bench))
    return found
