"""Interleaved memory is spread evenly over its nodes, whatever its size (the multi-node guests).

A transparent huge page is one unit of interleave: a 2 MiB array in one huge page lands
whole on one node. numafast keeps huge only whole huge pages in a multiple of the node
count and the rest in base pages, so every node holds its share to within one base page:
for fresh arrays (empty, zeros, numafast.torch.empty) and for memory that already exists
(mbind with mode "interleave", huge pages included). The truth is the kernel's: each
page's frame from /proc/self/pagemap and the node owning its memory block in sysfs, the
mapping's AnonHugePages from /proc/self/smaps (tests/sysfs_truth.py). Sizes are small:
from one page to nine huge pages, a few seconds under TCG.
"""

from __future__ import annotations

import mmap
from collections import Counter

import numpy as np
import pytest

import numafast
from sysfs_truth import (
    PAGE_SIZE,
    anon_huge_bytes,
    numa_maps_of,
    online_nodes,
    pagemap_nodes,
    transparent_huge_page_size,
)

NODES = online_nodes()
HUGE = transparent_huge_page_size() or 2 << 20
SIZES = [PAGE_SIZE, 5 * PAGE_SIZE, HUGE, 4 * HUGE + 3 * PAGE_SIZE, 9 * HUGE + PAGE_SIZE]


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def assert_spread_evenly(address: int, nbytes: int) -> None:
    """Every page of [address, address + nbytes) is touched and on one of NODES, and each
    node holds its share of them to within one page."""
    counts = Counter(pagemap_nodes(address, nbytes))
    pages = sum(counts.values())
    assert None not in counts, counts
    assert set(counts) <= set(NODES), counts
    for node in NODES:
        assert abs(counts[node] - pages / len(NODES)) < 1, f"{pages} pages over nodes {NODES}: {dict(counts)}"


def even_huge_bytes(nbytes: int) -> int:
    """What stays in huge pages: whole ones, as many on each node (none without THP)."""
    unit = HUGE * len(NODES)
    return nbytes // unit * unit if transparent_huge_page_size() else 0


@pytest.mark.numa(nodes=3)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("make", [numafast.empty, numafast.zeros])
def test_fresh_interleaved_arrays_are_spread_evenly(make, size: int) -> None:  # type: ignore[no-untyped-def]
    array = make(size, np.uint8, nodes=NODES)
    assert_spread_evenly(address_of(array), array.nbytes)
    assert anon_huge_bytes(address_of(array)) == even_huge_bytes(size)
    assert not array.any()


@pytest.mark.numa(nodes=3)
def test_torch_empty_interleaved_is_spread_evenly() -> None:
    torch = pytest.importorskip("torch")
    import numafast.torch

    for size in (HUGE, 4 * HUGE + 3 * PAGE_SIZE):
        tensor = numafast.torch.empty(size // 4, dtype=torch.float32, nodes=NODES)
        assert_spread_evenly(tensor.data_ptr(), tensor.nbytes)
        assert anon_huge_bytes(tensor.data_ptr()) == even_huge_bytes(size)


@pytest.mark.numa(nodes=3)
@pytest.mark.parametrize("size", [HUGE, 5 * HUGE])
def test_mbind_interleave_respreads_an_array_in_huge_pages_on_one_of_the_nodes(size: int) -> None:
    array = numafast.empty(size, np.uint8, node=NODES[0])
    array[:] = 7
    assert anon_huge_bytes(address_of(array)) == (size if transparent_huge_page_size() else 0)
    numafast.mbind(array, NODES, mode="interleave")
    assert_spread_evenly(address_of(array), array.nbytes)
    assert anon_huge_bytes(address_of(array)) == even_huge_bytes(size)  # those moved whole, one per node
    assert numa_maps_of(address_of(array))[0] == "interleave:" + numafast._validate.format_ids(NODES)
    assert (array == 7).all()


@pytest.mark.numa(nodes=3)
def test_mbind_interleave_spreads_base_pages_already_on_one_of_the_nodes() -> None:
    array = np.ones(37 * PAGE_SIZE // 8)  # numpy's own memory, touched here, on this CPU's node
    start = -(-address_of(array) // PAGE_SIZE) * PAGE_SIZE
    end = (address_of(array) + array.nbytes) // PAGE_SIZE * PAGE_SIZE
    numafast.mbind(array, NODES, mode="interleave")
    assert_spread_evenly(start, end - start)
    assert (array == 1).all()


@pytest.mark.numa(nodes=3)
def test_mbind_interleave_without_move_spreads_the_pages_touched_later() -> None:
    # Fresh, private and untouched: under THP "always" (the guests' kernel default) each
    # aligned 2 MiB of it would become one huge page on one node at its first touch.
    region = mmap.mmap(-1, 4 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    numafast.mbind(region, NODES, mode="interleave", move=False)
    view = np.frombuffer(region, dtype=np.uint8)  # unmapped with the last of region and view
    view[:] = 1
    assert_spread_evenly(address_of(view), view.nbytes)
