"""``numafast bench --plot FILE.png``: every matrix as an annotated heat map.

matplotlib is an optional extra (``pip install numafast[plot]``); both it and the
output path are checked before anything is measured, so that a long run never
ends in an error it could have given at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from numafast.cli.bench.result import BenchResult, Matrix
from numafast.cli.bench.settings import LLC_FACTOR
from numafast.cli.bench.table import cache_answered

MISSING_COLOR = "#d9d9d9"


def require_matplotlib() -> None:
    """ImportError naming the extra to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install numafast[plot] (or pip install matplotlib)") from None


def check_writable(path: str | os.PathLike[str]) -> Path:
    """``path``, if a file can be written there now; OSError naming it and why otherwise.

    Opens it for appending (which changes nothing in an existing file) and removes
    it again if it did not exist before.
    """
    target = Path(path)
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as error:
        raise type(error)(f"cannot write the plot to {target}: {error.strerror}") from None
    if not existed:
        target.unlink()
    return target


def _heat_map(axes: Any, matrix: Matrix) -> None:
    import matplotlib
    import numpy as np

    kind = matrix.kind
    grid = np.array([[np.nan if v is None else v for v in row] for row in matrix.values], dtype=float)
    colormap = matplotlib.colormaps["viridis" if kind.better == "higher" else "viridis_r"].with_extremes(bad=MISSING_COLOR)
    image = axes.imshow(np.ma.masked_invalid(grid), cmap=colormap)
    axes.set_xticks(range(len(matrix.cols)), [str(c) for c in matrix.cols])
    axes.set_yticks(range(len(matrix.rows)), [str(r) for r in matrix.rows])
    axes.set_xlabel(kind.col_kind.replace("_", " "))
    axes.set_ylabel(kind.row_kind.replace("_", " "))
    axes.set_title(f"{matrix.name}\n{kind.unit}, {kind.better} is better", fontsize=10)
    finite = grid[np.isfinite(grid)]
    middle = (finite.min() + finite.max()) / 2 if finite.size else 0.0
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if np.isnan(value):
                text, color = "n/a", "black"
            else:
                text = f"{value:.0f}" if kind.unit == "ns" else f"{value:.1f}"
                bright = value > middle if kind.better == "higher" else value < middle
                color = "black" if bright else "white"
            axes.text(j, i, text, ha="center", va="center", fontsize=8, color=color)
    axes.figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04)


def draw(result: BenchResult, path: str | os.PathLike[str]) -> None:
    """Write the heat maps of ``result`` to ``path`` (PNG, or any format matplotlib knows by its suffix)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    matrices = list(result.matrices.values())
    figure = Figure(figsize=(3.4 * max(len(matrices), 1), 3.6), dpi=90, layout="constrained")
    for index, matrix in enumerate(matrices):
        _heat_map(figure.add_subplot(1, len(matrices), index + 1), matrix)
    machine = result.machine
    quick = ", --quick" if result.settings["quick"] else ""
    if cache_answered(result) is not None:
        quick += f": CPU matrices measured the caches, not memory (buffers under {LLC_FACTOR}x the LLC)"
    figure.suptitle(
        f"numafast bench {result.version}: {machine['hostname']}, {machine['cpu_model']}{quick}", fontsize=10
    )
    figure.savefig(path)
