"""This process's loader pools as a whole: every :class:`~numafast.torch.owner_pools.NodePools`
(bounded by ``max_pinned_bytes`` together, shrunk in their user's thread), and the idle
ones kept for the next loader on their node, which then starts on warm, placed, locked
pools: frameworks re-create loaders (Lightning's reload every epoch, Accelerate's or
Ray's ``prepare``), and a validation loader is often made per pass.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol, cast

from numafast import _process
from numafast.pool import LockMode, PinnedPool, RegisterMode

__all__ = ["close_idle_pools", "pinned_bytes"]


class LoaderPools(Protocol):
    """What this module uses of a :class:`numafast.torch.owner_pools.NodePools`, which imports
    this module."""

    node: int
    lock: LockMode
    register: RegisterMode
    owner_pid: int
    users: int
    user_thread: threading.Thread
    closed: bool
    pools: list[PinnedPool]
    retired: list[PinnedPool]

    def shrink(self) -> int: ...

    def close(self) -> None: ...


IdleKey = tuple[int, LockMode, RegisterMode]
"""Which idle pools a loader may take: (node, lock, register)."""

# This module's state lives in numafast/_process.py, with what a forked child keeps of it.
every = cast("weakref.WeakSet[LoaderPools]", _process.loader_pools)
_idle = cast("dict[IdleKey, LoaderPools]", _process.idle_pools)
replacing = cast("weakref.WeakKeyDictionary[LoaderPools, LoaderPools]", _process.replacing)
iterators = _process.loader_iterators
"""torch's iterators over NumaLoaders of this process that have workers (a forked child's are shut down)."""


def _ours() -> list[LoaderPools]:
    """The NodePools this process owns (a forked child inherits its parent's registry)."""
    return [pools for pools in list(every) if pools.owner_pid == _process.pid]


def pinned_bytes() -> int:
    """Bytes mapped now by the pools of every loader and pin_memory hook of this process,
    page-locked or not: in use, retiring until their last slot is back, or idle."""
    return sum(pool.stats().bytes_mapped for pools in _ours() for pool in [*pools.pools, *pools.retired])


def shrink_all(receiving: LoaderPools) -> None:
    """Release the grown pools found wholly free in ``receiving`` (whose receiving thread
    calls this every SHRINK_EVERY batches) and in every NodePools of this process used in
    the calling thread (:func:`_used_in`): nothing else looks at those of a loader not
    iterated now (an eval loader whose consumer dropped what it kept, a gone one's idle
    pools). See the NOTE atop owner_pools."""
    caller = threading.current_thread()
    for pools in _ours():
        if (pools is receiving or _used_in(pools, caller)) and len(pools.pools) > 1 and not pools.closed:
            pools.shrink()


def _used_in(pools: LoaderPools, caller: threading.Thread) -> bool:
    """Whether ``caller`` is the user's thread of ``pools``, which it becomes where that
    thread ended (one threading did not start, a dummy thread, is alive while it runs)."""
    if pools.user_thread is not caller and not pools.user_thread.is_alive():
        pools.user_thread = caller
    return pools.user_thread is caller


def use(pools: LoaderPools) -> None:
    """One more loader lands its batches in ``pools``, idle no more if they were."""
    with _process.idle_mutex:
        pools.users += 1
        key = (pools.node, pools.lock, pools.register)
        if _idle.get(key) is pools:
            del _idle[key]


def let_go(pools: LoaderPools) -> None:
    """One loader fewer uses ``pools``: with none left, they replace (and close) the idle
    ones on their node, for the next loader there. A finalizer (a loader's collate
    function collected): where the collector ran it inside one of this thread's locks
    (it runs at any allocation, as in close_idle_pools or a node budget's reserve), it
    waits until the thread has let go of them, or it would wait for itself forever."""
    if _process.pid != pools.owner_pid:
        return  # a forked child's copy: the pools are the parent's
    if _process.defer_until_unlocked(lambda: let_go(pools)):
        return
    with _process.idle_mutex:
        pools.users -= 1
        if pools.users or pools.closed:
            return
        key = (pools.node, pools.lock, pools.register)
        replaced = _idle.get(key)
        _idle[key] = pools
        pools.user_thread = threading.current_thread()  # who lets them go looks after them until a loader takes them
    if replaced is not None and replaced is not pools:
        replaced.close()
    pools.shrink()  # idle with its first pool only, where the consumer let its kept batches go already


def take_idle(key: IdleKey) -> LoaderPools | None:
    """The idle pools for ``key``, no longer idle (None: there are none)."""
    with _process.idle_mutex:
        return _idle.pop(key, None)


def close_idle_pools() -> int:
    """Release the pools no loader uses any more, kept for the next loader on their node;
    returns how many sets of pools were closed."""
    with _process.idle_mutex:
        idle = list(_idle.values())
        _idle.clear()
    for pools in idle:
        pools.close()
    return len(idle)
