"""A NumaLoader's batches are the stock DataLoader's, whatever they hold: each batch is
compared, batch by batch (each sample tagged with its index), with the one a stock
DataLoader built the same way gives, in structure, types (tensor subclasses and
Parameters included), dtypes, shapes, values and requires_grad, over two epochs (the
first batches copied in by the main process, the later ones landed in slots and
rebuilt from the unpacking's templates)."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from sysfs_truth import online_nodes

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast  # noqa: E402
import numafast.torch  # noqa: E402
from numafast.torch import slot as slot_engine  # noqa: E402

NODE = online_nodes()[0]
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
    pytest.mark.host_only("batches as the stock loader gives them: the same on any kernel; workers cost seconds under TCG"),
]


class Tagged(torch.Tensor):
    """A user's own tensor subclass (as torchvision's tv_tensors are)."""


class Samples(Dataset):  # type: ignore[type-arg]
    """Sample i: whatever ``make(i)`` gives."""

    def __init__(self, make: Callable[[int], Any], count: int = 12) -> None:
        self.make, self.count = make, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        return self.make(index)


def outcomes(loader: Any, epochs: int = 2) -> list[Any]:
    """Every batch of ``epochs`` epochs, or ('raised', type, first line) where iterating raised."""
    results: list[Any] = []
    for _epoch in range(epochs):
        try:
            results.extend(loader)
        except Exception as error:  # noqa: BLE001
            results.append(("raised", type(error), str(error).splitlines()[0]))
    return results


def same(made: Any, expected: Any, where: str = "batch") -> None:
    """``made`` is ``expected``: the same types all the way down, keys in order, tensor
    dtypes, shapes, requires_grad and values (bytes), other leaves equal."""
    assert type(made) is type(expected), f"{where}: {type(made).__name__}, expected {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert (made.dtype, made.shape, made.requires_grad) == (expected.dtype, expected.shape, expected.requires_grad), where
        if expected.is_quantized:
            if quantizer(expected) is not None:  # torch's worker queue sends none: the stock batch lacks it then
                assert quantizer(made) == quantizer(expected), where
            made, expected = made.int_repr(), expected.int_repr()
        assert torch.equal(made.detach().reshape(-1).view(torch.uint8), expected.detach().reshape(-1).view(torch.uint8)), where
    elif isinstance(expected, dict):
        assert list(made) == list(expected), where
        for key in expected:
            same(made[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(made) == len(expected), where
        for index, (part, expected_part) in enumerate(zip(made, expected)):
            same(part, expected_part, f"{where}[{index}]")
    else:
        assert made == expected, where


def quantizer(tensor: torch.Tensor) -> tuple[float, int] | None:
    """A quantized tensor's scale and zero point; None where it has none to tell."""
    try:
        return tensor.q_scale(), tensor.q_zero_point()
    except RuntimeError:  # "cannot call qscheme on UnknownQuantizer"
        return None


def compare(make: Callable[[int], Any], workers: int, collate_fn: Any = None) -> None:
    """A NumaLoader over ``Samples(make)`` gives the stock loader's batches (or its error)."""
    options: dict[str, Any] = {"batch_size": 3, "num_workers": workers}
    if collate_fn is not None:
        options["collate_fn"] = collate_fn
    stock = outcomes(DataLoader(Samples(make), **options))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this file compares batches; the warnings have tests of their own
        ours = outcomes(numafast.torch.NumaLoader(DataLoader(Samples(make), **options), node=NODE, lock="best-effort"))
    assert len(ours) == len(stock), (ours[-1], stock[-1])
    for number, (made, expected) in enumerate(zip(ours, stock)):
        if isinstance(expected, tuple) and expected[:1] == ("raised",):
            assert made[:2] == expected[:2], (number, made, expected)
        else:
            same(made, expected, f"batch {number}")


def indexed(index: int) -> torch.Tensor:
    return torch.full((2, 3), float(index))


def stacked_as(kind: Callable[[torch.Tensor], Any]) -> Callable[[list[torch.Tensor]], Any]:
    """A custom collate_fn: the samples stacked, then made ``kind(stack)``."""

    def collate(samples: list[torch.Tensor]) -> Any:
        return kind(torch.stack(samples))

    return collate


def as_tagged(tensor: torch.Tensor) -> Tagged:
    return tensor.as_subclass(Tagged)


def as_parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor)


def as_quantized(tensor: torch.Tensor) -> torch.Tensor:
    return torch.quantize_per_tensor(tensor, 0.5, 3, torch.quint8)


def with_a_user_string(tensor: torch.Tensor) -> tuple[torch.Tensor, collections.UserString]:
    return tensor, collections.UserString("a caption")


# ---------------------------------------------------------------- default_collate of the samples


def test_samples_that_need_grad_collate_in_the_main_process_as_torch_stacks_them() -> None:
    """Without workers torch stacks without ``out=``: samples that need grad give a batch
    that needs grad (in a worker torch refuses, and so does numafast)."""
    for workers in (0, 2):
        compare(lambda index: indexed(index).requires_grad_(), workers)


def test_samples_of_mixed_dtypes_collate_in_the_main_process_to_torchs_promoted_dtype() -> None:
    """Without workers torch.stack promotes (float32 and float64 samples: a float64
    batch); in a worker it stacks into a tensor of the first sample's dtype."""
    for workers in (0, 2):
        compare(lambda index: indexed(index).to(torch.float64 if index % 3 else torch.float32), workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_quantized_samples_give_the_stock_batch_or_its_error_not_a_crash(workers: int) -> None:
    """A quantized tensor's scale and zero point are no part of a slot reference: such a
    tensor made over a slot was read with none (a segmentation fault)."""
    compare(lambda index: as_quantized(indexed(index)), workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_tensor_subclass_samples_collate_to_a_batch_of_their_class(workers: int) -> None:
    compare(lambda index: as_tagged(indexed(index)), workers)


# ---------------------------------------------------------------- a custom collate_fn's batch


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", [as_tagged, as_parameter], ids=["subclass", "Parameter"])
def test_a_custom_collates_tensor_subclasses_and_parameters_keep_their_class(workers: int, kind: Any) -> None:
    """Stock pickling keeps a tensor's class (a Parameter stays a Parameter); the copy by
    the main process and the packing by a worker must too."""
    compare(indexed, workers, stacked_as(kind))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_custom_collates_quantized_tensor_reaches_the_consumer_with_its_scale(workers: int) -> None:
    compare(indexed, workers, stacked_as(as_quantized))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_holding_a_userstring_is_copied_in_not_walked_forever(workers: int) -> None:
    """UserString is a Sequence whose items are UserStrings: walked as a container, the
    main process's copy of the batch never ended."""
    compare(indexed, workers, stacked_as(with_a_user_string))  # endless before: the suite's time limit fails it


def test_pin_refuses_a_quantized_tensor_by_name() -> None:
    """pin() copies plain dense tensors; a quantized one is refused, not read back without
    its scale."""
    with numafast.PinnedPool(NODE, 1 << 16, 2, register="off") as pool:
        with pytest.raises(numafast.errors.InvalidBufferError, match="quantized"):
            numafast.torch.pin([as_quantized(indexed(1))], pool)


def test_a_quantized_tensor_is_never_laid_out_in_a_slot() -> None:
    """The packer pickles a quantized tensor as it is (with its scale) rather than placing
    its bytes where nothing records its quantizer."""
    memory = memoryview(bytearray(1 << 16))
    batch = [as_quantized(indexed(1)), indexed(2)]
    packer = slot_engine.SlotPacker(memory)
    payload = packer.pack(batch)
    assert packer.unpinned == {"quantized tensor on cpu"}
    for _ in range(2):  # unpickled, then from the template
        same(slot_engine.unpack(payload, memory), batch)


class Span(tuple):  # type: ignore[type-arg]
    """A user's tuple class built from its fields, not from one iterable (as namedtuples are)."""

    def __new__(cls, tensor: Any, label: int) -> Span:
        return super().__new__(cls, (tensor, label))

    def __getnewargs__(self) -> tuple[Any, ...]:
        return tuple(self)


def one_list_twice(samples: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A custom collate_fn whose batch holds one list twice."""
    column = [torch.stack(samples)]
    return [column, column]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_container_found_twice_in_a_batch_is_one_container_as_in_the_stock_batch(workers: int) -> None:
    """Pickling keeps one object once (and a batch without workers is the collate's own):
    the copy by the main process and the unpacking's template made two lists of one, so a
    consumer changing one no longer changed the other."""
    options: dict[str, Any] = {"batch_size": 3, "num_workers": workers, "collate_fn": one_list_twice}
    assert all(batch[0] is batch[1] for batch in DataLoader(Samples(indexed), **options))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = numafast.torch.NumaLoader(DataLoader(Samples(indexed), **options), node=NODE, lock="best-effort")
        batches = outcomes(loader)
    assert len(batches) == 8 and all(batch[0] is batch[1] for batch in batches)
    compare(indexed, workers, one_list_twice)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_tuple_class_of_its_own_making_reaches_the_consumer_not_an_error(workers: int) -> None:
    """The main process's copy made such a tuple again as ``type(item)(parts)``: a
    TypeError the stock loader never raises."""
    compare(indexed, workers, stacked_as(lambda tensor: Span(tensor, 7)))
