"""A NumaLoader's batches keep their tensors' strides as the stock DataLoader's do: a
custom collate_fn's channels_last, transposed or permuted batch (non-overlapping and
dense) reaches the consumer with the same strides, whether the main process copied it
into a slot (no workers, and the first batches) or a worker packed it into one (later
batches, rebuilt from the unpacking's templates). A tensor with gaps or overlaps
(sliced, expanded) may come back row-major: only its values are compared. Each sample
is tagged with its index, so a batch's values say which samples it holds."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sysfs_truth import online_nodes

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402

NODE = online_nodes()[0]
pytestmark = pytest.mark.host_only("loader behaviour, the same on any kernel; workers cost seconds under TCG")

# Each sample's tensors by name, of these shapes, full of distinct values tagged with its index.
SHAPES = {"image": (3, 4, 5), "volume": (2, 3, 4, 5), "vector": (6,), "grid": (4, 5)}


class Tagged(Dataset):  # type: ignore[type-arg]
    """Sample i: a dict of row-major tensors (see SHAPES) whose values are 1000 i + 0, 1, ..."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * index
                for name, shape in SHAPES.items()}  # fmt: skip


Samples = list[dict[str, torch.Tensor]]
LayOut = Callable[[Samples], torch.Tensor]


def stacked(samples: Samples, name: str) -> torch.Tensor:
    """The samples' ``name`` tensors stacked: a row-major batch, index first."""
    return torch.stack([sample[name] for sample in samples])


# How a custom collate_fn lays out one batch tensor, by name: each non-overlapping and dense.
DENSE: dict[str, LayOut] = {
    "channels_last": lambda samples: stacked(samples, "image").contiguous(memory_format=torch.channels_last),
    "channels_last_3d": lambda samples: stacked(samples, "volume").contiguous(memory_format=torch.channels_last_3d),
    "transposed": lambda samples: stacked(samples, "vector").t(),
    "permuted": lambda samples: stacked(samples, "grid").permute(2, 0, 1),
}
# The same for tensors with gaps or overlaps, and plain ones.
NOT_DENSE: dict[str, LayOut] = {
    "expanded": lambda samples: stacked(samples, "vector")[:, None].expand(-1, 3, -1),
    "sliced": lambda samples: stacked(samples, "image")[:, :, 1:, ::2],
}
PLAIN: dict[str, LayOut] = {
    "contiguous": lambda samples: stacked(samples, "image"),
    "labels": lambda samples: torch.tensor([int(sample["vector"][0]) // 1000 for sample in samples]),
}


def collate(layouts: dict[str, LayOut], samples: Samples) -> dict[str, torch.Tensor]:
    """A custom collate_fn: a dict of the batch tensors each of ``layouts`` makes."""
    return {name: lay_out(samples) for name, lay_out in layouts.items()}


def batches(loader: Any, epochs: int = 2) -> list[dict[str, torch.Tensor]]:
    """Every batch of ``epochs`` epochs."""
    return [batch for _epoch in range(epochs) for batch in loader]


def compare(layouts: dict[str, LayOut], workers: int) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Each batch of a NumaLoader and of the stock DataLoader (the same dataset and
    collate_fn), in pairs, over two epochs; every tensor's values and dtype checked
    equal. With workers, checks that some batches landed in their worker's slot."""
    options: dict[str, Any] = {"batch_size": 3, "num_workers": workers, "collate_fn": functools.partial(collate, layouts)}
    stock = batches(DataLoader(Tagged(), **options))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this file compares batches; the warnings have tests of their own
        loader = numafast.torch.NumaLoader(DataLoader(Tagged(), **options), node=NODE, lock="best-effort")
        ours = batches(loader)
    assert len(ours) == len(stock) == 8
    if workers:
        assert loader.stats().landed >= 2, loader.stats()  # packed by a worker, then rebuilt from a template
    for number, (made, expected) in enumerate(zip(ours, stock)):
        assert list(made) == list(expected), number
        for name in expected:
            assert made[name].dtype == expected[name].dtype, (number, name)
            assert torch.equal(made[name], expected[name]), (number, name)
    return list(zip(ours, stock))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("layout", list(DENSE))
def test_a_dense_tensor_reaches_the_consumer_with_the_stock_loaders_strides(layout: str, workers: int) -> None:
    """The batch tensor of a collate_fn that lays it out in another order than
    row-major keeps that order: before, every one came back row-major (a channels_last
    model then converted each batch back)."""
    for number, (made, expected) in enumerate(compare({layout: DENSE[layout], **PLAIN}, workers)):
        for name in expected:
            assert made[name].stride() == expected[name].stride(), (number, name)
        memory_format = {"channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d}.get(layout)
        if memory_format is not None:
            assert made[layout].is_contiguous(memory_format=memory_format), number
        assert not made[layout].is_contiguous(), number


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_mixing_layouts_keeps_every_value_and_each_dense_tensors_strides(workers: int) -> None:
    """In one batch (one payload: references of either order side by side), tensors
    with gaps or overlaps come back with their values, plain ones row-major as
    before, and the dense ones keep their strides."""
    for number, (made, expected) in enumerate(compare({**NOT_DENSE, **PLAIN, **DENSE}, workers)):
        for name in [*PLAIN, *DENSE]:
            assert made[name].stride() == expected[name].stride(), (number, name)
        assert made["contiguous"].is_contiguous() and made["labels"].is_contiguous(), number
        assert made["channels_last"].is_contiguous(memory_format=torch.channels_last), number


# A custom collate_fn's NumPy batch arrays, by name. Through workers, torch's queue pickles
# them (at protocol 4, the default before Python 3.14): NumPy then delivers native byte
# order, row-major unless column-major. Without workers, the batch arrives as made.
ARRAYS: dict[str, Callable[[Samples], np.ndarray]] = {  # type: ignore[type-arg]
    "row_major": lambda samples: stacked(samples, "image").numpy(),
    "column_major": lambda samples: np.asfortranarray(stacked(samples, "image").numpy()),
    "permuted": lambda samples: stacked(samples, "volume").numpy().transpose(1, 0, 4, 2, 3),
    "big_endian": lambda samples: stacked(samples, "image").numpy().astype(">f4"),
    "big_endian_column_major": lambda samples: np.asfortranarray(stacked(samples, "image").numpy().astype(">f4")),
    "big_endian_permuted": lambda samples: stacked(samples, "grid").numpy().astype(">f4").transpose(2, 0, 1),
    "big_endian_empty": lambda samples: np.zeros((len(samples), 0), ">f4"),  # no bytes: pickled with the batch
}


@pytest.mark.parametrize("workers", [0, 2])
def test_numpy_arrays_arrive_in_the_stock_loaders_byte_order_and_layout(workers: int) -> None:
    """Before, a worker's slot kept a big-endian array's byte order, where the stock
    loader's batch is native (torch.from_numpy refused it), and a permuted array's
    strides, where the stock one is row-major (a .reshape(-1) view of it failed)."""
    options: dict[str, Any] = {"batch_size": 3, "num_workers": workers,
                               "collate_fn": lambda samples: {name: make(samples) for name, make in ARRAYS.items()}}
    stock = batches(DataLoader(Tagged(), **options))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = numafast.torch.NumaLoader(DataLoader(Tagged(), **options), node=NODE, lock="best-effort")
        ours = batches(loader)
    if workers:
        assert loader.stats().landed >= 2, loader.stats()
    assert len(ours) == len(stock) == 8
    for number, (made, expected) in enumerate(zip(ours, stock)):
        for name in ARRAYS:
            assert type(made[name]) is np.ndarray and np.array_equal(made[name], expected[name]), (number, name)
            assert made[name].dtype.str == expected[name].dtype.str, (number, name)
            assert made[name].strides == expected[name].strides or not made[name].size, (number, name)
