"""This process's id, for the checks made per batch (is this the pools' owner? a
worker forked since?) without a system call each: glibc no longer caches
``getpid()``. Read at import and again in every child that ``os.fork()`` makes
(a spawned child imports this anew)."""

from __future__ import annotations

import os

pid: int = os.getpid()


def _forked() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
