"""A worker's batch from its collate to the consumer, where something around it fails:
the worker's idle look at the board cannot start (no thread to spare), or the loader's
pools are gone by the time a copied collate function's batches arrive. Every sample is
tagged with its index; every batch is compared with the stock DataLoader's."""

from __future__ import annotations

import gc
import os
import pickle
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402
from numafast.torch.message import SlotBatch  # noqa: E402
from numafast.torch.worker_collate import SlotCollate  # noqa: E402

pytestmark = pytest.mark.host_only("one process's loaders and their workers: nothing the kernel's nodes change")


class Tagged(Dataset):  # type: ignore[type-arg]
    """Sample i: a tensor full of i."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        return torch.full((16,), float(index))


def no_thread_to_spare(worker_id: int) -> None:
    """A worker where no thread can be started for numafast's idle look (a pids limit)."""
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name == "numafast idle pools":
            raise RuntimeError("can't start new thread")
        start(thread)

    threading.Thread.start = refuse  # type: ignore[method-assign]


def values(loader: Any) -> list[Any]:
    """Each batch's sample indices (or what came in its place), nothing of it kept."""
    return [batch[:, 0].tolist() if isinstance(batch, torch.Tensor) else type(batch).__name__ for batch in loader]


def test_a_worker_that_cannot_start_its_idle_look_still_sends_every_batch_and_ends_its_leases() -> None:
    options: dict[str, Any] = {"batch_size": 2, "num_workers": 1, "worker_init_fn": no_thread_to_spare}
    stock = values(DataLoader(Tagged(), **options))
    # The pools exist before the worker's first batch (a gone loader's, taken over): it lands.
    first = numafast.torch.NumaLoader(DataLoader(Tagged(), batch_size=2, num_workers=1))
    assert values(first) == stock
    del first
    gc.collect()
    loader = numafast.torch.NumaLoader(DataLoader(Tagged(), persistent_workers=True, **options))
    assert values(loader) == stock
    assert loader.stats().landed >= 1  # the first batch, at least, landed in its worker
    # Every batch arrived: no slot stays leased to the live (persistent) worker.
    assert sum(pool.leased for pool in loader.stats().pools) == 0
    assert values(loader) == stock


def test_a_copied_collate_functions_batches_reach_the_consumer_after_the_loaders_pools_are_gone() -> None:
    options: dict[str, Any] = {"batch_size": 2, "num_workers": 2}
    stock = values(DataLoader(Tagged(), **options))
    loader = numafast.torch.NumaLoader(DataLoader(Tagged(), **options))
    assert values(loader) == stock
    pickled = pickle.dumps(loader.collate_fn)  # a framework's copy of the loader's settings, unpickled later
    del loader
    gc.collect()
    numafast.torch.close_idle_pools()
    gc.collect()
    copied = pickle.loads(pickled)  # a copy made while the pools live keeps them (test_loader_isolation)
    assert isinstance(copied, SlotCollate) and copied.pools is None
    assert values(DataLoader(Tagged(), collate_fn=copied, **options)) == stock


def test_a_slot_batch_for_pools_gone_from_this_process_is_an_error_not_a_batch() -> None:
    message = SlotBatch(os.getpid(), 1 << 40, 1, 0, 0, 64, b"", worker=0, number=1, sender=os.getpid())
    arrived = pickle.loads(pickle.dumps(message))
    assert isinstance(arrived, torch._utils.ExceptionWrapper)
    with pytest.raises(RuntimeError, match="pools are gone"):
        arrived.reraise()
