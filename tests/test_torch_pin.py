"""numafast.torch.pin and the pin_memory hook: nested batches copied into one pool slot.

The pages of a pinned batch are asked of the kernel (pagemap + sysfs memory blocks).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import threading
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest

from sysfs_truth import PAGE_SIZE, node_cpus, online_nodes, pagemap_nodes, parse_list, task_status

torch = pytest.importorskip("torch")

import numafast  # noqa: E402
import numafast.torch  # noqa: E402
from numafast.torch.batch import flatten  # noqa: E402
from numafast.torch.message import PIN_THREAD_NAME, Fallback, FallbackReason, SlotBatch  # noqa: E402
from numafast.torch.hook import PinMemoryHook  # noqa: E402
from numafast.torch.slot import ALIGNMENT  # noqa: E402

NODES = online_nodes()
MIB = 1 << 20
Pair = namedtuple("Pair", ["image", "label"])


@dataclasses.dataclass
class Sample:
    pixels: Any
    meta: dict[str, Any]
    count: int = 0


@dataclasses.dataclass(frozen=True)
class Frozen:
    values: Any


def a_batch() -> dict[str, Any]:
    image = torch.randn(4, 3, 8, 8)
    return {
        "image": image,
        "again": image,  # the same tensor twice: pinned once
        "labels": [torch.arange(4), "text", 3.5, None],
        "pair": Pair(torch.ones(2, dtype=torch.bool), torch.tensor(7)),
        "sample": Sample(torch.randn(5, 6).t(), OrderedDict(ids=torch.tensor([1, 2], dtype=torch.int16)), 2),
        "frozen": Frozen((torch.randn(3, dtype=torch.complex64).conj(), np.arange(3))),
        "half": torch.randn(7, dtype=torch.bfloat16),
        "empty": torch.empty(0, 5),
    }


def tensors_equal(left: Any, right: Any) -> bool:
    if isinstance(left, torch.Tensor):
        return (
            isinstance(right, torch.Tensor) and left.dtype == right.dtype and left.shape == right.shape
            and bool(torch.equal(left.resolve_conj(), right.resolve_conj()))
        )  # fmt: skip
    if isinstance(left, dict):
        return type(left) is type(right) and left.keys() == right.keys() and all(tensors_equal(left[k], right[k]) for k in left)
    if isinstance(left, (list, tuple)):
        return type(left) is type(right) and len(left) == len(right) and all(map(tensors_equal, left, right))
    if dataclasses.is_dataclass(left):
        fields = [f.name for f in dataclasses.fields(left)]
        return type(left) is type(right) and all(tensors_equal(getattr(left, f), getattr(right, f)) for f in fields)
    if isinstance(left, np.ndarray):
        return isinstance(right, np.ndarray) and left.dtype == right.dtype and bool(np.array_equal(left, right))
    return bool(left == right or left is right)


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def nodes_of(tensor: torch.Tensor) -> set[int | None]:
    return set(pagemap_nodes(tensor.data_ptr(), tensor.numel() * tensor.element_size()))


@pytest.fixture
def pool() -> Any:
    with numafast.PinnedPool(NODES[0], MIB, 3) as made:
        yield made


def test_pin_keeps_the_structure_and_values_and_puts_every_tensor_in_one_slot(pool: Any) -> None:
    batch = a_batch()
    pinned = numafast.torch.pin(batch, pool)
    assert tensors_equal(batch, pinned)
    assert pinned["again"] is pinned["image"]  # one copy for the one tensor
    assert pinned["labels"][1:] == ["text", 3.5, None]
    assert pool.contains(address_of(pinned["frozen"].values[1]))  # NumPy arrays are pinned too
    assert pinned["sample"].count == 2 and isinstance(pinned["sample"].meta, OrderedDict)
    tensors = [t for t in flatten(pinned)[0] if t.numel()]
    assert address_of(pinned["frozen"].values[1]) % ALIGNMENT == 0
    assert all(pool.contains(t.data_ptr()) for t in tensors)
    assert all(t.data_ptr() % ALIGNMENT == 0 for t in tensors)
    assert len({pool._slots.index_of(t.data_ptr()) for t in tensors}) == 1
    # Dense tensors keep their strides, as with Tensor.pin_memory(): the transposed one too.
    assert pinned["sample"].pixels.shape == (6, 5) and pinned["sample"].pixels.stride() == (1, 6)
    assert all(t.is_contiguous() for t in tensors if t is not pinned["sample"].pixels)
    assert pool.stats().in_use == 1
    # Each tensor has a storage of its own bytes, not the whole slot's.
    assert pinned["half"].untyped_storage().nbytes() == 7 * 2
    del pinned, tensors
    gc.collect()
    assert pool.stats().in_use == 0


def test_the_slot_stays_while_any_tensor_of_the_batch_lives(pool: Any) -> None:
    pinned = numafast.torch.pin({"a": torch.ones(1000), "b": torch.zeros(10)}, pool)
    kept = pinned["b"]
    del pinned
    assert pool.stats().in_use == 1
    other = numafast.torch.pin({"a": torch.full((1000,), 5.0)}, pool)  # another slot
    assert bool((kept == 0).all()) and bool((other["a"] == 5).all())
    del kept
    assert pool.stats().in_use == 1


def test_a_batch_without_tensors_takes_no_slot(pool: Any) -> None:
    batch = {"names": ["a", "b"], "n": 2}
    assert numafast.torch.pin(batch, pool) is batch
    assert pool.stats().acquired == 0


def test_big_batches_are_copied_by_several_threads_alike(pool: Any) -> None:
    with numafast.PinnedPool(NODES[0], 40 * MIB, 1) as big:
        batch = [torch.randn(5 * MIB), torch.randint(0, 255, (3 * MIB + 17,), dtype=torch.uint8)]
        for threads in (None, 1, 2):
            pinned = numafast.torch.pin(batch, big, threads=threads)
            assert tensors_equal(batch, pinned)
            del pinned


def test_a_batch_larger_than_a_slot_names_both_sizes(pool: Any) -> None:
    with pytest.raises(numafast.SlotTooSmallError, match=r"the batch needs 4194816 bytes \(2 tensors.*holds 1048576 bytes"):
        numafast.torch.pin([torch.zeros(1), torch.zeros(MIB)], pool)
    assert pool.stats().in_use == 0


def test_leaves_pin_cannot_see_into_are_named_once(pool: Any) -> None:
    class Opaque:
        def __init__(self) -> None:
            self.tensor = torch.ones(3)

    with pytest.warns(RuntimeWarning, match=r"pin\(\) leaves .*Opaque where they are") as said:
        pinned = numafast.torch.pin({"x": torch.ones(2), "other": Opaque()}, pool)
    assert pool.contains(pinned["x"].data_ptr()) and pinned["other"] is not None
    assert [warning.filename for warning in said] == [__file__]  # the caller's line


def test_numpy_arrays_pin_cannot_place_are_named_once(pool: Any) -> None:
    # Arrays of objects or of fields were left where they were without a word.
    fields, objects = np.zeros(4, dtype=[("a", "f4"), ("b", "i8")]), np.array(["a", None], dtype=object)
    with pytest.warns(RuntimeWarning, match=r"pin\(\) leaves numpy.ndarray of dtype \[\('a', '<f4'\), \('b', '<i8'\)\], "
                      r"numpy.ndarray of dtype object where they are: it places tensors and NumPy arrays of plain "
                      r"numbers") as said:
        pinned = numafast.torch.pin({"x": np.ones(3), "fields": fields, "objects": objects}, pool)
    assert pool.contains(pinned["x"].ctypes.data) and pinned["fields"] is fields and pinned["objects"] is objects
    assert [warning.filename for warning in said] == [__file__]


def test_pin_refuses_what_is_not_a_pool() -> None:
    with pytest.raises(TypeError, match="pin\\(\\) copies into a numafast.PinnedPool, not a dict"):
        numafast.torch.pin([torch.ones(2)], {})  # type: ignore[arg-type]


def test_tensors_that_cannot_be_pinned_are_refused(pool: Any) -> None:
    with pytest.raises(numafast.InvalidBufferError, match="tensor 0 of the batch is torch.sparse_coo"):
        numafast.torch.pin({"x": torch.eye(3).to_sparse()}, pool)
    # Was torch's "Internal error: NestedTensorImpl doesn't support sizes".
    with pytest.raises(numafast.InvalidBufferError, match="tensor 0 of the batch is a nested tensor: only dense"):
        numafast.torch.pin({"x": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, pool)
    with pytest.raises(numafast.PoolClosedError):
        closed = numafast.PinnedPool(NODES[0], 4096, 1)
        closed.close()
        numafast.torch.pin([torch.ones(3)], closed)
    with pytest.raises(numafast.InvalidSizeError, match="threads must be a positive integer, not 0"):
        numafast.torch.pin([torch.ones(3)], pool, threads=0)
    assert numafast.torch.pin([torch.ones(3)], pool, threads=np.int64(2))[0].tolist() == [1.0, 1.0, 1.0]  # NumPy's ints too


# ---------------------------------------------------------------- the pin_memory hook


def test_the_hook_installs_nothing_where_torch_does_not_pin() -> None:
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, pin_memory=True)
    collate = loader.collate_fn
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is here: the hook installs (tested in test_pool_cuda.py)")
    with pytest.warns(RuntimeWarning, match="pin_memory_hook installs nothing: PyTorch finds no accelerator") as caught:
        hook = numafast.torch.pin_memory_hook(loader)
    assert len(caught) == 1
    assert not hook.installed and "no accelerator" in hook.reason and loader.collate_fn is collate
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_hook_refuses_loaders_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="pin_memory=False: use numafast.torch.NumaLoader"):
        numafast.torch.pin_memory_hook(torch.utils.data.DataLoader(list(range(4))))
    with pytest.raises(TypeError, match="takes a torch.utils.data.DataLoader"):
        numafast.torch.pin_memory_hook([1, 2, 3])  # type: ignore[arg-type]


def iterate_as_torch_pin_thread(loader: Any) -> tuple[list[Any], list[int]]:
    """Iterate ``loader`` in a thread with the name of PyTorch's pin thread: the thread
    that, with pin_memory=True, takes each worker's message off the result queue and
    so unpickles it (torch pins only where an accelerator exists: here the thread
    stands in for it)."""
    out: list[Any] = []
    tid: list[int] = []

    def pin_thread() -> None:
        torch.multiprocessing._set_thread_name(PIN_THREAD_NAME)
        tid.append(threading.get_native_id())
        out.extend(loader)
        done.set()
        stop.wait()  # stay alive while the test looks at this thread

    stop, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=pin_thread)
    thread.start()
    done.wait(120)
    cpus = parse_list(task_status(tid[0])["Cpus_allowed_list"])
    stop.set()
    thread.join()
    return out, cpus


@pytest.mark.parametrize("node", NODES)
def test_hooked_batches_land_in_slots_in_the_pin_thread_bound_to_the_node(node: int) -> None:
    if not node_cpus(node):
        pytest.skip(f"node {node} has no CPUs for a pin thread (covered by the pool tests)")
    dataset = [torch.full((64, 1024), float(i)) for i in range(6)]
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=1)
    own_collate = loader.collate_fn
    hook = PinMemoryHook(loader, node, None, slots=4, installed=True, reason="")  # what pin_memory_hook makes
    assert hook.pools is not None
    first, _cpus = iterate_as_torch_pin_thread(loader)  # no pool yet: the owner's copy of the first batch makes it
    before = hook.pools.stats()
    # The batches collated before the pool was listed (prefetch_factor x num_workers at most) are copied in.
    assert before.batches == 3 and 1 <= before.copied <= 2 and before.landed == 3 - before.copied, before
    assert set(before.fallbacks) == {"first batches"}, before
    del first
    pinned, cpus = iterate_as_torch_pin_thread(loader)  # the pool's slots again
    assert cpus == node_cpus(node)  # the pin thread bound itself to the node
    stats = hook.pools.stats()
    # nothing copied: the batches were already there
    assert stats.bytes_copied == before.bytes_copied and stats.landed == before.landed + 3
    for index, batch in enumerate(pinned):
        assert isinstance(batch, torch.Tensor)
        assert bool((batch[0] == 2 * index).all()) and bool((batch[1] == 2 * index + 1).all())
        assert nodes_of(batch) == {node}
        assert hook.pools.holds(batch.data_ptr())
    hook.remove()
    assert not hook.installed and loader.collate_fn is own_collate


@pytest.mark.host_only("object lifetimes: nothing the kernel's nodes change; a worker costs seconds under TCG")
def test_a_hooked_loader_and_its_pools_go_once_the_user_drops_them() -> None:
    """A hooked DataLoader is freed with its dataset once the user drops it and the hook,
    and its pools go idle (for the next loader on the node): nothing of numafast keeps
    them (the pools held the hook, which held the loader, whose collate function's end
    is what lets the pools go: a cycle rooted in the finalizer, never freed)."""
    import weakref

    loader = torch.utils.data.DataLoader([torch.full((64, 1024), float(i)) for i in range(6)], batch_size=2,
                                         num_workers=1)  # fmt: skip
    hook = PinMemoryHook(loader, 0, None, slots=4, installed=True, reason="")
    pools = hook.pools
    assert pools is not None
    batches, _cpus = iterate_as_torch_pin_thread(loader)
    assert [batch[:, 0, 0].tolist() for batch in batches] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    gone = weakref.ref(loader)
    del loader, hook, batches
    gc.collect()
    assert gone() is None, "the hooked DataLoader outlived every reference of the user's"
    assert pools.users == 0  # let go: idle, for the next loader on node 0


@pytest.mark.host_only("a count of the pools' slots: nothing the kernel's nodes change; a worker costs seconds under TCG")
def test_the_hooks_held_count_leaves_out_only_the_batches_the_dataloader_reads_ahead() -> None:
    """``held`` is the slots in use beyond prefetch_factor x num_workers (2 here), whatever
    ``slots`` the hook was given: 3 kept batches, 1 beyond what the DataLoader may hold."""
    loader = torch.utils.data.DataLoader([torch.full((64, 1024), float(i)) for i in range(6)], batch_size=2,
                                         num_workers=1)  # fmt: skip
    hook = PinMemoryHook(loader, 0, None, slots=8, installed=True, reason="")
    assert hook.pools is not None
    iterate_as_torch_pin_thread(loader)  # the first epoch's first batches make the pool
    landed = hook.pools.stats().landed
    kept, _cpus = iterate_as_torch_pin_thread(loader)
    stats = hook.pools.stats()
    assert len(kept) == 3 and stats.landed == landed + 3 and sum(pool.in_use for pool in stats.pools) == 3, stats
    assert stats.held == 1, stats
    hook.remove()


def test_a_message_stays_a_message_in_another_process_and_is_its_batch_where_its_pools_are_gone() -> None:
    """Unpickled in a process that does not own its pools, a worker's message is not turned
    into a batch: it can travel on, and says what it is. In its owner's process once the
    pools are gone, a batch sent the copying way is that batch, never the message."""
    elsewhere = Fallback(os.getpid() + 10**6, 10**9, torch.ones(3), FallbackReason.FIRST_BATCHES)
    other = SlotBatch(os.getpid() + 10**6, 1, 7, 0, 1, 512, b"", ())
    again = pickle.loads(pickle.dumps(elsewhere))
    assert isinstance(again, Fallback) and again.reason is FallbackReason.FIRST_BATCHES
    assert bool((again.batch == torch.ones(3)).all())
    moved = pickle.loads(pickle.dumps(other))
    assert isinstance(moved, SlotBatch) and (moved.inode, moved.nbytes) == (7, 512)
    gone = pickle.loads(pickle.dumps(Fallback(os.getpid(), 10**9, torch.ones(3), FallbackReason.FIRST_BATCHES)))
    assert isinstance(gone, torch.Tensor) and bool((gone == torch.ones(3)).all())


def test_the_hook_checks_its_node_and_device_even_where_it_installs_nothing() -> None:
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, pin_memory=True)
    with pytest.raises(numafast.InvalidNodeError, match="node 99"):
        numafast.torch.pin_memory_hook(loader, node=99)
    # Were taken without a look where torch does not pin.
    with pytest.raises(ValueError, match="device 'bogus' is not a device: give a CUDA device"):
        numafast.torch.pin_memory_hook(loader, device="bogus")
    with pytest.raises(ValueError, match="device 'meta': numafast copies to a CUDA device"):
        numafast.torch.pin_memory_hook(loader, device="meta")
    with pytest.raises(TypeError, match=r"device 1\.5: give a CUDA device"):
        numafast.torch.pin_memory_hook(loader, device=1.5)
    assert loader.collate_fn is torch.utils.data.default_collate


@pytest.mark.numa(nodes=3)
def test_pinned_batches_land_on_every_node() -> None:
    batch = {"x": torch.randn(256, 1024), "y": torch.arange(PAGE_SIZE)}
    for node in NODES:
        with numafast.PinnedPool(node, 2 * MIB, 2) as pool:
            pinned = numafast.torch.pin(batch, pool)
            assert tensors_equal(batch, pinned)
            assert nodes_of(pinned["x"]) == {node} and nodes_of(pinned["y"]) == {node}


@pytest.mark.host_only("10^4 batches: nothing kernel-specific, seconds under TCG")
def test_ten_thousand_pinned_batches_grow_nothing() -> None:
    from test_pool import _process_footprint

    batch = {"images": torch.rand(4, 3, 32, 32), "labels": torch.arange(4), "names": ["a", "b", "c", "d"]}
    with numafast.PinnedPool(NODES[0], 64 << 10, 3) as pool:
        for _ in range(100):
            numafast.torch.pin(batch, pool)
        gc.collect()  # pools of earlier tests' loaders go now, not while this one counts
        before = _process_footprint()
        for _ in range(10_000):
            pinned = numafast.torch.pin(batch, pool)
        after = _process_footprint()
        del pinned
        stats = pool.stats()
    assert stats.acquired == 10_100 and stats.in_use == 0 and stats.peak_in_use == 2
    assert after[1:] == before[1:], (before, after)  # mappings, locked bytes
    assert after[0] - before[0] < 4 * MIB, (before, after)  # resident memory
