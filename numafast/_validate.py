"""Validation of node ids and CPU sets shared by every public call.

Each check raises an exception that names the bad value and the allowed ones, so
that a typo in a launcher script reads as such rather than as EINVAL.
"""

from __future__ import annotations

import errno
import operator
import os
import re
import sys
from collections.abc import Iterable, Sequence
from enum import Enum
from functools import cache
from typing import TypeVar

from numafast import _libnuma
from numafast.errors import InvalidCpuSetError, InvalidNodeError, InvalidSizeError, NodeNotAllowedError

NODE_ONLINE = "/sys/devices/system/node/online"
EnumT = TypeVar("EnumT", bound=Enum)


def member(enum: type[EnumT], value: object, name: str) -> EnumT:
    """``enum(value)`` (a member or its value), or a ValueError naming ``name``, the value
    and the allowed values."""
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum)
        raise ValueError(f"{name}={value!r} is not one of {choices}") from None


def format_ids(ids: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5', the kernel's list format."""
    ranges: list[list[int]] = []
    for i in sorted(set(ids)):
        if ranges and i == ranges[-1][1] + 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or "(none)"


def format_size(nbytes: int) -> str:
    """``nbytes`` as people read it: "4.5 GiB", "6.0 MiB", "512 bytes"."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} bytes"


# CPU and node ids are below this: 8x the largest NR_CPUS any architecture builds (8192).
ID_LIMIT = 1 << 16


def parse_ids(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5], the kernel's list format; tolerates the trailing newline
    and NUL bytes sysfs files may carry. ValueError naming the text for anything else
    ('3-1', '0-1-2', '0-', 'x', an id no kernel has: from :data:`ID_LIMIT` on)."""
    ids: list[int] = []
    for part in text.strip().strip("\x00").split(","):
        part = part.strip()
        if not part:
            continue
        match = _RANGE.fullmatch(part)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            where = "" if part == text.strip() else f" in {text.strip()!r}"
            raise ValueError(f"{part!r}{where} is neither a number nor a range A-B with A <= B (a list is like 0-2,5)")
        first = int(match[1])
        last = int(match[2] or first)
        if last >= ID_LIMIT:
            raise ValueError(f"{part!r} names ids up to {last}: no kernel has one past {ID_LIMIT - 1}")
        ids.extend(range(first, last + 1))
    return ids


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
LIST_SYNTAX = "numactl's syntax: all, 0-2,5, !1 (all but 1), +0-1 (the first two allowed)"


def parse_list(text: str, allowed: Sequence[int], what: str) -> list[int]:
    """A node or CPU list as numactl reads it: ``all`` (every allowed one), numbers and
    ranges separated by commas, ``!LIST`` (every allowed one but those), ``+LIST``
    (positions among the allowed ones: +0 is the first allowed). ``what`` ("node",
    "cpu") names the values in the ValueError a malformed or empty list raises."""
    ordered = sorted(allowed)
    spec = text.strip()
    invert = spec.startswith("!")
    spec = spec[1:] if invert else spec
    relative = spec.startswith("+")
    spec = spec[1:] if relative else spec
    allowed_text = f"allowed {what}s: {format_ids(ordered)}"
    if spec == "all":
        ids = list(ordered)
    else:
        try:
            ids = parse_ids(spec)
        except ValueError as error:
            raise ValueError(f"{what} list {error}; {LIST_SYNTAX}; {allowed_text}") from None
        if not ids:
            raise ValueError(f"{what} list {text!r} is empty; {LIST_SYNTAX}; {allowed_text}")
    if relative:
        beyond = [i for i in ids if i >= len(ordered)]
        if beyond:
            raise ValueError(
                f"{what} list {text!r}: +{format_ids(beyond)} counts past the {len(ordered)} allowed "
                f"{what}s ({format_ids(ordered)}); + numbers positions among them from 0"
            )
        ids = [ordered[i] for i in ids]
    if invert:
        ids = sorted(set(ordered) - set(ids))
        if not ids:
            raise ValueError(f"{what} list {text!r} leaves no {what}; {allowed_text}")
    return sorted(set(ids))


def integer(value: object) -> int | None:
    """``value`` as an int when it is an integer, Python's or NumPy's (``__index__``), but
    not a bool; None otherwise (a float, a string, ...)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_bool(name: str, value: object) -> bool:
    """``value`` as a bool when it is one, Python's or NumPy's; else TypeError naming
    ``name`` (1, "yes" or None would otherwise pass for a choice they do not make)."""
    if type(value) is bool:
        return value
    numpy = sys.modules.get("numpy")  # a NumPy bool exists only once NumPy is imported: not imported here for it
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    raise TypeError(f"{name} must be True or False, not {value!r}")


def positive_int(value: object, what: str, *, minimum: int = 1, or_none: bool = False) -> int:
    """``value`` (an integer, Python's or NumPy's) as an int of at least ``minimum``; else
    InvalidSizeError naming ``what`` and the value (``or_none``: the caller also takes None)."""
    number = integer(value)
    if number is None or number < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer of at least {minimum}")
        raise InvalidSizeError(f"{what} must be {kind}{' or None' if or_none else ''}, not {value!r}")
    return number


def id_list(ids: object) -> list[object]:
    """A node or CPU argument as a list: one integer stands for itself, else an iterable
    of them. TypeError for a string or anything not iterable (the caller names what is allowed)."""
    if integer(ids) is not None:
        return [ids]
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{ids!r} is a string")
    try:
        return list(ids)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(f"{ids!r} is neither an integer nor a list of them") from None


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


_mems_refused: int | None = None  # errno of get_mempolicy here (0: it works); see allowed_nodes


def allowed_nodes() -> list[int]:
    """Nodes this process may allocate on: its cpuset's mems (Mems_allowed), read afresh;
    node 0 alone on a kernel without NUMA system calls (ENOSYS), which has no other.

    Where a seccomp profile refuses get_mempolicy (EPERM: Docker's default without
    CAP_SYS_NICE), the same list comes from /proc/self/status. Which applies is asked
    once, of get_mempolicy itself: libnuma would print each refusal to stderr."""
    global _mems_refused
    if _mems_refused is None:
        try:
            _libnuma.get_mempolicy()
            _mems_refused = 0
        except OSError as error:
            _mems_refused = error.errno if error.errno in (errno.EPERM, errno.ENOSYS) else 0
    if _mems_refused == errno.ENOSYS:
        return [0]
    if _mems_refused == errno.EPERM:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Mems_allowed_list:"):
                    return parse_ids(line.split(":", 1)[1].strip())
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


def check_nodes(nodes: object, *, need_allowed: bool = True) -> list[int]:
    """Sorted, de-duplicated node ids, each online and (by default) allowed by the cpuset.

    ``nodes`` is one node or an iterable of them; Python and NumPy integers are node ids."""
    checked: set[int] = set()
    online = online_nodes()
    try:
        given = id_list(nodes)
    except TypeError as error:
        raise InvalidNodeError(f"nodes {error}: give a node id or a list of them; nodes here: {format_ids(online)}") from None
    for node in given:
        node_id = integer(node)
        if node_id is None:
            raise InvalidNodeError(f"node {node!r} is not an integer node id{_list_hint(node)}; nodes here: {format_ids(online)}")
        if node_id not in online:
            raise InvalidNodeError(f"node {node_id} does not exist; nodes here: {format_ids(online)}")
        checked.add(node_id)
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


def _list_hint(node: object) -> str:
    """For a list where one node was expected (numa_local([0, 1])): the calls that take
    CPUs or several nodes, since a list there is often meant as CPUs."""
    if isinstance(node, (str, bytes)) or not isinstance(node, Iterable):
        return ""
    return (
        f" (a list where one node id belongs: to run on CPUs {node!r}, use cpubind(cpus={node!r}); "
        "for several nodes, membind, interleave, preferred_many or cpubind(nodes=...))"
    )


def check_cpus(cpus: object, allowed: set[int] | None = None) -> list[int]:
    """Sorted, de-duplicated CPU ids, non-empty and all within ``allowed``
    (default: the calling thread's affinity). ``cpus`` is one CPU or an iterable of them."""
    if allowed is None:
        allowed = allowed_cpus()
    try:
        given = id_list(cpus)
    except TypeError as error:
        raise InvalidCpuSetError(f"cpus {error}: give a CPU id or a list of them; allowed CPUs: {format_ids(allowed)}") from None
    checked: set[int] = set()
    for cpu in given:
        cpu_id = integer(cpu)
        if cpu_id is None or cpu_id < 0:
            raise InvalidCpuSetError(
                f"cpu {cpu!r} is not a CPU id (a non-negative integer); allowed CPUs: {format_ids(allowed)}"
            )
        checked.add(cpu_id)
    if not checked:
        raise InvalidCpuSetError(f"empty CPU set; allowed CPUs: {format_ids(allowed)}")
    forbidden = checked.difference(allowed)
    if forbidden:
        raise InvalidCpuSetError(f"cpu {format_ids(forbidden)} not allowed; allowed CPUs: {format_ids(allowed)}")
    return sorted(checked)
