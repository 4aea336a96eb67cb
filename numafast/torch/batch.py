"""numafast.torch.pin: a nested batch copied into one slot of a PinnedPool.

A batch is whatever a DataLoader's collate function returns: tensors inside dicts,
lists, tuples, namedtuples and dataclasses, with other leaves (strings, numbers,
NumPy arrays) kept as they are. :func:`pin` lays every tensor out in one slot, each
starting on an :data:`ALIGNMENT` boundary, copies them all in one GIL-free call of
the extension (split over threads on the pool's node for big batches) and returns
the same structure with tensors over the slot. The slot goes back to the pool when
the last of those tensors is gone.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, TypeVar

import torch

from numafast import _libnuma
from numafast.errors import InvalidBufferError, SlotTooSmallError
from numafast.pool import PinnedPool, pool_of

__all__ = ["ALIGNMENT", "BatchLayout", "fill", "flatten", "layout", "pin", "record_stream"]

# Where each tensor starts inside a slot: the CUDA caching allocator's block size,
# so a copy engine reads every tensor from an aligned address.
ALIGNMENT = 512
# Below this many bytes per thread, one more copy thread costs more than it saves.
BYTES_PER_COPY_THREAD = 16 << 20
# Beyond this many threads a copy is memory-bound anyway.
MAX_COPY_THREADS = 8

Batch = TypeVar("Batch")


def flatten(batch: Batch) -> tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], Batch]]:
    """The distinct tensors of ``batch`` in a fixed order, and a function that rebuilds
    the same structure with other tensors in their places (a tensor that appears
    twice is one entry, and its replacement appears twice)."""
    tensors: list[torch.Tensor] = []
    positions: dict[int, int] = {}

    def collect(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            if id(item) not in positions:
                positions[id(item)] = len(tensors)
                tensors.append(item)
            return
        for child in _children(item):
            collect(child)

    collect(batch)

    def rebuild(replacements: Sequence[torch.Tensor]) -> Batch:
        if len(replacements) != len(tensors):
            raise ValueError(f"{len(replacements)} tensors to put back into a batch of {len(tensors)}")
        return _rebuild(batch, lambda tensor: replacements[positions[id(tensor)]])  # type: ignore[no-any-return]

    return tensors, rebuild


def _children(item: Any) -> Iterator[Any]:
    """The parts of a container the walk goes into (none for a leaf)."""
    if isinstance(item, (str, bytes, bytearray)):
        return iter(())
    if isinstance(item, Mapping):
        return iter(item.values())
    if isinstance(item, (tuple, list)) or (isinstance(item, Sequence) and not isinstance(item, range)):
        return iter(item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return (getattr(item, field.name) for field in dataclasses.fields(item))
    return iter(())


def _rebuild(item: Any, replace: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``item`` with every tensor replaced; containers of the same types (as
    torch.utils.data's pin_memory rebuilds them), leaves kept as they are."""
    if isinstance(item, torch.Tensor):
        return replace(item)
    if isinstance(item, (str, bytes, bytearray)):
        return item
    if isinstance(item, Mapping):
        values = {key: _rebuild(value, replace) for key, value in item.items()}
        if isinstance(item, MutableMapping):
            mapping = copy.copy(item)  # keeps the mapping's type and extra attributes
            mapping.update(values)
            return mapping
        try:
            return type(item)(values)  # type: ignore[call-arg]
        except TypeError:
            return values
    if isinstance(item, tuple):
        parts = [_rebuild(part, replace) for part in item]
        return type(item)(*parts) if hasattr(item, "_fields") else type(item)(parts)
    if isinstance(item, MutableSequence):
        sequence = copy.copy(item)
        for index, part in enumerate(item):
            sequence[index] = _rebuild(part, replace)
        return sequence
    if isinstance(item, Sequence) and not isinstance(item, range):
        parts = [_rebuild(part, replace) for part in item]
        try:
            return type(item)(parts)  # type: ignore[call-arg]
        except TypeError:
            return parts
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        instance = copy.copy(item)
        for field in dataclasses.fields(item):
            object.__setattr__(instance, field.name, _rebuild(getattr(item, field.name), replace))  # frozen ones too
        return instance
    return item


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where each tensor of a batch goes in a slot: byte offsets and the total size."""

    offsets: tuple[int, ...]
    nbytes: int


def layout(tensors: Sequence[torch.Tensor]) -> BatchLayout:
    """Each tensor at the next :data:`ALIGNMENT` boundary after the one before; checks
    that every tensor is a dense CPU tensor (the only kind that can be pinned)."""
    offsets = []
    end = 0
    for index, tensor in enumerate(tensors):
        if tensor.device.type != "cpu":
            raise InvalidBufferError(f"tensor {index} of the batch is on {tensor.device}: only host tensors are pinned")
        if tensor.layout != torch.strided:
            raise InvalidBufferError(f"tensor {index} of the batch is {tensor.layout}: only dense tensors are pinned")
        start = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(start)
        end = start + tensor.numel() * tensor.element_size()
    return BatchLayout(tuple(offsets), end)


def pin(batch: Batch, pool: PinnedPool, *, threads: int | None = None, timeout: float | None = None) -> Batch:
    """``batch`` copied into one slot of ``pool``: the same structure, each tensor
    replaced by a tensor of the same dtype, shape and values over pool memory.

    ``threads`` copy threads pinned to the pool's node (default: one per 16 MiB of
    the batch, up to the node's CPUs and at most 8; 1: the calling thread copies).
    A batch larger than a slot raises SlotTooSmallError naming both sizes; a full
    pool waits up to ``timeout`` seconds (None: the pool's own timeout).
    """
    tensors, rebuild = flatten(batch)
    if not tensors:
        return batch
    plan = layout(tensors)
    if plan.nbytes > pool.slot_bytes:
        raise SlotTooSmallError(
            f"the batch needs {plan.nbytes} bytes ({len(tensors)} tensors, each aligned to {ALIGNMENT} bytes) "
            f"but a slot of this pool holds {pool.slot_bytes} bytes"
        )
    slot = None
    if plan.nbytes:
        slot = pool.acquire(plan.nbytes) if timeout is None else pool.acquire(plan.nbytes, timeout)
    return rebuild(fill(slot, tensors, plan, pool.cpus, threads))


def fill(
    slot: _libnuma.Slot | None, tensors: Sequence[torch.Tensor], plan: BatchLayout, cpus: Sequence[int],
    threads: int | None = None,
) -> list[torch.Tensor]:
    """Copies of ``tensors`` in ``slot`` as ``plan`` lays them out: the contiguous ones
    in one GIL-free gather copy (``threads`` threads pinned to ``cpus``), the others
    (strided, conjugate or negative views) by torch, which resolves them."""
    pinned = [_tensor_in(slot, tensor, offset) for tensor, offset in zip(tensors, plan.offsets)]
    contiguous = [i for i, tensor in enumerate(tensors) if _copies_as_bytes(tensor)]
    as_bytes = set(contiguous)
    sources = [_bytes_of(tensors[i]) for i in contiguous]
    count = _copy_threads(sum(source.nbytes for source in sources), len(cpus), threads)
    if slot is not None and sources:
        _libnuma.gather_copy(slot, [plan.offsets[i] for i in contiguous], sources, cpus if count > 1 else (), count)
    for i, tensor in enumerate(tensors):
        if i not in as_bytes and tensor.numel():
            pinned[i].copy_(tensor)  # torch releases the GIL for it
    return pinned


def _tensor_in(slot: _libnuma.Slot | None, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A tensor of ``like``'s dtype and shape over ``slot`` at ``offset``. Each one has a
    storage of its own bytes only (torch.save or a queue sends no more than that) and
    holds a reference to the slot."""
    if like.numel() == 0 or slot is None:
        return torch.empty(like.shape, dtype=like.dtype)
    tensor = torch.frombuffer(slot, dtype=like.dtype, count=like.numel(), offset=offset).view(like.shape)
    return tensor.requires_grad_() if like.requires_grad else tensor


def _copies_as_bytes(tensor: torch.Tensor) -> bool:
    return bool(tensor.numel()) and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A contiguous CPU tensor's memory as a flat uint8 NumPy array (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _copy_threads(nbytes: int, cpus: int, asked: int | None) -> int:
    if asked is not None:
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            raise ValueError(f"threads must be a positive integer, not {asked!r}")
        return min(asked, max(cpus, 1))
    return max(1, min(nbytes // BYTES_PER_COPY_THREAD, cpus, MAX_COPY_THREADS))


def record_stream(batch: object, stream: object) -> int:
    """Name a CUDA stream that reads the pinned tensors of ``batch`` (as
    ``Tensor.record_stream`` does for the caching allocator): their slots are reused
    only after the work queued on ``stream`` by the time they come back has finished.
    Returns how many tensors were in a CUDA-registered pool."""
    recorded = 0
    for tensor in flatten(batch)[0]:
        pool = pool_of(tensor.data_ptr()) if tensor.numel() else None
        if pool is not None and pool.record_stream(tensor.data_ptr(), stream):
            recorded += 1
    return recorded
