"""Health checks over a bench result: ``--expect-local-ratio R`` and ``--expect-h2d GBPS``.

Each returns the failing cells, named as "MATRIX[ROW,COL]" with the figures that
failed, so that an operator sees which node or link to look at.
"""

from __future__ import annotations

import math

from numafast.cli.bench.result import BenchResult


def check_local_ratio(ratio: object) -> float:
    """R as a float, if it is a finite number of at least 1 (below 1 every remote cell
    would fail, an infinite one none could)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < math.inf:
        raise ValueError(
            f"expected local ratio {ratio!r}: give a finite number >= 1 (how many times worse than local a remote cell may be)"
        )
    return float(ratio)


def local_ratio_unchecked(result: BenchResult) -> str | None:
    """Why ``--expect-local-ratio`` compared no cell in ``result`` (None when it compared some):
    one node, or no row with both a local and a remote measured cell."""
    if any(matrix.remote_over_local(row) for matrix in result.matrices.values() for row in matrix.rows):
        return None
    return "no row has both a local and a measured remote cell (one node, or every remote cell missing)"


def h2d_unchecked(result: BenchResult) -> str | None:
    """Why ``--expect-h2d`` compared no cell in ``result`` (None when it compared some)."""
    matrix = result.matrices.get("h2d_gbps")
    if matrix is not None and any(value is not None for line in matrix.values for value in line):
        return None
    return "the h2d_gbps matrix has no measured cell"


def local_ratio_failures(result: BenchResult, ratio: float) -> list[str]:
    """Remote cells more than ``ratio`` times worse than their row's local cell.

    "Worse" follows the unit: a remote latency above R x the local one, a remote
    bandwidth below the local one / R. Rows with no local cell (a memory-less
    node's CPUs) have nothing to compare with and are skipped.
    """
    failures: list[str] = []
    for name, matrix in result.matrices.items():
        lower_is_better = matrix.kind.better == "lower"
        for row in matrix.rows:
            local = matrix.local(row)
            for col, remote_over_local in matrix.remote_over_local(row):
                factor = remote_over_local if lower_is_better else 1 / remote_over_local
                if factor > ratio:
                    remote = matrix.value(row, col)
                    failures.append(
                        f"{name}[{row},{col}]: {remote:.2f} {matrix.unit} is {factor:.2f}x worse than the local "
                        f"{local:.2f} {matrix.unit} of row {row} (expected at most {ratio:g}x)"
                    )
    return failures


def h2d_failures(result: BenchResult, gbps: float) -> list[str]:
    """Cells of the h2d_gbps matrix below ``gbps`` (every row: a node of host memory;
    every column: a CUDA device). ValueError when the run has no such matrix."""
    matrix = result.matrices.get("h2d_gbps")
    if matrix is None:
        raise ValueError("--expect-h2d: this run measured no h2d_gbps matrix")
    return [
        f"h2d_gbps[{row},{col}]: {value:.2f} GB/s from node {row} to GPU {col}, below the expected {gbps:g} GB/s"
        for row, values in zip(matrix.rows, matrix.values, strict=True)
        for col, value in zip(matrix.cols, values, strict=True)
        if value is not None and value < gbps
    ]
