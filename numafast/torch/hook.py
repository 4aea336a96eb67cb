"""pin_memory_hook: node-local pinning for loaders that keep ``DataLoader(pin_memory=True)``.

PyTorch's pin step calls ``pin_memory()`` on any batch object that has such a method:
its documented extension point for custom batch types. The hook wraps the loader's
collate function so that each batch reaches the main process as a :class:`NodeBatch`;
when the stock pin thread (``pt_data_pin``) calls ``NodeBatch.pin_memory()``, that
thread binds itself to the GPU's node (once) and copies the batch into a node-local,
page-locked pool, and hands on the batch itself: the consumer gets the same
structure as before, in pinned memory on the right node. No private torch function
is patched, so no torch version is special.

When to use which: the hook is one line and changes nothing else (the workers stay
where they are; each batch is still copied once by the stock thread); NumaLoader
also places the workers on the node and, with a CUDA device, overlaps the
host-to-device copy of the next batch with the compute on this one.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from numafast._validate import check_node
from numafast.binding import bind
from numafast.pool import PoolStats
from numafast.torch.loader import gpu_node, resolve_device
from numafast.torch.pools import NodePools

__all__ = ["NodeBatch", "PinMemoryHook", "pin_memory_hook"]

# The name PyTorch's pin thread gives itself (torch.utils.data._utils.pin_memory).
PIN_THREAD_NAME = "pt_data_pin"

_hooks: weakref.WeakValueDictionary[int, PinMemoryHook] = weakref.WeakValueDictionary()
_hook_ids = itertools.count(1)
_bound = threading.local()  # .node: the node this thread was bound to by a hook


@dataclass
class NodeBatch:
    """A collated batch on its way to PyTorch's pin step, which calls :meth:`pin_memory`."""

    data: Any
    hook_id: int

    def pin_memory(self, device: object = None) -> Any:
        """The batch copied into its hook's node-local pool (the stock pin step's call)."""
        hook = _hooks.get(self.hook_id)
        if hook is None:
            raise RuntimeError("the numafast pin_memory_hook that made this batch is gone (removed, or another process)")
        return hook.pin(self.data)


class _NodeCollate:
    """The loader's collate function, its result wrapped in a NodeBatch. Pickled into
    spawned workers without the hook, which only the main process uses."""

    def __init__(self, collate_fn: Callable[[Any], Any], hook: PinMemoryHook | None) -> None:
        self.collate_fn = collate_fn
        self.hook = hook
        self.hook_id = hook.hook_id if hook is not None else 0

    def __call__(self, samples: Any) -> NodeBatch:
        return NodeBatch(self.collate_fn(samples), self.hook_id)

    def __getstate__(self) -> dict[str, Any]:
        return {"collate_fn": self.collate_fn, "hook_id": self.hook_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.collate_fn, self.hook_id, self.hook = state["collate_fn"], state["hook_id"], None


class PinMemoryHook:
    """What :func:`pin_memory_hook` installed on a loader: ``installed`` says whether it
    acts (and ``reason`` why not), ``node`` where batches are pinned; :meth:`remove`
    puts the loader's own collate function back."""

    def __init__(self, loader: DataLoader[Any], node: int | None, device: torch.device | None, slots: int,
                 installed: bool, reason: str) -> None:
        self.hook_id = next(_hook_ids)
        self.loader = loader
        self.node = node
        self.device = device
        self.installed = installed
        self.reason = reason
        self.pools = NodePools(node, slots) if node is not None else None
        self._collate = loader.collate_fn
        if installed:
            _hooks[self.hook_id] = self
            loader.collate_fn = _NodeCollate(self._collate, self)

    def pin(self, data: Any) -> Any:
        """``data`` in a slot of this hook's pool; binds PyTorch's pin thread to the node first."""
        assert self.pools is not None and self.node is not None
        if getattr(_bound, "node", None) != self.node and _thread_name() == PIN_THREAD_NAME:
            bind(self.node)  # that thread only lives to pin: it stays on the node
            _bound.node = self.node
        return self.pools.pin(data)

    def remove(self) -> None:
        """Put the loader's collate function back (iterators already running keep the hook)."""
        if self.installed:
            self.loader.collate_fn = self._collate
            self.installed = False
            self.reason = "removed"

    def stats(self) -> list[PoolStats]:
        return self.pools.stats() if self.pools is not None else []

    def __repr__(self) -> str:
        state = f"pins on node {self.node}" if self.installed else f"not installed: {self.reason}"
        return f"<PinMemoryHook {state}>"


def pin_memory_hook(
    loader: DataLoader[Any], *, device: object = None, node: int | None = None, slots: int | None = None
) -> PinMemoryHook:
    """Make ``loader``'s stock pin thread bind itself to the GPU's node and pin into a
    node-local pool: one line after building a ``DataLoader(pin_memory=True)``.

    ``node`` defaults to the node of ``device`` (default: the current CUDA device).
    ``slots`` per pool defaults to the batches the loader keeps in flight
    (``prefetch_factor`` x ``num_workers``) plus two. Where PyTorch will not pin (no
    accelerator: the loader then hands batches on unpinned), nothing is installed
    and the returned hook says why; the loader behaves exactly as before.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"pin_memory_hook takes a torch.utils.data.DataLoader, not a {type(loader).__name__}")
    if not loader.pin_memory:
        raise ValueError("this DataLoader has pin_memory=False: use numafast.torch.NumaLoader(loader), "
                         "which pins itself, or build the loader with pin_memory=True")
    if isinstance(loader.collate_fn, _NodeCollate):
        raise ValueError("this DataLoader already has a numafast pin_memory_hook")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise ValueError(f"slots must be a positive integer or None, not {slots!r}")
    in_flight = (loader.prefetch_factor or 0) * loader.num_workers
    slots = slots or in_flight + 2
    why_not = _why_torch_will_not_pin()
    if why_not:
        return PinMemoryHook(loader, None, None, slots, False, why_not)
    resolved = resolve_device("cuda" if device is None else device)
    assert resolved is not None
    target = check_node(gpu_node(resolved) if node is None else node)
    return PinMemoryHook(loader, target, resolved, slots, True, "")


def _why_torch_will_not_pin() -> str:
    """Empty when a DataLoader with pin_memory=True pins here (torch.utils.data's own
    rule: an accelerator exists and it is not MPS), else why not."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:  # before torch 2.6 the rule was: CUDA is usable
        from numafast.torch import cuda

        return "" if cuda.usable() else "CUDA is not usable here, so DataLoader does not pin (pin_memory=True is ignored)"
    if not accelerator.is_available():
        return "PyTorch finds no accelerator here, so DataLoader does not pin (pin_memory=True is ignored)"
    kind = accelerator.current_accelerator().type
    if kind != "cuda":
        return f"the accelerator is {kind}: numafast pins for CUDA devices"
    return ""


def _thread_name() -> str:
    """The calling thread's kernel name (what PyTorch sets for its pin thread)."""
    try:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    except OSError:
        return ""
