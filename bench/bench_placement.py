"""`with numa_local(node): pass` (enter + exit) against the same system calls made
from C and from ctypes (the usual hand-rolled way), measured in the same run.

Each variant saves the calling thread's CPU mask and memory policy, binds to the
node's CPUs with MPOL_PREFERRED on the node, and restores both: six system calls
per cycle in C and ctypes (sched_getaffinity, get_mempolicy, sched_setaffinity,
set_mempolicy, sched_setaffinity, set_mempolicy). numafast skips a call that
would change nothing (binding a thread that already runs on exactly those CPUs).
The C loop is a tiny shared library built here with the system cc; ctypes is used
only in this benchmark, to call it and as the ctypes baseline.

Run: python3 -m pytest bench/bench_placement.py   (ratios of medians are printed at the end)
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import numafast
from numafast import _libnuma

CYCLES = 1000  # enter+exit cycles per timed round, so that timer overhead vanishes
NODE = int(os.environ.get("NUMAFAST_BENCH_NODE", "0"))
NODE_CPUS = _libnuma.node_to_cpus(NODE)
MPOL_PREFERRED = _libnuma.MPOL_PREFERRED

C_LOOP = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <numaif.h>

/* cycles times: save CPU mask and policy, bind to the node, restore both. */
int placement_cycles(long cycles, const cpu_set_t *target, int node) {
    cpu_set_t saved;
    unsigned long nodes[16] = {0}, saved_nodes[16];
    int saved_mode;
    nodes[node / 64] = 1UL << (node % 64);
    for (long i = 0; i < cycles; i++) {
        if (sched_getaffinity(0, sizeof saved, &saved)) return -1;
        if (get_mempolicy(&saved_mode, saved_nodes, 16 * 64, 0, 0)) return -2;
        if (sched_setaffinity(0, sizeof *target, target)) return -3;
        if (set_mempolicy(MPOL_PREFERRED, nodes, 16 * 64)) return -4;
        if (sched_setaffinity(0, sizeof saved, &saved)) return -5;
        if (set_mempolicy(saved_mode, saved_nodes, 16 * 64)) return -6;
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_loop() -> Iterator[Callable[[], int]]:
    with tempfile.TemporaryDirectory() as build:
        source, library = Path(build, "loop.c"), Path(build, "loop.so")
        source.write_text(C_LOOP)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(source), "-o", str(library), "-lnuma"], check=True)
        loop = ctypes.CDLL(str(library))
        target = (ctypes.c_ulong * 16)()
        for cpu in NODE_CPUS:
            target[cpu // 64] |= 1 << (cpu % 64)
        yield lambda: loop.placement_cycles(ctypes.c_long(CYCLES), target, NODE)


class CtypesNumaLocal:
    """numa_local the usual ctypes way: libc's sched_*affinity and libnuma's *_mempolicy."""

    libc = ctypes.CDLL(None, use_errno=True)
    libnuma = ctypes.CDLL("libnuma.so.1", use_errno=True)
    WORDS = 16

    def __init__(self, node: int, cpus: list[int]) -> None:
        self.target = (ctypes.c_ulong * self.WORDS)()
        for cpu in cpus:
            self.target[cpu // 64] |= 1 << (cpu % 64)
        self.nodes = (ctypes.c_ulong * self.WORDS)()
        self.nodes[node // 64] = 1 << (node % 64)

    def __enter__(self) -> None:
        size = ctypes.sizeof(self.target)
        self.saved_cpus = (ctypes.c_ulong * self.WORDS)()
        self.saved_nodes = (ctypes.c_ulong * self.WORDS)()
        self.saved_mode = ctypes.c_int()
        if self.libc.sched_getaffinity(0, size, self.saved_cpus):
            raise OSError(ctypes.get_errno(), "sched_getaffinity")
        if self.libnuma.get_mempolicy(ctypes.byref(self.saved_mode), self.saved_nodes, self.WORDS * 64, None, 0):
            raise OSError(ctypes.get_errno(), "get_mempolicy")
        if self.libc.sched_setaffinity(0, size, self.target):
            raise OSError(ctypes.get_errno(), "sched_setaffinity")
        if self.libnuma.set_mempolicy(MPOL_PREFERRED, self.nodes, self.WORDS * 64):
            raise OSError(ctypes.get_errno(), "set_mempolicy")

    def __exit__(self, *exc_info: object) -> None:
        if self.libc.sched_setaffinity(0, ctypes.sizeof(self.saved_cpus), self.saved_cpus):
            raise OSError(ctypes.get_errno(), "sched_setaffinity")
        if self.libnuma.set_mempolicy(self.saved_mode.value, self.saved_nodes, self.WORDS * 64):
            raise OSError(ctypes.get_errno(), "set_mempolicy")


def numafast_cycles() -> None:
    numa_local = numafast.numa_local
    for _ in range(CYCLES):
        with numa_local(NODE):
            pass


def ctypes_cycles() -> None:
    for _ in range(CYCLES):
        with CtypesNumaLocal(NODE, NODE_CPUS):
            pass


MEDIANS: dict[tuple[str, str], float] = {}
# "on node": the thread already runs on exactly the node's CPUs (numafast skips
# that set); "moving": the thread starts pinned to one CPU, so every variant
# really changes the CPU mask on entry and back on exit.
SCENARIOS = ["on node", "moving"]


@pytest.fixture(params=SCENARIOS)
def scenario(request: pytest.FixtureRequest) -> Iterator[str]:
    before = os.sched_getaffinity(0)
    if request.param == "moving":
        if len(NODE_CPUS) < 2:
            pytest.skip(f"node {NODE} has one CPU: a thread on it cannot start elsewhere on it")
        os.sched_setaffinity(0, {NODE_CPUS[-1]})
    else:
        os.sched_setaffinity(0, NODE_CPUS)
    yield request.param
    os.sched_setaffinity(0, before)


def run(benchmark, scenario: str, name: str, function: Callable[[], object]) -> None:  # type: ignore[no-untyped-def]
    before = (os.sched_getaffinity(0), _libnuma.get_mempolicy())
    benchmark.group = f"numa_local enter+exit, {scenario}"
    benchmark.pedantic(function, rounds=30, iterations=1, warmup_rounds=2)
    assert (os.sched_getaffinity(0), _libnuma.get_mempolicy()) == before
    MEDIANS[(scenario, name)] = benchmark.stats.stats.median


def test_c_loop(benchmark, scenario, c_loop) -> None:  # type: ignore[no-untyped-def]
    run(benchmark, scenario, "c", lambda: c_loop() == 0 or pytest.fail("C loop failed"))


def test_ctypes(benchmark, scenario) -> None:  # type: ignore[no-untyped-def]
    run(benchmark, scenario, "ctypes", ctypes_cycles)


def test_numafast(benchmark, scenario) -> None:  # type: ignore[no-untyped-def]
    run(benchmark, scenario, "numafast", numafast_cycles)


def test_report_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    """Runs last: the ratios of the medians measured above, in this same run."""
    if not MEDIANS:
        pytest.skip("no benchmark ran (--benchmark-disable?)")
    per_cycle = {key: median / CYCLES * 1e6 for key, median in MEDIANS.items()}
    with capsys.disabled():
        print()
        for scenario in SCENARIOS:
            if (scenario, "numafast") not in per_cycle:
                continue
            for name in ("c", "ctypes", "numafast"):
                print(f"numa_local enter+exit, {scenario}, {name:>8}: median {per_cycle[scenario, name]:.2f} us per cycle")
            numafast_us = per_cycle[scenario, "numafast"]
            print(f"{scenario}: ratio numafast / C loop {numafast_us / per_cycle[scenario, 'c']:.2f}x (aim: <= 1.25x), "
                  f"numafast / ctypes {numafast_us / per_cycle[scenario, 'ctypes']:.2f}x")
