"""Putting a topology together: from a snapshot's files, or live (cached)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from numafast.topo.allowed import live_allowed, snapshot_allowed
from numafast.topo.cpus import online_cpus, read_cpus
from numafast.topo.cuda import driver_memory_nodes, driver_uuids, nvml_uuids, torch_uuids, visible_gpus
from numafast.topo.model import Topology, register_sysfs_reader
from numafast.topo.nodes import read_nodes
from numafast.topo.pci import read_pci


def read_topology(
    root: str | os.PathLike[str],
    *,
    cuda_visible_devices: str | None = None,
    ask_gpu_libraries: bool = False,
    live: bool = False,
) -> Topology:
    """Everything under ``root`` (``sys/`` and ``proc/``) as a :class:`Topology`.

    ``live`` takes the allowed sets from the calling thread (sched_getaffinity)
    instead of the files.
    """
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a str or os.PathLike (a directory holding sys/ and proc/), not {root!r}")
    if cuda_visible_devices is not None and not isinstance(cuda_visible_devices, str):
        raise TypeError(
            f"cuda_visible_devices must be a str as CUDA_VISIBLE_DEVICES holds ('0,1', 'GPU-...') or None, "
            f"not {cuda_visible_devices!r}"
        )
    base = Path(root)
    if not (base / "sys").is_dir():
        raise FileNotFoundError(f"{base / 'sys'} is not a directory: {base} holds no copy of a machine's sys/")
    online = online_cpus(base)
    nodes = read_nodes(base, online)
    node_of = {cpu: node.id for node in nodes for cpu in node.cpus}
    cpus = read_cpus(base, online, node_of)
    pci = read_pci(base, nodes)
    uuids = driver_uuids(base)
    uuid_sources = f"looked in {base / 'proc/driver/nvidia/gpus'}/*/information"
    if ask_gpu_libraries and cuda_visible_devices and not uuids:
        uuids = nvml_uuids() or torch_uuids()
        uuid_sources += "; NVML (nvidia-ml-py) and torch.cuda named none (missing or no driver)"
    elif cuda_visible_devices:
        uuid_sources += "; NVML and torch are not asked about a snapshot"
    memory_nodes = driver_memory_nodes(base, [node.id for node in nodes])
    gpus = visible_gpus(pci, cuda_visible_devices, uuids, uuid_sources, memory_nodes)
    allowed_cpus, allowed_nodes = live_allowed(nodes) if live else snapshot_allowed(base, nodes, online)
    return Topology(
        nodes=tuple(nodes),
        cpus=tuple(cpus),
        pci=tuple(pci),
        gpus=tuple(gpus),
        allowed_cpus=tuple(allowed_cpus),
        allowed_nodes=tuple(allowed_nodes),
    )


register_sysfs_reader(read_topology)

_live: Topology | None = None
_live_lock = threading.Lock()


def topology(*, refresh: bool = False) -> Topology:
    """This machine's topology as this process sees it; read once, then cached.

    The process's own view is added to what ``/sys`` says: its CPU affinity and
    Mems_allowed, and ``CUDA_VISIBLE_DEVICES`` for the CUDA device order (NVML or
    torch name GPU UUIDs when the driver's proc files do not). Free memory and
    the allowed sets are as of the read: pass ``refresh=True`` to read again,
    e.g. after changing affinity or CUDA_VISIBLE_DEVICES.
    """
    global _live
    with _live_lock:
        if _live is None or refresh:
            _live = read_topology(
                "/",
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                ask_gpu_libraries=True,
                live=True,
            )
        return _live
