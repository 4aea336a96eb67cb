"""Which CUDA device a loader serves, and so the NUMA node its batches land on.

CUDA keeps the current device per thread, and torch initialises CUDA the first
time anything asks for it. Scripts usually build their loaders before they call
``torch.cuda.set_device(local_rank)``. So a loader settles at construction only what
it can know without initialising CUDA, and asks for the current device at its first
iteration, in the thread that iterates, never in a helper thread (whose current
device is 0).
"""

from __future__ import annotations

import contextlib
import numbers

import torch

from numafast import cuda
from numafast.affinity.apply import local_rank_from_environment
from numafast.errors import CudaUnavailable, InvalidGpuError, LocalRankError
from numafast.pages import local_node
from numafast.pool import check_visible
from numafast.topo import topology

__all__ = ["gpu_node", "iteration_gpu", "landing_node", "resolve_device", "settled_gpu"]


def resolve_device(device: object) -> torch.device | None:
    """None for host batches (``None`` or ``"cpu"``), else the CUDA device with its index
    as given (``"cuda"`` stays the current device, read at first iteration). Asks
    nothing that initialises CUDA."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, numbers.Integral, torch.device)):
        raise TypeError(f"device {device!r}: give a CUDA device ('cuda:0', 0, torch.device) or None")
    try:
        resolved = torch.device(f"cuda:{int(device)}" if isinstance(device, numbers.Integral) else device)
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
    if resolved.index is not None:
        check_visible(resolved.index, cuda.device_count(), f"device {device!r}")
    return resolved


def settled_gpu(device: torch.device | None) -> int | None:
    """The CUDA device of a loader with ``device`` (None: this rank's GPU) where it is
    known without initialising CUDA: the index given, else the local rank naming a
    visible device, else the only visible device; else None."""
    if device is not None and device.index is not None:
        return device.index
    if not cuda.usable():
        return None
    count = cuda.device_count()
    if device is None:  # not for 'cuda': that means the current device, not the rank's
        with contextlib.suppress(LocalRankError):  # no launcher's local rank
            local_rank = local_rank_from_environment()[0]
            if local_rank < count:
                return local_rank
    return 0 if count == 1 else None


def iteration_gpu(device: torch.device | None) -> int | None:
    """At first iteration, in the iterating thread: the loader's CUDA device (the current
    one where it is not settled); None where CUDA is not usable."""
    settled = settled_gpu(device)
    if settled is not None or not cuda.usable():
        return settled
    return cuda.current_index()


def gpu_node(index: int, *, required: bool = True) -> int:
    """The NUMA node of CUDA device ``index`` (its PCI root's node), from the topology.
    Where firmware does not say: InvalidGpuError when ``required``, else the calling
    thread's node."""
    try:
        node = topology().node_of_gpu(index)
    except InvalidGpuError:  # CUDA sees a device the topology does not list (a container's sysfs)
        if required:
            raise
        node = None
    if node is not None:
        return node
    if required:
        raise InvalidGpuError(f"the NUMA node of cuda:{index} is unknown (firmware did not say); pass node=")
    return local_node()


def landing_node(device: torch.device | None) -> tuple[int, bool]:
    """Where a loader without ``node=`` lands, and whether that is a guess until its first
    iteration: its device's node where CUDA is usable, else the calling thread's
    node. A guess takes the current device as of now (0 while CUDA is uninitialised)."""
    index = settled_gpu(device)
    if index is not None:
        return gpu_node(index, required=device is not None), False
    if not cuda.usable():
        return local_node(), False
    return gpu_node(cuda.current_index() if cuda.initialized() else 0, required=False), True
