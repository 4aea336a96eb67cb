"""A pinned pool filled by other processes: slots leased by forked and spawned
processes through the pool's memfd, adopted by the owner without a copy, never
handed out twice, reclaimed from a process that died holding one.

What the other process wrote is read back in the owner; where its pages are, asked
of the kernel (move_pages through pagemap_nodes) from the owner's mapping.
"""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import numafast
from numafast import _libnuma
from numafast.pool_owner import PoolBoard
from numafast.pool_worker import BoardReader, Lease, PoolView, open_shared_file
from sysfs_truth import node_cpus, online_nodes, pagemap_nodes

TESTS = Path(__file__).resolve().parent
NODES = online_nodes()
MIB = 1 << 20


def forked(work: Callable[[], int]) -> int:
    """Fork and run ``work()`` in the child, which exits with what it returns (70 where it
    raised); the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = work()
        finally:
            os._exit(code)
    return pid


def in_child(work: Callable[[], int]) -> int:
    """Fork, run ``work()`` in the child, return its exit status (0 when it returned 0)."""
    _, status = os.waitpid(forked(work), 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_worker_fills_a_slot_that_the_owner_adopts_without_a_copy() -> None:
    with numafast.PinnedPool(NODES[0], MIB, 2) as pool:
        handle = pool.share()
        read, write = os.pipe()

        def worker() -> int:
            view = PoolView(handle)
            lease = view.lease()
            assert lease is not None
            np.frombuffer(view.slot(lease[0]), dtype=np.uint8)[:1000] = 42
            os.write(write, f"{lease[0]} {lease[1]}".encode())
            return 0

        assert in_child(worker) == 0
        index, generation = map(int, os.read(read, 100).split())
        assert pool.stats().leased == 1 and pool.stats().free == 1
        slot = pool.adopt(index, generation, 1000)
        assert set(np.asarray(slot).tolist()) == {42}
        assert set(pagemap_nodes(slot.address, 1000)) == {NODES[0]}
        with pytest.raises(LookupError, match="no longer leased"):
            pool.adopt(index, generation, 1000)  # never twice
        stats = pool.stats()
        assert (stats.in_use, stats.leased, stats.adopted) == (1, 0, 1)
        del slot
        gc.collect()
        assert pool.stats().free == 2
        os.close(read)
        os.close(write)


def test_the_owner_maps_a_slot_a_worker_filled_with_a_fault_per_many_pages_and_a_refill_with_none() -> None:
    """The owner's first adoption of a slot enters pages the worker already wrote into its
    own page tables, and reading every one of them after takes no fault: read-populating
    maps them many to a fault (the kernel's fault-around), where populating them for
    writing took one fault per page (~3.4 ms per 36.75 MiB slot, in the consumer's
    thread, whenever a slot was first used: issue 47). Once a slot is mapped, a batch
    another worker wrote into it again is received and read with no fault at all: a
    receive costs the same at every batch size. Faults are the receiving thread's own,
    as the kernel counts them."""
    pages = 1024
    page = os.sysconf("SC_PAGE_SIZE")
    with numafast.PinnedPool(NODES[0], pages * page, 2, lock="off", register="off", prefault=False) as pool:
        handle = pool.share()

        def filled_by_a_worker(tag: int) -> tuple[int, int]:
            """A slot a worker leased and wrote, each page tagged: a spawned one, as a fork
            would leave this process's own memory copy-on-write (faults of its own)."""
            code = (
                "import sys, numpy as np\n"
                "from numafast.pool_worker import PoolHandle, PoolView\n"
                "*fields, tag, page = map(int, sys.argv[1:])\n"
                "view = PoolView(PoolHandle(*fields))\n"
                "index, generation = view.lease()\n"
                "memory = np.frombuffer(view.slot(index), dtype=np.uint8)\n"
                "memory[::page] = (np.arange(len(memory) // page) + tag) % 251\n"
                "print(index, generation)\n"
            )
            fields = [str(value) for value in vars(handle).values()]
            result = subprocess.run([sys.executable, "-c", code, *fields, str(tag), str(page)], capture_output=True,
                                    text=True, timeout=120, cwd=TESTS.parent)  # fmt: skip
            assert result.returncode == 0, result.stderr
            index, generation = map(int, result.stdout.split())
            return index, generation

        def faults_to_receive_and_read(tag: int, index: int, generation: int) -> int:
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            slot = pool.adopt(index, generation, pages * page)
            tags = np.asarray(slot)[::page].tolist()  # every page read
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
            assert tags == [(number + tag) % 251 for number in range(pages)]  # each page's own, this batch's
            del slot
            gc.collect()
            return faults

        first = filled_by_a_worker(1)
        faults = faults_to_receive_and_read(1, *first)
        # The kernel's fault-around maps 64 KiB a read fault: 16 pages of 4 KiB, 4 of 16 KiB (and
        # on 64 KiB pages one, where there is nothing to gain); slack for the test's own pages.
        per_fault = max(1, (64 << 10) // page)
        assert faults <= pages // per_fault + pages // 8, f"{faults} faults to map and read {pages} pages a worker filled"
        again = filled_by_a_worker(2)
        assert again[0] == first[0]  # the lowest free slot: the same one, refilled
        faults = faults_to_receive_and_read(2, *again)
        assert faults < 8, f"{faults} faults to receive and read {pages} pages refilled in a slot mapped already"


def test_the_process_id_the_batch_path_checks_is_a_forked_childs_own() -> None:
    """numafast._process spares a getpid() system call per check: it must follow fork, or a
    forked child would take its parent's pools for its own."""
    from numafast import _process

    assert _process.pid == os.getpid()
    assert in_child(lambda: 0 if _process.pid == os.getpid() != os.getppid() else 1) == 0


def test_no_process_leases_a_slot_of_a_closed_pool_and_a_lease_from_before_keeps_it() -> None:
    """A worker whose view of the pools is a batch old may lease from a pool its owner
    has just closed: a lease from before the close keeps the pool until its batch is
    adopted and gone; after the close, no slot can be leased (the owner has let the
    memory go, and a batch written there could never be read)."""
    pool = numafast.PinnedPool(NODES[0], MIB, 2)
    handle = pool.share()
    go_read, go_write = os.pipe()
    answer_read, answer_write = os.pipe()

    def worker() -> int:
        view = PoolView(handle)
        lease = view.lease()
        os.write(answer_write, f"{lease[0]} {lease[1]}".encode() if lease else b"none")
        os.read(go_read, 1)  # the owner closes the pool meanwhile
        late = view.lease()
        os.write(answer_write, b"none" if late is None else b"leased")
        return 0

    pid = forked(worker)
    index, generation = map(int, os.read(answer_read, 100).split())
    pool.close()
    assert not pool._slots.drained  # the lease keeps it
    os.write(go_write, b"x")
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert os.read(answer_read, 100) == b"none"  # the free slot was retired at the close
    slot = pool.adopt(index, generation, 10)  # the batch leased before the close is still read
    assert not pool._slots.drained
    del slot
    gc.collect()
    assert pool._slots.drained
    for fd in (go_read, go_write, answer_read, answer_write):
        os.close(fd)


def test_a_spawned_process_maps_the_pool_through_proc() -> None:
    """A process that did not inherit the memfd (spawn, forkserver) opens it as
    /proc/OWNER/fd/N; the inode tells it found the right file."""
    with numafast.PinnedPool(NODES[0], MIB, 2) as pool:
        handle = pool.share()
        code = (
            "import sys, numpy as np\n"
            "from numafast.pool_worker import PoolHandle, PoolView\n"
            "view = PoolView(PoolHandle(*map(int, sys.argv[1:])))\n"
            "index, generation = view.lease()\n"
            "np.frombuffer(view.slot(index), dtype=np.uint8)[:10] = 7\n"
            "print(index, generation)\n"
        )
        fields = [str(value) for value in vars(handle).values()]
        result = subprocess.run([sys.executable, "-c", code, *fields], capture_output=True, text=True, timeout=120,
                                cwd=TESTS.parent)
        assert result.returncode == 0, result.stderr
        index, generation = map(int, result.stdout.split())
        slot = pool.adopt(index, generation, 10)
        assert bytes(slot) == bytes([7] * 10)
        del slot


def test_a_wrong_or_vanished_pool_is_refused_by_name() -> None:
    with numafast.PinnedPool(NODES[0], MIB, 1) as pool:
        handle = pool.share()
    from dataclasses import replace

    with pytest.raises(OSError, match=f"cannot open the node-{NODES[0]} pool of process {os.getpid()}"):
        PoolView(handle)  # closed: its file is gone
    with numafast.PinnedPool(NODES[0], MIB, 1) as pool:
        with pytest.raises(OSError, match=r"inode 1\)"):
            PoolView(replace(pool.share(), inode=1))
    with pytest.raises(ValueError, match="holds no numafast slot table"):
        _libnuma.SlotTable.attach(_libnuma.mmap_anonymous(4096))


def test_looking_for_a_pool_opens_no_file_of_this_process_that_is_not_it(tmp_path: Path) -> None:
    """In a spawned worker, the owner's descriptor number is a file of the worker's own
    (a device, maybe): it is told apart by its inode before anything opens it. The
    kernel's inotify says what was opened."""
    import ctypes
    import errno
    import select

    libc = ctypes.CDLL(None, use_errno=True)
    in_open, in_nonblock = 0x20, os.O_NONBLOCK
    own = tmp_path / "own-file"
    own.write_bytes(b"x")
    fd = os.open(own, os.O_RDONLY)
    watch = libc.inotify_init1(in_nonblock)
    assert watch >= 0, os.strerror(ctypes.get_errno())
    try:
        assert libc.inotify_add_watch(watch, bytes(own), in_open) >= 0, os.strerror(ctypes.get_errno())

        def opened() -> int:
            select.select([watch], [], [], 0.2)
            try:
                return len(os.read(watch, 4096))
            except BlockingIOError as error:
                assert error.errno == errno.EAGAIN
                return 0

        with pytest.raises(OSError, match="cannot open the board"):
            open_shared_file(os.getpid(), fd, os.fstat(fd).st_ino + 1, "the board")
        assert opened() == 0, "a file that is not the pool's was opened"
        os.close(open_shared_file(os.getpid(), fd, os.fstat(fd).st_ino, "the board"))
        assert opened() > 0, "inotify saw no open of the file that is the pool's"
    finally:
        os.close(watch)
        os.close(fd)


def test_a_process_that_dies_holding_a_slot_gives_it_back_through_the_owner() -> None:
    with numafast.PinnedPool(NODES[0], MIB, 2) as pool:
        handle = pool.share()

        def dies_holding_one() -> int:
            assert PoolView(handle).lease() is not None
            os.kill(os.getpid(), 9)
            return 1

        assert in_child(dies_holding_one) == -9
        (index, generation, pid, _started), = pool._slots.table.leases()
        assert pool.stats().leased == 1
        assert pool.reclaim_orphans() == 1
        stats = pool.stats()
        assert (stats.leased, stats.free, stats.reclaimed) == (0, 2, 1)
        with pytest.raises(LookupError):  # a late message about that lease reads nothing
            pool.adopt(index, generation, 10)
        again = pool.acquire()
        assert pool._slots.table.states()[again.index] == _libnuma.SLOT_STATES["held"]
        del again


def test_a_dropped_pool_is_released_though_a_worker_still_leases_a_slot() -> None:
    """Nobody is left to adopt the batch of a dropped pool: its memory goes once no slot
    of the owner's is out, leases or not (a worker's own mapping keeps its slot valid)."""
    pool = numafast.PinnedPool(NODES[0], MIB, 2)
    resources = pool._resources
    assert PoolView(pool.share()).lease() is not None  # as a worker that then died would
    held = pool.acquire()
    del pool
    gc.collect()
    assert resources.fd >= 0 and not resources.region.freed  # the held slot keeps it
    del held
    assert released(resources)  # settled by the main thread at its next Python call: this one


def released(resources: Any) -> bool:
    return resources.fd == -1 and bool(resources.region.freed)


def test_many_processes_claiming_at_once_never_share_a_slot() -> None:
    """Each of 4 processes claims slots as fast as it can, writes its pid over the
    slot, checks it is still there, and gives the slot up: any slot handed out
    twice at once shows another pid."""
    with numafast.PinnedPool(NODES[0], 4096, 3, lock="off") as pool:
        handle = pool.share()

        def claimer() -> int:
            view = PoolView(handle)
            me = np.uint32(os.getpid())
            deadline = time.monotonic() + 60
            for _ in range(3000):
                lease = view.lease()
                while lease is None:  # 4 claimers, 3 slots: another one holds them all now
                    if time.monotonic() > deadline:
                        return 2
                    os.sched_yield()
                    lease = view.lease()
                words = np.frombuffer(view.slot(lease[0]), dtype=np.uint32)
                words[:64] = me
                if not (words[:64] == me).all():
                    return 3
                view.give_up(*lease)
            return 0

        children = []
        for _ in range(4):
            children.append(forked(claimer))
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        assert codes == [0, 0, 0, 0]
        assert pool.stats().free == 3 and pool.stats().leased == 0


def test_the_board_tells_running_processes_about_new_pools() -> None:
    board = PoolBoard()
    go_read, go_write = os.pipe()
    read_once, read_once_write = os.pipe()
    answer_read, answer_write = os.pipe()
    with numafast.PinnedPool(NODES[0], MIB, 1) as first, numafast.PinnedPool(NODES[0], 2 * MIB, 1) as second:
        board.publish([first.share()])

        def watcher() -> int:
            reader = BoardReader(board.handle())
            sizes = [view.handle.slot_bytes for view in reader.pools()]
            os.write(read_once_write, b"x")
            os.read(go_read, 1)  # the owner publishes again meanwhile
            sizes += [view.handle.slot_bytes for view in reader.pools()]
            os.write(answer_write, " ".join(map(str, sizes)).encode())
            return 0

        pid = forked(watcher)
        os.read(read_once, 1)
        board.publish([second.share(), first.share()])
        os.write(go_write, b"x")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.read(answer_read, 100).decode().split() == [str(MIB), str(2 * MIB), str(MIB)]
    board.close()


def test_the_board_is_one_file_only_its_owner_writes_and_a_worker_with_no_free_slot_never_waits() -> None:
    """The board is the only channel between owner and workers (its handle names one
    file, no pipe), and no thread of numafast's serves it. A forked worker sees the pools
    the owner publishes (none, then one, then a larger one: what copying its batches in
    made) at its next read; with every slot leased, its lease returns None at once, not
    after a wait. A child's close leaves the owner's board open; the owner's closes it."""
    threads = {thread.name for thread in threading.enumerate()}
    board = PoolBoard()
    assert list(vars(board.handle())) == ["owner_pid", "fd", "inode"]
    assert {thread.name for thread in threading.enumerate()} == threads
    with numafast.PinnedPool(NODES[0], MIB, 1) as small, numafast.PinnedPool(NODES[0], 2 * MIB, 1) as large:
        answer_read, answer_write = os.pipe()
        go_read, go_write = os.pipe()

        def worker() -> int:
            reader = BoardReader(board.handle())
            seen = [[view.handle.slot_bytes for view in reader.pools()]]
            os.write(answer_write, b"x")
            os.read(go_read, 1)  # the owner publishes one pool
            views = reader.pools()
            seen.append([view.handle.slot_bytes for view in views])
            start = time.monotonic()
            leases = [views[0].lease(), views[0].lease()]
            waited = time.monotonic() - start
            os.write(answer_write, b"x")
            os.read(go_read, 1)  # the owner resizes: the larger pool replaces it
            seen.append([view.handle.slot_bytes for view in reader.pools()])
            with pytest.raises(RuntimeError, match="a forked child cannot publish"):
                board.publish([])
            board.close()  # the child's copy only
            ok = leases[0] is not None and leases[1] is None and waited < 0.1
            return 0 if ok and seen == [[], [MIB], [2 * MIB]] else 1

        pid = forked(worker)
        os.read(answer_read, 1)
        board.publish([small.share()])
        os.write(go_write, b"x")
        os.read(answer_read, 1)
        board.publish([large.share()])
        os.write(go_write, b"x")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        fd = board.fd
        os.fstat(fd)  # still open here after the child's close
        board.close()
        with pytest.raises(OSError):
            os.fstat(fd)
        for end in (answer_read, answer_write, go_read, go_write):
            os.close(end)



def test_a_lease_that_races_a_resize_takes_a_slot_of_the_new_pool() -> None:
    """The owner resizes between a worker's read of the board and its claim: it publishes
    the larger pool, then closes the one listed before, whose free slots retire. The
    claim there fails; the worker reads the board again and leases a slot of the new
    pool, where it used to send its batch the copying way as if every slot were held."""
    board = PoolBoard()
    with numafast.PinnedPool(NODES[0], MIB, 2) as small, numafast.PinnedPool(NODES[0], 2 * MIB, 2) as large:
        board.publish([small.share()])
        claiming_read, claiming_write = os.pipe()
        go_read, go_write = os.pipe()

        def worker() -> int:
            reader = BoardReader(board.handle())
            assert [view.handle.slot_bytes for view in reader.pools()] == [MIB]
            claim = PoolView.lease

            def claim_after_the_resize(view: PoolView) -> tuple[int, int] | None:
                PoolView.lease = claim  # type: ignore[method-assign]
                os.write(claiming_write, b"x")
                os.read(go_read, 1)  # the owner resizes now
                return claim(view)

            PoolView.lease = claim_after_the_resize  # type: ignore[method-assign]
            lease = reader.lease(MIB)
            return 0 if isinstance(lease, Lease) and lease.view.handle.slot_bytes == 2 * MIB else 1

        pid = forked(worker)
        os.read(claiming_read, 1)
        board.publish([large.share()])
        small.close()
        assert small.stats().free == 0  # retired: no worker may lease them
        os.write(go_write, b"x")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert large.stats().leased == 1
        for end in (claiming_read, claiming_write, go_read, go_write):
            os.close(end)
    board.close()

@pytest.mark.numa(nodes=4)
def test_a_worker_on_another_node_writes_into_the_pools_node() -> None:
    """The pool's policy is the file's own (shared policy), and its pages exist before
    any worker writes: a worker running on node 3 fills a node-1 slot on node 1."""
    pool_node, worker_node = 1, 3
    with numafast.PinnedPool(pool_node, 4 * MIB, 2) as pool:
        handle = pool.share()

        def worker() -> int:
            os.sched_setaffinity(0, node_cpus(worker_node))
            with numafast.numa_local(worker_node):
                view = PoolView(handle)
                lease = view.lease()
                assert lease is not None
                np.frombuffer(view.slot(lease[0]), dtype=np.uint8)[:] = 5
                mine = np.frombuffer(view.slot(lease[0]), dtype=np.uint8)
                address = mine.__array_interface__["data"][0]
                return 0 if set(pagemap_nodes(address, 4 * MIB)) == {pool_node} else 4

        assert in_child(worker) == 0
        (index, generation, _pid, _started), = pool._slots.table.leases()
        slot = pool.adopt(index, generation, 4 * MIB)
        assert set(np.asarray(slot)[:: 4096].tolist()) == {5}
        assert set(pagemap_nodes(slot.address, 4 * MIB)) == {pool_node}
        del slot
