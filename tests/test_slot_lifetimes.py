"""Slot lifetimes: a slot is handed out again, and a pool's memory unmapped, only once
nothing reads it any more, whatever a consumer derives from a batch (views, NumPy
arrays, memoryviews, storages, tensors set over its storage, copies sent away); and a
slot is never lost. Checked by content: slots are filled with known values, and what
was kept must still read its own after many later batches reused the other slots.
Anything that might crash runs in a child process, so that the test process survives."""

from __future__ import annotations

import gc
import io
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import numafast
from numafast.pool import pool_of
from numafast.pool_worker import PoolView
from sysfs_truth import online_nodes

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402
from numafast.torch.slot import over_slot  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NODES = online_nodes()
pytestmark = pytest.mark.host_only("slot lifetimes, the same on any kernel; worker processes cost seconds under TCG")
SLOT = 4096
FLOATS = SLOT // 4


class Images(Dataset):  # type: ignore[type-arg]
    """Sample i: a 3x16x16 float32 image filled with i, and i: each batch's values say which it is."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return torch.full((3, 16, 16), float(index)), index


def filled_tensor(pool: numafast.PinnedPool, value: float) -> Any:
    """A float32 tensor over a whole slot of ``pool`` (as a batch's is made), every element ``value``."""
    tensor = over_slot(pool.acquire(), ("t", 0, "float32", (FLOATS,), False))
    tensor.fill_(value)
    return tensor


def reuse_every_free_slot(pool: numafast.PinnedPool, rounds: int = 20) -> None:
    """Hand out every slot that is free, fill it with -1, give it back; ``rounds`` times."""
    for _ in range(rounds):
        taken = []
        while True:
            try:
                taken.append(pool.acquire(timeout=0))
            except numafast.PoolExhaustedError:
                break
        for slot in taken:
            np.asarray(slot).view(np.float32)[:] = -1.0
        del taken


def first_value(kept: Any) -> float:
    """The first number ``kept`` (a tensor, array, memoryview or untyped storage) reads."""
    if isinstance(kept, torch.UntypedStorage):
        return float(torch.empty(0, dtype=torch.float32).set_(kept)[0])
    if isinstance(kept, memoryview):
        return float(np.asarray(kept).reshape(-1)[0])
    return float(np.asarray(kept).reshape(-1)[0])


def _set_over(tensor: Any) -> Any:
    """A new tensor set_() over ``tensor``'s storage, the batch tensor itself then dropped."""
    other = torch.empty(0, dtype=tensor.dtype)
    other.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    return other


DERIVED: dict[str, Callable[[Any], Any]] = {
    "a view": lambda tensor: tensor.view(32, 32),
    "a slice": lambda tensor: tensor[3:],
    "a transpose": lambda tensor: tensor.view(32, 32).t(),
    "detach": lambda tensor: tensor.detach(),
    ".numpy()": lambda tensor: tensor.numpy(),
    "torch.from_numpy(.numpy())": lambda tensor: torch.from_numpy(tensor.numpy()),
    "np.asarray": np.asarray,
    "memoryview(.numpy())": lambda tensor: memoryview(tensor.numpy()),
    "untyped_storage() alone": lambda tensor: tensor.untyped_storage(),
    "set_() over its storage": _set_over,
}


@pytest.mark.parametrize("derive", list(DERIVED), ids=list(DERIVED))
def test_what_a_consumer_derives_from_a_slot_tensor_keeps_the_slot_and_its_values(derive: str) -> None:
    """Whatever is derived from a batch tensor, kept alone (the tensor and its slot object
    dropped), keeps the slot out of the pool: later batches reuse the other slots only,
    and what was kept still reads its own values; the slot comes back once it is gone."""
    with numafast.PinnedPool(NODES[0], SLOT, 3, lock="off") as pool:
        tensor = filled_tensor(pool, 5.0)
        kept = DERIVED[derive](tensor)
        del tensor
        gc.collect()
        assert pool.stats().in_use == 1
        reuse_every_free_slot(pool)
        assert first_value(kept) == 5.0
        del kept
        gc.collect()
        assert pool.stats().in_use == 0 and pool.stats().free == 3


def test_share_memory_and_torch_save_copy_a_slot_tensor_out_and_give_the_slot_back() -> None:
    """share_memory_() moves a batch tensor's values into shared memory of torch's (the slot
    comes back, the values stay); torch.save writes its values, which read the same after
    the slot is reused."""
    with numafast.PinnedPool(NODES[0], SLOT, 1, lock="off") as pool:
        tensor = filled_tensor(pool, 3.0)
        saved = io.BytesIO()
        torch.save(tensor[:8], saved)
        tensor.share_memory_()
        gc.collect()
        assert pool.stats().in_use == 0
        reuse_every_free_slot(pool)
        assert set(tensor.tolist()) == {3.0}
        saved.seek(0)
        assert torch.load(saved).tolist() == [3.0] * 8


LOADER_CHILD = """
import gc, sys
sys.path.insert(0, "tests")
from test_slot_lifetimes import Images, numafast, np, torch, DataLoader
workers, gc_on = int(sys.argv[1]), sys.argv[2] == "on"
if not gc_on:
    gc.disable()
loader = numafast.torch.NumaLoader(DataLoader(Images(), batch_size=4, num_workers=workers), lock="off")
kept = {}
for number, (images, labels) in enumerate(loader):
    if number == 2:  # samples 8..11: every value of image k is 8 + k
        kept = {"images": images, "view": images.view(-1), "slice": images[1:], "numpy": images.numpy(),
                "memoryview": memoryview(images.numpy()), "storage": images.untyped_storage(),
                "labels": labels, "labels numpy": labels.numpy()}
        del images, labels
def reads_its_own():
    images = kept["images"]
    return (all(float(images[k].min()) == float(images[k].max()) == 8 + k for k in range(4))
            and float(kept["view"][0]) == 8 and float(kept["slice"][0, 0, 0, 0]) == 9
            and float(kept["numpy"][3].max()) == 11 and np.asarray(kept["memoryview"])[2, 0, 0, 0] == 10
            and float(torch.empty(0).set_(kept["storage"])[0]) == 8
            and kept["labels"].tolist() == [8, 9, 10, 11] and kept["labels numpy"].tolist() == [8, 9, 10, 11])
print("after the epoch", reads_its_own())
del loader
numafast.torch.close_idle_pools()
for pool in list(numafast.pool._live_pools):
    pool.close()
gc.collect()
print("after the pools closed", reads_its_own())
del kept
gc.collect()
print("released", all(pool.stats().bytes_mapped == 0 for pool in list(numafast.pool._live_pools)))
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("collector", ["on", "off"])
def test_a_kept_batch_reads_its_own_values_after_the_epoch_and_after_its_pools_close(workers: int,
                                                                                      collector: str) -> None:
    """A NumaLoader's batch and what is derived from it, kept through the rest of the epoch
    (every other slot reused), then kept while the loader is dropped and every pool
    closed: it still reads its own values, nothing crashes (a child process), and once
    it is dropped every pool's memory is released; with the garbage collector off too."""
    result = subprocess.run([sys.executable, "-c", LOADER_CHILD, str(workers), collector], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == ["after the epoch True", "after the pools closed True", "released True"], (
        result.stdout, result.stderr[-3000:])


def test_a_released_pool_is_never_taken_for_the_live_pool_now_mapped_where_it_was() -> None:
    """A pool closed with no slot out is unmapped at once, and the kernel maps the next pool
    of its size where it was. The released pool, still referenced, must not claim that
    address: pool_of (record_stream's lookup) would find it rather than the live pool,
    and the live slot's GPU copy would go unrecorded, the slot reused under it."""
    released = []
    for _ in range(4):
        pool = numafast.PinnedPool(NODES[0], SLOT, 2, lock="off")
        pool.close()
        assert pool.stats().bytes_mapped == 0
        released.append(pool)
    with numafast.PinnedPool(NODES[0], SLOT, 2, lock="off") as live:
        slot = live.acquire()
        if not any(pool._slots.address == slot.address for pool in released):
            pytest.skip("the kernel mapped the live pool elsewhere")
        assert not any(pool.contains(slot.address) for pool in released)
        assert pool_of(slot.address) is live
        del slot


def test_a_pool_view_whose_handle_says_larger_slots_than_its_table_is_refused() -> None:
    """A worker maps a pool through its handle, but the pool's own table says where each
    slot ends: a handle that says larger slots (stale, or made by hand) would make a
    leased slot's memory run into the next slot, which the owner holds. Refused by name."""
    with numafast.PinnedPool(NODES[0], SLOT, 2, lock="off") as pool:
        first = pool.acquire()  # slot 0, given back below: the one a worker then leases
        neighbour = filled_tensor(pool, 2.0)  # slot 1, held by the owner
        del first
        handle = pool.share()
        with pytest.raises(ValueError, match=f"{2 * SLOT}-byte slots.*{SLOT}"):
            view = PoolView(replace(handle, slot_bytes=2 * SLOT))
            claimed = view.lease()
            assert claimed is not None and claimed[0] == 0
            memory = view.slot(0)
            memory[:] = b"\xff" * len(memory)  # the worker fills its slot, as far as its memory goes
            view.give_up(*claimed)
        assert set(neighbour.tolist()) == {2.0}
