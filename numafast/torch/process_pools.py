"""This process's loader pools as a whole: every :class:`~numafast.torch.pools.NodePools`
(bounded by ``max_pinned_bytes`` and shrunk together), and the idle ones kept for the
next loader on their node, which then starts on warm, placed, locked pools: frameworks
re-create loaders (Lightning's reload every epoch, Accelerate's or Ray's ``prepare``),
and a validation loader is often made per pass.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Protocol

from numafast import _process
from numafast.pool import LockMode, PinnedPool, RegisterMode
from numafast.private import ITERATOR_SHUTDOWN

__all__ = ["close_idle_pools", "pinned_bytes"]


class LoaderPools(Protocol):
    """What this module uses of a :class:`numafast.torch.pools.NodePools`, which imports
    this module."""

    node: int
    lock: LockMode
    register: RegisterMode
    owner_pid: int
    users: int
    closed: bool
    pools: list[PinnedPool]
    retired: list[PinnedPool]

    def shrink(self) -> int: ...

    def close(self) -> None: ...


IdleKey = tuple[int, LockMode, RegisterMode]
"""Which idle pools a loader may take: (node, lock, register)."""

# Every NodePools of this process (each adds itself): what max_pinned_bytes bounds together.
every: weakref.WeakSet[LoaderPools] = weakref.WeakSet()
# NodePools no loader uses any more, by IdleKey: the next loader's.
_idle: dict[IdleKey, LoaderPools] = {}
_idle_mutex = threading.Lock()
"""Guards _idle and every NodePools' ``users``."""


# In a forked child: the pools made here in the place of each set inherited from the
# parent, so that the loaders over one inherited set (the user's and a framework's copy
# of it) land in one set here too, as they did there.
replacing: weakref.WeakKeyDictionary[LoaderPools, LoaderPools] = weakref.WeakKeyDictionary()
iterators: weakref.WeakSet[Any] = weakref.WeakSet()
"""torch's iterators over NumaLoaders of this process that have workers: a forked child
inherits them (see :func:`forget_inherited`)."""


def forget_inherited() -> None:
    """In a forked child, this module's state as a new process has it: no idle pools
    (those inherited are the parent's: never taken, never closed here), unlocked, and
    the inherited iterators marked shut down. An inherited iterator's workers, queues
    and done event are the parent's: dropping it in the child would run torch's
    shutdown on them (set the shared done event, send each worker its end), ending the
    parent's epoch; marked, it ends with nothing done."""
    global _idle_mutex
    _idle_mutex = threading.Lock()
    _idle.clear()
    replacing.clear()
    for iterator in list(iterators):
        setattr(iterator, ITERATOR_SHUTDOWN, True)  # torch's iterator: its __del__ shuts down only what is not
    iterators.clear()


os.register_at_fork(after_in_child=forget_inherited)


def _ours() -> list[LoaderPools]:
    """The NodePools this process owns (a forked child inherits its parent's registry)."""
    return [pools for pools in list(every) if pools.owner_pid == _process.pid]


def pinned_bytes() -> int:
    """Bytes mapped now by the pools of every loader and pin_memory hook of this process,
    page-locked or not: in use, retiring until their last slot is back, or idle."""
    return sum(pool.stats().bytes_mapped for pools in _ours() for pool in [*pools.pools, *pools.retired])


def shrink_all() -> None:
    """Release the grown pools found wholly free in every NodePools of this process:
    nothing else looks at those of a loader not iterated now (an eval loader whose
    consumer dropped what it kept, a gone one's idle pools)."""
    for pools in _ours():
        if len(pools.pools) > 1 and not pools.closed:
            pools.shrink()


def use(pools: LoaderPools) -> None:
    """One more loader lands its batches in ``pools``."""
    with _idle_mutex:
        pools.users += 1


def let_go(pools: LoaderPools) -> None:
    """One loader fewer uses ``pools``: with none left, they replace (and close) the idle
    ones on their node, for the next loader there."""
    if _process.pid != pools.owner_pid:
        return  # a forked child's copy: the pools are the parent's
    with _idle_mutex:
        pools.users -= 1
        if pools.users or pools.closed:
            return
        key = (pools.node, pools.lock, pools.register)
        replaced = _idle.get(key)
        _idle[key] = pools
    if replaced is not None and replaced is not pools:
        replaced.close()
    pools.shrink()  # idle with its first pool only, where the consumer let its kept batches go already


def take_idle(key: IdleKey) -> LoaderPools | None:
    """The idle pools for ``key``, no longer idle (None: there are none)."""
    with _idle_mutex:
        return _idle.pop(key, None)


def close_idle_pools() -> int:
    """Release the pools no loader uses any more, kept for the next loader on their node;
    returns how many sets of pools were closed."""
    with _idle_mutex:
        idle = list(_idle.values())
        _idle.clear()
    for pools in idle:
        pools.close()
    return len(idle)
