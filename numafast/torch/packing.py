"""A batch packed into one pool slot by whichever process fills it, and unpacked over
the owner's mapping of the same slot.

:class:`SlotPacker` lays tensors out in a slot, each on an :data:`ALIGNMENT`
boundary. It serves two ways: as torch's own ``collate`` with a map whose tensor
function stacks the samples straight into the slot (``torch.stack(out=...)``: the
batch is made where it will be read, no copy), and as the pickler of the finished
batch, which turns each tensor or NumPy array into a small reference to its bytes
in the slot (copying those that are not there yet) and pickles everything else as
it is. Any batch that torch could send from a worker can be packed: dicts, lists,
namedtuples, dataclasses, a user's own classes. :func:`unpack` rebuilds it in the
owner with tensors and arrays over the slot.
"""

from __future__ import annotations

import io
import math
import operator
import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from numafast import _libnuma

__all__ = ["ALIGNMENT", "SlotFull", "SlotMeasure", "SlotPacker", "placeable", "tensor_kind", "unpack"]

# Where each tensor starts inside a slot: the CUDA caching allocator's block size,
# so a copy engine reads every tensor from an aligned address.
ALIGNMENT = 512

# A reference to bytes in the slot: ("t", offset, dtype name, shape, requires_grad)
# for a tensor, ("a", offset, dtype str, shape) for a NumPy array.
Ref = tuple[Any, ...]
CollateFn = Callable[..., Any]
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


class SlotFull(Exception):
    """The batch does not fit in the slot."""


def plain_array(item: object) -> bool:
    """A NumPy array of plain numbers (no objects, no fields): bytes that can be placed."""
    return type(item) is np.ndarray and not item.dtype.hasobject and item.dtype.fields is None


def copies_as_bytes(leaf: torch.Tensor | np.ndarray[Any, Any]) -> bool:
    """A non-empty tensor or array whose memory is its values in order: copied as bytes
    (strided, conjugate or negative views are copied by torch or NumPy instead)."""
    if isinstance(leaf, np.ndarray):
        return leaf.size > 0 and leaf.flags.c_contiguous
    return bool(leaf.numel()) and leaf.is_contiguous() and not leaf.is_conj() and not leaf.is_neg()


class SlotPacker:
    """Lays a batch out in ``memory`` (one slot, writable); :meth:`reset` lays the next
    one out in another slot, with the same collate map (made once)."""

    def __init__(self, memory: Any, made: dict[Ref, Any] | None = None) -> None:
        self.placed: dict[int, tuple[object, Ref]] = {}
        self.copies: list[tuple[int, Any]] = []
        self.unpinned: set[str] = set()
        """Kinds of tensors left as they are (sparse, nested, on a device)."""
        self._collate_map: dict[Any, CollateFn] | None = None
        self._payloads: dict[Any, bytes] = {}  # by layout (see pack)
        self.reset(memory, made)

    def reset(self, memory: Any, made: dict[Ref, Any] | None = None) -> SlotPacker:
        """Start laying a new batch out in ``memory``. ``made``: the tensors made over
        ``memory`` for earlier batches, by reference, to reuse (a worker's, whose
        tensors never leave it: only their references travel); None: new ones."""
        self.memory = memory
        self.capacity = len(memory)
        self.end = 0
        self._made = made
        self.placed.clear()
        self.copies.clear()
        self.unpinned.clear()
        return self

    def close(self) -> None:
        """Let go of the slot and of every tensor made over it (a packer used for one
        batch, in the process that owns the pool). Its collate map's functions refer
        back to the packer: a reference cycle that, left as it is, would keep the
        batch's slot until the garbage collector runs."""
        self.memory = b""
        self.capacity = 0
        self._made = None
        self.placed.clear()
        self.copies.clear()
        self._collate_map = None
        self._payloads.clear()

    def _reserve(self, nbytes: int) -> int:
        start = -(-self.end // ALIGNMENT) * ALIGNMENT
        if start + nbytes > self.capacity:
            raise SlotFull(f"{start + nbytes} bytes needed, the slot holds {self.capacity}")
        self.end = start + nbytes
        return start

    def tensor(self, dtype: torch.dtype, shape: Sequence[int], requires_grad: bool = False) -> torch.Tensor:
        """A new tensor in the slot (uninitialised; an empty one outside it)."""
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        start = self._reserve(numel * dtype.itemsize)
        ref = ("t", start, _dtype_name(dtype), tuple(shape), requires_grad)
        tensor: torch.Tensor = self._over(ref)
        self.placed[id(tensor)] = (tensor, ref)
        return tensor

    def _over(self, ref: Ref) -> Any:
        """The tensor ``ref`` names over the slot: made anew, or the one made for an
        earlier batch where they are kept (see :meth:`reset`)."""
        made = self._made
        if made is None:
            return _over_slot(self.memory, ref)
        over = made.get(ref)
        if over is None:
            if len(made) >= _TEMPLATES_KEPT:
                made.clear()
            over = made[ref] = _over_slot(self.memory, ref)
        return over

    def _packed(self, values: Sequence[Any], code: str, dtype: torch.dtype) -> torch.Tensor | None:
        """A ``dtype`` tensor in the slot holding ``values`` (Python numbers, all of one type),
        written by ``struct`` in one call, ``code`` being its code for ``dtype``; None when
        one does not fit (an int beyond int64: torch's own function says so)."""
        count = len(values)
        start = self._reserve(count * dtype.itemsize)
        try:
            _struct_of(code, count).pack_into(self.memory, start, *values)
        except struct.error:
            return None
        ref = ("t", start, _dtype_name(dtype), (count,), False)
        tensor: torch.Tensor = self._over(ref)
        self.placed[id(tensor)] = (tensor, ref)
        return tensor

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied into the slot (now, by torch: for small and strided ones)."""
        if not placeable(tensor):
            return tensor
        copy = self.tensor(tensor.dtype, tensor.shape)
        copy.copy_(tensor)
        return copy

    # ---------------------------------------------------------------- collating into the slot

    def collate(self, samples: Sequence[Any]) -> Any:
        """``default_collate(samples)``, every tensor it makes made in the slot: torch's own
        ``collate`` with :meth:`collate_map`, except that samples (and their parts) that are
        exactly a tuple, list or dict take torch's branch for them here, with its check of
        their lengths made in C (by ``zip(strict=True)``) rather than per sample in Python;
        any other type, and samples that fail that check, go to torch's ``collate`` (its
        result, its error)."""
        return self._collate(samples, self.collate_map())

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

    def collate_map(self) -> dict[Any, CollateFn]:
        """torch's ``default_collate_fn_map`` with every tensor it makes made in the slot:
        given to ``torch.utils.data._utils.collate.collate``, it is ``default_collate``
        (the same structure, types and errors) with the batch landing in place."""
        if self._collate_map is None:
            self._collate_map = self._make_collate_map()
        return self._collate_map

    def _make_collate_map(self) -> dict[Any, CollateFn]:
        collate_map: dict[Any, CollateFn] = dict(default_collate_fn_map)
        for kind in _NUMBER_KINDS:  # torch makes a small tensor of these: make it in the slot too
            if kind in collate_map:
                make = collate_map[kind]
                collate_map[kind] = self._placing(make) if kind is _NUMPY_SCALARS else self._numbers(make)
        collate_map[torch.Tensor] = self._stack
        return collate_map

    def _numbers(self, make: CollateFn) -> CollateFn:
        """Python ints, bools or floats (labels, ids) written into the slot by struct where
        they are all of one of those types (torch's dtype is then known without looking
        at the values), else torch's own function (``make``), with its result or error."""

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
        return torch.stack(batch, 0, out=self.tensor(first.dtype, (len(batch), *first.shape)))

    def _placing(self, make: CollateFn) -> CollateFn:
        def collate_in_slot(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
            return self.place(make(batch, collate_fn_map=collate_fn_map))

        return collate_in_slot

    # ---------------------------------------------------------------- packing

    def pack(self, batch: object, cpus: Sequence[int] = (), threads: int = 1) -> bytes:
        """``batch`` pickled with its tensors and arrays as references into the slot; those
        not in it yet are copied there (in one GIL-free gather copy, ``threads`` threads
        on ``cpus``). SlotFull when they do not fit.

        A batch of lists, tuples and str-keyed dicts of tensors collated into the slot
        has the same payload as the last one of its layout: that is reused, not pickled."""
        layout = self._layout(batch)
        if layout is not None:
            payload = self._payloads.get(layout)
            if payload is not None:
                return payload
        out = io.BytesIO()
        _Packer(out, self).dump(batch)
        if self.copies:
            offsets = [offset for offset, _source in self.copies]
            _libnuma.gather_copy(self.memory, offsets, [source for _offset, source in self.copies], cpus, threads)
            self.copies.clear()
        payload = out.getvalue()
        if layout is not None:
            if len(self._payloads) >= _TEMPLATES_KEPT:
                self._payloads.clear()
            self._payloads[layout] = payload
        return payload

    def _layout(self, value: object) -> Any:
        """What makes ``value``'s payload: its containers and the references of the
        tensors in the slot they hold; None when it holds anything else."""
        known = self.placed.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        kind = type(value)
        if kind is list or kind is tuple:
            parts = [self._layout(item) for item in value]  # type: ignore[attr-defined]
            return None if None in parts else (kind, *parts)
        if kind is dict and all(type(key) is str for key in value):  # type: ignore[attr-defined]
            items = [(key, self._layout(item)) for key, item in value.items()]  # type: ignore[attr-defined]
            return None if any(part is None for _key, part in items) else (dict, *items)
        return None

    def _copy_in(self, target: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
        if copies_as_bytes(tensor):  # in the one gather copy at the end of pack()
            self.copies.append((offset, tensor.detach().reshape(-1).view(torch.uint8).numpy()))
        else:
            with torch.no_grad():
                target.copy_(tensor)

    def reference(self, value: object) -> Ref | None:
        """The slot reference for ``value`` (placing it first), or None to pickle it as is."""
        known = self.placed.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            tensor: torch.Tensor = value  # type: ignore[assignment]
            if not placeable(tensor):
                if tensor.numel():
                    self.unpinned.add(tensor_kind(tensor))
                return None
            target = self.tensor(tensor.dtype, tensor.shape, tensor.requires_grad)
            ref = self.placed[id(target)][1]
            self._copy_in(target, ref[1], tensor)
        elif isinstance(value, np.ndarray) and plain_array(value) and value.size:
            start = self._reserve(value.nbytes)
            self.copies.append((start, np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
            ref = ("a", start, value.dtype.str, value.shape)
        else:
            return None
        self.placed[id(value)] = (value, ref)
        return ref


class SlotMeasure(SlotPacker):
    """Lays a batch out as :class:`SlotPacker` would, in no memory: the bytes of slot
    it needs, for a worker to ask for a pool that fits before it collates (so that
    even the first batch is made in its slot). Tensors it makes are on the ``meta``
    device: shapes without bytes."""

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
        self.copies.clear()
        return self.end

    def tensor(self, dtype: torch.dtype, shape: Sequence[int], requires_grad: bool = False) -> torch.Tensor:
        numel = math.prod(shape)
        start = self._reserve(numel * dtype.itemsize) if numel else 0
        tensor = torch.empty(tuple(shape), dtype=dtype, device="meta")
        self.placed[id(tensor)] = (tensor, ("t", start, _dtype_name(dtype), tuple(shape), requires_grad))
        return tensor

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        if placeable(tensor):
            self.tensor(tensor.dtype, tensor.shape)
        return tensor

    def _copy_in(self, target: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
        pass

    def _numbers(self, make: CollateFn) -> CollateFn:
        return self._placing(make)  # the same bytes as struct writes, where that applies

    def _stack(self, batch: tuple[torch.Tensor, ...] | list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        first = batch[0]
        if not _stacks_in_slot(first):
            return super()._stack(batch, collate_fn_map=collate_fn_map)
        return self.tensor(first.dtype, (len(batch), *first.shape))


def tensor_kind(tensor: torch.Tensor) -> str:
    """What kind of tensor one that numafast leaves where it is is, for a warning."""
    return "nested tensor" if tensor.is_nested else f"{tensor.layout} tensor on {tensor.device}"


def _stacks_in_slot(first: torch.Tensor) -> bool:
    """A column whose first tensor is this one is stacked into the slot (dense, on the
    CPU); others are left to torch's own collate function."""
    return first.is_cpu and first.layout is torch.strided and not first.is_nested


def placeable(tensor: torch.Tensor) -> bool:
    """A dense, non-empty CPU tensor: one that can be laid out in a slot."""
    return tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_nested and tensor.numel() > 0


class _Packer(pickle.Pickler):
    def __init__(self, out: io.BytesIO, packer: SlotPacker) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
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
            made = self.made[ref] = _over_slot(self.slot, ref)
        return made


# torch dtype name -> NumPy dtype, for those NumPy has (not bfloat16, float8, ...).
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {}
for _name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "float32",
              "float64", "complex64", "complex128"):  # fmt: skip
    if hasattr(torch, _name):
        _NUMPY_DTYPES[_name] = torch.empty(0, dtype=getattr(torch, _name)).numpy().dtype


def _struct_of(code: str, count: int) -> struct.Struct:
    """``count`` values of struct code ``code``, compiled once."""
    compiled = _STRUCTS.get((code, count))
    if compiled is None:
        if len(_STRUCTS) >= _TEMPLATES_KEPT:
            _STRUCTS.clear()
        compiled = _STRUCTS[(code, count)] = struct.Struct(f"{count}{code}")
    return compiled


_STRUCTS: dict[tuple[str, int], struct.Struct] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name as a reference carries it ("uint8")."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _over_slot(slot: Any, ref: Ref) -> Any:
    """The tensor or array ``ref`` names, over ``slot``. The array (and so the tensor made
    from it) holds a reference to ``slot``: the slot lives as long as they do."""
    kind, offset, dtype, shape = ref[:4]
    if kind == "a":
        return np.ndarray(shape, np.dtype(dtype), slot, offset)
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is not None:  # a third of the cost of torch.frombuffer + view, the same tensor
        tensor = torch.from_numpy(np.ndarray(shape, numpy_dtype, slot, offset))
    else:
        tensor = torch.frombuffer(slot, dtype=getattr(torch, dtype), count=math.prod(shape), offset=offset).view(shape)
    return tensor.requires_grad_() if ref[4] else tensor


# How to rebuild a payload's batch over another slot without unpickling it: the
# payload of same-shaped batches is the same bytes (offsets are slot-relative), so
# its structure is learnt once. None: a payload whose batch holds more than lists,
# tuples, str-keyed dicts and slot tensors and arrays (anything else is unpickled
# anew every time, so no object is ever shared between two batches).
Build = Callable[[list[Any]], Any]
# A reference as a template makes it again: (NumPy dtype, shape, offset) of a tensor
# made by torch.from_numpy (the dtype None for any other kind), and the reference.
Maker = tuple[Any, tuple[int, ...], int, Ref]
_templates: dict[bytes, tuple[tuple[Maker, ...], Build] | None] = {}
_TEMPLATES_KEPT = 64
_UNSEEN: Any = object()
_from_numpy = torch.from_numpy
_ndarray = np.ndarray


def unpack(payload: bytes, slot: Any) -> Any:
    """The batch :meth:`SlotPacker.pack` packed, with its tensors and arrays over ``slot``
    (each holds a reference to it: the slot comes back when the last is gone)."""
    template = _templates.get(payload, _UNSEEN)
    if template is not None and template is not _UNSEEN:
        makers, build = template
        return build([
            _over_slot(slot, ref) if dtype is None else _from_numpy(_ndarray(shape, dtype, slot, offset))
            for dtype, shape, offset, ref in makers
        ])  # fmt: skip
    unpacker = _Unpacker(payload, slot)
    batch = unpacker.load()
    if template is _UNSEEN:
        if len(_templates) >= _TEMPLATES_KEPT:
            _templates.clear()
        builder = _builder(batch, {id(made): position for position, made in enumerate(unpacker.made.values())},
                           len(unpacker.made))  # fmt: skip
        _templates[payload] = None if builder is None else (tuple(map(_maker, unpacker.made)), builder)
    return batch


def _maker(ref: Ref) -> Maker:
    plain = ref[0] == "t" and not ref[4]  # not an array, no gradient to ask for
    return (_NUMPY_DTYPES.get(ref[2]) if plain else None), ref[3], ref[1], ref


def _builder(value: Any, positions: dict[int, int], count: int) -> Build | None:
    """A function that makes ``value`` again from the ``count`` objects over a new slot
    (given in a new list, in the order of the references), or None when ``value``
    holds anything else."""
    position = positions.get(id(value))
    if position is not None:
        return operator.itemgetter(position)
    kind = type(value)
    if kind is list or kind is tuple:
        if [positions.get(id(item)) for item in value] == list(range(count)):
            return list if kind is list else tuple  # the objects themselves, in order: a list of images and labels
        parts = [_builder(item, positions, count) for item in value]
        if any(part is None for part in parts):
            return None
        if kind is list:
            return lambda made: [part(made) for part in parts]  # type: ignore[misc]
        return lambda made: tuple(part(made) for part in parts)  # type: ignore[misc]
    if kind is dict and all(type(key) is str for key in value):
        items = [(key, _builder(item, positions, count)) for key, item in value.items()]
        if any(part is None for _key, part in items):
            return None
        return lambda made: {key: part(made) for key, part in items}  # type: ignore[misc]
    return None
