"""The message a DataLoader worker sends for each batch, and what it becomes on arrival.

NOTE: the central hop. A batch becomes a batch while torch unpickles the worker's
message, inside the DataLoader's own ``get``, not in a step numafast adds to the loop.
That is what keeps loaders that frameworks rebuild from a NumaLoader's settings (a
plain DataLoader with numafast's collate function: Lightning, Accelerate, Ray Train)
landing their batches: nothing of numafast's iterator needs to be there. It forces
three things, each handled here or beside it: the take-over runs wherever torch
unpickles (the main thread, between any two bytecodes, where a signal handler may
raise: see _process.raised_by_signal_handler; or PyTorch's pin thread, which must never die
of a batch: see in_pin_thread), it must never raise where torch would lose count of
its batches (see below), and a sender that died after sending has its slot
reclaimed by then (SenderDied).

A :class:`SlotBatch` names the slot that holds the batch; a :class:`Fallback` carries
the batch as torch would send it, and why it did not land. Both travel on the
DataLoader's own result queue and *become the batch* as they are unpickled in the
process that owns the pools (``__reduce__``), whichever iterator takes them;
elsewhere they stay messages. The owner's side registers in :data:`receivers`, so
this module imports neither side.

A message that cannot become its batch becomes torch's ``ExceptionWrapper``, as a
worker's failed batch does: raising inside the unpickling would lose a message the
DataLoader already took off its queue (its count of batches in flight then never
comes right, and the next batch is waited for forever) and end PyTorch's pin thread.
The exception is :class:`SenderDied`: raised out of the DataLoader's ``get`` (not in
the pin thread), it lets the DataLoader find the worker dead and say so, as for any
worker that dies, and stop waiting for its batches, so the count no longer matters.
An exception that a signal handler raised during the take-over is not the batch's
either: it passes as it came.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, cast

from numafast import _process
from numafast.errors import SenderDied
from numafast.private import PIN_THREAD_NAME, exception_wrapper

__all__ = ["Fallback", "FallbackReason", "Receiver", "SenderDied", "SlotBatch", "in_pin_thread", "receivers"]


class FallbackReason(str, Enum):
    """Why a batch did not land in a slot in its worker and was copied by the main process."""

    FIRST_BATCHES = "first batches"
    """No pool yet: the owner's copy of the batch makes the first one (no warning)."""
    NO_FREE_SLOT = "no free slot"
    """Every slot was held (by batches the consumer keeps, queued ones, copies to the
    GPU): the owner's copy of the batch adds a pool (no warning of its own)."""
    TOO_LARGE = "batch larger than a slot"
    """The batch fits no slot: the owner's copy of it resizes the pool (no warning)."""
    CANNOT_MAP = "worker cannot map the pool"
    """The worker could not open the pool's file (another user's process, a sandbox)."""
    BYPASSED = "collate bypassed"
    """The batch came from a loader whose workers do not run numafast's collate (its
    settings live where numafast cannot reach them)."""


class Receiver(Protocol):
    """The owner's side (:class:`numafast.torch.owner_pools.NodePools`)."""

    def receive(self, message: SlotBatch) -> Any: ...

    def copy_in(self, fallback: Fallback) -> Any: ...


# The receivers of this process by id: what a message names to become its batch (kept in numafast/_process.py).
receivers = cast("weakref.WeakValueDictionary[int, Receiver]", _process.receivers)


class _Message:
    """What both messages share: their receiver (``owner_id`` of process ``owner_pid``),
    and which batch of which DataLoader worker they are."""

    __slots__: tuple[str, ...] = ()
    owner_pid: int
    owner_id: int
    worker: int
    number: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _arrive, (type(self), *(getattr(self, name) for name in self.__slots__))

    def describe(self) -> str:
        batch = "a batch" if self.worker < 0 or self.number <= 0 else f"batch {self.number}"
        of = f" of DataLoader worker process {self.worker}" if self.worker >= 0 else ""
        return f"{batch}{of} ({self._what()})"

    def _what(self) -> str:
        raise NotImplementedError


@dataclass(slots=True, eq=False)
class SlotBatch(_Message):
    """A batch a worker packed into slot ``index`` (lease ``generation``) of the pool
    whose file is ``inode``."""

    owner_pid: int
    owner_id: int
    inode: int
    index: int
    generation: int
    nbytes: int
    payload: bytes
    unpinned: tuple[str, ...] = ()
    worker: int = -1
    """The DataLoader worker that sent it (-1: not said)."""
    number: int = 0
    """Its batch's number among those that worker collated (1 for its first)."""
    sender: int = 0
    """The pid of the process that sent it (0: not said)."""

    def _what(self) -> str:
        return f"slot {self.index} of pool file {self.inode}, lease {self.generation}"


@dataclass(slots=True, eq=False)
class Fallback(_Message):
    """A batch that travels as torch sends it (tensors in shared memory), and why."""

    owner_pid: int
    owner_id: int
    batch: Any
    reason: FallbackReason
    detail: str = ""
    worker: int = -1
    number: int = 0

    def _what(self) -> str:
        return f"sent to be copied: {self.reason.value}"


def _arrive(kind: type[SlotBatch | Fallback], *fields: Any) -> Any:
    """A message unpickled: its batch in its receiver's process (a forked child inherits
    the registry, not the pools), in another process the message itself, to travel on."""
    message = kind(*fields)
    if message.owner_pid != _process.pid:
        return message
    receiver = receivers.get(message.owner_id)
    if receiver is None:
        return _unreceived(message)
    try:
        return receiver.receive(message) if isinstance(message, SlotBatch) else receiver.copy_in(message)
    except Exception as error:  # noqa: BLE001 - the consumer meets it at this batch, as a worker's error
        if isinstance(error, SenderDied) and not in_pin_thread():
            # Out of the DataLoader's get: it finds its worker dead and says so (see above),
            # once that worker can be reaped, or it takes it for alive and raises this.
            if isinstance(message, SlotBatch) and message.sender > 0:
                _process.wait_child_exited(message.sender)
            raise
        if _process.raised_by_signal_handler(error):
            raise  # the DataLoader's error, not this batch's: the consumer gets it as it came
        return _failed(message.describe())


def _unreceived(message: SlotBatch | Fallback) -> Any:
    """A message that arrived in its owner's process once the pools it names were gone
    (closed and collected: a copy of the loader's collate function outlived them). Never
    the message itself, which no consumer expects: a batch sent to be copied is the batch
    as torch sent it; one in a slot of those pools cannot be read, an error at its place."""
    if isinstance(message, Fallback):
        return message.batch
    try:
        raise RuntimeError(f"{message.describe()} arrived after its loader's pools are gone from this process "
                           f"(closed): nothing can read it")  # fmt: skip
    except RuntimeError:
        return _failed(message.describe())


def _failed(batch: str) -> Any:
    """The exception being handled, as torch's DataLoader carries a worker's: its
    iterator raises it in the consumer at this batch (its type, message and traceback,
    and where: which batch of which worker)."""
    wrap = exception_wrapper()  # torch is loaded: a DataLoader unpickles this
    return wrap(where=f"in the main process, taking over {batch}")


def in_pin_thread() -> bool:
    """Whether the calling thread is PyTorch's pin thread (by the kernel name it gives itself)."""
    try:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip() == PIN_THREAD_NAME
    except OSError:
        return False
