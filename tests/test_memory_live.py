"""Where memory lands on a kernel with several nodes (the 4-node and memory-only guests).

The truth is asked of the kernel without numafast's move_pages mirror: each page's
frame from /proc/self/pagemap and the node owning that frame's memory block in
sysfs (tests/sysfs_truth.py), plus the mapping's line in /proc/self/numa_maps.
Arrays are a few MiB: enough pages to count, little work under TCG.
"""

from __future__ import annotations

import numpy as np
import pytest

import numafast
from sysfs_truth import (
    PAGE_SIZE,
    cpuless_nodes_with_memory,
    nearest_cpu_nodes,
    node_cpus,
    numa_maps_of,
    online_nodes,
    pagemap_nodes,
)

NODES = online_nodes()
MIB = 1 << 20


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def whole_page_nodes(array: np.ndarray) -> list[int | None]:
    """Truth for the pages wholly inside ``array`` (those mbind and migrate act on)."""
    start = -(-address_of(array) // PAGE_SIZE) * PAGE_SIZE
    end = (address_of(array) + array.nbytes) // PAGE_SIZE * PAGE_SIZE
    return pagemap_nodes(start, end - start)


def other_node(node: int) -> int:
    return NODES[(NODES.index(node) + 1) % len(NODES)]


@pytest.mark.numa(nodes=3)
@pytest.mark.parametrize(("size", "hugepages"), [(100, True), (4 * MIB, False), (4 * MIB, True)])
def test_empty_lands_entirely_on_each_node(size: int, hugepages: bool) -> None:
    for node in NODES:  # the memory-only node included, in that guest
        array = numafast.empty(size, np.uint8, node=node, hugepages=hugepages)
        pages = pagemap_nodes(address_of(array), array.nbytes)
        assert set(pages) == {node}, f"node {node}: {sorted(set(pages), key=str)}"
        policy, counts = numa_maps_of(address_of(array))
        assert policy == f"bind:{node}" and set(counts) == {node}, (policy, counts)


@pytest.mark.numa(nodes=3, memory_only=True)
def test_memory_only_node_is_filled_from_its_nearest_cpus() -> None:
    for node in cpuless_nodes_with_memory():
        array = numafast.zeros((512, 1024), np.float32, node=node)
        assert set(pagemap_nodes(address_of(array), array.nbytes)) == {node}
        assert not array.any()
        # Big allocations pre-touch from threads pinned to the nearest node with CPUs
        # (small ones from the caller); drive that path directly on a small mapping.
        cpus = numafast.memory._pretouch_cpus([node])
        assert cpus == sorted(cpu for near in nearest_cpu_nodes(node) for cpu in node_cpus(near))
        region = numafast._libnuma.mmap_anonymous(4 * MIB)
        numafast.mbind(region, node)
        numafast._libnuma.pretouch(region, cpus, 2)
        view = np.frombuffer(region, dtype=np.uint8)
        assert set(pagemap_nodes(address_of(view), view.nbytes)) == {node}


@pytest.mark.numa(nodes=3)
def test_interleave_goes_round_robin_page_by_page() -> None:
    array = numafast.empty(64 * PAGE_SIZE, np.uint8, nodes=NODES, hugepages=False)
    pages = pagemap_nodes(address_of(array), array.nbytes)
    assert None not in pages
    # The kernel picks a page's node from its offset, so the cycle may start anywhere.
    for here, following in zip(pages, pages[1:]):
        assert following == other_node(here), pages
    assert numa_maps_of(address_of(array))[0] == "interleave:" + numafast._validate.format_ids(NODES)


@pytest.mark.numa(nodes=3)
def test_mbind_with_move_moves_an_existing_arrays_pages() -> None:
    array = np.ones(MIB // 8)  # numpy's own memory, touched here, on this CPU's node
    home = pagemap_nodes(address_of(array) + array.nbytes // 2, 1)[0]
    target = other_node(home)  # type: ignore[arg-type]
    numafast.mbind(array, target, move=True)
    assert set(whole_page_nodes(array)) == {target}
    assert (array == 1).all()


@pytest.mark.numa(nodes=3)
def test_mbind_interleave_with_move_spreads_the_pages_off_its_nodes() -> None:
    array = np.ones(MIB // 8)
    home = pagemap_nodes(address_of(array) + array.nbytes // 2, 1)[0]
    others = [n for n in NODES if n != home]
    numafast.mbind(array, others, mode="interleave")
    pages = whole_page_nodes(array)
    assert set(pages) == set(others)  # every page left home, over all the other nodes
    for here, following in zip(pages, pages[1:]):  # in the kernel's interleave order
        assert following == others[(others.index(here) + 1) % len(others)]  # type: ignore[arg-type]


@pytest.mark.numa(nodes=3)
def test_mbind_without_move_leaves_pages_where_they_are() -> None:
    array = np.ones(MIB // 8)
    before = whole_page_nodes(array)
    numafast.mbind(array, other_node(before[0]), move=False)  # type: ignore[arg-type]
    assert whole_page_nodes(array) == before


@pytest.mark.numa(nodes=3)
def test_migrate_moves_every_touched_page_and_counts_them() -> None:
    for target in NODES:  # the memory-only node included, in that guest
        array = numafast.empty(MIB, np.uint8, nodes=NODES, hugepages=False)
        array[:] = 5
        before = whole_page_nodes(array)
        moved = numafast.migrate(array, target)
        assert moved == sum(node != target for node in before)
        assert set(whole_page_nodes(array)) == {target}
        assert (array == 5).all()
        assert numafast.migrate(array, target) == 0


@pytest.mark.numa(nodes=3)
def test_migrate_leaves_untouched_pages_untouched() -> None:
    region = numafast._libnuma.mmap_anonymous(16 * PAGE_SIZE)
    view = np.frombuffer(region, dtype=np.uint8)
    view[: 8 * PAGE_SIZE] = 1
    target = other_node(pagemap_nodes(address_of(view), 1)[0])  # type: ignore[arg-type]
    assert numafast.migrate(region, target) == 8
    assert whole_page_nodes(view) == [target] * 8 + [None] * 8


@pytest.mark.numa(nodes=3)
def test_a_node_too_small_for_the_request_is_named_with_its_free_bytes() -> None:
    node = NODES[-1]
    free = numafast._libnuma.node_size64(node)[1]
    with pytest.raises(numafast.NodeMemoryError, match=rf"node {node} has \d+ bytes free"):
        numafast.empty(free + 64 * MIB, np.uint8, node=node)
