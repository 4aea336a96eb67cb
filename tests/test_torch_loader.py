"""NumaLoader: the wrapped DataLoader's batches, in node-local pinned memory, from
workers and a pin thread that run on the node.

Where the workers and the pin thread may run is read from the kernel
(sched_getaffinity inside each worker, /proc/self/task/TID/status for the pin
thread); where the batches are, from pagemap and the sysfs memory blocks.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from typing import Any

import pytest

from sysfs_truth import (
    cpuless_nodes_with_memory,
    kib,
    nearest_cpu_nodes,
    node_cpus,
    online_nodes,
    pagemap_nodes,
    parse_list,
    smaps_of,
    task_status,
    thread_policy,
)

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast  # noqa: E402
import numafast.torch  # noqa: E402

NODES = online_nodes()
CPU_NODES = [node for node in NODES if node_cpus(node)]
# The loader's semantics (same batches, exceptions, shutting down) are the same on any
# kernel; the guests run only the placement tests, each DataLoader costing seconds there.
SEMANTICS = pytest.mark.host_only("loader semantics, the same on any kernel; worker processes cost seconds under TCG")


class Numbers(Dataset):  # type: ignore[type-arg]
    """Sample i: a tensor full of i, its index, and where the worker that made it runs."""

    def __init__(self, count: int, size: int = 4096, fail_at: frozenset[int] = frozenset()) -> None:
        self.count, self.size, self.fail_at = count, size, fail_at

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index in self.fail_at:
            raise KeyError(f"sample {index} is broken")
        info = torch.utils.data.get_worker_info()
        return {
            "values": torch.full((self.size,), float(index)),
            "index": index,
            "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "policy": thread_policy(),  # get_mempolicy(2) of the worker's thread
            "seed": getattr(info.dataset, "marker", -1) if info is not None else -1,
        }


def set_marker(worker_id: int) -> None:
    """A user's own worker_init_fn: NumaLoader must still call it."""
    torch.utils.data.get_worker_info().dataset.marker = 1000 + worker_id


def make_loader(dataset: Dataset, **options: Any) -> DataLoader:  # type: ignore[type-arg]
    options = {"batch_size": 3, "num_workers": 2, "shuffle": True, **options}
    return DataLoader(dataset, generator=torch.Generator().manual_seed(7), **options)


def same(left: Any, right: Any) -> bool:
    """Batches equal element by element (where the worker ran aside)."""
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and left.dtype == right.dtype and bool(torch.equal(left, right))
    if isinstance(left, dict):
        keys = [key for key in left if key not in ("pid", "cpus", "policy")]
        return all(same(left[key], right[key]) for key in keys)
    if isinstance(left, (list, tuple)):
        return len(left) == len(right) and all(map(same, left, right))
    return bool(left == right)


def outcomes(iterable: Any) -> list[Any]:
    """Every batch, or ('raised', type, message) where iterating raised."""
    results: list[Any] = []
    iterator = iter(iterable)
    while True:
        try:
            results.append(next(iterator))
        except StopIteration:
            return results
        except Exception as error:  # noqa: BLE001
            results.append(("raised", type(error), str(error)))


def wait_until(condition: Any, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def pin_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "numafast_pin"]


# ---------------------------------------------------------------- the same batches


@SEMANTICS
def test_yields_the_stock_loaders_batches_in_order_pinned_on_the_node() -> None:
    dataset = Numbers(20)
    stock = list(make_loader(dataset))
    loader = numafast.torch.NumaLoader(make_loader(dataset), node=NODES[0])
    assert len(loader) == len(stock) == 7
    ours = list(loader)
    assert len(ours) == len(stock) and all(map(same, stock, ours))
    pools = loader.pools.pools
    assert len(pools) == 2  # 7 batches kept, 4 slots a pool: it grew once
    assert all(any(pool.contains(batch["values"].data_ptr()) for pool in pools) for batch in ours)
    assert all(kib(smaps_of(pool._slots.address)["Locked"]) >= pool.slots * pool.slot_bytes for pool in pools)
    del ours
    gc.collect()
    stats = loader.stats()
    assert sum(s.in_use for s in stats) == 0 and sum(s.acquired for s in stats) == 7


@SEMANTICS
def test_a_consumer_that_keeps_random_earlier_batches_sees_them_unchanged() -> None:
    dataset = Numbers(60, size=2048)
    stock = list(make_loader(dataset))
    loader = numafast.torch.NumaLoader(make_loader(dataset), node=NODES[0], slots=3, prefetch=2)
    chooser = random.Random(1)
    kept: dict[int, Any] = {}
    for position, batch in enumerate(loader):
        if chooser.random() < 0.5:
            kept[position] = batch
        if len(kept) > 5:
            kept.pop(chooser.choice(sorted(kept)))  # let an old one go: its slot is reused
    assert kept and all(same(stock[position], batch) for position, batch in kept.items())
    assert loader.pools.grown > 0  # more batches kept than slots: the pools grew instead of stalling


@SEMANTICS
def test_persistent_workers_give_the_same_batches_every_epoch() -> None:
    dataset = Numbers(9)
    stock = DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True)
    loader = numafast.torch.NumaLoader(DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True))
    expected = list(stock)
    for _epoch in range(2):
        assert all(map(same, expected, list(loader)))


@SEMANTICS
def test_the_datasets_exceptions_come_out_in_their_place_and_iteration_goes_on() -> None:
    dataset = Numbers(15, fail_at=frozenset({4, 11}))
    stock = outcomes(make_loader(dataset, shuffle=False))
    ours = outcomes(numafast.torch.NumaLoader(make_loader(dataset, shuffle=False)))
    raised = [i for i, outcome in enumerate(stock) if isinstance(outcome, tuple)]
    assert raised == [1, 3] and len(ours) == len(stock) == 5
    for left, right in zip(stock, ours):
        if isinstance(left, tuple):
            assert right[:2] == left[:2] == ("raised", KeyError) and "sample" in right[2] and "is broken" in right[2]
        else:
            assert same(left, right)


@SEMANTICS
def test_a_single_process_loader_works_too() -> None:
    dataset = Numbers(7)
    stock = list(DataLoader(dataset, batch_size=2))
    assert all(map(same, stock, numafast.torch.NumaLoader(DataLoader(dataset, batch_size=2))))


# ---------------------------------------------------------------- shutting down


@SEMANTICS
def test_an_early_break_stops_the_pin_thread_and_the_workers() -> None:
    loader = numafast.torch.NumaLoader(make_loader(Numbers(300), num_workers=2))
    workers = set()
    for position, batch in enumerate(loader):
        workers.update(batch["pid"].tolist())
        if position == 3:
            break
    del batch
    assert wait_until(lambda: not pin_threads())
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}/status") for pid in workers)), workers
    gc.collect()
    assert sum(s.in_use for s in loader.stats()) == 0  # the queued batches were let go


@SEMANTICS
def test_dropping_a_half_read_loader_cleans_up() -> None:
    iterator = iter(numafast.torch.NumaLoader(make_loader(Numbers(300))))
    first = next(iterator)
    pool_address = first["values"].data_ptr()
    del iterator, first
    gc.collect()
    assert wait_until(lambda: not pin_threads())
    assert wait_until(lambda: smaps_of(pool_address) == {})  # the pool went with the loader


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("loader", "options", "error", "match"),
    [
        (DataLoader(range(4), pin_memory=True), {}, ValueError, "pin_memory=True: NumaLoader pins itself"),
        ([1, 2], {}, TypeError, "wraps a torch.utils.data.DataLoader"),
        (DataLoader(range(4)), {"prefetch": 0}, numafast.InvalidSizeError, "prefetch must be a positive integer"),
        (DataLoader(range(4)), {"slots": -1}, numafast.InvalidSizeError, "slots must be"),
        (DataLoader(range(4)), {"node": 99}, numafast.InvalidNodeError, "node 99 does not exist"),
        (DataLoader(range(4)), {"device": "meta"}, ValueError, "copies to a CUDA device"),
    ],
)
def test_bad_arguments_are_refused_by_name(loader: Any, options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        numafast.torch.NumaLoader(loader, **options)


def test_a_cuda_device_without_cuda_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the device path is tested in test_pool_cuda.py")
    with pytest.raises(numafast.CudaUnavailable, match="device 'cuda:0': this PyTorch .* without CUDA|no CUDA device"):
        numafast.torch.NumaLoader(DataLoader(range(4)), device="cuda:0")


# ---------------------------------------------------------------- placement


def check_placement(node: int, *, workers: int) -> None:
    """A NumaLoader on ``node``: where its workers and pin thread may run, what memory
    policy the workers have, and where its batches are, all asked of the kernel."""
    cpus = sorted(cpu for near in nearest_cpu_nodes(node) for cpu in node_cpus(near))
    loader = DataLoader(Numbers(6, size=2048), batch_size=2, num_workers=workers, worker_init_fn=set_marker)
    iterator = iter(numafast.torch.NumaLoader(loader, node=node))
    first = next(iterator)
    # The pin thread is alive until it has queued the end: the queue (2) is full before that.
    thread_cpus = parse_list(task_status(iterator.pin_thread_id)["Cpus_allowed_list"])  # type: ignore[attr-defined]
    assert thread_cpus == cpus, (node, thread_cpus)
    batches = [first, *iterator]
    assert len(batches) == 3 and loader.worker_init_fn is set_marker  # put back once the workers started
    for batch in batches:
        assert batch["seed"].tolist() in ([1000, 1000], [1001, 1001])  # the user's worker_init_fn ran too
        assert all(row == cpus for row in _per_sample(batch["cpus"])), (node, batch["cpus"])
        modes = batch["policy"][0].tolist()
        nodes = _per_sample(batch["policy"][1])
        assert modes == [numafast._libnuma.MPOL_PREFERRED] * 2 and nodes == [[node], [node]], batch["policy"]
        assert set(pagemap_nodes(batch["values"].data_ptr(), batch["values"].nbytes)) == {node}


def _per_sample(collated_cpus: Any) -> list[list[int]]:
    """default_collate turns each sample's CPU list into columns of tensors: rows back."""
    return [list(row) for row in zip(*[column.tolist() for column in collated_cpus])]


def test_workers_and_the_pin_thread_run_on_the_node_here() -> None:
    check_placement(NODES[0], workers=2)


@pytest.mark.numa(nodes=4)
def test_workers_and_the_pin_thread_run_on_each_node() -> None:
    for node in CPU_NODES:
        check_placement(node, workers=1)


@pytest.mark.numa(nodes=3, memory_only=True)
def test_a_memory_only_node_is_fed_from_its_nearest_cpus() -> None:
    for node in cpuless_nodes_with_memory():
        check_placement(node, workers=1)
