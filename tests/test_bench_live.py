"""``numafast bench`` on kernels with several nodes (the 4-node and memory-only guests).

Timings under TCG emulation mean nothing; what is checked is that every cell is
measured or explained, that each kept cell passed its placement checks, and that
what those checks report agrees with sysfs (each node's CPUs, the whole buffer's
pages counted on the right node). One ``numafast bench --quick --json`` child per
guest serves several tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import numafast
from numafast.cli.bench.in_progress import Unmeasurable, check_pages
from numafast.cli.bench.result import PLACEMENT_FAILED, BenchResult, check_document
from numafast.memory import allocate
from sysfs_truth import PAGE_SIZE, node_cpus, node_distances, node_meminfo, online_nodes, pagemap_nodes

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
NODES = online_nodes()
CPU_MATRICES = ("latency_ns", "read_gbps", "copy_gbps")


def bench_json(*args: str, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    command = [*prefix, sys.executable, "-m", "numafast", "bench", "--quick", "--json", *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=TESTS.parent,
                            env=ENV, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


@pytest.fixture(scope="module")
def quick_run() -> dict[str, Any]:
    return bench_json()


def cpu_node_of(name: str, row: int, col: int) -> int:
    """The node whose CPUs do a cell's work (node copies: the destination's, by default)."""
    return col if name == "node_copy_gbps" else row


def buffer_nodes(name: str, row: int, col: int) -> dict[str, int]:
    if name == "node_copy_gbps":
        return {"source": row, "destination": col}
    if name == "copy_gbps":
        return {"source": col, "destination": col}
    return {"source": col}


@pytest.mark.numa(nodes=3)
def test_every_cell_is_measured_or_explained(quick_run: dict[str, Any]) -> None:
    assert set(quick_run["matrices"]) == {*CPU_MATRICES, "node_copy_gbps"}
    for name, matrix in quick_run["matrices"].items():
        assert matrix["rows"] == matrix["cols"] == NODES
        for i, row in enumerate(NODES):
            for j, col in enumerate(NODES):
                value, key = matrix["values"][i][j], f"{row},{col}"
                cpu_node = cpu_node_of(name, row, col)
                if node_cpus(cpu_node):
                    assert value is not None and value > 0, (name, key, matrix["missing"].get(key))
                    assert matrix["threads"][i][j] == (1 if name == "latency_ns" else len(node_cpus(cpu_node)))
                else:  # the memory-only guest's CPU-less node
                    assert value is None and matrix["threads"][i][j] == 0
                    assert matrix["missing"][key].startswith(f"node {cpu_node} has no CPUs"), (name, key)
        assert len(matrix["missing"]) == sum(v is None for line in matrix["values"] for v in line)


@pytest.mark.numa(nodes=3)
def test_every_placement_check_passed_and_agrees_with_sysfs(quick_run: dict[str, Any]) -> None:
    pages = quick_run["settings"]["size"] // PAGE_SIZE
    for name, matrix in quick_run["matrices"].items():
        assert not any(reason.startswith(PLACEMENT_FAILED) for reason in matrix["missing"].values())
        measured = {f"{r},{c}" for r, line in zip(NODES, matrix["values"]) for c, v in zip(NODES, line) if v is not None}
        assert set(matrix["placement"]) == measured
        for key, placement in matrix["placement"].items():
            row, col = map(int, key.split(","))
            cpu_node = cpu_node_of(name, row, col)
            assert placement["cpu_node"] == cpu_node
            expected_cpus = node_cpus(cpu_node)[:1] if name == "latency_ns" else node_cpus(cpu_node)
            assert placement["cpus"] == expected_cpus, (name, key)
            assert placement["buffers"] == {
                role: {"node": node, "pages": {str(node): pages}}
                for role, node in buffer_nodes(name, row, col).items()
            }, (name, key)


@pytest.mark.numa(nodes=3)
def test_json_round_trips_and_describes_this_machine(quick_run: dict[str, Any]) -> None:
    check_document(quick_run)
    assert BenchResult.from_dict(quick_run).to_dict() == quick_run
    assert json.loads(BenchResult.from_dict(quick_run).to_json()) == quick_run
    machine = quick_run["machine"]
    assert [n["id"] for n in machine["nodes"]] == NODES
    assert [n["cpus"] for n in machine["nodes"]] == [node_cpus(n) for n in NODES]
    assert [n["memory_bytes"] for n in machine["nodes"]] == [node_meminfo(n)["MemTotal"] for n in NODES]
    assert machine["distances"] == [node_distances(n) for n in NODES]
    assert quick_run["settings"] == {
        "nodes": NODES, "size": 8 << 20, "threads": None, "repetitions": None, "quick": True, "copy_by": "destination",
    }  # fmt: skip


@pytest.mark.numa(nodes=3)
def test_a_buffer_on_another_node_fails_the_page_check() -> None:
    buffer = allocate(4 << 20, node=NODES[1])
    truth = pagemap_nodes(buffer.address, buffer.size)
    assert set(truth) == {NODES[1]}
    assert check_pages(buffer, NODES[1], "source") == {"node": NODES[1], "pages": {str(NODES[1]): len(truth)}}
    with pytest.raises(Unmeasurable, match=f"{PLACEMENT_FAILED}the source buffer should be all on node {NODES[0]}"):
        check_pages(buffer, NODES[0], "source")
    buffer.free()


@pytest.mark.numa(nodes=4)
def test_nodes_the_cpuset_forbids_are_explained() -> None:
    """Node 3's CPU and node 2's memory forbidden by a cgroup cpuset (4-node guest: node i has CPU i)."""
    cpuset = (sys.executable, str(TESTS / "cpuset_exec.py"), "--cpus", "0-2", "0-1,3", "--")
    document = bench_json("--matrix", "latency_ns", "--matrix", "node_copy_gbps", "--repetitions", "1", prefix=cpuset)
    cpus_forbidden = "node 3's CPUs 3 are all outside the CPUs this process may use (0-2: its affinity and cpuset)"
    memory_forbidden = "node 2 is outside the memory nodes this process may use (0-1,3: its cpuset's mems)"
    for name, matrix in document["matrices"].items():
        for row in NODES:
            for col in NODES:
                cpu_node = cpu_node_of(name, row, col)
                memory = {col} if name == "latency_ns" else {row, col}
                expected = cpus_forbidden if cpu_node == 3 else memory_forbidden if 2 in memory else None
                assert matrix["missing"].get(f"{row},{col}") == expected, (name, row, col)
                value = matrix["values"][NODES.index(row)][NODES.index(col)]
                assert (value is None) == (expected is not None)


@pytest.mark.numa(nodes=3, memory_only=True)
def test_copies_into_a_cpu_less_node_are_measured_by_the_source_cpus() -> None:
    cpu_less = next(n for n in NODES if not node_cpus(n))
    result = numafast.bench(quick=True, matrices=["node_copy_gbps"], copy_by="source")
    matrix = result.matrices["node_copy_gbps"]
    for source in NODES:
        if source == cpu_less:
            assert all(matrix.value(source, d) is None for d in NODES)
            assert matrix.missing[f"{source},{source}"] == (
                f"node {source} has no CPUs to copy with; the destination's (the default) could"
            )
        else:
            assert matrix.value(source, cpu_less) is not None
            placement = matrix.placement[f"{source},{cpu_less}"]
            assert placement["cpu_node"] == source and placement["cpus"] == node_cpus(source)
            assert placement["buffers"]["destination"]["node"] == cpu_less
