"""Python functions as jobs: ``ssh_scheduler.Executor``, a ``concurrent.futures.Executor`` whose
calls run on the machines as jobs of one open batch.

May import every layer before it (jobs, machines, planner, results, view, agent, transport,
executors, coordinator) and the vocabulary (errors, events); cloudpickle.  The command line may
import it.
"""
