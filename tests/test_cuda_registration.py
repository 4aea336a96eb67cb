"""How numafast.cuda cuts a pool into cudaHostRegister calls, and undoes a failure.

Linux 6.11 to 6.13 refuse to pin more than 2 GiB in one call, and the driver holds
global locks for the whole of each call: registration goes in pieces of at most
1 GiB, never splitting a slot. These tests check the pieces and the order of the
calls against a runtime that records them (no GPU is involved or pretended: the
real registration is tested in test_pool_cuda.py where a GPU is).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("torch")

from numafast import cuda  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20


def test_pieces_cover_the_region_in_whole_slots_of_at_most_the_limit() -> None:
    head, stride, slots = 4096, 300 * MIB, 11
    ranges = cuda.register_ranges(1 << 40, head + stride * slots, unit=stride, head=head)
    assert ranges[0] == (1 << 40, head + 3 * stride)  # the table rides with the first slots
    assert all(length == 3 * stride for _, length in ranges[1:-1]) and ranges[-1][1] == 2 * stride
    assert all(start + length == following for (start, length), (following, _) in zip(ranges, ranges[1:]))
    assert sum(length for _, length in ranges) == head + stride * slots
    assert all(length - (head if index == 0 else 0) <= cuda.REGISTER_CHUNK_BYTES for index, (_, length) in enumerate(ranges))


def test_a_slot_larger_than_the_limit_is_a_piece_of_its_own() -> None:
    ranges = cuda.register_ranges(0, 4096 + 3 * 3 * GIB, unit=3 * GIB, head=4096)
    assert [length for _, length in ranges] == [4096 + 3 * GIB, 3 * GIB, 3 * GIB]


@pytest.mark.parametrize(("size", "unit", "head"), [(0, 1, 0), (10, 0, 0), (10, 1, 11), (10, 1, -1)])
def test_nonsense_is_refused(size: int, unit: int, head: int) -> None:
    with pytest.raises(ValueError, match="cannot cut"):
        cuda.register_ranges(0, size, unit=unit, head=head)


class CudaError(enum.Enum):
    """What ``torch.cuda.cudart()``'s calls return: its ``cudaError``, a pybind11 enum that
    ``int()`` turns into the code, and the only type its ``cudaGetErrorString`` takes."""

    success = 0
    memory_allocation = 2

    def __int__(self) -> int:
        return int(self.value)


class Recorder:
    """Answers cudaHostRegister / cudaHostUnregister / cudaGetErrorString with the types
    torch's runtime binding has, failing the ``fail_at``-th registration, and records
    every call; as the device guard, records which device each call ran under (None:
    outside any guard)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.devices: list[int | None] = []
        self.fail_at = fail_at
        self.current: int | None = None

    @contextmanager
    def guard(self, index: int) -> Iterator[None]:
        before, self.current = self.current, index
        try:
            yield
        finally:
            self.current = before

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> CudaError:  # noqa: N802 - CUDA's name
        self.calls.append(("register", address))
        self.devices.append(self.current)
        registered = sum(1 for call, _ in self.calls if call == "register")
        return CudaError.memory_allocation if registered == self.fail_at else CudaError.success

    def cudaHostUnregister(self, address: int) -> CudaError:  # noqa: N802
        self.calls.append(("unregister", address))
        self.devices.append(self.current)
        return CudaError.success

    def cudaGetLastError(self) -> CudaError:  # noqa: N802
        self.calls.append(("clear", 0))
        self.devices.append(self.current)
        return CudaError.success

    def cudaGetErrorString(self, error: CudaError) -> str:  # noqa: N802
        if not isinstance(error, CudaError):  # as pybind11 refuses an int for the enum
            raise TypeError("cudaGetErrorString(): incompatible function arguments")
        return "out of memory"


def test_a_failure_part_way_unregisters_the_pieces_done_last_first() -> None:
    runtime = Recorder(fail_at=3)
    with pytest.raises(cuda.RegistrationFailed, match=r"piece 3 .* failed: cudaError 2: out of memory; the 2 pieces before"):
        cuda.Registration(0x10000, 4096 + 8 * MIB, device=3, unit=MIB, head=4096, limit=2 * MIB, runtime=runtime,
                          device_guard=runtime.guard)
    starts = [0x10000, 0x10000 + 4096 + 2 * MIB, 0x10000 + 4096 + 4 * MIB]
    assert runtime.calls == [
        ("register", starts[0]), ("register", starts[1]), ("register", starts[2]),
        ("clear", 0),  # the refusal, reset at once in this thread: no later kernel launch reports it as its own
        ("unregister", starts[1]), ("unregister", starts[0]),
    ]  # fmt: skip
    assert runtime.devices == [3] * 6


def test_unregistering_goes_last_first_once() -> None:
    runtime: Any = Recorder()
    registration = cuda.Registration(0, 4096 + 4 * MIB, device=1, unit=MIB, head=4096, limit=2 * MIB,
                                     runtime=runtime, device_guard=runtime.guard)
    assert len(registration.ranges) == 2
    registration.unregister()
    registration.unregister()
    assert [call for call, _ in runtime.calls] == ["register", "register", "unregister", "unregister"]
    assert runtime.calls[2][1] > runtime.calls[3][1]
    # Each call on the pool's device, whichever thread makes it: never a thread's default device 0.
    assert runtime.devices == [1] * 4 and runtime.current is None


def test_a_fence_is_asked_under_its_pools_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread that makes room for workers asks fences too, and its current device is
    0: every question goes under the pool's device (events that record what they were
    asked; no GPU is involved or pretended)."""
    entered: list[int] = []

    @contextmanager
    def on_device(index: int) -> Iterator[None]:
        entered.append(index)
        yield

    class Event:
        def query(self) -> bool:
            assert entered, "asked outside the device guard"
            return True

    monkeypatch.setattr(cuda, "on_device", on_device)
    fence = cuda._Fence(lambda: [Event(), Event()], 3)
    fence.record()
    assert fence.query()
    assert fence.query()
    assert entered == [3, 3, 3]  # recorded, asked twice (a fence is only asked, never waited on)


def test_a_refused_registration_with_register_auto_leaves_the_pools_unregistered_said_once() -> None:
    """As lock='auto' does: the pool goes on unregistered (no fences: a copy from it is
    staged by the driver), one RuntimeWarning for the process, the refusal reset. The
    pools' memory is real; the runtime that refuses records its calls."""
    import warnings

    import numafast
    from numafast import _process, pool as pool_module
    from numafast.pages import local_node

    _process.done_once.discard("pools unregistered")  # a fresh process's state
    pools = [numafast.PinnedPool(local_node(), 1 << 16, 2, lock="off", register="off") for _ in range(2)]
    runtimes = [Recorder(fail_at=1) for _ in pools]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fences = [pool_module._register(pool._resources, 1, pool_module.RegisterMode.AUTO, 1 << 16, 2,
                                        runtime=runtime, device_guard=runtime.guard)
                  for pool, runtime in zip(pools, runtimes)]  # fmt: skip
    assert fences == [None, None] and all(pool._resources.registration is None for pool in pools)
    said = [str(warning.message) for warning in caught]
    assert len(said) == 1 and "cudaHostRegister" in said[0] and "said once" in said[0], said
    assert caught[0].category is RuntimeWarning and caught[0].filename == __file__  # the caller's line
    for runtime in runtimes:  # each refusal reset under the pool's device
        assert [call for call, _ in runtime.calls] == ["register", "clear"] and runtime.devices == [1, 1]
    refusing = Recorder(fail_at=1)
    with pytest.raises(cuda.RegistrationFailed, match="out of memory"):
        pool_module._register(pools[0]._resources, 1, pool_module.RegisterMode.REQUIRED, 1 << 16, 2,
                              runtime=refusing, device_guard=refusing.guard)  # fmt: skip
    for pool in pools:
        pool.close()


def test_a_fence_made_during_a_graph_capture_records_and_answers_only_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the thread captures a CUDA graph (numafast's own ``capturing()`` set to say
    so: no GPU is involved or pretended), a fence neither records nor is asked: either
    would invalidate the capture; it answers None (cannot be asked now). After it, its
    first question records."""
    asked: list[str] = []

    class Event:
        def query(self) -> bool:
            asked.append("query")
            return True

    def record() -> list[Event]:
        asked.append("record")
        return [Event()]

    @contextmanager
    def on_device(index: int) -> Iterator[None]:
        yield

    monkeypatch.setattr(cuda, "on_device", on_device)
    monkeypatch.setattr(cuda, "capturing", lambda: True)
    fence = cuda._Fence(record, 0)
    assert fence.query() is None  # cannot be asked while capturing: an open pool's slot stays fenced
    assert asked == []
    monkeypatch.setattr(cuda, "capturing", lambda: False)
    assert fence.query() is True
    assert asked == ["record", "query"]
