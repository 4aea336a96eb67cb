"""Validation of node ids and CPU sets shared by every public call.

Each check raises an exception that names the bad value and the allowed ones, so
that a typo in a launcher script reads as such rather than as EINVAL.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from functools import cache

from numafast import _libnuma
from numafast.errors import InvalidCpuSetError, InvalidNodeError, NodeNotAllowedError

NODE_ONLINE = "/sys/devices/system/node/online"


def format_ids(ids: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5', the kernel's list format."""
    ranges: list[list[int]] = []
    for i in sorted(set(ids)):
        if ranges and i == ranges[-1][1] + 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or "(none)"


def parse_ids(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; tolerates the trailing newline and NUL bytes sysfs files may carry."""
    ids: list[int] = []
    for part in text.strip().strip("\x00").split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        ids.extend(range(int(first), int(last or first) + 1))
    return ids


@cache
def online_nodes() -> tuple[int, ...]:
    """Node ids the kernel has online (sparse ids are normal); (0,) without NUMA in sysfs.

    Cached: nodes come and go only with memory hotplug, which a training job does not see.
    """
    try:
        with open(NODE_ONLINE) as f:
            return tuple(parse_ids(f.read())) or (0,)
    except OSError:
        return (0,)


def allowed_nodes() -> list[int]:
    """Nodes this process may allocate on: its cpuset's mems (Mems_allowed), read afresh."""
    return _libnuma.get_mems_allowed()


def allowed_cpus() -> set[int]:
    """CPUs the calling thread may run on (sched_getaffinity), read afresh."""
    return os.sched_getaffinity(0)


def cpus_near(nodes: Iterable[int], allowed: set[int]) -> list[int]:
    """The allowed CPUs of ``nodes``; where those have none (CPU-less HBM, CXL or GPU
    memory nodes), the allowed CPUs of the nodes with some at the smallest
    numa_distance from any of them (all ties). Empty when no node has an allowed CPU."""
    nodes = list(nodes)

    def usable(node: int) -> list[int]:
        return [cpu for cpu in _libnuma.node_to_cpus(node) if cpu in allowed]

    if own := sorted(cpu for node in nodes for cpu in usable(node)):
        return own
    distance = {other: min(_libnuma.distance(n, other) for n in nodes) for other in online_nodes() if usable(other)}
    if not distance:
        return []
    nearest = min(distance.values())
    return sorted(cpu for other, d in distance.items() if d == nearest for cpu in usable(other))


def check_node(node: object, *, need_allowed: bool = True) -> int:
    """``node`` as an int, if it is an online node (and allowed, unless told otherwise)."""
    return check_nodes([node], need_allowed=need_allowed)[0]


def check_nodes(nodes: Iterable[object], *, need_allowed: bool = True) -> list[int]:
    """Sorted, de-duplicated node ids, each online and (by default) allowed by the cpuset."""
    checked: set[int] = set()
    online = online_nodes()
    for node in nodes:
        if isinstance(node, bool) or not isinstance(node, int):
            raise InvalidNodeError(f"node {node!r} is not an integer node id; nodes here: {format_ids(online)}")
        if node not in online:
            raise InvalidNodeError(f"node {node} does not exist; nodes here: {format_ids(online)}")
        checked.add(node)
    if not checked:
        raise InvalidNodeError(f"no node given; nodes here: {format_ids(online)}")
    if need_allowed:
        allowed = allowed_nodes()
        forbidden = checked.difference(allowed)
        if forbidden:
            raise NodeNotAllowedError(
                f"node {format_ids(forbidden)} is not allowed for this process (its cpuset's "
                f"Mems_allowed is {format_ids(allowed)}; a container or numactl/cgroup limit)"
            )
    return sorted(checked)


def check_cpus(cpus: Iterable[object], allowed: set[int] | None = None) -> list[int]:
    """Sorted, de-duplicated CPU ids, non-empty and all within ``allowed``
    (default: the calling thread's affinity)."""
    checked: set[int] = set()
    for cpu in cpus:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            raise InvalidCpuSetError(f"cpu {cpu!r} is not a CPU id (a non-negative integer)")
        checked.add(cpu)
    if allowed is None:
        allowed = allowed_cpus()
    if not checked:
        raise InvalidCpuSetError(f"empty CPU set; allowed CPUs: {format_ids(allowed)}")
    forbidden = checked.difference(allowed)
    if forbidden:
        raise InvalidCpuSetError(f"cpu {format_ids(forbidden)} not allowed; allowed CPUs: {format_ids(allowed)}")
    return sorted(checked)
