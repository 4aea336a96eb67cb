"""A batch in one pool slot: where each of its tensors and NumPy arrays sits, how its
values get there and how it comes back, in whichever process. The one layout engine of
every way a batch enters a slot: collated into it in a worker (:class:`SlotPacker`,
torch's own ``collate`` with a map that stacks the samples straight into the slot),
packed into it (the pickler of a finished batch turns each tensor or array into a
reference to its bytes there, copying those not there yet, and pickles the rest as it
is: any batch torch could send from a worker), copied in by :func:`fill` (``pin`` and a
loader's copy), and unpacked over the owner's mapping of the slot (:func:`unpack`).

Leaves sit one after another, each on an :data:`ALIGNMENT` boundary, its bytes in
row-major order, or as they lie where a copied leaf is dense (channels_last,
transposed: see :func:`_own_strides`), so that it comes back with its strides, as from
a stock worker. A :data:`Ref` names one leaf's place and kind (all a worker sends of a
tensor); :func:`over_slot` makes its tensor over any process's mapping of the slot.
Every cache of a batch's path follows one policy: :func:`recall` and
:func:`remember`, least recently used dropped past :data:`CACHE_ENTRIES`. A batch's
path crosses this module once per batch, not once per tensor: all that is done per
leaf is here.
"""

from __future__ import annotations

import io
import math
import operator
import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Union

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from numafast import _libnuma
from numafast.errors import InvalidBufferError, SlotFull

__all__ = [
    "ALIGNMENT", "CACHE_ENTRIES", "UNMADE", "Leaf", "Ref", "SlotFull", "SlotLayout", "SlotMeasure", "SlotPacker",
    "bytes_needed", "copy_in", "copy_threads", "fill", "over_slot", "placeable", "plain_array", "recall", "remember",
    "tensor_kind", "unpack",
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
# Whether a NumPy array pickled by torch's worker queue (the default protocol) keeps
# its byte order and dense strides: from protocol 5 (Python 3.14's default) with NumPy 2.
_PICKLED_ARRAYS_KEEP_LAYOUT = pickle.DEFAULT_PROTOCOL >= 5

# A tensor or a NumPy array of plain numbers: what a slot holds.
Leaf = Union[torch.Tensor, "np.ndarray[Any, Any]"]
# A leaf's place in a slot: ("t", offset, dtype name, shape, requires_grad) for a
# tensor, ("a", offset, dtype str, shape) for a NumPy array, their bytes in row-major
# order; "ts" and "as" in place of "t" and "a", byte strides added last, for one laid
# out as its bytes lie (see _own_strides). Hashable and picklable.
Ref = tuple[Any, ...]

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class SlotLayout:
    """Leaves laid out in a slot of ``capacity`` bytes, one after another, each on the
    next :data:`ALIGNMENT` boundary; ``end`` is the bytes used so far. ``sent``: a batch
    a worker sends, whose NumPy arrays are laid out (see :func:`_as_sent`) and whose
    other objects are pickled as torch's worker queue delivers them; else as they are
    (pin(), a batch collated in the process that reads it)."""

    def __init__(self, capacity: int = sys.maxsize, *, sent: bool = False) -> None:
        self.capacity = capacity
        self.end = 0
        self.sent = sent

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
        """Room for a copy of ``leaf``, and its reference, with its strides where it keeps
        them (see :func:`_own_strides`); None for an empty leaf, which takes no room."""
        if isinstance(leaf, np.ndarray):
            if not leaf.size:
                return None
            dtype, keeps_strides = _as_sent(leaf) if self.sent else (leaf.dtype, True)
            ref: Ref = ("a", self.reserve(leaf.nbytes), dtype.str, leaf.shape)
            if leaf.flags.c_contiguous or not keeps_strides:
                return ref
            strides = _own_strides(leaf.shape, leaf.strides, leaf.itemsize)
        else:
            if not leaf.numel():
                return None
            ref = self.tensor_ref(leaf.dtype, leaf.shape, leaf.requires_grad)
            if leaf.is_contiguous() and 1 not in leaf.shape:  # row-major (over a dimension of 1, any stride is contiguous)
                return ref
            itemsize = leaf.itemsize
            strides = _own_strides(leaf.shape, [stride * itemsize for stride in leaf.stride()], itemsize)
        return ref if strides is None else (ref[0] + "s", *ref[1:], strides)


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
        if isinstance(leaf, torch.Tensor) and leaf.is_nested:
            raise InvalidBufferError(f"tensor {index} of the batch is a nested tensor: only dense tensors are pinned")
        if isinstance(leaf, torch.Tensor) and leaf.is_quantized:
            raise InvalidBufferError(f"tensor {index} of the batch is quantized: only plain dense tensors are pinned")
    plan = SlotLayout()
    refs = [plan.leaf_ref(leaf) for leaf in leaves]
    slot, cpus = acquire(plan.end, len(leaves)) if plan.end else (None, ())
    copy_in(slot, [(leaf, ref) for leaf, ref in zip(leaves, refs) if ref is not None], cpus, threads)
    return [_empty_like(leaf) if ref is None else over_slot(slot, ref) for leaf, ref in zip(leaves, refs)]


def copy_in(memory: Any, copies: Sequence[tuple[Leaf, Ref]], cpus: Sequence[int] = (), threads: int | None = 1) -> None:
    """Each leaf of ``copies`` copied into ``memory`` where its reference says: those whose
    bytes are in the order it lays them out in one GIL-free gather copy (``threads``
    threads pinned to ``cpus``; None: see :func:`copy_threads`), others (strided views
    copied row-major, conjugate or negated views) by torch or NumPy."""
    offsets: list[int] = []
    sources: list[Any] = []
    others: list[tuple[Leaf, Ref]] = []
    for leaf, ref in copies:
        source = _bytes_of(leaf, ref)
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
    """The threads that copy ``nbytes`` on ``cpus`` CPUs: ``asked`` (validated by the
    caller; at most ``cpus``), or by default one per 16 MiB, at most ``cpus`` and 8."""
    if asked is not None:
        return min(asked, max(cpus, 1))
    return max(1, min(nbytes // BYTES_PER_COPY_THREAD, cpus, MAX_COPY_THREADS))


def over_slot(memory: Any, ref: Ref) -> Any:
    """The tensor or array ``ref`` names, over ``memory`` (a slot), which it keeps alive;
    its storage is its own bytes only (torch.save or a queue sends no more). Runs for
    every leaf of every batch: the row-major kinds first, each unpacked whole (no slice)."""
    kind = ref[0]
    if kind == "t":
        _, offset, dtype, shape, grad = ref
        numpy_dtype = _NUMPY_DTYPES.get(dtype)
        if numpy_dtype is not None:  # a third of the cost of torch.frombuffer + view, the same tensor
            tensor = torch.from_numpy(np.ndarray(shape, numpy_dtype, memory, offset))
        else:
            tensor = torch.frombuffer(memory, dtype=getattr(torch, dtype), count=math.prod(shape), offset=offset).view(shape)
        return tensor.requires_grad_() if grad else tensor
    if kind == "a":
        _, offset, dtype, shape = ref
        return np.ndarray(shape, np.dtype(dtype), memory, offset)
    return _over_slot_in_own_order(memory, ref)


def _over_slot_in_own_order(memory: Any, ref: Ref) -> Any:
    """:func:`over_slot` of a "ts" or "as" reference: the leaf with its byte strides."""
    if ref[0] == "as":
        _, offset, dtype, shape, strides = ref
        return np.ndarray(shape, np.dtype(dtype), memory, offset, strides)
    _, offset, dtype, shape, grad, strides = ref
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is not None:
        tensor = torch.from_numpy(np.ndarray(shape, numpy_dtype, memory, offset, strides))
    else:  # a dtype NumPy lacks (bfloat16, float8, ...)
        flat = torch.frombuffer(memory, dtype=getattr(torch, dtype), count=math.prod(shape), offset=offset)
        tensor = flat.as_strided(shape, [stride // flat.itemsize for stride in strides])
    return tensor.requires_grad_() if grad else tensor


def plain_array(item: object) -> bool:
    """A NumPy array of plain numbers (no objects, no fields): bytes that can be placed."""
    return type(item) is np.ndarray and not item.dtype.hasobject and item.dtype.fields is None


def placeable(tensor: torch.Tensor) -> bool:
    """A dense, non-empty CPU tensor (not quantized: a reference has no room for its
    scale and zero point): one that can be laid out in a slot."""
    return (
        tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_nested
        and not tensor.is_quantized and tensor.numel() > 0
    )  # fmt: skip


def tensor_kind(tensor: torch.Tensor) -> str:
    """What kind of tensor one that numafast leaves where it is is, for a warning."""
    if tensor.is_nested:
        return "nested tensor"
    return f"quantized tensor on {tensor.device}" if tensor.is_quantized else f"{tensor.layout} tensor on {tensor.device}"


def _as_sent(array: np.ndarray) -> tuple[np.dtype, bool]:
    """The dtype of ``array`` as torch's worker queue delivers it, and whether its strides
    stay (else it arrives row-major): the queue pickles at the default protocol, and
    below 5 NumPy sends the values in native byte order, column-major only for a
    column-major array (a byte-swapped or permuted one arrives as neither)."""
    if _PICKLED_ARRAYS_KEEP_LAYOUT:
        return array.dtype, True
    return array.dtype.newbyteorder("="), array.flags.f_contiguous


def _own_strides(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, ...] | None:
    """The byte ``strides`` of a non-empty leaf where its copy keeps them: those of one
    that covers its span once, each element once, but not in row-major order
    (non-overlapping and dense: channels_last, transposed, permuted), its bytes laid out
    as they lie. None for row-major strides, and for a leaf that overlaps or has gaps
    (expanded, a slice of a larger one): its copy is row-major, its values the same."""
    span = itemsize
    row_major = True
    for size, stride in zip(reversed(shape), reversed(strides)):
        row_major = row_major and stride == span
        span *= size
    if row_major:
        return None
    span = itemsize
    for stride, size in sorted(zip(strides, shape)):
        if size != 1:  # a dimension of one element steps nowhere, whatever its stride
            if stride != span:
                return None
            span *= size
    return tuple(strides)


def _bytes_of(leaf: Leaf, ref: Ref) -> Any:
    """A non-empty CPU tensor's or array's memory as a flat uint8 NumPy array (no copy),
    where that memory is its values in the order ``ref`` lays them out (row-major, or as
    they lie for a "ts" or "as" reference: dense, its bytes from its first one on),
    copied as bytes; None for others."""
    if isinstance(leaf, np.ndarray):
        if ref[2] != leaf.dtype.str:
            return None  # sent in another byte order: NumPy swaps as it copies
        if leaf.flags.c_contiguous:
            return leaf.reshape(-1).view(np.uint8) if leaf.size > 0 else None
        return leaf.ravel(order="K").view(np.uint8) if ref[0] == "as" else None  # a view of a dense one
    if not leaf.numel() or leaf.is_conj() or leaf.is_neg():
        return None
    if leaf.is_contiguous():
        return leaf.detach().reshape(-1).view(torch.uint8).numpy()
    return leaf.detach().as_strided((leaf.numel(),), (1,)).view(torch.uint8).numpy() if ref[0] == "ts" else None


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


# ------------------------------------------------------------ collating and packing

CollateFn = Callable[..., Any]
# A batch not made yet: :meth:`SlotPacker.pack_into` collates its samples into the slot.
UNMADE: Any = object()
# The keys of torch's default_collate_fn_map whose functions return a new tensor.
_NUMPY_SCALARS = (np.bool_, np.number, np.object_)
_NUMBER_KINDS: tuple[Any, ...] = (float, int, _NUMPY_SCALARS)
# torch.tensor(batch) of Python ints only gives int64, of bools only bool; collate gives
# float64 for floats only: such a batch is written into the slot by struct (its code for
# the dtype) in one call. 256 labels here: ~10 us with the check of their types, against
# ~85 us for torch.tensor and ~12 us for NumPy's conversion alone.
_PACKED_NUMBERS: dict[type, tuple[str, torch.dtype]] = {
    int: ("q", torch.int64),
    bool: ("?", torch.bool),
    float: ("d", torch.float64),
}


class SlotPacker(SlotLayout):
    """Lays a batch out in ``memory`` (one slot, writable); :meth:`reset` lays the next
    one out in another slot, with the same collate map (made once)."""

    def __init__(self, memory: Any, made: dict[Ref, Any] | None = None, *, sent: bool = False) -> None:
        super().__init__(sent=sent)
        self.placed: dict[int, tuple[object, Ref]] = {}
        """What is in the slot, by id: tensors made there, and leaves given a place there."""
        self.copies: list[tuple[Leaf, Ref]] = []
        """Leaves :meth:`pack` copies into the slot, and where."""
        self.unpinned: set[str] = set()
        """Kinds of tensors left as they are (sparse, nested, on a device)."""
        self._collate_map: dict[Any, CollateFn] | None = None
        self._payloads: dict[Any, bytes] = {}  # by layout (see pack)
        self.reset(memory, made)

    def reset(self, memory: Any, made: dict[Ref, Any] | None = None) -> SlotPacker:
        """Start laying a new batch out in ``memory``, reusing the tensors in ``made`` (by
        reference: a worker's tensors never leave it, only their references travel)."""
        self.memory = memory
        self.capacity = len(memory)
        self.end = 0
        self._made = made
        self.placed.clear()
        self.copies.clear()
        self.unpinned.clear()
        return self

    def pack_into(
        self, memory: Any, kept: dict[Ref, Any], samples: Any, made: Any
    ) -> tuple[bytes, int, tuple[str, ...]] | None:
        """A worker's batch laid out in ``memory`` (a leased slot; ``kept``: the tensors made
        over it for earlier batches): ``samples`` collated into it as ``default_collate``
        would where ``made`` is :data:`UNMADE`, else ``made`` packed. Its payload, the bytes
        it uses and the kinds of tensors left unpinned; None when it does not fit. Holds
        nothing of the slot afterwards (see worker_collate's _let_go_while_idle)."""
        self.reset(memory, kept)
        try:
            payload = self.pack(self.collate(samples) if made is UNMADE else made)
            return payload, self.end, tuple(sorted(self.unpinned))
        except SlotFull:
            return None
        finally:
            self.reset(b"")

    def close(self) -> None:
        """Let go of the slot and every tensor made over it (a packer used once, by the
        owner): the collate map refers back to the packer, a cycle that would keep the
        slot until the garbage collector runs."""
        self.reset(b"")
        self._collate_map = None
        self._payloads.clear()

    def tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A new tensor in the slot (uninitialised; an empty one outside it)."""
        if not math.prod(shape):
            return torch.empty(tuple(shape), dtype=dtype)
        return self._placed(self.tensor_ref(dtype, shape))

    def _placed(self, ref: Ref) -> torch.Tensor:
        """The tensor ``ref`` names over the slot, known as placed there."""
        tensor: torch.Tensor = self._over(ref)
        self.placed[id(tensor)] = (tensor, ref)
        return tensor

    def _over(self, ref: Ref) -> Any:
        """The tensor ``ref`` names over the slot: the one made for an earlier batch, if kept."""
        made = self._made
        if made is None:
            return over_slot(self.memory, ref)
        over = recall(made, ref, None)
        return remember(made, ref, over_slot(self.memory, ref)) if over is None else over

    def _packed(self, values: Sequence[Any], code: str, dtype: torch.dtype) -> torch.Tensor | None:
        """A ``dtype`` tensor in the slot holding ``values`` (Python numbers of one type),
        written by ``struct`` code ``code`` in one call; None when one does not fit (an
        int beyond int64: torch's own function then says so)."""
        count = len(values)
        ref = self.tensor_ref(dtype, (count,))
        try:
            _struct_of(code, count).pack_into(self.memory, ref[1], *values)
        except struct.error:
            return None
        return self._placed(ref)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied into the slot (now, by torch: for small and strided ones)."""
        if not placeable(tensor):
            return tensor
        copy = self.tensor(tensor.dtype, tensor.shape)
        copy.copy_(tensor)
        return copy

    # ---------------------------------------------------------------- collating into the slot

    def collate(self, samples: Sequence[Any]) -> Any:
        """``default_collate(samples)`` with every tensor made in the slot: torch's
        ``collate`` with its ``default_collate_fn_map`` making them there, but exact
        tuples, lists and dicts take torch's branch here, their lengths checked in C
        (``zip(strict=True)``) rather than per sample; samples that fail it go to torch
        (its error)."""
        if self._collate_map is None:
            collate_map: dict[Any, CollateFn] = dict(default_collate_fn_map)
            for kind in _NUMBER_KINDS:  # torch makes a small tensor of these: make it in the slot too
                if kind in collate_map:
                    make = collate_map[kind]
                    collate_map[kind] = self._placing(make) if kind is _NUMPY_SCALARS else self._numbers(make)
            collate_map[torch.Tensor] = self._stack
            self._collate_map = collate_map
        return self._collate(samples, self._collate_map)

    def _collate(self, batch: Sequence[Any], collate_map: dict[Any, CollateFn]) -> Any:
        elem = batch[0]
        kind = type(elem)
        make = collate_map.get(kind)
        if make is not None:  # torch looks the exact type up first too
            return make(batch, collate_fn_map=collate_map)
        if kind is tuple or kind is list:  # torch: a list of the collated columns, for both
            try:
                columns = list(zip(*batch, strict=True))  # samples of other lengths raise: torch's error below
            except (TypeError, ValueError):
                columns = None
            if columns is not None:
                return [self._collate(column, collate_map) for column in columns]
        elif kind is dict:  # torch: a copy of the first sample with each key's column collated
            return {key: self._collate([sample[key] for sample in batch], collate_map) for key in elem}
        return collate(batch, collate_fn_map=collate_map)

    def _numbers(self, make: CollateFn) -> CollateFn:
        """Python ints, bools or floats (labels, ids) of one type written into the slot by
        struct (the dtype is then known without looking at the values), else ``make``."""

        def collate_numbers(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
            kind = type(batch[0])
            packing = _PACKED_NUMBERS.get(kind)
            if packing is not None and list(map(type, batch)).count(kind) == len(batch):
                packed = self._packed(batch, *packing)
                if packed is not None:
                    return packed
            return self.place(make(batch, collate_fn_map=collate_fn_map))

        return collate_numbers

    def _stack(self, batch: tuple[torch.Tensor, ...] | list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        first = batch[0]
        if not _stacks_in_slot(first):
            own: torch.Tensor = collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # torch's own answer
            return own
        if not _stacks_as_in_a_worker(batch):  # torch's own answer, in the slot unless it records grad
            own = collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
            return own if own.requires_grad else self.place(own)
        return torch.stack(batch, 0, out=self.tensor(first.dtype, (len(batch), *first.shape)))

    def _placing(self, make: CollateFn) -> CollateFn:
        def collate_in_slot(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
            return self.place(make(batch, collate_fn_map=collate_fn_map))

        return collate_in_slot

    # ---------------------------------------------------------------- packing

    def pack(self, batch: object) -> bytes:
        """``batch`` pickled with its tensors and arrays as references into the slot, those
        not there yet copied in (by the calling thread); SlotFull when they do not fit. A batch of lists, tuples and str-keyed dicts of tensors already in the
        slot reuses the payload of the last batch of its layout."""
        layout = _tree(batch, self.placed)
        if layout is not None:
            payload = recall(self._payloads, layout, None)
            if payload is not None:
                return payload
        out = io.BytesIO()
        _Packer(out, self).dump(batch)
        if self.copies:
            copy_in(self.memory, self.copies)
            self.copies.clear()
        payload = out.getvalue()
        return payload if layout is None else remember(self._payloads, layout, payload)

    def reference(self, value: object) -> Ref | None:
        """The slot reference for ``value`` (copied there at the end of :meth:`pack`), or
        None to pickle it as is."""
        known = self.placed.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        if type(value) is torch.Tensor:  # a Parameter pickles as one around its data, placed here
            tensor: torch.Tensor = value
            if not placeable(tensor):
                if tensor.numel():
                    self.unpinned.add(tensor_kind(tensor))
                return None
            leaf: Leaf = tensor
        elif plain_array(value) and value.size:  # type: ignore[attr-defined]
            leaf = value  # type: ignore[assignment]
        else:
            return None
        ref = self.leaf_ref(leaf)
        assert ref is not None  # not empty
        self.copies.append((leaf, ref))
        self.placed[id(value)] = (value, ref)
        return ref


class SlotMeasure(SlotPacker):
    """Lays a batch out as :class:`SlotPacker` would, on the ``meta`` device (shapes
    without bytes): the slot bytes it needs, so that a worker can ask for a pool that
    fits before it collates, and even the first batch is made in its slot."""

    def __init__(self) -> None:
        super().__init__(b"")

    def reset(self, memory: Any, made: dict[Ref, Any] | None = None) -> SlotPacker:
        super().reset(memory)
        self.capacity = sys.maxsize
        return self

    def collated(self, samples: Any) -> int:
        """The bytes ``default_collate(samples)`` needs in a slot."""
        self.reset(b"")
        self.collate(samples)
        return self.end

    def packed(self, batch: Any) -> int:
        """The bytes :meth:`SlotPacker.pack` needs for ``batch`` in a slot."""
        self.reset(b"")
        _Packer(io.BytesIO(), self).dump(batch)
        return self.end

    def _over(self, ref: Ref) -> Any:
        return torch.empty(ref[3], dtype=getattr(torch, ref[2]), device="meta")

    def _numbers(self, make: CollateFn) -> CollateFn:
        return self._placing(make)  # the same bytes as struct writes, where that applies

    def _stack(self, batch: tuple[torch.Tensor, ...] | list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        first = batch[0]
        if not _stacks_in_slot(first) or not _stacks_as_in_a_worker(batch):
            return super()._stack(batch, collate_fn_map=collate_fn_map)
        return self.tensor(first.dtype, (len(batch), *first.shape))


def bytes_needed(samples: Any, made: Any) -> int:
    """The bytes of slot :meth:`SlotPacker.pack_into` needs for ``samples`` (``made`` as there)."""
    measure = SlotMeasure()
    return measure.collated(samples) if made is UNMADE else measure.packed(made)


def _stacks_in_slot(first: torch.Tensor) -> bool:
    """Whether a column whose first tensor is ``first`` is stacked into the slot (dense,
    on the CPU) rather than by torch's own collate function."""
    return first.is_cpu and first.layout is torch.strided and not first.is_nested and not first.is_quantized


def _stacks_as_in_a_worker(batch: Sequence[torch.Tensor]) -> bool:
    """Whether torch's own collate stacks ``batch`` as into a tensor of its first one's
    dtype: always in a DataLoader worker (it stacks with ``out=``), in the main process
    only where every tensor has that dtype and none records grad (torch.stack there
    promotes dtypes and records grad)."""
    if get_worker_info() is not None:
        return True
    dtype = batch[0].dtype
    grad = torch.is_grad_enabled()
    return all(tensor.dtype is dtype and not (grad and tensor.requires_grad) for tensor in batch)


class _Packer(pickle.Pickler):
    def __init__(self, out: io.BytesIO, packer: SlotPacker) -> None:
        super().__init__(out, protocol=pickle.DEFAULT_PROTOCOL if packer.sent else pickle.HIGHEST_PROTOCOL)
        self.packer = packer

    def persistent_id(self, obj: Any) -> Ref | None:
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            return self.packer.reference(obj)
        return None


class _Unpacker(pickle.Unpickler):
    def __init__(self, payload: bytes, slot: Any) -> None:
        super().__init__(io.BytesIO(payload))
        self.slot = slot
        self.made: dict[Ref, Any] = {}  # one object per reference, as in the packed batch

    def persistent_load(self, ref: Any) -> Any:
        made = self.made.get(ref)
        if made is None:
            made = self.made[ref] = over_slot(self.slot, ref)
        return made


def _struct_of(code: str, count: int) -> struct.Struct:
    """``count`` values of struct code ``code``, compiled once (while in use)."""
    compiled = recall(_STRUCTS, (code, count), None)
    return remember(_STRUCTS, (code, count), struct.Struct(f"{count}{code}")) if compiled is None else compiled


_STRUCTS: dict[tuple[str, int], struct.Struct] = {}

# How to rebuild a payload's batch over another slot without unpickling it (same-shaped
# batches have the same payload: offsets are slot-relative): its references in order,
# and the function that makes the batch from them. None for a batch holding more than
# lists, tuples, str-keyed dicts and slot leaves: unpickled anew each time, so no
# object is ever shared between two batches.
Build = Callable[[list[Any]], Any]
_templates: dict[bytes, tuple[tuple[Ref, ...], Build] | None] = {}
_UNSEEN: Any = object()


def unpack(payload: bytes, slot: Any) -> Any:
    """The batch :meth:`SlotPacker.pack` packed, with its tensors and arrays over ``slot``
    (each holds a reference to it: the slot comes back when the last is gone)."""
    template = recall(_templates, payload, _UNSEEN)
    if template is not None and template is not _UNSEEN:
        refs, build = template
        return build([over_slot(slot, ref) for ref in refs])
    unpacker = _Unpacker(payload, slot)
    batch = unpacker.load()
    if template is _UNSEEN:
        made = list(unpacker.made.values())
        tree = _tree(batch, {id(over): (over, position) for position, over in enumerate(made)})
        remember(_templates, payload, None if tree is None else (tuple(unpacker.made), _builder(tree, len(made))))
    return batch


def _tree(value: object, known: dict[int, tuple[object, Any]], seen: set[int] | None = None) -> Any:
    """``value``'s lists, tuples and str-keyed dicts, each as ``(type, *parts)`` (a dict's
    parts ``(key, part)``), with each leaf ``known`` by id as what it maps to: what a
    payload depends on (the leaves' references in the slot), or how to make the batch
    again (their positions among the objects over a slot). None when ``value`` holds
    anything else, or one container twice (``seen``: those met so far): a tree would
    make two of it."""
    found = known.get(id(value))
    if found is not None and found[0] is value:
        return found[1]
    kind = type(value)
    if kind is not list and kind is not tuple and kind is not dict:
        return None
    seen = set() if seen is None else seen
    if id(value) in seen:
        return None
    seen.add(id(value))
    if kind is list or kind is tuple:
        parts = [_tree(item, known, seen) for item in value]  # type: ignore[attr-defined]
        return None if None in parts else (kind, *parts)
    if all(type(key) is str for key in value):  # type: ignore[attr-defined]
        items = [(key, _tree(item, known, seen)) for key, item in value.items()]  # type: ignore[attr-defined]
        return None if any(part is None for _key, part in items) else (dict, *items)
    return None


def _builder(tree: Any, count: int) -> Build:
    """A function that makes the batch of ``tree`` (see :func:`_tree`, its leaves positions)
    from the ``count`` objects over a new slot, in the order of the references."""
    if type(tree) is int:
        return operator.itemgetter(tree)
    kind, *parts = tree
    if kind is dict:
        items = [(key, _builder(part, count)) for key, part in parts]
        return lambda made: {key: part(made) for key, part in items}
    if parts == list(range(count)):
        return kind  # type: ignore[no-any-return]  # the objects themselves, in order: a list of images and labels
    builders = [_builder(part, count) for part in parts]
    if kind is list:
        return lambda made: [part(made) for part in builders]
    return lambda made: tuple(part(made) for part in builders)


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
