"""The collate function a NumaLoader (or a pin_memory_hook) gives the DataLoader's
workers: each batch is collated straight into a free slot of the loader's shared,
node-local, page-locked pool, and only the slot's number and the batch's layout
travel to the main process.

In a worker, :class:`SlotCollate` reads the loader's pool board (which pools exist
now), leases a slot, and then either collates with torch's own ``collate`` and a
map that stacks every tensor into the slot (the loader's ``collate_fn`` is
``default_collate``), or calls the loader's own ``collate_fn`` and copies its
tensors into the slot; the result is a :class:`SlotBatch`. When a batch cannot
land in a slot, the worker sends it as torch would, in a :class:`Fallback` that
names the reason, and the main process copies it into a slot: never a stall,
never a deadlock. Called in the main process (``num_workers=0``) it collates into
a slot there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

from torch.utils.data import default_collate, get_worker_info
from torch.utils.data._utils.collate import collate

from numafast.pool_share import BoardHandle, BoardReader, PoolView
from numafast.torch.packing import SlotFull, SlotPacker

if TYPE_CHECKING:
    from numafast.torch.pools import NodePools

__all__ = ["Fallback", "FallbackReason", "SlotBatch", "SlotCollate"]

# How long a worker waits for a free slot before it sends its batch the copying way:
# short, since a full pool means the consumer holds its batches (waiting longer
# would only slow the loader down).
SLOT_WAIT_S = 0.05
# How often a waiting worker looks at the pools again.
SLOT_POLL_S = 0.0002


class FallbackReason(str, Enum):
    """Why a batch did not land in a slot in its worker and was copied by the main process."""

    FIRST_BATCHES = "first batches"
    """No pool yet: the first batches size it (no warning)."""
    NO_FREE_SLOT = "no free slot"
    """Every slot was held (by batches the consumer keeps, queued ones, copies to the GPU)."""
    TOO_LARGE = "batch larger than a slot"
    """The pool is resized to the batch."""
    CANNOT_MAP = "worker cannot map the pool"
    """The worker could not open the pool's file (another user's process, a sandbox)."""


class SlotBatch:
    """A batch a worker packed into slot ``index`` (lease ``generation``) of the pool
    whose file is ``inode``. In the main process it becomes the batch again through
    its loader's pools; dropped unread, it gives its slot back."""

    def __init__(self, owner_id: int, inode: int, index: int, generation: int, nbytes: int, payload: bytes,
                 unpinned: tuple[str, ...]) -> None:
        self.owner_id = owner_id
        self.inode = inode
        self.index = index
        self.generation = generation
        self.nbytes = nbytes
        self.payload = payload
        self.unpinned = unpinned
        self.sender = os.getpid()
        self.received = False  # True in the process that unpickled it
        self.taken = False

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in vars(self).items() if name != "received"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.received = True

    def pin_memory(self, device: object = None) -> Any:
        """The batch, already in page-locked memory (PyTorch's pin thread calls this)."""
        return _owner(self.owner_id).receive(self)

    def __del__(self) -> None:
        if self.received and not self.taken:
            owner = _owners_get(self.owner_id)
            if owner is not None:
                owner.drop(self)


class Fallback:
    """A batch that travels as torch sends it (tensors in shared memory), with why."""

    def __init__(self, owner_id: int, batch: Any, reason: FallbackReason, detail: str = "") -> None:
        self.owner_id = owner_id
        self.batch = batch
        self.reason = reason
        self.detail = detail

    def pin_memory(self, device: object = None) -> Any:
        return _owner(self.owner_id).copy_in(self)


def _owners_get(owner_id: int) -> NodePools | None:
    from numafast.torch.pools import owners  # here: pools.py imports this module

    return owners.get(owner_id)


def _owner(owner_id: int) -> NodePools:
    owner = _owners_get(owner_id)
    if owner is None:
        raise RuntimeError("the numafast loader or hook that made this batch is gone (removed, or another process)")
    return owner


class SlotCollate:
    """``collate_fn`` for the workers of a loader whose batches land in ``pools``.
    Picklable, for spawned workers: what travels is the board's handle, not the pools."""

    def __init__(self, collate_fn: Callable[[Any], Any], pools: NodePools) -> None:
        self.collate_fn = collate_fn
        self.direct = collate_fn is default_collate
        self.pools: NodePools | None = pools
        self.owner_id = pools.owner_id
        self.owner_pid = os.getpid()
        self.board: BoardHandle = pools.board.handle()

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "pools": None}

    def __call__(self, samples: Any) -> Any:
        if self.pools is not None and os.getpid() == self.owner_pid and get_worker_info() is None:
            return self.pools.collate_here(samples, self)
        return self._in_worker(samples)

    def _in_worker(self, samples: Any) -> SlotBatch | Fallback:
        try:
            views = _reader(self.board).pools()
        except OSError as error:
            return Fallback(self.owner_id, self.collate_fn(samples), FallbackReason.CANNOT_MAP, str(error))
        if not views:
            return Fallback(self.owner_id, self.collate_fn(samples), FallbackReason.FIRST_BATCHES)
        lease = _lease(views, SLOT_WAIT_S)
        if lease is None:
            return Fallback(self.owner_id, self.collate_fn(samples), FallbackReason.NO_FREE_SLOT)
        view, index, generation = lease
        try:
            packer = SlotPacker(view.slot(index))
            try:
                batch = self.fill(packer, samples)
                payload = packer.pack(batch)
            except SlotFull:
                view.give_up(index, generation)
                batch = self.collate_fn(samples) if self.direct else batch
                return Fallback(self.owner_id, batch, FallbackReason.TOO_LARGE)
        except BaseException:
            view.give_up(index, generation)
            raise
        return SlotBatch(self.owner_id, view.handle.inode, index, generation, packer.end, payload,
                         tuple(sorted(packer.unpinned)))

    def fill(self, packer: SlotPacker, samples: Any) -> Any:
        """The batch, collated into ``packer``'s slot when the collate function is
        ``default_collate``, else as the loader's own function makes it."""
        if self.direct:
            return collate(samples, collate_fn_map=packer.collate_map())
        return self.collate_fn(samples)


# In a worker: the board of each loader it serves, mapped once.
_readers: dict[BoardHandle, BoardReader] = {}


def _reader(board: BoardHandle) -> BoardReader:
    reader = _readers.get(board)
    if reader is None:
        reader = _readers[board] = BoardReader(board)
    return reader


def _lease(views: list[PoolView], wait_s: float) -> tuple[PoolView, int, int] | None:
    """A free slot of one of ``views``, waiting up to ``wait_s`` seconds for one."""
    deadline = time.monotonic() + wait_s
    while True:
        for view in views:
            lease = view.lease(0.0)
            if lease is not None:
                return view, lease[0], lease[1]
        if time.monotonic() >= deadline:
            return None
        time.sleep(SLOT_POLL_S)
