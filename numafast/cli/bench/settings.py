"""What a ``numafast bench`` run measures: its settings, checked before anything is
allocated (unknown nodes and matrices, sizes below STREAM's rule, GPU matrices
without CUDA)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from numafast._buffers import PAGE_SIZE
from numafast._validate import check_nodes, integer
from numafast.cli.bench.machine import largest_llc
from numafast.cli.bench.result import COPY_BY, MATRICES, MAX_REPETITIONS
from numafast.errors import InvalidSizeError
from numafast.topo import Topology

MIB = 1 << 20
LLC_FACTOR = 4  # STREAM: each buffer at least 4x the caches the run can use
SIZE_FLOOR = 64 * MIB  # the default never goes below this, whatever the LLC
SIZE_WITHOUT_LLC = 256 * MIB  # the default when sysfs does not give the LLC's size
SMALLEST_SIZE = 1 * MIB
QUICK_SIZE = 8 * MIB
WARMUP = 1
REPETITIONS = {"latency_ns": 5, "read_gbps": 10, "copy_gbps": 10, "node_copy_gbps": 10}
GPU_REPETITIONS = 7  # each GPU matrix: the median of these
QUICK_REPETITIONS = 2

CPU_MATRICES = ("latency_ns", "read_gbps", "copy_gbps", "node_copy_gbps")
GPU_MATRICES = ("h2d_gbps", "d2h_gbps", "h2d_concurrent_gbps", "d2h_concurrent_gbps")


@dataclass(frozen=True)
class Settings:
    """What a run measures, validated before anything is allocated."""

    nodes: list[int]
    matrices: list[str]
    size: int
    threads: int | None
    repetitions: int | None
    quick: bool
    copy_by: str

    def repetitions_of(self, name: str) -> int:
        if self.repetitions is not None:
            return self.repetitions
        return QUICK_REPETITIONS if self.quick else REPETITIONS.get(name, GPU_REPETITIONS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "size": self.size,
            "threads": self.threads,
            "repetitions": self.repetitions,
            "quick": self.quick,
            "copy_by": self.copy_by,
        }


def _positive(name: str, value: object, most: int | None = None) -> int | None:
    """``value`` (None, or a whole number of at least 1 and at most ``most``) as an int."""
    if value is None:
        return None
    number = integer(value)
    if number is None or number < 1 or (most is not None and number > most):
        bound = "of at least 1" if most is None else f"from 1 to {most}"
        raise ValueError(f"{name} must be a whole number {bound}, not {value!r}")
    return number


def _matrix_names(matrices: str | Iterable[str]) -> list[str]:
    """The names ``matrices`` holds, each once (one name stands for itself)."""
    choices = ", ".join(MATRICES)
    try:
        names = [matrices] if isinstance(matrices, str) else list(matrices)
    except TypeError:
        raise TypeError(f"matrices must be a matrix name or a list of them ({choices}), not {matrices!r}") from None
    for name in names:
        if not isinstance(name, str) or name not in MATRICES:
            raise ValueError(f"matrix {name!r}: choose among {choices}")
    return list(dict.fromkeys(names))


def _buffer_size(size: object, minimum: int, llc: int, quick: bool) -> int:
    """A ``size`` given: an integer of at least SMALLEST_SIZE, and (unless ``quick``)
    ``minimum``, STREAM's 4x the last-level cache."""
    checked = integer(size)
    if checked is None or checked < SMALLEST_SIZE:
        raise InvalidSizeError(f"size {size!r}: buffers must be whole numbers of bytes, at least {SMALLEST_SIZE >> 20} MiB")
    if checked < minimum and not quick:
        raise InvalidSizeError(
            f"size {checked / MIB:.0f} MiB is below {LLC_FACTOR}x the last-level cache ({llc / MIB:.0f} MiB): "
            f"caches, not memory, would answer; give at least {minimum / MIB:.0f} MiB (STREAM's rule), or --quick"
        )
    return checked


def resolve_settings(
    machine: Topology,
    summary: dict[str, Any],
    gpu_problem: str | None,
    *,
    nodes: int | Iterable[int] | None,
    matrices: str | Iterable[str] | None,
    threads: int | None,
    size: int | None,
    repetitions: int | None,
    quick: bool,
    copy_by: str,
) -> Settings:
    """Settings from :func:`numafast.bench`'s arguments (``gpu_problem``: why the GPU
    matrices cannot be measured here, None when they can); an exception naming the
    bad value and the allowed ones."""
    chosen_nodes = check_nodes(machine.node_ids if nodes is None else nodes, need_allowed=False)
    if matrices is None:
        names = list(CPU_MATRICES) + ([] if gpu_problem else list(GPU_MATRICES))
    else:
        names = _matrix_names(matrices)
        for name in names:
            if name in GPU_MATRICES and gpu_problem:
                raise ValueError(f"{name} needs CUDA: {gpu_problem}")
        if not names:
            raise ValueError(f"no matrix chosen; choose among {', '.join(MATRICES)}")
    if copy_by not in COPY_BY:
        raise ValueError(f"copy_by {copy_by!r}: choose 'destination' or 'source'")
    llc = largest_llc(summary, chosen_nodes) or 0
    minimum = LLC_FACTOR * llc
    if size is None:
        size = QUICK_SIZE if quick else max(minimum or SIZE_WITHOUT_LLC, SIZE_FLOOR)
    else:
        size = _buffer_size(size, minimum, llc, quick)
    return Settings(
        nodes=chosen_nodes,
        matrices=names,
        size=-(-size // PAGE_SIZE) * PAGE_SIZE,
        threads=_positive("threads", threads),
        repetitions=_positive("repetitions", repetitions, MAX_REPETITIONS),
        quick=bool(quick),
        copy_by=copy_by,
    )
