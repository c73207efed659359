"""What to run: batch files, a job's needs, sweeps, and what a job copies forward.

Pure: reads the user's files, never a network or a host.  May import: the standard library,
yaml, and the package's vocabulary (``errors``, ``events``).
"""
