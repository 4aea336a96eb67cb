"""NumaLoader against the stock DataLoader and against the pipeline's own ceiling, on a
transport-bound pipeline: the workers only make each sample (a clone of a ready
image, filled with its index) and collate, so what is measured is how a batch
reaches the consumer.

Kinds of batch: 64 images 3x224x224 in uint8 (9.19 MiB) and float32 (36.75 MiB),
and 256 images 3x32x32 in uint8 (0.75 MiB), from 2 persistent workers. Cases, each
measured in the same run:

* stock ``DataLoader(pin_memory=False)``: the baseline (workers collate into a new
  shared-memory file per batch, the main process maps it);
* the ceiling: the same workers doing the same work, stacking each batch into a
  buffer they reuse (``torch.stack(..., out=buffer)``, the labels into another) and
  sending only its length (its consumer reads a stand-in batch instead, so that the
  consumer's own work per batch is the same in every case). No loader that delivers
  the batch can beat it with the same workers; what NumaLoader loses against it is
  its own cost per batch;
* stock plus a pin thread that copies each batch into a new tensor, as PyTorch's
  pin thread does on a GPU machine (without an accelerator ``pin_memory=True`` skips
  it, so it is emulated here);
* NumaLoader (workers collate straight into slots of its page-locked pool);
* NumaLoader through ``accelerate``'s ``Accelerator().prepare()`` (a
  ``DataLoaderShard`` made from its settings), where accelerate is installed;
* the pin_memory hook, its batches taken off the workers' queue in a thread, as
  PyTorch's pin thread does (emulated: with CUDA that thread's ``pin_memory()``
  returns the already-pinned tensors as they are).

Each prints samples/s (median of the rounds after one warm-up epoch), the main
process's CPU per GiB and per batch and its minor page faults per batch (as the
kernel counts them: getrusage), with ratios to the baseline; NumaLoader's
slowest round is also reported against the ceiling's median (the goal: every round
after the first epoch within 10% of the ceiling). Then, per kind, rounds of the
ceiling and of NumaLoader alternated (8x longer, each pair in the other order from
the one before), each NumaLoader round against the ceiling round of its pair: the
median and the slowest of those ratios are the fairest reading on a machine whose
speed drifts. A group times a new loader's first batch and a short epoch (8
batches): stock, a first NumaLoader (its pools made then), and a NumaLoader
re-created on the same node (the pools of the one it replaces taken over). A last
group has consumers that keep batches (issue 33: an eval loop keeping each batch's
labels, ``list(loader)``; 512 batches of 8 3x32x32 float32 images per epoch, 2
persistent workers, forked and spawned): rounds of stock and of NumaLoader
alternated, each NumaLoader round against the stock round of its pair (goal >= 0.95x).
``python3 -m pytest bench/bench_loader.py``
"""

from __future__ import annotations

import queue
import resource
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import numafast
from bench_pool import NODE, ROUNDS, record, table  # noqa: F401 - table is the report fixture

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402
from numafast.torch.hook import PinMemoryHook  # noqa: E402

TITLE = "loaders, 2 persistent workers"
WORKERS = 2
GIB = 1 << 30
# name -> (batch size, image shape, dtype, batches per round)
KINDS: dict[str, tuple[int, tuple[int, ...], torch.dtype, int]] = {
    "uint8 64x3x224x224": (64, (3, 224, 224), torch.uint8, 12),
    "float32 64x3x224x224": (64, (3, 224, 224), torch.float32, 8),
    "uint8 256x3x32x32": (256, (3, 32, 32), torch.uint8, 48),
}
SHORT_EPOCH = 8  # batches, for the time to a new loader's first batch and epoch
_slowest: dict[str, float] = {}


class Images(Dataset):  # type: ignore[type-arg]
    """Sample i: a clone of a ready image, filled with i, and i."""

    def __init__(self, kind: str, batches: int | None = None) -> None:
        batch, shape, dtype, per_round = KINDS[kind]
        self.ready = torch.zeros(shape, dtype=dtype)
        self.count = batch * (batches or per_round)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.ready.clone().fill_(index % 251), index


class StackIntoOwnBuffer:
    """The ceiling's collate_fn: the same collating (images stacked, labels made int64),
    into buffers the worker keeps; only the batch's length travels. The labels go in
    the cheapest way known (NumPy's conversion of the list, ~10 us for 256), as
    NumaLoader's struct packing does: without them the ceiling did less work than
    any loader that delivers the batch."""

    def __init__(self) -> None:
        self.images: torch.Tensor | None = None
        self.labels = np.empty(0, np.int64)

    def __call__(self, samples: list[tuple[torch.Tensor, int]]) -> int:
        images = [image for image, _index in samples]
        if self.images is None or self.images.shape[0] < len(images):
            self.images = torch.empty((len(images), *images[0].shape), dtype=images[0].dtype)
            self.labels = np.empty(len(images), np.int64)
        torch.stack(images, out=self.images[: len(images)])
        self.labels[: len(samples)] = [index for _image, index in samples]
        return len(samples)


def stock(kind: str, batches: int | None = None, **options: Any) -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(Images(kind, batches), batch_size=KINDS[kind][0], num_workers=WORKERS, persistent_workers=True,
                      **options)  # fmt: skip


def with_pin_thread(batches: Iterator[Any], pin: Callable[[Any], Any]) -> Iterator[Any]:
    """``batches`` through a thread that applies ``pin`` to each, two ahead, as
    PyTorch's pin thread does."""
    handed: queue.Queue[Any] = queue.Queue(maxsize=2)
    end = object()

    def run() -> None:
        for batch in batches:
            handed.put(pin(batch))
        handed.put(end)

    threading.Thread(target=run, daemon=True).start()
    while (batch := handed.get()) is not end:
        yield batch


def consume(batches: Iterator[Any], stand_in: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
    """Count the samples; touch one byte per batch, as a consumer reading it would. The
    ceiling's batches are their lengths only: for each, its consumer reads ``stand_in``
    (a batch of the same kind, made once) instead, so that the consumer's own work per
    batch, which is no loader's, is the same in every case."""
    samples = 0
    for batch in batches:
        images, labels = stand_in if isinstance(batch, int) else batch
        samples += len(labels)
        images.view(-1)[-1].item()
    return samples


def stand_in(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``kind``, for the ceiling's consumer to read."""
    batch, shape, dtype, _per_round = KINDS[kind]
    return torch.zeros((batch, *shape), dtype=dtype), torch.zeros(batch, dtype=torch.int64)


def after_warmup(values: list[Any]) -> Any:
    """The median of ``values`` but the first, the warm-up epoch's (a new slot's first
    use costs its pages' faults, once), as for samples/s."""
    rounds = sorted(values[1:])
    return rounds[len(rounds) // 2]


def measure(benchmark, table, kind: str, case: str, epoch: Callable[[], Iterator[Any]]) -> None:  # type: ignore[no-untyped-def]
    """samples/s (through pytest-benchmark), the main process's CPU per GiB and per batch
    of ``epoch``, and its minor page faults per batch."""
    batch, shape, dtype, batches = KINDS[kind]
    batch_bytes = batch * torch.Size(shape).numel() * dtype.itemsize
    cpu: list[float] = []
    faults: list[int] = []

    read = stand_in(kind) if case.startswith("ceiling") else None

    def run() -> None:
        start, faulted = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        assert consume(epoch(), read) == batch * batches
        cpu.append(time.process_time() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)

    group = f"{kind} batches of {batch_bytes / 2**20:.2f} MiB"
    record(benchmark, table, group, case, run, unit="samples/s", scale=lambda seconds: batch * batches / seconds,
           warmup=1)  # fmt: skip
    if benchmark.stats is None:
        return
    median_cpu = after_warmup(cpu)
    table.setdefault(f"{group}: main-process CPU", {})[case] = (median_cpu / (batch_bytes * batches / GIB) * 1000, "ms/GiB")
    table.setdefault(f"{group}: main-process CPU per batch", {})[case] = (median_cpu / batches * 1e6, "us/op")
    median_faults = after_warmup(faults)
    table.setdefault(f"{group}: main-process minor page faults per batch", {})[case] = (median_faults / batches, "faults/op")
    slowest = batch * batches / max(benchmark.stats.stats.data)
    if case.startswith("ceiling"):
        _slowest[kind] = benchmark.stats.stats.median
    elif case.startswith("NumaLoader") and kind in _slowest:
        ceiling_rate = batch * batches / _slowest[kind]
        table.setdefault(f"{group}: slowest round after the first epoch, vs the ceiling's median", {}).update(
            {"ceiling (median)": (ceiling_rate, "samples/s"), case: (slowest, "samples/s")}
        )


@pytest.mark.parametrize("kind", list(KINDS))
def test_stock(benchmark, table, kind: str) -> None:  # type: ignore[no-untyped-def]
    loader = stock(kind)
    measure(benchmark, table, kind, "stock DataLoader(pin_memory=False) (baseline)", lambda: iter(loader))


@pytest.mark.parametrize("kind", list(KINDS))
def test_ceiling(benchmark, table, kind: str) -> None:  # type: ignore[no-untyped-def]
    loader = stock(kind, collate_fn=StackIntoOwnBuffer())
    measure(benchmark, table, kind, "ceiling: the same workers, stacking into their own buffer, moving nothing",
            lambda: iter(loader))  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_stock_with_a_pin_thread(benchmark, table, kind: str) -> None:  # type: ignore[no-untyped-def]
    loader = stock(kind)

    def copy(batch: Any) -> Any:
        images, labels = batch
        return images.clone(), labels.clone()  # a new host buffer and a copy: torch's pin step without CUDA

    measure(benchmark, table, kind, "stock + a pin thread copying each batch (emulated)",
            lambda: with_pin_thread(iter(loader), copy))  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_numa_loader(benchmark, table, kind: str) -> None:  # type: ignore[no-untyped-def]
    loader = numafast.torch.NumaLoader(stock(kind), node=NODE)
    measure(benchmark, table, kind, "NumaLoader (collated into pinned slots on the node)", lambda: iter(loader))
    stats = loader.stats()
    assert stats.landed > 0 and set(stats.fallbacks) <= {"first batches"}, stats


@pytest.mark.parametrize("kind", list(KINDS))
def test_numa_loader_through_accelerate(benchmark, table, kind: str) -> None:  # type: ignore[no-untyped-def]
    accelerate = pytest.importorskip("accelerate")
    prepared = accelerate.Accelerator(cpu=True).prepare(numafast.torch.NumaLoader(stock(kind), node=NODE))
    measure(benchmark, table, kind, "NumaLoader through accelerate's prepare()", lambda: iter(prepared))
    stats = numafast.torch.loader_stats(prepared)
    assert stats is not None and stats.landed > 0 and set(stats.fallbacks) <= {"first batches"}, stats


@pytest.mark.parametrize("kind", list(KINDS))
def test_pin_memory_hook(benchmark, table, kind: str) -> None:  # type: ignore[no-untyped-def]
    loader = stock(kind)
    hook = PinMemoryHook(loader, NODE, None, slots=WORKERS * 2 + 4, installed=True, reason="")  # what pin_memory_hook makes with CUDA
    measure(benchmark, table, kind, "pin_memory_hook, batches taken off the queue in a pin thread (emulated)",
            lambda: with_pin_thread(iter(loader), lambda batch: batch))  # fmt: skip
    stats = hook.stats()
    assert stats is not None and stats.landed > 0, stats


ALTERNATED_ROUNDS = 8  # x a kind's batches per round: rounds long enough to outlast a scheduling hiccup


def alternated_rounds(benchmark, table, group: str, rates: str, baseline: tuple[str, str, Any], loader: Any,  # type: ignore[no-untyped-def]
                      epoch: Callable[[Iterator[Any]], int], samples: int, quiet: bool = False) -> None:
    """Pairs of a baseline round and a NumaLoader round (each pair in the other order from
    the one before), each NumaLoader round against the baseline round of its pair: on a
    machine whose speed drifts (other guests on the host), the fairest ratio. ``baseline``
    is (its name, its row's label, the loader); ``epoch(iterator)`` consumes one epoch and
    returns its samples. Tabled under ``group`` (median and slowest round) and ``rates``
    (median samples/s of each, to tell a slow NumaLoader from a slow baseline: a ratio
    above 1 is the baseline's own bad run, not NumaLoader beating it)."""
    name, label, base = baseline
    ratios: list[float] = []
    rounds_seconds: dict[str, list[float]] = {name: [], "NumaLoader": []}

    def seconds(who: str, iterator: Iterator[Any]) -> float:
        start = time.perf_counter()
        assert epoch(iterator) == samples
        rounds_seconds[who].append(time.perf_counter() - start)
        return rounds_seconds[who][-1]

    def pair() -> None:
        # Which goes first alternates too: here the second round of a pair of the very same
        # loader ran ~3% faster than the first (median of 7 pairs: 1.00-1.09x).
        if len(ratios) % 2:
            numa_seconds = seconds("NumaLoader", iter(loader))
            ratios.append(seconds(name, iter(base)) / numa_seconds)
        else:
            base_seconds = seconds(name, iter(base))
            ratios.append(base_seconds / seconds("NumaLoader", iter(loader)))

    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        record(benchmark, table, group, f"{name} + NumaLoader, a round each", pair, unit="us/op",
               scale=lambda seconds: seconds * 1e6, warmup=1)  # fmt: skip
    if benchmark.stats is not None:
        rounds = sorted(ratios[1:])  # the first pair was the warm-up
        table[group] = {
            label: (1.0, "x"),
            "NumaLoader, median round": (rounds[len(rounds) // 2], "x"),
            "NumaLoader, slowest round": (rounds[0], "x"),
        }
        table[rates] = {who: (samples / sorted(taken[1:])[len(taken[1:]) // 2], "samples/s")
                        for who, taken in rounds_seconds.items()}  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_numa_loader_against_the_ceiling_alternated(benchmark, table, kind: str) -> None:  # type: ignore[no-untyped-def]
    """The ceiling (the same workers moving nothing) and NumaLoader, rounds alternated:
    the cases above each run their rounds back to back."""
    batch, _shape, _dtype, per_round = KINDS[kind]
    batches = per_round * ALTERNATED_ROUNDS
    ceiling = stock(kind, batches, collate_fn=StackIntoOwnBuffer())
    loader = numafast.torch.NumaLoader(stock(kind, batches), node=NODE)
    read = stand_in(kind)
    alternated_rounds(benchmark, table, f"{kind}: NumaLoader / the ceiling, rounds alternated (after one warm-up epoch)",
                      f"{kind}: the same rounds, median samples/s", ("ceiling", "the ceiling (each round)", ceiling),
                      loader, lambda epoch: consume(epoch, read), batch * batches)  # fmt: skip
    stats = loader.stats()
    assert stats.landed > 0 and set(stats.fallbacks) <= {"first batches"}, stats


# ---------------------------------------------------------------- a new loader's first batches

FIRST_KIND = "uint8 64x3x224x224"


def short_epoch(make: Callable[[], Any]) -> Callable[[], None]:
    """A new loader from ``make`` (not persistent), its first batch and an epoch of
    SHORT_EPOCH batches; the two times go to ``run.times``."""

    def run() -> None:
        start = time.perf_counter()
        iterator = iter(make())
        consume(iter([next(iterator)]))
        first = time.perf_counter() - start
        consume(iterator)
        times.append((first, time.perf_counter() - start))

    times: list[tuple[float, float]] = []
    run.times = times  # type: ignore[attr-defined]
    return run


def loader_options() -> dict[str, Any]:
    return {"batch_size": KINDS[FIRST_KIND][0], "num_workers": WORKERS}


@pytest.mark.parametrize(
    "case",
    ["stock DataLoader (baseline)", "a first NumaLoader (pools made)", "a re-created NumaLoader (pools taken over)"],
)
def test_new_loader(benchmark, table, case: str) -> None:  # type: ignore[no-untyped-def]
    dataset = Images(FIRST_KIND, batches=SHORT_EPOCH)
    if case.startswith("stock"):
        def make() -> Any:
            return DataLoader(dataset, **loader_options())
    else:
        def make() -> Any:
            return numafast.torch.NumaLoader(DataLoader(dataset, **loader_options()), node=NODE)
    run = short_epoch(make)
    group = f"a new loader, {FIRST_KIND}: time to the end of an epoch of {SHORT_EPOCH} batches"
    # A first loader finds no idle pools: the ones the last round left are released untimed.
    def release_idle_pools() -> None:
        numafast.torch.close_idle_pools()

    setup = release_idle_pools if case.startswith("a first") else None
    record(benchmark, table, group, case, run, unit="us/op", scale=lambda seconds: seconds * 1e6, warmup=1,
           setup=setup)  # fmt: skip
    if benchmark.stats is not None:
        firsts = sorted(first for first, _whole in run.times)  # type: ignore[attr-defined]
        table.setdefault(f"a new loader, {FIRST_KIND}: time to its first batch", {})[case] = (
            firsts[len(firsts) // 2] * 1e6, "us/op"
        )


# ---------------------------------------------------------------- consumers that keep batches

KEPT_BATCHES = 512  # per epoch, of KEPT_BATCH images 3x32x32 float32 (96 KiB a batch)
KEPT_BATCH = 8


class SmallImages(Dataset):  # type: ignore[type-arg]
    """Sample i: a 3x32x32 float32 image filled with i, and i."""

    def __init__(self) -> None:
        self.ready = torch.zeros((3, 32, 32))

    def __len__(self) -> int:
        return KEPT_BATCHES * KEPT_BATCH

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.ready.clone().fill_(index % 251), index


def keep_labels(batches: Iterator[Any]) -> int:
    """An eval loop: reads each batch, keeps its labels for metrics at the end (a view of
    the batch: with NumaLoader, of its slot)."""
    targets = []
    for images, labels in batches:
        images.view(-1)[-1].item()
        targets.append(labels)
    return sum(len(labels) for labels in targets)


def keep_all(batches: Iterator[Any]) -> int:
    """A small dataset cached with list(loader)."""
    kept = list(batches)
    return sum(len(labels) for _images, labels in kept)


KEEPERS: dict[str, Callable[[Iterator[Any]], int]] = {"labels kept": keep_labels, "list(loader)": keep_all}


def kept_loader(start: str) -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(SmallImages(), batch_size=KEPT_BATCH, num_workers=WORKERS, persistent_workers=True,
                      multiprocessing_context=start)  # fmt: skip


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("consumer", list(KEEPERS))
def test_consumers_keeping_batches_against_stock_alternated(benchmark, table, consumer: str, start: str) -> None:  # type: ignore[no-untyped-def]
    """The stock loader and NumaLoader, rounds alternated, the consumer keeping every batch
    (or its labels) of the epoch: NumaLoader's pools grow at once, within
    max_pinned_bytes, as the owner copies in the batches that found every slot held,
    and are released when the consumer drops what it kept (before the next round's).
    The warning about kept batches is said once and tested elsewhere."""
    loader = numafast.torch.NumaLoader(kept_loader(start), node=NODE)
    alternated_rounds(benchmark, table, f"{consumer}, {start} workers: NumaLoader / stock, rounds alternated (after one warm-up pair)",
                      f"{consumer}, {start} workers: the same rounds, median samples/s",
                      ("stock", "stock DataLoader (each round)", kept_loader(start)), loader, KEEPERS[consumer],
                      KEPT_BATCHES * KEPT_BATCH, quiet=True)  # fmt: skip
    stats = loader.stats()
    # Copied: the first batches, and those in flight as each pool was added (copying them in added it).
    assert stats.unpinned == 0 and set(stats.fallbacks) <= {"first batches", "no free slot"}, stats
    print(f"\n{consumer}, {start} workers: NumaLoader copied {stats.copied} of {stats.batches} batches {stats.fallbacks}")
