"""A batch's tensors and NumPy arrays in one pool slot: where each sits, how its values
get there, and the tensors made over the slot. The one layout engine of every way a
batch enters a slot (collated or packed by :class:`~numafast.torch.packing.SlotPacker`,
copied in by :func:`numafast.torch.pin` and a loader's copy).

Leaves sit one after another, each on an :data:`ALIGNMENT` boundary. A :data:`Ref`
names one leaf's place and kind (all a worker sends of a tensor); :func:`over_slot`
makes its tensor over any process's mapping of the slot. Every cache of a batch's
path follows one policy: :func:`recall` and :func:`remember`, least recently used
dropped past :data:`CACHE_ENTRIES`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Union

import numpy as np
import torch

from numafast import _libnuma
from numafast._validate import positive_int
from numafast.errors import InvalidBufferError, SlotFull

__all__ = [
    "ALIGNMENT", "CACHE_ENTRIES", "Leaf", "Ref", "SlotFull", "SlotLayout", "copy_in", "copy_threads",
    "fill", "over_slot", "placeable", "plain_array", "recall", "remember", "tensor_kind",
]  # fmt: skip

# Where each leaf starts inside a slot: the CUDA caching allocator's block size, so a
# copy engine reads every tensor from an aligned address.
ALIGNMENT = 512
# Below this many bytes per thread, one more copy thread costs more than it saves.
BYTES_PER_COPY_THREAD = 16 << 20
# Beyond this many threads a copy is memory-bound anyway.
MAX_COPY_THREADS = 8
# The most entries any cache of a batch's path keeps (see recall and remember).
CACHE_ENTRIES = 64

# A tensor or a NumPy array of plain numbers: what a slot holds.
Leaf = Union[torch.Tensor, "np.ndarray[Any, Any]"]
# A leaf's place in a slot: ("t", offset, dtype name, shape, requires_grad) for a
# tensor, ("a", offset, dtype str, shape) for a NumPy array. Hashable and picklable.
Ref = tuple[Any, ...]

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class SlotLayout:
    """Leaves laid out in a slot of ``capacity`` bytes, one after another, each on the
    next :data:`ALIGNMENT` boundary; ``end`` is the bytes used so far."""

    def __init__(self, capacity: int = sys.maxsize) -> None:
        self.capacity = capacity
        self.end = 0

    def reserve(self, nbytes: int) -> int:
        """Where the next ``nbytes`` go; SlotFull when they do not fit."""
        start = -(-self.end // ALIGNMENT) * ALIGNMENT
        if start + nbytes > self.capacity:
            raise SlotFull(f"{start + nbytes} bytes needed, the slot holds {self.capacity}")
        self.end = start + nbytes
        return start

    def tensor_ref(self, dtype: torch.dtype, shape: Sequence[int], requires_grad: bool = False) -> Ref:
        """Room for a tensor of ``dtype`` and ``shape`` (not empty), and its reference."""
        start = self.reserve(math.prod(shape) * dtype.itemsize)
        return "t", start, _DTYPE_NAMES[dtype], tuple(shape), requires_grad

    def leaf_ref(self, leaf: Leaf) -> Ref | None:
        """Room for a copy of ``leaf``, and its reference; None for an empty leaf, which
        takes no room."""
        if isinstance(leaf, np.ndarray):
            return ("a", self.reserve(leaf.nbytes), leaf.dtype.str, leaf.shape) if leaf.size else None
        return self.tensor_ref(leaf.dtype, leaf.shape, leaf.requires_grad) if leaf.numel() else None


def fill(
    leaves: Sequence[Leaf], acquire: Callable[[int, int], tuple[Any, Sequence[int]]], threads: int | None = None
) -> list[Any]:
    """Copies of ``leaves`` laid out in the slot ``acquire(bytes, leaves)`` gives (with the
    CPUs to copy on; not called when they need no bytes), which they hold: it comes back
    when the last of them goes. An empty leaf's copy is a new empty one. Checks that
    every tensor is a dense CPU tensor (the only kind that can be pinned)."""
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
            raise InvalidBufferError(f"tensor {index} of the batch is on {leaf.device}: only host tensors are pinned")
        if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
            raise InvalidBufferError(f"tensor {index} of the batch is {leaf.layout}: only dense tensors are pinned")
    plan = SlotLayout()
    refs = [plan.leaf_ref(leaf) for leaf in leaves]
    slot, cpus = acquire(plan.end, len(leaves)) if plan.end else (None, ())
    copy_in(slot, [(leaf, ref) for leaf, ref in zip(leaves, refs) if ref is not None], cpus, threads)
    return [_empty_like(leaf) if ref is None else over_slot(slot, ref) for leaf, ref in zip(leaves, refs)]


def copy_in(memory: Any, copies: Sequence[tuple[Leaf, Ref]], cpus: Sequence[int] = (), threads: int | None = 1) -> None:
    """Each leaf of ``copies`` copied into ``memory`` where its reference says: contiguous
    ones in one GIL-free gather copy (``threads`` threads pinned to ``cpus``; None: see
    :func:`copy_threads`), others (strided, conjugate or negated views) by torch or NumPy."""
    offsets: list[int] = []
    sources: list[Any] = []
    others: list[tuple[Leaf, Ref]] = []
    for leaf, ref in copies:
        source = _bytes_of(leaf)
        if source is None:
            others.append((leaf, ref))
        else:
            offsets.append(ref[1])
            sources.append(source)
    count = copy_threads(sum(source.nbytes for source in sources), len(cpus), threads)
    if sources:
        _libnuma.gather_copy(memory, offsets, sources, cpus if count > 1 else (), count)
    for leaf, ref in others:
        target = over_slot(memory, ref)
        if isinstance(leaf, np.ndarray):
            np.copyto(target, leaf)
        else:
            with torch.no_grad():
                target.copy_(leaf)  # torch releases the GIL for it


def copy_threads(nbytes: int, cpus: int, asked: int | None) -> int:
    """The threads that copy ``nbytes`` on ``cpus`` CPUs: ``asked`` (at most ``cpus``), or
    by default one per 16 MiB, at most ``cpus`` and 8."""
    if asked is not None:
        return min(positive_int(asked, "threads"), max(cpus, 1))
    return max(1, min(nbytes // BYTES_PER_COPY_THREAD, cpus, MAX_COPY_THREADS))


def over_slot(memory: Any, ref: Ref) -> Any:
    """The tensor or array ``ref`` names, over ``memory`` (a slot), which it keeps alive;
    its storage is its own bytes only (torch.save or a queue sends no more)."""
    kind, offset, dtype, shape = ref[:4]
    if kind == "a":
        return np.ndarray(shape, np.dtype(dtype), memory, offset)
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is not None:  # a third of the cost of torch.frombuffer + view, the same tensor
        tensor = torch.from_numpy(np.ndarray(shape, numpy_dtype, memory, offset))
    else:
        tensor = torch.frombuffer(memory, dtype=getattr(torch, dtype), count=math.prod(shape), offset=offset).view(shape)
    return tensor.requires_grad_() if ref[4] else tensor


def plain_array(item: object) -> bool:
    """A NumPy array of plain numbers (no objects, no fields): bytes that can be placed."""
    return type(item) is np.ndarray and not item.dtype.hasobject and item.dtype.fields is None


def placeable(tensor: torch.Tensor) -> bool:
    """A dense, non-empty CPU tensor: one that can be laid out in a slot."""
    return tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_nested and tensor.numel() > 0


def tensor_kind(tensor: torch.Tensor) -> str:
    """What kind of tensor one that numafast leaves where it is is, for a warning."""
    return "nested tensor" if tensor.is_nested else f"{tensor.layout} tensor on {tensor.device}"


def _bytes_of(leaf: Leaf) -> Any:
    """A non-empty CPU tensor's or array's memory as a flat uint8 NumPy array (no copy),
    where that memory is its values in order (copied as bytes); None for others."""
    if isinstance(leaf, np.ndarray):
        return leaf.reshape(-1).view(np.uint8) if leaf.size > 0 and leaf.flags.c_contiguous else None
    if leaf.numel() and leaf.is_contiguous() and not leaf.is_conj() and not leaf.is_neg():
        return leaf.detach().reshape(-1).view(torch.uint8).numpy()
    return None


def _empty_like(leaf: Leaf) -> Any:
    """A new empty tensor or array of ``leaf``'s dtype and shape: an empty leaf's copy."""
    if isinstance(leaf, np.ndarray):
        return np.empty(leaf.shape, leaf.dtype)
    return torch.empty(leaf.shape, dtype=leaf.dtype)


def recall(cache: dict[K, V], key: K, missing: D) -> V | D:
    """``cache[key]``, now its most recently used entry; ``missing`` when it has none."""
    if key not in cache:
        return missing
    value = cache[key] = cache.pop(key)  # last in the dict's order: the most recently used
    return value


def remember(cache: dict[K, V], key: K, value: V) -> V:
    """``value`` kept in ``cache`` under ``key``; past :data:`CACHE_ENTRIES` entries the
    least recently used goes, so new keys never grow memory and the ones in use stay."""
    if len(cache) >= CACHE_ENTRIES and key not in cache:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


# Every torch dtype's name as a reference carries it ("uint8"), and the NumPy dtype of
# those NumPy has (not bfloat16, float8, ...).
_DTYPE_NAMES: dict[torch.dtype, str] = {
    dtype: str(dtype).removeprefix("torch.") for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)
}
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {}
for _name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "float32",
              "float64", "complex64", "complex128"):  # fmt: skip
    if hasattr(torch, _name):
        _NUMPY_DTYPES[_name] = torch.empty(0, dtype=getattr(torch, _name)).numpy().dtype
