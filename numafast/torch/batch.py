"""numafast.torch.pin: a nested batch (tensors and NumPy arrays inside dicts, lists,
tuples, namedtuples and dataclasses) copied into one slot of a PinnedPool, in one
GIL-free copy, and the walk of a batch's structure it is made of.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import UserString
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from numafast._validate import positive_int
from numafast.errors import SlotTooSmallError
from numafast.pool import PinnedPool, Slot, pool_of
from numafast.torch.slot import ALIGNMENT, fill, plain_array

__all__ = ["flatten", "pin", "record_stream"]

Batch = TypeVar("Batch")
# Leaves that are values, not buffers: kept as they are without a word.
PLAIN_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), np.generic, torch.dtype, torch.device)


def flatten(
    batch: Batch, *, arrays: bool = False, opaque: set[str] | None = None
) -> tuple[list[Any], Callable[[Sequence[Any]], Batch]]:
    """The distinct tensors of ``batch`` (with ``arrays``, its plain NumPy arrays too) in
    a fixed order, and a function that rebuilds the structure with other values in
    their places (a leaf found twice is one entry). ``opaque`` receives the type names
    of leaves the walk cannot see into (with ``arrays``, of NumPy arrays that are not
    plain numbers too)."""
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
        if arrays and isinstance(item, np.ndarray):  # of objects or of fields: not raw numbers
            if opaque is not None:
                opaque.add(f"numpy.ndarray of dtype {item.dtype}")
            continue
        children = list(_children(item))
        if opaque is not None and not children and _opaque(item):
            opaque.add(f"{type(item).__module__}.{type(item).__qualname__}")
        pending.extend(reversed(children))

    def rebuild(replacements: Sequence[Any]) -> Batch:
        if len(replacements) != len(leaves):
            raise ValueError(f"{len(replacements)} values to put back into a batch of {len(leaves)}")
        return _rebuild(batch, lambda leaf: replacements[positions[id(leaf)]], arrays)  # type: ignore[no-any-return]

    return leaves, rebuild


def _opaque(item: object) -> bool:
    """A leaf with no parts that is neither a buffer, a value, nor an (empty) container."""
    return not (
        isinstance(item, (torch.Tensor, np.ndarray, Mapping, Sequence, *PLAIN_LEAVES)) or dataclasses.is_dataclass(item)
    )


def _children(item: Any) -> Iterator[Any]:
    """The parts of a container the walk goes into (none for a leaf)."""
    if isinstance(item, (str, bytes, bytearray, UserString)):  # a UserString's items are UserStrings
        return iter(())
    if isinstance(item, Mapping):
        return iter(item.values())
    if isinstance(item, (tuple, list)) or (isinstance(item, Sequence) and not isinstance(item, range)):
        return iter(item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return (getattr(item, field.name) for field in dataclasses.fields(item))
    return iter(())


def _rebuild(item: Any, replace: Callable[[Any], Any], arrays: bool = False, made: dict[int, Any] | None = None) -> Any:
    """``item`` with every tensor (with ``arrays``, every plain array) replaced, in
    containers of the same types (as torch's pin_memory rebuilds them); a container found
    twice (``made``: those rebuilt so far, by id) is rebuilt once, shared as it was."""
    if isinstance(item, torch.Tensor) or (arrays and plain_array(item)):
        return replace(item)
    if isinstance(item, (str, bytes, bytearray, UserString)):
        return item
    made = {} if made is None else made
    if id(item) not in made:
        made[id(item)] = _rebuilt(item, lambda part: _rebuild(part, replace, arrays, made))
    return made[id(item)]


def _rebuilt(item: Any, rebuild: Callable[[Any], Any]) -> Any:
    """Container ``item`` made again of its parts, each given by ``rebuild``."""
    if isinstance(item, Mapping):
        values = {key: rebuild(value) for key, value in item.items()}
        if isinstance(item, MutableMapping):
            mapping = copy.copy(item)  # keeps the mapping's type and extra attributes
            mapping.update(values)
            return mapping
        try:
            return type(item)(values)  # type: ignore[call-arg]
        except TypeError:
            return values
    if isinstance(item, tuple):
        parts = [rebuild(part) for part in item]
        try:
            return type(item)(*parts) if hasattr(item, "_fields") else type(item)(parts)
        except TypeError:  # a tuple class made otherwise: left as it is, its tensors where they are
            return item
    if isinstance(item, MutableSequence):
        sequence = copy.copy(item)
        for index, part in enumerate(item):
            sequence[index] = rebuild(part)
        return sequence
    if isinstance(item, Sequence) and not isinstance(item, range):
        parts = [rebuild(part) for part in item]
        try:
            return type(item)(parts)  # type: ignore[call-arg]
        except TypeError:
            return parts
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        instance = copy.copy(item)
        for field in dataclasses.fields(item):
            object.__setattr__(instance, field.name, rebuild(getattr(item, field.name)))  # frozen ones too
        return instance
    return item


def pin(batch: Batch, pool: PinnedPool, *, threads: int | None = None, timeout: float | None = None) -> Batch:
    """``batch`` copied into one slot of ``pool``: the same structure, each tensor (and
    NumPy array) replaced by one of the same dtype, shape and values over pool memory,
    and the same strides where it is dense (channels_last, transposed; one that overlaps
    or has gaps, expanded or sliced, comes back row-major).

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
    threads = None if threads is None else positive_int(threads, "threads")

    def warn(opaque: set[str]) -> None:
        warnings.warn(
            f"pin() leaves {', '.join(sorted(opaque))} where they are: it places tensors and NumPy arrays of plain "
            "numbers inside "
            "dicts, lists, tuples, namedtuples and dataclasses", RuntimeWarning, stacklevel=4,  # pin's caller
        )

    def acquire(nbytes: int, leaves: int) -> tuple[Slot, Sequence[int]]:
        if nbytes > pool.slot_bytes:
            raise SlotTooSmallError(
                f"the batch needs {nbytes} bytes ({leaves} tensors, each aligned to {ALIGNMENT} bytes) "
                f"but a slot of this pool holds {pool.slot_bytes} bytes"
            )
        return (pool.acquire(nbytes) if timeout is None else pool.acquire(nbytes, timeout)), pool.cpus

    return place(batch, acquire, warn, threads=threads)


def place(
    batch: Batch,
    acquire: Callable[[int, int], tuple[Slot, Sequence[int]]],
    warn: Callable[[set[str]], None],
    keep: Callable[[Any], bool] = lambda leaf: False,
    threads: int | None = None,
) -> Batch:
    """The steps of every pin: ``batch``'s tensors and arrays (but those ``keep`` keeps)
    copied into a slot by :func:`~numafast.torch.slot.fill` with ``acquire``, in the same
    structure; ``warn(kinds)`` first, with the kinds it cannot see into."""
    opaque: set[str] = set()
    leaves, rebuild = flatten(batch, arrays=True, opaque=opaque)
    if opaque:
        warn(opaque)
    kept = [keep(leaf) or _of_own_class(leaf) for leaf in leaves]
    placed = [leaf for leaf, left in zip(leaves, kept) if not left]
    if not placed:
        return batch
    copies = iter(fill(placed, acquire, threads))
    return rebuild([leaf if left else next(copies) for leaf, left in zip(leaves, kept)])


def _of_own_class(leaf: Any) -> bool:
    """A tensor of a class of its own (a subclass, a Parameter): left as it is, as a
    worker's packing pickles it, since a copy in a slot would be a plain tensor."""
    return isinstance(leaf, torch.Tensor) and type(leaf) is not torch.Tensor


def record_stream(batch: object, stream: object) -> int:
    """Name a CUDA stream that reads the pinned tensors of ``batch`` (as
    ``Tensor.record_stream`` does): their slots are reused only once the work queued on
    ``stream`` by the time they come back is done. Returns how many were in a registered pool."""
    recorded = 0
    for tensor in flatten(batch)[0]:
        pool = pool_of(tensor.data_ptr()) if tensor.numel() and tensor.device.type == "cpu" else None
        if pool is not None and pool.record_stream(tensor.data_ptr(), stream):
            recorded += 1
    return recorded
