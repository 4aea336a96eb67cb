"""Each loader's batches are its own: two loaders over one dataset count and hold only
their own batches. Every sample carries its index; every batch is checked by content."""

from __future__ import annotations

from typing import Any

import pytest

from sysfs_truth import online_nodes

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402
from numafast.torch.collate import SlotCollate  # noqa: E402

NODES = online_nodes()
SEMANTICS = pytest.mark.host_only("loader semantics, the same on any kernel; worker processes cost seconds under TCG")


class Tagged(Dataset):  # type: ignore[type-arg]
    """Sample i: (a tensor full of i, i)."""

    def __init__(self, count: int, size: int = 2048) -> None:
        self.count, self.size = count, size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return torch.full((self.size,), float(index)), index


def wrong_batches(batches: list[Any], expected: list[list[int]]) -> list[str]:
    """What is wrong with ``batches``, each ``(values, indices)``, against the indices
    ``expected`` batch by batch (empty: every batch is right)."""
    wrong = []
    if len(batches) != len(expected):
        wrong.append(f"{len(batches)} batches, {len(expected)} expected")
    for number, (batch, indices) in enumerate(zip(batches, expected)):
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            wrong.append(f"batch {number} is a {type(batch).__name__}: {batch!r:.200}")
            continue
        values, got = batch
        if got.tolist() != indices:
            wrong.append(f"batch {number} has samples {got.tolist()}, not {indices}")
        elif not torch.equal(values, torch.tensor(indices, dtype=values.dtype)[:, None].expand_as(values)):
            wrong.append(f"batch {number}'s values are not its samples' {indices}")
    return wrong


def in_order(count: int, batch_size: int) -> list[list[int]]:
    return [list(range(start, min(start + batch_size, count))) for start in range(0, count, batch_size)]


@SEMANTICS
def test_two_loaders_over_one_dataset_each_count_and_hold_only_their_own_batches() -> None:
    """A train and an eval loader over one dataset, iterated zipped: two loaders, not one
    found again by its dataset (each used to count the other's batches too)."""
    dataset = Tagged(64)
    train = numafast.torch.NumaLoader(dataset, batch_size=4, num_workers=2, node=NODES[0])
    evaluate = numafast.torch.NumaLoader(dataset, batch_size=8, num_workers=1, node=NODES[0], max_pinned_bytes=1 << 26)
    assert train.pools is not evaluate.pools
    train_batches, eval_batches = [], []
    for train_batch, eval_batch in zip(train, evaluate):
        train_batches.append([part.clone() for part in train_batch])
        eval_batches.append([part.clone() for part in eval_batch])
    assert wrong_batches(train_batches, in_order(64, 4)[:8]) == []
    assert wrong_batches(eval_batches, in_order(64, 8)) == []
    # zip takes a 9th train batch before it finds the eval loader done
    assert train.stats().batches == 9 and evaluate.stats().batches == 8, (train.stats(), evaluate.stats())
    assert train.stats().max_pinned_bytes != evaluate.stats().max_pinned_bytes == 1 << 26
    assert wrong_batches([[part.clone() for part in batch] for batch in evaluate], in_order(64, 8)) == []
    assert train.stats().batches == 9 and evaluate.stats().batches == 16


@SEMANTICS
def test_a_loader_made_again_from_a_numaloaders_collate_function_still_shares_its_pools() -> None:
    """What a framework copies (the collate function) still finds the pools."""
    dataset = Tagged(24)
    loader = numafast.torch.NumaLoader(dataset, batch_size=4, num_workers=2, node=NODES[0])
    again = numafast.torch.NumaLoader(dataset, batch_size=4, num_workers=2, collate_fn=loader.collate_fn,
                                      node=NODES[0])  # fmt: skip
    assert again.pools is loader.pools and isinstance(again.collate_fn, SlotCollate)
    assert wrong_batches([[part.clone() for part in batch] for batch in again], in_order(24, 4)) == []

