"""Placement on a real multi-node kernel (the QEMU guests of tests/run_suite.py).

Every assertion asks the kernel: the node of each page (get_mempolicy with
MPOL_F_NODE|MPOL_F_ADDR), the thread's CPUs (os.sched_getaffinity, /proc), the
thread's policy (get_mempolicy). Buffers are fresh mappings, touched inside the
block: a policy acts when a page is first touched.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import numafast
from sysfs_truth import (
    PAGE_SIZE,
    cpuless_nodes_with_memory,
    nearest_cpu_nodes,
    node_cpus,
    online_nodes,
    page_nodes,
    thread_policy,
)

TESTS = Path(__file__).resolve().parent
MIB = 1 << 20


def fresh_array(nbytes: int = MIB) -> np.ndarray:
    """``nbytes`` of float64 ones over a new anonymous mapping, touched here. Not np.ones:
    whatever MALLOC_MMAP_THRESHOLD_ says, malloc carves a request from a free heap chunk
    that fits before it maps anything new, and such a chunk's pages were touched by an
    earlier test, under its own policy (an interleave over nodes 0 and 1 once found its
    pages all on node 3, where the test before had bound the thread)."""
    array = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.float64)
    array[:] = 1
    return array


def fresh_buffers() -> tuple[np.ndarray, mmap.mmap]:
    """A NumPy array and a plain buffer, each 1 MiB over a new mapping (not a bytearray:
    calloc too may reuse a free heap chunk whose pages stay where they were), touched."""
    raw = mmap.mmap(-1, MIB)
    raw[::PAGE_SIZE] = b"\x01" * (MIB // PAGE_SIZE)  # a new mapping's pages are not there until touched
    return fresh_array(), raw


def expected_cpus(node: int) -> set[int]:
    own = node_cpus(node)
    return set(own) if own else {cpu for n in nearest_cpu_nodes(node) for cpu in node_cpus(n)}


def run_python(code: str, *prefix: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (optionally under a prefix command), its output captured."""
    command = [*prefix, sys.executable, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, cwd=TESTS.parent, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"})  # fmt: skip


@pytest.mark.numa(nodes=2)
@pytest.mark.parametrize("strict", [False, True], ids=["preferred", "strict"])
@pytest.mark.parametrize("node", online_nodes())
def test_numa_local_puts_pages_and_thread_on_the_node_then_restores(node: int, strict: bool) -> None:
    cpus_before, policy_before = os.sched_getaffinity(0), thread_policy()
    with numafast.numa_local(node, strict=strict):
        array, raw = fresh_buffers()
        assert set(page_nodes(array)) == {node} and len(page_nodes(array)) >= MIB // PAGE_SIZE - 1
        assert set(page_nodes(raw)) == {node}
        assert os.sched_getaffinity(0) == expected_cpus(node)
        mode = numafast._libnuma.MPOL_BIND if strict else numafast._libnuma.MPOL_PREFERRED
        assert thread_policy() == (mode, [node])
    assert os.sched_getaffinity(0) == cpus_before
    assert thread_policy() == policy_before
    # Pages stay where they were placed; new ones follow the restored policy again.
    assert set(page_nodes(array)) == {node}


@pytest.mark.numa(memory_only=True)
def test_memory_only_node_runs_on_nearest_cpu_node_and_allocates_on_itself() -> None:
    node = cpuless_nodes_with_memory()[0]
    with numafast.numa_local(node):
        array, _ = fresh_buffers()
        assert set(page_nodes(array)) == {node}
        assert os.sched_getaffinity(0) == expected_cpus(node) != set()


@pytest.mark.numa(nodes=4)
@pytest.mark.parametrize("count", [2, 3, 4])
def test_interleave_spreads_pages_round_robin(count: int) -> None:
    nodes = online_nodes()[:count]
    pages = 64 * count
    with numafast.interleave(nodes):
        array = fresh_array(pages * PAGE_SIZE)
    per_node = Counter(page_nodes(array))
    assert set(per_node) == set(nodes)
    for node in nodes:
        assert abs(per_node[node] - len(page_nodes(array)) / count) <= 1, per_node


@pytest.mark.numa(nodes=4)
def test_membind_preferred_many_and_local_alloc_as_the_kernel_sees_them() -> None:
    with numafast.membind([1, 2]):
        assert thread_policy() == (numafast._libnuma.MPOL_BIND, [1, 2])
        assert set(page_nodes(fresh_array())) <= {1, 2}
    with numafast.preferred_many([2, 3]):
        assert thread_policy() == (numafast._libnuma.MPOL_PREFERRED_MANY, [2, 3])
        assert set(page_nodes(fresh_array())) <= {2, 3}
    with numafast.cpubind(nodes=[3]), numafast.local_alloc():
        assert thread_policy() == (numafast._libnuma.MPOL_LOCAL, [])
        assert set(page_nodes(fresh_array())) == {3}
    with numafast.membind([1], flags=[numafast.ModeFlag.STATIC_NODES]):
        assert numafast.get_policy() == numafast.Policy(
            numafast.Mode.BIND, (1,), frozenset({numafast.ModeFlag.STATIC_NODES})
        )


@pytest.mark.numa(nodes=4)
def test_two_threads_in_different_blocks_do_not_disturb_each_other() -> None:
    both_inside = threading.Barrier(2)
    seen: dict[int, tuple[set[int], set[int]]] = {}

    def worker(node: int) -> None:
        with numafast.numa_local(node):
            both_inside.wait()
            array, _ = fresh_buffers()
            seen[node] = (set(page_nodes(array)), os.sched_getaffinity(0))
            both_inside.wait()

    cpus_before, policy_before = os.sched_getaffinity(0), thread_policy()
    threads = [threading.Thread(target=worker, args=(node,)) for node in (1, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {1: ({1}, set(node_cpus(1))), 3: ({3}, set(node_cpus(3)))}
    assert (os.sched_getaffinity(0), thread_policy()) == (cpus_before, policy_before)


@pytest.mark.numa(nodes=4)
def test_nesting_and_exceptions_restore_each_level() -> None:
    outer_state = (os.sched_getaffinity(0), thread_policy())
    with pytest.raises(KeyError):
        with numafast.numa_local(1):
            level1 = (os.sched_getaffinity(0), thread_policy())
            with numafast.interleave([0, 2]):
                with pytest.raises(ZeroDivisionError):
                    with numafast.numa_local(3, strict=True):
                        assert set(page_nodes(fresh_array())) == {3}
                        1 / 0
                assert thread_policy() == (numafast._libnuma.MPOL_INTERLEAVE, [0, 2])
                assert os.sched_getaffinity(0) == set(node_cpus(1))
            assert (os.sched_getaffinity(0), thread_policy()) == level1
            raise KeyError("leave")
    assert (os.sched_getaffinity(0), thread_policy()) == outer_state


@pytest.mark.numa(nodes=4)
def test_decorated_function_runs_placed_and_restores() -> None:
    @numafast.numa_local(2)
    def load() -> tuple[set[int], set[int]]:
        return set(page_nodes(fresh_array())), os.sched_getaffinity(0)

    before = (os.sched_getaffinity(0), thread_policy())
    assert load() == ({2}, set(node_cpus(2)))
    assert load() == ({2}, set(node_cpus(2)))
    assert (os.sched_getaffinity(0), thread_policy()) == before


@pytest.mark.numa(nodes=4)
def test_forked_child_inherits_cpus_and_policy() -> None:
    with numafast.numa_local(2, strict=True):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: report what the kernel says about itself
            report = {
                "cpus": sorted(os.sched_getaffinity(0)),
                "policy": thread_policy(),
                "pages": sorted(set(page_nodes(fresh_array()))),
            }
            os.write(write_end, json.dumps(report).encode())
            os._exit(0)
        os.close(write_end)
        report = json.loads(os.read(read_end, 65536))
        os.close(read_end)
        os.waitpid(pid, 0)
    assert report == {"cpus": node_cpus(2), "policy": [numafast._libnuma.MPOL_BIND, [2]], "pages": [2]}


BIND_PROCESS = """
import json, os, threading
import numpy as np
import numafast
from sysfs_truth import page_nodes, thread_cpus_of_process
release = threading.Event()
threads = [threading.Thread(target=release.wait) for _ in range(3)]
for t in threads: t.start()
with numafast.preferred(0):
    early = np.ones(1 << 17)  # touched on node 0 before binding
before = thread_cpus_of_process()
moved = numafast.bind_process(1, migrate=True)
after = thread_cpus_of_process()
pages = sorted(set(page_nodes(np.ones(1 << 17))))
release.set()
print(json.dumps({"before": list(before.values()), "after": after, "moved": moved, "pages": pages,
                  "migrated": sorted(set(page_nodes(early)))}))
"""


@pytest.mark.numa(nodes=4)
def test_bind_process_moves_every_existing_thread() -> None:
    result = run_python(BIND_PROCESS)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert all(cpus == online_cpus() for cpus in report["before"])
    # 3 waiting threads, the main one, and whatever pools NumPy's BLAS started.
    assert len(report["after"]) >= 4 and sorted(map(int, report["after"])) == sorted(report["moved"])
    assert all(cpus == node_cpus(1) for cpus in report["after"].values())
    assert report["pages"] == [1]
    assert report["migrated"] == [1]


def online_cpus() -> list[int]:
    return sorted(cpu for node in online_nodes() for cpu in node_cpus(node))


FILL_NODE = """
import json, numpy as np, numafast
from sysfs_truth import buffer_address, numa_maps_pages
with numafast.{call}:
    array = np.ones({size_mib} << 17)  # {size_mib} MiB, every page touched
print(json.dumps(numa_maps_pages(*buffer_address(array))))
"""


@pytest.mark.numa(memory_only=True)
def test_preferred_falls_back_when_the_node_is_full_and_strict_bind_does_not() -> None:
    # Node 0 has 512 MiB; 640 MiB cannot fit there.
    spilled = run_python(FILL_NODE.format(call="numa_local(0)", size_mib=640))
    assert spilled.returncode == 0, spilled.stderr
    pages = {int(node): count for node, count in json.loads(spilled.stdout).items()}
    assert pages.get(0, 0) > 0 and sum(n for node, n in pages.items() if node != 0) > 0, pages
    strict = run_python(FILL_NODE.format(call="numa_local(0, strict=True)", size_mib=640))
    # The node is all there is: the OOM killer (SIGKILL) or a MemoryError, never other nodes.
    assert strict.returncode != 0, strict.stdout
    assert strict.returncode == -9 or "MemoryError" in strict.stderr, (strict.returncode, strict.stderr)


CPUSET_CHILD = """
import os, sys
import numafast
from numafast import _libnuma
from cpuset_exec import enter_cpuset
prepared = numafast.numa_local(3)   # validated while node 3 is allowed
enter_cpuset("0-2", "0-3")          # now node 3's memory is forbidden, its CPU is not
before = (os.sched_getaffinity(0), _libnuma.get_mempolicy())
try:
    with prepared:
        print("entered")
except numafast.NodeNotAllowedError as error:
    print("refused:", error)
print("restored" if (os.sched_getaffinity(0), _libnuma.get_mempolicy()) == before else "HALF-APPLIED")
try:
    with numafast.numa_local(3):
        print("entered")
except numafast.NodeNotAllowedError as error:
    print("again:", error)
with numafast.numa_local(2):
    print("node 2 ok")
"""


@pytest.mark.numa(nodes=4)
def test_cpuset_that_excludes_a_node_is_refused_and_nothing_stays_half_applied() -> None:
    result = run_python(CPUSET_CHILD)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("refused: ") and "Mems_allowed is 0-2" in lines[0], lines
    assert lines[1] == "restored"
    assert lines[2].startswith("again: node 3 is not allowed"), lines
    assert lines[3] == "node 2 ok"


@pytest.mark.numa(nodes=4)
def test_process_started_in_a_cpuset_gets_a_clear_error_for_the_excluded_node() -> None:
    code = (
        "import numafast\n"
        "for call in (lambda: numafast.numa_local(3), lambda: numafast.cpubind(cpus=[3]),\n"
        "             lambda: numafast.membind([2, 3]), lambda: numafast.cpubind(nodes=[3])):\n"
        "    try: call(); print('accepted')\n"
        "    except numafast.NumaError as error: print(type(error).__name__, error)\n"
    )
    result = run_python(code, sys.executable, str(TESTS / "cpuset_exec.py"), "--cpus", "0-2", "0-2", "--")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "NodeNotAllowedError node 3 is not allowed for this process (its cpuset's " \
        "Mems_allowed is 0-2; a container or numactl/cgroup limit)"
    assert lines[1] == "InvalidCpuSetError cpu 3 not allowed; allowed CPUs: 0-2"
    assert lines[2].startswith("NodeNotAllowedError node 3 is not allowed")
    assert lines[3].startswith("NodeNotAllowedError node 3 is not allowed")


def test_weighted_interleave_matches_the_kernel_release() -> None:
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    capability = numafast.capabilities().weighted_interleave
    assert capability.available == (release >= (6, 9)), capability
    if not capability.available:
        assert "6.9" in capability.reason
        with pytest.raises(numafast.PolicyUnsupported, match="6.9"):
            numafast.interleave([0], weights=[1])
