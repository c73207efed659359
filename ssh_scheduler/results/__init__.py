"""Results: the journal, the results folder and its lock, a batch's status and joblog, a sweep's
results table and store, and ``combine_folders``.

Local files only.  May import: the standard library, yaml, the vocabulary (``errors``,
``events``), ``jobs``, ``machines`` and ``planner``.
"""
