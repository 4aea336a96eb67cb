"""A NumaLoader iterates as the stock DataLoader it wraps, by content: every sample
carries its index, and every batch of every epoch is checked against a stock loader
built the same way with the same seed, through what users and frameworks do to a
loader (copy it, pickle it, re-create it with some options replaced).

Every worker-backed loader has a DataLoader ``timeout``, so a hang fails the test where
it waits.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sysfs_truth import online_nodes

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler  # noqa: E402

import numafast.torch  # noqa: E402
from numafast.errors import LoaderHint  # noqa: E402

NODES = online_nodes()
pytestmark = pytest.mark.host_only("loader semantics, the same on any kernel; worker processes cost seconds under TCG")

SAMPLES = 20
BATCH_TIMEOUT_S = 60  # DataLoader's own: a worker that never answers is an error, not a wait


@pytest.fixture(autouse=True)
def no_hints() -> Iterator[None]:
    """numafast's LoaderHint (num_workers=0) is not what these tests look at."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LoaderHint)
        yield


class Tagged(Dataset):  # type: ignore[type-arg]
    """Sample i: (a tensor full of i, i)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return torch.full((64,), float(index)), index


def content(batch: Any) -> Any:
    """A batch as plain lists: each sample's index and values, whatever the batching
    (a collated pair of tensors, a list of samples, one sample)."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", batch.shape, batch.tolist())
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, [content(part) for part in batch])
    return batch


def epochs(loader: Any, count: int = 2) -> list[list[Any]]:
    """Every batch of ``count`` epochs, by content."""
    return [[content(batch) for batch in loader] for _ in range(count)]


def stock(workers: int, **options: Any) -> DataLoader:  # type: ignore[type-arg]
    """A stock loader over :class:`Tagged`, its shuffling seeded."""
    options = {"batch_size": 3, "shuffle": True, **options}
    if workers:
        options["timeout"] = BATCH_TIMEOUT_S
    return DataLoader(Tagged(), num_workers=workers, generator=torch.Generator().manual_seed(7), **options)


COPIES: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda loader: pickle.loads(pickle.dumps(loader)),
    "deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", list(COPIES))
def test_a_pickled_or_deep_copied_loader_gives_the_stock_copys_batches_and_the_original_goes_on(
    how: str, workers: int
) -> None:
    """A stock DataLoader not being iterated pickles and deep-copies (frameworks copy
    loaders; a spawned process receives one pickled). A NumaLoader raised instead: its
    pools hold locks and threads. Its copy must give the batches the stock copy gives,
    and leave the original's epochs alone."""
    expected = epochs(COPIES[how](stock(workers)))
    original = numafast.torch.NumaLoader(stock(workers), node=NODES[0])
    copied = COPIES[how](original)
    assert isinstance(copied, numafast.torch.NumaLoader) and len(copied) == len(original)
    assert epochs(copied) == expected
    assert epochs(original) == expected  # its generator was copied, not shared
    assert copied.stats().landed + copied.stats().copied == 2 * len(copied)  # into pools of its own


@pytest.mark.parametrize("workers", [0, 2])
def test_shuffle_false_given_with_a_shuffling_loader_gives_the_stock_unshuffled_batches(workers: int) -> None:
    """``NumaLoader(loader, shuffle=False)``: options given replace the loader's, as a
    framework re-creating it passes them, so the batches are those of a stock loader
    made with ``shuffle=False``. The RandomSampler DataLoader made for the wrapped
    loader's ``shuffle=True`` used to stay, and the batches came shuffled."""
    expected = epochs(stock(workers, shuffle=False))
    assert expected[0][0] == ("list", [("tensor", (3, 64), [[0.0] * 64, [1.0] * 64, [2.0] * 64]), ("tensor", (3,), [0, 1, 2])])
    assert epochs(numafast.torch.NumaLoader(stock(workers, shuffle=True), shuffle=False, node=NODES[0])) == expected
    # A sampler of the user's own stays, as with DataLoader(dataset, sampler=..., shuffle=False).
    def own_sampler() -> SubsetRandomSampler:
        return SubsetRandomSampler(list(range(0, SAMPLES, 2)), generator=torch.Generator().manual_seed(3))

    expected = epochs(stock(workers, shuffle=False, sampler=own_sampler()))
    loader = numafast.torch.NumaLoader(stock(workers, shuffle=False, sampler=own_sampler()), shuffle=False, node=NODES[0])
    assert epochs(loader) == expected


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("wrapped", "given"), [(None, 4), (4, None)])
@pytest.mark.parametrize("through", ["DataLoader", "NumaLoader"])
def test_a_batch_size_given_that_turns_batching_on_or_off_collates_as_the_stock_loader_does(
    wrapped: int | None, given: int | None, workers: int, through: str
) -> None:
    """DataLoader fills in its collate function from how it batches (``default_collate``
    for batches, ``default_convert`` for single samples). Re-made with a batch size
    that turns batching on or off, a NumaLoader kept the wrapped loader's: batches of
    4 came as lists of uncollated samples, or single samples went to default_collate
    (a TypeError in every batch). So it did where the loader it wraps is a NumaLoader,
    whose collate function is numafast's, wrapping DataLoader's."""
    expected = epochs(stock(workers, batch_size=given, shuffle=False))
    wrapped_loader = stock(workers, batch_size=wrapped, shuffle=False)
    if through == "NumaLoader":
        wrapped_loader = numafast.torch.NumaLoader(wrapped_loader, node=NODES[0])
    loader = numafast.torch.NumaLoader(wrapped_loader, batch_size=given, node=NODES[0])
    assert epochs(loader) == expected
    assert loader.collate_fn.collate_fn is DataLoader(Tagged(), batch_size=given).collate_fn
