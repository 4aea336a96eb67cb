"""This process's id, for the checks made per batch (is this the pools' owner? a
worker forked since?) without a system call each: glibc no longer caches
``getpid()``. Read at import and again in every child that ``os.fork()`` makes
(a spawned child imports this anew).

And what tells one process from another that the kernel later gives the same pid:
its start time (:func:`started`, :func:`start_time`). A pid alone is no identity:
pids are reused once the process that had one is gone and reaped, within seconds on
a busy machine where ``pid_max`` is small (32768 by default before systemd raised it)."""

from __future__ import annotations

import errno
import os

pid: int = os.getpid()
_started: int | None = None  # this process's start time, read at the first call of started()
# What opening /proc/PID/stat fails with once the process is gone (ESRCH: reaped while read).
_GONE = (errno.ENOENT, errno.ESRCH)


def _forked() -> None:
    global pid, _started
    pid = os.getpid()
    _started = None


os.register_at_fork(after_in_child=_forked)


def owns(owner_pid: int) -> bool:
    """Whether this process is ``owner_pid``: the check made before anything that only
    the process which made a pool or a board may do (a forked child has a copy)."""
    return owner_pid == pid


def start_time(process: int | str = "self") -> int | None:
    """When ``process`` started, in clock ticks after boot (/proc/PID/stat's 22nd field,
    ``starttime``); None when it is gone, or dead and not yet reaped (a zombie, whose
    pid is still taken but which runs no more). Any other failure to read it (EMFILE
    under a low ``ulimit -n``, ENFILE, EACCES) says nothing of the process and raises
    the OSError: taken for "gone", it would free a live worker's slot for a second batch. Two processes that had the same pid
    one after the other do not have the same start time: it counts clock ticks (10 ms
    at USER_HZ 100), and the kernel hands out pids in a cycle, so a pid comes back
    only after every other free one up to pid_max (32768 or 4194304) was handed out,
    far more forks than one tick holds; unless a tool asks for that pid
    (/proc/sys/kernel/ns_last_pid, clone3's set_tid: checkpoint/restore)."""
    try:
        with open(f"/proc/{process}/stat", "rb") as stat:
            line = stat.read()
    except OSError as error:
        if error.errno in _GONE:
            return None
        raise
    # The command name, in parentheses, may hold spaces and parentheses: the fields
    # start after the last ')'. The third field, the state, comes first there.
    fields = line.rpartition(b")")[2].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])


def started() -> int:
    """This process's start time (see :func:`start_time`), read once per process."""
    global _started
    if _started is None:
        here = start_time("self")
        if here is None:
            raise OSError(f"cannot read /proc/self/stat in process {os.getpid()}: is /proc mounted?")
        _started = here
    return _started
