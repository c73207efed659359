"""A user's script with an Executor, run by the cluster tests as a process of its own (to be
interrupted, killed, or measured): ``python script.py WHAT RESULTS MACHINE...``.  Copied into
the test's project folder beside ``work.py`` (tests/call_work.py).

``sleep``: one call that sleeps (Ctrl-C it); ``sleep-bare``: the same outside a ``with``
block (the interpreter's exit stops the executor); ``counted``: ten counted calls, their
results printed; ``big``: one 50 MB value, and the highest this process's memory rose meanwhile."""

import json
import sys
import tracemalloc

import work

from ssh_scheduler import Executor


def main(what, results, machines):
    options = {"results_dir": results, "no_gpu_required": True, "num_cpus": 0.1, "memory_required": 10}
    if what == "sleep-bare":
        ex = Executor(machines, **options)
        future = ex.submit(work.sleep_marked, "sleeping")
        print("submitted", flush=True)
        future.result()
        return
    with Executor(machines, **options) as ex:
        if what == "sleep":
            future = ex.submit(work.sleep_marked, "sleeping")
            print("submitted", flush=True)
            future.result()
        elif what == "counted":
            print(json.dumps(list(ex.map(work.counted, range(10)))), flush=True)
        elif what == "big":
            assert ex.submit(work.big, 10).result() == b"x" * 10  # warm: connected, everything imported
            # Every allocation of this process's Python, the coordinator's thread included:
            # the highest point above where it stood, while the value came home and was read.
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            value = ex.submit(work.big, 50 * 2**20).result()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            ok = len(value) == 50 * 2**20 and value.count(b"x") == len(value)
            print(json.dumps({"ok": ok, "peak_mb": (peak - before) / 2**20}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
