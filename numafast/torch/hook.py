"""pin_memory_hook: node-local pinning for loaders that keep ``DataLoader(pin_memory=True)``.

The workers collate into a node-local, page-locked pool slot through numafast's
collate function; PyTorch's pin thread (``pt_data_pin``) binds itself to the GPU's
node at its first batch, and its ``pin_memory()`` finds every tensor pinned already
(the pools are registered with CUDA) and copies nothing. No private torch function is
patched. Unlike NumaLoader, the workers stay where they are and the host-to-device
copy is not overlapped.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader

from numafast._validate import check_node, positive_int
from numafast.binding import bind_if_permitted
from numafast.torch.device import gpu_node, iteration_gpu, parse_device, resolve_device
from numafast.torch.message import in_pin_thread
from numafast.torch.owner_pools import LoaderStats, node_pools
from numafast.torch.worker_collate import SlotCollate

__all__ = ["PinMemoryHook", "pin_memory_hook"]

_bound = threading.local()  # .node: the node this thread was bound to by a hook


class PinMemoryHook:
    """What :func:`pin_memory_hook` installed on a loader: ``installed`` says whether it
    acts (``reason``: why not), ``node`` where batches land."""

    def __init__(self, loader: DataLoader[Any], node: int | None, device: torch.device | None, slots: int,
                 installed: bool, reason: str) -> None:
        self.loader = loader
        self.node = node
        self.device = device
        self.installed = installed
        self.reason = reason
        self.pools = node_pools(node, slots, _batches_read_ahead(loader)) if node is not None and installed else None
        self._collate = loader.collate_fn
        if self.pools is not None and node is not None:
            if device is not None and device.index is not None:
                self.pools.device = device.index
            # Not a method of the hook: the pools would hold the hook, the hook the loader, the
            # loader the collate function whose end lets the pools go, and none would ever go.
            self.pools.before_receive = functools.partial(_bind_pin_thread, node)
            loader.collate_fn = SlotCollate(self._collate, self.pools)

    def remove(self) -> None:
        """Put the loader's collate function back (iterators already running keep the hook)."""
        if self.installed:
            self.loader.collate_fn = self._collate
            self.installed = False
            self.reason = "removed"

    def stats(self) -> LoaderStats | None:
        """How the batches arrived; None where nothing was installed."""
        return self.pools.stats() if self.pools is not None else None

    def __repr__(self) -> str:
        state = f"pins on node {self.node}" if self.installed else f"not installed: {self.reason}"
        return f"<PinMemoryHook {state}>"


def _bind_pin_thread(node: int) -> None:
    """Bind PyTorch's pin thread to ``node`` at its first batch: it only lives to pin."""
    if getattr(_bound, "node", None) != node and in_pin_thread():
        bind_if_permitted(node)
        _bound.node = node


def pin_memory_hook(
    loader: DataLoader[Any], *, device: object = None, node: int | None = None, slots: int | None = None
) -> PinMemoryHook:
    """Make ``loader``'s stock pin thread bind itself to the GPU's node and pin into a
    node-local pool. ``node`` defaults to the node of ``device`` (default: the current
    CUDA device); ``slots`` per pool to the batches the loader keeps in flight plus two.
    Where PyTorch will not pin, nothing is installed and the returned hook says why."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"pin_memory_hook takes a torch.utils.data.DataLoader, not a {type(loader).__name__}")
    if not loader.pin_memory:
        raise ValueError("this DataLoader has pin_memory=False: use numafast.torch.NumaLoader(loader), "
                         "which pins itself, or build the loader with pin_memory=True")
    if isinstance(loader.collate_fn, SlotCollate):
        raise ValueError("this DataLoader already has a numafast pin_memory_hook")
    slots = _batches_read_ahead(loader) + 2 if slots is None else positive_int(slots, "slots", or_none=True)
    checked = check_node(node) if node is not None else None  # a bad node or device is refused here too
    parse_device(device)
    why_not = _why_torch_will_not_pin()
    if why_not:
        warnings.warn(f"numafast.torch.pin_memory_hook installs nothing: {why_not}", RuntimeWarning, stacklevel=2)
        return PinMemoryHook(loader, checked, None, slots, False, why_not)
    # PyTorch's pin thread pins for the device current when iteration starts; the hook
    # is installed just before, so it reads that device now (initialising CUDA).
    index = iteration_gpu(resolve_device("cuda" if device is None else device))
    assert index is not None
    target = checked if checked is not None else check_node(gpu_node(index))
    return PinMemoryHook(loader, target, torch.device("cuda", index), slots, True, "")


def _batches_read_ahead(loader: DataLoader[Any]) -> int:
    """The batches ``loader`` may hold unread: ``prefetch_factor`` per worker."""
    return (loader.prefetch_factor or 0) * loader.num_workers


def _why_torch_will_not_pin() -> str:
    """Why a DataLoader with pin_memory=True does not pin here, or "" where it does
    (torch.utils.data's rule: an accelerator exists and it is not MPS)."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or not torch.accelerator.is_available():
        return "PyTorch finds no accelerator here, so DataLoader does not pin (pin_memory=True is ignored)"
    if accelerator.type != "cuda":
        return f"the accelerator is {accelerator.type}: numafast pins for CUDA devices"
    return ""

