"""Perform on a place that runs jobs: one executor interface; a host driven through its agent
(the session, content-addressed copy forward, safe copy back); a Slurm cluster through its
login node.

May import: the standard library, the vocabulary, ``jobs``, ``machines``, ``planner``,
``results``, ``agent`` (its protocol) and ``transport``.
"""
