"""The libnuma mirrors of src/policy.pxi, each against what the kernel then reports
(get_mempolicy, sched_getaffinity, /proc). Each runs in a fresh thread: policy
and affinity are per thread, so nothing leaks into the rest of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from numafast import _libnuma
from sysfs_truth import node_cpus, online_nodes, parse_list, task_status, thread_policy

TESTS = Path(__file__).resolve().parent
CPU_NODES = [n for n in online_nodes() if node_cpus(n)]


def in_fresh_thread(function: Callable[[], object]) -> object:
    result: list[object] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(function())
        except BaseException as error:  # handed to the test thread
            errors.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def after(call: Callable[[], object]) -> tuple[tuple[int, list[int]], list[int]]:
    """The thread's policy and CPUs, from the kernel, after ``call``."""
    return in_fresh_thread(lambda: (call(), thread_policy(), sorted(os.sched_getaffinity(0)))[1:])  # type: ignore[return-value]


@pytest.mark.parametrize("node", CPU_NODES)
def test_bind_run_on_node_and_run_on_node_mask(node: int) -> None:
    assert after(lambda: _libnuma.bind([node])) == ((_libnuma.MPOL_BIND, [node]), node_cpus(node))
    assert after(lambda: _libnuma.run_on_node(node))[1] == node_cpus(node)
    assert after(lambda: _libnuma.run_on_node_mask([node]))[1] == node_cpus(node)
    assert in_fresh_thread(lambda: (_libnuma.run_on_node(node), _libnuma.get_run_node_mask())[1]) == [node]
    everything = sorted(os.sched_getaffinity(0))
    assert after(lambda: (_libnuma.run_on_node(node), _libnuma.run_on_node(-1)))[1] == everything


@pytest.mark.parametrize("node", online_nodes())
def test_memory_policy_setters_and_getters(node: int) -> None:
    assert after(lambda: _libnuma.set_membind([node]))[0] == (_libnuma.MPOL_BIND, [node])
    assert in_fresh_thread(lambda: (_libnuma.set_membind([node]), _libnuma.get_membind())[1]) == [node]
    assert after(lambda: _libnuma.set_preferred(node))[0] == (_libnuma.MPOL_PREFERRED, [node])
    assert in_fresh_thread(lambda: (_libnuma.set_preferred(node), _libnuma.preferred())[1]) == node
    assert after(lambda: _libnuma.set_interleave_mask([node]))[0] == (_libnuma.MPOL_INTERLEAVE, [node])
    assert in_fresh_thread(lambda: (_libnuma.set_interleave_mask([node]), _libnuma.get_interleave_mask())[1]) == [node]
    assert after(lambda: (_libnuma.set_interleave_mask([node]), _libnuma.set_interleave_mask([])))[0] == (
        _libnuma.MPOL_DEFAULT, [],
    )  # fmt: skip
    # libnuma 2.0.16+ sets MPOL_LOCAL; older ones MPOL_PREFERRED with no node: both mean local.
    assert after(_libnuma.set_localalloc)[0] in [(_libnuma.MPOL_LOCAL, []), (_libnuma.MPOL_PREFERRED, [])]
    if _libnuma.has_preferred_many() > 0:
        assert after(lambda: _libnuma.set_preferred_many([node]))[0] == (_libnuma.MPOL_PREFERRED_MANY, [node])
        assert in_fresh_thread(lambda: (_libnuma.set_preferred_many([node]), _libnuma.preferred_many())[1]) == [node]


def test_void_libnuma_calls_raise_what_the_kernel_refused() -> None:
    with pytest.raises(_libnuma.LibnumaError, match="numa_set_membind failed"):
        in_fresh_thread(lambda: _libnuma.set_membind([]))
    with pytest.raises(ValueError, match="node 5000 is outside"):
        _libnuma.set_mempolicy(_libnuma.MPOL_BIND, [5000])
    with pytest.raises(ValueError, match="cpu -1 is outside"):
        _libnuma.sched_setaffinity(0, [-1])
    with pytest.raises(_libnuma.LibnumaError, match="sched_setaffinity failed: Invalid argument"):
        _libnuma.sched_setaffinity(0, [])


def test_affinity_of_another_thread_by_its_id() -> None:
    started, release = threading.Event(), threading.Event()
    tids: list[int] = []

    def sleeper() -> None:
        tids.append(_libnuma.gettid())
        started.set()
        release.wait()

    thread = threading.Thread(target=sleeper)
    thread.start()
    started.wait()
    cpu = min(os.sched_getaffinity(0))
    try:
        _libnuma.sched_setaffinity(tids[0], [cpu])
        assert parse_list(task_status(tids[0])["Cpus_allowed_list"]) == [cpu]
        assert _libnuma.sched_getaffinity(tids[0]) == [cpu]
        assert os.sched_getaffinity(0) != {cpu} or len(os.sched_getaffinity(0)) == 1  # ours untouched
    finally:
        release.set()
        thread.join()
    assert _libnuma.gettid() == threading.get_native_id()


def test_get_mempolicy_flags_mems_allowed_and_page_node() -> None:
    assert _libnuma.get_mempolicy(_libnuma.MPOL_F_MEMS_ALLOWED)[1] == _libnuma.get_mems_allowed()
    # Address 0 is never mapped: EFAULT, reported with the call and its arguments.
    with pytest.raises(_libnuma.LibnumaError, match="get_mempolicy failed: Bad address"):
        _libnuma.get_mempolicy(_libnuma.MPOL_F_NODE | _libnuma.MPOL_F_ADDR, 0)


MIGRATE = """
import json, numpy as np
from numafast import _libnuma
from sysfs_truth import page_nodes
_libnuma.set_preferred(0)
array = np.ones(1 << 17)
before = sorted(set(page_nodes(array)))
left = _libnuma.migrate_pages(0, [0], [1])
print(json.dumps([before, sorted(set(page_nodes(array))), left]))
"""


@pytest.mark.numa(nodes=2)
def test_migrate_pages_moves_a_process_between_nodes() -> None:
    env = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
    result = subprocess.run([sys.executable, "-c", MIGRATE], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[0], [1], 0]
