"""Containers that refuse memory placement (issue 45), under a real seccomp filter
(tests/seccomp_exec.c): Docker's default profile without CAP_SYS_NICE answers
get_mempolicy, set_mempolicy and mbind with EPERM, and move_pages and migrate_pages
always; a kernel without NUMA answers ENOSYS.

What numafast places on its own (NumaLoader's workers, its pinned pools) goes on
unplaced, CPU binding kept, with one warning at the user's line; what the user asks
for explicitly raises an exception naming the refused call, the cause and the fix.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from sysfs_truth import online_nodes
from test_launch_live import snapshot_with_gpus
from test_no_numa import NO_NUMA, POOLS
from test_policy_seccomp import ENV, under_seccomp  # noqa: F401  (the fixture)

pytestmark = pytest.mark.host_only("seccomp refusals: the same whatever the nodes")
NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="NumaLoader needs torch (numafast[torch])")

# Docker's default seccomp profile (moby/profiles seccomp/default.json) without CAP_SYS_NICE.
DOCKER = "get_mempolicy,set_mempolicy,mbind,set_mempolicy_home_node,move_pages,migrate_pages"

LOADERS = """
import os, warnings
import torch
from torch.utils.data import Dataset
import numafast, numafast.errors
from numafast import _libnuma
from numafast.torch import NumaLoader

CPUS = sorted(os.sched_getaffinity(0))
NODE_CPUS = sorted(set(_libnuma.node_to_cpus(0)) & set(CPUS))
os.sched_setaffinity(0, {CPUS[-1]})  # so that a worker's binding to node 0 is seen to change something

class Tagged(Dataset):
    # Each sample: its index, and the CPUs the process that loaded it may run on.
    def __len__(self): return 24
    def __getitem__(self, index):
        mask = torch.zeros(os.cpu_count(), dtype=torch.int8)
        mask[sorted(os.sched_getaffinity(0))] = 1
        return torch.full((16,), index, dtype=torch.int64), mask

def check(loader, workers):
    for epoch in range(2):
        seen = []
        for values, masks in loader:  # LINE: the user's line
            assert (values == values[:, :1]).all(), values
            seen += values[:, 0].tolist()
            if workers:
                assert all(sorted(row.nonzero().flatten().tolist()) == NODE_CPUS for row in masks), masks
        assert seen == list(range(24)), (epoch, seen)
    stats = loader.stats()
    # Two epochs: every batch arrived in a pool's slot, landed there or (the first batches, collated
    # before the owner made the pool) copied in.
    assert stats.batches == 24 and stats.landed + stats.copied == 24 and stats.landed >= 24 - 4, stats
    assert set(stats.fallbacks) <= {"first batches"}, stats

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for workers, persistent, node in [(0, False, None), (0, False, 0), (2, False, None),
                                      (2, True, 0), (2, True, None), (2, False, 0)]:
        loader = NumaLoader(Tagged(), batch_size=2, num_workers=workers, persistent_workers=persistent,
                            node=node, lock="off")
        check(loader, workers)
        print("ok", workers, persistent, node)
for warning in caught:  # but the num_workers=0 hints, and torch's on 2 workers for the 1 CPU left above
    if not issubclass(warning.category, numafast.errors.LoaderHint) and "/torch/" not in warning.filename:
        print("warning", warning.category.__name__, warning.filename, warning.lineno, warning.message)
"""
USER_LINE = next(n for n, line in enumerate(LOADERS.splitlines(), 1) if "# LINE:" in line)


def _loaders_ran(result) -> list[str]:  # type: ignore[no-untyped-def]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:6] == ["ok 0 False None", "ok 0 False 0", "ok 2 False None", "ok 2 True 0", "ok 2 True None",
                         "ok 2 False 0"]  # fmt: skip
    return lines[6:]


@NEEDS_TORCH
def test_numaloader_runs_unplaced_in_docker_with_one_warning_naming_the_fix(under_seccomp) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    said = _loaders_ran(under_seccomp(DOCKER, LOADERS))
    assert len(said) == 1, said  # six loaders, workers and pools: one warning
    _, category, filename, line, message = said[0].split(" ", 4)
    assert (category, filename, line) == ("RuntimeWarning", "<string>", str(USER_LINE))
    assert message.startswith("get_mempolicy, set_mempolicy, mbind refused with EPERM")
    assert "not placed on node 0" in message and "CPU binding still applies" in message
    assert "seccomp: filter active, no CAP_SYS_NICE" in message and "--cap-add SYS_NICE" in message
    assert "securityContext.capabilities.add" in message  # the Kubernetes user's fix too


@NEEDS_TORCH
def test_numaloader_runs_unplaced_on_a_kernel_without_numa_with_one_warning(under_seccomp) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    said = _loaders_ran(under_seccomp(NO_NUMA, LOADERS))
    assert len(said) == 1, said
    _, category, filename, line, message = said[0].split(" ", 4)
    assert (category, filename, line) == ("RuntimeWarning", "<string>", str(USER_LINE))
    assert "this kernel has no NUMA support (ENOSYS)" in message and "Nothing to do" in message


@NEEDS_TORCH
def test_numaloader_where_placement_works_says_nothing(under_seccomp) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    # The same filter program with nothing refused but an unrelated call, as a baseline.
    assert _loaders_ran(under_seccomp("set_mempolicy_home_node", LOADERS)) == []


EXPLICIT = """
import os
import numpy as np
import numafast, numafast.errors
from numafast import _libnuma

cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[-1]})
before = os.sched_getaffinity(0)

def refused(name, call):
    try:
        call()
    except numafast.PolicyNotPermitted as error:
        print(name, "|", error)
    else:
        print(name, "| not refused")
    print(name, "| cpus restored" if os.sched_getaffinity(0) == before else "| cpus CHANGED")

def enter(placement):
    with placement:
        pass

array = np.ones(4 * _libnuma.pagesize(), dtype=np.uint8)
refused("numa_local", lambda: enter(numafast.numa_local(0)))
refused("preferred", lambda: enter(numafast.preferred(0)))
refused("membind", lambda: enter(numafast.membind(0)))
refused("empty", lambda: numafast.empty(1 << 16, node=0))
refused("mbind", lambda: numafast.mbind(array, 0))
refused("migrate", lambda: numafast.migrate(array, 0))
refused("page_nodes", lambda: numafast.page_nodes(array))
refused("placement", lambda: numafast.placement(array, 0))
with numafast.cpubind(nodes=0):  # CPU affinity is allowed in containers
    print("cpubind | on node 0:", sorted(os.sched_getaffinity(0)) == sorted(set(_libnuma.node_to_cpus(0)) & set(cpus)))
print("cpubind | cpus restored" if os.sched_getaffinity(0) == before else "cpubind | cpus CHANGED")
"""


def test_explicit_placement_in_docker_raises_naming_call_cause_and_fix(under_seccomp) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    result = under_seccomp(DOCKER, EXPLICIT)
    assert result.returncode == 0, result.stderr
    said: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        name, text = line.split(" | ", 1)
        said.setdefault(name, []).append(text)
    calls = {"numa_local": "get_mempolicy", "preferred": "get_mempolicy", "membind": "get_mempolicy",
             "empty": "mbind", "mbind": "mbind", "migrate": "move_pages", "page_nodes": "move_pages",
             "placement": "move_pages"}  # fmt: skip
    for name, call in calls.items():
        error, restored = said[name]
        assert error.startswith(f"{call} (") and "refused with EPERM" in error, (name, error)
        assert "seccomp: filter active, no CAP_SYS_NICE" in error, (name, error)
        assert restored == "cpus restored", name
        if call == "move_pages":  # Docker never allows it: the capability would not help
            assert "even with CAP_SYS_NICE" in error and "--security-opt seccomp=" in error
        else:
            assert "--cap-add SYS_NICE" in error, (name, error)
    assert said["cpubind"] == ["on node 0: True", "cpus restored"]


BIND_RANK = """
import os
import numafast
topology = numafast.Topology.from_sysfs({root!r})
try:
    numafast.bind_rank(0, topology=topology)
except numafast.PolicyNotPermitted as error:
    print(error)
print(numafast.bind_rank(0, topology=topology, memory="none").memory_policy.value)
"""


def test_bind_rank_in_docker_explains_the_memory_policy_and_binds_cpus_alone(under_seccomp, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    root = snapshot_with_gpus(tmp_path, [online_nodes()[0]])
    result = under_seccomp(DOCKER, BIND_RANK.format(root=str(root)))
    assert result.returncode == 0, result.stderr
    error, memory = result.stdout.splitlines()
    assert error.startswith("get_mempolicy (bind_rank, memory='preferred'; memory='none' binds CPUs only)"), error
    assert "refused with EPERM" in error and "--cap-add SYS_NICE" in error
    assert memory == "none"  # CPUs alone need no refused call


STRICT = """
import torch
import numafast
from numafast.torch import NumaLoader
loader = NumaLoader(list(range(8)), batch_size=2, num_workers=2, strict=True, lock="off")
try:
    next(iter(loader))
except numafast.PolicyNotPermitted as error:
    print(error)
"""


@NEEDS_TORCH
def test_strict_numaloader_in_docker_raises_instead_of_running_unplaced(under_seccomp) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    result = under_seccomp(DOCKER, STRICT)
    assert result.returncode == 0, result.stderr
    assert "refused with EPERM" in result.stdout and "--cap-add SYS_NICE" in result.stdout, result.stdout




def test_pinned_pools_run_unplaced_in_docker_with_one_warning(under_seccomp) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    result = under_seccomp(DOCKER, POOLS)
    assert result.returncode == 0, result.stderr
    same, *said = result.stdout.splitlines()
    assert same == "True"
    assert len(said) == 1, said
    category, filename, line, message = said[0].split(" ", 3)
    assert (category, filename, line) == ("RuntimeWarning", "<string>", "7")  # the line that made the pool
    assert message.startswith("get_mempolicy, set_mempolicy, mbind refused with EPERM") and "--cap-add SYS_NICE" in message
    assert result.stderr == ""  # nor anything libnuma would print of the refusals


CHECK_ITSELF = """
import os, subprocess, sys
report = subprocess.run([sys.executable, "-m", "numafast", "check", "--process-only", str(os.getpid())],
                        capture_output=True, text=True, timeout=120)
print(report.stdout, end="")
"""


def test_check_says_when_a_rank_runs_where_placement_is_refused(under_seccomp) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    result = under_seccomp(DOCKER, CHECK_ITSELF)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("  note: ")]
    assert len(notes) == 1, result.stdout
    assert "memory placement likely refused" in notes[0] and "EPERM (seccomp: filter active, no CAP_SYS_NICE)" in notes[0]
    assert "--cap-add SYS_NICE" in notes[0] and "securityContext.capabilities.add" in notes[0]


def test_check_says_nothing_of_placement_where_it_is_allowed() -> None:
    from numafast.policy import seccomp_state

    state, nice = seccomp_state()
    if state == "filter active" and nice is False:
        pytest.skip("this test process itself runs under a seccomp filter without CAP_SYS_NICE")
    report = subprocess.run([sys.executable, "-m", "numafast", "check", "--process-only", str(os.getpid())],
                            capture_output=True, text=True, timeout=120, env=ENV)  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "note:" not in report.stdout and "likely refused" not in report.stdout
