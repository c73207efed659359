# execute_to's watchdog: runs one command, and kills all of it if the channel closes first.
#
# sshd leaves a command running when its channel closes (no pty: no SIGHUP), so closing the
# channel on timeout or Ctrl-C would not stop it.  This runs as `sh -c THIS sshs COMMAND GRACE`
# (coordinator/fleet.py, `killable`), as the session's first process, which sshd made the
# leader of a session and process group of its own.  A watcher, detached so the command never
# has an unknown child, reads the channel (the client never sends EOF on it); at its end, if the
# command still runs, it TERMs the whole group and KILLs it after GRACE seconds.  After a
# command that ended by itself, nothing is killed: what it left running on purpose (`nohup
# server &`) keeps running, as with plain ssh.  The command is exec'd (no shell waits on it and
# reports "Killed"), with /dev/null as stdin, so its exit status or signal is its own.
#
# A shell, not python3: the watcher costs two forks of the shell instead of an interpreter's
# start on each host for each command, and a host without python3 is watched too.  It only
# uses POSIX sh builtins (dash, bash, busybox), and sends only to the group whose id is this
# shell's own pid: if something made it no group leader, that group does not exist and nothing
# is killed.  As it travels on one line, every line below ends a command (with ';' or '&').
# The command runs as the agent runs jobs: bash without ~/.bashrc, /bin/sh where bash is missing.
exec 3<&0 </dev/null;
( { trap '' TERM; while read -r _; do :; done; kill -s 0 $$ && { kill -s TERM -- -$$; sleep "$2"; kill -s KILL -- -$$; }; } <&3 >/dev/null 2>&1 & );
exec 3<&-;
if [ -x /bin/bash ]; then exec /bin/bash --norc -c "$1"; fi;
exec /bin/sh -c "$1";
