"""Decide: the planner, events in and actions out; each host's resources and the GPU memory
invariant; when to re-probe; ``--halt``.

Pure: nothing here awaits, sleeps, or touches a socket or a file.  May import: the standard
library, the vocabulary (``errors``, ``events``), ``jobs`` and ``machines``.
"""
