"""page_nodes and placement on a kernel with several nodes, against pagemap + sysfs."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

import numafast
from numafast import _libnuma
from sysfs_truth import PAGE_SIZE, online_nodes, pagemap_nodes

NODES = online_nodes()


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def truth(array: np.ndarray) -> list[int | None]:
    return pagemap_nodes(address_of(array), array.nbytes)


@pytest.mark.numa(nodes=3)
def test_page_nodes_agrees_page_for_page_with_pagemap() -> None:
    array = numafast.empty(2 << 20, np.uint8, nodes=NODES, hugepages=False)
    numafast.migrate(array[: 1 << 20], NODES[-1])  # half of it moved: a mixed layout
    # page_nodes counts the statuses of the move_pages(2) mirror; pagemap is the other path.
    status = list(_libnuma.move_pages(array))
    assert [s if s >= 0 else None for s in status] == truth(array)
    counts = Counter(truth(array))
    assert numafast.page_nodes(array) == numafast.PageNodes(counts)
    assert len(counts) == len(NODES)


@dataclasses.dataclass
class Batch:
    images: np.ndarray
    labels: list[np.ndarray]
    extra: dict[str, tuple[np.ndarray, ...]]


@pytest.mark.numa(nodes=3)
def test_placement_of_a_nested_batch_matches_the_kernel() -> None:
    home, away, far = NODES[0], NODES[1], NODES[2]
    batch = Batch(
        images=numafast.empty((256, 1024), np.float32, node=home),
        labels=[numafast.empty(8192, np.int64, node=away), numafast.empty(8192, np.int64, node=home)],
        extra={"boxes": (numafast.empty(16384, np.float32, node=far),)},
    )
    report = numafast.placement(batch, node=home)
    expected: Counter[int | None] = Counter()
    for array in (batch.images, *batch.labels, batch.extra["boxes"][0]):
        expected.update(truth(array))
    assert dict(report.pages) == dict(expected) and report.pages.untouched == 0
    remote = sum(n for node, n in expected.items() if node != home)
    assert report.remote_pages == remote
    assert report.remote_share == pytest.approx(remote / sum(expected.values()))
    pages = (64 << 10) // PAGE_SIZE  # each of these arrays is 64 KiB
    assert report.leaves[".labels[0]"] == numafast.PageNodes({away: pages})
    assert report.leaves[".extra['boxes'][0]"] == numafast.PageNodes({far: pages})
