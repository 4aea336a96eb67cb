"""NodePools: the pinned pools of one node that a loader's pin step fills, sized by the
batches themselves.

A loader cannot know its batch size in bytes before the first batch, nor how many
batches its consumer keeps. So the first batch sizes the slots (with headroom for
the batches that vary), a batch that outgrows them starts a pool with bigger slots
(the old pools close and are released as their slots come back), and when every
slot is held by batches the consumer still keeps, another pool of the same size is
added rather than waiting for a slot that would never come back. A slot that is
only in flight (a GPU copy still reading it) is waited for instead: it is free soon.
"""

from __future__ import annotations

import threading
from typing import TypeVar

from numafast.errors import PoolExhaustedError
from numafast.pool import LockMode, PinnedPool, PoolStats, RegisterMode, Slot
from numafast.torch.batch import fill, flatten, layout

__all__ = ["NodePools"]

Batch = TypeVar("Batch")

# Slots are this much larger than the batch that sized them, rounded up to SLOT_GRAIN.
HEADROOM = 1.25
SLOT_GRAIN = 1 << 16


class NodePools:
    """Pinned pools on ``node`` with ``slots`` slots each, created as batches need them."""

    def __init__(
        self,
        node: int,
        slots: int,
        *,
        lock: LockMode | str | bool = "auto",
        register: RegisterMode | str | bool = "auto",
    ) -> None:
        self.node = node
        self.slots = slots
        self.lock = lock
        self.register = register
        self.pools: list[PinnedPool] = []
        self.retired: list[PinnedPool] = []
        self.grown = 0
        self.resized = 0
        self._mutex = threading.Lock()

    def pin(self, batch: Batch) -> Batch:
        """``batch`` copied into a slot on this node (see :func:`numafast.torch.pin`)."""
        tensors, rebuild = flatten(batch)
        if not tensors:
            return batch
        plan = layout(tensors)
        if not plan.nbytes:
            return rebuild(fill(None, tensors, plan, ()))
        slot, pool = self._acquire(plan.nbytes)
        return rebuild(fill(slot, tensors, plan, pool.cpus))

    def _acquire(self, nbytes: int) -> tuple[Slot, PinnedPool]:
        with self._mutex:
            if not self.pools or nbytes > self.pools[0].slot_bytes:
                self._resize(nbytes)
            for pool in self.pools:
                try:
                    return pool.acquire(nbytes, 0), pool
                except PoolExhaustedError:
                    pass
            in_flight = [pool for pool in self.pools if pool.stats().in_flight]
            if not in_flight:
                self.grown += 1
                self.pools.append(self._new_pool(self.pools[0].slot_bytes))
                return self.pools[-1].acquire(nbytes, 0), self.pools[-1]
        return in_flight[0].acquire(nbytes, None), in_flight[0]

    def _resize(self, nbytes: int) -> None:
        if self.pools:
            self.resized += 1
        for pool in self.pools:
            pool.close()  # released as its slots come back
        self.retired.extend(self.pools)
        slot_bytes = -(-int(nbytes * HEADROOM) // SLOT_GRAIN) * SLOT_GRAIN
        self.pools = [self._new_pool(slot_bytes)]

    def _new_pool(self, slot_bytes: int) -> PinnedPool:
        return PinnedPool(self.node, slot_bytes, self.slots, lock=self.lock, register=self.register, timeout=None)

    def stats(self) -> list[PoolStats]:
        """The counters of each pool in use now (retired ones not included)."""
        return [pool.stats() for pool in self.pools]

    def close(self) -> None:
        for pool in [*self.pools, *self.retired]:
            pool.close()
