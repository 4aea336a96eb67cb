"""The owner's side of a pool shared with DataLoader workers: the board that lists the
pools they may fill now. The worker's side, and the format of the board and of a
pool's handle that both sides share, are in :mod:`numafast.pool_worker`."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

from numafast import _libnuma, _process
from numafast.pool_worker import BOARD_BYTES, BoardHandle, PoolHandle, board_payload

__all__ = ["PoolBoard"]


class PoolBoard:
    """The pools a loader's workers may fill now, in a small shared file (a seqlock, see
    src/pool.pxi) that the owner rewrites as its pools change and every worker reads
    before each batch: new pools reach workers started before them. The board is the
    only way from owner to workers; nothing goes back but batches (a worker whose batch
    fits no free slot listed sends it the copying way, and the owner's copy of it makes
    the room that the board then lists)."""

    def __init__(self) -> None:
        self.owner_pid = _process.pid
        self.fd = os.memfd_create("numafast-pool-board", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, BOARD_BYTES)
        # numafast's mapping keeps no descriptor, unlike Python's mmap (see _close_board).
        self.memory = _libnuma.mmap_shared(BOARD_BYTES, self.fd)
        self.version = 0
        info = os.fstat(self.fd)
        file = (info.st_dev, info.st_ino)
        self._closer = weakref.finalize(self, _close_board, self.memory, self.fd, file, self.owner_pid)

    def handle(self) -> BoardHandle:
        return BoardHandle(self.owner_pid, self.fd, os.fstat(self.fd).st_ino)

    def publish(self, pools: Sequence[PoolHandle]) -> None:
        """Make the first BOARD_ENTRIES of ``pools`` what workers see, a new version; only
        the board's maker may (a forked child's copy maps the same file)."""
        if self.owner_pid != _process.pid:
            raise RuntimeError(f"this pool board belongs to process {self.owner_pid}: a forked child "
                               "cannot publish on it")  # fmt: skip
        self.version = _libnuma.seqlock_write(self.memory, board_payload(pools))

    def close(self) -> None:
        """Unmap and close the file (also when collected); in a forked child, its own copies."""
        self._closer()


def _close_board(memory: _libnuma.MappedBuffer, fd: int, file: tuple[int, int], owner_pid: int) -> None:
    """Unmap, and close descriptor ``fd`` where it is still the board's ``file`` (device,
    inode): a forked child may have closed the number it inherited (as a daemon closes
    every descriptor) and opened a file of its own under it."""
    memory.free()
    if owner_pid != _process.pid:
        try:
            info = os.fstat(fd)
        except OSError:
            return
        if (info.st_dev, info.st_ino) != file:
            return
    os.close(fd)
