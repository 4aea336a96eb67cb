"""``numafast show``: the nodes, CPUs, memory and distances this machine has."""

from __future__ import annotations

import argparse

from numafast import _libnuma, numa_available


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("show", help="print the NUMA topology")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not numa_available():
        print("NUMA is not available here (numa_available() < 0): no NUMA system calls.")
        return 0
    nodes = [n for n in range(_libnuma.max_node() + 1) if _node_exists(n)]
    print(f"available: {len(nodes)} nodes ({_ranges(nodes)})")
    for node in nodes:
        total, free = _libnuma.node_size64(node)
        cpus = _libnuma.node_to_cpus(node)
        print(f"node {node} cpus: {' '.join(map(str, cpus)) or '(none)'}")
        print(f"node {node} size: {total >> 20} MB  free: {free >> 20} MB")
    print("node distances:")
    print("node " + "".join(f"{n:>4}" for n in nodes))
    for a in nodes:
        print(f"{a:>4}:" + "".join(f"{_libnuma.distance(a, b):>4}" for b in nodes))
    return 0


def _node_exists(node: int) -> bool:
    try:
        _libnuma.node_size64(node)
    except OSError:
        return False
    return True


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5', as the kernel writes cpulists."""
    parts: list[str] = []
    for i in ids:
        if parts and i == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)
