"""One matrix of ``numafast bench``, measured cell by cell: :func:`measure_grid`.

What every matrix shares, CPU x memory node (measure.py) and host node x GPU
(gpu.py) alike: each cell is measured by a function of (run, row, column) that
returns a :class:`Cell` or raises :class:`~numafast.cli.bench.in_progress.Unmeasurable`
with the reason, which the matrix keeps in ``missing``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from numafast.cli.bench.result import Matrix, cell_key
from numafast.cli.bench.in_progress import Run, Unmeasurable
from numafast.cli.bench.settings import WARMUP


@dataclass
class Cell:
    """A measured cell: its value, how many threads did it, what its placement checks saw."""

    value: float
    threads: int
    placement: dict[str, Any]



def measure_grid(
    run: Run,
    name: str,
    rows: list[int],
    cols: list[int],
    cell: Callable[[Run, int, int], Cell],
    *,
    bytes: int,
    statistic: str,
    per_repetition: int,
    per_repetition_unit: str,
    streams: int | None = None,
) -> Matrix:
    """A ``rows`` x ``cols`` matrix, cell by cell; a cell that cannot be measured says why."""
    values: list[list[float | None]] = []
    threads: list[list[int]] = []
    missing: dict[str, str] = {}
    placement: dict[str, dict[str, Any]] = {}
    for row in rows:
        values.append([])
        threads.append([])
        for col in cols:
            key = cell_key(row, col)
            try:
                result = cell(run, row, col)
            except Unmeasurable as reason:
                values[-1].append(None)
                threads[-1].append(0)
                missing[key] = str(reason)
            else:
                values[-1].append(result.value)
                threads[-1].append(result.threads)
                placement[key] = result.placement
            run.tick(f"{name} {key}")
    return Matrix(
        name=name, rows=rows, cols=cols, values=values, missing=missing, threads=threads, bytes=bytes,
        repetitions=run.settings.repetitions_of(name), warmup=WARMUP, statistic=statistic,
        per_repetition=per_repetition, per_repetition_unit=per_repetition_unit, placement=placement,
        streams=streams,
    )  # fmt: skip
