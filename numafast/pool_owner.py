"""The owner's side of a pool shared with DataLoader workers: the board that lists the
pools they may fill now, and the thread that answers their requests for room. The
worker's side, and the format of the board and of a pool's handle that both sides
share, are in :mod:`numafast.pool_worker`."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import astuple

from numafast import _libnuma, _process
from numafast.pool_worker import (
    _CLOSED, _COUNT, _ENTRY, _REQUEST, BOARD_BYTES, BOARD_ENTRIES, REFUSED, BoardHandle, PoolHandle,
)  # fmt: skip

__all__ = ["PoolBoard"]


class PoolBoard:
    """The pools a loader's workers may fill now, in a small shared file (a seqlock, see
    src/pool.pxi) that the owner rewrites as its pools change and every worker reads
    before each batch: new pools reach workers started before them. A worker whose
    batch fits no pool listed asks for room through the board's pipe
    (:meth:`BoardReader.ask`); the owner's thread (:meth:`serve_requests`) answers by
    publishing one that fits, so even a loader's first batches are made in place."""

    def __init__(self) -> None:
        self.owner_pid = _process.pid
        self.fd = os.memfd_create("numafast-pool-board", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, BOARD_BYTES)
        self.memory = mmap.mmap(self.fd, BOARD_BYTES)
        self.version = 0
        self.requests, self.request_fd = os.pipe2(os.O_CLOEXEC)  # workers write to a copy of request_fd
        self._serving = False
        self._fds = [self.fd, self.request_fd, self.requests]  # closed with the board
        self._closer = weakref.finalize(self, _close_board, self.memory, self._fds)

    def handle(self) -> BoardHandle:
        return BoardHandle(
            self.owner_pid, self.fd, os.fstat(self.fd).st_ino, self.request_fd, os.fstat(self.request_fd).st_ino
        )

    def publish(self, pools: Sequence[PoolHandle], *, refused: bool = False) -> None:
        """Make the first BOARD_ENTRIES of ``pools`` what workers see, a new version (the
        answer a worker waits for), ``refused`` where it answers a request for room with
        none; only the board's maker may (a forked child's copy maps the same file)."""
        if not _process.owns(self.owner_pid):
            raise RuntimeError(f"this pool board belongs to process {self.owner_pid}: a forked child "
                               "cannot publish on it")  # fmt: skip
        pools = list(pools)[:BOARD_ENTRIES]
        payload = _COUNT.pack(len(pools) | (REFUSED if refused else 0)) + b"".join(
            _ENTRY.pack(*astuple(pool)) for pool in pools
        )
        self.version = _libnuma.seqlock_write(self.memory, payload)

    def serve_requests(self, make_room: Callable[[int, bool], object], name: str) -> threading.Thread:
        """Start a daemon thread calling ``make_room(nbytes, more)`` for the requests
        waiting at once (the largest size; whether any asked for more) until the board
        closes. The thread owns the pipe's read end from here, before it runs, so that a
        board closed first cannot close it under the thread (its number then reused)."""
        if self._serving:
            raise RuntimeError("this board's requests are served already")
        self._serving = True
        self._fds.remove(self.requests)
        thread = threading.Thread(target=_serve, args=(self.requests, make_room), name=name, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Unmap and close the file and the pipe (also when collected), ending
        :meth:`serve_requests`; in a forked child, only its own copies."""
        if self._serving and _process.owns(self.owner_pid):
            self._serving = False
            os.write(self.request_fd, _CLOSED)  # the serving thread's cue to return
        self._closer()


def _serve(requests: int, make_room: Callable[[int, bool], object]) -> None:
    """Read requests until the closing one; the read waits without the GIL."""
    try:
        while True:
            data = os.read(requests, 64 * _REQUEST.size)
            waiting = list(_REQUEST.iter_unpack(data[: len(data) - len(data) % _REQUEST.size]))
            if not waiting or (0, 0) in waiting:
                return
            make_room(max(size for size, _more in waiting), any(more for _size, more in waiting))
    finally:
        os.close(requests)


def _close_board(memory: mmap.mmap, fds: list[int]) -> None:
    memory.close()
    for fd in fds:
        os.close(fd)
