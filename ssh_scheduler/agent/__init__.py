"""On the host: the programs that travel to the hosts and run there, and the protocol the agent
speaks with the coordinator.

The agent (main.py and the modules boot.MODULES lists) runs on the host's python3 3.8 or newer;
its first stage (boot.py) travels on a command line and runs on whatever python3 the host has;
execute_to's watchdog (watchdog.sh) travels on a command line and runs on its /bin/sh.  Their
text is what travels: nothing here is a string of program text.

May import: the standard library only (no 3.9+ syntax); its modules import each other, and
nothing else of the package.
"""
