"""NUMA nodes from ``sys/devices/system/node``: CPUs, memory and distances."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from numafast.topo.files import read_id_set, read_int_row, read_meminfo, subdirs, warn
from numafast.topo.model import LOCAL_DISTANCE, REMOTE_DISTANCE, Node

NODE_DIR = Path("sys/devices/system/node")
PROC_MEMINFO = Path("proc/meminfo")


def node_memory(meminfo: dict[str, int] | None) -> tuple[int | None, int | None]:
    """(MemTotal, MemFree) in bytes from a parsed meminfo; None where unknown."""
    if meminfo is None:
        return None, None
    return meminfo.get("MemTotal"), meminfo.get("MemFree")


def distance_map(path: Path, node_id: int, node_ids: list[int]) -> dict[int, int]:
    """A node's ``distance`` row as {node: distance}.

    The kernel writes one number per online node in id order, so sparse ids
    (0,1,4,5) map by position. A missing or short row falls back to what the
    kernel itself reports without a SLIT: 10 to itself, 20 to every other node.
    """
    row = read_int_row(path)
    if row is not None and len(row) == len(node_ids):
        return dict(zip(node_ids, row, strict=True))
    if row is not None or len(node_ids) > 1:
        got = "missing" if row is None else f"{len(row)} numbers for {len(node_ids)} nodes"
        warn(f"{path}: {got}; distances taken as {LOCAL_DISTANCE} local, {REMOTE_DISTANCE} remote")
    return {other: LOCAL_DISTANCE if other == node_id else REMOTE_DISTANCE for other in node_ids}


def read_nodes(root: Path, online_cpus: list[int]) -> list[Node]:
    """Every node the kernel shows, its online CPUs (``cpulist``, or the ``cpumap`` mask),
    memory and distances.

    Node ids may be sparse (0,1,4,5 or 250-255). CPU-less nodes (HBM, CXL, GPU
    memory) have no CPUs, memory-less nodes a MemTotal of 0. A kernel built
    without NUMA has no node directory: then the machine is one node 0 holding
    every online CPU and all of ``/proc/meminfo``'s memory.
    """
    node_dirs = subdirs(root / NODE_DIR, "node")
    if not node_dirs:
        total, free = node_memory(read_meminfo(root / PROC_MEMINFO))
        distances = MappingProxyType({0: LOCAL_DISTANCE})
        return [Node(0, tuple(online_cpus), total, free, distances)]
    online = set(online_cpus)
    node_ids = [node_id for node_id, _ in node_dirs]
    nodes: list[Node] = []
    for node_id, path in node_dirs:
        cpus = tuple(sorted(online.intersection(read_id_set(path / "cpulist", path / "cpumap") or ())))
        meminfo = read_meminfo(path / "meminfo")
        if meminfo is None:
            warn(f"{path / 'meminfo'}: missing; memory of node {node_id} unknown")
        total, free = node_memory(meminfo)
        distances = MappingProxyType(distance_map(path / "distance", node_id, node_ids))
        nodes.append(Node(node_id, cpus, total, free, distances))
    return nodes
