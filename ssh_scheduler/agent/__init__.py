"""On the host: the stdlib-only agent that travels to every host and runs there on its python3
(3.8 or newer), and the protocol it speaks with the coordinator.

May import: the standard library only (no 3.9+ syntax); its modules import each other, and
nothing else of the package.
"""
