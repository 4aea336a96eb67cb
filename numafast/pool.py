"""Node-local pinned buffer pools: :class:`PinnedPool`.

A host-to-device copy is fastest from page-locked memory on the GPU's own node, and
``cudaHostAlloc`` per batch is slow (a driver-wide lock, no NUMA flag). A pool pays
once: one shared memfd mapping (a slot table, then ``slots`` x ``slot_bytes``), bound
to the node with mbind before any page exists, faulted in by threads on the node's
CPUs, page-locked, and registered with CUDA in chunks. Placement must come first:
memory registered with CUDA is pinned for DMA and can no longer migrate.

DataLoader workers map the file too (:mod:`numafast.pool_worker`) and collate straight
into a slot. Neither the lock nor the registration is inherited by a child; a forked
child gets a private, copy-on-write view of its parent's pools, so it never writes
into a slot the parent may hand out again.

A slot is handed out with one compare-and-swap and comes back by itself when the last
array or tensor viewing it is gone; with CUDA, only once the GPU work queued on it
has finished.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import numbers
import os
import resource
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, cast

from numafast import _libnuma, _process
from numafast._buffers import PAGE_SIZE
from numafast._validate import allowed_cpus, check_bool, check_node, cpus_near, format_size, positive_int
from numafast.errors import (
    CudaUnavailable,
    InvalidGpuError,
    InvalidNodeError,
    InvalidSizeError,
    LibnumaError,
    MemlockError,
    MemlockWarning,
    PoolClosedError,
    PoolExhaustedError,
    PoolForkedError,
    SlotTooSmallError,
)
from numafast.memory import allocate
from numafast.pool_worker import MADV_POPULATE_READ, PoolHandle
from numafast.topo.files import read_fields

if TYPE_CHECKING:
    from numafast.cuda import Registration, SlotEvents, _Fence

__all__ = ["LockMode", "PinnedPool", "PoolStats", "RegisterMode", "Slot"]

Slot = _libnuma.Slot
_HELD = _libnuma.SLOT_STATES["held"]

# The name of every pool's memfd (then the node), as /proc/PID/maps and numa_maps show it.
MEMFD_PREFIX = "numafast-pool-node"

# CAP_IPC_LOCK (linux/capability.h): lets a process lock memory beyond RLIMIT_MEMLOCK.
CAP_IPC_LOCK = 14
# How to raise RLIMIT_MEMLOCK, for a message that cannot know the shortfall: the soft
# limit first (any user, up to the hard limit), then what needs root or an administrator.
MEMLOCK_FIX = (
    "`ulimit -S -l unlimited` in the shell that starts the job (no privileges needed up to the hard limit, "
    "`ulimit -H -l`); past it, root or an administrator: `* - memlock unlimited` in "
    "/etc/security/limits.conf (then log in again), `LimitMEMLOCK=infinity` in a systemd unit, "
    "`docker run --ulimit memlock=-1`"
)
# Errors of mlock(2) that mean "not this much, not by you".
LOCK_REFUSALS = (errno.ENOMEM, errno.EPERM, errno.EAGAIN)


class LockMode(str, Enum):
    """How a pool page-locks its memory (``lock=``)."""

    AUTO = "auto"
    """As ``best-effort`` where a GPU is usable (PyTorch imported and seeing a CUDA
    device: numafast.cuda.usable); elsewhere nothing is locked and nothing said, as
    page-locking serves copies to a GPU and buys a CPU-only job nothing but a share of
    RLIMIT_MEMLOCK (8 MiB for a user on most systems, without CAP_IPC_LOCK)."""
    REQUIRED = "required"
    """Lock every page or raise :class:`MemlockError` naming the limit and the fix (``True``)."""
    BEST_EFFORT = "best-effort"
    """Lock if the kernel allows; otherwise unlocked, with one warning per process."""
    OFF = "off"
    """Never lock (``False``)."""


class RegisterMode(str, Enum):
    """Whether a pool registers its memory with CUDA (``register=``)."""

    AUTO = "auto"
    """When PyTorch is already imported and CUDA is usable (the pool never imports torch itself);
    where cudaHostRegister refuses, unregistered, with one warning per process."""
    REQUIRED = "required"
    """Register, or raise :class:`CudaUnavailable` (``True``)."""
    OFF = "off"
    """Never register (``False``)."""


@dataclass(frozen=True)
class PoolStats:
    """A pool's counters at one moment. In an open pool ``free + in_use + in_flight +
    guarded + leased + retired == slots``; ``acquired`` counts every slot ever handed out."""

    node: int
    slots: int
    slot_bytes: int
    in_use: int
    """Slots handed out whose arrays or tensors still exist."""
    free: int
    in_flight: int
    """Slots given back while GPU work queued on them may still be running."""
    guarded: int
    """Slots given back while a process forked when they were held may still read them
    through its inherited arrays and tensors: reused once it has copied them (within
    milliseconds of the fork) or, where it could not, once it has exited."""
    retired: int
    """Slots given back without a fence (a CUDA error): never handed out again."""
    leased: int
    """Slots a worker process is filling, or whose batch is on its way to this process."""
    adopted: int
    """Slots filled by worker processes and taken over by this one (zero-copy batches)."""
    reclaimed: int
    """Leases ended by this process: their worker died, or their batch was dropped unread."""
    peak_in_use: int
    acquired: int
    waits: int
    """Acquisitions that found no free slot and had to wait (or timed out)."""
    wait_seconds: float
    bytes_mapped: int
    bytes_locked: int
    bytes_registered: int
    lock_possible: bool
    """Whether the kernel let this pool lock its pages (False when it was not asked to)."""
    lock_note: str
    """Why the pages are not locked; empty when they are."""
    closed: bool


class Releasable(Protocol):
    """What is given back with a pool's memory (a node budget's reservation)."""

    def release(self) -> None: ...


class _Resources:
    """A pool's memfd, its mapping, and what pins them, released once in reverse order.
    Known to the at-fork handler before the file exists: a child forked by another
    thread at any step of a pool's making (each lets go of the GIL) must turn that
    mapping private too. Apart from the pool, so that slots, which outlive a closed
    pool, hold no reference to it."""

    def __init__(self, node: int) -> None:
        self.owner_pid = _process.pid
        self.node = node
        self.fd = -1
        self.region: _libnuma.MappedBuffer | None = None
        self.locked = False
        self.registration: Registration | None = None
        self.events: SlotEvents | None = None  # the slots' fences, where registered
        # Released during a CUDA graph capture: a fence recorded after it, past every stream
        # that may read the memory, and until when it is waited for (see _release_deferred).
        self.after_capture: tuple[_Fence, float] | None = None
        self.reservation: Releasable | None = None  # given back once the memory is released
        self.released = False
        self.private = False
        """Whether this process's view of the file is private (made so at a fork), and so
        is that of every process forked from it."""
        self.lock = threading.Lock()
        _pool_files.add(self)

    def view_privately(self) -> None:
        """In a forked child: make every shared mapping of this file private, at the same
        address (OSError when one cannot be). A pool being made at the fork has no region
        here yet (its thread is not in the child): /proc/self/maps says where it is. A view
        private already (the parent's parent's pool) stays as it is: mapped anew from the
        file, it would read what that pool's owner wrote since, not the batch inherited."""
        fd, region = self.fd, self.region
        if fd < 0 or self.private:
            return  # no file yet, or released: nothing of it is mapped; or private already
        if region is not None:
            if not region.freed:
                _libnuma.remap_private(region.address, region.size, fd, 0)
            self.private = True
            return
        inode = b"%d" % os.fstat(fd).st_ino
        with open("/proc/self/maps", "rb") as maps:
            lines = maps.readlines()  # all read before any mapping changes
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) >= 6 and fields[4] == inode and fields[1][3:4] == b"s" and b"/memfd:" in fields[5]:
                low, high = (int(part, 16) for part in fields[0].split(b"-"))
                _libnuma.remap_private(low, high - low, fd, int(fields[2], 16))
        self.private = True

    def lock_pages(self, mode: LockMode, *, on_fault: bool) -> str:
        """Lock the whole region or nothing; return why it is not locked ('' when it is)."""
        region = self.region
        assert region is not None
        if mode is LockMode.OFF:
            return "not asked to lock (lock='off')"
        if mode is LockMode.AUTO and not _gpu_usable():
            return "lock='auto' and no usable GPU here: page-locking serves copies to a GPU"
        try:
            _libnuma.mlock(region, on_fault)
        except LibnumaError as error:
            if error.errno not in LOCK_REFUSALS:
                raise
            with contextlib.suppress(LibnumaError):  # mlock may have locked a part before it gave up
                _libnuma.munlock(region)
            if mode is LockMode.REQUIRED:
                raise MemlockError(_memlock_message(region.size, self.node, error, "or pass lock='best-effort' to "
                                                    "go on unlocked")) from error  # fmt: skip
            message = _memlock_message(region.size, self.node, error, "or pass lock='off' not to lock")
            message += ". Pools go on with unlocked memory (this is said once)"
            held = getattr(_held_warnings, "messages", None)
            if held is not None:
                held.append(message)
            else:
                warn_unlocked(message, stacklevel=3)  # lock_pages, PinnedPool.__init__, its caller
            return str(error)
        self.locked = True
        return ""

    def unpin(self) -> None:
        """Unregister and unlock (the memory stays mapped and valid); nothing in a
        forked child, which inherited neither the lock nor the registration."""
        if self.owner_pid != _process.pid:
            return
        with self.lock:
            registration, self.registration = self.registration, None
            if registration is not None:
                registration.unregister()
            if self.locked and self.region is not None:
                self.locked = False
                _libnuma.munlock(self.region)

    def release(self) -> None:
        """Unpin, unmap, close the file, once no slot is out and no GPU work is in flight
        (or when making the pool failed). Only in the owner (SlotPool.settle calls
        on_drained there alone): in a forked child, arrays it inherited may still read
        its private view. While this thread captures a CUDA graph, a registered pool is
        released later instead (see _release_deferred)."""
        if self.registration is not None:
            from numafast import cuda

            if cuda.capturing():
                _released_later.append(self)
                return
        self.unpin()
        if self.region is not None:
            self.region.free()
        _pool_files.discard(self)
        fd, self.fd = self.fd, -1  # forgotten before closed: its number may be reused
        if fd >= 0:
            os.close(fd)
        self.released = True
        reservation, self.reservation = self.reservation, None
        if reservation is not None:
            reservation.release()


# This process's pools, kept in numafast/_process.py (what a forked child does with them too).
_live_pools = cast("weakref.WeakSet[PinnedPool]", _process.live_pools)
_released_later = cast("list[_Resources]", _process.released_later)
_pool_files = cast("weakref.WeakSet[_Resources]", _process.pool_files)
_held_warnings = threading.local()  # .messages: the MemlockWarnings held back in this thread (memlock_warning_held)

FORK_REMAP_FAILED_STATUS = _process.FORK_REMAP_FAILED_STATUS


def _release_deferred(*, wait: bool = True) -> None:
    """Release the pools drained during a CUDA graph capture (unregistering then would
    have invalidated it; their fences could not be asked), once this thread captures
    none and a fence recorded then, past every stream that may read them
    (SlotEvents.at_exit), is done. That fence is waited for until
    ``_libnuma.FENCE_WAIT_S`` after it was recorded (without ``wait``, only asked),
    never longer: a pool whose copies have not finished stays deferred, asked again at
    the next call (a pool made or settled, and at exit)."""
    if not _released_later:
        return
    from numafast import cuda

    if cuda.capturing():
        return
    deferred = list(_released_later)
    del _released_later[:]
    kept = []
    for resources in deferred:
        if resources.events is None:  # its pool was never made: no slot was ever read
            resources.release()
            continue
        if resources.after_capture is None:
            resources.after_capture = resources.events.at_exit(), time.monotonic() + _libnuma.FENCE_WAIT_S
        fence, deadline = resources.after_capture
        if cuda.wait_fences([fence], deadline - time.monotonic() if wait else 0.0):
            resources.release()
        else:
            kept.append(resources)
    _released_later.extend(kept)


EXIT_WAIT_S = 30.0
"""How long, at interpreter exit, the copies that may still read held slots get to finish."""


def _close_at_exit() -> None:
    """At interpreter exit: close every pool. One whose slots are still referenced is
    unregistered and unlocked now (while CUDA is still up), once the copies that may read
    its slots have finished (a ``non_blocking`` copy may still read a slot the consumer
    holds), and stays mapped until the process ends, since an object freed later in
    shutdown may still point into it. Past :data:`EXIT_WAIT_S` (a copy behind a hung
    kernel), such pools stay registered and locked too, said once: unregistering memory
    a copy still reads is undefined, and the process's end releases both anyway. So do
    pools released during a CUDA graph capture whose copies are still running (see
    _release_deferred), waited for alike."""
    _release_deferred(wait=False)
    held = []
    for pool in list(_live_pools):
        pool.close()
        if not pool._slots.drained:
            held.append(pool)
    registered = [pool for pool in held if pool._fences is not None]
    deferred = [resources.after_capture[0] for resources in _released_later if resources.after_capture]
    if registered or deferred:
        from numafast import cuda

        fences = [*(pool._fences.at_exit() for pool in registered if pool._fences), *deferred]
        if cuda.wait_fences(fences, EXIT_WAIT_S):
            _release_deferred(wait=False)
        else:
            captured = f" and {len(deferred)} released during a CUDA graph capture" if deferred else ""
            warnings.warn(
                f"numafast: at exit, copies from {len(registered)} pinned pool(s) still held{captured} had not "
                f"finished after {EXIT_WAIT_S:g} s (a kernel that does not end?): their memory is left registered, "
                "locked and mapped until the process ends, rather than unregistered under a running copy",
                RuntimeWarning, stacklevel=1,
            )  # fmt: skip
            held = [pool for pool in held if pool._fences is None]
    for pool in held:
        pool._resources.unpin()


def parse_mode(value: object, enum: type[LockMode] | type[RegisterMode], name: str) -> Any:
    """``lock=`` / ``register=`` as its enum member (True: required, False: off), or a
    ValueError naming the value and the choices."""
    if value is True:
        return enum("required")
    if value is False:
        return enum("off")
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum)
        raise ValueError(f"{name}={value!r}: choose one of {choices}, True or False") from None


_WAIT = object()  # acquire()'s default: the pool's own timeout


class PinnedPool:
    """``slots`` buffers of ``slot_bytes`` each on ``node``, page-locked and (with CUDA)
    registered once, handed out by :meth:`acquire`. A context manager, or call :meth:`close`.

    ``lock`` / ``register`` take a :class:`LockMode` / :class:`RegisterMode` (or True /
    False). ``timeout``, when every slot is in use: None waits as long as it takes, t
    waits up to t seconds (0: not at all), then raises :class:`PoolExhaustedError`; so
    does a wait for a copy to the GPU still running ``_libnuma.FENCE_WAIT_S`` after its
    slot came back (a kernel that does not end), whatever the timeout.
    ``hugepages`` uses transparent huge pages where the kernel allows.

    ``device`` (default: the calling thread's current one) is the CUDA device whose
    context registers the memory and whose current stream fences the slots; the
    registration is portable: copies to every device read the memory as pinned.

    ``prefault=False`` makes a pool cost nothing until used: each slot is faulted in on
    the node when this process first hands it out or adopts it (a worker faults in
    those it leases); with mlock2 MLOCK_ONFAULT a page is locked as it is faulted in,
    but the whole size counts against RLIMIT_MEMLOCK at once. Ignored when registering
    with CUDA, which pins every page.
    """

    def __init__(
        self,
        node: int,
        slot_bytes: int,
        slots: int,
        *,
        lock: LockMode | str | bool = "auto",
        register: RegisterMode | str | bool = "auto",
        timeout: float | None = None,
        hugepages: bool = True,
        prefault: bool = True,
        device: int | None = None,
    ) -> None:
        node = check_node(node)
        slot_bytes = positive_int(slot_bytes, "slot_bytes")
        slots = positive_int(slots, "slots")
        size = pool_bytes(slot_bytes, slots)
        hugepages, prefault = check_bool("hugepages", hugepages), check_bool("prefault", prefault)
        lock_mode: LockMode = parse_mode(lock, LockMode, "lock")
        register_mode: RegisterMode = parse_mode(register, RegisterMode, "register")
        self._wait = _wait_of(timeout)
        if device is not None:
            device = check_device_index(device)
        if _libnuma.node_size64(node)[0] == 0:
            raise InvalidNodeError(f"node {node} has no memory (a CPU-only node): a pool needs a node with memory")
        device = _registering_device(register_mode, device)
        prefault = prefault or device is not None
        self._cpus = tuple(cpus_near([node], allowed_cpus()))
        # Made before memfd_create, the first step that lets go of the GIL (see _Resources).
        self._resources = resources = _Resources(node)
        try:
            resources.fd = os.memfd_create(f"{MEMFD_PREFIX}{node}", os.MFD_CLOEXEC)
            # A child forked before the next line finds the mapping in /proc/self/maps.
            resources.region = region = allocate(
                size,
                node=node,
                hugepages=hugepages,
                shared_file=resources.fd,
                pretouch=prefault,
                unplaced_ok=True,  # a container refusing mbind: unplaced, said once, not an error
            )
            self._lock_note = resources.lock_pages(lock_mode, on_fault=not prefault)
            self._fences: SlotEvents | None = None
            if device is not None:
                self._fences = resources.events = _register(resources, device, register_mode, slot_bytes, slots)
            self._slots = _libnuma.SlotPool(region, slot_bytes, slots, self._fences, resources.release)
            self._slots.defer_settle = _process.defer_until_unlocked  # see _process.DeferringLock
            # Dropped: closed then, and released once its last slot is back, leases or not;
            # without waiting there (a finalizer runs in the dropping thread).
            weakref.finalize(self, self._slots.abandon).atexit = False
            # prefault=False: how many bytes of each slot this process has faulted in.
            self._faulted: list[int] | None = None if prefault else [0] * slots
        except BaseException:
            resources.release()
            raise
        _live_pools.add(self)
        if _process.first_time("close pools at exit"):
            atexit.register(_close_at_exit)

    # ------------------------------------------------------------ use

    def acquire(self, nbytes: int | None = None, timeout: float | None | object = _WAIT) -> Slot:
        """A slot whose buffer is its first ``nbytes`` bytes (default: all), given back once it
        and every array or tensor made over it (``numpy.asarray(slot)``,
        ``torch.frombuffer(slot, dtype=...)``) are gone. ``timeout`` overrides the pool's."""
        slots = self._slots
        size, wait = slots.table.slot_bytes, self._wait
        if nbytes is not None:
            size = positive_int(nbytes, "nbytes", minimum=0)
            if size > slots.table.slot_bytes:
                raise SlotTooSmallError(
                    f"{size} bytes asked for, but a slot of this pool holds {self.slot_bytes} bytes"
                )
        if timeout is not _WAIT:
            wait = _wait_of(timeout)
        try:
            slot: Slot = slots.acquire(size, wait)
        except PoolExhaustedError as error:  # a copy to the GPU that does not end (see _libnuma.FENCE_WAIT_S)
            raise PoolExhaustedError(f"node-{self.node} pool: {error}") from None
        except TimeoutError as error:
            raise PoolExhaustedError(
                f"node-{self.node} pool: {error}; drop references to earlier batches, or make the pool larger"
            ) from None
        except RuntimeError:  # the extension's refusal: say it in numafast's words
            self._check()
            raise
        self._fault_in(slot.index, slot.nbytes)
        return slot

    def _fault_in(self, index: int, nbytes: int, *, filled: bool = False) -> None:
        """Fault in the first ``nbytes`` of slot ``index`` now, in one call, as far as this
        process has not yet (a pool made with ``prefault=False``); ``filled``: a worker
        wrote them (see :func:`~numafast.pool_worker.fault_in`)."""
        if self._faulted is None:
            return  # prefault=True: every page was faulted in when the pool was made
        done = self._faulted[index]
        if nbytes > done:
            end = whole_pages(nbytes)  # a slot's stride is whole pages too
            self._faulted[index] = end
            start = self._slots.table.offset(index)
            with memoryview(self._slots.table.region) as whole, whole[start + done : start + end] as part:
                # pool_worker.fault_in, inline: a slot's first adoption stays in this module
                with contextlib.suppress(OSError):
                    _libnuma.madvise(part, MADV_POPULATE_READ if filled else _libnuma.MADV_POPULATE_WRITE)

    def adopt(self, index: int, generation: int, nbytes: int) -> Slot:
        """Slot ``index``, leased by a worker in ``generation`` (see :meth:`share`) and filled
        with ``nbytes`` bytes, as a slot of this process. LookupError when that lease has
        ended (the worker died and the slot was reclaimed, or it was adopted already);
        InvalidSizeError for an index this pool does not have, SlotTooSmallError for
        ``nbytes`` larger than a slot."""
        self._check(closed_ok=not self._slots.drained)  # a closed pool still takes its workers' batches
        index, generation, nbytes = _c_integers(("index", index, 63), ("generation", generation, 64),
                                                ("nbytes", nbytes, 64))  # fmt: skip
        try:
            slot: Slot = self._slots.adopt(index, generation, nbytes)
        except (IndexError, ValueError) as error:  # the extension's refusals, in numafast's classes
            raise (InvalidSizeError if isinstance(error, IndexError) else SlotTooSmallError)(
                f"node-{self.node} pool: {error}"
            ) from None
        except LookupError as error:
            raise LookupError(f"node-{self.node} pool: {error}; its batch cannot be read any more") from None
        self._fault_in(index, nbytes, filled=True)  # the worker faulted them in: they enter this process's tables
        return slot

    def reclaim_orphans(self) -> int:
        """End every lease whose worker process is gone (killed, or exited with a batch
        never sent): those slots are free again. Returns how many."""
        if self._resources.owner_pid != _process.pid:
            return 0
        freed = 0
        for index, generation, pid, started in self._slots.table.leases():
            try:
                now = _process.start_time(pid)
            except OSError:
                continue  # /proc cannot tell now (EMFILE, ENFILE): alive, until it can
            # A lease keeps its worker's start time (modulo 2**40), so a later process given
            # the same pid is not taken for it. -1 (not recorded yet) counts as a match:
            # ending a live worker's lease would let two batches share a slot, while
            # keeping a dead one's only costs that slot.
            alive = now is not None and (started < 0 or now & _libnuma.LEASE_STARTED_BITS == started)
            if not alive and self._slots.reclaim(index, generation, pid):
                freed += 1
        return freed

    def end_lease(self, index: int, generation: int, pid: int) -> bool:
        """End process ``pid``'s lease of slot ``index`` in ``generation`` whose batch this
        process will not take over (it failed on arrival): the slot is free again. False
        when that lease had ended already (adopted, reclaimed); InvalidSizeError for an index
        this pool does not have."""
        lease = _c_integers(("index", index, 63), ("generation", generation, 64), ("pid", pid, 63))
        try:
            return self._resources.owner_pid == _process.pid and bool(self._slots.reclaim(*lease))
        except IndexError as error:
            raise InvalidSizeError(f"node-{self.node} pool: {error}") from None

    def release_with(self, reservation: Releasable) -> None:
        """Call ``reservation.release()`` once this pool's memory is released (unmapped, its
        file closed), or now if it is already: a node budget's share of it comes back."""
        if not callable(getattr(reservation, "release", None)):
            raise TypeError(f"reservation must have a release() method (a node budget's reservation), not "
                            f"{reservation!r}")  # fmt: skip
        resources = self._resources
        if resources.released:
            reservation.release()
        else:
            resources.reservation = reservation

    def share(self) -> PoolHandle:
        """What another process needs to map this pool and lease its slots (small and
        picklable): see :class:`numafast.pool_worker.PoolView`."""
        self._check()
        return PoolHandle(
            owner_pid=self._resources.owner_pid,
            fd=self._resources.fd,
            inode=os.fstat(self._resources.fd).st_ino,
            nbytes=self._slots.table.region.size,
            node=self.node,
            slot_bytes=self.slot_bytes,
        )

    def settle(self) -> bool:
        """For a closed pool: release its memory once no slot is out (held, in flight or
        leased); True once released. Also records fences of slots given back since last time,
        and releases the pools whose release fell in a CUDA graph capture."""
        _release_deferred()
        self.reclaim_orphans()
        return self._slots.settle()

    def reap(self, *, wait: bool = False) -> None:
        """Free the slots whose GPU copies are done (workers lease only free slots); with
        ``wait`` and none free, wait for the oldest copy first, until
        ``_libnuma.FENCE_WAIT_S`` after its slot came back: then PoolExhaustedError. From
        any thread (it records no fence); nothing without CUDA."""
        try:
            self._slots.reap(check_bool("wait", wait))
        except PoolExhaustedError as error:
            raise PoolExhaustedError(f"node-{self.node} pool: {error}") from None

    def guard_held(self, guard: _process.ForkGuard) -> int:
        """Before a fork: keep the slots held now out of use, once given back, until
        ``guard`` ends (the child copied them); how many (see ``_process.ForkGuard``).
        A closed pool hands out no slot again, but the parent may still write into a
        batch it holds: its held slots are counted for the child to copy, none kept."""
        if self._slots.closed:
            return len(self._held_while_closed()) if self._resources.owner_pid == _process.pid else 0
        return int(self._slots.guard_held(_fork_guard(guard)))

    def _held_while_closed(self) -> list[int]:
        """A closed pool's slots held now (read from the table, which a forked child views
        as it was at the fork until it writes)."""
        if self._slots.drained:
            return []
        return [index for index, state in enumerate(self._slots.table.states()) if state == _HELD]

    def unguard(self) -> int:
        """Reuse the slots kept for forked processes whose guards ended; how many."""
        return int(self._slots.unguard())

    def copy_guarded(self, guard: _process.ForkGuard) -> None:
        """In a forked child: the slots held at its fork (``guard``'s) copied into this
        process's own memory, where its private view of them read the pool's file, which
        the parent goes on refilling. OSError when that memory cannot be had."""
        table = self._slots.table
        indices = self._held_while_closed() if self._slots.closed else self._slots.guarded_by(_fork_guard(guard))
        if not indices or table.region.freed:
            return
        with memoryview(table.region) as whole:
            for index in indices:
                start = table.offset(index)
                with whole[start : start + table.slot_bytes] as part:
                    _libnuma.pretouch(part, (), 1)  # a write fault per page: the child's own copy of it

    def __reduce__(self) -> NoReturn:
        self._slots.__reduce__()  # raises TypeError: why pool memory does not travel, and what to do
        raise AssertionError("unreachable")

    def _check(self, *, closed_ok: bool = False) -> None:
        """PoolForkedError in a forked child (its copy of the pool is a private view);
        PoolClosedError once the pool is closed, unless ``closed_ok``."""
        if self._resources.owner_pid != _process.pid:
            raise PoolForkedError(
                f"this pool was made by process {self._resources.owner_pid}; the forked child {_process.pid} only "
                "reads the slots it inherited (a private view: locking and CUDA registration are not "
                "inherited): make a new pool in the child"
            ) from None
        if self._slots.closed and not closed_ok:
            raise PoolClosedError(f"this node-{self.node} pool is closed") from None

    def record_stream(self, address: int, stream: object) -> bool:
        """Like ``Tensor.record_stream``: the slot holding ``address`` (a ``data_ptr()``) is
        reused only after the work queued on ``stream`` by the time it comes back has
        finished. False when the address is not in this pool or it is not registered.
        A closed pool takes it too, as :meth:`adopt` takes its batches: a loader's pool
        retired by a resize still holds the batches queued before it."""
        self._check(closed_ok=True)
        index = self._slot_index(address)
        if index < 0 or self._fences is None or self._slots.drained:
            return False
        self._fences.add_reader(index, stream)
        return True

    def contains(self, address: int) -> bool:
        """Whether ``address`` lies inside one of this pool's slots; never once its memory is
        released (the kernel may map another pool there)."""
        return not self._slots.drained and self._slot_index(address) >= 0

    def _slot_index(self, address: int) -> int:
        """The slot holding ``address`` (-1: none); InvalidSizeError when it is no address."""
        return int(self._slots.index_of(*_c_integers(("address", address, 64))))

    def stats(self) -> PoolStats:
        """The pool's counters now (see :class:`PoolStats`)."""
        self._check(closed_ok=True)
        slots = self._slots
        region = slots.table.region
        states = slots.table.states()
        return PoolStats(
            node=self.node,
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            in_use=slots.in_use,
            free=states.count(_libnuma.SLOT_STATES["free"]),
            in_flight=slots.fenced,
            guarded=slots.guarded,
            retired=slots.lost,
            leased=states.count(_libnuma.SLOT_STATES["leased"]),
            adopted=slots.adopted,
            reclaimed=slots.reclaimed,
            peak_in_use=slots.peak,
            acquired=slots.acquired,
            waits=slots.waits,
            wait_seconds=slots.waited_seconds,
            bytes_mapped=0 if region.freed else region.size,
            bytes_locked=region.size if self.locked else 0,
            bytes_registered=region.size if self.registered else 0,
            lock_possible=not self._lock_note,
            lock_note=self._lock_note,
            closed=slots.closed,
        )

    def close(self) -> None:
        """Hand out no more slots (waiters raise PoolClosedError), wait for GPU work in
        flight, and release the memory once the last slot is gone. A copy still running
        ``_libnuma.FENCE_WAIT_S`` after its slot came back is waited for no longer: the
        memory stays until a later :meth:`settle` finds it done. Idempotent; in a forked
        child it only marks the child's copy closed."""
        self._slots.close()

    def __enter__(self) -> PinnedPool:
        self._check()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ what it is

    @property
    def node(self) -> int:
        return self._resources.node

    @property
    def slot_bytes(self) -> int:
        return self._slots.table.slot_bytes

    @property
    def slots(self) -> int:
        return self._slots.table.count

    @property
    def in_use(self) -> int:
        """Slots held now (as :attr:`PoolStats.in_use`), without the cost of :meth:`stats`."""
        return int(self._slots.in_use)

    @property
    def cpus(self) -> tuple[int, ...]:
        """The allowed CPUs nearest the pool's memory: where copies into it should run."""
        return self._cpus

    @property
    def device(self) -> int | None:
        """The CUDA device the pool is registered through; None when not registered."""
        return None if self._fences is None else self._fences.device

    @property
    def closed(self) -> bool:
        return self._slots.closed

    @property
    def locked(self) -> bool:
        return self._resources.locked

    @property
    def registered(self) -> bool:
        return self._resources.registration is not None

    def __repr__(self) -> str:
        state = "closed" if self._slots.closed else f"{self._slots.in_use}/{self.slots} in use"
        pinned = ", ".join(
            word for word, on in (("locked", self.locked), ("CUDA-registered", self.registered)) if on
        ) or "not locked"
        return f"<PinnedPool node {self.node}: {self.slots} x {self.slot_bytes} bytes, {pinned}, {state}>"


def _register(resources: _Resources, device: int, mode: RegisterMode, slot_bytes: int, slots: int,
              **runtime: Any) -> SlotEvents | None:
    """Register ``resources``' region with CUDA through ``device``: the slots' fences. Where
    cudaHostRegister refuses (not enough memory the driver may pin, a platform without
    it, memory registered already by someone else), ``register='auto'`` goes on
    unregistered, as ``lock='auto'`` does, said once per process: None. ``runtime``
    (``runtime=``, ``device_guard=``) is passed on to :class:`~numafast.cuda.Registration`."""
    from numafast import cuda

    region = resources.region
    assert region is not None
    try:
        resources.registration = cuda.Registration(
            region.address, region.size, device=device, unit=whole_pages(slot_bytes),
            head=_libnuma.slot_table_bytes(slots), **runtime,
        )
    except cuda.RegistrationFailed as error:
        if mode is RegisterMode.REQUIRED:
            raise
        if _process.first_time("pools unregistered"):
            warnings.warn(
                f"{error}. Pools go on unregistered (this is said once): batches still land in them, but copies to "
                "the GPU read them as pageable memory, staged by the driver. Pass register='off' not to try, or "
                "register='required' to make this an error", RuntimeWarning, stacklevel=3,
            )
        return None
    return cuda.SlotEvents(slots, device)


def whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: a slot's stride."""
    return -(-nbytes // PAGE_SIZE) * PAGE_SIZE


def pool_bytes(slot_bytes: int, slots: int) -> int:
    """The bytes a pool of ``slots`` x ``slot_bytes`` maps: its slot table, then whole-page
    slots; InvalidSizeError when that is more than an address space holds."""
    if slots <= sys.maxsize // PAGE_SIZE:  # a slot takes a page at least: beyond, no pool fits
        size = _libnuma.slot_table_bytes(slots) + whole_pages(slot_bytes) * slots
        if size <= sys.maxsize:
            return size
    raise InvalidSizeError(
        f"{slots} slots of {slot_bytes} bytes (each in whole pages of {PAGE_SIZE} bytes, after the slot table) "
        f"are more than an address space holds ({sys.maxsize} bytes)"
    )


def pool_of(address: int) -> PinnedPool | None:
    """The live pool whose slots hold ``address``, if any."""
    return next((pool for pool in list(_live_pools) if pool.contains(address)), None)


def _c_integers(*values: tuple[str, object, int]) -> list[int]:
    """Each ``(name, value, bits)`` as an int from 0 to below 2**bits, as the slot table's C
    calls take them (whose own conversion would truncate a float), or InvalidSizeError
    naming it."""
    numbers = []
    for name, value, bits in values:
        number = value if type(value) is int and value >= 0 else positive_int(value, name, minimum=0)
        if number >> bits:
            raise InvalidSizeError(f"{name} must be a non-negative integer below 2**{bits}, not {value!r}")
        numbers.append(number)
    return numbers


def _fork_guard(guard: object) -> _process.ForkGuard:
    """``guard``, or a TypeError: a slot kept for anything else would never come back."""
    if not isinstance(guard, _process.ForkGuard):
        raise TypeError(f"guard must be a numafast._process.ForkGuard (one is made at each fork), not {guard!r}")
    return guard


def _wait_of(timeout: object) -> float:
    """``timeout`` as SlotPool.acquire takes it (None, as long as it takes, is -1.0), or a
    ValueError naming it."""
    if timeout is None:
        return -1.0
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout < 0 or timeout != timeout:
        raise ValueError(f"timeout must be None (wait as long as it takes) or seconds >= 0, not {timeout!r}")
    return float(timeout)


def check_device_index(device: object) -> int:
    """``device`` as a CUDA device index (an int or NumPy integer, >= 0). Whether it
    exists is checked only by a pool that registers: counting devices is for a
    process that uses CUDA."""
    if isinstance(device, bool) or not isinstance(device, numbers.Integral):
        raise TypeError(f"device={device!r}: give a CUDA device index (0, 1, ...) or None for the current device")
    if int(device) < 0:
        raise InvalidGpuError(f"device={device!r}: a CUDA device index is 0 or more")
    return int(device)


def _registering_device(mode: RegisterMode, device: int | None) -> int | None:
    """The device a pool registers through (``device``, else the calling thread's current
    one); None when it does not register, CudaUnavailable when it must and cannot."""
    if mode is RegisterMode.OFF or mode is RegisterMode.AUTO and "torch" not in sys.modules:
        return None
    try:
        from numafast import cuda
    except ImportError as error:
        raise CudaUnavailable(f"register='required' needs PyTorch with CUDA: {error}") from error
    if not cuda.usable():
        if mode is RegisterMode.REQUIRED:
            raise CudaUnavailable(f"register='required', but CUDA is not usable here: {cuda.why_not_usable()}")
        return None
    if device is None:
        return cuda.current_index()
    check_visible(device, cuda.device_count(), f"device={device}")
    return device


def check_visible(index: int, count: int, given: str) -> None:
    """InvalidGpuError, naming the argument as ``given``, unless CUDA device ``index`` is
    one of the ``count`` this process sees."""
    if index >= count:
        raise InvalidGpuError(f"{given}: this process sees {count} CUDA devices (0 to {count - 1})")


def _gpu_usable() -> bool:
    """Whether page-locking can serve a GPU here: PyTorch is imported (a pool never
    imports it) and sees a CUDA device (numafast.cuda.usable)."""
    if "torch" not in sys.modules:
        return False
    try:
        from numafast import cuda
    except ImportError:
        return False
    return cuda.usable()


@contextlib.contextmanager
def memlock_warning_held() -> Iterator[list[str]]:
    """Pools made in this block, in this thread, do not say their MemlockWarning: its
    text goes into the list yielded, for the caller to say with :func:`warn_unlocked`
    where the user sees it (a loader makes its pools deep inside torch's iterator, and
    says the warning after the batch, in order: the cause of a shortfall first)."""
    held: list[str] = []
    before = getattr(_held_warnings, "messages", None)
    _held_warnings.messages = held
    try:
        yield held
    finally:
        _held_warnings.messages = before


def warn_unlocked(message: str, stacklevel: int) -> None:
    """Say the MemlockWarning ``message``, once per process (a loader's pools, made one
    by one, are refused alike); ``stacklevel`` as warnings.warn's, from the caller."""
    if _process.first_time("MemlockWarning"):
        warnings.warn(message, MemlockWarning, stacklevel=stacklevel + 1)


def _memlock_limits() -> tuple[int, int, int | None, bool]:
    """RLIMIT_MEMLOCK (soft, hard), the bytes this process locks already (VmLck; None
    without it), and whether it has CAP_IPC_LOCK."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    status = read_fields(Path("/proc/self/status")) or {}
    capable = bool(int(status.get("CapEff", "0"), 16) >> CAP_IPC_LOCK & 1)
    locked = status.get("VmLck")
    return soft, hard, None if locked is None else int(locked.split()[0]) * 1024, capable


def memlock_room() -> int | None:
    """Bytes this process may still page-lock; None when unlimited (RLIMIT_MEMLOCK
    infinity, or CAP_IPC_LOCK)."""
    soft, _hard, locked, capable = _memlock_limits()
    if soft == resource.RLIM_INFINITY or capable:
        return None
    return max(soft - (locked or 0), 0)


def _memlock_message(nbytes: int, node: int, error: LibnumaError, otherwise: str) -> str:
    """Why locking ``nbytes`` failed, by how much, the fix that works for this process
    (its soft limit raised, which needs no privileges up to the hard one; past that,
    root or an administrator), and ``otherwise``."""
    soft, hard, locked, capable = _memlock_limits()
    why = f"mlock: {os.strerror(error.errno or 0)}"
    head = f"page-locking the {format_size(nbytes)} pool on node {node} failed ({why})"
    if capable or soft == resource.RLIM_INFINITY:  # not the limit: the memory itself
        return f"{head} although this process may lock without limit: is node {node} out of memory? {otherwise}"
    needed = (locked or 0) + nbytes  # the soft limit it takes (the memory of a pool that fails is not locked)
    needed_kib = -(-needed // 1024)
    short_kib = needed_kib - soft // 1024
    already = "an unknown amount (no VmLck)" if locked is None else format_size(locked)
    limits = (
        f"{head}: this process locks {already} already and may lock {format_size(soft)} in all "
        f"(RLIMIT_MEMLOCK; hard limit {'unlimited' if hard == resource.RLIM_INFINITY else format_size(hard)}; "
        f"no CAP_IPC_LOCK), {short_kib} KiB short"
    )
    if hard == resource.RLIM_INFINITY or hard >= needed:
        target = "unlimited" if hard == resource.RLIM_INFINITY else str(hard // 1024)
        fix = (
            f"Raise the soft limit, which needs no privileges up to the hard limit: `ulimit -S -l {target}` in the "
            f"shell that starts the job (at least {needed_kib}: the value is in KiB)"
        )
    else:
        fix = (
            "That is past the hard limit, which only root or an administrator can raise: `* - memlock unlimited` "
            "in /etc/security/limits.conf (then log in again), `LimitMEMLOCK=infinity` in a systemd unit, "
            "`docker run --ulimit memlock=-1`"
        )
    return f"{limits}. {fix}; {otherwise}"
