"""The machine summary of a bench run, and the last-level cache sizes its buffer rules need."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from numafast._buffers import PAGE_SIZE
from numafast.memory import THP_ENABLED_FILE, _thp_size
from numafast.topo import Topology
from numafast.topo.cpus import last_level_cache_dir
from numafast.topo.files import read_text

SIZE_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def cache_size(text: str | None) -> int | None:
    """sysfs's cache ``size`` ('32768K', '1M') in bytes; None when unreadable."""
    if not text:
        return None
    scale = SIZE_SUFFIXES.get(text[-1].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    return int(digits) * scale if digits.isdigit() else None


def last_level_cache(cpu: int, root: Path = Path("/")) -> tuple[tuple[int, ...], int] | None:
    """(CPUs sharing it, bytes) of ``cpu``'s last-level cache, as the topology finds it;
    None when sysfs does not give its size."""
    found = last_level_cache_dir(root, cpu)
    if found is None:
        return None
    index, shared = found
    size = cache_size(read_text(index / "size"))
    return (tuple(shared), size) if size else None


def node_llc_bytes(cpus: tuple[int, ...]) -> int | None:
    """The bytes of all distinct last-level caches of a node's CPUs (an EPYC node has
    several L3s); None when sysfs does not say (0 for a CPU-less node)."""
    caches: dict[tuple[int, ...], int] = {}
    for cpu in cpus:
        cache = last_level_cache(cpu)
        if cache is None:
            return None
        caches[cache[0]] = cache[1]
    return sum(caches.values())


def cpu_model() -> str:
    for line in (read_text(Path("/proc/cpuinfo")) or "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "Model name", "cpu model"):
            return value.strip()
    return platform.machine()


def describe(machine: Topology) -> dict[str, Any]:
    """The ``machine`` object of the JSON schema (see result.py)."""
    thp_mode = read_text(THP_ENABLED_FILE) or "unavailable"
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpu_model": cpu_model(),
        "page_size": PAGE_SIZE,
        "thp": thp_mode.partition("[")[2].partition("]")[0] or thp_mode,
        "thp_size": _thp_size(),
        "allowed_cpus": sorted(machine.allowed_cpus),
        "allowed_nodes": sorted(machine.allowed_nodes),
        "nodes": [
            {"id": node.id, "cpus": list(node.cpus), "memory_bytes": node.mem_total, "llc_bytes": node_llc_bytes(node.cpus)}
            for node in machine.nodes
        ],
        "distances": [[machine.distance(a, b) for b in machine.node_ids] for a in machine.node_ids],
        "gpus": [{"index": gpu.index, "address": gpu.address, "node": gpu.node} for gpu in machine.gpus],
    }


def largest_llc(summary: dict[str, Any], nodes: list[int]) -> int | None:
    """The largest node LLC among ``nodes`` (the caches one cell's threads can use);
    None when a node's is unknown."""
    sizes: list[int | None] = [n["llc_bytes"] for n in summary["nodes"] if n["id"] in nodes and n["cpus"]]
    known = [size for size in sizes if size is not None]
    return max(known) if known and len(known) == len(sizes) else None

