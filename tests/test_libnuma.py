"""The native layer against the kernel's own files in /sys/devices/system/node."""

from __future__ import annotations

import re
import threading

import pytest

import numafast
from numafast import _libnuma
from sysfs_truth import (
    cpuless_nodes_with_memory,
    node_cpus,
    node_distances,
    node_meminfo,
    online_nodes,
)


def test_numa_is_available() -> None:
    assert numafast.numa_available()
    assert _libnuma.available() == 0


def test_node_count_and_highest_node_match_sysfs() -> None:
    nodes = online_nodes()
    assert _libnuma.max_node() == max(nodes)
    with_memory = [n for n in nodes if node_meminfo(n).get("MemTotal", 0) > 0]
    assert _libnuma.num_configured_nodes() == len(with_memory)


@pytest.mark.parametrize("node", online_nodes())
def test_cpus_of_each_node_match_sysfs(node: int) -> None:
    assert _libnuma.node_to_cpus(node) == node_cpus(node)
    for cpu in node_cpus(node):
        assert _libnuma.node_of_cpu(cpu) == node


def test_full_distance_matrix_matches_sysfs() -> None:
    nodes = online_nodes()
    for a in nodes:
        row = [_libnuma.distance(a, b) for b in nodes]
        assert row == node_distances(a), f"distance row of node {a}"


@pytest.mark.parametrize("node", online_nodes())
def test_node_size_agrees_with_meminfo_within_one_percent(node: int) -> None:
    total, free = _libnuma.node_size64(node)
    meminfo = node_meminfo(node)
    assert total == pytest.approx(meminfo["MemTotal"], rel=0.01)
    # free memory moves while we look; 1% of the node's total is the tolerance
    assert abs(free - node_meminfo(node)["MemFree"]) <= 0.01 * meminfo["MemTotal"]


def test_mems_allowed_are_online_nodes_with_memory() -> None:
    allowed = _libnuma.get_mems_allowed()
    assert allowed and set(allowed) <= set(online_nodes())


@pytest.mark.numa(nodes=4)
def test_four_node_guest_has_non_uniform_distances() -> None:
    nodes = online_nodes()
    assert len(nodes) >= 4
    remote = {_libnuma.distance(a, b) for a in nodes for b in nodes if a != b}
    assert len(remote) > 1, f"expected a non-uniform SLIT, got {remote}"
    assert all(_libnuma.distance(n, n) == 10 for n in nodes)
    for n in nodes:
        assert _libnuma.node_to_cpus(n), f"node {n} of the 4-node guest should have a CPU"


@pytest.mark.numa(nodes=3, memory_only=True)
def test_memory_only_node_has_memory_and_no_cpus() -> None:
    for node in cpuless_nodes_with_memory():
        assert _libnuma.node_to_cpus(node) == []
        total, _free = _libnuma.node_size64(node)
        assert total == pytest.approx(node_meminfo(node)["MemTotal"], rel=0.01)
        assert total > 0


@pytest.mark.parametrize(
    ("call", "args", "error", "message"),
    [
        (_libnuma.node_size64, (4096,), numafast.InvalidNodeError, "node 4096 does not exist; nodes here: "),
        (_libnuma.node_to_cpus, (4096,), numafast.InvalidNodeError, "node 4096 does not exist; nodes here: "),
        (_libnuma.distance, (0, 4096), numafast.InvalidNodeError, "node 4096 does not exist; nodes here: "),
        (_libnuma.run_on_node, (4096,), numafast.InvalidNodeError, "node 4096 does not exist; nodes here: "),
        (_libnuma.node_of_cpu, (1 << 20,), numafast.InvalidCpuSetError, f"cpu {1 << 20} does not exist; CPUs here: 0-"),
        (_libnuma.node_of_cpu, (-1,), numafast.InvalidCpuSetError, "cpu -1 does not exist; CPUs here: 0-"),
    ],
)
def test_unknown_node_or_cpu_names_it_and_those_here(call, args, error, message) -> None:  # type: ignore[no-untyped-def]
    # libnuma alone answers ERANGE, ENOENT, EINVAL or (numa_distance) a silent 0.
    with pytest.raises(error, match=re.escape(message)):
        call(*args)


def test_failures_raise_libnuma_error_naming_the_call() -> None:
    with pytest.raises(numafast.LibnumaError) as raised:
        _libnuma.sched_setaffinity(0, [])  # an empty CPU mask: EINVAL from the kernel
    assert raised.value.call == "sched_setaffinity"
    assert "sched_setaffinity" in str(raised.value)
    assert raised.value.errno


def test_calls_are_safe_from_many_threads() -> None:
    nodes = online_nodes()
    expected = {n: node_cpus(n) for n in nodes}
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(200):
                for n in nodes:
                    assert _libnuma.node_to_cpus(n) == expected[n]
                    _libnuma.node_size64(n)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
