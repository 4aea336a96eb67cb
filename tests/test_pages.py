"""page_nodes and placement on any node count, against /proc/self/pagemap + sysfs."""

from __future__ import annotations

import dataclasses
import mmap
from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest

import numafast
from numafast import _libnuma
from sysfs_truth import PAGE_SIZE, online_nodes, pagemap_nodes, pinned_to_one_cpu

NODE = online_nodes()[0]


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def truth_counts(array: np.ndarray) -> tuple[dict[int, int], int]:
    """({node: pages}, untouched pages) of every page ``array`` touches, from pagemap."""
    nodes = Counter(pagemap_nodes(address_of(array), array.nbytes))
    untouched = nodes.pop(None, 0)
    return dict(nodes), untouched


def test_untouched_and_read_only_pages_are_reported_apart() -> None:
    with mmap.mmap(-1, 16 * PAGE_SIZE) as region:
        for page in range(4):
            region[page * PAGE_SIZE] = 1  # written: a frame of its own
        for page in range(4, 8):
            # Only read: most kernels map the shared zero page (-EFAULT), some a page of its own.
            region[page * PAGE_SIZE]
        counts = numafast.page_nodes(region)  # pages 8-15 never touched (-ENOENT)
        view = np.frombuffer(region, dtype=np.uint8)
        assert counts == numafast.PageNodes(*truth_counts(view))
        del view
        assert counts.touched in (4, 8) and counts.total == 16


def test_page_nodes_agrees_page_for_page_with_pagemap() -> None:
    array = np.ones(300_000)
    array[::1000] = 2
    status = list(_libnuma.move_pages(array))  # the per-page answer page_nodes counts
    truth = pagemap_nodes(address_of(array), array.nbytes)
    assert [s if s >= 0 else None for s in status] == truth
    assert numafast.page_nodes(array) == numafast.PageNodes(*truth_counts(array))


def test_a_small_buffer_counts_the_page_it_lies_in() -> None:
    small = np.arange(10)  # 80 bytes on one heap page (or two, at a page boundary)
    counts = numafast.page_nodes(small)
    assert counts == numafast.PageNodes(*truth_counts(small)) and counts.total in (1, 2)


def test_page_nodes_takes_read_only_and_fortran_ordered_buffers() -> None:
    data = bytes(5 * PAGE_SIZE)
    assert numafast.page_nodes(data).total in (5, 6)
    fortran = np.asfortranarray(np.ones((300, 400)))
    assert numafast.page_nodes(fortran) == numafast.PageNodes(*truth_counts(fortran.T))


@pytest.mark.parametrize(
    ("buf", "message"),
    [(np.ones((100, 100))[::2], "not C-contiguous"), (bytearray(), "empty"), ("text", "does not expose")],
)
def test_page_nodes_rejects_what_has_no_single_span(buf, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(numafast.InvalidBufferError, match=message):
        numafast.page_nodes(buf)


@dataclasses.dataclass
class Sample:
    image: np.ndarray
    label: int
    name: str


class Pair(NamedTuple):
    left: np.ndarray
    right: np.ndarray


def test_placement_of_a_nested_batch_counts_each_buffer_once() -> None:
    image = numafast.empty((64, 1024), np.float32, node=NODE)
    other = np.ones(200_000)
    batch = {
        "samples": [Sample(image, 3, "a"), Sample(image, 4, "b")],  # the same image twice
        "pair": Pair(other, other[: 1000]),
        "meta": {"ids": (np.arange(5), None, 1.5)},
        "strided": other[::2],
    }
    batch["self"] = batch  # a cycle is walked once
    report = numafast.placement(batch, node=NODE)
    assert set(report.leaves) == {
        "['samples'][0].image", "['samples'][1].image", "['pair'][0]", "['pair'][1]", "['meta']['ids'][0]",
    }  # fmt: skip
    assert set(report.skipped) == {"['strided']"} and "not C-contiguous" in report.skipped["['strided']"]
    expected: Counter[int] = Counter()
    for array in (image, other, other[:1000], batch["meta"]["ids"][0]):  # type: ignore[index]
        expected.update(truth_counts(array)[0])
    assert dict(report.pages) == dict(expected)
    remote = sum(pages for node, pages in expected.items() if node != NODE)
    assert report.remote_pages == remote
    assert report.remote_share == pytest.approx(remote / sum(expected.values()))
    assert f"{report.remote_share:.1%} remote from node {NODE}" in str(report)


def test_placement_of_one_array_and_of_nothing() -> None:
    array = numafast.empty(10_000, node=NODE)
    with pinned_to_one_cpu() as node:
        report = numafast.placement(array)
    assert report.node == node
    assert report.leaves == {"": numafast.page_nodes(array)}
    empty = numafast.placement({"a": [1, "x"], "b": None})
    assert empty.pages == numafast.PageNodes({}) and empty.remote_share == 0.0


def test_placement_rejects_an_unknown_node() -> None:
    with pytest.raises(numafast.InvalidNodeError, match="node 4096 does not exist"):
        numafast.placement(np.ones(10), node=4096)


def test_placement_lists_objects_it_cannot_see_into_as_skipped() -> None:
    class Batch:  # a custom batch class: no buffer, mapping, list, tuple or dataclass
        def __init__(self) -> None:
            self.images = numafast.empty(1 << 16, "uint8", node=NODE)

    report = numafast.placement({"custom": Batch(), "set": {1, 2}, "label": "cat", "count": 3}, node=NODE)
    assert report.leaves == {}
    assert set(report.skipped) == {"['custom']", "['set']"}
    assert report.skipped["['custom']"].startswith("a Batch is none of a buffer, mapping, list, tuple or dataclass")
    assert "a set is none of" in report.skipped["['set']"]
    assert "['custom']: skipped, a Batch" in str(report)
