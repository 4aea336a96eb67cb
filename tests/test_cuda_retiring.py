"""A loader's pool retired by a resize: its queued batches still reach the consumer
(with ``device=``, each is named to the copy stream through ``record_stream``), and it
is closed and released outside the mutex that every batch's receive takes.

Both are numafast's own bookkeeping, the same with or without a GPU: what a closed
pool accepts, and which lock is held while a pool is released. The end-to-end run with
``device=`` needs a CUDA device and is skipped without one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numafast  # noqa: E402
import numafast.pool  # noqa: E402
import numafast.torch  # noqa: E402
from numafast.pages import local_node  # noqa: E402
from numafast.torch.owner_pools import NodePools  # noqa: E402

SEMANTICS = pytest.mark.host_only("numafast's bookkeeping, the same on any kernel")
BATCH = 4
SMALL = 4096  # float32 values per sample of the first batches: 64 KiB a batch
LARGE_FROM = 4  # batches from this one on are 3x larger: past the first pool's 1.25x headroom


class Varying(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Variable-length samples, each filled with its index."""

    def __len__(self) -> int:
        return 12 * BATCH

    def __getitem__(self, index: int) -> Any:
        length = SMALL * (3 if index // BATCH >= LARGE_FROM else 1)
        return torch.full((length,), float(index))


def expected(number: int) -> list[float]:
    return [float(index) for index in range(number * BATCH, (number + 1) * BATCH)]


def one_by_one(batches: Iterator[Any]) -> Iterator[tuple[int, Any]]:
    """The batches numbered, each dropped before the next is asked for, as a training loop does."""
    number = 0
    while (batch := next(batches, None)) is not None:
        yield number, batch
        del batch
        number += 1


@SEMANTICS
def test_batches_of_a_pool_retired_by_a_larger_batch_are_named_to_the_copy_stream() -> None:
    """The loader with ``device=`` calls record_stream for every batch it copies. A batch
    3x the first retires the pool (the owner resizes it as it copies that batch in) while
    a batch of that pool is still held: it must be accepted (here the pools are not
    registered, so nothing is recorded)."""
    loader = numafast.torch.NumaLoader(Varying(), batch_size=BATCH, num_workers=2, lock="off")
    no_stream = object()  # what the loader passes is its side stream; unregistered pools never use it
    held = []
    for number, batch in one_by_one(iter(loader)):
        assert batch[:, 0].tolist() == expected(number)
        assert all(bool((row == row[0]).all()) for row in batch)
        assert numafast.torch.record_stream(batch, no_stream) == 0
        if number < LARGE_FROM:
            held.append(batch)  # the small batches, held past the large ones
    assert loader.pools.resized >= 1 and loader.stats().batches == 12
    pools = [numafast.pool.pool_of(batch.data_ptr()) for batch in held]
    assert any(pool is not None and pool.closed for pool in pools), "no held batch's pool was retired: the case was not met"
    for number, batch in enumerate(held):
        assert numafast.torch.record_stream(batch, no_stream) == 0  # old code: PoolClosedError
        assert batch[:, 0].tolist() == expected(number)
    del held, pools


@SEMANTICS
def test_a_closed_pool_takes_record_stream_for_its_slots_until_released() -> None:
    pool = numafast.PinnedPool(local_node(), 1 << 16, 2, lock="off")
    slot = pool.acquire()
    pool.close()
    assert not pool.record_stream(slot.address, object())  # unregistered: nothing to record, no PoolClosedError
    del slot
    assert pool.settle()
    assert not pool.record_stream(pool._slots.address, object())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)")
def test_with_a_device_batches_of_varying_size_all_arrive_on_it() -> None:
    loader = numafast.torch.NumaLoader(Varying(), batch_size=BATCH, num_workers=2, device="cuda")
    for number, batch in one_by_one(iter(loader)):
        assert batch.device.type == "cuda"
        assert batch[:, 0].tolist() == expected(number)
        assert bool((batch == batch[:, :1]).all())
    assert loader.stats().batches == 12


# ---------------------------------------------------------------- releasing outside the mutex


@pytest.fixture
def mutex_free_at_release(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[bool], list[NodePools]]]:
    """Every pool made from now on, as it is released (unmapped, its file closed; with
    CUDA also unregistered), has another thread take the watched NodePools' mutex, as
    a batch's receive does: each release records whether it could within 2 s."""
    free: list[bool] = []
    watched: list[NodePools] = []
    release = numafast.pool._Resources.release

    def watching(resources: numafast.pool._Resources) -> None:
        if watched:
            mutex = watched[0]._mutex
            taken = threading.Event()

            def receive() -> None:
                with mutex:
                    taken.set()

            receiver = threading.Thread(target=receive, daemon=True)
            receiver.start()
            free.append(taken.wait(2))
        release(resources)

    monkeypatch.setattr(numafast.pool._Resources, "release", watching)
    yield free, watched


@SEMANTICS
def test_a_pool_retired_by_a_resize_is_released_outside_the_mutex(
    mutex_free_at_release: tuple[list[bool], list[NodePools]],
) -> None:
    free, watched = mutex_free_at_release
    pools = NodePools(local_node(), 2, lock="off")
    watched.append(pools)
    try:
        pools.make_room(1 << 16, more=False)
        small = pools.pools[0]
        pools.make_room(4 * small.slot_bytes, more=False)  # every slot free: the small pool is released at once
        assert free == [True], "a batch's receive waited while the retired pool was released"
        assert pools.resized == 1 and small.stats().bytes_mapped == 0 and not pools.retired
        batch = pools.pin(torch.full((256,), 5.0))  # the pools go on
        assert batch.tolist() == [5.0] * 256
    finally:
        pools.close()


@SEMANTICS
def test_an_added_pool_shrunk_away_is_released_outside_the_mutex(
    mutex_free_at_release: tuple[list[bool], list[NodePools]],
) -> None:
    free, watched = mutex_free_at_release
    pools = NodePools(local_node(), 1, lock="off")
    watched.append(pools)
    try:
        kept = [pools.pin(torch.full((256,), float(index))) for index in range(2)]  # the second needs another pool
        assert len(pools.pools) == 2
        del kept
        assert pools.shrink() == 1
        assert free == [True], "a batch's receive waited while the shrunk pool was released"
        assert len(pools.pools) == 1 and not pools.retired
    finally:
        pools.close()


@SEMANTICS
def test_closing_the_pools_releases_them_outside_the_mutex(
    mutex_free_at_release: tuple[list[bool], list[NodePools]],
) -> None:
    free, watched = mutex_free_at_release
    pools = NodePools(local_node(), 2, lock="off")
    watched.append(pools)
    pools.make_room(1 << 16, more=False)
    pools.close()
    assert free == [True], "a batch's receive waited while the closed pool was released"
