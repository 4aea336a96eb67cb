"""NumaLoader: a DataLoader whose workers and host buffers sit on the GPU's node, and
whose batches arrive page-locked there without a copy.

Stock PyTorch collates each batch in a worker into a fresh shared-memory file, then
copies it again in a pin thread of the main process that runs wherever the
scheduler puts it, into a NUMA-blind caching allocator. NumaLoader wraps a
DataLoader built with ``pin_memory=False``:

* it iterates the DataLoader in the caller's own thread, as the DataLoader would
  be: every warning, error, signal handler and shutdown is the DataLoader's own,
  at the same call;
* the workers run on the node's CPUs with the node's memory policy: ``iter()``
  forks them inside a ``numa_local(node)`` scope (a fork inherits the forking
  thread's affinity and policy), and the binding is applied again inside each
  worker, before the user's own ``worker_init_fn``, since some OpenMP runtimes
  reset affinity after fork and a spawned worker inherits nothing;
* the workers collate each batch straight into a slot of a shared, node-local,
  page-locked pool (:mod:`numafast.torch.collate`): the main process copies no
  byte; a batch that cannot land in a slot is copied in, with the reason counted;
* with a CUDA ``device`` the host-to-device copies of the next ``prefetch``
  batches are queued on a side stream from the same thread, and the consumer gets
  device tensors; a slot is reused once its copy is done (a CUDA event).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from numafast import cuda
from numafast._validate import check_node
from numafast.binding import bind, numa_local
from numafast.errors import CudaUnavailable, InvalidGpuError, InvalidSizeError
from numafast.pages import local_node
from numafast.torch.batch import flatten, record_stream
from numafast.torch.collate import Fallback, SlotBatch, SlotCollate
from numafast.torch.pools import LoaderStats, NodePools
from numafast.topo import topology

__all__ = ["NumaLoader", "WorkerPlacement", "gpu_node", "resolve_device"]

# DataLoader attributes that it refuses to change once built (DataLoader.__setattr__).
FROZEN_ATTRIBUTES = frozenset(("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"))


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
    try:
        resolved = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    except RuntimeError:
        raise ValueError(
            f"device {device!r} is not a device: give a CUDA device ('cuda', 'cuda:1', 1, torch.device) "
            "or None / 'cpu' for host batches"
        ) from None
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
    """Wrap ``loader`` (a DataLoader with ``pin_memory=False``) so that its workers run on
    ``node`` and its batches come out page-locked on that node, or, with a CUDA
    ``device``, already on the device.

    ``node`` defaults to the device's node from the topology, or without a device to
    the calling thread's node. ``slots`` is the size of each pinned pool (default:
    the batches the DataLoader keeps in flight, ``prefetch_factor`` x
    ``num_workers``, plus ``prefetch`` with a device, plus two for the batch being
    filled and the one the consumer holds); when the consumer keeps more, another
    pool is added rather than stalling. ``strict`` binds the workers' memory to the
    node instead of preferring it; ``lock`` is the pools' :class:`~numafast.LockMode`.

    It reads like the DataLoader it wraps: the same batches, order, exceptions,
    warnings and ``len()``, and every public attribute (``dataset``, ``batch_size``,
    ``num_workers``...), with the same ones refused on assignment.
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
        resolved = resolve_device(device)
        if node is None:
            node = gpu_node(resolved) if resolved is not None else local_node()
        checked = check_node(node)
        in_flight = (loader.prefetch_factor or 0) * loader.num_workers + (prefetch if resolved is not None else 0)
        own: dict[str, object] = {
            "loader": loader,
            "device": resolved,
            "node": checked,
            "prefetch": prefetch,
            "strict": strict,
            "pools": NodePools(checked, slots or in_flight + 2, lock=lock),
        }
        for name, value in own.items():  # past __setattr__, which forwards DataLoader attributes
            object.__setattr__(self, name, value)
        self.loader: DataLoader[Any]
        self.device: torch.device | None
        self.node: int
        self.prefetch: int
        self.strict: bool
        self.pools: NodePools

    def __getattr__(self, name: str) -> Any:
        # Only what NumaLoader lacks: the wrapped DataLoader's public attributes.
        if name.startswith("_") or name == "loader":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FROZEN_ATTRIBUTES:
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is initialized")
        if name in vars(self) or name.startswith("_") or not hasattr(self.loader, name):
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)  # DataLoader's own settings (num_workers, collate_fn...)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> _NumaLoaderIterator:
        return _NumaLoaderIterator(self)

    def stats(self) -> LoaderStats:
        """How the batches arrived (see :class:`numafast.torch.LoaderStats`) and the
        counters of the pinned pools in use."""
        return self.pools.stats()

    def __repr__(self) -> str:
        target = str(self.device) if self.device is not None else "host"
        return f"<NumaLoader node {self.node} -> {target}, prefetch {self.prefetch}, {len(self.pools.pools)} pools>"


def _iterate_placed(loader: DataLoader[Any], placement: WorkerPlacement, collate: SlotCollate) -> Any:
    """iter(loader) with the workers' init and collate functions set to numafast's; the
    loader's own attributes are put back at once (the DataLoader reads them when it
    makes its iterator and starts its workers, inside iter)."""
    own_init, own_collate = loader.worker_init_fn, loader.collate_fn
    loader.worker_init_fn = placement if loader.num_workers else own_init
    loader.collate_fn = collate
    try:
        return iter(loader)
    finally:
        loader.worker_init_fn, loader.collate_fn = own_init, own_collate


@dataclass
class _OnDevice:
    """A batch whose copies to the device are queued on the side stream."""

    copies: list[torch.Tensor]
    ready: Any
    rebuild: Callable[[list[torch.Tensor]], Any]


@dataclass
class _Raised:
    """The wrapped loader raised this at this batch (met while prefetching)."""

    error: BaseException


class _NumaLoaderIterator:
    """One pass over a NumaLoader, driven by the thread that iterates it."""

    def __init__(self, owner: NumaLoader) -> None:
        self._owner = owner
        self._pools = owner.pools
        loader = owner.loader
        # The workers are forked here, inside the node's scope: they start on its CPUs
        # with its memory policy (the calling thread gets its own back on leaving).
        with numa_local(owner.node, strict=owner.strict):
            self._inner: Any = _iterate_placed(
                loader, WorkerPlacement(owner.node, owner.strict, loader.worker_init_fn), owner.pools.collate(loader.collate_fn)
            )
        self._copier = cuda.CopyStream(owner.device) if owner.device is not None else None
        self._ahead: deque[_OnDevice | _Raised] = deque()
        self._exhausted = False

    def __iter__(self) -> _NumaLoaderIterator:
        return self

    def __len__(self) -> int:
        return len(self._inner) if self._inner is not None else len(self._owner)

    def __next__(self) -> Any:
        if self._inner is None:
            raise StopIteration
        if self._copier is None:
            return self._arrived(next(self._inner))
        self._queue_copies()
        if not self._ahead:
            self.close()
            raise StopIteration
        item = self._ahead.popleft()
        if isinstance(item, _Raised):
            error = item.error
            del item
            raise error
        cuda.hand_over(item.copies, item.ready)
        return item.rebuild(item.copies)

    def _arrived(self, item: Any) -> Any:
        """A batch as the consumer sees it, from what the DataLoader yielded."""
        if isinstance(item, SlotBatch):
            return self._pools.receive(item)
        if isinstance(item, Fallback):
            return self._pools.copy_in(item)
        return self._pools.pin(item)  # from workers started without numafast's collate

    def _queue_copies(self) -> None:
        """Keep the copies of the next ``prefetch`` batches queued on the side stream;
        stop at an error, which the consumer meets at its own batch."""
        assert self._copier is not None
        while not self._exhausted and len(self._ahead) <= self._owner.prefetch:
            if self._ahead and isinstance(self._ahead[-1], _Raised):
                return
            try:
                pinned = self._arrived(next(self._inner))
            except StopIteration:
                self._exhausted = True
                return
            except Exception as error:  # the dataset's own exception, in its place
                self._ahead.append(_Raised(error))
                return
            tensors, rebuild = flatten(pinned)
            copies, ready = self._copier.to_device(tensors)
            # The slots come back as `pinned` goes; they are reused once the side stream is done.
            record_stream(pinned, self._copier.stream)
            self._ahead.append(_OnDevice(copies, ready, rebuild))

    def close(self) -> None:
        """Stop now: the wrapped iterator is dropped (the DataLoader shuts its workers
        down, as when its own iterator is dropped) and the queued copies released.
        Also happens when this iterator is dropped."""
        self._inner = None
        self._ahead.clear()
