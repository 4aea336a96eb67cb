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
import warnings

import torch

from numafast import cuda
from numafast.affinity.apply import local_rank_from_environment
from numafast.errors import CudaUnavailable, InvalidGpuError, LocalRankError
from numafast.pages import local_node
from numafast.pool import check_visible
from numafast.topo import topology

__all__ = ["gpu_node", "gpu_usable", "iteration_gpu", "landing_node", "parse_device", "resolve_device", "settled_gpu"]


def resolve_device(device: object) -> torch.device | None:
    """None for host batches (``None`` or ``"cpu"``), else the CUDA device with its index
    as given (``"cuda"`` stays the current device, read at first iteration). Asks
    nothing that initialises CUDA."""
    resolved = parse_device(device)
    if resolved is None:
        return None
    if not cuda.usable():
        raise CudaUnavailable(f"device {device!r}: {cuda.why_not_usable()}")
    if resolved.index is not None:
        check_visible(resolved.index, cuda.device_count(), f"device {device!r}")
    return resolved


def parse_device(device: object) -> torch.device | None:
    """:func:`resolve_device` without asking CUDA anything: what ``device`` names."""
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
        raise ValueError(f"device {device!r}: numafast copies to a CUDA device or yields host batches (None, 'cpu')")
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


def gpu_usable() -> bool:
    """Whether CUDA is usable here (asks nothing that initialises it)."""
    return cuda.usable()


def iteration_gpu(device: torch.device | None, *, stacklevel: int = 4) -> int | None:
    """At first iteration (or first batch), in the thread that iterates (receives): the
    loader's CUDA device; None where CUDA is not usable. The index given; else, once
    torch has initialised CUDA (the user picked a device, or used one), the current
    device, where copies with ``.to("cuda")`` go, warning when the launcher's
    LOCAL_RANK names another; else the device :func:`settled_gpu` names, else the
    current one. ``stacklevel`` points the warning at the user's line."""
    if device is not None and device.index is not None:
        return device.index
    if not cuda.usable():
        return None
    if cuda.initialized():
        current = cuda.current_index()
        rank_gpu = settled_gpu(None) if device is None and cuda.device_count() > 1 else None
        if rank_gpu is not None and rank_gpu != current:
            warnings.warn(
                f"LOCAL_RANK names cuda:{rank_gpu}, but this thread's current device is cuda:{current}: numafast's "
                f"pools follow the current device, where .to('cuda') copies go. If the rank should use "
                f"cuda:{rank_gpu}, call torch.cuda.set_device({rank_gpu}) before the first batch",
                RuntimeWarning, stacklevel=stacklevel,
            )
        return current
    settled = settled_gpu(device)
    return settled if settled is not None else cuda.current_index()


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
