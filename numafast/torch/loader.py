"""NumaLoader: a DataLoader whose workers, pin step and host buffers sit on the GPU's node.

Stock PyTorch pins every batch in one thread of the main process that runs wherever
the scheduler puts it, into a NUMA-blind caching allocator. NumaLoader wraps a
DataLoader built with ``pin_memory=False`` and does that step itself:

* the workers run on the node's CPUs with the node's memory policy: they are forked
  by a thread bound to the node (a fork inherits the forking thread's affinity and
  policy), and the binding is applied again inside each worker, before the user's
  own ``worker_init_fn``, since some OpenMP runtimes reset affinity after fork and
  a spawned worker inherits nothing;
* its own pin thread, bound to the node, copies each batch into a slot of a
  node-local, page-locked pool sized from the first batch;
* with a CUDA ``device`` that thread also queues the host-to-device copies on a side
  stream, ``prefetch`` batches ahead, and the consumer gets device tensors; a slot
  is reused once its copy is done (a CUDA event on the side stream).
"""

from __future__ import annotations

import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from numafast._validate import check_node
from numafast.binding import bind
from numafast.errors import CudaUnavailable, InvalidGpuError, InvalidSizeError
from numafast.pages import local_node
from numafast.pool import PoolStats
from numafast.torch import cuda
from numafast.torch.batch import flatten, record_stream
from numafast.torch.pools import NodePools
from numafast.topo import topology

__all__ = ["NumaLoader", "WorkerPlacement", "gpu_node", "resolve_device"]

# How often a blocked pin thread or consumer looks whether it should stop.
POLL_S = 0.1
# How long closing an iterator waits for the pin thread to finish its current batch.
JOIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkerPlacement:
    """A DataLoader ``worker_init_fn`` that binds the worker to ``node`` (its CPUs, and
    its memory preferred there or, with ``strict``, bound there), then calls the
    user's own function. Picklable, for workers that are spawned."""

    node: int
    strict: bool = False
    then: Callable[[int], None] | None = None

    def __call__(self, worker_id: int) -> None:
        bind(self.node, strict=self.strict)
        if self.then is not None:
            self.then(worker_id)


def resolve_device(device: object) -> torch.device | None:
    """None for host batches (``None`` or ``"cpu"``), else a CUDA device with its index.

    Raises CudaUnavailable for a CUDA device when CUDA is not usable here, and
    ValueError for any other device type.
    """
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device {device!r}: give a CUDA device ('cuda:0', 0, torch.device) or None")
    resolved = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    if resolved.type == "cpu":
        return None
    if resolved.type != "cuda":
        raise ValueError(f"device {device!r}: NumaLoader copies to a CUDA device or yields host batches (None, 'cpu')")
    if not cuda.usable():
        raise CudaUnavailable(f"device {device!r}: {cuda.why_not_usable()}")
    return cuda.with_index(resolved)


def gpu_node(device: torch.device) -> int:
    """The NUMA node of CUDA device ``device`` (its PCI root's node), from the topology."""
    node = topology().node_of_gpu(device.index or 0)
    if node is None:
        raise InvalidGpuError(f"the NUMA node of {device} is unknown (firmware did not say); pass node=")
    return node


class NumaLoader:
    """Wrap ``loader`` (a DataLoader with ``pin_memory=False``) so that its workers and
    pin step run on ``node`` and its batches come out page-locked on that node, or,
    with a CUDA ``device``, already on the device.

    ``node`` defaults to the device's node from the topology, or without a device to
    the calling thread's node. ``slots`` is the size of each pinned pool (default
    ``prefetch + 2``: the batches queued, the one being filled and the one the
    consumer holds); when the consumer keeps more batches than that, another pool
    is added rather than stalling. ``strict`` binds the workers' memory to the node
    instead of preferring it. Iterating gives the same batches, in the same order,
    with the same exceptions, as the wrapped loader; ``len()`` is the same too.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        *,
        device: object = None,
        node: int | None = None,
        slots: int | None = None,
        prefetch: int = 2,
        strict: bool = False,
        lock: str | bool = "auto",
    ) -> None:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"NumaLoader wraps a torch.utils.data.DataLoader, not a {type(loader).__name__}")
        if loader.pin_memory:
            raise ValueError(
                "this DataLoader has pin_memory=True: NumaLoader pins itself, into node-local memory; build the "
                "loader with pin_memory=False, or keep pin_memory=True and use numafast.torch.pin_memory_hook(loader)"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise InvalidSizeError(f"prefetch must be a positive integer, not {prefetch!r}")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise InvalidSizeError(f"slots must be a positive integer or None, not {slots!r}")
        self.loader = loader
        self.device = resolve_device(device)
        if node is None:
            node = gpu_node(self.device) if self.device is not None else local_node()
        self.node = check_node(node)
        self.prefetch = prefetch
        self.strict = strict
        self.pools = NodePools(self.node, slots or prefetch + 2, lock=lock)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return _NumaLoaderIterator(self)

    def stats(self) -> list[PoolStats]:
        """The counters of the pinned pools in use (see :class:`numafast.PoolStats`)."""
        return self.pools.stats()

    def __repr__(self) -> str:
        target = str(self.device) if self.device is not None else "host"
        return f"<NumaLoader node {self.node} -> {target}, prefetch {self.prefetch}, {len(self.pools.pools)} pools>"


class _End:
    """The wrapped loader is exhausted."""


@dataclass
class _Raised:
    """The wrapped loader (or the pin step) raised this for the batch at this place."""

    error: BaseException


@dataclass
class _OnDevice:
    """A batch whose copies to the device are queued on the side stream."""

    copies: list[torch.Tensor]
    ready: Any
    rebuild: Callable[[list[torch.Tensor]], Any]


class _Pipe:
    """What the consumer and the pin thread share; never a reference to the iterator,
    so that dropping the iterator ends the thread."""

    def __init__(self, depth: int) -> None:
        self.batches: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread_id: int | None = None

    def put(self, item: Any) -> bool:
        """Queue ``item``; False when told to stop first."""
        while not self.stop.is_set():
            try:
                self.batches.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False


def _pin_loop(pipe: _Pipe, owner: NumaLoader) -> None:
    """The pin thread: bound to the node, it iterates the wrapped loader (whose workers
    it forks), pins each batch and, with a device, queues its copy."""
    pipe.thread_id = threading.get_native_id()
    loader, node = owner.loader, owner.node
    pools = owner.pools
    copier: cuda.CopyStream | None = None
    try:
        bind(node)  # this thread only lives to pin: it stays on the node
        if owner.device is not None:
            copier = cuda.CopyStream(owner.device)
        batches = _iterate_placed(loader, WorkerPlacement(node, owner.strict, loader.worker_init_fn))
    except BaseException as error:  # noqa: BLE001 - handed to the consumer
        pipe.put(_Raised(error))
        return
    try:
        while not pipe.stop.is_set():
            try:
                batch = next(batches)
            except StopIteration:
                pipe.put(_End())
                return
            except Exception as error:  # the dataset's own exception, in its place
                if not pipe.put(_Raised(error)):
                    return
                continue
            try:
                item = pools.pin(batch)
                del batch
                if copier is not None:
                    item = _to_device(item, copier)
            except Exception as error:
                item = _Raised(error)
            if not pipe.put(item):
                return
            del item
    finally:
        # Dropping the wrapped iterator shuts its workers down, here, in the one
        # thread that ever used it.
        del batches


def _iterate_placed(loader: DataLoader[Any], placement: WorkerPlacement) -> Iterator[Any]:
    """iter(loader) with ``placement`` as its workers' init function; the loader's own
    attribute is put back at once (workers read it when they are created, inside iter)."""
    if loader.num_workers == 0:
        return iter(loader)
    own = loader.worker_init_fn
    loader.worker_init_fn = placement
    try:
        return iter(loader)
    finally:
        loader.worker_init_fn = own


def _to_device(pinned: Any, copier: cuda.CopyStream) -> _OnDevice:
    tensors, rebuild = flatten(pinned)
    copies, ready = copier.to_device(tensors)
    # The slots come back as `pinned` goes; they are reused once the side stream is done.
    record_stream(pinned, copier.stream)
    return _OnDevice(copies, ready, rebuild)


def _shut_down(pipe: _Pipe, thread: threading.Thread) -> None:
    """Stop the pin thread and free what it queued; runs when the iterator is dropped."""
    pipe.stop.set()
    while True:  # pinned batches in the queue hold slots: let them go
        try:
            pipe.batches.get_nowait()
        except queue.Empty:
            break
    if thread is not threading.current_thread():
        thread.join(JOIN_TIMEOUT_S)
        if thread.is_alive():
            warnings.warn(
                f"NumaLoader's pin thread did not stop within {JOIN_TIMEOUT_S:g} s (a worker still busy?)",
                RuntimeWarning,
                stacklevel=2,
            )


class _NumaLoaderIterator:
    """One pass over a NumaLoader."""

    def __init__(self, owner: NumaLoader) -> None:
        self._owner = owner
        self._pipe = _Pipe(owner.prefetch)
        self.pin_thread = threading.Thread(target=_pin_loop, args=(self._pipe, owner), name="numafast_pin", daemon=True)
        self._finalizer = weakref.finalize(self, _shut_down, self._pipe, self.pin_thread)
        self.pin_thread.start()
        self._done = False

    @property
    def pin_thread_id(self) -> int | None:
        """The kernel's id of the pin thread (see /proc/self/task/ID), once it has started."""
        return self._pipe.thread_id

    def __iter__(self) -> _NumaLoaderIterator:
        return self

    def __len__(self) -> int:
        return len(self._owner)

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._pipe.batches.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self.pin_thread.is_alive() and self._pipe.batches.empty():
                    self.close()
                    raise RuntimeError("NumaLoader's pin thread ended without a word") from None
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Raised):
            error = item.error
            del item
            raise error
        if isinstance(item, _OnDevice):
            cuda.hand_over(item.copies, item.ready)
            return item.rebuild(item.copies)
        return item

    def close(self) -> None:
        """Stop now: the pin thread ends, the wrapped loader's workers shut down, and
        the batches it queued are released. Also happens when the iterator is dropped."""
        self._done = True
        self._finalizer()
