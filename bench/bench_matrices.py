"""The benchmark of the benchmark: ``numafast bench``'s figures against plain C
references compiled in the same run with the system compiler at -O2.

* ``bench/reference/stream.c``: STREAM's copy and triad kernels (OpenMP, as STREAM
  is), plus a read loop; compared with read_gbps and copy_gbps.
* ``bench/reference/chase.c``: a random pointer chase; compared with latency_ns.

Each case runs on node NUMAFAST_BENCH_NODE (default 0) with one thread and with
all of the node's allowed CPUs, on buffers of the size ``numafast bench`` picks
(4x the last-level cache; NUMAFAST_BENCH_MIB overrides), with the same warm-up
and best-of-N as numafast. Rounds alternate: a C round (pytest-benchmark's
untimed setup), then a numafast round (timed: one whole ``numafast.bench()``
call, allocation included). The goal is agreement within 5%: the ratios of the
medians print at the end.

    python3 -m pytest bench/bench_matrices.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import numafast
from numafast.binding import cpus_allowed
from numafast.cli.bench.measure import MEASURERS, live_topology
from numafast.cli.bench.in_progress import chase_steps
from numafast.cli.bench.settings import REPETITIONS, resolve_settings

REFERENCE = Path(__file__).resolve().parent / "reference"
NODE = int(os.environ.get("NUMAFAST_BENCH_NODE", "0"))
NODE_CPUS = [cpu for cpu in numafast.topology().node(NODE).cpus if cpu in cpus_allowed()]
ROUNDS = 15
GOAL = 0.05


def default_size() -> int:
    if "NUMAFAST_BENCH_MIB" in os.environ:
        return int(os.environ["NUMAFAST_BENCH_MIB"]) << 20
    from numafast.cli.bench.machine import describe

    machine = live_topology()
    settings = resolve_settings(machine, describe(machine), MEASURERS, nodes=[NODE], matrices=None, threads=None, size=None,
                                repetitions=None, quick=False, copy_by="destination")  # fmt: skip
    return settings.size


SIZE = default_size()
# (matrix, threads, what the C reference prints for it)
CASES = [
    ("read_gbps", 1, "read"),
    ("read_gbps", len(NODE_CPUS), "read"),
    ("copy_gbps", 1, "copy"),
    ("copy_gbps", len(NODE_CPUS), "copy"),
    ("latency_ns", 1, "latency"),
]
FIGURES: dict[tuple[str, int], dict[str, list[float]]] = {}


@pytest.fixture(scope="module")
def references() -> Iterator[dict[str, Path]]:
    with tempfile.TemporaryDirectory() as build:
        programs = {"stream": Path(build, "stream"), "chase": Path(build, "chase")}
        subprocess.run(["cc", "-O2", "-fopenmp", str(REFERENCE / "stream.c"), "-o", str(programs["stream"])], check=True)
        subprocess.run(["cc", "-O2", str(REFERENCE / "chase.c"), "-o", str(programs["chase"])], check=True)
        yield programs


def run_reference(references: dict[str, Path], name: str, threads: int) -> dict[str, float]:
    """One run of the C reference for ``name``: {figure name: value}."""
    if name == "latency_ns":
        steps = chase_steps(SIZE)
        command = [str(references["chase"]), str(NODE_CPUS[0]), str(SIZE), str(steps), str(REPETITIONS[name])]
        environment = dict(os.environ)
    else:
        command = [str(references["stream"]), str(SIZE), str(REPETITIONS[name])]
        cpus = ",".join(f"{{{cpu}}}" for cpu in NODE_CPUS[:threads])
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "close", "OMP_PLACES": cpus}
    output = subprocess.run(command, capture_output=True, text=True, check=True, env=environment).stdout
    return {line.split()[0]: float(line.split()[1]) for line in output.splitlines()}


@pytest.mark.parametrize(("name", "threads", "figure"), CASES, ids=[f"{n}-{t}threads" for n, t, _ in CASES])
def test_numafast_agrees_with_c(benchmark, references, name: str, threads: int, figure: str) -> None:  # type: ignore[no-untyped-def]
    figures: dict[str, list[float]] = {"c": [], "numafast": [], "triad": []}

    def c_round() -> None:
        printed = run_reference(references, name, threads)
        figures["c"].append(printed[figure])
        if "triad" in printed:
            figures["triad"].append(printed["triad"])

    def numafast_round() -> None:
        result = numafast.bench(nodes=[NODE], matrices=[name], threads=threads, size=SIZE)
        value = result.matrices[name].value(NODE, NODE)
        assert value is not None, result.matrices[name].missing
        figures["numafast"].append(value)

    benchmark.group = f"numafast bench {name}, {threads} threads"
    benchmark.pedantic(numafast_round, setup=c_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    # The first of each is the warm-up round's.
    FIGURES[name, threads] = {key: values[1:] for key, values in figures.items()}


def test_report_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    """Runs last: medians of each case's rounds, and numafast / C."""
    if not FIGURES:
        pytest.skip("no benchmark ran (--benchmark-disable?)")
    with capsys.disabled():
        print(f"\nnumafast bench vs plain C (-O2), node {NODE}, buffers of {SIZE >> 20} MiB, "
              f"medians of {ROUNDS} rounds (each the best of N after a warm-up):")  # fmt: skip
        for (name, threads), figures in FIGURES.items():
            unit = "ns" if name == "latency_ns" else "GB/s"
            c, ours = statistics.median(figures["c"]), statistics.median(figures["numafast"])
            ratio = ours / c
            verdict = "within 5%" if abs(ratio - 1) <= GOAL else f"MISSED: off by {abs(ratio - 1):.1%}"
            triad = f" (C triad {statistics.median(figures['triad']):.2f} GB/s)" if figures["triad"] and name == "copy_gbps" else ""
            print(f"  {name:<10} {threads} thread{'s' if threads > 1 else ' '}: numafast {ours:8.2f} {unit:<4} "
                  f"C {c:8.2f} {unit:<4} ratio {ratio:.3f}  {verdict}{triad}")  # fmt: skip
