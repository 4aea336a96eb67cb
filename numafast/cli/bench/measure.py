"""Measuring the matrices of ``numafast bench``: :func:`bench`.

Each cell runs on a :class:`~numafast.cli.bench.in_progress.Run`'s buffers once they pass
their placement checks; the timed loops are the extension's (src/bench.pxi): C,
GIL released, threads pinned one to a CPU, all started on a barrier.

STREAM's rules: buffers at least 4x the largest last-level cache of a node (the
caches one cell's threads can use), one untimed warm-up repetition, then the
best of N; GB/s are 1e9 bytes per second, a copy counting the bytes it reads
and those it writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any

from numafast import _libnuma
from numafast.cli.bench import gpu
from numafast.cli.bench import machine as machine_summary
from numafast.cli.bench.grid import Cell, measure_grid
from numafast.cli.bench.result import MATRICES, BenchResult, Matrix
from numafast.cli.bench.in_progress import Run, Timings, Unmeasurable, check_pages, check_threads
from numafast.cli.bench.settings import WARMUP, resolve_settings
from numafast.topo import Topology
from numafast.topo.read import read_topology

# time_copy (STREAM's loop) or time_memcpy: (source, destination, cpus, repetitions) -> timings.
Timer = Callable[[Any, Any, list[int], int], Timings]


def _timed_cell(run: Run, name: str, cpu_node: int, timed: Timings, buffers: dict[str, Any]) -> Cell:
    """The cell's value from the best timed repetition, once its threads pass their check."""
    seconds, placed = timed
    cpus = check_threads(placed, cpu_node)
    best = min(seconds[WARMUP:])
    per_repetition = _per_repetition(run, name)[0]
    value = best / per_repetition * 1e9 if MATRICES[name].unit == "ns" else per_repetition / best / 1e9
    return Cell(value, len(placed), {"cpus": cpus, "cpu_node": cpu_node, "buffers": buffers})


# ---------------------------------------------------------------- the cells of each CPU matrix


def latency_cell(run: Run, row: int, col: int) -> Cell:
    cpu = run.cpus_of(row)[0]
    chain = run.chain(col)
    buffers = {"source": check_pages(chain, col, "source")}
    timed = _libnuma.time_chase(chain, cpu, run.chase_steps, WARMUP + run.settings.repetitions_of("latency_ns"))
    return _timed_cell(run, "latency_ns", row, timed, buffers)


def read_cell(run: Run, row: int, col: int) -> Cell:
    cpus = run.cpus_of(row)
    source = run.buffer(col, "source")
    buffers = {"source": check_pages(source, col, "source")}
    timed = _libnuma.time_read(source, cpus, WARMUP + run.settings.repetitions_of("read_gbps"))
    return _timed_cell(run, "read_gbps", row, timed, buffers)


def copy_cell(run: Run, row: int, col: int) -> Cell:
    return _copy(run, "copy_gbps", row, col, col, _libnuma.time_copy)


def node_copy_cell(run: Run, row: int, col: int) -> Cell:
    by_source = run.settings.copy_by == "source"
    try:
        return _copy(run, "node_copy_gbps", row if by_source else col, row, col, _libnuma.time_memcpy)
    except Unmeasurable as reason:
        if str(reason).endswith("has no CPUs"):
            other = "destination's (the default)" if by_source else "source's (--copy-by source)"
            raise Unmeasurable(f"{reason} to copy with; the {other} could") from None
        raise


def _copy(run: Run, name: str, cpu_node: int, source_node: int, destination_node: int, timer: Timer) -> Cell:
    cpus = run.cpus_of(cpu_node)
    source = run.buffer(source_node, "source")
    destination = run.buffer(destination_node, "destination")
    buffers = {
        "source": check_pages(source, source_node, "source"),
        "destination": check_pages(destination, destination_node, "destination"),
    }
    timed = timer(source, destination, cpus, WARMUP + run.settings.repetitions_of(name))
    return _timed_cell(run, name, cpu_node, timed, buffers)


def _per_repetition(run: Run, name: str) -> tuple[int, str]:
    """What one repetition of a CPU matrix's cell counts: its loads (latency) or the
    bytes it moves (a copy counts those it reads and those it writes, as STREAM does)."""
    if name == "latency_ns":
        return run.chase_steps, "loads"
    return (run.settings.size if name == "read_gbps" else 2 * run.settings.size), "bytes"


def measure_cells(run: Run, name: str, cell: Callable[[Run, int, int], Cell]) -> Matrix:
    """A node x node matrix, cell by cell; a cell that cannot be measured says why."""
    per_repetition, unit = _per_repetition(run, name)
    nodes = list(run.settings.nodes)
    return measure_grid(
        run, name, nodes, nodes, cell, bytes=run.settings.size, statistic="best",
        per_repetition=per_repetition, per_repetition_unit=unit,
    )  # fmt: skip


# The matrices a run can measure, in the order it measures them: name -> what
# measures the whole matrix. The GPU x host-node matrices (gpu.MEASURERS; see
# result.py for their rows, columns and counting) join them where CUDA is usable.
MEASURERS: dict[str, Callable[[Run], Matrix]] = {
    "latency_ns": lambda run: measure_cells(run, "latency_ns", latency_cell),
    "read_gbps": lambda run: measure_cells(run, "read_gbps", read_cell),
    "copy_gbps": lambda run: measure_cells(run, "copy_gbps", copy_cell),
    "node_copy_gbps": lambda run: measure_cells(run, "node_copy_gbps", node_copy_cell),
}


def cuda_problem() -> str | None:
    """Why this machine's GPU x host-node matrices cannot be measured; None when they can."""
    return gpu.unavailable(live_topology())


def live_topology() -> Topology:
    """This machine as the process sees it now, without asking GPU libraries (no torch import)."""
    return read_topology("/", cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), live=True)


def bench(
    *,
    nodes: Iterable[int] | None = None,
    matrices: str | Iterable[str] | None = None,
    threads: int | None = None,
    size: int | None = None,
    repetitions: int | None = None,
    quick: bool = False,
    copy_by: str = "destination",
    progress: Callable[[int, int, str], None] | None = None,
) -> BenchResult:
    """Measure latency and bandwidth between every pair of ``nodes`` (default: all).

    ``matrices``: a name or a list of names among latency_ns, read_gbps, copy_gbps,
    node_copy_gbps (and h2d_gbps, d2h_gbps, h2d_concurrent_gbps, d2h_concurrent_gbps
    with CUDA); default: all that can be measured here.
    ``threads``: at most this many threads per cell (default: every allowed CPU of the
    node; latency always uses one). ``size``: bytes per buffer (default: 4x the
    largest last-level cache, at least 64 MiB; a smaller one is refused unless
    ``quick``). ``repetitions``: timed repetitions after one warm-up, at most 10000
    (default 5 for latency, 10 for bandwidth). ``quick``: 8 MiB buffers and 2 repetitions, for a
    smoke test (the figures then measure caches as much as memory). ``copy_by``:
    whose CPUs do node_copy_gbps's copies, "destination" or "source".
    ``progress(done, total, label)`` is called after each cell.

    Buffers are freed when it returns, raises or is interrupted; the calling
    thread's affinity and memory policy are never changed (only the timing
    threads, which end with each cell, are pinned).
    """
    from numafast import __version__

    created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    machine = live_topology()
    summary = machine_summary.describe(machine)
    gpu_problem = gpu.unavailable(machine)
    measurers = MEASURERS if gpu_problem else {**MEASURERS, **gpu.MEASURERS}
    settings = resolve_settings(
        machine, summary, gpu_problem, nodes=nodes, matrices=matrices, threads=threads, size=size,
        repetitions=repetitions, quick=quick, copy_by=copy_by,
    )  # fmt: skip
    with Run(settings, machine, progress) as run:
        if progress is not None:
            progress(0, run.cells_total, "allocating")
        measured = {name: measurers[name](run) for name in settings.matrices}
    return BenchResult(__version__, created, settings.to_dict(), summary, measured)
