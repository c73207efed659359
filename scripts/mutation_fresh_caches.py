"""A pytest plugin for ``scripts/mutation``: every mutant's run starts with the package's caches empty.

mutmut forks each mutant's test run from one process that has already imported the package,
and may have run tests in it.  A ``functools.lru_cache`` filled there (the compiled patterns of
``ssh_evaluate`` and ``ssh_include``) answers in the fork without calling the mutated function
beneath it, so that function's mutants "survive" without ever running: in one run all 125 of
``ssh_include._bracket`` did.  Emptying the caches when each run starts makes it call them.
"""

import sys

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    del session
    for name, module in list(sys.modules.items()):
        if name != "ssh_scheduler" and not name.startswith("ssh_scheduler."):
            continue
        for value in list(vars(module).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear):
                clear()
