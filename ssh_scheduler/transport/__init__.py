"""Connections to hosts: the only package that imports asyncssh.

Split by concern: ``base`` (the Transport interface, constants, errors), ``bootstrap`` (how an
agent is started: a first stage on the command line, the agent on its stdin), ``ssh`` (the SSH
transport and ``connect``), ``local`` (this machine, no SSH), ``lines`` (the agent's output as
bounded lines), ``hostkeys`` (known_hosts and --accept-new), ``auth`` (client keys, jump hosts,
ProxyCommand, allowed algorithms), ``loading`` (importing asyncssh without its slow search).

May import: the standard library, asyncssh, the vocabulary, ``machines`` and ``agent`` (the
agent's files, which travel to the hosts).
"""
