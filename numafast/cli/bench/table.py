"""The text of ``numafast bench``: each matrix laid out like ``numactl -H``'s distances,
with its unit, the remote/local ratios of each row, and why empty cells are empty."""

from __future__ import annotations

import string
from collections.abc import Iterator

from numafast._validate import format_ids
from numafast.cli.bench.machine import largest_llc
from numafast.cli.bench.result import BenchResult, Matrix
from numafast.cli.bench.settings import CPU_MATRICES, LLC_FACTOR, SIZE_WITHOUT_LLC

# The corner of each table: what its rows and columns are.
AXIS_NAMES = {
    "cpu_node": "cpu",
    "memory_node": "mem",
    "source_node": "from",
    "destination_node": "to",
    "cuda_device": "gpu",
}


def _mib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / (1 << 20):.0f} MiB"


def cache_answered(result: BenchResult) -> str | None:
    """Why the CPU matrices measured the caches, not memory (buffers under LLC_FACTOR x the
    largest last-level cache a cell can use), saying how to measure memory; None when
    the buffers were big enough. A --quick run's 8 MiB usually are not."""
    size = result.settings["size"]
    llc = largest_llc(result.machine, result.settings["nodes"])
    if llc is None:
        if size >= SIZE_WITHOUT_LLC:
            return None
        return (f"sysfs does not give the last-level cache's size here, so buffers of {_mib(size)} may have "
                f"measured the caches, not memory; for memory give --size {SIZE_WITHOUT_LLC >> 20}M")  # fmt: skip
    if not llc or size >= LLC_FACTOR * llc:
        return None
    return (
        f"CACHE, NOT MEMORY: buffers of {_mib(size)} are under {LLC_FACTOR}x the {_mib(llc)} last-level cache, so the "
        f"matrices marked [cache] measured the caches; for memory give --size {-(-LLC_FACTOR * llc // (1 << 20))}M "
        "(or drop --quick)"
    )


def render(result: BenchResult) -> Iterator[str]:
    """The whole report: a machine line, the settings, then each matrix."""
    machine, settings = result.machine, result.settings
    nodes = machine["nodes"]
    llc = sorted({_mib(n["llc_bytes"]) for n in nodes if n["cpus"]})
    yield (
        f"numafast bench {result.version} on {machine['hostname']}: {machine['cpu_model']}, "
        f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}, {len(machine['allowed_cpus'])} allowed CPUs, LLC per node {'/'.join(llc) or 'none'}, "
        f"THP {machine['thp']}"
    )
    quick = "; --quick: few repetitions, figures indicative only" if settings["quick"] else ""
    yield f"nodes {format_ids(settings['nodes'])}, buffers of {_mib(settings['size'])}{quick}"
    cache = cache_answered(result)
    if cache is not None:
        yield cache
    gpu_nodes = {gpu["index"]: gpu["node"] for gpu in machine.get("gpus", [])}
    for matrix in result.matrices.values():
        yield ""
        yield from render_matrix(matrix, gpu_nodes, cache=cache is not None and matrix.name in CPU_MATRICES)
    failures = result.placement_failures
    if failures:
        yield ""
        yield f"{len(failures)} cells failed their placement check:"
        yield from (f"  {failure}" for failure in failures)


def _threads_text(matrix: Matrix) -> str:
    counts = sorted({n for row in matrix.threads for n in row if n})
    if not counts:
        return "no cell measured"
    text = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{text} thread{'s' if counts[-1] > 1 else ''} per cell"


def _format(value: float, unit: str) -> str:
    return f"{value:.1f}" if unit == "ns" else f"{value:.2f}"


def render_matrix(matrix: Matrix, gpu_nodes: dict[int, int | None] | None = None, *, cache: bool = False) -> Iterator[str]:
    """One matrix: title line, the table with a remote/local column, the reasons for empty cells.

    For a GPU matrix (columns: CUDA devices, ``gpu_nodes`` their nodes) a row's ratios
    compare it with each GPU's own node's row. ``cache``: its buffers fit the caches,
    so its title says that it measured them.
    """
    kind = matrix.kind
    streams = f", {matrix.streams} stream{'s' if matrix.streams != 1 else ''}" if matrix.streams else ""
    yield (
        f"{matrix.name}{' [cache]' if cache else ''} ({kind.unit}, {kind.better} is better): {_threads_text(matrix)}{streams}, "
        f"{matrix.statistic} of {matrix.repetitions} after {matrix.warmup} warm-up"
    )
    labels: dict[str, str] = {}  # reason -> "[a]"
    for reason in matrix.missing.values():
        labels.setdefault(reason, f"[{string.ascii_lowercase[len(labels) % 26]}]")
    cells = [
        [
            labels[matrix.missing[f"{row},{col}"]] if value is None else _format(value, kind.unit)
            for col, value in zip(matrix.cols, values, strict=True)
        ]
        for row, values in zip(matrix.rows, matrix.values, strict=True)
    ]
    corner = f"{AXIS_NAMES[kind.row_kind]}\\{AXIS_NAMES[kind.col_kind]}"
    width = max(7, *(len(text) + 1 for line in cells for text in line), *(len(str(c)) + 1 for c in matrix.cols))
    first = max(len(corner), *(len(str(r)) for r in matrix.rows))
    yield f"  {corner:>{first}}" + "".join(f"{col:>{width}}" for col in matrix.cols) + "   remote/local"
    for row, line in zip(matrix.rows, cells, strict=True):
        cells_text = "".join(f"{text:>{width}}" for text in line)
        ratios = _gpu_ratios(matrix, row, gpu_nodes or {}) if kind.col_kind == "cuda_device" else matrix.remote_over_local(row)
        yield f"  {row:>{first}}{cells_text}   {_range_text([ratio for _, ratio in ratios])}".rstrip()
    for reason, label in labels.items():
        where = " ".join(key for key, why in matrix.missing.items() if why == reason)
        yield f"  {label} {reason} (cells {where})"


def _gpu_ratios(matrix: Matrix, row: int, gpu_nodes: dict[int, int | None]) -> list[tuple[int, float]]:
    """(GPU, value / the value from the GPU's own node) for each GPU that is not on ``row``."""
    ratios = []
    for col, value in zip(matrix.cols, matrix.values[matrix.rows.index(row)], strict=True):
        own = gpu_nodes.get(col)
        if value is None or own is None or own == row or own not in matrix.rows:
            continue
        local = matrix.value(own, col)
        if local:
            ratios.append((col, value / local))
    return ratios


def _range_text(ratios: list[float]) -> str:
    if not ratios:
        return ""
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}" if round(low, 2) == round(high, 2) else f"{low:.2f}-{high:.2f}"
