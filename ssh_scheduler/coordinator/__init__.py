"""Perform a batch: the coordinator that carries out the planner's actions, the one per-job
pipeline, ``execute_remote``, ``execute_to``, ``doctor``, the control socket and ``--detach``.

May import: every layer before it (``jobs``, ``machines``, ``planner``, ``results``, ``view``,
``agent``, ``transport``, ``executors``) and the vocabulary; never ``cli``.
"""
