"""The message a DataLoader worker sends for each batch, and what it becomes on arrival.

A worker that collated a batch into a pool slot sends a :class:`SlotBatch`: which
slot of which pool, and the batch's layout. One that could not (no pool yet, no
free slot, a batch too large) sends a :class:`Fallback` with the batch as torch
would send it and why. Both travel through the DataLoader's own result queue, and
both *become the batch* when they are unpickled in the process that owns the pools
(``__reduce__`` names a function of this module): the DataLoader's iterator, its
pin thread, or any framework's iterator wrapped around it yields tensors over the
slot, whoever built the loader. Elsewhere (a process that does not own the pools)
they stay messages, and can travel on.

The owner's side registers here (:data:`receivers`), so this module imports
neither the workers' side nor the owner's: the batch's path has no import circle.
"""

from __future__ import annotations

import weakref
from enum import Enum
from typing import Any, Protocol

from numafast import _pid

__all__ = ["Fallback", "FallbackReason", "Receiver", "SlotBatch", "receivers"]


class FallbackReason(str, Enum):
    """Why a batch did not land in a slot in its worker and was copied by the main process."""

    FIRST_BATCHES = "first batches"
    """No pool yet, and none came in time for the worker that asked for one, or the
    batch has no bytes to lay out (no warning)."""
    NO_FREE_SLOT = "no free slot"
    """Every slot was held (by batches the consumer keeps, queued ones, copies to the
    GPU), and no more came in time for the worker that asked for them."""
    TOO_LARGE = "batch larger than a slot"
    """No larger slots came in time for the worker that asked: the main process resizes
    the pool to the batch."""
    CANNOT_MAP = "worker cannot map the pool"
    """The worker could not open the pool's file (another user's process, a sandbox)."""
    BYPASSED = "collate bypassed"
    """The batch came from a loader whose workers do not run numafast's collate (its
    settings live where numafast cannot reach them)."""


class Receiver(Protocol):
    """The owner's side (:class:`numafast.torch.pools.NodePools`)."""

    def receive(self, message: SlotBatch) -> Any: ...

    def copy_in(self, fallback: Fallback) -> Any: ...


# The receivers of this process by id: what a message names to become its batch.
receivers: weakref.WeakValueDictionary[int, Receiver] = weakref.WeakValueDictionary()


class SlotBatch:
    """A batch a worker packed into slot ``index`` (lease ``generation``) of the pool
    whose file is ``inode``, owned by receiver ``owner_id`` of process ``owner_pid``."""

    __slots__ = ("owner_pid", "owner_id", "inode", "index", "generation", "nbytes", "payload", "unpinned")

    def __init__(self, owner_pid: int, owner_id: int, inode: int, index: int, generation: int, nbytes: int,
                 payload: bytes, unpinned: tuple[str, ...] = ()) -> None:
        self.owner_pid = owner_pid
        self.owner_id = owner_id
        self.inode = inode
        self.index = index
        self.generation = generation
        self.nbytes = nbytes
        self.payload = payload
        self.unpinned = unpinned

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _arrive_in_slot, (self.owner_pid, self.owner_id, self.inode, self.index, self.generation, self.nbytes,
                                 self.payload, self.unpinned)  # fmt: skip


class Fallback:
    """A batch that travels as torch sends it (tensors in shared memory), and why."""

    __slots__ = ("owner_pid", "owner_id", "batch", "reason", "detail")

    def __init__(self, owner_pid: int, owner_id: int, batch: Any, reason: FallbackReason, detail: str = "") -> None:
        self.owner_pid = owner_pid
        self.owner_id = owner_id
        self.batch = batch
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _arrive_copied, tuple(getattr(self, name) for name in Fallback.__slots__)


def _receiver(owner_pid: int, owner_id: int) -> Receiver | None:
    """This process's receiver ``owner_id`` when this is its process (a forked child
    inherits the registry, not the pools)."""
    return receivers.get(owner_id) if owner_pid == _pid.pid else None


def _arrive_in_slot(*fields: Any) -> Any:
    message = SlotBatch(*fields)
    receiver = _receiver(message.owner_pid, message.owner_id)
    return message if receiver is None else receiver.receive(message)


def _arrive_copied(*fields: Any) -> Any:
    fallback = Fallback(*fields)
    receiver = _receiver(fallback.owner_pid, fallback.owner_id)
    return fallback if receiver is None else receiver.copy_in(fallback)
