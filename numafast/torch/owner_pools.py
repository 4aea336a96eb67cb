"""The owner's side of a batch's path: NodePools, a loader's pinned pools on one node.
It makes room for the workers' batches, turns each worker's message into its batch
over the slot, and copies in the batches that did not land.

Neither a batch's size nor how many batches the consumer keeps is known before the
first batch, so the pools grow as batches arrive, and only here, in the thread that
receives them (:meth:`NodePools.make_room`): a worker whose batch finds no free slot
that fits sends it the copying way, and copying it in makes the room. The first batch
sizes the first pool, a larger batch gets a pool of larger slots, and when the
consumer keeps every slot another pool is added at once rather than waiting for a slot
that would never come back; all within the node's pinned budget that every numafast
process there shares, and ``max_pinned_bytes`` where given, past which batches arrive
unpinned. The board publishes each change; workers see it at their next batch.
Idle pools outlive their loader for the next one on the node
(:mod:`numafast.torch.owner_process_pools`).

NOTE: who changes these pools: two threads. The receiving thread (the consumer's, or
PyTorch's pin thread) makes, resizes and publishes them, and shrinks them every
SHRINK_EVERY batches. The user's thread (``user_thread``: the one that made or took
them for a loader, last called a NumaLoader's iter() over them, or let them go idle; a
pin_memory hook's is the one that installed it; once that thread ends, the next one
whose batches arrive) shrinks them at iter(), at stats() called in it (stats() in
another thread only reads), and every SHRINK_EVERY batches any loader receives in it
(owner_process_pools.shrink_all: how the grown pools of a loader not iterated now are
released), and closes them; no other thread's shrink looks at them. Lifecycle calls (a
gone loader's let_go, close_idle_pools) act only on pools no loader uses any more, so
with no receiving thread. Every change of the lists is under ``_mutex``; making a pool
is under ``_making`` too (two loaders sharing pools receive in two threads). No worker
waits on the owner, and no thread of numafast's own changes them.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import queue
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

import numafast
from numafast import _process, node_budget
from numafast._validate import format_size
from numafast.errors import PoolClosedError, PoolExhaustedError
from numafast.pool import (
    MEMFD_PREFIX, LockMode, PinnedPool, PoolStats, RegisterMode, Slot, memlock_warning_held, parse_mode,
    pool_bytes, warn_unlocked,
)
from numafast.pool_owner import PoolBoard
from numafast.pool_worker import BOARD_ENTRIES
from numafast.private import stacklevel_outside
from numafast.torch import owner_process_pools
from numafast.torch.batch import place
from numafast.torch.device import gpu_usable, iteration_gpu
from numafast.torch.message import Fallback, FallbackReason, SenderDied, SlotBatch, receivers
from numafast.torch.owner_process_pools import pinned_bytes
from numafast.torch.owner_sizing import (
    check_max_pinned_bytes, default_max_pinned_bytes, grown_slot_bytes, slot_bytes_for, slots_within,
)
from numafast.torch.slot import UNMADE, SlotFull, SlotPacker, bytes_needed, placeable, tensor_kind, unpack

__all__ = ["LoaderStats", "NodePools", "default_max_pinned_bytes", "node_pools", "pinned_bytes"]

Batch = TypeVar("Batch")

# A grown pool found wholly free is released when the batches a loader received reach
# a multiple of this (whose pools: see owner_process_pools.shrink_all), and at stats(),
# iter() and when its loader is gone: a look at each pool's counters.
SHRINK_EVERY = 8
# How often a copy in this process tries for a slot when the new ones it made room for
# are taken by workers first.
_ACQUIRE_ATTEMPTS = 4

_owner_ids = itertools.count(1)
POOL_FILE = f"/memfd:{MEMFD_PREFIX}"  # how /proc/PID/maps names a pool's file

# The copies said once, each with its fix. The others are how the pools grow, counted
# only: the first batches (no pool yet), a batch that fits no slot (the copy resizes
# the pool), one that found every slot held (the copy adds a pool; the kept-batches
# warning, or the unpinned one past max_pinned_bytes, says why where something is
# wrong), or a gone iterator's (iter() called again with batches unread).
_FIXES = {
    FallbackReason.CANNOT_MAP: "{detail}. Its batches are copied by the main process instead; use the fork "
    "start method, or let the workers read the main process's /proc/PID/fd",
    FallbackReason.BYPASSED: "{detail}",
}
_NOT_PLACED = (
    "batch leaves of kind {} are not pinned (numafast places dense CPU tensors and NumPy arrays): they reach the "
    "consumer as the collate function made them"
)
_OPAQUE = (
    "batch leaves of type {} are not pinned: numafast places tensors and NumPy arrays of plain numbers inside dicts, "
    "lists, tuples, namedtuples and dataclasses"
)


@dataclass(frozen=True)
class LoaderStats:
    """How a loader's batches reached the consumer. ``landed + copied + unpinned == batches``."""

    node: int
    batches: int
    landed: int
    """Batches collated straight into a slot: no byte copied by the main process."""
    copied: int
    """Batches the main process copied into a slot."""
    bytes_copied: int
    fallbacks: dict[str, int] = field(default_factory=dict)
    """Copied batches by :class:`~numafast.torch.message.FallbackReason` (its value)."""
    pools: list[PoolStats] = field(default_factory=list)
    """The counters of the pools in use now (retiring ones not included)."""
    unpinned: int = 0
    """Batches handed over as the DataLoader made them: no room for more pinned slots
    (``max_pinned_bytes``, the node's budget, or the board's limit on pools)."""
    held: int = 0
    """Slots whose batches the consumer holds now (``targets.append(y)`` keeps ``y``'s
    whole slot): the slots in use beyond those of the batches the DataLoader may hold
    unread (``prefetch_factor`` x ``num_workers``)."""
    pinned_bytes: int = 0
    """Bytes mapped by the pools of every loader of this process (see :func:`pinned_bytes`)."""
    max_pinned_bytes: int = 0
    """The bound these pools grow within: the node's pinned budget, shared by every numafast
    process on the node (a quarter of its memory, or of the cgroup's limit where lower), or
    an explicit ``max_pinned_bytes`` for this process's pools where lower."""
    mapped_by_workers: int = 0
    """Bytes of pools these pools let go (resized, shrunk) that the loader's live workers
    still map: resident until they let go too (an idle worker does within a second or
    two), and not counted in ``pinned_bytes``."""


class NodePools:
    """Pinned pools on ``node``, the first with ``slots`` slots, made as batches need them
    within the node's pinned budget, shared by every numafast process on the node
    (:mod:`numafast.node_budget`), and within ``max_pinned_bytes`` for all this process's
    loader pools where given."""

    def __init__(
        self,
        node: int,
        slots: int,
        *,
        in_flight: int = 0,
        lock: LockMode | str | bool = "auto",
        register: RegisterMode | str | bool = "auto",
        max_pinned_bytes: int | None = None,
    ) -> None:
        self.node = node
        self.slots = slots
        # Checked now, not at the first batch that makes a pool.
        self.lock: LockMode = parse_mode(lock, LockMode, "lock")
        self.register: RegisterMode = parse_mode(register, RegisterMode, "register")
        self._start(in_flight, check_max_pinned_bytes(max_pinned_bytes), taken_over=False)
        self.pools: list[PinnedPool] = []
        self.retired: list[PinnedPool] = []
        self.grown = 0
        self.resized = 0
        # The CUDA device the pools made from now on register through (see _new_pool); those
        # made before stay: a portable registration is good for any device.
        self.device: int | None = None
        self.board = PoolBoard()
        self.owner_id = next(_owner_ids)
        self.owner_pid = _process.pid
        self.users = 0  # the loaders landing their batches here
        self.closed = False
        self._by_inode: dict[int, PinnedPool] = {}
        self._inodes_made: set[int] = set()  # of every pool made here, for mapped_by_workers
        self._senders: set[int] = set()  # the pids of the workers whose batches landed
        # Taken by the receive of every batch: held for bookkeeping only, never while a
        # pool is faulted in, registered or released. _making: one pool is made at a time
        # (two loaders sharing these pools receive in two threads).
        self._mutex = _Mutex()
        self._making = _process.DeferringLock()
        receivers[self.owner_id] = self
        owner_process_pools.every.add(self)

    def _start(self, in_flight: int, max_pinned_bytes: int | None, *, taken_over: bool) -> None:
        """The settings and counters of a loader starting on these pools (new, or idle ones
        ``taken_over`` from a loader gone since: its first batches may need larger slots)."""
        self.node_budget = default_max_pinned_bytes(self.node)
        self.cap = max_pinned_bytes
        self.in_flight = in_flight  # the batches the DataLoader may hold unread, which LoaderStats.held leaves out
        self.landed = self.copied = self.bytes_copied = self.unpinned = 0
        self.largest_landed = 0  # the largest batch landed in a worker: what an added pool is sized by
        self.fallbacks: Counter[str] = Counter()
        self.warned: set[str] = set()
        self.refused = ""  # why make_room last refused more room
        self._kept_grew = False  # pools were added because the consumer keeps every slot
        # A pool's MemlockWarning, held back to be said at the next batch (_warn_unlocked_pool),
        # and whether that pool was one added for kept batches.
        self._unlocked: tuple[str, bool] | None = None
        self._fewer_slots = ""  # why a pool holds fewer slots than asked, to be said at the next batch
        self.before_receive: Callable[[], None] = lambda: None  # the hook binds PyTorch's pin thread
        self.taken_over = taken_over
        self.user_thread = threading.current_thread()  # see the NOTE at the top: the loader's maker, until it iterates

    @property
    def max_pinned_bytes(self) -> int:
        """What these pools grow within: the node's budget, shared with every numafast process
        on it, and an explicit ``max_pinned_bytes`` (:attr:`cap`) for this process's pools."""
        return self.node_budget if self.cap is None else min(self.cap, self.node_budget)

    @max_pinned_bytes.setter
    def max_pinned_bytes(self, value: int | None) -> None:
        self.cap = value

    def attach(self, user: object) -> None:
        """``user`` (a loader's collate function) lands its batches here: the pools stay
        while it lives, and go idle once none is left."""
        owner_process_pools.use(self)
        # Not at interpreter exit: the pools close then anyway, and modules are going away.
        weakref.finalize(user, owner_process_pools.let_go, self).atexit = False

    # ------------------------------------------------------------ batches arriving

    def receive(self, message: SlotBatch) -> Any:
        """The batch a worker packed into one of these pools, over this process's mapping
        (called as the message is unpickled here)."""
        pool: PinnedPool | None = None
        try:
            self.before_receive()
            with self._mutex:
                pool = self._by_inode.get(message.inode)
                try:
                    if pool is None:
                        raise RuntimeError(f"a batch arrived in slot {message.index} of a node-{self.node} pool this "
                                           "loader no longer has")  # fmt: skip
                    slot = pool.adopt(message.index, message.generation, message.nbytes)
                except (LookupError, RuntimeError) as error:
                    # A lease ends early only when its worker is gone (reclaim_orphans), and a
                    # pool leaves this loader only once every lease of it ended.
                    if message.sender and _sender_gone(message.sender):
                        raise SenderDied(
                            f"DataLoader worker process {message.worker} (pid {message.sender}) died after sending "
                            f"{message.describe()}: its slot went back to the pool when the death was seen"
                        ) from error
                    raise
                self.landed += 1
                self.largest_landed = max(self.largest_landed, message.nbytes)
                self._senders.add(message.sender)
        except BaseException:
            # Not taken over, whatever stopped it (a signal handler's exception, a message
            # that does not fit its slot): the lease ends here, or its slot would stay the
            # worker's until that worker exits (never, with persistent workers).
            if pool is not None and message.sender:
                pool.end_lease(message.index, message.generation, message.sender)
            raise
        self._warn_unpinned(message.unpinned)
        self._after_batch(message.nbytes)
        return unpack(message.payload, slot)

    def _grow_ahead(self, nbytes: int) -> None:
        """Add a pool before the workers run out of free slots, where the consumer keeps
        batches (it holds two slots or more) and fewer slots are free than the batches in
        flight: else each pool added for kept batches would be one the owner's copy of a
        batch that found none free adds, the batches in flight then copied too (~5% of
        an epoch of kept batches, halving its speed, as bench_loader measured). Never
        waits for another thread making a pool; an error making it is met again by the
        copy of a batch that then finds no free slot. (A gone worker's leases, not
        reclaimed here for a look per batch, count as held: at worst a pool early.)"""
        fitting = [pool for pool in self.pools if pool.slot_bytes >= nbytes]
        in_use = sum(pool.in_use for pool in fitting)
        # Cheap first (no look at each slot): the free slots are at least those neither
        # held nor leased by the batches in flight.
        if in_use - self.in_flight < 2 or sum(pool.slots for pool in fitting) - in_use >= 2 * self.in_flight:
            return
        counted = self._counted(nbytes)
        if sum(stats.free for _, stats in counted) >= self.in_flight or self._held(s for _, s in counted) < 2:
            return
        if not self._making.acquire(blocking=False):
            return
        try:
            with contextlib.suppress(Exception):
                self._make_room(nbytes, True, ahead=True)
        finally:
            self._making.release()

    def _after_batch(self, nbytes: int = 0) -> None:
        """In the receiving thread (where the user's warning filters apply): the warning
        about kept batches, retired pools settled, now and then free grown pools released;
        and, after a batch of ``nbytes`` in a slot (landed or copied) where the consumer
        kept batches in this loader's life, another pool ahead (:meth:`_grow_ahead`)."""
        if self._kept_grew and "kept" not in self.warned:  # the cause first: a limit met only by kept batches
            self._warn_kept()
        if self._unlocked is not None:
            self._warn_unlocked_pool()
        if self._fewer_slots:
            self._warn_once("fewer slots", self._fewer_slots)
            self._fewer_slots = ""
        if not self.received() % SHRINK_EVERY:
            owner_process_pools.shrink_all(self)
        self._settle_retired()
        self._unguard()
        if self.grown and nbytes:
            self._grow_ahead(nbytes)

    def copy_in(self, fallback: Fallback) -> Any:
        """A batch that came the copying way, copied into a slot here."""
        self.before_receive()
        return self._copy(fallback.batch, fallback.reason, fallback.detail)

    def _unpinned(self, batch: Batch) -> Batch:
        """``batch`` handed over as it is, no room for more pinned slots: counted, warned once."""
        with self._mutex:
            self.unpinned += 1
            why = self.refused or "no room for more pinned slots"
        self._warn_once("unpinned", f"a batch reached the consumer unpinned, as the DataLoader "
                        f"made it: {why}")  # fmt: skip
        self._after_batch()
        return batch

    def holds(self, address: int) -> bool:
        """Whether ``address`` lies in a slot of one of these pools."""
        return any(pool.contains(address) for pool in [*self.pools, *self.retired])

    def received(self) -> int:
        """Batches received so far: landed, copied and unpinned."""
        return self.landed + self.copied + self.unpinned

    def copy_bypassed(self, batch: Any, why: str) -> Any:
        """A batch that came past numafast's collate, copied into a slot here (warned once)."""
        return self._copy(batch, FallbackReason.BYPASSED, why)

    def collate_here(self, samples: Any, collate_fn: Callable[[Any], Any], direct: bool) -> Any:
        """Collate in this process (no workers): into a slot when ``collate_fn`` is torch's
        default (``direct``; the first batch, measured, sizes the pool), else a copy."""
        first = None if self.pools else FallbackReason.FIRST_BATCHES
        needed = bytes_needed(samples, UNMADE) if first and direct else 0
        if not direct or (first and not needed):  # another collate function, or no bytes to lay out
            return self._copy(collate_fn(samples), first)
        try:
            slot = self._acquire(needed or self.pools[0].slot_bytes)[0]
        except _NoRoom:
            return self._unpinned(collate_fn(samples))
        packer = SlotPacker(memoryview(slot))
        del slot  # the batch's tensors hold the slot now: it comes back when the last of them goes
        try:
            batch = packer.collate(samples)
        except SlotFull:
            return self._copy(collate_fn(samples), FallbackReason.TOO_LARGE)
        finally:
            packer.close()
        self.landed += 1
        self._after_batch()
        return batch

    def _copy(self, batch: Any, reason: FallbackReason | None, detail: str = "") -> Any:
        """``batch`` copied into a slot here, counted by ``reason`` (None: no fallback) and
        warned once where something is wrong (_FIXES); unpinned when there is no room."""
        if reason is FallbackReason.TOO_LARGE and self.taken_over and not self.landed:
            reason = FallbackReason.FIRST_BATCHES  # pools sized by the loader before: this one's size them again
        copied_before = self.bytes_copied
        try:  # a copy standing in for batches that land next time: their workers pack other classes' tensors
            pinned = self.pin(batch, classes_land_later=reason is not None and reason not in _FIXES)
        except _NoRoom:
            return self._unpinned(batch)
        if reason is not None:
            self.fallbacks[reason.value] += 1
            if reason in _FIXES:
                fix = _FIXES[reason].format(detail=detail)
                self._warn_once(reason.value, f"a batch was copied by the main process ({reason.value}): {fix}")
        self.copied += 1
        self._after_batch(self.bytes_copied - copied_before)
        return pinned

    # ------------------------------------------------------------ room for batches

    def make_room(self, nbytes: int, more: bool) -> bool:
        """Room for a batch of ``nbytes``: a pool of larger slots when it fits none, and with
        ``more`` (no slot came free) another pool of as many slots as all before it, within
        ``max_pinned_bytes``, published on the board. True when there is room (now or
        soon); False when refused.

        The pool is made outside the mutex every receive takes (a registered pool is
        faulted in whole: seconds per GiB), under ``_making``, taken before deciding:
        another receiving thread may have made room meanwhile (it holds ``_making`` only
        while it makes one pool). Its bytes are reserved first, on the node's budget that
        every numafast process there shares (see :mod:`numafast.node_budget`), and given
        back once its memory is released."""
        with self._making:
            return self._make_room(nbytes, more)

    def _make_room(self, nbytes: int, more: bool, *, ahead: bool = False) -> bool:
        """make_room, under ``_making`` (``ahead``: see :meth:`_grow_ahead`)."""
        if more and not ahead:  # workers lease only free slots: free those whose copy to the GPU is done, waiting for the oldest
            for pool in self.pools:
                # A copy past FENCE_WAIT_S keeps its slot in flight: _acquire says so, unpinned.
                with contextlib.suppress(PoolExhaustedError):
                    pool.reap(wait=True)
        self._unguard()
        self._reclaim()
        room = self._room()  # read outside the mutex: /proc says which processes live
        with self._mutex:
            wanted = self._wanted(nbytes, more, room, ahead=ahead)
            if not isinstance(wanted, tuple):
                return wanted
        slot_bytes, count, resize = wanted
        if resize and 0 < count < self.slots:  # said at the next batch, at the user's line (_after_batch)
            self._fewer_slots = self._fewer(slot_bytes, count)
        reservation = None
        if count:
            reservation = node_budget.reserve(self.node, pool_bytes(slot_bytes, count), self.node_budget, self.cap)
        if reservation is None:
            with self._mutex:
                return self._refuse(self._over(slot_bytes))
        try:
            with memlock_warning_held() as held:  # said at the next batch, at the user's line (_after_batch)
                pool = self._new_pool(slot_bytes, count)
        except BaseException:
            reservation.release()
            raise
        pool.release_with(reservation)
        if held:
            self._unlocked = (held[0], not resize)
        with self._mutex:
            published = not self.closed
            if published:
                inode = pool.share().inode
                self._by_inode[inode] = pool
                self._inodes_made.add(inode)
                if resize:  # the pools in use retire, released as their slots come back
                    if self.pools:
                        self.resized += 1
                    self._publish([pool], retiring=self.pools)
                else:
                    self.grown += 1
                    self._kept_grew = True
                    self._publish([*self.pools, pool])
        if not published:  # closed meanwhile
            pool.close()
            return False
        self._settle_retired()
        return True

    def _wanted(self, nbytes: int, more: bool, room: int, *, ahead: bool = False) -> tuple[int, int, bool] | bool:
        """The pool make_room would add, ``(slot_bytes, slots, resize)``, as many slots as fit
        in ``room`` (0: none), or its answer without one (True: room already; ``ahead``:
        another pool though slots are free). Under the mutex."""
        if self.closed:
            return False
        resize = not self.pools or nbytes > self.pools[0].slot_bytes
        slots_now = sum(pool.slots for pool in self.pools)
        if resize:
            slot_bytes, wanted = slot_bytes_for(nbytes), self.slots
        # A slot only in flight (a GPU copy still reads it) is free soon: waited for.
        elif not more or (not ahead and any(stats.free or stats.in_flight for _, stats in self._counted(nbytes))):
            return True
        elif len(self.pools) >= BOARD_ENTRIES:
            return self._refuse(
                f"these pools are {len(self.pools)}, as many as a loader's pool board lists (BOARD_ENTRIES), "
                f"holding {slots_now} slots, every one held"
            )
        else:
            slot_bytes = grown_slot_bytes(self.pools[0].slot_bytes, max(nbytes, self.largest_landed))
            wanted = max(self.slots, slots_now)
        return slot_bytes, min(wanted, slots_within(slot_bytes, room)), resize

    def _room(self) -> int:
        """Bytes another pool may map now: within the node's budget, given what every
        process's pools there hold, and within :attr:`cap`, given this process's."""
        room = self.node_budget - node_budget.ledger(self.node).total()
        if self.cap is not None:
            room = min(room, self.cap - node_budget.process_reserved())
        return room

    def _over(self, slot_bytes: int, slots: int = 1) -> str:
        """Why another pool of ``slots`` slots of ``slot_bytes`` does not fit."""
        pool = pool_bytes(slot_bytes, slots)
        what = f"another pool of {slot_bytes}-byte slots" if slots == 1 else f"a pool of {slots} {slot_bytes}-byte slots"
        if self.cap is not None and node_budget.process_reserved() + pool > self.cap:
            return (
                f"max_pinned_bytes is {self.cap} bytes and this process's loader pools map "
                f"{node_budget.process_reserved()} already; {what} would go past it"
            )
        ledger = node_budget.ledger(self.node)
        return (
            f"node {self.node}'s pinned memory budget is {self.node_budget} bytes, shared by the numafast processes "
            f"on it, and their loader pools hold {ledger.total()} ({ledger.mine()} this process's); {what} would go "
            f"past it"
        )

    def _fewer(self, slot_bytes: int, count: int) -> str:
        """Why the pool for batches of up to ``slot_bytes`` holds ``count`` slots, fewer than asked."""
        needed = node_budget.process_reserved() + pool_bytes(slot_bytes, self.slots)
        room = "" if self.cap is None or needed <= self.cap else f", or max_pinned_bytes={needed} or more"
        return (
            f"its pool holds {count} slots of {format_size(slot_bytes)}, not the {self.slots} asked for (slots=, by "
            f"default prefetch_factor x num_workers + 2): {self._over(slot_bytes, self.slots)}. Pass slots={count} "
            f"or fewer{room} (each slot holds one batch, in flight or held by the consumer)"
        )

    def _refuse(self, why: str) -> bool:
        """Refuse room: say why (warned as batches arrive unpinned). Under the mutex."""
        self.refused = (
            f"{why}. Pinned memory stays within max_pinned_bytes (NumaLoader(..., max_pinned_bytes=...), for this "
            f"process) and within the node's budget for every numafast process there (a quarter of the node's memory, "
            f"or of the cgroup's memory limit where lower); if the consumer keeps batches, .clone() what it keeps "
            f"(targets.append(y.clone())) so that their slots come back"
        )
        return False

    def shrink(self) -> int:
        """Release the added pools that are wholly free again while those that stay keep
        ``slots`` free slots (the first pool stays): off the board first, then closed.
        Returns how many."""
        gone: list[PinnedPool] = []
        self._reclaim()
        with self._mutex:
            if not self.closed and len(self.pools) > 1:
                counted = self._counted()
                spare = sum(stats.free for _, stats in counted)
                for pool, stats in reversed(counted[1:]):  # the newest, largest first
                    if stats.free == pool.slots and spare - pool.slots >= self.slots:
                        gone.append(pool)
                        spare -= pool.slots
            if gone:
                self._publish([pool for pool in self.pools if pool not in gone], retiring=gone)
                self.refused = ""
        self._settle_retired()
        return len(gone)

    def _unguard(self) -> None:
        """Reuse the slots kept for forked processes (see ``_process.ForkGuard``) whose
        guards ended: a look per guard, only while this process has guards."""
        if _process.fork_guards:
            for pool in self.pools:
                pool.unguard()

    def _reclaim(self) -> None:
        """End the leases of workers that are gone, in every pool: before _counted, and
        outside the mutex, as a retired pool whose last lease ends here is released."""
        with self._mutex:
            pools = [*self.pools, *self.retired]
        for pool in pools:
            pool.reclaim_orphans()

    def _counted(self, nbytes: int = 0) -> list[tuple[PinnedPool, PoolStats]]:
        """The pools in use whose slots hold ``nbytes``, with their counters (the caller
        ended the leases of workers that are gone first: :meth:`_reclaim`)."""
        return [(pool, pool.stats()) for pool in self.pools if pool.slot_bytes >= nbytes]

    def _held(self, counters: Iterable[PoolStats]) -> int:
        """Slots the consumer holds now, by the pools' ``counters`` (see :attr:`LoaderStats.held`)."""
        return max(sum(stats.in_use for stats in counters) - self.in_flight, 0)

    def _new_pool(self, slot_bytes: int, slots: int) -> PinnedPool:
        """A pool registered through ``self.device``. Where that is not settled yet (pools
        a loader's first iteration did not settle: a framework's DataLoader over numafast's
        collate function, a pin_memory hook), it is settled here, in the thread that
        receives the batches and copies them on (iteration_gpu): pools are made only there."""
        # Not faulted in up front: a slot's pages are zeroed by the worker that first fills
        # it, as a stock DataLoader's new shared-memory batch is, so a new loader's first
        # batch does not wait for every slot (~55 ms for 8 x 11 MiB here) and unused
        # slots cost nothing. (A registered pool is faulted in all the same: see PinnedPool.)
        device = self.device
        if device is None and self.register is not RegisterMode.OFF and gpu_usable():
            device = self.device = iteration_gpu(None, stacklevel=_user_level() + 1)
        pool = PinnedPool(
            self.node, slot_bytes, slots, lock=self.lock, register=self.register, timeout=None,
            prefault=False, device=device,
        )
        return pool

    def _publish(self, pools: list[PinnedPool], *, retiring: Sequence[PinnedPool] = ()) -> None:
        """``pools`` in use from now on, on the board; ``retiring`` to be closed and released
        by :meth:`_settle_retired`, which the caller runs once out of the mutex. Under the mutex."""
        self.pools = pools
        # First: a pool the board lists is never one already let go, and no worker leases
        # a slot of a pool the board no longer lists (see _settle_retired).
        self.board.publish([pool.share() for pool in pools])
        self.retired.extend(retiring)

    def _settle_retired(self) -> None:
        """Close the retired pools and forget those whose every slot is back (released now).

        NOTE: outside the mutex every receive takes, as a pool is made (make_room):
        closing and settling wait for the GPU copies still reading a slot, and releasing
        unregisters the memory from CUDA, unmaps it and closes its file; a batch that
        arrives meanwhile must not wait behind that. A retired pool stays known
        (``_by_inode``) until released, so its batches are still received."""
        if not self.retired:
            return
        with self._mutex:
            retired = list(self.retired)
        released = []
        for pool in retired:
            pool.close()  # once; later calls only settle
            if pool.settle():
                released.append(pool)
        if released:
            with self._mutex:
                self.retired = [pool for pool in self.retired if pool not in released]
                self._by_inode = {inode: known for inode, known in self._by_inode.items() if known not in released}

    # ------------------------------------------------------------ copying

    def pin(self, batch: Batch, classes_land_later: bool = False) -> Batch:
        """``batch`` copied into a slot on this node (see :func:`numafast.torch.pin`);
        PoolExhaustedError, saying why, when no slot is free and no room may be made.
        Leaves left unpinned are warned about once; leaves of classes the copy cannot see
        into not where ``classes_land_later`` (a worker's packer places them)."""
        unpinned: set[str] = set()

        def keep(leaf: Any) -> bool:
            """Sparse, nested and device tensors stay as they are, as in a worker's slot."""
            if not isinstance(leaf, torch.Tensor) or placeable(leaf):
                return False
            if leaf.numel():  # an empty one has nothing to pin: no word, as from a worker's slot
                unpinned.add(tensor_kind(leaf))
            return True

        def acquire(nbytes: int, _leaves: int) -> tuple[Slot, Sequence[int]]:
            slot, pool = self._acquire(nbytes)
            self.bytes_copied += nbytes
            return slot, pool.cpus

        def opaque(types: Iterable[str]) -> None:
            if not classes_land_later:
                self._warn_unpinned(sorted(types), _OPAQUE)

        try:
            return place(batch, acquire, opaque, keep)
        finally:
            self._warn_unpinned(sorted(unpinned))

    def _acquire(self, nbytes: int) -> tuple[Slot, PinnedPool]:
        """A slot of ``nbytes`` for a copy here: a free one, else one in flight to the GPU
        (free soon: waited for up to ``_libnuma.FENCE_WAIT_S``, a copy that does not end
        sending the batch unpinned), else a new pool's; _NoRoom, saying why, when no room
        may be made. Never a wait for slots held by tensors: a pool is added for those."""
        for _attempt in range(_ACQUIRE_ATTEMPTS):
            self._reclaim()
            with self._mutex:
                if self.closed:
                    raise PoolClosedError(f"the node-{self.node} pools of this loader are closed")
                for pool in self.pools:
                    if nbytes <= pool.slot_bytes:
                        with contextlib.suppress(PoolExhaustedError):
                            return pool.acquire(nbytes, 0), pool
                busy = [pool for pool, stats in self._counted(nbytes) if stats.in_flight]
            if busy:  # wait for its oldest copy, then take that slot, unless a worker took it first
                try:
                    busy[0].reap(wait=True)
                except PoolExhaustedError as error:  # a copy that does not end
                    with self._mutex:
                        self.refused = str(error)
                    break
                continue
            if not self.make_room(nbytes, more=True):
                break
        # Refused, or each new slot was taken by a worker before this thread: the batch goes unpinned.
        raise _NoRoom(f"no slot for a {nbytes}-byte batch on node {self.node}: {self.refused or 'none free'}")

    # ------------------------------------------------------------ warnings

    def _warn_kept(self) -> None:
        self._reclaim()
        held = self._held(stats for _, stats in self._counted())
        if held < 2:  # only the batch being worked on: a framework reading ahead, not kept batches
            self._kept_grew = False  # looked at again after the next pool added
            return
        kept = held - 1
        self._warn_once("kept", (
            f"the consumer keeps tensors of earlier batches ({kept} {'batch' if kept == 1 else 'batches'} so far; a "
            f"list of labels for metrics, list(loader), a cache): a tensor over a slot keeps its whole slot "
            f"({format_size(self.pools[0].slot_bytes)}), so pools were added to go on, up to max_pinned_bytes "
            f"({format_size(self.max_pinned_bytes)}), after which batches arrive unpinned. .clone() what you keep "
            f"(targets.append(y.clone())): the slot comes back at once, and so does the memory of the pools added "
            f"for them. y.to(device) copies nothing where the device is the CPU, so a device-agnostic loop keeps the "
            f"slot that way too"
        ))  # fmt: skip

    def _warn_unlocked_pool(self) -> None:
        """The MemlockWarning held back when a pool could not be page-locked, at the user's
        line; none for a pool added for kept batches: .clone() (the kept-batches warning,
        which may come a few batches later, once the held slots are counted), not a higher
        limit, is the fix there."""
        assert self._unlocked is not None
        (message, kept), self._unlocked = self._unlocked, None
        if not kept:
            warn_unlocked(message, _user_level())

    def _warn_unpinned(self, kinds: Iterable[str], text: str = _NOT_PLACED) -> None:
        """Once per kind of leaf: ``kinds`` of leaves stay where they are, unpinned."""
        for kind in kinds:
            self._warn_once(kind, text.format(kind))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"numafast loader on node {self.node}: {message}", RuntimeWarning, stacklevel=_user_level())

    # ------------------------------------------------------------ state

    def stats(self) -> LoaderStats:
        if threading.current_thread() is self.user_thread:
            self.shrink()  # which ends the leases of workers that are gone
        else:  # another thread (a monitor's) only reads: see the NOTE at the top
            self._reclaim()
        pools = [stats for _, stats in self._counted()]
        return LoaderStats(
            node=self.node,
            batches=self.received(),
            landed=self.landed,
            copied=self.copied,
            bytes_copied=self.bytes_copied,
            fallbacks=dict(self.fallbacks),
            pools=pools,
            unpinned=self.unpinned,
            held=self._held(pools),
            pinned_bytes=pinned_bytes(),
            max_pinned_bytes=self.max_pinned_bytes,
            mapped_by_workers=self._mapped_by_workers(),
        )

    def _mapped_by_workers(self) -> int:
        """Bytes of the pools made here and let go since that live workers still map, as
        their /proc/PID/maps say (a worker that is gone is forgotten)."""
        with self._mutex:
            gone = self._inodes_made - self._by_inode.keys()
            senders = list(self._senders)
        mapped = 0
        for pid in senders if gone else ():
            try:
                lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
            except OSError:
                self._senders.discard(pid)
                continue
            for line in lines:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and POOL_FILE in fields[5] and int(fields[4]) in gone:
                    low, high = (int(part, 16) for part in fields[0].split("-"))
                    mapped += high - low
        return mapped

    def close(self) -> None:
        """Close every pool (each released once its slots are back) and the board; the
        pools outside the mutex (see _settle_retired)."""
        with self._mutex:  # a pool another thread makes from now on is closed by it, unpublished
            self.closed = True
            pools = [*self.pools, *self.retired]
        for pool in pools:
            pool.close()
        self.board.close()


def _sender_gone(pid: int) -> bool:
    """Whether worker ``pid`` is gone; False where /proc cannot tell (EMFILE, ENFILE)."""
    try:
        return _process.start_time(pid) is None
    except OSError:
        return False


class _Mutex(_process.DeferringLock):
    """NodePools' per-batch lock: a reentrant DeferringLock whose way in and out is written
    out here, so that a batch's receive does not leave this module to take it."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(reentrant=True)

    def __enter__(self) -> None:
        _process.held.depth += 1
        try:
            self._lock.acquire()
        except BaseException:
            _process.let_go()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()
        held = _process.held
        held.depth -= 1
        if not held.depth and held.deferred:
            _process.run_deferred()


class _NoRoom(PoolExhaustedError):
    """No slot for a copy and no room for another pool: the batch goes unpinned."""


# Where a loader's warnings are said from, not pointed at: numafast, torch (the DataLoader
# unpickles a worker's message, which becomes the batch, inside its queue's get), and the
# queue and threading machinery between them.
_LIBRARY_FILES = tuple(
    os.path.dirname(module.__file__ or "") + os.sep for module in (numafast, torch, multiprocessing)
) + (queue.__file__, threading.__file__)


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside :data:`_LIBRARY_FILES` (the line that
    asked for the batch, or made the loader); 2 where none is (PyTorch's pin thread)."""
    return stacklevel_outside(_LIBRARY_FILES, start=2)


def node_pools(
    node: int, slots: int, in_flight: int, *, lock: LockMode | str | bool = "auto",
    register: RegisterMode | str | bool = "auto", max_pinned_bytes: int | None = None,
) -> NodePools:
    """Pools for a new loader on ``node`` whose DataLoader may hold ``in_flight`` batches
    unread: the idle ones a gone loader left there (warm, and sized by its batches) when
    they have ``slots`` slots or more and this process's pools, theirs among them, stay
    within ``max_pinned_bytes``; else new ones."""
    cap = check_max_pinned_bytes(max_pinned_bytes)
    key = (node, parse_mode(lock, LockMode, "lock"), parse_mode(register, RegisterMode, "register"))
    idle = cast("NodePools | None", owner_process_pools.take_idle(key))  # as NodePools put it there
    if idle is not None and idle.slots >= slots and (cap is None or node_budget.process_reserved() <= cap):
        with idle._mutex:
            idle._start(in_flight, cap, taken_over=True)
        return idle
    if idle is not None:  # the new loader keeps more batches in flight, or has room for fewer bytes
        idle.close()
    return NodePools(node, slots, in_flight=in_flight, lock=key[1], register=key[2], max_pinned_bytes=cap)
