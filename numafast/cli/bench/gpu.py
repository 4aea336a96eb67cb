"""The GPU x host-node matrices of ``numafast bench``: ``h2d_gbps``, ``d2h_gbps`` and their
concurrent-stream twins ``h2d_concurrent_gbps``, ``d2h_concurrent_gbps``.

Rows are host memory nodes, columns CUDA devices. Each row gets one page-locked,
CUDA-registered buffer on its node (a :class:`numafast.PinnedPool` slot, whose pages
are checked against the kernel before any timing); a cell is the median GB/s of
several copies of the whole buffer, timed with CUDA events by
:mod:`numafast.cuda`, the one module that touches ``torch.cuda``. One big copy
on one stream can hide a NUMA penalty that several concurrent copies show, hence
the concurrent matrices (:data:`CONCURRENT_STREAMS` streams, each a share of the buffer).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial

from numafast.cli.bench.grid import Cell, measure_grid
from numafast.cli.bench.result import Matrix
from numafast.cli.bench.in_progress import Run, check_pages
from numafast.cli.bench.settings import WARMUP
from numafast.topo import Topology

MIB = 1 << 20
TRANSFER_BYTES = 256 * MIB  # "a few hundred MiB": what a loader's batch copies are like
QUICK_TRANSFER_BYTES = 16 * MIB
CONCURRENT_STREAMS = 4
NO_GPU = "no CUDA device here (no GPU in /sys/bus/pci, or CUDA_VISIBLE_DEVICES hides them all)"


def unavailable(machine: Topology) -> str | None:
    """Why the GPU matrices cannot be measured on ``machine``; None when they can.

    PyTorch is imported only where sysfs shows a GPU: it is what times the copies.
    """
    if not machine.gpus:
        return NO_GPU
    try:
        from numafast import cuda
    except ImportError as error:
        return f"the GPU matrices need PyTorch with CUDA (pip install numafast[torch]): {error}"
    if not cuda.usable():
        return cuda.why_not_usable()
    return None


def transfer_bytes(run: Run) -> int:
    return QUICK_TRANSFER_BYTES if run.settings.quick else TRANSFER_BYTES


def measure(run: Run, name: str) -> Matrix:
    """One GPU x host-node matrix, cell by cell; a cell that cannot be measured says why."""
    from numafast import cuda  # imports torch: only once a GPU matrix is measured

    to_device = name.startswith("h2d")
    streams = CONCURRENT_STREAMS if "concurrent" in name else 1
    nbytes = transfer_bytes(run)

    def cell(run: Run, node: int, gpu: int) -> Cell:
        host = run.pinned(node, nbytes)
        buffers = {"host": check_pages(host, node, "host")}
        rates = cuda.transfer_gbps(host, gpu, to_device=to_device, streams=streams,
                                   repetitions=run.settings.repetitions_of(name), warmup=WARMUP)  # fmt: skip
        # One host thread queues the copies; the GPU's copy engines do them.
        return Cell(statistics.median(rates), 1, {"cuda_device": gpu, "buffers": buffers})

    return measure_grid(
        run, name, list(run.settings.nodes), list(range(cuda.device_count())), cell, bytes=nbytes,
        statistic="median", per_repetition=nbytes, per_repetition_unit="bytes", streams=streams,
    )  # fmt: skip


MEASURERS: dict[str, Callable[[Run], Matrix]] = {
    name: partial(measure, name=name) for name in ("h2d_gbps", "d2h_gbps", "h2d_concurrent_gbps", "d2h_concurrent_gbps")
}
