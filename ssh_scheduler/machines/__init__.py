"""Where it may run: machine YAML, ``~/.ssh/config`` resolved as ``ssh -G`` does, host ranges,
a machine's ``env:``/``setup:`` and ``slurm:`` settings, and what a probe says a host has.

Pure: reads local files, never a network or a host.  May import: the standard library, yaml,
the vocabulary (``errors``, ``events``) and ``jobs``.
"""
