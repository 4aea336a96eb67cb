"""Memory order between processes: the pool board and the slot table read by forked
processes while the owner changes them, as fast as each side can.

Every list the owner publishes is consistent by construction: each field of each
entry is derived from the publication's number, which is the board's version / 2,
and the number of entries too. A reader that took a torn list (entries of two
publications), or the new version with entries from before it, sees a field that
does not derive from the version it read. x86 keeps stores in order and so forgives
a missing barrier more often than Arm does; the test runs in the aarch64 guest too,
and in the multi-node guests with the readers on other nodes than the writer (their
caches further apart). A control case publishes without the seqlock (the version
first, then the entries): the same readers must catch it, or the check proves nothing.
"""

from __future__ import annotations

import gc
import os
import select
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest

import numafast
from numafast import _libnuma
from numafast.pool_owner import PoolBoard
from numafast.pool_worker import BOARD_ENTRIES, BoardReader, PoolHandle, PoolView
from sysfs_truth import node_cpus, online_nodes

NODES = online_nodes()
READERS = 3
SECONDS = 1.0
FRESH = 10  # new versions each reader must have seen: it read while the board was written
LIMIT_S = 60.0
# Where the processes run: all where the suite does, or the writer (the owner) on the
# first node and the readers (workers) on the others.
PLACES = [
    pytest.param("anywhere"),
    pytest.param("readers on other nodes", marks=pytest.mark.numa(nodes=2)),
]


@pytest.fixture(autouse=True)
def _keep_affinity() -> Iterator[None]:
    """The test process's CPUs as they were, whatever the test pinned it to."""
    cpus = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, cpus)


def place(who: str, where: str) -> None:
    """Pin this process as ``where`` says for the ``who`` ('writer' or 'reader')."""
    if where == "anywhere":
        return
    nodes = NODES[:1] if who == "writer" else NODES[1:]
    os.sched_setaffinity(0, [cpu for node in nodes for cpu in node_cpus(node)])


def publication(number: int) -> list[PoolHandle]:
    """The entries of the owner's ``number``-th publication: 1 to BOARD_ENTRIES of them,
    every field derived from ``number`` and the entry's position."""
    return [
        PoolHandle(owner_pid=number, fd=position, inode=number * 1_000_003 + position, nbytes=(number << 8) | position,
                   node=number % 7, slot_bytes=number * 31 + position * 17)
        for position in range(1 + number % BOARD_ENTRIES)
    ]  # fmt: skip


def read_board(reader: BoardReader, seconds: float) -> tuple[int, int, int]:
    """Read the board for ``seconds``, and on until :data:`FRESH` reads found a new version
    (at most :data:`LIMIT_S`: under QEMU's emulation a reader may get little CPU while
    the writer runs): (reads that found a new version, versions whose entries were not
    that publication's, versions seen going backwards)."""
    fresh = wrong = backwards = 0
    start = time.monotonic()
    while (now := time.monotonic()) < start + seconds or fresh < FRESH and now < start + LIMIT_S:
        version, entries = reader._read()
        if version == reader.version:
            continue
        fresh += 1
        if version % 2 or entries != (publication(version // 2) if version else []):  # 0: none published yet
            wrong += 1
        if version < reader.version:
            backwards += 1
        reader.version = version
    return fresh, wrong, backwards


def publish_unordered(board: PoolBoard, pools: list[PoolHandle]) -> None:
    """The control: the even version first, then the count and the entries, plain stores
    (struct.pack_into even zero-fills each field before it writes it: a reader may
    see a version of 0 go by)."""
    board.version += 2
    struct.pack_into("q", board.memory, 0, board.version)
    struct.pack_into("q", board.memory, 8, len(pools))
    for position, pool in enumerate(pools):
        struct.pack_into("6q", board.memory, 16 + position * 48, *vars(pool).values())


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("writer", ["seqlock", "unordered control"])
def test_readers_in_other_processes_never_take_a_torn_or_stale_board(writer: str, where: str) -> None:
    board = PoolBoard()
    results = []
    children = []
    for _ in range(READERS):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # a reader: report, never return into pytest
            code = 1
            try:
                os.close(read_end)
                place("reader", where)
                counts = read_board(BoardReader(board.handle()), SECONDS)
                os.write(write_end, " ".join(map(str, counts)).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        children.append((pid, read_end))
    number = 0
    place("writer", where)
    publish = board.publish if writer == "seqlock" else lambda pools: publish_unordered(board, pools)
    pending = [read_end for _pid, read_end in children]
    while pending:  # publish until every reader has reported
        for _ in range(50):
            number += 1
            publish(publication(number))
        ready, _, _ = select.select(pending, [], [], 0)
        for read_end in ready:
            results.append(tuple(map(int, os.read(read_end, 100).split())))
            pending.remove(read_end)
    for pid, read_end in children:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        os.close(read_end)
    board.close()
    assert len(results) == READERS
    assert all(fresh >= FRESH for fresh, _wrong, _backwards in results), results  # they read while it was written
    if writer == "seqlock":
        assert all(wrong == 0 and backwards == 0 for _fresh, wrong, backwards in results), (number, results)
    else:
        assert sum(wrong for _fresh, wrong, _backwards in results) > 0, (number, results)


def test_the_seqlock_refuses_a_payload_that_does_not_fit_and_waits_out_no_writer() -> None:
    memory = bytearray(8 * 4)
    assert _libnuma.seqlock_write(memory, struct.pack("3q", 1, 2, 3)) == 2
    assert _libnuma.seqlock_read(memory, 24, -1) == (2, struct.pack("3q", 1, 2, 3))
    assert _libnuma.seqlock_read(memory, 24, 2) == (2, None)  # unchanged: nothing copied
    with pytest.raises(ValueError, match="do not fit"):
        _libnuma.seqlock_write(memory, struct.pack("4q", 1, 2, 3, 4))
    struct.pack_into("q", memory, 0, 3)  # a writer that stopped in the middle of its write
    with pytest.raises(BlockingIOError):
        _libnuma.seqlock_read(memory, 24, 2)
    assert _libnuma.seqlock_write(memory, struct.pack("q", 9)) == 4  # the next write ends it


@pytest.mark.parametrize("where", PLACES)
def test_a_batch_written_by_a_worker_is_whole_when_the_owner_adopts_it(where: str) -> None:
    """Workers lease slots, fill them with words derived from (slot, generation), and
    send the lease through a pipe; the owner adopts each and checks every word, then
    drops it (the slot is free again, and a worker's next lease of it must see the
    owner done with it). A word of an earlier batch would show another generation."""
    words = 2048  # 16 KiB a batch
    place("writer", where)  # the owner reads the batches
    with numafast.PinnedPool(NODES[0], words * 8, 4, lock="off") as pool:
        handle = pool.share()
        read_end, write_end = os.pipe()
        go_read, go_write = os.pipe()  # the workers start together, once all are forked (slow under TCG)
        children = []
        for _ in range(READERS):
            pid = os.fork()
            if pid == 0:  # a worker
                code = 1
                try:
                    place("reader", where)  # the workers write them
                    view = PoolView(handle)
                    os.close(go_write)  # the parent's end alone: its exit, if it fails first, ends this wait
                    os.read(go_read, 1)
                    deadline = time.monotonic() + SECONDS
                    while time.monotonic() < deadline:
                        lease = view.lease()
                        if lease is None:  # every slot taken: the owner frees them as it adopts
                            time.sleep(0.0002)
                            continue
                        index, generation = lease
                        np.frombuffer(view.slot(index), dtype=np.int64)[:] = index * 1_000_003 + generation
                        os.write(write_end, struct.pack("2q", index, generation))
                    code = 0
                finally:
                    os._exit(code)
            children.append(pid)
        os.close(write_end)
        os.write(go_write, b"x" * READERS)
        os.close(go_write)
        os.close(go_read)
        adopted = bad = 0
        with os.fdopen(read_end, "rb") as messages:
            while message := messages.read(16):
                index, generation = struct.unpack("2q", message)
                slot = pool.adopt(index, generation, words * 8)
                if not (np.frombuffer(slot, dtype=np.int64) == index * 1_000_003 + generation).all():
                    bad += 1
                adopted += 1
                del slot
        gc.collect()
        assert [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children] == [0] * READERS
        assert adopted >= 100 and bad == 0, (adopted, bad)
        assert pool.stats().free == 4
