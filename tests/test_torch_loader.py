"""NumaLoader: the wrapped DataLoader's batches, collated by workers on the node
straight into node-local, page-locked slots, behaving as the DataLoader does.

Every comparison is with a stock DataLoader built the same way and run in the same
test. Where the workers may run is read from the kernel (sched_getaffinity inside
each worker), where the batches are from pagemap and the sysfs memory blocks,
whether they are locked from /proc/self/smaps.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sysfs_truth import (
    cpuless_nodes_with_memory,
    nearest_cpu_nodes,
    node_cpus,
    online_nodes,
    pagemap_nodes,
    pages_mlocked,
    smaps_of,
    thread_policy,
)

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402

import numafast  # noqa: E402
import numafast.torch  # noqa: E402
from numafast.torch.worker_collate import SlotCollate  # noqa: E402

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


def held_in_pools(loader: Any, batches: list[Any]) -> bool:
    """Every batch's values tensor lies in one of the loader's pools."""
    pools = loader.pools.pools
    return all(any(pool.contains(batch["values"].data_ptr()) for pool in pools) for batch in batches)


def shared_memory_mappings() -> list[str]:
    """The mappings of this process that torch's shared-memory tensors use (its files
    are /dev/shm/torch_*, unlinked once mapped; multiprocessing's semaphores aside)."""
    names = [line.split(maxsplit=5)[5] for line in Path("/proc/self/maps").read_text().splitlines() if len(line.split()) > 5]
    return [name for name in names if name.startswith("/dev/shm/torch_")]


class Shards(IterableDataset):  # type: ignore[type-arg]
    """An IterableDataset whose workers yield shards of different lengths (0..count)."""

    def __init__(self, count: int, reported: int | None = None) -> None:
        self.count, self.reported = count, reported

    def __len__(self) -> int:
        return self.reported if self.reported is not None else self.count

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for index in range(worker, self.count, workers):
            if worker == 0 and index > self.count // 2:
                return  # worker 0 stops early: an uneven shard
            yield {"values": torch.full((512,), float(index)), "index": index}


class Boxed:
    """A user's own batch class with a tensor inside (picklable, as torch needs it to be)."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


def custom_collate(samples: list[Any]) -> dict[str, Any]:
    """A custom collate_fn: a transposed (strided) tensor, a NumPy array, a user's class."""
    values = torch.stack([sample["values"] for sample in samples])
    return {
        "columns": values.t(),
        "array": values.numpy().astype("float64"),
        "boxed": Boxed(torch.tensor([sample["index"] for sample in samples])),
        "names": [f"sample {sample['index']}" for sample in samples],
    }


class KilledWhenPickled:
    """Kills (SIGKILL) the process that pickles it: a NumaLoader's worker while it packs
    the batch into the slot it holds, a stock one in its queue's feeder thread."""

    def __reduce__(self) -> Any:
        time.sleep(0.5)  # the worker's queue thread has sent the batches before this one by then
        os.kill(os.getpid(), signal.SIGKILL)


def kill_on_batch(samples: list[Any]) -> Any:
    """A collate function whose worker is killed while it holds a slot."""
    batch = torch.utils.data.default_collate(samples)
    if any(sample["index"] == 7 for sample in samples):
        batch["killer"] = KilledWhenPickled()
    return batch


# ---------------------------------------------------------------- the same batches


@SEMANTICS
@pytest.mark.parametrize("workers", [0, 1, 4])
def test_yields_the_stock_loaders_batches_in_order_landed_on_the_node(workers: int) -> None:
    dataset = Numbers(40)
    stock = list(make_loader(dataset, num_workers=workers))
    loader = numafast.torch.NumaLoader(make_loader(dataset, num_workers=workers), node=NODES[0], lock="best-effort")
    assert len(loader) == len(stock) == 14
    ours = list(loader)
    assert len(ours) == len(stock) and all(map(same, stock, ours))
    assert held_in_pools(loader, ours)
    assert all(pages_mlocked(batch["values"].data_ptr(), batch["values"].nbytes) for batch in ours)
    stats = loader.stats()
    # Every batch was collated in a slot by the process that made it, or copied: the first
    # ones (no pool yet: at most the prefetch_factor x num_workers the DataLoader has in
    # flight before the owner copied the first in and made the pool), and those that found
    # every slot held while the consumer kept them (copying them in grew the pools).
    assert stats.batches == 14 and stats.landed + stats.copied == 14 and stats.landed > 0
    assert set(stats.fallbacks) <= {"first batches", "no free slot"}, stats
    assert stats.fallbacks.get("first batches", 0) <= 2 * workers, stats
    del ours
    gc.collect()
    assert sum(pool.in_use + pool.leased for pool in loader.stats().pools) == 0


@SEMANTICS
def test_landed_batches_copy_nothing_and_make_no_shared_memory_files() -> None:
    dataset = Numbers(48, size=16384)
    loader = numafast.torch.NumaLoader(make_loader(dataset, batch_size=4, num_workers=2), node=NODES[0], slots=16)
    list(loader)  # the first epoch: its first batches, copied in, make the pool
    first = loader.stats()
    assert set(first.fallbacks) == {"first batches"} and 0 < first.copied <= 2 * 2, first  # prefetch x workers
    before = set(shared_memory_mappings())
    ours = list(loader)
    assert loader.stats().bytes_copied == first.bytes_copied and loader.stats().copied == first.copied  # all landed
    assert held_in_pools(loader, ours) and set(shared_memory_mappings()) <= before
    stock_loader = make_loader(dataset, batch_size=4, num_workers=2)
    list(stock_loader)
    stock = list(stock_loader)  # its second epoch, as ours; torch's way maps shared-memory files
    assert set(shared_memory_mappings()) - before
    assert all(map(same, stock, ours))


@SEMANTICS
@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_with_uneven_shards_gives_the_stock_batches(workers: int) -> None:
    stock = list(DataLoader(Shards(23), batch_size=3, num_workers=workers))
    ours = list(numafast.torch.NumaLoader(DataLoader(Shards(23), batch_size=3, num_workers=workers)))
    assert len(ours) == len(stock) and all(map(same, stock, ours))


@SEMANTICS
def test_the_length_warning_comes_from_the_same_next_call_as_the_stock_loaders() -> None:
    def warned_at(iterable: Any) -> list[int]:
        positions = []
        assert len(iterable) == 2  # torch warns only once len() was asked
        iterator = iter(iterable)
        for position in range(100):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    next(iterator)
                except StopIteration:
                    return positions
            if any(str(w.message).startswith("Length of IterableDataset") for w in caught):
                positions.append(position)
        return positions

    stock = warned_at(DataLoader(Shards(23, reported=4), batch_size=2, num_workers=2))
    ours = warned_at(numafast.torch.NumaLoader(DataLoader(Shards(23, reported=4), batch_size=2, num_workers=2)))
    assert stock and ours == stock


@SEMANTICS
def test_persistent_workers_give_the_same_batches_every_epoch_and_land_them_all() -> None:
    dataset = Numbers(18)
    stock = DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True)
    loader = numafast.torch.NumaLoader(DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True))
    expected = list(stock)
    copied = []
    for _epoch in range(3):
        count = 0
        for count, batch in enumerate(loader, 1):  # each checked, then let go, as a training loop does
            assert same(expected[count - 1], batch)
        del batch
        assert count == len(expected)
        copied.append(loader.stats().copied)
    stats = loader.stats()
    # The workers started before any pool existed; the pool the owner made as it copied in
    # their first batches (at most prefetch_factor x num_workers) reached them without a restart.
    assert 0 < copied[0] <= 2 * 2 and copied[0] == copied[2] == stats.copied, (copied, stats)
    assert set(stats.fallbacks) == {"first batches"} and stats.landed == 3 * len(expected) - copied[0], stats


@SEMANTICS
def test_two_loaders_on_one_node_iterated_together_each_grow_their_own_pools() -> None:
    """Two loaders on one node, their batches taken in turn: each owner's copy of its own
    first batches makes its own pools (each loader's board lists only its own), at most
    prefetch_factor x num_workers first batches each arrive copied, and the second epoch
    lands; every batch is the stock one."""
    gc.collect()
    numafast.torch.close_idle_pools()  # new pools, not a gone loader's taken over (sized by its batches)
    first_data, second_data = Numbers(24), Numbers(24, size=8192)
    options = {"batch_size": 2, "num_workers": 2, "shuffle": False}
    stocks = [list(make_loader(data, **options)) for data in (first_data, second_data)]
    loaders = [numafast.torch.NumaLoader(make_loader(data, **options, persistent_workers=True), node=NODES[0])
               for data in (first_data, second_data)]  # fmt: skip
    assert loaders[0].pools is not loaders[1].pools
    copied = []
    for _epoch in range(2):
        count = 0
        for count, (one, two) in enumerate(zip(*loaders), 1):  # each checked, then let go
            assert same(stocks[0][count - 1], one) and same(stocks[1][count - 1], two)
            assert loaders[0].pools.holds(one["values"].data_ptr()) and loaders[1].pools.holds(two["values"].data_ptr())
        del one, two
        assert count == 12
        copied.append([loader.stats().copied for loader in loaders])
    # A copy past the first batches: a worker found the 6 slots held (4 in flight, and the
    # consumer's batch and the one before it, still bound while zip takes the next).
    for loader, first, second in zip(loaders, *copied):
        stats = loader.stats()
        assert set(stats.fallbacks) <= {"first batches", "no free slot"} and stats.unpinned == 0, stats
        assert 0 < stats.fallbacks["first batches"] <= 2 * 2 and second - first <= 2 * 2, (copied, stats)
        assert stats.landed + stats.copied == 24 and stats.landed >= 12, stats
    files = [{pool.share().inode for pool in loader.pools.pools} for loader in loaders]
    assert files[0] and files[1] and not files[0] & files[1]


@SEMANTICS
def test_in_order_false_gives_the_same_batches() -> None:
    dataset = Numbers(30)
    stock = list(make_loader(dataset, in_order=False, shuffle=False))
    ours = list(numafast.torch.NumaLoader(make_loader(dataset, in_order=False, shuffle=False)))
    key = lambda batch: batch["index"].tolist()  # noqa: E731
    assert sorted(map(key, stock)) == sorted(map(key, ours))
    by_key = {tuple(key(batch)): batch for batch in stock}
    assert all(same(by_key[tuple(key(batch))], batch) for batch in ours)


@SEMANTICS
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_map_the_pool_and_land_batches(context: str) -> None:
    dataset = Numbers(16)
    options = {"batch_size": 2, "num_workers": 1, "multiprocessing_context": context, "persistent_workers": True}
    stock = list(DataLoader(dataset, **options))
    loader = numafast.torch.NumaLoader(DataLoader(dataset, **options))
    copied = []
    for _epoch in range(2):
        count = 0
        for count, batch in enumerate(loader, 1):  # each checked, then let go
            assert same(stock[count - 1], batch)
        del batch
        assert count == len(stock)
        copied.append(loader.stats().copied)
    stats = loader.stats()  # the pool reached through /proc/PID/fd of this process, once made by the owner
    assert 0 < copied[0] <= 2 and copied[1] == copied[0], (copied, stats)  # prefetch_factor x num_workers
    assert set(stats.fallbacks) == {"first batches"} and stats.landed == 2 * len(stock) - copied[0], stats


def failing_init(worker_id: int) -> None:
    raise ValueError(f"worker {worker_id} could not start")


# DataLoader set-ups that torch's own test_dataloader.py covers, beyond the above.
STOCK_SETUPS: dict[str, Any] = {
    "batch_size=None": lambda **k: DataLoader(Numbers(6), batch_size=None, **k),
    "batch_sampler": lambda **k: DataLoader(
        Numbers(10), batch_sampler=torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(10)), 3, False), **k
    ),
    "drop_last": lambda **k: DataLoader(Numbers(10), batch_size=3, drop_last=True, **k),
    "strings": lambda **k: DataLoader(["a", "b", "c", "d", "e"], batch_size=2, **k),
    "numpy samples": lambda **k: DataLoader([__import__("numpy").full(3, i) for i in range(5)], batch_size=2, **k),
    "numbers in dicts": lambda **k: DataLoader([{"i": i, "f": i / 2, "b": bool(i % 2)} for i in range(6)], batch_size=4, **k),
    "worker_init_fn raises": lambda **k: DataLoader(Numbers(6), batch_size=2, worker_init_fn=failing_init, **k),
}


@SEMANTICS
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("setup", list(STOCK_SETUPS))
def test_other_dataloader_setups_give_the_stock_outcomes(setup: str, workers: int) -> None:
    if setup == "worker_init_fn raises" and workers == 0:
        pytest.skip("worker_init_fn runs only in workers")
    def summary(outcome: Any) -> Any:
        # An error's first and last lines: the traceback between names numafast's frames too.
        if isinstance(outcome, tuple) and outcome[:1] == ("raised",):
            lines = outcome[2].strip().splitlines()
            return ("raised", outcome[1], lines[0], lines[-1])
        return outcome

    make = STOCK_SETUPS[setup]
    stock = [summary(outcome) for outcome in outcomes(make(num_workers=workers))]
    ours = [summary(outcome) for outcome in outcomes(numafast.torch.NumaLoader(make(num_workers=workers)))]
    assert len(ours) == len(stock) and all(map(same, stock, ours)), (stock, ours)


@SEMANTICS
def test_a_custom_collate_fns_tensors_arrays_and_classes_land_in_the_slot_too() -> None:
    import numpy as np

    dataset = Numbers(40, size=256)
    stock = list(make_loader(dataset, batch_size=4, collate_fn=custom_collate))
    loader = numafast.torch.NumaLoader(make_loader(dataset, batch_size=4, collate_fn=custom_collate), node=NODES[0])
    kept: list[Any] = []
    landed = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for left, right in zip(stock, loader, strict=True):  # each checked as it arrives
            assert torch.equal(left["columns"], right["columns"]) and np.array_equal(left["array"], right["array"])
            assert torch.equal(left["boxed"].tensor, right["boxed"].tensor) and left["names"] == right["names"]
            assert isinstance(right["boxed"], Boxed) and right["array"].dtype == np.float64
            in_slot = [loader.pools.holds(address) for address in (
                right["columns"].data_ptr(), right["array"].__array_interface__["data"][0], right["boxed"].tensor.data_ptr())]
            assert in_slot[:2] == [True, True]  # landed, or copied in (the first batches)
            landed += all(in_slot)  # the class's tensor too: a worker packed it into the slot
            kept = [*kept[-1:], right]  # keep a few: slots come back
    assert landed == loader.stats().landed > 0 and loader.stats().unpinned == 0
    # The first batches, copied in, leave Boxed's tensor where it was, and every later one lands: no word.
    assert not [warning for warning in caught if "numafast" in str(warning.message)]


@SEMANTICS
def test_a_consumer_that_keeps_random_earlier_batches_sees_them_unchanged() -> None:
    dataset = Numbers(90, size=2048)
    stock = list(make_loader(dataset))
    loader = numafast.torch.NumaLoader(make_loader(dataset), node=NODES[0], slots=6, prefetch=2)
    chooser = random.Random(1)
    kept: dict[int, Any] = {}
    for position, batch in enumerate(loader):
        if chooser.random() < 0.5:
            kept[position] = batch
        if len(kept) > 4:
            kept.pop(chooser.choice(sorted(kept)))  # let an old one go: its slot is reused
    assert kept and all(same(stock[position], batch) for position, batch in kept.items())
    assert loader.stats().landed > 0


@SEMANTICS
def test_a_consumer_keeping_more_batches_than_slots_never_hangs() -> None:
    dataset = Numbers(60)
    stock = list(make_loader(dataset))
    loader = numafast.torch.NumaLoader(make_loader(dataset), node=NODES[0], slots=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = list(loader)
    assert all(map(same, stock, ours))
    # A worker that found every slot held sent its batch the copying way; copying it in added a pool.
    stats = loader.stats()
    assert set(stats.fallbacks) <= {"first batches", "no free slot"} and stats.unpinned == 0, stats
    assert stats.landed > stats.copied and loader.pools.grown > 0, stats
    assert all(loader.pools.holds(b["values"].data_ptr()) for b in ours)
    ours_said = [str(warning.message) for warning in caught if "numafast" in str(warning.message)]
    assert len(ours_said) == 1 and "keeps tensors of" in ours_said[0] and ".clone()" in ours_said[0], ours_said


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


KILLED_CHILD = """
import gc, os, re, signal, sys
sys.path.insert(0, "tests")
from test_torch_loader import DataLoader, Numbers, kill_on_batch, numafast
options = {"batch_size": 2, "num_workers": 1, "collate_fn": kill_on_batch, "timeout": 60}
loader = DataLoader(Numbers(20), **options)
if sys.argv[1] == "numafast":
    loader = numafast.torch.NumaLoader(loader)
try:
    for _batch in loader:
        pass
    print("no error")
except RuntimeError as error:
    # torch's SIGCHLD handler may raise again for the same dead worker: no more of it.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    print(re.sub(r"pid\\(s\\) [0-9, ]+|pid [0-9]+", "pid N", str(error)))
if sys.argv[1] == "numafast":
    gc.collect()
    pools = loader.stats().pools  # ends the dead worker's lease
    print(sum(pool.leased for pool in pools), sum(pool.reclaimed for pool in pools))
sys.stdout.flush()
os._exit(0)
"""


@SEMANTICS
def test_a_worker_killed_while_it_holds_a_slot_gives_the_dataloaders_own_error_and_the_slot_back() -> None:
    def run(kind: str) -> list[str]:
        result = subprocess.run([sys.executable, "-c", KILLED_CHILD, kind], capture_output=True, text=True,
                                timeout=300, cwd=Path(__file__).resolve().parent.parent)
        return result.stdout.splitlines() or [result.stderr]

    stock, ours = run("stock"), run("numafast")
    # DataLoader's own error: its SIGCHLD handler names the signal, unless the broken pipe is seen first.
    own_errors = ("DataLoader worker (pid N) is killed by signal: Killed. ", "DataLoader worker (pid N) exited unexpectedly")
    assert stock[0] in own_errors, stock
    assert ours[0] in own_errors, ours
    leased, reclaimed = map(int, ours[1].split())
    assert leased == 0 and reclaimed == 1, ours


@SEMANTICS
def test_iterating_installs_torchs_sigchld_handler_as_the_stock_loader_does() -> None:
    code = (
        "import torch, numafast.torch\n"
        "from torch.utils.data import DataLoader\n"
        "from torch.utils.data._utils import signal_handling\n"
        "print(sum(1 for _ in numafast.torch.NumaLoader(DataLoader(list(range(8)), num_workers=1))))\n"
        "print(signal_handling._SIGCHLD_handler_set)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.stdout.split() == ["8", "True"], result.stderr


@SEMANTICS
def test_a_single_process_loader_collates_into_the_slot_itself() -> None:
    dataset = Numbers(12)
    stock = list(DataLoader(dataset, batch_size=2))
    loader = numafast.torch.NumaLoader(DataLoader(dataset, batch_size=2))
    ours = list(loader)
    assert all(map(same, stock, ours)) and held_in_pools(loader, ours)
    assert loader.stats().landed == 6 and loader.stats().copied == 0  # the first batch sized the pool, in place


class Growing(Dataset):  # type: ignore[type-arg]
    """Sample i: a tensor of 4,096 x (1 + i // 3) floats, so that with batches of 3 each
    batch is larger than a slot sized by the ones before it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> Any:
        return torch.full((4096 * (1 + index // 3),), float(index))


def stack_collate(samples: list[Any]) -> Any:
    """A user's own collate function (numafast packs what it returns into the slot)."""
    return torch.stack(samples)


@SEMANTICS
@pytest.mark.parametrize("collate_fn", [None, stack_collate])
def test_batches_that_outgrow_the_slots_of_a_first_epoch_reach_the_consumer_whole(collate_fn: Any) -> None:
    """Every batch larger than all before it, every one in flight before the first
    arrives: each is copied in (no pool yet, or too small), the owner resizing the pool."""
    options = {"batch_size": 3, "num_workers": 2, "collate_fn": collate_fn}
    stock = list(DataLoader(Growing(), **options))
    loader = numafast.torch.NumaLoader(DataLoader(Growing(), **options), slots=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = list(loader)
    assert all(map(same, stock, ours)) and all(loader.pools.holds(batch.data_ptr()) for batch in ours)
    stats = loader.stats()
    assert stats.landed + stats.copied == 4 and stats.unpinned == 0 and loader.pools.resized >= 1, stats
    assert set(stats.fallbacks) <= {"first batches", "batch larger than a slot"}, stats
    assert not [warning for warning in caught if "numafast" in str(warning.message)]


class Resized(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Batches of 8 indices, then, from batch 12 on, of ``8 x factor``: the batch size grows mid-epoch."""

    def __init__(self, factor: float) -> None:
        self.later = round(8 * factor)

    def __iter__(self) -> Any:
        start = 0
        for number in range(24):
            size = 8 if number < 12 else self.later
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return 24


@SEMANTICS
@pytest.mark.parametrize("collate_fn", [None, stack_collate])
@pytest.mark.parametrize("factor", [1.25, 3])
def test_a_batch_size_growing_mid_epoch_lands_once_the_owner_resized_the_pools(factor: float, collate_fn: Any) -> None:
    """The batch size grows 1.25x (within a slot's headroom: it may land as it is) or 3x
    (the slots are too small: copied in, the owner resizes the pool) mid-epoch: every
    batch reaches the consumer whole, in a slot; only those in flight when the size grew
    (prefetch_factor x num_workers) are copied, without a word; every later one lands."""
    dataset = [torch.full((2048,), float(index)) for index in range(12 * 8 + 12 * round(8 * factor))]
    options = {"batch_sampler": Resized(factor), "num_workers": 2, "collate_fn": collate_fn}
    loader = numafast.torch.NumaLoader(DataLoader(dataset, **options), slots=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count, start, copied_before = 0, 0, 0
        for count, batch in enumerate(loader, 1):  # each checked by content, then let go
            size = 8 if count <= 12 else round(8 * factor)
            expected = torch.arange(start, start + size, dtype=torch.float32)
            assert batch.shape == (size, 2048) and torch.equal(batch[:, 0], expected) and torch.equal(batch[:, -1], expected)
            assert loader.pools.holds(batch.data_ptr())
            start += size
            if count == 12:
                copied_before = loader.stats().copied
        del batch
    stats = loader.stats()
    assert count == 24 and stats.batches == 24 and stats.unpinned == 0, stats
    # A slot of the new size may still be held when a worker looks (a loaded machine): copied, as bounded.
    assert set(stats.fallbacks) <= {"first batches", "batch larger than a slot", "no free slot"}, stats
    assert stats.fallbacks.get("first batches", 0) <= 2 * 2 and stats.copied - copied_before <= 2 * 2, stats
    if factor == 3:
        assert loader.pools.resized >= 1 and stats.fallbacks.get("batch larger than a slot", 0) >= 1, stats
    assert not [warning for warning in caught if "numafast" in str(warning.message)]


LIMITED_LOCKING_CHILD = """
import resource, sys, time, warnings
resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))  # a user's usual limit
import torch, numafast, numafast.torch
from torch.utils.data import DataLoader
warnings.simplefilter("always")
stock = DataLoader([torch.full((64, 1024), float(i)) for i in range(64)], batch_size=8, num_workers=2)
if sys.argv[1] == "required":
    loader = numafast.torch.NumaLoader(stock, lock="required")
    try:
        iter(loader)
    except numafast.MemlockError as error:
        print("MemlockError", error)
    sys.exit()
with warnings.catch_warnings(record=True) as caught:
    sums = [batch.sum().item() for batch in numafast.torch.NumaLoader(stock)]  # the one-line change
print(sums == [batch.sum().item() for batch in stock], sum(isinstance(w.message, numafast.MemlockWarning) for w in caught),
      torch.cuda.is_available())
"""


@SEMANTICS
@pytest.mark.parametrize("lock", ["auto", "required"])
def test_under_a_users_locking_limit_the_default_runs_and_required_is_refused_at_iter(lock: str) -> None:
    """RLIMIT_MEMLOCK 8 MiB without CAP_IPC_LOCK, as a new user has: the default loader
    (64 KiB batches, 2 workers, so its pool is over the limit) runs to the end, with one
    warning where a GPU is usable (lock='auto' locks nothing without one); lock='required' is refused at iter(), before any worker starts, naming the
    limit and the fix (not out of a batch mid-epoch)."""
    without_ipc_lock = ("setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock")  # as root, CAP_IPC_LOCK would allow it
    result = subprocess.run([*without_ipc_lock, sys.executable, "-c", LIMITED_LOCKING_CHILD, lock], capture_output=True,
                            text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr
    if lock == "required":
        assert result.stdout.startswith("MemlockError lock='required', but this process may page-lock only 8192 KiB")
        assert "ulimit -S -l unlimited" in result.stdout and "lock='best-effort'" in result.stdout
    else:  # lock='auto' locks only where a GPU is usable; there, one warning
        same, warned, gpu = result.stdout.split()
        assert (same, warned) == ("True", "1" if gpu == "True" else "0"), result.stdout + result.stderr


# ---------------------------------------------------------------- the DataLoader's surface


def test_a_numaloader_is_a_dataloader_with_the_wrapped_loaders_settings_and_numafasts_collate() -> None:
    dataset = Numbers(10)
    stock = DataLoader(dataset, batch_size=3, num_workers=2, drop_last=True, prefetch_factor=3, worker_init_fn=set_marker)
    loader = numafast.torch.NumaLoader(stock)
    assert isinstance(loader, DataLoader)
    for name in ("dataset", "batch_size", "sampler", "num_workers", "drop_last", "prefetch_factor",
                 "persistent_workers", "generator", "timeout", "multiprocessing_context", "in_order"):
        assert getattr(loader, name) is getattr(stock, name), name
    assert list(loader.batch_sampler) == list(stock.batch_sampler)
    # numafast's part: plain attributes, which frameworks copy when they re-create a loader
    assert isinstance(loader.collate_fn, SlotCollate) and loader.collate_fn.collate_fn is stock.collate_fn
    assert loader.worker_init_fn is set_marker  # the user's own: frameworks read it (Lightning seeds where it is None)
    assert loader.collate_fn.node == loader.node  # the workers bind themselves to the node at their first batch
    for name in ("batch_size", "sampler", "batch_sampler", "dataset", "drop_last", "persistent_workers"):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after NumaLoader is initialized"):
            setattr(loader, name, None)
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after DataLoader is initialized"):
            setattr(stock, name, None)
    loader.collate_fn = custom_collate  # set later: still collated into a slot
    assert isinstance(loader.collate_fn, SlotCollate) and loader.collate_fn.collate_fn is custom_collate
    loader.pin_memory = True  # numafast pins: torch's pin thread never runs on top
    assert loader.pin_memory is False and len(loader) == len(stock) == 3
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        loader.nonsense  # noqa: B018


@SEMANTICS
def test_options_given_with_a_loader_replace_its_own_as_a_framework_passes_them() -> None:
    """Lightning re-creates a loader from the arguments it was made with plus a new
    sampler (``shuffle=False, batch_sampler=None``): the new sampler decides the batches."""
    dataset = Numbers(20)
    sampler = torch.utils.data.SubsetRandomSampler(list(range(0, 20, 2)), generator=torch.Generator().manual_seed(3))
    stock = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
    loader = numafast.torch.NumaLoader(
        make_loader(dataset, batch_size=4, shuffle=True), sampler=sampler, shuffle=False, batch_sampler=None
    )
    sampler.generator.manual_seed(3)
    expected = outcomes(stock)
    sampler.generator.manual_seed(3)
    assert all(map(same, expected, outcomes(loader)))
    assert numafast.torch.NumaLoader(make_loader(dataset), num_workers=0).num_workers == 0


@SEMANTICS
def test_a_loader_built_with_pin_memory_lands_once_without_torchs_pin_thread() -> None:
    dataset = Numbers(24)
    loader = numafast.torch.NumaLoader(make_loader(dataset, num_workers=2, pin_memory=True))
    assert loader.pin_memory is False
    batches = outcomes(loader)
    assert all(map(same, outcomes(make_loader(dataset, num_workers=2)), batches)) and held_in_pools(loader, batches)
    assert not [thread for thread in threading.enumerate() if "pin" in thread.name.lower()]


# ---------------------------------------------------------------- loaders frameworks make from a NumaLoader


def landed_in(pools: Any, batches: list[Any]) -> bool:
    return all(pools.holds(batch["values"].data_ptr()) for batch in batches)


@SEMANTICS
def test_a_plain_dataloader_made_from_a_numaloaders_attributes_lands_every_batch_too() -> None:
    """What Ray Train's prepare_data_loader and Accelerate's prepare do: a new DataLoader
    from the public attributes (collate_fn and worker_init_fn among them)."""
    dataset = Numbers(36)
    loader = numafast.torch.NumaLoader(make_loader(dataset), node=NODES[0])
    copied = DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
    )  # forked outside numa_local: the workers bind themselves at their first batch
    stock = make_loader(dataset)
    for _epoch in range(2):
        expected, batches = outcomes(stock), outcomes(copied)
        assert all(map(same, expected, batches)) and landed_in(loader.pools, batches)
        assert all(cpus == node_cpus(NODES[0]) for batch in batches for cpus in _per_sample(batch["cpus"]))
        del batches
    stats = numafast.torch.loader_stats(copied)
    # the test keeps a whole epoch (12 batches, 6 slots a pool): a few are copied while the pools grow
    assert stats is not None and stats.batches == 24 and stats.landed >= 12, stats
    assert set(stats.fallbacks) <= {"first batches", "no free slot"}, stats


class Wrapper(DataLoader):  # type: ignore[type-arg]
    """A framework's loader that keeps a DataLoader inside and iterates it (as Accelerate's
    DataLoaderShard does with base_dataloader), counting epochs."""

    def __init__(self, base: DataLoader) -> None:  # type: ignore[type-arg]
        super().__init__(base.dataset)
        self.base_dataloader = base
        self.epochs = 0

    def set_epoch(self, epoch: int) -> None:
        self.epochs = epoch

    def __len__(self) -> int:
        return len(self.base_dataloader)

    def __iter__(self) -> Any:
        yield from self.base_dataloader
        self.epochs += 1


class Hidden(DataLoader):  # type: ignore[type-arg]
    """A loader that iterates another one numafast cannot find."""

    def __init__(self, base: DataLoader) -> None:  # type: ignore[type-arg]
        super().__init__(base.dataset)
        self._secret = base

    def __iter__(self) -> Any:
        return iter(self._secret)


@SEMANTICS
def test_a_loader_with_its_own_iteration_is_iterated_through_with_numafast_on_its_inner_loader() -> None:
    dataset = Numbers(30)
    wrapper = Wrapper(make_loader(dataset))
    loader = numafast.torch.NumaLoader(wrapper, node=NODES[0])
    assert isinstance(loader, DataLoader) and len(loader) == len(wrapper) == 10
    assert loader.batch_sampler is wrapper.base_dataloader.batch_sampler  # the inner loader's objects
    loader.set_epoch(4)  # the wrapper's own methods and attributes read through
    assert wrapper.epochs == 4 and loader.epochs == 4
    expected = outcomes(make_loader(dataset))
    batches = outcomes(loader)
    assert all(map(same, expected, batches)) and landed_in(loader.pools, batches) and wrapper.epochs == 5
    assert isinstance(wrapper.base_dataloader.collate_fn, SlotCollate) and wrapper.base_dataloader.pin_memory is False
    with pytest.raises(ValueError, match="iterates this Wrapper as it is and cannot change its batch_size"):
        numafast.torch.NumaLoader(wrapper, batch_size=5)


@SEMANTICS
def test_batches_that_come_past_numafasts_collate_are_copied_in_counted_and_warned_about_once() -> None:
    dataset = Numbers(30)
    loader = numafast.torch.NumaLoader(Hidden(make_loader(dataset)), node=NODES[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = outcomes(loader)
    assert all(map(same, outcomes(make_loader(dataset)), batches)) and landed_in(loader.pools, batches)
    said = [str(warning.message) for warning in caught if "collate bypassed" in str(warning.message)]
    assert len(said) == 1 and "batches of this Hidden do not come from numafast's collate" in said[0], said
    stats = loader.stats()
    assert stats.batches == stats.copied == 10 and stats.fallbacks == {"collate bypassed": 10}


@SEMANTICS
def test_a_loader_made_again_from_a_numaloaders_settings_takes_over_its_pools() -> None:
    """Lightning re-creates a loader from its attributes when it did not see it made:
    the collate function that comes along brings its pools."""
    loader = numafast.torch.NumaLoader(make_loader(Numbers(30)), node=NODES[0])
    outcomes(loader)
    again = numafast.torch.NumaLoader(loader.dataset, batch_size=3, collate_fn=loader.collate_fn, num_workers=2,
                                      node=NODES[0])  # fmt: skip
    assert again.pools is loader.pools and again.collate_fn is loader.collate_fn  # not one inside another
    batches = outcomes(again)
    assert landed_in(loader.pools, batches)
    assert loader.stats().fallbacks.get("first batches", 0) == again.stats().fallbacks.get("first batches", 0)


@SEMANTICS
def test_a_numaloader_made_from_a_numaloader_lands_as_the_first_does() -> None:
    dataset = Numbers(30)
    first = numafast.torch.NumaLoader(make_loader(dataset), node=NODES[0])
    again = numafast.torch.NumaLoader(first)
    assert again.pools is first.pools and again.collate_fn is first.collate_fn
    batches = outcomes(again)
    assert all(map(same, outcomes(make_loader(dataset)), batches)) and landed_in(again.pools, batches)
    through = numafast.torch.NumaLoader(numafast.torch.NumaLoader(Wrapper(make_loader(dataset)), node=NODES[0]))
    batches = outcomes(through)
    assert all(map(same, outcomes(make_loader(dataset)), batches)) and landed_in(through.pools, batches)
    assert "collate bypassed" not in through.stats().fallbacks


class Counting(IterableDataset):  # type: ignore[type-arg]
    """0..count-1, split between workers, with a len() (torch's test_iterable_style_dataset)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(torch.full((256,), float(i)) for i in range(start, self.count, step))


@SEMANTICS
def test_iterating_again_before_the_last_iterator_is_gone_warns_nothing() -> None:
    """torch's own test re-runs ``it = iter(loader)``: the new workers start while the old
    iterator, its batches unread, still holds slots; those come back, silently."""
    loader = numafast.torch.NumaLoader(Counting(20), num_workers=2, prefetch_factor=2, node=NODES[0])
    iterator = iter(loader)
    for _ in range(10):
        next(iterator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        iterator = iter(loader)
        values = sorted(int(next(iterator)[0, 0]) for _ in range(20))
    assert values == list(range(20))


@SEMANTICS
@pytest.mark.parametrize("workers", [0, 2])
def test_nested_and_sparse_leaves_reach_the_consumer_as_made_even_when_copied(workers: int) -> None:
    nested = [torch.nested.nested_tensor([torch.full((5,), float(i))]) for i in range(4)]
    sparse = [torch.eye(3).to_sparse() * i for i in range(4)]
    for dataset in (nested, sparse):
        loader = numafast.torch.NumaLoader(dataset, batch_size=2, num_workers=workers, node=NODES[0],
                                           collate_fn=lambda batch: {"leaves": list(batch), "dense": torch.ones(2)})  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(loader)
        assert [[leaf.layout for leaf in batch["leaves"]] for batch in batches] == [[dataset[0].layout] * 2] * 2
        assert all(loader.pools.holds(batch["dense"].data_ptr()) for batch in batches)
        assert any("are not pinned" in str(warning.message) for warning in caught)


@SEMANTICS
@pytest.mark.parametrize("workers", [0, 2])
def test_an_empty_unplaceable_leaf_is_no_reason_for_a_warning_in_any_process(workers: int) -> None:
    """An empty nested or sparse tensor has no bytes to pin: neither the copy in this
    process nor a worker's slot warns of it, as of an empty dense one."""
    empties: list[Any] = [torch.zeros((0, 3)).to_sparse()]
    if not workers:  # torch cannot unpickle an empty nested tensor (an internal assert), the stock loader's workers neither
        empties.append(torch.nested.nested_tensor([]))
    loader = numafast.torch.NumaLoader(range(4), batch_size=2, num_workers=workers, node=NODES[0],
                                       collate_fn=lambda batch: {"empty": empties, "dense": torch.tensor(batch)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(loader)
    assert [batch["dense"].tolist() for batch in batches] == [[0, 1], [2, 3]]
    assert [[leaf.layout for leaf in batch["empty"]] for batch in batches] == [[leaf.layout for leaf in empties]] * 2
    assert not [warning for warning in caught if "not pinned" in str(warning.message)]


def test_numaloader_is_generic_as_dataloader_is() -> None:
    def typed(loader: numafast.torch.NumaLoader[list[int]]) -> numafast.torch.NumaLoader[list[int]]:
        return loader

    assert typed.__annotations__ and numafast.torch.NumaLoader[list] is not None


@SEMANTICS
def test_a_sampler_with_set_epoch_reshuffles_as_the_stock_one() -> None:
    from torch.utils.data.distributed import DistributedSampler

    def epochs(loader: Any) -> list[list[int]]:
        seen = []
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)
            seen.append([index for batch in loader for index in batch["index"].tolist()])
        return seen

    def make() -> DataLoader:  # type: ignore[type-arg]
        dataset = Numbers(24)
        return DataLoader(dataset, batch_size=4, num_workers=2, sampler=DistributedSampler(dataset, 2, 1, seed=3))

    stock = epochs(make())
    assert stock[0] != stock[1] and epochs(numafast.torch.NumaLoader(make())) == stock


# ---------------------------------------------------------------- shutting down


@SEMANTICS
def test_an_early_break_returns_promptly_and_stops_the_workers() -> None:
    loader = numafast.torch.NumaLoader(make_loader(Numbers(300), num_workers=2))
    workers = set()
    start = time.monotonic()
    for position, batch in enumerate(loader):
        workers.update(batch["pid"].tolist())
        if position == 3:
            break
    del batch
    assert time.monotonic() - start < 30
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}/status") for pid in workers)), workers
    gc.collect()
    assert sum(pool.in_use + pool.leased for pool in loader.stats().pools) == 0  # the queued batches were let go


@SEMANTICS
def test_dropping_a_half_read_loader_leaves_its_pools_to_the_next_and_closing_them_cleans_up() -> None:
    loader = numafast.torch.NumaLoader(make_loader(Numbers(300)))
    iterator = iter(loader)
    first = next(iterator)
    pools, pool_address = loader.pools, first["values"].data_ptr()
    # The worker-start watch, until it has seen every worker start, holds the iterator for
    # an instant in each look (its check of torch's shutdown flag): a del below in that
    # instant would leave the iterator, and so the pools, to end a moment later in the
    # watch's thread (a CI run once found the pools not handed over). Let the watch end first.
    assert wait_until(lambda: all(thread.name != "numafast worker start" for thread in threading.enumerate()))
    del iterator, first, loader
    gc.collect()
    again = numafast.torch.NumaLoader(make_loader(Numbers(30)))
    assert again.pools is pools and again.stats().batches == 0  # warm, with its own counters
    del again
    gc.collect()
    assert smaps_of(pool_address) != {} and numafast.torch.close_idle_pools() == 1
    assert wait_until(lambda: smaps_of(pool_address) == {})  # released once closed


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("loader", "options", "error", "match"),
    [
        (iter([1, 2]), {}, TypeError, "takes a torch.utils.data.DataLoader or a dataset, not a list_iterator"),
        (DataLoader(range(4)), {"prefetch": 0}, numafast.InvalidSizeError, "prefetch must be a positive integer"),
        (DataLoader(range(4)), {"slots": -1}, numafast.InvalidSizeError, "slots must be"),
        (DataLoader(range(4)), {"node": 99}, numafast.InvalidNodeError, "node 99 does not exist"),
        (DataLoader(range(4)), {"device": "meta"}, ValueError, "copies to a CUDA device"),
        (DataLoader(range(4)), {"device": "banana"}, ValueError, "device 'banana' is not a device: give a CUDA device"),
        (DataLoader(range(4)), {"lock": "bogus"}, ValueError, "lock='bogus': choose one of 'auto', 'required'"),
    ],
)
def test_bad_arguments_are_refused_by_name(loader: Any, options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        numafast.torch.NumaLoader(loader, **options)


def test_numpy_integers_are_integers() -> None:
    """Sizes read from a config array or computed with NumPy (np.int64) are taken as ints."""
    loader = numafast.torch.NumaLoader(
        DataLoader(range(8), batch_size=4), slots=np.int64(3), prefetch=np.int32(1), max_pinned_bytes=np.int64(1 << 26)
    )
    assert (loader.slots, loader.prefetch, loader.max_pinned_bytes) == (3, 1, 1 << 26)
    assert type(loader.slots) is int and type(loader.max_pinned_bytes) is int
    assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(numafast.InvalidSizeError, match=r"slots must be a positive integer or None, not 2.5"):
        numafast.torch.NumaLoader(DataLoader(range(4)), slots=2.5)


def test_a_cuda_device_without_cuda_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the device path is tested in test_pool_cuda.py")
    with pytest.raises(numafast.CudaUnavailable, match="device 'cuda:0': this PyTorch .* without CUDA|no CUDA device"):
        numafast.torch.NumaLoader(DataLoader(range(4)), device="cuda:0")


# ---------------------------------------------------------------- placement


def check_placement(node: int, *, workers: int) -> None:
    """A NumaLoader on ``node``: where its workers may run, what memory policy they
    have, where its batches are and that they are locked and were not copied, all
    asked of the kernel; and that the iterating thread got its own placement back."""
    cpus = sorted(cpu for near in nearest_cpu_nodes(node) for cpu in node_cpus(near))
    mine = os.sched_getaffinity(0)
    loader = DataLoader(Numbers(12, size=4096), batch_size=2, num_workers=workers, worker_init_fn=set_marker)
    wrapped = numafast.torch.NumaLoader(loader, node=node, lock="best-effort")  # locked (auto: only with a GPU)
    for _batch in wrapped:  # the first epoch: its first batches, copied in, size the pool
        pass
    del _batch
    first = wrapped.stats().copied
    assert 0 < first <= 2 * workers  # at most the batches in flight before the first arrived
    before = set(shared_memory_mappings())
    count = 0
    for batch in wrapped:  # each checked, then let go, as a training loop does
        count += 1
        assert held_in_pools(wrapped, [batch])
        assert batch["seed"].tolist() in ([1000, 1000], [1001, 1001])  # the user's worker_init_fn ran too
        assert all(row == cpus for row in _per_sample(batch["cpus"])), (node, batch["cpus"])
        modes = batch["policy"][0].tolist()
        nodes = _per_sample(batch["policy"][1])
        assert modes == [numafast._libnuma.MPOL_PREFERRED] * 2 and nodes == [[node], [node]], batch["policy"]
        assert set(pagemap_nodes(batch["values"].data_ptr(), batch["values"].nbytes)) == {node}
        assert pages_mlocked(batch["values"].data_ptr(), batch["values"].nbytes)
        assert set(shared_memory_mappings()) <= before  # no shared-memory file for a landed batch
    del batch
    assert os.sched_getaffinity(0) == mine  # iter() forked the workers inside the node's scope, then left it
    assert count == 6 and loader.worker_init_fn is set_marker  # put back once the workers started
    stats = wrapped.stats()
    assert stats.batches == 12 and stats.copied == first, stats  # the second epoch's every batch landed


def _per_sample(collated_cpus: Any) -> list[list[int]]:
    """default_collate turns each sample's CPU list into columns of tensors: rows back."""
    return [list(row) for row in zip(*[column.tolist() for column in collated_cpus])]


def test_workers_run_on_the_node_and_batches_land_there_here() -> None:
    check_placement(NODES[0], workers=2)


@pytest.mark.numa(nodes=4)
def test_workers_run_on_each_node_and_batches_land_there() -> None:
    for node in CPU_NODES:
        check_placement(node, workers=1)


def on_one_cpu(worker_id: int) -> None:
    """A user's worker_init_fn that places each worker itself: on one of the CPUs it may use."""
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {allowed[worker_id % len(allowed)]})


@SEMANTICS
def test_a_worker_that_the_users_worker_init_fn_placed_stays_where_it_was_put() -> None:
    """NumaLoader binds each worker to the node at its first batch, after the user's
    worker_init_fn; one whose CPUs that function changed keeps them, at every batch
    of every epoch (the kernel's answer, read inside the worker per sample)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs this process may run on: with one, a worker has nowhere else to be put")
    loader = numafast.torch.NumaLoader(DataLoader(Numbers(16, size=64), batch_size=2, num_workers=2,
                                                  worker_init_fn=on_one_cpu))  # fmt: skip
    for _epoch in range(2):  # the first (copied in) and the second (landed)
        where: dict[int, set[tuple[int, ...]]] = {}
        for batch in loader:
            for pid, cpus in zip(batch["pid"].tolist(), _per_sample(batch["cpus"])):
                where.setdefault(pid, set()).add(tuple(cpus))
        assert len(where) == 2 and all(len(cpus) == 1 and len(next(iter(cpus))) == 1 for cpus in where.values()), where


def onto_the_cpu_the_dataset_names(worker_id: int) -> None:
    """A user's worker_init_fn that puts the worker on one CPU, ``dataset.elsewhere``."""
    os.sched_setaffinity(0, {torch.utils.data.get_worker_info().dataset.elsewhere})


@pytest.mark.numa(nodes=2)
def test_a_worker_that_the_users_worker_init_fn_put_off_the_node_moves_to_it() -> None:
    """Put on another node's CPU (as an OpenMP runtime that binds to the first CPU does),
    the worker moves to the loader's node at its first batch: the samples it reads from
    then on say so, those of its first batch (read before) the CPU it was put on."""
    if len(CPU_NODES) < 2:
        pytest.skip("needs 2 nodes with CPUs")
    node, other = CPU_NODES[:2]
    dataset = Numbers(8, size=64)
    dataset.elsewhere = min(node_cpus(other))  # type: ignore[attr-defined]
    cpus = sorted(cpu for near in nearest_cpu_nodes(node) for cpu in node_cpus(near))
    loader = numafast.torch.NumaLoader(DataLoader(dataset, batch_size=2, num_workers=1,
                                                  worker_init_fn=onto_the_cpu_the_dataset_names), node=node)  # fmt: skip
    rows = [_per_sample(batch["cpus"]) for batch in loader]
    assert rows[0] == [[dataset.elsewhere]] * 2 and all(row == [cpus, cpus] for row in rows[1:]), rows


@pytest.mark.numa(nodes=3, memory_only=True)
def test_a_memory_only_node_is_fed_from_its_nearest_cpus() -> None:
    for node in cpuless_nodes_with_memory():
        check_placement(node, workers=1)


@SEMANTICS
def test_a_loader_a_framework_makes_again_from_the_users_arguments_counts_on_the_users_handle() -> None:
    """What Lightning does with the loader a user returns from a hook: the same class made
    again from the arguments the user's was made with, plus its DistributedSampler (its
    own functions, as its trainer calls them). The loader the user holds counts the
    copy's batches, which land in the same pools: found by the collate function numafast
    put among the saved arguments, not by the dataset, which another loader may share."""
    data = pytest.importorskip("lightning.fabric.utilities.data")
    dataset = Numbers(16)
    with data._replace_dunder_methods(DataLoader, "dataset"):
        own = numafast.torch.NumaLoader(dataset, batch_size=4, num_workers=2)
        evaluate = numafast.torch.NumaLoader(dataset, 4, num_workers=2)  # over the same dataset: its own pools
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    made = data._update_dataloader(own, sampler)
    assert type(made) is numafast.torch.NumaLoader and made is not own
    batches = list(made)
    assert [batch["index"].tolist() for batch in batches] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert made.pools is own.pools and evaluate.pools is not own.pools
    del batches  # the first epoch's batches were copied in, making the pool; the second's land
    assert [batch["index"].tolist() for batch in made] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert own.stats().batches == made.stats().batches == 4 and own.stats().landed > 0
    again = data._update_dataloader(evaluate, sampler)
    assert again.pools is evaluate.pools and [batch["index"].tolist() for batch in again] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert own.stats().batches == 4 and evaluate.stats().batches == 2


@SEMANTICS
def test_workers_that_cannot_map_the_board_send_every_batch_to_be_copied_warned_once() -> None:
    """The board's descriptor is not that file any more where the workers look (as for a
    spawned worker denied the owner's /proc/PID/fd): every batch still arrives whole, in
    order, pinned by the main process's copy, counted under that reason, with one warning
    naming the cause and the fix."""
    from dataclasses import replace

    stock = make_loader(Numbers(30), shuffle=False)
    loader = numafast.torch.NumaLoader(stock, lock="off")
    collate = loader.collate_fn
    assert isinstance(collate, SlotCollate)
    collate.board = replace(collate.board, inode=1)  # what the workers open: a file of another inode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(loader)
    assert all(same(got, want) for got, want in zip(batches, stock, strict=True))
    stats = loader.stats()
    assert stats.landed == 0 and stats.fallbacks == {"worker cannot map the pool": len(batches)}, stats
    said = [w for w in caught if "cannot map" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "cannot open a loader's pool board" in str(said[0].message) and "/proc/PID/fd" in str(said[0].message)
    assert said[0].filename == __file__  # at the user's line
