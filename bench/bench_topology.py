"""Live topology() cold (re-read) and warm (cached) against what users do today: run
``numactl -H`` and ``lscpu -p`` in subprocesses and parse their text.

Run: python3 -m pytest bench/bench_topology.py  (the ratios print at the end)
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest

import numafast

medians: dict[str, float] = {}


def numactl_and_lscpu() -> dict[str, object]:
    """The baseline: nodes, CPUs, memory, distances and each CPU's core/socket/node from two tools."""
    numactl = subprocess.run(["numactl", "-H"], check=True, capture_output=True, text=True).stdout
    lscpu = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET,NODE"], check=True, capture_output=True, text=True).stdout
    nodes = {int(n): [int(c) for c in cpus.split()] for n, cpus in re.findall(r"^node (\d+) cpus:(.*)$", numactl, re.M)}
    sizes = {int(n): int(mb) for n, mb in re.findall(r"^node (\d+) size: (\d+) MB", numactl, re.M)}
    rows = [[int(d) for d in row.split()] for row in re.findall(r"^\s*\d+:((?:\s+\d+)+)\s*$", numactl, re.M)]
    cpus = [[int(f) if f else -1 for f in line.split(",")] for line in lscpu.splitlines() if not line.startswith("#")]
    return {"nodes": nodes, "sizes": sizes, "distances": rows, "cpus": cpus}


def record(name: str, benchmark: Any) -> None:
    medians[name] = benchmark.stats.stats.median


def test_baseline_numactl_and_lscpu_subprocesses(benchmark: Any) -> None:
    result = benchmark(numactl_and_lscpu)
    assert result["nodes"]
    record("baseline", benchmark)


def test_topology_cold(benchmark: Any) -> None:
    result = benchmark(lambda: numafast.topology(refresh=True))
    assert result.nodes
    record("cold", benchmark)


def test_topology_warm(benchmark: Any) -> None:
    numafast.topology()
    result = benchmark(numafast.topology)
    assert result.nodes
    record("warm", benchmark)


def test_print_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    if len(medians) < 3:
        pytest.skip("the three benchmarks above did not all run (--benchmark-disable?)")
    baseline = medians["baseline"]
    with capsys.disabled():
        print()
        print(f"numactl -H + lscpu -p (subprocesses), median: {baseline * 1e6:11.1f} us")
        for name in ("cold", "warm"):
            median = medians[name]
            print(f"topology() {name:<4}, median: {median * 1e6:11.1f} us   {baseline / median:10.1f}x faster")
