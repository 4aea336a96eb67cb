"""PinnedPool: node-local, page-locked slots, handed out and given back by the extension.

Where the pages are, whether they are locked, shared with workers and private in
forked children is asked of the kernel (pagemap + sysfs memory blocks,
/proc/self/smaps and maps), not of the pool.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import numafast
from numafast import _libnuma
from sysfs_truth import (
    PAGE_SIZE,
    cpuless_nodes_with_memory,
    kib,
    node_cpus,
    online_nodes,
    pagemap_nodes,
    pages_mlocked,
    smaps_of,
    task_status,
)

TESTS = Path(__file__).resolve().parent
NODES = online_nodes()
MIB = 1 << 20


def free_slots(slots: Any) -> int:
    return slots.table.states().count(_libnuma.SLOT_STATES["free"])


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def pool_range(pool: numafast.PinnedPool) -> tuple[int, int]:
    start = pool._slots.address
    return start, pool.slots * pool._slots.table.stride


def run_child(code: str, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` from the checkout, behind ``prefix`` (a command that execs it)."""
    command = [*prefix, sys.executable, "-c", code, *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=TESTS.parent, timeout=300)


# ---------------------------------------------------------------- the memory


def mapped_file(address: int, pid: str = "self") -> str:
    """The file /proc/PID/maps names for the mapping that holds ``address``."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, *fields = line.split(maxsplit=5)
        low, high = (int(part, 16) for part in span.split("-"))
        if low <= address < high:
            return fields[4] if len(fields) > 4 else ""
    return ""


def test_a_pool_is_one_locked_shared_memfd_mapping_on_its_node() -> None:
    node = NODES[0]
    with numafast.PinnedPool(node, 100_000, 5, lock="required", register="off") as pool:
        start, length = pool_range(pool)
        table = _libnuma.slot_table_bytes(5)
        assert length == 5 * (-(-100_000 // PAGE_SIZE) * PAGE_SIZE)
        assert set(pagemap_nodes(start - table, table + length)) == {node}  # faulted in, all of it, on the node
        smaps = smaps_of(start)
        assert kib(smaps["Locked"]) >= table + length, smaps
        flags = smaps["VmFlags"].split()
        assert "sh" in flags and "dc" not in flags, flags  # shared, and forked workers get it too
        assert mapped_file(start) == f"/memfd:numafast-pool-node{node} (deleted)"
        stats = pool.stats()
        assert (stats.bytes_mapped, stats.bytes_locked, stats.bytes_registered) == (table + length,) * 2 + (0,)
        assert stats.lock_possible and stats.lock_note == ""
    assert smaps_of(start) == {}  # unmapped on leaving the block
    assert pool.stats().bytes_mapped == 0 and pool.stats().bytes_locked == 0


def test_a_pool_made_without_prefault_faults_each_slot_in_on_its_node_when_first_handed_out() -> None:
    node = NODES[-1]
    with numafast.PinnedPool(node, 100_000, 3, lock="required", register="off", prefault=False, hugepages=False) as pool:
        start, length = pool_range(pool)
        stride = pool._slots.table.stride
        assert set(pagemap_nodes(start, length)) == {None}  # not a page yet
        assert "lo" in smaps_of(start)["VmFlags"].split()  # locked all the same: each page as it comes
        assert pool.stats().bytes_locked == _libnuma.slot_table_bytes(3) + length
        slot = pool.acquire(50_000)
        first = start + slot.index * stride
        assert pages_mlocked(first, 50_000) and set(pagemap_nodes(first, 50_000)) == {node}  # before any write
        asked = -(-50_000 // PAGE_SIZE) * PAGE_SIZE
        assert set(pagemap_nodes(first + asked, stride - asked)) == {None}  # only as far as asked for
        array = np.asarray(pool.acquire())  # the whole of another slot
        assert pages_mlocked(address_of(array), array.nbytes) and set(pagemap_nodes(address_of(array), array.nbytes)) == {node}
        untouched = ({0, 1, 2} - {slot.index, (address_of(array) - start) // stride}).pop()
        assert set(pagemap_nodes(start + untouched * stride, stride)) == {None}
        del slot, array


def test_lock_off_leaves_the_pages_unlocked() -> None:
    with numafast.PinnedPool(NODES[0], 4096, 2, lock=False, register=False) as pool:
        assert kib(smaps_of(pool_range(pool)[0])["Locked"]) == 0
        stats = pool.stats()
        assert not stats.lock_possible and "off" in stats.lock_note and stats.bytes_locked == 0


# ---------------------------------------------------------------- slots


def test_a_slot_comes_back_when_its_last_array_or_tensor_is_gone() -> None:
    with numafast.PinnedPool(NODES[0], 8192, 2) as pool:
        slot = pool.acquire(1000)
        array = np.asarray(slot)
        assert array.shape == (1000,) and array.dtype == np.uint8 and slot.exports == 1
        assert address_of(array) == slot.address == pool_range(pool)[0]
        view = array[10:20]
        del slot
        assert pool.stats().in_use == 1  # the arrays hold it
        del array
        assert pool.stats().in_use == 1  # the view does
        view[:] = 7
        del view
        assert pool.stats().in_use == 0 and pool.stats().free == 2
        # A memoryview and a whole-slot acquire.
        slot = pool.acquire()
        assert len(memoryview(slot)) == 8192 and slot.capacity == 8192
        del slot
        assert pool.stats().in_use == 0


def test_torch_frombuffer_keeps_the_slot_though_it_drops_its_buffer_export() -> None:
    torch = pytest.importorskip("torch")
    with numafast.PinnedPool(NODES[0], 4096, 1) as pool:
        slot = pool.acquire()
        tensor = torch.frombuffer(slot, dtype=torch.float32)
        assert slot.exports == 0  # torch let go of the export at once
        del slot
        gc.collect()
        assert pool.stats().in_use == 1
        with pytest.raises(numafast.PoolExhaustedError):
            pool.acquire(timeout=0)
        tensor.fill_(1.5)
        del tensor
        assert pool.stats().in_use == 0


def test_slots_are_handed_out_lowest_first_and_reused() -> None:
    with numafast.PinnedPool(NODES[0], 4096, 3) as pool:
        held = [pool.acquire() for _ in range(3)]
        assert [slot.index for slot in held] == [0, 1, 2]
        assert len({slot.address for slot in held}) == 3
        freed = held.pop(1).index
        assert pool.acquire().index == freed


def test_a_full_pool_raises_or_waits_as_configured() -> None:
    with numafast.PinnedPool(NODES[0], 4096, 2, timeout=0) as pool:
        held = [pool.acquire(), pool.acquire()]
        with pytest.raises(numafast.PoolExhaustedError, match="all 2 slots .* in use"):
            pool.acquire()
        started = time.monotonic()
        with pytest.raises(numafast.PoolExhaustedError):
            pool.acquire(timeout=0.2)
        assert time.monotonic() - started >= 0.2
        threading.Timer(0.1, held.pop).start()  # another thread gives one back
        slot = pool.acquire(timeout=30)
        stats = pool.stats()
        # 0.2 s timed out, then most of the timer's 0.1 s (it started before the wait did)
        assert slot.index in (0, 1) and stats.waits == 3 and stats.wait_seconds >= 0.25


def test_stats_add_up_under_threads_that_acquire_and_release() -> None:
    slots, threads, seconds = 6, 4, 1.5
    errors: list[str] = []
    with numafast.PinnedPool(NODES[0], 4096, slots, timeout=None) as pool:
        stop = time.monotonic() + seconds
        done = [0] * threads

        def work(me: int) -> None:
            mark = np.uint8(me + 1)
            while time.monotonic() < stop:
                slot = pool.acquire()
                array = np.asarray(slot)
                array[:] = mark
                time.sleep(0)  # let the others run while this one holds it
                if not (array == mark).all():  # someone else got the same slot
                    errors.append(f"slot {slot.index} was written by another holder")
                del array, slot
                done[me] += 1

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        stats = pool.stats()
    assert not errors, errors[:3]
    assert stats.acquired == sum(done) > threads
    assert stats.in_use == 0 and stats.free == slots and stats.free + stats.in_use + stats.in_flight == stats.slots
    assert stats.peak_in_use == min(threads, slots)


# ---------------------------------------------------------------- the in-flight guard


class Fence:
    """A fence the test completes by hand: the pool's in-flight mechanism, exercised
    without a GPU (the CUDA events behind it are tested in test_pool_cuda.py)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()


def test_a_fenced_slot_is_reused_only_once_its_fence_is_done() -> None:
    fences: list[Fence] = []

    def fence(index: int) -> Fence:
        fences.append(Fence())
        return fences[-1]

    drained = []
    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(2) + 2 * PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 2, fence, lambda: drained.append(True))
    first = slots.acquire(PAGE_SIZE)
    first_index = first.index
    del first  # "a copy still reads it"
    assert (slots.in_use, slots.fenced, free_slots(slots)) == (0, 1, 1)
    other = slots.acquire(PAGE_SIZE)
    assert other.index != first_index  # the fenced one is not handed out
    with pytest.raises(TimeoutError):
        slots.acquire(PAGE_SIZE, 0.05)
    threading.Timer(0.1, fences[0].done.set).start()
    again = slots.acquire(PAGE_SIZE, 30)  # polls the fence, then gets it
    assert again.index == first_index and slots.fenced == 0
    del again, other
    slots.settle()  # records their fences now (else the main thread's next call would)
    fences[1].done.set()
    fences[2].done.set()
    slots.close()  # settles the remaining fences before the memory may go
    assert slots.fenced == 0 and drained == [True]


def test_an_open_pool_frees_a_fenced_slot_for_workers_once_its_fence_is_done() -> None:
    """Workers lease only free slots and never look at fences: the owner frees a fenced
    slot whose copy is done at its next settle (a slot given back queues one) or reap,
    else workers of a loader with a GPU find every slot taken after the first pass."""
    fences: list[Fence] = []

    def fence(index: int) -> Fence:
        fences.append(Fence())
        return fences[-1]

    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(1) + PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 1, fence)
    started = numafast._process.started()
    slots.acquire(PAGE_SIZE)  # dropped at once: a batch dropped while its copy to the GPU still runs
    slots.settle()
    assert slots.fenced == 1 and slots.table.claim(started) is None  # the worker waits for the copy
    fences[0].done.set()
    slots.settle()  # what the next slot given back runs
    lease = slots.table.claim(started)
    assert lease is not None and lease[0] == 0 and slots.fenced == 0
    assert slots.reclaim(*lease, os.getpid())
    slots.adopt(*slots.table.claim(started), PAGE_SIZE)  # a worker's batch, adopted and dropped: fenced again
    slots.settle()  # its fence recorded (by the pending call the drop queued, or here)
    threading.Timer(0.1, fences[1].done.set).start()
    slots.reap(True)  # the owner, making room for a copy: waits for the oldest copy
    assert slots.table.claim(started) is not None and len(fences) == 2 and fences[1].done.is_set()
    slots.close()


def test_a_failing_fence_surfaces_from_acquire_and_leaves_the_pool_usable() -> None:
    class Broken(Fence):
        """Fails every query until mended: CUDA's errors are sticky. (A failure met by
        the settle a slot given back queues is left for acquire to raise.)"""

        broken = True

        def query(self) -> bool:
            if Broken.broken:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return True

    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(1) + PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 1, lambda index: Broken())
    slots.acquire(PAGE_SIZE, 0)  # handed out and given back at once: fenced
    with pytest.raises(RuntimeError, match="illegal memory access"):
        slots.acquire(PAGE_SIZE, 0)
    Broken.broken = False
    again = slots.acquire(PAGE_SIZE, 0)  # the next look finds it done
    assert again.index == 0 and slots.fenced == 0 and slots.in_use == 1


def test_threads_waiting_on_the_same_fences_each_get_a_slot_once() -> None:
    fences: list[Fence] = []

    def fence(index: int) -> Fence:
        fences.append(Fence())
        return fences[-1]

    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(4) + 4 * PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 4, fence)
    for held in [slots.acquire(PAGE_SIZE) for _ in range(4)]:
        del held
    taken: list[Any] = []
    waiters = [threading.Thread(target=lambda: taken.append(slots.acquire(PAGE_SIZE, 30))) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    for done in fences:
        time.sleep(0.02)
        done.done.set()
    for waiter in waiters:
        waiter.join(30)
    assert sorted(slot.index for slot in taken) == [0, 1, 2, 3]
    assert (slots.fenced, slots.in_use, free_slots(slots)) == (0, 4, 0)
    taken.clear()  # given back, fenced again: let those fences be done
    for done in fences:
        done.done.set()


def test_a_slot_dropped_in_another_thread_runs_no_python_in_its_deallocator() -> None:
    """A Slot's deallocator runs in whichever thread drops it (a pin thread, the cycle
    collector): it only marks the slot returned. Recording its fence, asking it (a
    closed pool waits for it) and releasing the memory run in the main thread, outside it."""
    where: dict[str, list[int]] = {"fence": [], "query": [], "drained": []}

    class Recorded(Fence):
        def query(self) -> bool:
            where["query"].append(threading.get_ident())
            return True

    def fence(index: int) -> Fence:
        where["fence"].append(threading.get_ident())
        return Recorded()

    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(1) + PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 1, fence, lambda: where["drained"].append(threading.get_ident()))
    box = [slots.acquire(PAGE_SIZE)]
    slots.close()  # with the slot out: its return waits for its fence, then the memory goes
    dropper = threading.Thread(target=box.clear)
    dropper.start()
    dropper.join()
    slots.settle()  # done already if the main thread ran its pending call
    main = threading.get_ident()
    assert where == {"fence": [main], "query": [main], "drained": [main]}, (where, main, dropper.ident)
    assert slots.drained and slots.in_use == 0 and slots.fenced == 0


def test_a_slot_in_a_reference_cycle_comes_back_and_never_reads_a_cleared_pool() -> None:
    """The cycle collector clears the objects of a cycle in no set order, and a Slot's
    deallocator needs its pool: neither may be cleared before it runs. A slot kept by a
    cycle (a traceback holding a batch) is given back when the cycle goes; a pool in a
    cycle with its own slot does not crash the collector."""
    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(2) + 2 * PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 2)
    slot = slots.acquire(10)
    gc.collect()  # the slot now in an older generation than the cycle that will hold it
    cycle: dict[str, Any] = {"slot": slot}
    cycle["self"] = cycle
    del slot, cycle
    gc.collect()
    assert slots.in_use == 0 and free_slots(slots) == 2  # was: the slot never came back
    pool_in_a_cycle = """
import gc
from numafast import _libnuma
box = {}
page = _libnuma.pagesize()
slots = _libnuma.SlotPool(_libnuma.mmap_anonymous(page * 4), page, 2, None, box.get)
box["slot"] = slots.acquire(10)
del slots, box
gc.collect()
print("collected")
"""
    run = run_child(pool_in_a_cycle)
    assert run.returncode == 0 and run.stdout == "collected\n", (run.returncode, run.stdout, run.stderr)  # was: SIGSEGV


def test_ctrl_c_that_comes_while_the_main_thread_settles_a_pool_is_raised_there() -> None:
    """The settling a returned slot leaves to the main thread runs Python (on_drained):
    a signal whose handler raises there (Ctrl-C; PyTorch's SIGCHLD handler for a dead
    worker) reaches the main thread's code, not a printed unraisable error."""
    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(1) + PAGE_SIZE)
    drained: list[bool] = []

    def ctrl_c_while_draining() -> None:
        drained.append(True)
        signal.raise_signal(signal.SIGINT)  # its handler runs in this Python code

    slots = _libnuma.SlotPool(region, PAGE_SIZE, 1, None, ctrl_c_while_draining)
    box = [slots.acquire(PAGE_SIZE)]
    slots.close()  # with the slot out: the memory goes when it comes back
    # As at a terminal: a runner started in the background hands SIGINT ignored.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            box.clear()  # the slot comes back: settle() is the main thread's next pending call
            for _ in range(1000):  # Python instructions, at one of which the pending call runs
                pass
    finally:
        signal.signal(signal.SIGINT, handler)
    assert drained == [True] and slots.drained


# ---------------------------------------------------------------- closing, exit, fork


def test_close_refuses_new_slots_but_keeps_the_held_ones_until_they_are_gone() -> None:
    pool = numafast.PinnedPool(NODES[0], 4096, 2)
    start = pool_range(pool)[0]
    slot = pool.acquire()
    array = np.asarray(slot)
    del slot
    pool.close()
    pool.close()  # twice is fine
    with pytest.raises(numafast.PoolClosedError, match="closed"):
        pool.acquire()
    with pytest.raises(numafast.PoolClosedError):
        pool.__enter__()
    array[:] = 3  # still mapped: the array holds the slot
    assert smaps_of(start) != {} and pool.stats().bytes_mapped > 0
    del array
    assert smaps_of(start) == {} and pool.stats().bytes_mapped == 0


def test_closing_wakes_a_waiter_with_an_error() -> None:
    pool = numafast.PinnedPool(NODES[0], 4096, 1)
    held = pool.acquire()
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            pool.acquire(timeout=30)
        except BaseException as error:  # noqa: BLE001
            outcome.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    pool.close()
    waiter.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], numafast.PoolClosedError)
    del held


def test_a_dropped_pool_is_released_when_its_last_slot_goes() -> None:
    pool = numafast.PinnedPool(NODES[0], 4096, 2)
    start = pool_range(pool)[0]
    array = np.asarray(pool.acquire())
    del pool
    gc.collect()
    assert smaps_of(start) != {}
    del array
    assert smaps_of(start) == {}


EXIT_CHECK = """
import atexit, sys
sys.path.insert(0, "tests")
from sysfs_truth import kib, smaps_of
def after():  # registered first, so it runs after numafast's own exit hook
    print("locked", kib(smaps_of(start).get("Locked", "0 kB")), "mapped", smaps_of(start) != {}, flush=True)
atexit.register(after)
import numpy, numafast
pool = numafast.PinnedPool(0, 1 << 20, 2)
start = pool._slots.address
kept = numpy.asarray(pool.acquire()) if sys.argv[1:] == ["keep"] else None
"""


@pytest.mark.host_only("a Python child per case: the exit path is the same on any kernel")
@pytest.mark.parametrize(("keep", "expected"), [(False, "locked 0 mapped False"), (True, "locked 0 mapped True")])
def test_interpreter_exit_releases_a_pool_left_open(keep: bool, expected: str) -> None:
    result = run_child(EXIT_CHECK, *(["keep"] if keep else []))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected, result.stdout + result.stderr
    # A slot kept to the end comes back as the interpreter tears its modules down: the
    # settling it asks for must not run then (their globals are None by that time).
    assert result.stderr == "", result.stderr


def test_a_forked_child_reads_the_parents_slots_but_never_writes_or_frees_them() -> None:
    with numafast.PinnedPool(NODES[0], 4096, 2) as pool:
        slot = pool.acquire()
        start = slot.address
        np.asarray(slot)[:] = 7
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            lines = []
            for attempt in (pool.acquire, pool.stats):
                try:
                    attempt()
                    lines.append("worked")
                except numafast.PoolForkedError as error:
                    lines.append(type(error).__name__ + ": " + str(error)[:60])
            inherited = np.asarray(slot)
            lines.append(f"read {inherited[0]} {inherited[-1]}")
            inherited[:] = 9  # lands in the child's private copy
            lines.append(f"wrote {inherited[0]}")
            lines.append(" ".join(smaps_of(start)["VmFlags"].split()))
            del inherited, slot
            pool.close()  # harmless in the child
            gc.collect()
            lines.append("mapped" if smaps_of(start) else "unmapped")
            os.write(write, "\n".join(lines).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            report = pipe.read().splitlines()
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child ended with wait status {status:#x}"
        assert report[0].startswith("PoolForkedError: this pool was made by process"), report
        assert report[1].startswith("PoolForkedError"), report
        assert report[2:4] == ["read 7 7", "wrote 9"], report
        assert "sh" not in report[4].split(), report  # the child's view is private (copy-on-write)
        assert report[5] == "mapped", report  # the child's copies of the pool objects unmap nothing
        assert set(np.asarray(slot).tolist()) == {7}  # the parent's slot is untouched
        assert pool.stats().in_use == 1 and smaps_of(start)["VmFlags"].split().count("sh") == 1
        del slot


def test_a_pool_does_not_pickle_and_says_why() -> None:
    import pickle

    with numafast.PinnedPool(NODES[0], 4096, 1) as pool:
        slot = pool.acquire()
        for thing in (pool, slot):
            with pytest.raises(TypeError, match="pool memory does not travel by pickle.*NumaLoader"):
                pickle.dumps(thing)
        del slot


# ---------------------------------------------------------------- page-locking limits

MEMLOCK_CHILD = """
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
import numafast
try:
    with warnings.catch_warnings(record=True) as caught:
        pool = numafast.PinnedPool(0, 1 << 20, 4, lock=sys.argv[1], prefault=sys.argv[2] == "prefault")
except numafast.MemlockError as error:
    print("MemlockError:", error)
else:
    stats = pool.stats()
    print("pool", stats.bytes_locked, stats.lock_possible, len(caught), caught[0].message if caught else "")
    print("VmLck", open("/proc/self/status").read().split("VmLck:")[1].split()[0])
"""
# As root, CAP_IPC_LOCK ignores RLIMIT_MEMLOCK: drop it, as a container without it would.
WITHOUT_IPC_LOCK = ("setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock")


POOL_BYTES = _libnuma.slot_table_bytes(4) + (4 << 20)  # MEMLOCK_CHILD's: its slot table, then 4 x 1 MiB
MEMLOCK_HOST_ONLY = pytest.mark.host_only("a Python child per case: RLIMIT_MEMLOCK is not NUMA-specific")


@MEMLOCK_HOST_ONLY
@pytest.mark.parametrize("prefault", ["prefault", "on first use"])  # the whole size counts at once either way
def test_required_locking_beyond_the_limit_names_the_limit_and_the_fix(prefault: str) -> None:
    result = run_child(MEMLOCK_CHILD, "required", prefault, prefix=WITHOUT_IPC_LOCK)
    assert result.returncode == 0, result.stderr
    message = result.stdout
    assert message.startswith("MemlockError: page-locking the 4.0 MiB pool on node 0 failed"), message
    assert "may lock 64.0 KiB in all (RLIMIT_MEMLOCK; hard limit 64.0 KiB; no CAP_IPC_LOCK)" in message
    short_kib = -(-POOL_BYTES // 1024) - 64
    assert f", {short_kib} KiB short." in message, message  # nothing else locked: the pool less the limit
    # Past the hard limit: what only root or an administrator can do, not `ulimit -l unlimited`, which fails here.
    assert "only root or an administrator" in message and "--ulimit memlock=-1" in message and "ulimit -S" not in message
    assert "best-effort" in message


def gpu_usable() -> bool:
    """Whether PyTorch is here and sees a CUDA device: where lock='auto' locks."""
    try:
        from numafast import cuda
    except ImportError:
        return False
    return cuda.usable()


@MEMLOCK_HOST_ONLY
@pytest.mark.parametrize("mode", ["best-effort", "auto"])  # auto: as best-effort where a GPU is usable
def test_best_effort_locking_warns_once_and_goes_on_unlocked(mode: str) -> None:
    if mode == "auto" and not gpu_usable():
        pytest.skip("lock='auto' locks only where a GPU is usable (test_lock_auto_without_a_gpu_...)")
    result = run_child(MEMLOCK_CHILD, mode, "prefault", prefix=WITHOUT_IPC_LOCK)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.startswith("pool 0 False 1 page-locking the 4.0 MiB pool"), first
    assert "only root or an administrator" in first and "lock='off'" in first
    assert "best-effort" not in first  # no advice to pass what was passed, or is the default already
    assert second == "VmLck 0", second  # nothing half-locked


@MEMLOCK_HOST_ONLY
def test_lock_auto_without_a_gpu_locks_nothing_and_says_nothing() -> None:
    """Without a usable GPU (or without torch imported: a pool never imports it),
    page-locking buys nothing: lock='auto' does not try, so a limit too low is no
    warning (old code: a MemlockWarning advising `ulimit -l unlimited`)."""
    if gpu_usable():
        pytest.skip("a usable GPU here: lock='auto' locks (test_best_effort_locking_warns_once_...[auto])")
    with_torch = "import numafast\ntry:\n    import torch\nexcept ImportError:\n    pass\n"  # as a user's script would
    result = run_child(MEMLOCK_CHILD.replace("import numafast\n", with_torch), "auto", "prefault",
                       prefix=WITHOUT_IPC_LOCK)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["pool 0 False 0 ", "VmLck 0"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0, 0, 4), {}, numafast.InvalidSizeError, "slot_bytes must be a positive integer, not 0"),
        ((0, -5, 4), {}, numafast.InvalidSizeError, "slot_bytes"),
        ((0, 4096, 0), {}, numafast.InvalidSizeError, "slots must be a positive integer, not 0"),
        ((0, 4096, True), {}, numafast.InvalidSizeError, "slots"),
        ((0, 4096.0, 2), {}, numafast.InvalidSizeError, "slot_bytes"),
        ((999, 4096, 2), {}, numafast.InvalidNodeError, "node 999 does not exist; nodes here"),
        (("0", 4096, 2), {}, numafast.InvalidNodeError, "not an integer node id"),
        ((0, 4096, 2), {"lock": "sometimes"}, ValueError, "lock='sometimes': choose one of 'auto', 'required'"),
        ((0, 4096, 2), {"register": "maybe"}, ValueError, "register='maybe'"),
        ((0, 4096, 2), {"timeout": -1}, ValueError, "timeout must be None"),
        ((0, 1 << 50, 2), {}, numafast.NodeMemoryError, "node 0 has .* bytes free"),
    ],
)
def test_bad_pool_arguments_are_refused_by_name(args: tuple, kwargs: dict, error: type, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(error, match=match):
        numafast.PinnedPool(*args, **kwargs)


def test_register_required_without_cuda_says_why() -> None:
    try:
        import torch
    except ImportError:  # the Pythons CI tests without torch
        why = "register='required' needs PyTorch with CUDA: "
    else:
        if torch.cuda.is_available():
            pytest.skip("CUDA is here: registration is tested in test_pool_cuda.py")
        why = "register='required', but CUDA is not usable here: "
    with pytest.raises(numafast.CudaUnavailable, match=f"^{re.escape(why)}"):
        numafast.PinnedPool(NODES[0], 4096, 1, register="required")


def test_bad_acquire_arguments_are_refused_by_name() -> None:
    with numafast.PinnedPool(NODES[0], 4096, 1) as pool:
        with pytest.raises(numafast.SlotTooSmallError, match="5000 bytes asked for, but a slot of this pool holds 4096"):
            pool.acquire(5000)
        with pytest.raises(numafast.InvalidSizeError, match="non-negative"):
            pool.acquire(-1)
        with pytest.raises(ValueError, match="timeout"):
            pool.acquire(timeout=-2)
        assert pool.stats().in_use == 0


# ---------------------------------------------------------------- no leaks over many batches


def _process_footprint() -> tuple[int, int, int]:
    status = task_status()
    mappings = len(Path("/proc/self/maps").read_text().splitlines())
    return kib(status["VmRSS"].strip()), mappings, kib(status["VmLck"].strip())


@pytest.mark.host_only("10^4 batches: nothing kernel-specific, seconds under TCG")
def test_ten_thousand_batches_grow_nothing() -> None:
    with numafast.PinnedPool(NODES[0], 64 << 10, 4) as pool:
        source = np.arange(16 << 10, dtype=np.float32)
        for _ in range(100):  # warm up allocator caches
            np.asarray(pool.acquire()).view(np.float32)[:] = source
        before = _process_footprint()
        for _ in range(10_000):
            np.asarray(pool.acquire()).view(np.float32)[:] = source
        after = _process_footprint()
        stats = pool.stats()
    assert stats.acquired == 10_100 and stats.in_use == 0 and stats.peak_in_use == 1
    assert after[1:] == before[1:], (before, after)  # mappings, locked bytes
    assert after[0] - before[0] < 4 * MIB, (before, after)  # resident memory


# ---------------------------------------------------------------- on every node (guests)


@pytest.mark.numa(nodes=3)
def test_every_node_gets_a_pool_of_its_own_locked_pages() -> None:
    for node in NODES:  # the memory-only node included, in that guest
        with numafast.PinnedPool(node, 3 * MIB, 2, lock="required", hugepages=False) as pool:
            start, length = pool_range(pool)
            assert set(pagemap_nodes(start, length)) == {node}, node
            assert kib(smaps_of(start)["Locked"]) == _libnuma.slot_table_bytes(2) + length  # the table too
            array = np.asarray(pool.acquire())
            array[:] = 1
            assert set(pagemap_nodes(address_of(array), array.nbytes)) == {node}


@pytest.mark.numa(nodes=3, memory_only=True)
def test_a_pool_on_a_memory_only_node_is_filled_from_the_nearest_cpus() -> None:
    for node in cpuless_nodes_with_memory():
        with numafast.PinnedPool(node, MIB, 2) as pool:
            assert pool.cpus and not set(pool.cpus) & set(node_cpus(node))
            assert set(pagemap_nodes(*pool_range(pool))) == {node}
