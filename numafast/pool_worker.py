"""A pinned pool seen from another process: a DataLoader worker maps the owner's pool
file (:class:`PoolView`, from :meth:`PinnedPool.share`'s :class:`PoolHandle`), leases
a slot, writes its batch there and sends the slot's index and generation; the owner
adopts the slot (:meth:`PinnedPool.adopt`) and reads the batch without a copy. The
file's lock and CUDA registration stay the owner's. A dead worker's lease is ended by
the owner (:meth:`PinnedPool.reclaim_orphans`); the generation, bumped whenever a slot
becomes free, makes a late message about it harmless.

This module is the worker's side, with the format both sides share (a pool's and a
board's handle, the board's layout); the owner's board is :mod:`numafast.pool_owner`.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from enum import Enum
from typing import Any

from numafast import _libnuma, _process

__all__ = [
    "BoardHandle", "BoardReader", "Lease", "LeaseMiss", "PoolHandle", "PoolView", "board_entries", "board_payload",
    "fault_in", "open_shared_file",
]  # fmt: skip

# A board lists at most this many pools (a loader's pools of one slot size, and the
# ones it is retiring); each entry is a PoolHandle's six fields. The file is a seqlock
# (src/pool.pxi): its version (odd while the owner writes), then the payload: the
# number of entries, then the entries.
BOARD_ENTRIES = 16
_ENTRY = struct.Struct("6q")
_COUNT = struct.Struct("q")
_PAYLOAD_BYTES = _COUNT.size + BOARD_ENTRIES * _ENTRY.size
BOARD_BYTES = 8 + _PAYLOAD_BYTES
# How long a reader waits for a board that the owner is writing at each look: only an
# owner stopped in the middle of a write (SIGSTOP, a debugger) takes more than microseconds.
_BOARD_WAIT_S = 5.0
# How many times a lease reads a board that changed under it before it settles for a
# miss: an owner publishes once per pool it makes, so a second look finds it settled.
_LEASE_LOOKS = 3
# madvise(2) advice of Linux 5.14 (uapi asm-generic/mman-common.h, every architecture's
# value), which the extension does not publish: see fault_in.
MADV_POPULATE_READ = 22


@dataclass(frozen=True)
class PoolHandle:
    """Where another process finds a pool: the owner's process id and descriptor of
    the memfd, and its inode, which tells that descriptor still is that file."""

    owner_pid: int
    fd: int
    inode: int
    nbytes: int
    node: int
    slot_bytes: int


@dataclass(frozen=True)
class BoardHandle:
    """Where another process finds a :class:`~numafast.pool_owner.PoolBoard` (as :class:`PoolHandle` does a
    pool): its file."""

    owner_pid: int
    fd: int
    inode: int


def open_shared_file(owner_pid: int, fd: int, inode: int, what: str) -> int:
    """A read-write descriptor of process ``owner_pid``'s file ``fd`` (inode ``inode``):
    this process's inherited copy (a forked worker), else through /proc (a spawned
    one). OSError naming ``what`` and why when neither opens. A path is opened only
    once its stat names that inode: in a spawned worker, descriptor ``fd`` is a file of
    the worker's own, maybe a device that opening would act on."""
    for path in (f"/proc/self/fd/{fd}", f"/proc/{owner_pid}/fd/{fd}"):
        try:
            if os.stat(path).st_ino != inode:
                continue
            opened = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        if os.fstat(opened).st_ino == inode:
            return opened
        os.close(opened)
    raise OSError(
        f"cannot open {what} of process {owner_pid} (its descriptor {fd}, inode {inode}) from process "
        f"{_process.pid}: the owner is gone, or this process may not read its /proc/PID/fd"
    )


def board_payload(pools: Sequence[PoolHandle]) -> bytes:
    """What a board says of ``pools`` (the first BOARD_ENTRIES of them)."""
    pools = list(pools)[:BOARD_ENTRIES]
    return _COUNT.pack(len(pools)) + b"".join(_ENTRY.pack(*astuple(pool)) for pool in pools)


def board_entries(payload: bytes) -> list[PoolHandle]:
    """The pools a board's ``payload`` lists (see :func:`board_payload`)."""
    count = min(_COUNT.unpack_from(payload)[0], BOARD_ENTRIES)
    return [PoolHandle(*fields) for fields in _ENTRY.iter_unpack(payload[_COUNT.size :])][:count]


class BoardReader:
    """A :class:`~numafast.pool_owner.PoolBoard` as a worker reads it: :meth:`pools`, mapped here."""

    def __init__(self, handle: BoardHandle) -> None:
        _check_handle(handle, BoardHandle, "PoolBoard.handle()")
        fd = open_shared_file(handle.owner_pid, handle.fd, handle.inode, "a loader's pool board")
        try:
            self.memory = mmap.mmap(fd, BOARD_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.handle = handle
        self.version = -1
        self.views: list[PoolView] = []

    def _read(self, known: int | None = None) -> tuple[int, list[PoolHandle] | None]:
        """The board's version and its entries (None while the version is still ``known``,
        default: this reader's); OSError when the owner stays mid-write _BOARD_WAIT_S."""
        known = self.version if known is None else known
        deadline = None
        while True:
            try:
                version, payload = _libnuma.seqlock_read(self.memory, _PAYLOAD_BYTES, known)
            except BlockingIOError:
                now = time.monotonic()
                deadline = deadline or now + _BOARD_WAIT_S
                if now >= deadline:
                    raise OSError(f"the pool board of process {self.handle.owner_pid} was being written at every "
                                  f"look for {_BOARD_WAIT_S:g} s: is its owner stopped?") from None  # fmt: skip
                time.sleep(0.0001)
                continue
            if payload is None:
                return version, None
            return version, board_entries(payload)

    def pools(self) -> list[PoolView]:
        """The pools listed now, each mapped once and let go once delisted; OSError when one
        cannot be mapped here (unless the owner let it go and published since: read again)."""
        while True:
            version, entries = self._read()
            if entries is None:
                return self.views
            known = {view.handle: view for view in self.views}
            try:
                views = [known.get(entry) or PoolView(entry) for entry in entries]
            except OSError:
                if self._read(version)[0] != version:
                    continue  # maybe listed no more: the owner let it go and published since
                raise
            self.views = views
            for handle, view in known.items():
                if handle not in entries:
                    view.close()
            self.version = version
            return views

    def lease(self, needed: int) -> Lease | LeaseMiss:
        """A free slot of ``needed`` bytes or more (0: any) in a pool listed now, leased to
        this process with its memory, in one call per batch; else why there is none. Never
        waits (the batch then goes the copying way, and the owner makes room). A miss is
        the answer only if the board is still as read: an owner that resized meanwhile
        published the new pools, then retired the slots of those it listed before, so
        the board is read again (up to _LEASE_LOOKS times). OSError as :meth:`pools`."""
        miss = LeaseMiss.NO_POOL
        for _ in range(_LEASE_LOOKS):
            views = self.pools()
            if not views:
                return LeaseMiss.NO_POOL
            fits = False
            for view in views:
                if view.handle.slot_bytes >= needed:
                    fits = True
                    claimed = view.lease()
                    if claimed is not None:
                        index, generation = claimed
                        return Lease(view, index, generation, view.slot(index), view.made[index])
            miss = LeaseMiss.ALL_HELD if fits else LeaseMiss.TOO_SMALL
            if self._read()[1] is None:  # published nothing since
                break
        return miss


class LeaseMiss(Enum):
    """Why :meth:`BoardReader.lease` leased no slot."""

    NO_POOL = "no pool is listed yet"
    TOO_SMALL = "no pool listed has slots that large"
    ALL_HELD = "every slot large enough is held"


@dataclass(slots=True)
class Lease:
    """Slot ``index`` of ``view``'s pool, leased in ``generation``: its writable ``memory``
    and what a filler ``kept`` over it from earlier batches (see :attr:`PoolView.made`)."""

    view: PoolView
    index: int
    generation: int
    memory: memoryview
    kept: dict[Any, Any]

    def give_up(self) -> None:
        """End the lease of a slot this process will not send (its batch failed, or did not fit)."""
        self.view.give_up(self.index, self.generation)


class PoolView:
    """``handle``'s pool mapped shared here, to lease and fill slots; OSError when it
    cannot be (the owner is gone, or its descriptors are closed to this process)."""

    def __init__(self, handle: PoolHandle) -> None:
        _check_handle(handle, PoolHandle, "PinnedPool.share()")
        self.handle = handle
        fd = open_shared_file(handle.owner_pid, handle.fd, handle.inode, f"the node-{handle.node} pool")
        try:
            region = _libnuma.mmap_shared(handle.nbytes, fd)
        finally:
            os.close(fd)
        self.table = _libnuma.SlotTable.attach(region)
        if self.table.slot_bytes != handle.slot_bytes:  # slot() would run into the next slot
            raise ValueError(f"the handle says {handle.slot_bytes}-byte slots, but the node-{handle.node} pool's "
                             f"table says {self.table.slot_bytes}")  # fmt: skip
        self.memory = memoryview(region)
        self._slots: list[memoryview | None] = [None] * self.table.count
        """Each slot's memory, made (and faulted in) at its first lease here."""
        self.made: list[dict[Any, Any]] = [{} for _ in range(self.table.count)]
        """Per slot, what a filler keeps over its memory from batch to batch (tensors to
        collate into), as long as this mapping lives."""
        self._started = (0, 0)  # (pid, its start time): what a lease records of its holder

    def lease(self) -> tuple[int, int] | None:
        """A free slot leased to this process, ``(index, generation)``; None when every one
        is taken. OSError when /proc cannot tell this process's start time."""
        pid, started = self._started
        if pid != _process.pid:  # read once per process (a forked child's view is its own lease holder)
            pid, started = self._started = (_process.pid, _process.started())
        return self.table.claim(started)

    def slot(self, index: int) -> memoryview:
        """The writable memory of slot ``index`` (the same memoryview at every lease)."""
        memory = self._slots[index]
        if memory is None:  # once per slot, not per batch
            start = self.table.offset(index)
            memory = self._slots[index] = self.memory[start : start + self.handle.slot_bytes]
            fault_in(memory)
        return memory

    def give_up(self, index: int, generation: int) -> None:
        """End this process's lease of a slot it will not send (its batch failed)."""
        self.table.unclaim(index, generation)

    def close(self) -> None:
        """Let the mapping go: unmapped once no memoryview or tensor over a slot is left."""
        try:
            self.memory.release()
        except BufferError:
            pass  # still viewed: unmapped with the last view


def _check_handle(handle: object, kind: type, made_by: str) -> None:
    """TypeError unless ``handle`` is a ``kind`` (what ``made_by`` returns in the owner)."""
    if not isinstance(handle, kind):
        raise TypeError(f"handle must be a {kind.__name__}, what {made_by} returns in the owning process, "
                        f"not {handle!r}")  # fmt: skip


def fault_in(memory: memoryview, *, filled: bool = False) -> None:
    """Enter every page of ``memory`` (a slot) in this process's page tables in one call,
    faulting in (zeroing, on the pool's node) any page never touched. Page tables are
    per process: otherwise each takes a minor fault per page at its first write of a
    slot (~2,400 per 9 MiB slot of 4 KiB pages), which slowed the epoch after the first by half.
    MADV_POPULATE_WRITE and _READ need Linux 5.14: an older kernel refuses them, mapping
    each page as it is touched.

    ``filled``: another process (a worker) wrote every page already. Then they are
    read-populated: a read fault maps the file's pages around it too (fault-around,
    64 KiB a fault), where a write fault maps one; ~2.3x faster (1.5 against 3.4 ms for a
    36.75 MiB slot, the owner's first adoption of it, in the consumer's thread). A
    read-faulted page of a shared memfd mapping is mapped writable all the same (shmem
    tracks no dirty pages), so a later write takes no fault either."""
    try:
        _libnuma.madvise(memory, MADV_POPULATE_READ if filled else _libnuma.MADV_POPULATE_WRITE)
    except OSError:
        pass
