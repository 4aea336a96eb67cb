"""The one module of numafast that touches ``torch.cuda``, through PyTorch's public API
only: registering pool memory with CUDA, the events that keep a pool slot from being
reused while a copy still reads it, and the side stream NumaLoader copies on.

Nothing here runs without a usable CUDA device; everything that calls in checks
:func:`usable` first, so numafast works wherever torch or a GPU is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "CopyStream",
    "Registration",
    "SlotEvents",
    "device_count",
    "device_uuids",
    "hand_over",
    "transfer_gbps",
    "usable",
    "why_not_usable",
    "with_index",
]

# cudaHostRegisterPortable: the memory counts as pinned in every CUDA context of the
# process, not only the current device's (as torch/cuda/_pin_memory_utils.py does).
HOST_REGISTER_PORTABLE = 1

# torch.cuda's constructors and cudart, as the typed callables they are (torch leaves them unannotated).
_cudart: Callable[[], Any] = torch.cuda.cudart
_Event: Callable[..., Any] = torch.cuda.Event
_Stream: Callable[[torch.device], Any] = torch.cuda.Stream


def usable() -> bool:
    """True when this PyTorch has CUDA and sees at least one device."""
    return bool(torch.cuda.is_available())


def why_not_usable() -> str:
    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is built without CUDA"
    return "no CUDA device is visible (torch.cuda.is_available() is False; check CUDA_VISIBLE_DEVICES and the driver)"


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index: 'cuda' means the current CUDA device."""
    if device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"{device}: this process sees {torch.cuda.device_count()} CUDA devices")
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _error_text(code: int) -> str:
    describe = getattr(_cudart(), "cudaGetErrorString", None)
    return f"cudaError {code}" + (f": {describe(code)}" if describe is not None else "")


class Registration:
    """Host memory registered with CUDA (cudaHostRegister): copies from and to it run
    as DMA from page-locked memory. The driver pins the pages for DMA, so they can no
    longer migrate: register only memory that is already where it should be."""

    def __init__(self, address: int, nbytes: int) -> None:
        code = int(_cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: {_error_text(code)}")
        self.address: int | None = address

    def unregister(self) -> None:
        """cudaHostUnregister, once."""
        address, self.address = self.address, None
        if address is not None:
            code = int(_cudart().cudaHostUnregister(address))
            if code != 0:
                raise RuntimeError(f"cudaHostUnregister at {address:#x} failed: {_error_text(code)}")


class _Fence:
    """Events recorded on every stream that may still read a slot."""

    __slots__ = ("events",)

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def query(self) -> bool:
        return all(event.query() for event in self.events)

    def synchronize(self) -> None:
        for event in self.events:  # waits with the GIL released
            event.synchronize()


class SlotEvents:
    """A pool's fences: ``self(index, streams)`` records CUDA events on the current
    stream and on each of ``streams`` as slot ``index`` comes back.

    Each slot keeps its own events, one per stream device, and reuses them: a slot is
    given back again only after it was handed out again, which happens only once its
    last fence said done, so an event is never re-recorded while still awaited.
    """

    def __init__(self, slots: int) -> None:
        self.events: list[dict[tuple[torch.device, int], Any]] = [{} for _ in range(slots)]

    def __call__(self, index: int, streams: Sequence[Any]) -> _Fence:
        current = torch.cuda.current_stream()
        readers = [current, *(stream for stream in streams if stream != current)]
        owned = self.events[index]
        events = []
        for position, stream in enumerate(readers):
            key = (stream.device, position)
            event = owned.get(key)
            if event is None:
                event = owned[key] = _Event()
            event.record(stream)
            events.append(event)
        return _Fence(events)


class CopyStream:
    """A side stream on ``device`` for host-to-device copies of pinned batches, so
    that the copy of batch n+1 overlaps the compute on batch n."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = _Stream(device)

    def to_device(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """Queue copies of ``tensors`` (pinned host memory) on the side stream; returns
        the device tensors and an event that fires when all of them have arrived."""
        with torch.cuda.stream(self.stream):
            copies = [tensor.to(self.device, non_blocking=True) for tensor in tensors]
            ready = _Event()
            ready.record(self.stream)
        return copies, ready


def hand_over(copies: Sequence[torch.Tensor], ready: Any) -> None:
    """In the consumer's thread: make its current stream wait for ``ready`` (the side
    stream's copies), and tell the caching allocator that this stream uses the copies
    (their memory was allocated on the side stream)."""
    if not copies:
        return
    consumer = torch.cuda.current_stream(copies[0].device)
    consumer.wait_event(ready)
    for tensor in copies:
        tensor.record_stream(consumer)


def device_count() -> int:
    return int(torch.cuda.device_count())


def device_uuids() -> dict[str, str]:
    """'GPU-<uuid>' -> PCI address ('0000:3b:00.0') of each CUDA device this process sees."""
    uuids: dict[str, str] = {}
    for index in range(device_count()):
        props = torch.cuda.get_device_properties(index)
        # torch's stub lacks the pci_* fields that its CUDA builds have.
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"  # type: ignore[attr-defined]
        uuids[f"GPU-{props.uuid}"] = address
    return uuids


def transfer_gbps(host: Any, device: int, *, to_device: bool, streams: int, repetitions: int, warmup: int = 2) -> list[float]:
    """GB/s of each of ``repetitions`` copies between the page-locked buffer ``host``
    and CUDA device ``device`` (host to device, or back), timed with CUDA events.

    With ``streams`` > 1 the buffer is cut into that many parts copied on as many
    streams at once: one big copy can hide what several concurrent ones show.
    """
    pinned = torch.frombuffer(host, dtype=torch.uint8)
    nbytes = pinned.numel()
    target = torch.device("cuda", device)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=target)
    bounds = [nbytes * part // streams for part in range(streams + 1)]
    with torch.cuda.device(target):
        lanes = [_Stream(target) for _ in range(streams)]
        main = torch.cuda.current_stream(target)
        results = []
        for round_ in range(warmup + repetitions):
            start, end = _Event(enable_timing=True), _Event(enable_timing=True)
            start.record(main)
            for lane, low, high in zip(lanes, bounds, bounds[1:]):
                lane.wait_stream(main)
                with torch.cuda.stream(lane):
                    if to_device:
                        on_device[low:high].copy_(pinned[low:high], non_blocking=True)
                    else:
                        pinned[low:high].copy_(on_device[low:high], non_blocking=True)
            for lane in lanes:
                main.wait_stream(lane)
            end.record(main)
            end.synchronize()
            if round_ >= warmup:
                results.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return results
