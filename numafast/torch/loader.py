"""NumaLoader: a DataLoader whose workers and host buffers sit on the GPU's node, and
whose batches arrive page-locked there without a copy.

Stock PyTorch collates each batch in a worker into a fresh shared-memory file, then
copies it again, in a pin thread the scheduler puts anywhere, into a NUMA-blind
caching allocator. NumaLoader's ``collate_fn`` is numafast's
(:mod:`numafast.torch.worker_collate`): each worker binds itself to the node at its first
batch (some OpenMP runtimes reset affinity after fork; a spawned worker inherits
nothing) and collates straight into a slot of a shared, node-local, page-locked pool.
A plain attribute, it survives a framework rebuilding the loader from its settings
(Lightning's sampler injection, Accelerate's and Ray Train's ``prepare``).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, default_collate, default_convert

from numafast import _process, cuda
from numafast._validate import check_bool, check_node, positive_int
from numafast.binding import bind, numa_local_if_permitted
from numafast.capabilities import memory_placement_refused, warn_unplaced
from numafast.errors import LoaderHint, MemlockError
from numafast.pool import MEMLOCK_FIX, LockMode, memlock_room, parse_mode
from numafast.private import LIGHTNING_SAVED_ARGUMENTS, LOADER_GET_ITERATOR, LOADER_ITERATOR, RAY_INNER_LOADER
from numafast.torch import owner_process_pools
from numafast.torch.batch import flatten, record_stream
from numafast.torch.device import gpu_node, iteration_gpu, landing_node, resolve_device
from numafast.torch.fork_watch import watch_starts
from numafast.torch.owner_pools import LoaderStats, NodePools, _user_level, node_pools
from numafast.torch.owner_sizing import check_max_pinned_bytes
from numafast.torch.worker_collate import SlotCollate

# What the loader's dataset yields: NumaLoader[T] reads like DataLoader[T].
T_co = TypeVar("T_co", covariant=True)

__all__ = ["NumaLoader", "WorkerPlacement", "gpu_node", "loader_stats", "resolve_device"]


class _FromLoader:
    """The default of NumaLoader's DataLoader options: the wrapped loader's value (or,
    for a dataset, DataLoader's own default)."""

    def __repr__(self) -> str:
        return "<from the loader>"


FROM_LOADER: Any = _FromLoader()

DATALOADER_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(DataLoader.__init__).parameters.items()
    if name not in ("self", "dataset")
}
# What decides which samples form a batch; DataLoader rebuilds its batch sampler from these.
_BATCHING = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
# Where loaders that wrap another keep it (Accelerate's DataLoaderShard, Ray Train's
# _WrappedDataLoader, a NumaLoader iterating through another).
_INNER_LOADER_ATTRIBUTES = ("base_dataloader", RAY_INNER_LOADER, "_through", "dataloader", "loader")


@dataclass(frozen=True)
class WorkerPlacement:
    """A DataLoader ``worker_init_fn`` that binds the worker to ``node`` (its CPUs, and
    its memory preferred there or, with ``strict``, bound there), then calls the
    user's own function. Picklable, for workers that are spawned."""

    node: int
    strict: bool = False
    then: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        # Checked here, not first in each worker, where a mistake ends every worker.
        object.__setattr__(self, "node", check_node(self.node))
        object.__setattr__(self, "strict", check_bool("strict", self.strict))
        if self.then is not None and not callable(self.then):
            raise TypeError(f"then must be the user's worker_init_fn (a callable taking the worker id) or None, "
                            f"not {self.then!r}")  # fmt: skip

    def __call__(self, worker_id: int) -> None:
        bind(self.node, strict=self.strict)
        if self.then is not None:
            self.then(worker_id)


def settings_of(loader: DataLoader[Any]) -> dict[str, Any]:
    """The DataLoader options that make a loader with ``loader``'s dataset, batches and
    workers: its very sampler or batch sampler, so epochs and sharding carry on."""
    settings: dict[str, Any] = {name: getattr(loader, name, default) for name, default in DATALOADER_DEFAULTS.items()}
    settings.update(dataset=loader.dataset, shuffle=None)
    if loader.batch_size is None and loader.batch_sampler is not None:  # the user's own batch sampler
        settings.update(batch_size=1, drop_last=False, sampler=None)
    else:
        settings["batch_sampler"] = None
        if isinstance(loader.dataset, IterableDataset):
            settings["sampler"] = None
    return settings


def merge_settings(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a loader's settings) with the options ``given`` to NumaLoader: a new
    sampler, shuffle or batch sampler replaces how ``base`` batched, as in DataLoader's
    own call (Lightning injects a DistributedSampler as ``sampler=``, ``shuffle=False``,
    ``batch_sampler=None``)."""
    merged = {**base, **given}
    # shuffle=False: not the RandomSampler DataLoader made for the loader's shuffle=True either
    unshuffled = given.get("shuffle") is False and type(base["sampler"]) is RandomSampler
    if (given.get("shuffle") or unshuffled) and "sampler" not in given:
        merged["sampler"] = None
    if given.get("batch_sampler") is not None:
        for name in ("batch_size", "shuffle", "sampler", "drop_last"):
            if name not in given:
                merged[name] = DATALOADER_DEFAULTS[name]
    batched = base["batch_size"] is not None or base["batch_sampler"] is not None
    collate_fn = base["collate_fn"]
    own = collate_fn.collate_fn if isinstance(collate_fn, SlotCollate) else collate_fn  # a NumaLoader's: the user's
    if "collate_fn" not in given and own is (default_collate if batched else default_convert) and (
        batched != (merged["batch_size"] is not None or merged["batch_sampler"] is not None)
    ):
        merged["collate_fn"] = None  # DataLoader's own for the loader's batching: its own for the new batching
    if merged["num_workers"] == 0:  # DataLoader refuses these without workers
        for name in ("prefetch_factor", "persistent_workers", "multiprocessing_context"):
            if name not in given:
                merged[name] = DATALOADER_DEFAULTS[name]
    return merged


def settings_loader(loader: DataLoader[Any]) -> DataLoader[Any]:
    """The loader whose settings make the workers: ``loader``, or the one it wraps."""
    inner = vars(loader).get("base_dataloader")
    return settings_loader(inner) if isinstance(inner, DataLoader) else loader


def iterates_itself(loader: DataLoader[Any]) -> bool:
    """Whether ``loader`` iterates as DataLoader does, over its own settings (so a
    NumaLoader built from them yields what it yields)."""
    if isinstance(loader, NumaLoader):
        return loader._through is None
    kind = type(loader)
    return (
        settings_loader(loader) is loader
        and kind.__iter__ is DataLoader.__iter__
        and getattr(kind, LOADER_GET_ITERATOR) is getattr(DataLoader, LOADER_GET_ITERATOR)
        and kind.__len__ is DataLoader.__len__
    )


class NumaLoader(DataLoader[T_co]):
    """A DataLoader whose workers run on ``node`` and whose batches come out page-locked
    there (with a CUDA ``device``: already on it, copied ``prefetch`` batches ahead on
    a side stream).

    ``NumaLoader(loader)`` takes a DataLoader's settings (options given too replace
    them, as a framework re-creating it passes them); ``NumaLoader(dataset, ...)`` is
    built as a DataLoader is. A loader with an iteration of its own (Accelerate's
    prepared loaders) is iterated as it is, numafast's collate function on the loader
    that makes its workers. ``pin_memory=True`` is accepted and turned off: numafast
    pins, and torch's pin thread would only copy each batch again.

    ``node`` defaults to the device's node, else that of this rank's GPU where CUDA is
    usable, else the calling thread's. Neither building nor pickling a loader
    initialises CUDA: the current device is read at the first iteration. ``slots``
    per pinned pool defaults to ``prefetch_factor`` x ``num_workers`` (+ ``prefetch``
    with a device) + 2, the batch being filled and the one the consumer holds (fewer,
    said once, where the pinned memory allowed does not hold them); a consumer that keeps
    more gets another pool, released once it lets them go.
    ``strict`` binds the workers' memory to the node instead of preferring it (and
    raises where the kernel refuses memory policies, as a container without
    CAP_SYS_NICE does; otherwise the loader runs unplaced there and says so once);
    ``lock`` is the pools' :class:`~numafast.LockMode`; a gone loader's pools are
    taken over by the next on its node. ``max_pinned_bytes`` bounds this process's
    loader pools together (default: a quarter of the node's memory); past it, batches
    arrive unpinned, counted in ``stats().unpinned`` and warned about once.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: Any = FROM_LOADER,
        shuffle: Any = FROM_LOADER,
        sampler: Any = FROM_LOADER,
        batch_sampler: Any = FROM_LOADER,
        num_workers: Any = FROM_LOADER,
        collate_fn: Any = FROM_LOADER,
        pin_memory: Any = FROM_LOADER,
        drop_last: Any = FROM_LOADER,
        timeout: Any = FROM_LOADER,
        worker_init_fn: Any = FROM_LOADER,
        multiprocessing_context: Any = FROM_LOADER,
        generator: Any = FROM_LOADER,
        *,
        prefetch_factor: Any = FROM_LOADER,
        persistent_workers: Any = FROM_LOADER,
        pin_memory_device: Any = FROM_LOADER,
        in_order: Any = FROM_LOADER,
        device: object = None,
        node: int | None = None,
        slots: int | None = None,
        prefetch: int = 2,
        strict: bool = False,
        lock: str | bool = "auto",
        max_pinned_bytes: int | None = None,
    ) -> None:
        options = {
            "batch_size": batch_size, "shuffle": shuffle, "sampler": sampler, "batch_sampler": batch_sampler,
            "num_workers": num_workers, "collate_fn": collate_fn, "pin_memory": pin_memory, "drop_last": drop_last,
            "timeout": timeout, "worker_init_fn": worker_init_fn, "multiprocessing_context": multiprocessing_context,
            "generator": generator, "prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers,
            "pin_memory_device": pin_memory_device, "in_order": in_order,
        }  # fmt: skip
        given = {name: value for name, value in options.items() if value is not FROM_LOADER}
        through: DataLoader[Any] | None = None
        if isinstance(dataset, NumaLoader) and dataset._through is not None:
            dataset = dataset._through  # NumaLoader(NumaLoader(prepared)) is NumaLoader(prepared)
        if isinstance(dataset, DataLoader):
            if not iterates_itself(dataset):
                if given:
                    raise ValueError(
                        f"NumaLoader iterates this {type(dataset).__name__} as it is and cannot change its "
                        f"{', '.join(sorted(given))}: pass them to the loader it wraps, or wrap that loader"
                    )
                through = dataset
            base = settings_of(settings_loader(dataset))
        elif hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__") and not isinstance(dataset, IterableDataset):
            raise TypeError(
                f"NumaLoader takes a torch.utils.data.DataLoader or a dataset, not a {type(dataset).__name__}"
            )
        else:
            base = {**DATALOADER_DEFAULTS, "dataset": dataset}
        settings = merge_settings(base, given)
        _hint(settings, batched=isinstance(dataset, DataLoader) or {"batch_size", "batch_sampler"} & given.keys())
        # All before DataLoader.__init__, which sets collate_fn through __setattr__.
        self.prefetch: int = positive_int(prefetch, "prefetch")
        self.slots: int | None = None if slots is None else positive_int(slots, "slots", or_none=True)
        self.max_pinned_bytes: int | None = check_max_pinned_bytes(max_pinned_bytes)
        self.device: torch.device | None = resolve_device(device)
        self._asked = (self.device, node is None)  # the device, and whether the node is ours to guess
        self._node_guessed = False
        if node is None:
            node, self._node_guessed = landing_node(self.device)
        self.node: int = check_node(node)
        self.strict: bool = check_bool("strict", strict)
        self.lock: str | bool = lock
        workers = settings["num_workers"]
        self._in_flight = (settings["prefetch_factor"] or 2) * workers if workers else 0
        self._in_flight += self.prefetch if self.device is not None else 0
        self._wanted_slots = self.slots or self._in_flight + 2
        self._take_pools(_shared_pools(settings["collate_fn"], self.node, lock))
        self._first_iteration_done = False
        self._through: DataLoader[Any] | None = through
        super().__init__(settings.pop("dataset"), **settings)
        _travel_with_lightnings_arguments(self)
        if through is not None:
            inner = settings_loader(through)
            for name in _BATCHING:  # the very objects the loader iterated through uses (past the frozen check)
                object.__setattr__(self, name, getattr(inner, name, None))
            inner.collate_fn = self.collate_fn
            inner.pin_memory = False

    def __setattr__(self, name: str, value: Any) -> None:
        # numafast's part of the settings stays numafast's, whatever is set later.
        if name == "collate_fn" and not _lands_in(value, self.pools, self.strict):
            own = value.collate_fn if isinstance(value, SlotCollate) else value
            value = SlotCollate(own, self.pools, bind_workers=True, strict=self.strict)
        elif name == "pin_memory":
            value = False
        super().__setattr__(name, value)

    def __getstate__(self) -> dict[str, Any]:
        # The pools (locks, threads, this process's mappings) stay with this loader; a copy makes its own.
        return {**vars(self), "pools": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._first_iteration_done = False  # its pools' device is settled at its first iteration
        self._take_pools()
        self.collate_fn = self.collate_fn  # __setattr__ wraps the user's again, over the new pools
        if self._through is not None:
            settings_loader(self._through).collate_fn = self.collate_fn
        _travel_with_lightnings_arguments(self)

    def __getattr__(self, name: str) -> Any:
        # Only for what a DataLoader lacks: the attributes of the loader iterated through
        # (Accelerate's set_epoch, end_of_dataloader, ...).
        through = vars(self).get("_through")
        if through is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(through, name)

    def __len__(self) -> int:
        return len(self._through) if self._through is not None else super().__len__()

    def _before_first_iteration(self) -> None:
        """In the iterating thread before the first workers start (the rank's device is
        picked by now): check the locking limit, settle the CUDA device and a guessed node."""
        if self._first_iteration_done:
            return
        if self.pools.lock is LockMode.REQUIRED:
            # Pools grow with the batches and when the consumer keeps them, so any finite
            # RLIMIT_MEMLOCK can be met mid-epoch, inside a batch: refused here instead.
            room = memlock_room()
            if room is not None:
                raise MemlockError(
                    f"lock='required', but this process may page-lock only {room // 1024} KiB more (RLIMIT_MEMLOCK, "
                    f"without CAP_IPC_LOCK), and a loader's pools grow with its batches: raise the limit "
                    f"({MEMLOCK_FIX}), or pass lock='best-effort' to lock where the kernel allows and go on "
                    "unlocked, with one warning, where it does not (lock='auto' does so where a GPU is usable)"
                )
        index = iteration_gpu(self.device)
        if index is not None:
            if self._node_guessed:
                self._land_on(gpu_node(index, required=self.device is not None))
            if self.device is not None:
                self.device = torch.device("cuda", index)
            self.pools.device = index
        self._first_iteration_done = True

    def _take_pools(self, shared: NodePools | None = None) -> None:
        """Land on ``shared`` pools, else on the node's (:func:`node_pools`), putting this loader's
        in-flight batches and max_pinned_bytes on them. Shared pools are those of the loader
        this one is a framework's copy of, iterated in its place: the most of either's."""
        if shared is None:
            self.pools: NodePools = node_pools(self.node, self._wanted_slots, self._in_flight, lock=self.lock,
                                               max_pinned_bytes=self.max_pinned_bytes)  # fmt: skip
            return
        self.pools = shared
        shared.slots = max(shared.slots, self._wanted_slots)  # the pools it makes from now on keep the copy's batches too
        shared.in_flight = max(shared.in_flight, self._in_flight)
        if self.max_pinned_bytes is not None:
            shared.max_pinned_bytes = self.max_pinned_bytes

    def _land_on(self, node: int) -> None:
        """Move, before any worker started, from the guessed node to ``node``: its pools and
        numafast's collate function over them."""
        self._node_guessed = False
        if node == self.node:
            return
        self.node = check_node(node)
        self._take_pools()
        self.collate_fn = self.collate_fn  # __setattr__ wraps the user's again, over the new pools
        if self._through is not None:
            settings_loader(self._through).collate_fn = self.collate_fn

    def _own_pools(self) -> None:
        """In a process forked from the one whose pools this loader lands in (Lightning's
        ``ddp_fork``, a notebook launcher): pools of this process's own, on the node and
        device it settles anew, before any worker of its forks. The parent's are left
        alone: its workers' slots, its mutexes (maybe held by a thread at the fork), its
        idle pools; so is a persistent iterator inherited from it, whose workers are the
        parent's (see :func:`numafast._process._forked`)."""
        setattr(self, LOADER_ITERATOR, None)
        self.device, self._node_guessed = self._asked
        if self._node_guessed:
            self.node = landing_node(self.device)[0]
        self._first_iteration_done = False
        inherited, mine = self.pools, owner_process_pools.replacing.get(self.pools)
        if mine is None or mine.closed or mine.node != self.node:
            self._take_pools()
            owner_process_pools.replacing[inherited] = self.pools
        else:  # a framework's copy of this loader, or the loader it copies, came first
            self._take_pools(cast("NodePools", mine))
        self.collate_fn = self.collate_fn  # __setattr__ wraps the user's again, over the new pools
        if self._through is not None:
            settings_loader(self._through).collate_fn = self.collate_fn

    def __iter__(self) -> Any:
        if self.pools.owner_pid != _process.pid:
            self._own_pools()
        self._before_first_iteration()
        if refused := memory_placement_refused():  # a container's seccomp profile, a kernel without NUMA
            warn_unplaced([self.node], refused, stacklevel=_user_level())
        self.pools.user_thread = threading.current_thread()  # see the NOTE atop owner_pools
        self.pools.shrink()  # pools grown for the batches a consumer kept, free again since
        if self._through is not None:
            batches: Iterator[Any] = _through_batches(self, iter(self._through))
        elif self.persistent_workers and getattr(self, LOADER_ITERATOR) is not None:
            batches = super().__iter__()  # the same workers, another epoch: nothing forks
        else:
            # The workers fork here, inside the node's scope: they start on its CPUs with
            # its memory policy (the calling thread gets its own back on leaving). One
            # that never starts (stuck in the fork) is forked again there. The watch keeps
            # that scope while a worker is pending: the node and strictness, not the loader.
            fork_scope = functools.partial(numa_local_if_permitted, self.node, strict=self.strict)
            with fork_scope():
                batches = watch_starts(super().__iter__, fork_scope)
            owner_process_pools.iterators.add(batches)
        return batches if self.device is None else _OnDeviceIterator(self, batches)

    def stats(self) -> LoaderStats:
        """How the batches arrived, and the counters of the pinned pools in use (in a forked
        child not iterated yet: nothing arrived)."""
        if self.pools.owner_pid != _process.pid:
            self._own_pools()
        return self.pools.stats()

    def __repr__(self) -> str:
        target = str(self.device) if self.device is not None else "host"
        return f"<NumaLoader node {self.node} -> {target}, prefetch {self.prefetch}, {len(self.pools.pools)} pools>"


def _hint(settings: dict[str, Any], *, batched: object) -> None:
    """One LoaderHint per kind and process, at the user's line, where numafast can do
    little: ``NumaLoader(dataset)`` with no batch size given (not ``batched``) makes
    batches of one sample, as ``DataLoader(dataset)`` does; ``num_workers=0`` leaves no
    workers to place, and the main process collates every batch itself."""
    workers = settings["num_workers"]
    if not batched and settings["batch_size"] == 1:
        kind, text = "batch_size", (
            "NumaLoader(dataset) without batch_size makes batches of 1 sample, as DataLoader(dataset) does"
            + (", with no worker processes" if not workers else "")
            + ": numafast's speed-up comes from workers collating whole batches into node-local slots. Pass "
            "batch_size=... and num_workers=... (2 or more), as to a DataLoader"
        )
    elif not workers:
        kind, text = "num_workers", (
            "num_workers=0: the main process loads and collates every batch itself, so there are no workers to "
            "place on the node and nothing runs beside the training loop. Pass num_workers=2 or more for "
            "numafast's speed-up"
        )
    else:
        return
    if _process.first_time(f"LoaderHint {kind}"):
        warnings.warn(text + " (said once)", LoaderHint, stacklevel=_user_level())


def _lands_in(value: Any, pools: NodePools, strict: bool) -> bool:
    """``value`` is numafast's collate into ``pools``, placing workers as asked."""
    return isinstance(value, SlotCollate) and value.pools is pools and (value.node, value.strict) == (pools.node, strict)


def _shared_pools(collate_fn: Any, node: int, lock: str | bool) -> NodePools | None:
    """The pools (on ``node``, locked alike) of the loader this one re-creates, found by
    what a framework copies from it: its collate function. Never by a shared dataset: a
    train and an eval loader over one dataset are two loaders, each counting its own."""
    pools = collate_fn.pools if isinstance(collate_fn, SlotCollate) else None
    if pools is not None and pools.node == node and pools.lock is parse_mode(lock, LockMode, "lock"):
        return pools
    return None



def _travel_with_lightnings_arguments(loader: NumaLoader[Any]) -> None:
    """Put ``loader``'s collate function among the arguments Lightning saved for it (when
    it made it in a hook), so that the loader Lightning makes again from them lands in the
    same pools and the user's loader counts its batches: the copy is found by what
    travels with it, never by sharing a dataset with it."""
    args, kwargs, names = (vars(loader).get(name) for name in LIGHTNING_SAVED_ARGUMENTS)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not isinstance(names, tuple):
        return
    if "collate_fn" in names:
        position = names.index("collate_fn")
        object.__setattr__(loader, LIGHTNING_SAVED_ARGUMENTS[0],
                           (*args[:position], loader.collate_fn, *args[position + 1 :]))  # fmt: skip
    else:
        kwargs["collate_fn"] = loader.collate_fn


def _through_batches(owner: NumaLoader[Any], iterator: Iterator[Any]) -> Iterator[Any]:
    """The batches of a loader iterated through, its first ``next()`` (which starts its
    workers) inside the node's scope. A batch beyond those the pools received came past
    numafast's collate: it is copied into a slot, counted and warned about once.
    Counted, not judged by its memory: such a loader may move batches itself and read
    ahead, as Accelerate's does."""
    pools = owner.pools
    bypassed = (
        f"the batches of this {type(owner._through).__name__} do not come from numafast's collate function (its "
        "workers' settings are not where numafast put them); wrap the DataLoader it was made from instead, e.g. "
        "accelerator.prepare(NumaLoader(loader))"
    )
    start = pools.received()
    with numa_local_if_permitted(owner.node, strict=owner.strict):
        try:
            first = next(iterator)
        except StopIteration:
            return
    for yielded, batch in enumerate(itertools.chain((first,), iterator), start=1):
        if pools.received() - start < yielded:
            batch = pools.copy_bypassed(batch, bypassed)
        yield batch


def loader_stats(loader: object) -> LoaderStats | None:
    """The :class:`LoaderStats` of the numafast pools behind ``loader`` (a NumaLoader, a
    DataLoader a framework made from one, or a wrapper around either), or None (in a
    forked child, for a DataLoader over pools of the parent's that no NumaLoader of the
    child replaced: its batches are collated as torch does)."""
    seen: set[int] = set()
    pending = [loader]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, NumaLoader):
            return current.stats()  # in a forked child, its own pools (see _own_pools)
        attributes = vars(current) if hasattr(current, "__dict__") else {}
        collate = attributes.get("collate_fn")
        if isinstance(collate, SlotCollate) and collate.pools is not None:
            pools: object = collate.pools
            if collate.pools.owner_pid != _process.pid:  # a forked child's copy: the pools that replace them here
                pools = owner_process_pools.replacing.get(collate.pools)
            return None if pools is None else cast("NodePools", pools).stats()
        pending.extend(attributes[name] for name in _INNER_LOADER_ATTRIBUTES if attributes.get(name) is not None)
    return None


@dataclass
class _OnDevice:
    """A batch whose copies to the device are queued on the side stream."""

    copies: list[torch.Tensor]
    ready: Any
    rebuild: Callable[[list[torch.Tensor]], Any]


class _OnDeviceIterator:
    """One pass over a NumaLoader with a CUDA device: the host ``batches``, each copied on
    a side stream ``prefetch`` batches ahead by the thread that iterates."""

    def __init__(self, owner: NumaLoader[Any], batches: Iterator[Any]) -> None:
        assert owner.device is not None
        self._owner = owner
        self._inner: Iterator[Any] | None = batches
        self._copier = cuda.CopyStream(owner.device)
        self._ahead: deque[_OnDevice | Exception] = deque()  # an Exception: the loader raised it at that batch
        self._exhausted = False

    def __iter__(self) -> _OnDeviceIterator:
        return self

    def __len__(self) -> int:
        return len(self._owner)

    def __getattr__(self, name: str) -> Any:
        # The DataLoader iterator's own attributes (_workers, _num_yielded, ...) read through.
        inner = vars(self).get("_inner")
        if inner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    def __next__(self) -> Any:
        self._queue_copies()
        if not self._ahead:
            self.close()
            raise StopIteration
        item = self._ahead.popleft()
        if isinstance(item, Exception):
            raise item
        cuda.hand_over(item.copies, item.ready)
        return item.rebuild(item.copies)

    def _queue_copies(self) -> None:
        """Keep the copies of the next ``prefetch`` batches queued on the side stream;
        stop at an error, which the consumer meets at its own batch."""
        if self._ahead and isinstance(self._ahead[-1], Exception):
            return
        while self._inner is not None and not self._exhausted and len(self._ahead) <= self._owner.prefetch:
            try:
                pinned = next(self._inner)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as error:  # the dataset's own exception, in its place
                self._ahead.append(error)
                return
            tensors, rebuild = flatten(pinned)
            copies, ready = self._copier.to_device(tensors)
            # The slots come back as `pinned` goes; they are reused once the side stream is done.
            record_stream(tensors, self._copier.stream)
            self._ahead.append(_OnDevice(copies, ready, rebuild))

    def close(self) -> None:
        """Stop now, as dropping this iterator does: drop the DataLoader's iterator (which
        shuts its workers down) and the queued copies."""
        self._inner = None
        self._ahead.clear()
