"""Ready-to-use node-local memory: allocate SIZE bytes and have every page faulted in.

Baselines measured in the same run: numpy.empty + fill with 4 KiB pages (naive first
touch), numpy.empty + fill as numpy does it by default (it asks for huge pages
itself above 4 MiB), numa_alloc_onnode + fill (libnuma's bound memory), torch.empty
+ fill_ (torch's own threads), and one thread's mmap + MADV_HUGEPAGE +
MADV_POPULATE_WRITE (the kernel's best single-call populate). Each round allocates,
populates and frees. The table at the end gives medians per GiB and ratios.

    python3 -m pytest bench/bench_alloc.py                (NUMAFAST_BENCH_MIB=256 by default)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import numafast
from numafast import _libnuma

SIZE = int(os.environ.get("NUMAFAST_BENCH_MIB", "256")) << 20
GIB = 1 << 30
NODE = numafast.pages.local_node()
# Two warm-up rounds each: the first huge-page allocations after other work can wait on
# the kernel to free up 2 MiB blocks (one 256 MiB round took 351 ms instead of 17 here).
BASELINE = "numpy.empty + fill, 4 KiB pages (naive first touch)"
ROUNDS = 7


@pytest.fixture(scope="module")
def medians(request: pytest.FixtureRequest) -> Iterator[dict[str, float]]:
    """Median seconds per case; the module's teardown prints them per GiB, with ratios."""
    results: dict[str, float] = {}
    yield results
    base = results.get(BASELINE)
    lines = [f"\nready-to-use allocation of {SIZE >> 20} MiB on node {NODE}, median of {ROUNDS} rounds:"]
    for name, seconds in sorted(results.items(), key=lambda item: item[1]):
        ratio = f"{base / seconds:5.2f}x naive first touch" if base else ""
        lines.append(f"  {name:<56} {seconds * GIB / SIZE * 1e3:7.1f} ms/GiB {SIZE / seconds / 1e9:6.2f} GB/s {ratio}")
    # Past pytest's output capture, which would swallow a teardown's print.
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n".join(lines), flush=True)


def measure(benchmark, medians: dict[str, float], name: str, allocate_and_fill: Callable[[], object]) -> None:  # type: ignore[no-untyped-def]
    benchmark.name = name
    benchmark.pedantic(allocate_and_fill, rounds=ROUNDS, iterations=1, warmup_rounds=2)
    medians[name] = benchmark.stats.stats.median


def numpy_madvise_hugepage(enabled: bool) -> bool:
    """numpy's switch for its own MADV_HUGEPAGE on large arrays; returns the old value."""
    core = getattr(np, "_core", None) or np.core
    return bool(core.multiarray._set_madvise_hugepage(enabled))


def test_numpy_empty_fill_4k_pages(benchmark, medians) -> None:  # type: ignore[no-untyped-def]
    previous = numpy_madvise_hugepage(False)
    try:
        measure(benchmark, medians, BASELINE, lambda: np.empty(SIZE, np.uint8).fill(0))
    finally:
        numpy_madvise_hugepage(previous)


def test_numpy_empty_fill_default(benchmark, medians) -> None:  # type: ignore[no-untyped-def]
    measure(benchmark, medians, "numpy.empty + fill, numpy's default (its THP madvise)",
            lambda: np.empty(SIZE, np.uint8).fill(0))  # fmt: skip


def test_numa_alloc_onnode_fill(benchmark, medians) -> None:  # type: ignore[no-untyped-def]
    def allocate_and_fill() -> None:
        memory = _libnuma.alloc_onnode(SIZE, NODE)
        np.frombuffer(memory, dtype=np.uint8).fill(0)  # one pass of stores, as memset
        memory.free()

    measure(benchmark, medians, "numa_alloc_onnode + fill (4 KiB pages)", allocate_and_fill)


def test_torch_empty_fill(benchmark, medians) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    measure(benchmark, medians, f"torch.empty + fill_ ({torch.get_num_threads()} torch threads)",
            lambda: torch.empty(SIZE, dtype=torch.uint8).fill_(0))  # fmt: skip


def test_populate_write_one_thread(benchmark, medians) -> None:  # type: ignore[no-untyped-def]
    def allocate_and_fill() -> None:
        memory = _libnuma.mmap_anonymous(SIZE, 2 << 20)
        _libnuma.madvise(memory, _libnuma.MADV_HUGEPAGE)
        _libnuma.madvise(memory, _libnuma.MADV_POPULATE_WRITE)
        memory.free()

    measure(benchmark, medians, "mmap + THP + MADV_POPULATE_WRITE, 1 thread", allocate_and_fill)


@pytest.mark.parametrize("hugepages", [True, False])
def test_numafast_empty(benchmark, medians, hugepages: bool) -> None:  # type: ignore[no-untyped-def]
    pages = "THP" if hugepages else "4 KiB pages"
    threads = len(numafast.memory._pretouch_cpus([NODE]))
    measure(benchmark, medians, f"numafast.empty ({pages}, {threads} pinned threads)",
            lambda: numafast.empty(SIZE, np.uint8, node=NODE, hugepages=hugepages))  # fmt: skip
