"""``numafast bench``: what placement is worth on this machine, node by node.

Matrices (rows x columns; see result.py for the JSON schema, numafast.bench/1):

* ``latency_ns``: ns per dependent load, CPU node x memory node (one thread, a
  random pointer chase over a buffer several times the last-level cache);
* ``read_gbps``, ``copy_gbps``: GB/s, CPU node x memory node (every allowed CPU
  of the row node, or ``--threads N``; STREAM's rules);
* ``node_copy_gbps``: GB/s of memcpy from a buffer on node s to one on node d,
  by the CPUs of d (``--copy-by source``: of s);
* ``h2d_gbps``, ``d2h_gbps`` and their ``*_concurrent_gbps`` twins: GB/s between a
  page-locked buffer on each node and each CUDA device, where PyTorch sees one (gpu.py).

Every cell is checked against the kernel before it is kept (its buffers' pages,
its threads' CPUs); a cell that cannot be measured is shown with its reason.
``--expect-local-ratio`` and ``--expect-h2d`` make it a health check: the exit
status is 1 and the failing cells are named. Ctrl-C stops after the current cell
with every buffer freed (exit status 130).

The same as a Python API: :func:`bench` returns a :class:`BenchResult`.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING, TextIO

from numafast.cli.arguments import count, node_list, threshold
from numafast.cli.bench.health import (
    check_local_ratio,
    h2d_failures,
    h2d_unchecked,
    local_ratio_failures,
    local_ratio_unchecked,
)
from numafast.cli.bench.result import COPY_BY, MATRICES, MAX_REPETITIONS, BenchResult

if TYPE_CHECKING:
    from numafast.cli.bench.measure import bench

__all__ = ["BenchResult", "bench"]

SIZE = re.compile(r"(\d+)\s*([KMG]?)(?:i?B)?", re.IGNORECASE)
EXIT_INTERRUPTED = 130


def parse_size(text: str) -> int:
    """'134217728', '128M', '128MiB', '1G' -> bytes (K, M and G are powers of 1024)."""
    match = SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with K, M or G)")
    return int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2].upper()]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure latency and bandwidth between every pair of nodes (a health check with --expect-*)",
        description="What placement is worth on this machine: latency and bandwidth matrices, node by node.",
    )
    parser.add_argument("--nodes", type=node_list, metavar="LIST", help="only these nodes, e.g. 0-1 or !0, numactl's syntax (default: all)")
    parser.add_argument(
        "--matrix", action="append", choices=list(MATRICES), metavar="NAME",
        help=f"measure only this matrix (repeatable): {', '.join(MATRICES)}",
    )  # fmt: skip
    parser.add_argument("--threads", type=count(1), metavar="N", help="at most N threads per cell (default: all allowed CPUs of the node)")
    parser.add_argument("--size", type=parse_size, metavar="BYTES", help="bytes per buffer, e.g. 512M (default: 4x the LLC, >= 64M)")
    parser.add_argument("--repetitions", type=count(1, MAX_REPETITIONS), metavar="N", help=f"timed repetitions after one warm-up, at most {MAX_REPETITIONS} (default: 5 latency, 10 bandwidth)")
    parser.add_argument("--quick", action="store_true", help="8 MiB buffers and 2 repetitions: a smoke test; where 8 MiB is under 4x the LLC, says it measured the caches")
    parser.add_argument("--copy-by", choices=COPY_BY, default="destination", help="node_copy_gbps: whose CPUs copy (default: destination)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (schema numafast.bench/1)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the matrices as heat maps (needs matplotlib)")
    parser.add_argument("--expect-local-ratio", type=threshold(1), metavar="R",
                        help="fail when a remote cell is more than R times worse than its row's local cell")  # fmt: skip
    parser.add_argument("--expect-h2d", type=threshold(0, inclusive=False), metavar="GBPS", help="fail when a host-to-GPU cell is below GBPS (needs CUDA)")
    parser.set_defaults(run=run)


class ProgressBar:
    """A one-line bar on a terminal's stderr, cleared when done."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream, self.width = stream, width

    def __call__(self, done: int, total: int, label: str) -> None:
        filled = self.width * done // max(total, 1)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {label:<24}")
        self.stream.flush()

    def clear(self) -> None:
        self.stream.write("\r" + " " * (self.width + 40) + "\r")
        self.stream.flush()


def check_before_measuring(args: argparse.Namespace) -> None:
    """Every mistake the options can hold, found before anything is allocated."""
    if args.expect_local_ratio is not None:
        check_local_ratio(args.expect_local_ratio)
    if args.expect_h2d is not None:
        from numafast.cli.bench.measure import cuda_problem

        problem = cuda_problem()
        if problem:
            raise ValueError(f"--expect-h2d needs CUDA (the h2d_gbps matrix): {problem}")
        if args.matrix and "h2d_gbps" not in args.matrix:
            raise ValueError("--expect-h2d needs the h2d_gbps matrix, which --matrix leaves out")
    if args.plot is not None:
        from numafast.cli.bench.plot import check_writable, require_matplotlib

        require_matplotlib()
        check_writable(args.plot)


def run(args: argparse.Namespace) -> int:
    # Here, not above: measuring imports NumPy and the pools, which the other commands,
    # whose parser is built beside this one's, do without.
    from numafast.cli.bench.measure import bench
    from numafast.cli.bench.table import render

    progress = ProgressBar(sys.stderr) if sys.stderr.isatty() else None
    try:
        try:
            check_before_measuring(args)
            result = bench(
                nodes=args.nodes, matrices=args.matrix, threads=args.threads, size=args.size,
                repetitions=args.repetitions, quick=args.quick, copy_by=args.copy_by, progress=progress,
            )  # fmt: skip
        finally:
            if progress is not None:
                progress.clear()
    except ImportError as error:
        print(f"numafast bench: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("numafast bench: interrupted; every buffer was freed", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(result.to_json() if args.json else "\n".join(render(result)), flush=True)
    if args.plot is not None:
        from numafast.cli.bench.plot import draw

        draw(result, args.plot)
    failures = result.placement_failures
    if not any(value is not None for m in result.matrices.values() for line in m.values for value in line):
        failures.append("no cell could be measured (the reasons are in the output)")
    if args.expect_local_ratio is not None:
        failures += local_ratio_failures(result, args.expect_local_ratio)
        if (why := local_ratio_unchecked(result)) is not None:
            print(f"numafast bench: --expect-local-ratio checked nothing: {why}", file=sys.stderr)
    if args.expect_h2d is not None:
        failures += h2d_failures(result, args.expect_h2d)
        if (why := h2d_unchecked(result)) is not None:
            failures.append(f"--expect-h2d checked nothing: {why}")
    for failure in failures:
        print(f"numafast bench: FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


def __getattr__(name: str) -> object:
    """``bench``, the Python API, imported on first use (see :func:`run`)."""
    if name == "bench":
        from numafast.cli.bench.measure import bench

        return bench
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
