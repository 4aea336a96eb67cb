"""The workers' side of a batch's path: :class:`SlotCollate`, the collate function a
NumaLoader (or a pin_memory_hook) gives the DataLoader. In a worker it leases a free
slot of a pool the loader's board lists, collates the batch into it (stacking straight
into the slot under ``default_collate``, else copying the loader's own result in) and
returns a small :class:`~numafast.torch.message.SlotBatch`.

Where no pool is listed yet, none fits the batch or no slot is free, the worker never
waits (a full pool means the consumer keeps its batches): the batch goes as torch
sends it, in a :class:`~numafast.torch.message.Fallback`, counted with its reason.
The owner's copy of it is what makes or resizes the pools, in the process that owns
them (:meth:`~numafast.torch.owner_pools.NodePools.make_room`), and publishes them on
the board, where every worker finds them at its next batch. Being a picklable
attribute of the loader, it comes along when a framework builds a new DataLoader from
a NumaLoader's settings.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from torch.utils.data import default_collate, get_worker_info

from numafast import _process
from numafast.binding import bind_if_permitted
from numafast.pool_worker import BoardHandle, BoardReader, Lease, LeaseMiss
from numafast.torch.message import Fallback, FallbackReason, SlotBatch, receivers
from numafast.torch.slot import UNMADE, SlotPacker, bytes_needed

if TYPE_CHECKING:
    from numafast.torch.owner_pools import NodePools

__all__ = ["SlotCollate"]


class SlotCollate:
    """The loader's ``collate_fn``, collating into a slot of ``pools``. Picklable (for
    spawned workers): what travels is the board's handle, not the pools."""

    def __init__(self, collate_fn: Callable[[Any], Any], pools: NodePools, *, bind_workers: bool = False,
                 strict: bool = False) -> None:
        self.collate_fn = collate_fn
        self.direct = collate_fn is default_collate
        self.pools: NodePools | None = pools
        self.owner_id = pools.owner_id
        self.owner_pid = _process.pid
        self.board: BoardHandle = pools.board.handle()
        self._board_key = (self.board.owner_pid, self.board.inode)  # hashed in C, per batch
        self.node = pools.node if bind_workers else None
        """The node each worker binds itself to at its first batch (None: stay where it is)."""
        self.strict = strict
        self._bound_pid = 0
        self._packer: SlotPacker | None = None  # a worker's, reused batch after batch
        self._batch = (0, -1, 0)
        """In a worker: its pid, its worker id, the number of the batch it collates now
        (1 for its first): what its messages say, for an error met on their arrival."""
        pools.attach(self)

    def __getstate__(self) -> dict[str, Any]:
        # _batch names the worker process it was set in: stale elsewhere.
        return {**vars(self), "pools": None, "_packer": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        if self.owner_pid == _process.pid:  # a copy made here (copy.deepcopy): it lands where the original does
            pools = cast("NodePools | None", receivers.get(self.owner_id))
            if pools is not None and not pools.closed:
                self.pools = pools
                pools.attach(self)

    def __call__(self, samples: Any) -> Any:
        info = get_worker_info()
        if info is not None:
            if _iterating_process() != self.owner_pid:
                _warn_elsewhere(self.owner_pid)
                return self.collate_fn(samples)
            if self.node is not None and self._bound_pid != _process.pid:
                # Here, not in worker_init_fn, so that the loader's own stays the user's
                # (Lightning seeds workers only where it is None) and a loader a framework
                # re-creates gets the placement with the collate function. Workers forked
                # by NumaLoader's iter() start bound already; one that the user's worker_init_fn
                # put on some of the node's CPUs stays there.
                bind_if_permitted(self.node, strict=self.strict, began_on=_process.affinity_at_start)
                self._bound_pid = _process.pid
            pid, _worker, number = self._batch
            self._batch = (_process.pid, info.id, number + 1 if pid == _process.pid else 1)
            with _process.making_batch:
                batch = self._in_worker(samples)
            _watch_while_idle()
            return batch
        if self.pools is not None and _process.pid == self.owner_pid:
            return self.pools.collate_here(samples, self.collate_fn, self.direct)
        _warn_elsewhere(self.owner_pid)
        return self.collate_fn(samples)

    def _in_worker(self, samples: Any) -> SlotBatch | Fallback:
        made = UNMADE if self.direct else self.collate_fn(samples)
        lease = self._lease(0)
        if isinstance(lease, Lease):
            landed = self._land(lease, samples, made)
            if landed is None:  # larger than that slot: a larger one listed may fit
                lease = self._lease(bytes_needed(samples, made))
                landed = self._land(lease, samples, made) if isinstance(lease, Lease) else None
            if landed is not None:
                return landed
        if isinstance(lease, OSError):
            return self._copying(samples, made, FallbackReason.CANNOT_MAP, str(lease))
        reason = _MISSES[lease] if isinstance(lease, LeaseMiss) else FallbackReason.TOO_LARGE  # a lease it did not fit
        return self._copying(samples, made, reason)

    def _lease(self, needed: int) -> Lease | LeaseMiss | OSError:
        """A free slot of ``needed`` bytes or more leased from the pools the loader's board
        lists (mapped at this process's first look); else why not, or why they cannot be
        mapped here."""
        try:
            reader = _readers.get(self._board_key)
            if reader is None:
                reader = _readers[self._board_key] = BoardReader(self.board)
            return reader.lease(needed)
        except OSError as error:
            return error

    def _land(self, lease: Lease, samples: Any, made: Any) -> SlotBatch | None:
        """The batch collated (or ``made`` packed) into the leased slot; None (the lease
        given up) when it does not fit."""
        packer = self._packer = self._packer or SlotPacker(b"", sent=True)
        try:
            packed = packer.pack_into(lease.memory, lease.kept, samples, made)
        except BaseException:
            lease.give_up()
            raise
        if packed is None:
            lease.give_up()
            return None
        payload, nbytes, unpinned = packed
        return SlotBatch(self.owner_pid, self.owner_id, lease.view.handle.inode, lease.index, lease.generation, nbytes,
                         payload, unpinned, self._batch[1], self._batch[2], _process.pid)  # fmt: skip

    def _copying(self, samples: Any, made: Any, reason: FallbackReason, detail: str = "") -> Fallback:
        """The batch as torch would send it, for the main process to copy into a slot."""
        batch = self.collate_fn(samples) if made is UNMADE else made
        return Fallback(self.owner_pid, self.owner_id, batch, reason, detail, self._batch[1], self._batch[2])


# Why a batch was sent to be copied, by why no slot was leased for it.
_MISSES = {
    LeaseMiss.NO_POOL: FallbackReason.FIRST_BATCHES,  # the owner's copy of this one makes the first pool
    LeaseMiss.ALL_HELD: FallbackReason.NO_FREE_SLOT,
    LeaseMiss.TOO_SMALL: FallbackReason.TOO_LARGE,
}
# In a worker: the board of each loader it serves, mapped once (kept in numafast/_process.py).
_readers = cast("dict[tuple[int, int], BoardReader]", _process.board_readers)
# How often an idle worker looks for pools the owner let go (a look is a read of the board).
IDLE_LOOK_S = 1.0


def _watch_while_idle() -> None:
    """Once per worker process: start the thread of :func:`_let_go_while_idle`."""
    if _process.idle_watch_pid != _process.pid:
        _process.idle_watch_pid = _process.pid
        try:
            threading.Thread(target=_let_go_while_idle, name="numafast idle pools", daemon=True).start()
        except RuntimeError:
            # No thread to spare (a pids limit): the batch made, its slot leased, must still
            # go. Without the look, delisted pools are let go at the worker's next batch.
            pass


def _let_go_while_idle() -> None:
    """A worker maps each pool it fills and lets go of those the owner delisted at its next
    batch; an idle one (persistent workers between epochs, an eval loader's while training
    goes on) has no next batch for a while, and the pools the owner released would stay
    resident in it: up to twice max_pinned_bytes in all. So, between batches, it looks at
    the board now and then, and unmaps what is no longer listed."""
    while True:
        time.sleep(IDLE_LOOK_S)
        making_batch = _process.making_batch
        if not making_batch.acquire(blocking=False):
            continue  # a batch is being made: it looks at the board itself
        try:
            for reader in list(_readers.values()):
                try:
                    reader.pools()
                except OSError:
                    pass  # the next batch's look says why
        finally:
            making_batch.release()


def _iterating_process() -> int:
    """In a DataLoader worker: the process that iterates its DataLoader, whose pools alone
    its batches may land in (the one that made its ``Process``, whether it forked or
    spawned it, or had a forkserver fork it). A worker of a process forked from the
    pools' owner (a ``ddp_fork`` rank iterating an inherited DataLoader) must not lease
    the owner's slots: its batches would arrive where nothing turns them into batches."""
    if _process.iterating[0] != _process.pid:
        parent = multiprocessing.parent_process()
        _process.iterating = (_process.pid, parent.pid if parent is not None and parent.pid is not None else 0)
    return _process.iterating[1]


def _warn_elsewhere(owner_pid: int) -> None:
    """Once per owner: this process collates for a loader whose pools live in another
    (or were closed before this copy of the collate function was made)."""
    if owner_pid == _process.pid and _process.first_time("collating after the pools closed"):
        warnings.warn(
            "numafast: this copy of a NumaLoader's collate function was made after the loader's pools were "
            "closed, so its batches are collated as without numafast; iterate a NumaLoader (it makes pools of "
            "its own) or copy the loader while it lives", RuntimeWarning, stacklevel=3,
        )
    elif owner_pid != _process.pid and _process.first_time(f"collating for process {owner_pid}"):
        warnings.warn(
            f"numafast: this loader's pools belong to process {owner_pid}, not to the one iterating it: the "
            "loader was copied to another process (pickled, or inherited through fork), whose batches are "
            "collated as without numafast; iterate a NumaLoader there (it makes pools of that process's own), "
            "or make the loader in the process that iterates it", RuntimeWarning, stacklevel=3,
        )
