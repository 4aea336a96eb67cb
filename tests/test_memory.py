"""numafast.empty/zeros, mbind and migrate on any node count: API, bad input, lifetime.

Where pages are is asked of the kernel through /proc/self/pagemap and sysfs memory
blocks (tests/sysfs_truth.py), never through numafast's own move_pages mirror;
whether memory is still mapped, through /proc/self/maps.
"""

from __future__ import annotations

import gc
import mmap
import random
import threading
import time
import weakref

import numpy as np
import pytest

import numafast
from numafast import _libnuma
from sysfs_truth import PAGE_SIZE, anon_huge_bytes, online_nodes, pagemap_nodes, pinned_to_one_cpu, vma_of

NODE = online_nodes()[0]
MIB = 1 << 20


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def nodes_of(array: np.ndarray) -> set[int | None]:
    return set(pagemap_nodes(address_of(array), array.nbytes))


def whole_page_nodes(array: np.ndarray) -> set[int | None]:
    """Truth for the pages wholly inside ``array`` (those mbind and migrate act on)."""
    start = -(-address_of(array) // PAGE_SIZE) * PAGE_SIZE
    end = (address_of(array) + array.nbytes) // PAGE_SIZE * PAGE_SIZE
    return set(pagemap_nodes(start, end - start))


def backing(array: np.ndarray) -> _libnuma.MappedBuffer:
    """The MappedBuffer under a numafast array (through its .base chain)."""
    base: object = array
    while not isinstance(base, _libnuma.MappedBuffer):
        base = base.obj if isinstance(base, memoryview) else base.base  # type: ignore[attr-defined]
    return base


# ---------------------------------------------------------------- allocation


@pytest.mark.parametrize("hugepages", [True, False])
@pytest.mark.parametrize(("shape", "dtype"), [((3, 5), np.int16), (1, np.uint8), ((512, 1024), np.float32)])
def test_empty_is_c_ordered_writable_zero_and_on_its_node(shape, dtype, hugepages) -> None:  # type: ignore[no-untyped-def]
    array = numafast.empty(shape, dtype, node=NODE, hugepages=hugepages)
    assert array.shape == (shape if isinstance(shape, tuple) else (shape,))
    assert array.dtype == dtype and array.flags.c_contiguous and array.flags.writeable
    assert address_of(array) % PAGE_SIZE == 0
    assert not array.any()
    assert nodes_of(array) == {NODE}  # faulted in already, and on the node
    array[...] = 7
    assert (array == 7).all()


def test_zeros_is_zero_and_default_node_is_the_callers() -> None:
    with pinned_to_one_cpu() as node:
        array = numafast.zeros((256, 256))
    assert array.dtype == np.float64 and not array.any()
    assert nodes_of(array) == {node}


def test_large_allocation_is_aligned_and_backed_by_huge_pages_where_thp_allows() -> None:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off on this kernel")
    array = numafast.empty(8 * MIB, np.uint8, node=NODE)
    assert address_of(array) % (2 * MIB) == 0
    assert anon_huge_bytes(address_of(array)) > 0
    small = numafast.empty(8 * MIB, np.uint8, node=NODE, hugepages=False)
    assert anon_huge_bytes(address_of(small)) == 0


@pytest.mark.parametrize(
    ("shape", "error"),
    [(0, numafast.InvalidSizeError), ((4, 0), numafast.InvalidSizeError), ((-1,), numafast.InvalidSizeError),
     ((2, -3), numafast.InvalidSizeError), ((2.5,), TypeError)],
)  # fmt: skip
def test_empty_rejects_sizes_that_allocate_nothing(shape, error) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match="shape"):
        numafast.empty(shape, node=NODE)


def test_empty_rejects_unknown_nodes_object_dtypes_and_node_with_nodes() -> None:
    with pytest.raises(numafast.InvalidNodeError, match="node 4096 does not exist; nodes here"):
        numafast.empty(10, node=4096)
    with pytest.raises(numafast.InvalidNodeError, match="no node given"):
        numafast.empty(10, nodes=[])
    with pytest.raises(TypeError, match="Python objects"):
        numafast.empty(10, object, node=NODE)
    with pytest.raises(ValueError, match="not both"):
        numafast.empty(10, node=NODE, nodes=[NODE])


def test_size_beyond_free_memory_names_the_node_and_its_free_bytes() -> None:
    free = _libnuma.node_size64(NODE)[1]
    with pytest.raises(numafast.NodeMemoryError, match=rf"node {NODE} has \d+ bytes free") as raised:
        numafast.empty(2 * free + (1 << 30), np.uint8, node=NODE)
    assert isinstance(raised.value, MemoryError)


# ---------------------------------------------------------------- lifetime


def test_a_view_keeps_the_memory_mapped_and_the_last_one_unmaps_it() -> None:
    array = numafast.empty(MIB, np.uint8, node=NODE)
    start = address_of(array)
    view = array[4096:8192]
    del array
    gc.collect()
    assert vma_of(start) is not None
    view[:] = 3
    assert (view == 3).all()
    del view
    assert vma_of(start) is None


def test_many_views_in_random_order_free_once() -> None:
    array = numafast.empty(4 * MIB, np.uint8, node=NODE)
    start, owner = address_of(array), backing(array)
    views: list[object] = [array[i::7] for i in range(50)]
    views += [memoryview(array)[i * 100 :] for i in range(50)]
    views += [np.asarray(memoryview(owner)) for _ in range(50)]
    views += [array.reshape(2, -1).T for _ in range(50)]
    del array, owner
    random.Random(5).shuffle(views)
    while views:
        assert vma_of(start) is not None
        views.pop()
    gc.collect()
    assert vma_of(start) is None


def test_memory_in_a_reference_cycle_is_freed_by_the_cycle_collector() -> None:
    array = numafast.empty(MIB, np.uint8, node=NODE)
    start = address_of(array)
    cycle: list[object] = [array]
    cycle.append(cycle)
    del array, cycle
    gc.collect()
    assert vma_of(start) is None


def test_explicit_free_refuses_while_views_live_then_frees_once() -> None:
    array = numafast.empty(MIB, np.uint8, node=NODE)
    owner, start = backing(array), address_of(array)
    with pytest.raises(BufferError, match="views still use this memory"):
        owner.free()
    assert vma_of(start) is not None and array.sum() == 0
    del array
    gc.collect()
    owner.free()
    assert owner.freed and vma_of(start) is None
    owner.free()  # a second free is a no-op, not a double munmap
    for call in (numafast.page_nodes, lambda buf: numafast.mbind(buf, NODE)):
        with pytest.raises(numafast.InvalidBufferError, match="already freed"):
            call(owner)


def test_threads_allocating_querying_and_dropping_views_never_crash_or_leak() -> None:
    WORKERS, ROUNDS = 5, 12  # noqa: N806
    # Weak references to every MappedBuffer: dead once its memory is unmapped. (Freed
    # addresses are soon reused by other mappings, e.g. the threads' malloc arenas,
    # so /proc/self/maps cannot tell here; the single-threaded tests check it.)
    owners: list[weakref.ref[_libnuma.MappedBuffer]] = []
    errors: list[BaseException] = []
    shared = [numafast.empty(2 * MIB, np.uint8, node=NODE) for _ in range(4)]
    owners += [weakref.ref(backing(a)) for a in shared]
    lock = threading.Lock()
    # Each worker gets views of the shared arrays and drops them as it goes.
    handed = [[a[seed * 10 :] for a in shared for _ in range(5)] for seed in range(WORKERS)]

    def worker(seed: int, mine_views: list[np.ndarray]) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(ROUNDS):
                mine = numafast.empty(rng.choice([4096, 3 * MIB]), np.uint8, node=NODE)
                with lock:
                    owners.append(weakref.ref(backing(mine)))
                view = mine_views.pop(rng.randrange(len(mine_views)))[rng.randrange(1000) :]
                assert numafast.page_nodes(view).keys() <= {NODE}
                numafast.mbind(mine, NODE)
                numafast.migrate(mine, NODE)
                mine[::4096] = 1
                del mine, view
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed, handed[seed])) for seed in range(WORKERS)]
    shared.clear()
    handed.clear()  # the workers now hold the only views of the shared arrays
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    assert not errors, errors
    assert len(owners) == 4 + WORKERS * ROUNDS
    assert [owner() for owner in owners if owner() is not None] == []


def test_closing_an_mmap_races_with_queries_but_never_frees_under_one() -> None:
    region = mmap.mmap(-1, 64 * PAGE_SIZE)
    region.write(b"x" * len(region))
    counted: list[int] = []
    unexpected: list[BaseException] = []

    def query() -> None:
        try:
            for _ in range(2000):
                counted.append(numafast.page_nodes(region).total)
        except numafast.InvalidBufferError:
            return  # closed between two queries: refused cleanly
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            unexpected.append(error)

    thread = threading.Thread(target=query)
    thread.start()
    while not region.closed:
        try:
            region.close()  # BufferError while a query holds the memory
        except BufferError:
            time.sleep(0.0001)
    thread.join()
    assert not unexpected, unexpected
    assert set(counted) <= {64}
    with pytest.raises(numafast.InvalidBufferError, match="closed"):
        numafast.page_nodes(region)


# ---------------------------------------------------------------- mbind and migrate on any buffer


def buffers() -> list[tuple[str, object]]:
    backing_bytes = bytearray(8 * PAGE_SIZE)
    region = mmap.mmap(-1, 8 * PAGE_SIZE)
    return [
        ("ndarray", np.ones(64 * 1024)),
        ("bytearray", bytearray(8 * PAGE_SIZE)),
        ("memoryview", memoryview(backing_bytes)[PAGE_SIZE:]),
        ("mmap", region),
        ("numafast", numafast.empty((16, 1024), np.float32, node=NODE)),
    ]


@pytest.mark.parametrize(("kind", "buf"), buffers())
@pytest.mark.parametrize("mode", ["bind", "preferred", numafast.Mode.INTERLEAVE, "preferred_many"])
def test_mbind_and_migrate_take_every_writable_contiguous_buffer(kind, buf, mode) -> None:  # type: ignore[no-untyped-def]
    memoryview(buf).cast("B")[:] = b"\x01" * memoryview(buf).nbytes
    numafast.mbind(buf, NODE, mode=mode)
    assert numafast.migrate(buf, NODE) == 0  # already there: nothing moved
    view = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    assert whole_page_nodes(view) == {NODE}
    assert (view == 1).all()


def test_mbind_and_migrate_reject_bad_buffers_with_clear_errors() -> None:
    released = memoryview(bytearray(4 * PAGE_SIZE))
    released.release()
    closed = mmap.mmap(-1, PAGE_SIZE)
    closed.close()
    read_only = np.zeros(4 * PAGE_SIZE, np.uint8)
    read_only.flags.writeable = False
    cases = [
        (np.zeros((64, 1024))[:, ::2], "not C-contiguous"),
        (np.zeros((64, 1024)).T, "not C-contiguous"),
        (bytes(4 * PAGE_SIZE), "read-only"),
        (read_only, "read-only"),
        (bytearray(), "empty"),
        (released, "memory of this memoryview is gone"),
        (closed, "memory of this mmap is gone"),
        (bytearray(100), "hold no whole"),
        ([1, 2, 3], "does not expose its memory"),
    ]
    for buf, message in cases:
        for call in (lambda b: numafast.mbind(b, NODE), lambda b: numafast.migrate(b, NODE)):
            with pytest.raises(numafast.InvalidBufferError, match=message):
                call(buf)


def test_mbind_and_migrate_reject_bad_nodes_and_modes() -> None:
    buf = bytearray(4 * PAGE_SIZE)
    with pytest.raises(numafast.InvalidNodeError, match="node 4096 does not exist"):
        numafast.mbind(buf, 4096)
    with pytest.raises(numafast.InvalidNodeError, match="node -1 does not exist"):
        numafast.migrate(buf, -1)
    with pytest.raises(ValueError, match=r"mode 'spread': choose one of bind, interleave, preferred, preferred_many"):
        numafast.mbind(buf, NODE, mode="spread")
    with pytest.raises(ValueError, match=r"mode 'local': choose one of"):
        numafast.mbind(buf, NODE, mode=numafast.Mode.LOCAL)


@pytest.mark.numa(nodes=2)
def test_preferred_takes_exactly_one_node() -> None:
    with pytest.raises(numafast.InvalidNodeError, match="'preferred' takes one node"):
        numafast.mbind(bytearray(4 * PAGE_SIZE), online_nodes()[:2], mode="preferred")


# ---------------------------------------------------------------- the raw mirrors


def test_alloc_onnode_mirrors_libnuma() -> None:
    owner = _libnuma.alloc_onnode(MIB, NODE)
    view = np.frombuffer(owner, dtype=np.uint8)
    assert set(pagemap_nodes(address_of(view), MIB)) == {None}  # numa_alloc_onnode does not touch
    view.fill(9)
    assert nodes_of(view) == {NODE} and (view == 9).all()
    start = owner.address
    del view
    owner.free()
    assert owner.freed and vma_of(start) is None


def test_pretouch_populates_every_page_and_keeps_contents() -> None:
    owner = _libnuma.mmap_anonymous(3 * MIB + PAGE_SIZE, 2 * MIB)
    numafast.mbind(owner, NODE)  # else each thread's pages land on its own node
    view = np.frombuffer(owner, dtype=np.uint8)
    view[-1] = 42
    how = _libnuma.pretouch(owner, sorted(numafast._validate.allowed_cpus()), 2, 2 * MIB)
    assert how in {"madvise(MADV_POPULATE_WRITE)", "a write per page"}
    assert nodes_of(view) == {NODE} and view[-1] == 42 and not view[:-1].any()


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: _libnuma.move_pages(bytearray(PAGE_SIZE * 2), 4000, _libnuma.MPOL_MF_MOVE), "move_pages"),
        (lambda: _libnuma.mbind(bytearray(PAGE_SIZE * 2), 99, [NODE]), "mbind"),
        (lambda: _libnuma.madvise(bytearray(PAGE_SIZE * 2), 12345), "madvise"),
        (lambda: _libnuma.alloc_onnode(1 << 60, NODE), "numa_alloc_onnode"),
    ],
)
def test_failing_calls_raise_libnuma_error_naming_the_call(call, name) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(numafast.LibnumaError) as raised:
        call()
    assert raised.value.call == name
