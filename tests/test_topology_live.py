"""The live topology against the kernel of the multi-node guests: what ``numactl -H``
prints, what /sys says, and the allowed sets inside a cgroup cpuset."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import numafast
from sysfs_truth import node_cpus, node_distances, node_meminfo, online_nodes

TESTS = Path(__file__).resolve().parent
MB = 1 << 20


def numactl_hardware() -> dict[str, object]:
    """``numactl -H`` parsed: node ids, CPUs, size and free (MB) per node, distance rows."""
    text = subprocess.run(["numactl", "-H"], check=True, capture_output=True, text=True).stdout
    nodes = [int(n) for n in re.findall(r"^node (\d+) cpus:", text, re.M)]
    cpus = {int(n): [int(c) for c in line.split()] for n, line in re.findall(r"^node (\d+) cpus:(.*)$", text, re.M)}
    size = {int(n): int(mb) for n, mb in re.findall(r"^node (\d+) size: (\d+) MB", text, re.M)}
    free = {int(n): int(mb) for n, mb in re.findall(r"^node (\d+) free: (\d+) MB", text, re.M)}
    rows = {int(n): [int(d) for d in row.split()] for n, row in re.findall(r"^\s*(\d+):((?:\s+\d+)+)\s*$", text, re.M)}
    available = re.search(r"^available: (\d+) nodes", text, re.M)
    assert available is not None, text
    return {"count": int(available[1]), "nodes": nodes, "cpus": cpus, "size": size, "free": free, "rows": rows}


def assert_matches_numactl_and_sysfs() -> None:
    # Pinned pools of earlier tests' loaders are released when the garbage collector
    # gets to them: let that happen now, not between the two reads of free memory.
    gc.collect()
    topology = numafast.topology(refresh=True)
    numactl = numactl_hardware()
    # Read again after numactl: memory freed while it ran (an exiting process of an
    # earlier test) shows in one of the two reads that bracket its own.
    after = {node.id: node.mem_free for node in numafast.topology(refresh=True).nodes}
    assert len(topology.nodes) == numactl["count"]
    assert list(topology.node_ids) == numactl["nodes"] == online_nodes()
    for node in topology.nodes:
        assert list(node.cpus) == numactl["cpus"][node.id] == node_cpus(node.id)  # type: ignore[index]
        assert node.mem_total is not None and node.mem_free is not None
        assert node.mem_total // MB == numactl["size"][node.id]  # type: ignore[index]
        assert node.mem_total == node_meminfo(node.id)["MemTotal"]
        # free memory moves between the reads: 1% of the node (or 8 MB) of slack
        slack = max(8 * MB, node.mem_total // 100)
        low, high = sorted((node.mem_free, after[node.id] or 0))
        assert low - slack <= numactl["free"][node.id] * MB <= high + slack  # type: ignore[index]
        row = [node.distances[other] for other in topology.node_ids]
        assert row == numactl["rows"][node.id] == node_distances(node.id)  # type: ignore[index]
    for node_id in topology.node_ids:
        for cpu in node_cpus(node_id):
            assert topology.node_of_cpu(cpu) == node_id
    assert set(topology.allowed_cpus) == os.sched_getaffinity(0)


def test_live_topology_is_cached_until_refresh() -> None:
    first = numafast.topology()
    assert numafast.topology() is first
    fresh = numafast.topology(refresh=True)
    assert fresh is not first
    assert fresh.node_ids == first.node_ids
    assert numafast.topology() is fresh


def test_live_topology_matches_sysfs_and_this_threads_affinity() -> None:
    topology = numafast.topology(refresh=True)
    assert list(topology.node_ids) == online_nodes()
    for node in topology.nodes:
        assert list(node.cpus) == node_cpus(node.id)
        assert [node.distances[other] for other in topology.node_ids] == node_distances(node.id)
    assert set(topology.allowed_cpus) == os.sched_getaffinity(0)


@pytest.mark.numa(nodes=4)
def test_four_node_guest_topology_equals_numactl_and_sysfs() -> None:
    assert_matches_numactl_and_sysfs()


@pytest.mark.numa(nodes=3, memory_only=True)
def test_memory_only_guest_topology_equals_numactl_and_sysfs() -> None:
    assert_matches_numactl_and_sysfs()
    topology = numafast.topology()
    for node_id in online_nodes():
        if node_cpus(node_id):
            continue
        assert topology.node(node_id).cpus == ()
        assert topology.node(node_id).mem_total == node_meminfo(node_id)["MemTotal"] > 0
        row = dict(zip(online_nodes(), node_distances(node_id), strict=True))
        cpu_nodes = [n for n in online_nodes() if node_cpus(n)]
        assert topology.nearest_cpu_node(node_id) == min(cpu_nodes, key=lambda n: (row[n], n))


# The child reads its allowed sets three ways: the kernel's own /proc/self/status (the
# truth), numafast's live topology, and numafast's cgroup reader on the real /sys/fs/cgroup.
CHILD = """
import json, os
from pathlib import Path
import numafast
from numafast.topo.allowed import from_cgroup
status = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)
live = numafast.topology()
snapshot = numafast.Topology.from_sysfs('/')
print(json.dumps({
    'status_cpus': status['Cpus_allowed_list'].strip(),
    'status_mems': status['Mems_allowed_list'].strip(),
    'affinity': sorted(os.sched_getaffinity(0)),
    'live': [live.allowed_cpus, live.allowed_nodes],
    'snapshot': [snapshot.allowed_cpus, snapshot.allowed_nodes],
    'cgroup': from_cgroup(Path('/')),
}))
"""


@pytest.mark.numa(nodes=3)
def test_allowed_sets_inside_a_cgroup_cpuset() -> None:
    """Nodes 1 and the last: in the memory-only guest the last node has memory and no CPUs."""
    from sysfs_truth import parse_list

    nodes = online_nodes()
    mems = [nodes[1], nodes[-1]]
    cpus = node_cpus(nodes[1]) + node_cpus(nodes[-1])
    command = [sys.executable, str(TESTS / "cpuset_exec.py"), "--cpus", ",".join(map(str, cpus)),
               ",".join(map(str, mems)), "--", sys.executable, "-c", CHILD]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert parse_list(seen["status_cpus"]) == seen["affinity"] == cpus  # the kernel applied the cpuset
    assert parse_list(seen["status_mems"]) == mems
    assert seen["live"] == [cpus, mems]
    assert seen["snapshot"] == [cpus, mems]  # from_sysfs('/') reads proc/self/status
    assert seen["cgroup"] == [cpus, mems]  # cgroup v2 cpuset.*.effective found via /proc/self/cgroup
