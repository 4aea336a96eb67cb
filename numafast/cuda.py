"""The one module of numafast that touches ``torch.cuda`` (public API only): registering
pool memory, the events that keep a slot from reuse while a copy still reads it, the
side stream NumaLoader copies on, the GPUs' identities and the bench's timings.

Imported only where used, after PyTorch, by callers that check :func:`usable` first,
so numafast works wherever torch or a GPU is missing.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from numafast.errors import RegistrationFailed

__all__ = [
    "REGISTER_CHUNK_BYTES",
    "CopyStream",
    "capturing",
    "Registration",
    "RegistrationFailed",
    "SlotEvents",
    "clear_last_error",
    "current_index",
    "device_count",
    "device_uuids",
    "hand_over",
    "initialized",
    "on_device",
    "transfer_gbps",
    "usable",
    "why_not_usable",
    "register_ranges",
    "wait_fences",
]

# cudaHostRegisterPortable: the memory counts as pinned in every CUDA context of the
# process, not only the current device's (as torch/cuda/_pin_memory_utils.py does).
HOST_REGISTER_PORTABLE = 1
# Registration pins at most this much per cudaHostRegister call: Linux 6.11 to 6.13
# refuse to pin more than 2 GiB at once, and the driver holds global locks for the
# whole call (registering hundreds of GiB in one call stalls every other CUDA process
# of the machine for minutes); between chunks the lock is free.
REGISTER_CHUNK_BYTES = 1 << 30

# torch.cuda's constructors and cudart, as the typed callables they are (torch leaves them unannotated).
_cudart: Callable[[], Any] = torch.cuda.cudart
_Event: Callable[..., Any] = torch.cuda.Event
_Stream: Callable[[torch.device], Any] = torch.cuda.Stream
_is_initialized: Callable[[], bool] = torch.cuda.is_initialized


def usable() -> bool:
    """True when this PyTorch has CUDA and sees at least one device."""
    return bool(torch.cuda.is_available())


def why_not_usable() -> str:
    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is built without CUDA"
    return "no CUDA device is visible (torch.cuda.is_available() is False; check CUDA_VISIBLE_DEVICES and the driver)"


def initialized() -> bool:
    """Whether torch has initialised CUDA in this process (asking does not)."""
    return bool(_is_initialized())


def capturing() -> bool:
    """Whether the calling thread's current stream is capturing a CUDA graph (False while
    torch has not initialised CUDA: asking then would). Under torch's default capture mode
    ("global"), querying, recording or waiting on an event, or registering host memory,
    now would invalidate the capture: torch's own allocators skip event queries while
    capturing, and so does numafast (NOTE: only the capturing thread can tell; another
    thread's calls are safe with ``torch.cuda.graph(..., capture_error_mode="thread_local")``)."""
    return initialized() and bool(torch.cuda.is_current_stream_capturing())


def current_index() -> int:
    """The calling thread's current CUDA device. CUDA keeps it per thread: a thread
    that never chose one (PyTorch's pin thread before it sets one) is on
    device 0. Initialises torch's CUDA state, which a loader does only
    once it iterates (the user picks the rank's device after building it)."""
    return int(torch.cuda.current_device())


# Makes a device the calling thread's current one for a block, and restores the one
# before without creating a context on it (torch's device guard).
on_device: Callable[[int], AbstractContextManager[Any]] = torch.cuda.device


def register_ranges(address: int, nbytes: int, *, unit: int, head: int = 0,
                    limit: int = REGISTER_CHUNK_BYTES) -> list[tuple[int, int]]:
    """``[address, address + nbytes)`` cut into ``(start, length)`` pieces of whole
    ``unit``s (a pool's slot stride) of at most ``limit`` bytes each (a larger unit is
    a piece of its own), the first also holding the ``head`` (the slot table): no slot
    is split between two registrations, since a copy must read from one."""
    if nbytes <= 0 or unit <= 0 or head < 0 or head > nbytes:
        raise ValueError(f"cannot cut {nbytes} bytes in units of {unit} after a head of {head}")
    per_piece = max(limit // unit, 1) * unit
    ranges = []
    start, end = address, address + nbytes
    length = head + per_piece
    while start < end:
        length = min(length, end - start)
        ranges.append((start, length))
        start += length
        length = per_piece
    return ranges


def clear_last_error(runtime: Any, device: int) -> None:
    """Reset the calling thread's CUDA "last error" after a runtime call that failed
    (cudaHostRegister returns its error, and the runtime keeps it as the last one too):
    torch reads it after its next kernel launch in this thread (C10_CUDA_KERNEL_LAUNCH_CHECK
    calls cudaGetLastError) and would raise it as that kernel's own. Through ``runtime``'s
    cudaGetLastError where torch binds it; else (torch 2.x binds none) by launching a
    one-byte fill on ``device``, whose check reads and resets it: the stale error it
    raises is swallowed. Under ``device``, in the thread of the failed call."""
    get_last_error = getattr(runtime, "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()
        return
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, dtype=torch.uint8, device=torch.device("cuda", device))


class Registration:
    """Host memory registered with CUDA (cudaHostRegister) in the pieces of
    :func:`register_ranges`, so that copies run as DMA. The driver pins the pages, so
    they can no longer migrate: register only memory already where it should be. A
    failure part way unregisters the pieces done, in reverse.

    Every call runs with ``device`` current: the runtime registers through the current
    device's context and creates it if the thread has none, so a thread that never
    chose a device (PyTorch's pin thread, one dropping the last tensor of a closed
    pool) would make a context on device 0, hundreds of MiB of GPU memory, in every
    rank of a multi-GPU job. A refusal raises :class:`RegistrationFailed` and leaves no
    CUDA error behind (:func:`clear_last_error`).

    ``runtime`` answers cudaHostRegister / cudaHostUnregister / cudaGetErrorString
    (default ``torch.cuda.cudart()``); with ``device_guard`` (default :data:`on_device`)
    it lets a test record the calls and the device each runs under.
    """

    def __init__(self, address: int, nbytes: int, *, device: int, unit: int | None = None, head: int = 0,
                 limit: int = REGISTER_CHUNK_BYTES, runtime: Any = None,
                 device_guard: Callable[[int], AbstractContextManager[Any]] = on_device) -> None:
        self.runtime = _cudart() if runtime is None else runtime
        self.device = device
        self._device_guard = device_guard
        self.ranges: list[tuple[int, int]] = []
        if capturing():
            raise RegistrationFailed(
                f"cudaHostRegister of {nbytes} bytes at {address:#x} (device {device}) was not tried: this thread "
                "is capturing a CUDA graph, which the call would invalidate"
            )
        with device_guard(device):
            for start, length in register_ranges(address, nbytes, unit=unit or nbytes, head=head, limit=limit):
                error = self.runtime.cudaHostRegister(start, length, HOST_REGISTER_PORTABLE)
                if int(error) != 0:
                    done = len(self.ranges)
                    clear_last_error(self.runtime, device)
                    self.unregister()
                    raise RegistrationFailed(
                        f"cudaHostRegister of {length} bytes at {start:#x} (piece {done + 1} of {nbytes} bytes at "
                        f"{address:#x}, device {device}) failed: {self._error_text(error)}; the {done} pieces "
                        "before it were unregistered"
                    )
                self.ranges.append((start, length))

    def _error_text(self, error: Any) -> str:
        # torch's cudaGetErrorString takes the cudaError its calls return (a pybind11 enum),
        # not an int: given int(error) it raises TypeError.
        return f"cudaError {int(error)}: {self.runtime.cudaGetErrorString(error)}"

    def unregister(self) -> None:
        """cudaHostUnregister of every piece, last first, once."""
        ranges, self.ranges = self.ranges, []
        if not ranges:
            return
        failures = []
        with self._device_guard(self.device):
            for start, _length in reversed(ranges):
                error = self.runtime.cudaHostUnregister(start)
                if int(error) != 0:
                    failures.append(f"{start:#x}: {self._error_text(error)}")
            if failures:
                clear_last_error(self.runtime, self.device)
        if failures:
            raise RuntimeError(f"cudaHostUnregister failed at {', '.join(failures)}")


class _Fence:
    """Events recorded on every stream that may still read a slot, asked under the
    pool's ``device``: the thread that makes room for workers asks too, and its current
    device is 0, where an unguarded CUDA call would make a context the rank does not use.

    ``record()`` records them; a fence made while its thread captures a CUDA graph
    (see :func:`capturing`) records at its first question after the capture, covering
    all the work queued by then. While capturing, :meth:`query` answers None: it cannot
    be asked (an open pool keeps the slot fenced; a closed pool goes on, its memory
    released only after the capture: numafast.pool, _release_deferred)."""

    __slots__ = ("_pending", "device", "events")

    def __init__(self, record: Callable[[], list[Any]], device: int) -> None:
        self._pending: Callable[[], list[Any]] | None = record
        self.events: list[Any] = []
        self.device = device

    def record(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            with on_device(self.device):
                self.events = pending()

    def query(self) -> bool | None:
        """Whether the work these events follow is done; None while this thread captures a
        CUDA graph. Never waits: numafast polls fences, for a bounded time (an event's
        own synchronize has no end)."""
        if capturing():
            return None
        self.record()
        with on_device(self.device):
            return all(event.query() for event in self.events)


class SlotEvents:
    """A pool's fences: ``self(index)``, as slot ``index`` comes back, records events on
    ``device``'s current stream and on each stream named by :meth:`add_reader`.

    ``device`` is the pool's, named explicitly: a slot comes back in whichever thread
    drops its last tensor (PyTorch's pin thread, a framework's prefetch thread), whose
    current device may be another GPU, or none yet (device 0, where asking for its
    stream would create a context).

    A slot reuses its events: it is given back again only after it was handed out
    again, so once its last fence said done: an event is never re-recorded while
    still awaited.
    """

    def __init__(self, slots: int, device: int) -> None:
        self.device = device
        self.readers: list[list[Any]] = [[] for _ in range(slots)]
        self.events: list[dict[tuple[torch.device, int], Any]] = [{} for _ in range(slots)]
        self.streams: list[Any] = []
        """Every stream ever named by :meth:`add_reader` (for :meth:`at_exit`)."""

    def add_reader(self, index: int, stream: Any) -> None:
        """Name ``stream`` as reading slot ``index`` until the slot comes back."""
        if stream not in self.readers[index]:
            self.readers[index].append(stream)
        if stream not in self.streams:
            self.streams.append(stream)

    def at_exit(self) -> _Fence:
        """A fence, recorded now, past every copy that may read a slot: on the device's
        current and default streams and on every stream ever named a reader (held slots
        and slots already back alike). At exit, and after a CUDA graph capture for a pool
        released during it (numafast.pool, _release_deferred)."""
        readers = [torch.cuda.current_stream(self.device), torch.cuda.default_stream(self.device), *self.streams]
        unique = [stream for position, stream in enumerate(readers) if stream not in readers[:position]]
        fence = _Fence(lambda: [_recorded(stream) for stream in unique], self.device)
        fence.record()
        return fence

    def __call__(self, index: int) -> _Fence:
        streams, self.readers[index] = self.readers[index], []
        current = torch.cuda.current_stream(self.device)
        readers = [current, *streams]
        capture = capturing()
        if capture:  # the current stream is the capture's: the consumer's own is the default one, most likely
            readers.append(torch.cuda.default_stream(self.device))
        unique = [stream for position, stream in enumerate(readers) if stream not in readers[:position]]
        fence = _Fence(functools.partial(self._record, index, unique), self.device)
        if not capture:
            fence.record()
        return fence

    def _record(self, index: int, readers: list[Any]) -> list[Any]:
        """Record slot ``index``'s events on ``readers``, reusing the slot's own."""
        owned = self.events[index]
        events = []
        for position, stream in enumerate(readers):
            key = (stream.device, position)  # an event records only on its first stream's device
            event = owned.get(key)
            if event is None:
                event = owned[key] = _Event()
            event.record(stream)
            events.append(event)
        return events


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


def _recorded(stream: Any) -> Any:
    event = _Event()
    event.record(stream)
    return event


def wait_fences(fences: Sequence[_Fence], seconds: float) -> bool:
    """Poll ``fences`` until all are done or ``seconds`` have passed (False then): an
    event's own synchronize has no end, and a copy stuck behind a hung kernel would
    keep the process from exiting."""
    deadline = time.monotonic() + seconds
    pause = 0.001
    while not all(fence.query() for fence in fences):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)
    return True


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
    and CUDA device ``device`` (either way), timed with CUDA events. ``streams`` > 1
    copies as many parts at once: one big copy can hide what concurrent ones show."""
    pinned = torch.frombuffer(host, dtype=torch.uint8)
    nbytes = pinned.numel()
    target = torch.device("cuda", device)
    on_gpu = torch.empty(nbytes, dtype=torch.uint8, device=target)
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
                        on_gpu[low:high].copy_(pinned[low:high], non_blocking=True)
                    else:
                        pinned[low:high].copy_(on_gpu[low:high], non_blocking=True)
            for lane in lanes:
                main.wait_stream(lane)
            end.record(main)
            end.synchronize()
            if round_ >= warmup:
                results.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return results
