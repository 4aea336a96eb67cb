"""NumaLoader against the stock DataLoader on a transport-bound pipeline: the workers
do almost nothing but collate, so what is measured is how a batch reaches the
consumer (issue 17's goal: landing pinned on the node costs nothing).

Batches of 64 images 3x224x224, uint8 (9.2 MiB) and float32 (36.8 MiB), from 2
persistent workers. Cases, each measured in the same run:

* stock ``DataLoader(pin_memory=False)``: the baseline (workers collate into a new
  shared-memory file per batch, the main process maps it);
* stock plus a pin thread that copies each batch into a new tensor, as PyTorch's
  pin thread does on a GPU machine (without an accelerator ``pin_memory=True`` skips
  it, so it is emulated here);
* NumaLoader (workers collate straight into slots of its page-locked pool);
* the pin_memory hook, driven by PyTorch's own ``pin_memory()`` in a pin thread
  (emulated the same way).

Each prints samples/s and the main process's CPU seconds per GiB delivered, with
ratios to the baseline. ``python3 -m pytest bench/bench_loader.py``
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import numafast
from bench_pool import NODE, ROUNDS, record, table  # noqa: F401 - table is the report fixture

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402
from numafast.torch.hook import PinMemoryHook  # noqa: E402

TITLE = "loaders, 2 workers, 64 x 3x224x224 per batch"
BATCH = 64
BATCHES = 12  # per round (an epoch of persistent workers)
WORKERS = 2
GIB = 1 << 30
DTYPES = {"uint8": torch.uint8, "float32": torch.float32}


class Images(Dataset):  # type: ignore[type-arg]
    """Ready-made samples: the workers only pick one and collate."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.samples = [torch.full((3, 224, 224), index, dtype=dtype) for index in range(8)]

    def __len__(self) -> int:
        return BATCH * BATCHES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.samples[index % 8], index


def stock(dtype: torch.dtype) -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(Images(dtype), batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)


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


def consume(batches: Iterator[Any]) -> int:
    """Count the samples; touch one byte per batch, as a consumer reading it would."""
    samples = 0
    for images, labels in batches:
        samples += len(labels)
        images.view(-1)[-1].item()
    return samples


def measure(benchmark, table, dtype_name: str, case: str, epoch: Callable[[], Iterator[Any]]) -> None:  # type: ignore[no-untyped-def]
    """samples/s (through pytest-benchmark) and the main process's CPU s/GiB of ``epoch``."""
    nbytes = BATCH * BATCHES * 3 * 224 * 224 * DTYPES[dtype_name].itemsize
    cpu: list[float] = []

    def run() -> None:
        start = time.process_time()
        consume(epoch())
        cpu.append(time.process_time() - start)

    group = f"{dtype_name} batches of {BATCH * 3 * 224 * 224 * DTYPES[dtype_name].itemsize / 2**20:.1f} MiB"
    record(benchmark, table, group, case, run, unit="samples/s", scale=lambda seconds: BATCH * BATCHES / seconds)
    if benchmark.stats is not None:
        cpu_per_gib = sorted(cpu)[len(cpu) // 2] / (nbytes / GIB)
        table.setdefault(f"{group}: main-process CPU", {})[case] = (cpu_per_gib * 1000, "ms/GiB")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_stock(benchmark, table, dtype_name: str) -> None:  # type: ignore[no-untyped-def]
    loader = stock(DTYPES[dtype_name])
    measure(benchmark, table, dtype_name, "stock DataLoader(pin_memory=False) (baseline)", lambda: iter(loader))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_stock_with_a_pin_thread(benchmark, table, dtype_name: str) -> None:  # type: ignore[no-untyped-def]
    loader = stock(DTYPES[dtype_name])

    def copy(batch: Any) -> Any:
        images, labels = batch
        return images.clone(), labels.clone()  # a new host buffer and a copy: torch's pin step without CUDA

    measure(benchmark, table, dtype_name, "stock + a pin thread copying each batch (emulated)",
            lambda: with_pin_thread(iter(loader), copy))  # fmt: skip


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_numa_loader(benchmark, table, dtype_name: str) -> None:  # type: ignore[no-untyped-def]
    loader = numafast.torch.NumaLoader(stock(DTYPES[dtype_name]), node=NODE)
    measure(benchmark, table, dtype_name, "NumaLoader (collated into pinned slots on the node)", lambda: iter(loader))
    stats = loader.stats()
    assert stats.landed > 0 and set(stats.fallbacks) <= {"first batches"}, stats


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_pin_memory_hook(benchmark, table, dtype_name: str) -> None:  # type: ignore[no-untyped-def]
    from torch.utils.data._utils.pin_memory import pin_memory

    loader = stock(DTYPES[dtype_name])
    hook = PinMemoryHook(loader, NODE, None, slots=WORKERS * 2 + 4, installed=True, reason="")  # what pin_memory_hook makes with CUDA
    measure(benchmark, table, dtype_name, "pin_memory_hook, torch's pin_memory() in a pin thread (emulated)",
            lambda: with_pin_thread(iter(loader), pin_memory))  # fmt: skip
    stats = hook.stats()
    assert stats is not None and stats.landed > 0, stats
