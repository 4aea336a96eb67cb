"""numafast.torch.pin: a nested batch copied into one slot of a PinnedPool.

A batch is whatever a DataLoader's collate function returns: tensors and NumPy
arrays inside dicts, lists, tuples, namedtuples and dataclasses, with other leaves
(strings, numbers) kept as they are. :func:`pin` lays every tensor and array out in
one slot, each starting on an :data:`ALIGNMENT` boundary, copies them all in one
GIL-free call of the extension (split over threads on the pool's node for big
batches) and returns the same structure with tensors and arrays over the slot. The
slot goes back to the pool when the last of them is gone. A leaf of another type
(an object pin cannot see into) stays where it is, and pin says so, once.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, TypeVar, Union

import numpy as np
import torch

from numafast import _libnuma
from numafast.errors import InvalidBufferError, SlotTooSmallError
from numafast.pool import PinnedPool, pool_of
from numafast.torch.packing import ALIGNMENT, copies_as_bytes, plain_array

__all__ = ["ALIGNMENT", "BatchLayout", "fill", "flatten", "layout", "pin", "record_stream"]

# Below this many bytes per thread, one more copy thread costs more than it saves.
BYTES_PER_COPY_THREAD = 16 << 20
# Beyond this many threads a copy is memory-bound anyway.
MAX_COPY_THREADS = 8

Batch = TypeVar("Batch")
# What pin() places in a slot: tensors, and NumPy arrays of plain numbers.
Leaf = Union[torch.Tensor, "np.ndarray[Any, Any]"]
# Leaves that are values, not buffers: kept as they are without a word.
PLAIN_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), np.generic, torch.dtype, torch.device)


def flatten(batch: Batch, *, arrays: bool = False) -> tuple[list[Any], Callable[[Sequence[Any]], Batch]]:
    """The distinct tensors of ``batch`` (with ``arrays``, its NumPy arrays of plain
    numbers too) in a fixed order, and a function that rebuilds the same structure
    with other values in their places (a leaf that appears twice is one entry, and
    its replacement appears twice)."""
    leaves: list[Any] = []
    positions: dict[int, int] = {}
    # A walk with a stack, not a recursive closure: a closure that calls itself is a
    # reference cycle, which would keep the leaves (tensors over a slot) and so their
    # slot alive until the garbage collector runs.
    pending = [batch]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor) or (arrays and plain_array(item)):
            if id(item) not in positions:
                positions[id(item)] = len(leaves)
                leaves.append(item)
            continue
        pending.extend(reversed(list(_children(item))))

    def rebuild(replacements: Sequence[Any]) -> Batch:
        if len(replacements) != len(leaves):
            raise ValueError(f"{len(replacements)} values to put back into a batch of {len(leaves)}")
        return _rebuild(batch, lambda leaf: replacements[positions[id(leaf)]], arrays)  # type: ignore[no-any-return]

    return leaves, rebuild


def opaque_leaves(batch: object) -> set[str]:
    """The type names of the leaves of ``batch`` that pin cannot see into: not a
    tensor, array, container pin walks, or plain value."""
    found: set[str] = set()
    pending = [batch]  # a stack, not a recursive closure (a reference cycle: see flatten)
    while pending:
        item = pending.pop()
        if isinstance(item, (torch.Tensor, np.ndarray, *PLAIN_LEAVES)):
            continue
        children = list(_children(item))
        if children or isinstance(item, (Mapping, Sequence)) or dataclasses.is_dataclass(item):
            pending.extend(children)
        else:
            found.add(f"{type(item).__module__}.{type(item).__qualname__}")
    return found


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


def _rebuild(item: Any, replace: Callable[[Any], Any], arrays: bool = False) -> Any:
    """``item`` with every tensor (and with ``arrays``, every plain array) replaced;
    containers of the same types (as torch.utils.data's pin_memory rebuilds them),
    other leaves kept as they are."""
    if isinstance(item, torch.Tensor) or (arrays and plain_array(item)):
        return replace(item)
    if isinstance(item, (str, bytes, bytearray)):
        return item
    if isinstance(item, Mapping):
        values = {key: _rebuild(value, replace, arrays) for key, value in item.items()}
        if isinstance(item, MutableMapping):
            mapping = copy.copy(item)  # keeps the mapping's type and extra attributes
            mapping.update(values)
            return mapping
        try:
            return type(item)(values)  # type: ignore[call-arg]
        except TypeError:
            return values
    if isinstance(item, tuple):
        parts = [_rebuild(part, replace, arrays) for part in item]
        return type(item)(*parts) if hasattr(item, "_fields") else type(item)(parts)
    if isinstance(item, MutableSequence):
        sequence = copy.copy(item)
        for index, part in enumerate(item):
            sequence[index] = _rebuild(part, replace, arrays)
        return sequence
    if isinstance(item, Sequence) and not isinstance(item, range):
        parts = [_rebuild(part, replace, arrays) for part in item]
        try:
            return type(item)(parts)  # type: ignore[call-arg]
        except TypeError:
            return parts
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        instance = copy.copy(item)
        for field in dataclasses.fields(item):
            object.__setattr__(instance, field.name, _rebuild(getattr(item, field.name), replace, arrays))  # frozen ones too
        return instance
    return item


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where each tensor of a batch goes in a slot: byte offsets and the total size."""

    offsets: tuple[int, ...]
    nbytes: int


def layout(tensors: Sequence[Leaf]) -> BatchLayout:
    """Each tensor or array at the next :data:`ALIGNMENT` boundary after the one before;
    checks that every tensor is a dense CPU tensor (the only kind that can be pinned)."""
    offsets = []
    end = 0
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, np.ndarray):
            start = -(-end // ALIGNMENT) * ALIGNMENT
            offsets.append(start)
            end = start + tensor.nbytes
            continue
        if tensor.device.type != "cpu":
            raise InvalidBufferError(f"tensor {index} of the batch is on {tensor.device}: only host tensors are pinned")
        if tensor.layout != torch.strided:
            raise InvalidBufferError(f"tensor {index} of the batch is {tensor.layout}: only dense tensors are pinned")
        start = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(start)
        end = start + tensor.numel() * tensor.element_size()
    return BatchLayout(tuple(offsets), end)


def pin(batch: Batch, pool: PinnedPool, *, threads: int | None = None, timeout: float | None = None) -> Batch:
    """``batch`` copied into one slot of ``pool``: the same structure, each tensor (and
    NumPy array) replaced by one of the same dtype, shape and values over pool memory.

    ``threads`` copy threads pinned to the pool's node (default: one per 16 MiB of
    the batch, up to the node's CPUs and at most 8; 1: the calling thread copies).
    A batch larger than a slot raises SlotTooSmallError naming both sizes; a full
    pool waits up to ``timeout`` seconds (None: the pool's own timeout). Leaves of
    types pin cannot see into are left in place with a RuntimeWarning naming them.
    """
    if not isinstance(pool, PinnedPool):
        raise TypeError(
            f"pin() copies into a numafast.PinnedPool, not a {type(pool).__name__}: make one with "
            "numafast.PinnedPool(node, slot_bytes, slots)"
        )
    opaque = opaque_leaves(batch)
    if opaque:
        warnings.warn(
            f"pin() leaves {', '.join(sorted(opaque))} where they are: it places tensors and NumPy arrays inside "
            "dicts, lists, tuples, namedtuples and dataclasses", RuntimeWarning, stacklevel=2,
        )
    tensors, rebuild = flatten(batch, arrays=True)
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
    slot: _libnuma.Slot | None, tensors: Sequence[Leaf], plan: BatchLayout, cpus: Sequence[int],
    threads: int | None = None,
) -> list[Any]:
    """Copies of ``tensors`` (and arrays) in ``slot`` as ``plan`` lays them out: the
    contiguous ones in one GIL-free gather copy (``threads`` threads pinned to
    ``cpus``), the others (strided, conjugate or negative views) by torch or NumPy."""
    pinned = [_tensor_in(slot, tensor, offset) for tensor, offset in zip(tensors, plan.offsets)]
    contiguous = [i for i, tensor in enumerate(tensors) if copies_as_bytes(tensor)]
    as_bytes = set(contiguous)
    sources = [_bytes_of(tensors[i]) for i in contiguous]
    count = _copy_threads(sum(source.nbytes for source in sources), len(cpus), threads)
    if slot is not None and sources:
        _libnuma.gather_copy(slot, [plan.offsets[i] for i in contiguous], sources, cpus if count > 1 else (), count)
    for i, tensor in enumerate(tensors):
        if i not in as_bytes and _numel(tensor):
            if isinstance(tensor, np.ndarray):
                np.copyto(pinned[i], tensor)
            else:
                pinned[i].copy_(tensor)  # torch releases the GIL for it
    return pinned


def _numel(leaf: Leaf) -> int:
    return int(leaf.size) if isinstance(leaf, np.ndarray) else leaf.numel()


def _tensor_in(slot: _libnuma.Slot | None, like: Leaf, offset: int) -> Any:
    """A tensor (or array) of ``like``'s dtype and shape over ``slot`` at ``offset``.
    Each tensor has a storage of its own bytes only (torch.save or a queue sends no
    more than that); each holds a reference to the slot."""
    if isinstance(like, np.ndarray):
        if like.size == 0 or slot is None:
            return np.empty(like.shape, like.dtype)
        return np.frombuffer(memoryview(slot), dtype=like.dtype, count=like.size, offset=offset).reshape(like.shape)
    if like.numel() == 0 or slot is None:
        return torch.empty(like.shape, dtype=like.dtype)
    tensor = torch.frombuffer(slot, dtype=like.dtype, count=like.numel(), offset=offset).view(like.shape)
    return tensor.requires_grad_() if like.requires_grad else tensor


def _bytes_of(leaf: Leaf) -> Any:
    """A contiguous CPU tensor's or array's memory as a flat uint8 NumPy array (no copy)."""
    if isinstance(leaf, np.ndarray):
        return leaf.reshape(-1).view(np.uint8)
    return leaf.detach().reshape(-1).view(torch.uint8).numpy()


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
        pool = pool_of(tensor.data_ptr()) if tensor.numel() and tensor.device.type == "cpu" else None
        if pool is not None and pool.record_stream(tensor.data_ptr(), stream):
            recorded += 1
    return recorded
