"""Pinned pools: the cost of a slot, of pinning a batch, of making a pool, and a loader's throughput.

Each group measures its baseline in the same run and prints medians and ratios:

* acquire + release of a slot: a Python free list under a lock (what a hand-written
  pool does) and a fresh ``numpy.empty`` of the slot's size (no pool at all);
* ``numafast.torch.pin`` of one tensor into a slot vs a plain ``memcpy`` (ctypes
  memmove) of the same bytes into the same slot, one thread and all of the node's;
* making a 1 GiB pool (bind, parallel touch, lock) vs ``mmap`` + one thread touching
  every page + ``mlock``, and vs ``torch.empty(...).pin_memory()`` where CUDA is here;
* samples/s of a data-bound pipeline (workers making large float32 images): the
  stock DataLoader vs NumaLoader over the same DataLoader;
* with CUDA, host-to-device GB/s from pool slots vs ``pin_memory()`` tensors vs pageable memory.

    python3 -m pytest bench/bench_pool.py
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import numafast

GIB = 1 << 30
MIB = 1 << 20
NODE = numafast.pages.local_node()
ROUNDS = 7
OPS = 20_000  # acquire + release pairs per round
libc = ctypes.CDLL(None, use_errno=True)
TIME_UNITS = ("us/op", "ms/GiB", "faults/op")  # lower is better; every other unit is a rate


@pytest.fixture(scope="module")
def table(request: pytest.FixtureRequest) -> Iterator[dict[str, dict[str, tuple[float, str]]]]:
    """{group: {case: (median, unit)}}; the module's teardown prints each group with
    every case's ratio to the group's first (baseline) case."""
    groups: dict[str, dict[str, tuple[float, str]]] = {}
    yield groups
    title = getattr(request.module, "TITLE", "pinned pools")
    lines = [f"\n{title} on node {NODE}, medians of {ROUNDS} rounds:"]
    for group, cases in groups.items():
        lines.append(f"  {group}")
        base_name, (base, unit) = next(iter(cases.items()))
        for name, (value, unit) in cases.items():
            faster = (base / value if value else float("inf")) if unit in TIME_UNITS else value / base
            tag = "baseline" if name == base_name else f"{faster:5.2f}x the baseline (higher is better)"
            lines.append(f"    {name:<58} {value:10.3f} {unit:<10} {tag}")
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines), flush=True)


def record(benchmark, table, group: str, name: str, run: Callable[[], object], *,  # type: ignore[no-untyped-def]
           unit: str, scale: Callable[[float], float], warmup: int = 2,
           setup: Callable[[], object] | None = None) -> None:
    """Time ``run`` (``setup``, if given, runs untimed before each round)."""
    benchmark.group = group
    benchmark.name = name
    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=warmup)
    if benchmark.stats is not None:  # None under --benchmark-disable: each case ran once, untimed
        table.setdefault(group, {})[name] = (scale(benchmark.stats.stats.median), unit)


# ---------------------------------------------------------------- a slot

SLOT_BYTES = 1 * MIB
PER_OP = "us/op"


def per_op(seconds: float) -> float:
    return seconds / OPS * 1e6


def test_slot_python_free_list(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    buffers = [bytearray(SLOT_BYTES) for _ in range(4)]
    free = list(range(4))
    lock = threading.Lock()

    def cycle() -> None:
        for _ in range(OPS):
            with lock:
                index = free.pop()
            with lock:
                free.append(index)
        assert buffers

    record(benchmark, table, "acquire + release one slot", "Python free list under a lock (baseline)", cycle,
           unit=PER_OP, scale=per_op)  # fmt: skip


def test_slot_numpy_empty(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    def cycle() -> None:
        for _ in range(OPS):
            np.empty(SLOT_BYTES, np.uint8)

    record(benchmark, table, "acquire + release one slot", "numpy.empty of the slot size (no pool)", cycle,
           unit=PER_OP, scale=per_op)  # fmt: skip


def test_slot_pinned_pool(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    with numafast.PinnedPool(NODE, SLOT_BYTES, 4) as pool:
        acquire = pool.acquire

        def cycle() -> None:
            for _ in range(OPS):
                acquire()  # the Slot dies at once: its slot is back

        record(benchmark, table, "acquire + release one slot", "PinnedPool.acquire() + drop", cycle,
               unit=PER_OP, scale=per_op)  # fmt: skip
        assert pool.stats().in_use == 0


# ---------------------------------------------------------------- pinning a batch


@pytest.fixture(scope="module")
def copy_pools() -> Iterator[dict[int, numafast.PinnedPool]]:
    pools = {size: numafast.PinnedPool(NODE, size, 1) for size in (4 * MIB, 64 * MIB, 256 * MIB)}
    yield pools
    for pool in pools.values():
        pool.close()


def gbps(size: int) -> Callable[[float], float]:
    return lambda seconds: size / seconds / 1e9


@pytest.mark.parametrize("size", [4 * MIB, 64 * MIB, 256 * MIB])
def test_copy_memcpy(benchmark, table, copy_pools, size: int) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    source = torch.rand(size // 4)
    slot = copy_pools[size].acquire()
    target = np.asarray(slot)
    destination = target.__array_interface__["data"][0]

    def copy() -> None:
        ctypes.memmove(destination, source.data_ptr(), size)

    record(benchmark, table, f"copy {size >> 20} MiB into a slot", "memcpy, 1 thread (baseline)", copy,
           unit="GB/s", scale=gbps(size))  # fmt: skip
    del target, slot


@pytest.mark.parametrize("size", [4 * MIB, 64 * MIB, 256 * MIB])
@pytest.mark.parametrize("threads", [1, None])
def test_copy_pin(benchmark, table, copy_pools, size: int, threads: int | None) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    import numafast.torch
    from numafast.torch.slot import copy_threads

    pool = copy_pools[size]
    batch = {"images": torch.rand(size // 4)}
    count = copy_threads(size, len(pool.cpus), threads)  # what pin() will use

    def pin() -> None:
        numafast.torch.pin(batch, pool, threads=threads)

    label = "numafast.torch.pin, 1 thread" if threads == 1 else f"numafast.torch.pin, auto ({count} threads)"
    record(benchmark, table, f"copy {size >> 20} MiB into a slot", label, pin, unit="GB/s", scale=gbps(size))


# ---------------------------------------------------------------- making a pool

POOL_BYTES = 1 * GIB
MS_PER_GIB = "ms/GiB"


def ms_per_gib(seconds: float) -> float:
    return seconds * GIB / POOL_BYTES * 1e3


def test_create_mmap_touch_mlock(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    page = mmap.PAGESIZE

    def create() -> None:
        region = mmap.mmap(-1, POOL_BYTES)
        pages = np.frombuffer(region, dtype=np.uint8)
        pages[::page] = 0  # one thread touches every page
        address = ctypes.c_void_p(pages.__array_interface__["data"][0])
        if libc.mlock(address, ctypes.c_size_t(POOL_BYTES)) != 0:
            raise OSError(ctypes.get_errno(), "mlock")
        libc.munlock(address, ctypes.c_size_t(POOL_BYTES))
        del pages
        region.close()

    record(benchmark, table, "make a 1 GiB pinned region", "mmap + 1-thread touch + mlock (baseline)", create,
           unit=MS_PER_GIB, scale=ms_per_gib, warmup=1)  # fmt: skip


def test_create_torch_pin_memory(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch.empty(...).pin_memory() needs CUDA")
    record(benchmark, table, "make a 1 GiB pinned region", "torch.empty(...).pin_memory()",
           lambda: torch.empty(POOL_BYTES, dtype=torch.uint8).pin_memory(), unit=MS_PER_GIB, scale=ms_per_gib)  # fmt: skip


def test_create_private_region(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    """What a pool was before it became a shared memfd: private anonymous memory,
    bound, touched in parallel and locked the same way."""
    from numafast.memory import allocate

    def create() -> None:
        region = allocate(POOL_BYTES, node=NODE)
        numafast._libnuma.mlock(region)
        region.free()

    record(benchmark, table, "make a 1 GiB pinned region", "private anonymous (bind + parallel touch + lock)", create,
           unit=MS_PER_GIB, scale=ms_per_gib, warmup=1)  # fmt: skip


def test_create_pinned_pool(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    def create() -> None:
        numafast.PinnedPool(NODE, 64 * MIB, POOL_BYTES // (64 * MIB)).close()

    record(benchmark, table, "make a 1 GiB pinned region", "PinnedPool: shared memfd (bind + parallel touch + lock)",
           create, unit=MS_PER_GIB, scale=ms_per_gib, warmup=1)  # fmt: skip


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_copy_into_private_or_shared_memory(benchmark, table, shared: bool) -> None:  # type: ignore[no-untyped-def]
    """memcpy of 256 MiB into locked private anonymous memory vs a locked shared memfd
    mapping: a pool's slots are the second kind since workers write them."""
    from numafast.memory import allocate

    size = 256 * MIB
    fd = os.memfd_create("bench", os.MFD_CLOEXEC) if shared else None
    target = allocate(size, node=NODE, shared_file=fd)
    source = np.ones(size, dtype=np.uint8)

    def copy() -> None:
        numafast._libnuma.gather_copy(target, [0], [source])

    name = "shared memfd mapping" if shared else "private anonymous memory (baseline)"
    record(benchmark, table, "memcpy of 256 MiB into", name, copy, unit="GB/s", scale=gbps(size))
    target.free()
    if fd is not None:
        os.close(fd)


# ---------------------------------------------------------------- a data-bound pipeline

IMAGES = 256  # samples per round
WORKERS = 2


def image_loader(torch):  # type: ignore[no-untyped-def]
    class Images(torch.utils.data.Dataset):  # type: ignore[misc]
        """Large float32 images made by the workers (the data-bound part)."""

        def __len__(self) -> int:
            return IMAGES

        def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
            return torch.full((3, 224, 224), float(index)), index

    return torch.utils.data.DataLoader(Images(), batch_size=32, num_workers=WORKERS, persistent_workers=True)


def samples_per_second(seconds: float) -> float:
    return IMAGES / seconds


def test_pipeline_stock(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    loader = image_loader(torch)
    record(benchmark, table, f"pipeline, {WORKERS} workers, 3x224x224 float32",
           "stock DataLoader (baseline)", lambda: sum(len(b[1]) for b in loader), unit="samples/s",
           scale=samples_per_second)  # fmt: skip


def test_pipeline_stock_with_a_copy(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    loader = image_loader(torch)

    def run() -> int:
        # What the stock pin step does on a GPU machine: a fresh host buffer and a copy,
        # in the main process (without CUDA, pin_memory=True skips it).
        return sum(len(images.clone()) for images, _labels in loader)

    record(benchmark, table, f"pipeline, {WORKERS} workers, 3x224x224 float32",
           "stock DataLoader + a copy per batch (its pin step, emulated)", run, unit="samples/s",
           scale=samples_per_second)  # fmt: skip


def test_pipeline_numa_loader(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    import numafast.torch

    loader = numafast.torch.NumaLoader(image_loader(torch), node=NODE)
    record(benchmark, table, f"pipeline, {WORKERS} workers, 3x224x224 float32",
           "NumaLoader (workers on the node, batches collated into its pinned pool)", lambda: sum(len(b[1]) for b in loader),
           unit="samples/s", scale=samples_per_second)  # fmt: skip


# ---------------------------------------------------------------- host to device (CUDA only)

H2D_BYTES = 256 * MIB


def h2d_case(benchmark, table, name: str, make_host: Callable[[object], object]) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("host-to-device copies need CUDA")
    host = make_host(torch)
    device = torch.empty(H2D_BYTES, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    record(benchmark, table, f"host to device, {H2D_BYTES >> 20} MiB", name, copy, unit="GB/s", scale=gbps(H2D_BYTES))


def test_h2d_pageable(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    h2d_case(benchmark, table, "pageable memory (baseline)", lambda torch: torch.empty(H2D_BYTES, dtype=torch.uint8))  # type: ignore[attr-defined]


def test_h2d_pin_memory(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    h2d_case(benchmark, table, "torch pin_memory()", lambda torch: torch.empty(H2D_BYTES, dtype=torch.uint8).pin_memory())  # type: ignore[attr-defined]


def test_h2d_pool_slot(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    def from_pool(torch):  # type: ignore[no-untyped-def]
        gpu_node = numafast.topology().node_of_gpu(0)
        pool = numafast.PinnedPool(NODE if gpu_node is None else gpu_node, H2D_BYTES, 1, register="required")
        return torch.frombuffer(pool.acquire(), dtype=torch.uint8)

    h2d_case(benchmark, table, "PinnedPool slot on the GPU's node (registered)", from_pool)
