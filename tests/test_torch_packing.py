"""A batch packed into a slot and unpacked over the owner's mapping: the second and
later batches of a layout are rebuilt from a template, and must come out exactly as
unpickling makes them."""

from __future__ import annotations

import gc
from collections import namedtuple
from typing import Any

import numpy as np
import pytest

from sysfs_truth import online_nodes

torch = pytest.importorskip("torch")

import numafast  # noqa: E402
from numafast.torch import slot as slot_engine  # noqa: E402
from numafast.torch.batch import flatten  # noqa: E402
from numafast.torch.slot import CACHE_ENTRIES, recall, remember  # noqa: E402

NODE = online_nodes()[0]
Pair = namedtuple("Pair", "image label")


def packed(pool: numafast.PinnedPool, batch: Any) -> tuple[Any, bytes]:
    """A slot of ``pool`` holding ``batch`` (packed as a worker packs it), and its payload."""
    slot = pool.acquire()
    return slot, slot_engine.SlotPacker(memoryview(slot)).pack(batch)


def in_slot(value: Any, slot: Any) -> bool:
    start = np.asarray(slot).ctypes.data
    address = value.data_ptr() if isinstance(value, torch.Tensor) else value.ctypes.data
    return start <= address < start + len(memoryview(slot))


def test_a_layout_seen_before_is_rebuilt_as_unpickling_makes_it() -> None:
    slot_engine._templates.clear()
    with numafast.PinnedPool(NODE, 1 << 20, 4, register="off") as pool:
        shared = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        batch = {"image": shared, "again": shared, "rows": [torch.ones(4, dtype=torch.int64), (np.arange(3),)],
                 "mask": torch.tensor([True, False])}  # fmt: skip
        first_slot, payload = packed(pool, batch)
        second_slot, second_payload = packed(pool, batch)
        assert payload == second_payload  # slot-relative: the same bytes for the same layout
        first = slot_engine.unpack(payload, first_slot)
        assert payload in slot_engine._templates and slot_engine._templates[payload] is not None
        second = slot_engine.unpack(payload, second_slot)  # from the template
        for made, slot in ((first, first_slot), (second, second_slot)):
            assert type(made) is dict and list(made) == ["image", "again", "rows", "mask"]
            assert made["image"] is made["again"]  # one object per reference, as unpickled
            assert type(made["rows"]) is list and type(made["rows"][1]) is tuple
            assert isinstance(made["rows"][1][0], np.ndarray) and made["rows"][1][0].tolist() == [0, 1, 2]
            assert torch.equal(made["image"], shared) and made["image"].dtype == torch.float32
            assert torch.equal(made["rows"][0], torch.ones(4, dtype=torch.int64))
            assert made["mask"].tolist() == [True, False]
            leaves = [made["image"], made["rows"][0], made["rows"][1][0], made["mask"]]
            assert all(in_slot(leaf, slot) for leaf in leaves)
        second["image"][0, 0] = 42.0
        assert first["image"][0, 0] == 0.0  # each over its own slot
        del first, second, first_slot, second_slot, made, slot, leaves
        gc.collect()
        assert pool.stats().in_use == 0  # the slots came back with the last tensor over them


def test_a_template_keeps_bfloat16_and_tensors_that_need_grad() -> None:
    slot_engine._templates.clear()
    with numafast.PinnedPool(NODE, 1 << 20, 2, register="off") as pool:
        batch = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, requires_grad=True)]
        slots_and_payloads = [packed(pool, batch) for _ in range(2)]
        for slot, payload in slots_and_payloads:
            half, weights = slot_engine.unpack(payload, slot)
            assert half.dtype == torch.bfloat16 and half.tolist() == [1.0, 1.0, 1.0] and in_slot(half, slot)
            assert weights.requires_grad and weights.tolist() == [0.0, 0.0]
        del half, weights, slots_and_payloads


def test_batches_with_other_objects_are_unpickled_each_time_sharing_nothing() -> None:
    slot_engine._templates.clear()
    with numafast.PinnedPool(NODE, 1 << 20, 4, register="off") as pool:
        batch = Pair(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), ["a.jpg", "b.jpg"])  # a user's own collate's
        made = [slot_engine.unpack(payload, slot) for slot, payload in (packed(pool, batch) for _ in range(2))]
        assert all(type(pair) is Pair and pair.label == ["a.jpg", "b.jpg"] for pair in made)
        assert made[0].label is not made[1].label  # a consumer may change one batch's list
        assert torch.equal(made[1].image, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
        assert set(slot_engine._templates.values()) == {None}
        del made


def test_a_packer_reuses_a_payload_only_for_the_same_layout_of_slot_tensors() -> None:
    with numafast.PinnedPool(NODE, 1 << 20, 2, register="off") as pool:
        slot = pool.acquire()
        packer = slot_engine.SlotPacker(memoryview(slot))

        def pack(shape: tuple[int, ...], name: str | None = None) -> tuple[bytes, Any]:
            packer.reset(memoryview(slot))
            images = packer.tensor(torch.float32, shape)
            images.fill_(1.0)
            batch: Any = [images, packer.tensor(torch.int64, shape[:1])] if name is None else {"x": images, "name": name}
            payload = packer.pack(batch)
            return payload, slot_engine.unpack(payload, slot)

        first, _ = pack((4, 2))
        again, made = pack((4, 2))
        assert again is first  # the same layout: reused, not pickled again
        assert [tuple(t.shape) for t in made] == [(4, 2), (4,)] and made[0].sum() == 8
        other, made = pack((3, 2))
        assert other != first and [tuple(t.shape) for t in made] == [(3, 2), (3,)]
        _, named = pack((2, 2), "a.jpg")
        _, renamed = pack((2, 2), "b.jpg")  # anything but slot tensors is pickled every time
        assert (named["name"], renamed["name"]) == ("a.jpg", "b.jpg")
        del made, named, renamed, slot


def _same(made: Any, expected: Any) -> None:
    """``made`` is ``expected``: the same container types, keys and order, tensor dtypes,
    shapes and values, and other leaves equal and of the same type."""
    assert type(made) is type(expected), (made, expected)
    if isinstance(expected, torch.Tensor):
        assert made.dtype == expected.dtype and made.shape == expected.shape and torch.equal(made, expected)
    elif isinstance(expected, dict):
        assert list(made) == list(expected)
        for key in expected:
            _same(made[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(made) == len(expected)
        for part, expected_part in zip(made, expected):
            _same(part, expected_part)
    else:
        assert made == expected


def _image(index: int) -> torch.Tensor:
    return torch.full((3, 4), index, dtype=torch.uint8)


COLLATED_SAMPLES: dict[str, list[Any]] = {
    "(tensor, int)": [(_image(i), i) for i in range(5)],
    "[tensor, float, bool]": [[_image(i), i / 2, i % 2 == 0] for i in range(5)],
    "dict of tensor, int, str, nested dict": [
        {"pixels": _image(i), "label": i, "name": f"s{i}", "extra": {"weight": float(i), "ids": (i, i + 1)}}
        for i in range(4)
    ],
    "namedtuple": [Pair(_image(i), i) for i in range(3)],
    "tuple of arrays and a list": [(np.arange(3) + i, [i, i + 1]) for i in range(3)],
    "empty tuples": [() for _ in range(3)],
    "ints then a float": [(_image(i), 2.5 if i == 2 else i) for i in range(4)],
    "a bool then ints": [(_image(i), True if i == 0 else i) for i in range(4)],
    "ints with a bool among them": [(_image(i), True if i == 2 else i) for i in range(4)],
    "ints with a NumPy int among them": [(_image(i), np.int32(i) if i == 1 else i) for i in range(4)],
    "floats with an int among them": [(_image(i), 3 if i == 1 else i + 0.25) for i in range(4)],
}
COLLATE_ERRORS: dict[str, list[Any]] = {
    "tuples of two lengths": [(_image(0), 0), (_image(1), 1, "extra")],
    "a sample without a length": [(_image(0), 0), 7],
    "a dict without a key": [{"pixels": _image(0), "label": 0}, {"pixels": _image(1)}],
    "images of two shapes": [(_image(0), 0), (torch.zeros(2, 2, dtype=torch.uint8), 1)],
    "an int beyond int64": [(_image(0), 1 << 70), (_image(1), 1)],
    "ints with a NumPy uint16 among them": [(_image(0), 0), (_image(1), np.uint16(1))],
    "an object torch cannot collate": [(_image(0), object()), (_image(1), object())],
}


@pytest.mark.parametrize("kind", list(COLLATED_SAMPLES))
def test_collating_into_a_slot_gives_default_collates_batch(kind: str) -> None:
    """The packer's own branch for exact tuples, lists and dicts (and torch's collate for
    the rest) gives what default_collate gives, with its tensors in the slot, and the
    measured size is the bytes the packer used."""
    samples = COLLATED_SAMPLES[kind]
    expected = torch.utils.data.default_collate(samples)
    memory = bytearray(1 << 16)
    packer = slot_engine.SlotPacker(memoryview(memory))
    made = packer.collate(samples)
    _same(made, expected)
    assert slot_engine.SlotMeasure().collated(samples) == packer.end
    tensors, _rebuild = flatten(made)
    assert all(in_slot(tensor, memory) for tensor in tensors if tensor.numel())


@pytest.mark.parametrize("kind", list(COLLATE_ERRORS))
def test_collating_into_a_slot_fails_as_default_collate_does(kind: str) -> None:
    samples = COLLATE_ERRORS[kind]
    with pytest.raises(Exception) as expected:
        torch.utils.data.default_collate(samples)
    with pytest.raises(expected.type) as made:
        slot_engine.SlotPacker(memoryview(bytearray(1 << 16))).collate(samples)
    assert str(made.value) == str(expected.value)


def test_a_packer_keeping_its_tensors_fills_them_anew_for_each_batch() -> None:
    """A worker's packer keeps the tensors it made over a slot and collates the next batch
    of the same layout into the very same ones: each batch still comes out as
    default_collate makes it, in the slot, and so does the owner's unpacked view."""
    memory = memoryview(bytearray(1 << 16))
    kept: dict[Any, Any] = {}
    packer = slot_engine.SlotPacker(memory, kept)
    batches = [[(_image(i + start), i + start) for i in range(count)] for start, count in ((0, 4), (10, 4), (20, 3), (30, 4))]
    made = []
    for samples in batches:
        collated = packer.reset(memory, kept).collate(samples)
        expected = torch.utils.data.default_collate(samples)
        _same(collated, expected)
        _same(slot_engine.unpack(packer.pack(collated), memory), expected)
        assert all(in_slot(tensor, memory) for tensor in collated)
        made.append(collated)
    assert made[1][0] is made[0][0] and made[1][1] is made[0][1]  # the same layout: the same tensors, filled again
    assert made[2][0] is not made[0][0] and made[3][0] is made[0][0]


def test_a_cache_keeps_the_entries_in_use_within_its_bound() -> None:
    """The one cache policy of a batch's path: bounded, the least recently used entry
    going first, so a stream of new keys (new shapes, payloads with file names) never
    pushes out the one every batch uses."""
    cache: dict[int, str] = {}
    remember(cache, -1, "in use")
    for key in range(3 * CACHE_ENTRIES):
        remember(cache, key, str(key))
        assert recall(cache, -1, None) == "in use"
    assert len(cache) == CACHE_ENTRIES
    assert recall(cache, 0, None) is None and recall(cache, 3 * CACHE_ENTRIES - 1, None) == str(3 * CACHE_ENTRIES - 1)
