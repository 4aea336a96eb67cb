"""One ``numafast bench`` run in progress: each node's buffers, the rows' CPUs, and the
placement checks every cell passes before it is kept.

Each memory node gets its buffers once, from :func:`numafast.memory.allocate`
(fresh, bound to the node with mbind, pre-faulted, transparent huge pages where
the kernel allows): a "source" buffer, which holds the latency chase's chain of
links and which reads and copies read, and a "destination" buffer that copies
write. Before a cell is measured its buffers' pages are asked of the kernel
(move_pages(2)) and must all be on the cell's nodes; the timing threads pin
themselves to one CPU each and report, from inside, what sched_getaffinity and
sched_getcpu said before and after the timed loops; a thread off its CPU, or on
a CPU of another node than the cell's, voids the cell. Either failure leaves the
cell empty, its reason starting "placement check failed".
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from numafast import _libnuma
from numafast._validate import format_ids
from numafast.cli.bench.result import MATRICES, PLACEMENT_FAILED
from numafast.cli.bench.settings import Settings
from numafast.errors import MemlockError, NodeMemoryError
from numafast.memory import allocate
from numafast.pool import PinnedPool, Slot
from numafast.pages import page_nodes
from numafast.topo import Topology

CHASE_STRIDE = 64  # one link per cache line
CHASE_STEPS_MAX = 1 << 21  # dependent loads per repetition: a lap, at most ~0.2 s of loads
CHASE_SEED = 0x6E756D61

# What a timing thread reports from inside (src/bench.pxi): the CPU it pinned itself
# to, sched_getcpu() before and after the timed loops, and whether sched_getaffinity
# said exactly that CPU; and a timed call's seconds per repetition with those reports.
ThreadPlacement = tuple[int, int, int, bool]
Timings = tuple[list[float], list[ThreadPlacement]]


class Unmeasurable(Exception):
    """A cell that cannot be measured here; the message says why (it goes to ``missing``)."""


class Run(AbstractContextManager["Run"]):
    """One run in progress: its settings, the machine, each node's buffers (freed on
    exit, also on Ctrl-C) and its progress."""

    def __init__(self, settings: Settings, machine: Topology, progress: Callable[[int, int, str], None] | None):
        self.settings = settings
        self.machine = machine
        self.allowed_cpus = set(machine.allowed_cpus)
        self.progress = progress
        self.cells_done = 0
        columns = {"cuda_device": len(machine.gpus)}
        self.cells_total = sum(
            len(settings.nodes) * columns.get(MATRICES[name].col_kind, len(settings.nodes)) for name in settings.matrices
        )
        self._buffers: dict[tuple[int, str], _libnuma.MappedBuffer] = {}
        self._pinned: dict[int, tuple[PinnedPool, Slot]] = {}
        self._chained: set[int] = set()
        self._memory_problems: dict[int, str] = {}

    def __exit__(self, *exc_info: object) -> None:
        pinned, self._pinned = self._pinned, {}
        for pool, _slot in pinned.values():
            pool.close()  # released as its slot goes, with the dict
        del pinned
        buffers, self._buffers = self._buffers, {}
        for buffer in buffers.values():
            try:
                buffer.free()
            except BufferError:
                pass  # a view still holds it (an exception's traceback): unmapped when that goes

    def tick(self, label: str) -> None:
        self.cells_done += 1
        if self.progress is not None:
            self.progress(self.cells_done, self.cells_total, label)

    # ---- rows: CPUs

    def cpus_of(self, node: int) -> list[int]:
        """The allowed CPUs of ``node`` that do a cell's work (at most ``threads``)."""
        own = self.machine.node(node).cpus
        if not own:
            raise Unmeasurable(f"node {node} has no CPUs")
        cpus = [cpu for cpu in own if cpu in self.allowed_cpus]
        if not cpus:
            raise Unmeasurable(
                f"node {node}'s CPUs {format_ids(own)} are all outside the CPUs this process may use "
                f"({format_ids(self.allowed_cpus)}: its affinity and cpuset)"
            )
        return cpus[: self.settings.threads]

    # ---- columns: memory

    def memory_problem(self, node: int) -> str | None:
        if node in self._memory_problems:
            return self._memory_problems[node]
        total = self.machine.node(node).mem_total
        if total == 0:
            return f"node {node} has no memory"
        if node not in self.machine.allowed_nodes:
            return (
                f"node {node} is outside the memory nodes this process may use "
                f"({format_ids(self.machine.allowed_nodes)}: its cpuset's mems)"
            )
        return None

    def buffer(self, node: int, role: str) -> _libnuma.MappedBuffer:
        """The ``role`` ("source" or "destination") buffer on ``node``, allocated on first use."""
        problem = self.memory_problem(node)
        if problem:
            raise Unmeasurable(problem)
        if (node, role) not in self._buffers:
            try:
                self._buffers[node, role] = allocate(self.settings.size, node=node)
            except NodeMemoryError as error:
                self._memory_problems[node] = f"node {node}: {error}"
                raise Unmeasurable(self._memory_problems[node]) from None
        return self._buffers[node, role]

    def pinned(self, node: int, nbytes: int) -> Slot:
        """A page-locked, CUDA-registered buffer of ``nbytes`` on ``node`` (the GPU
        matrices' host side), made on first use: one slot of a PinnedPool."""
        problem = self.memory_problem(node)
        if problem:
            raise Unmeasurable(problem)
        if node not in self._pinned:
            try:
                pool = PinnedPool(node, nbytes, 1, register="required")
            except (NodeMemoryError, MemlockError) as error:
                self._memory_problems[node] = f"node {node}: {error}"
                raise Unmeasurable(self._memory_problems[node]) from None
            self._pinned[node] = (pool, pool.acquire())
        return self._pinned[node][1]

    def chain(self, node: int) -> _libnuma.MappedBuffer:
        """The source buffer of ``node`` holding the chase's chain of links."""
        buffer = self.buffer(node, "source")
        if node not in self._chained:
            _libnuma.chase_links(buffer, CHASE_STRIDE, CHASE_SEED + node)
            self._chained.add(node)
        return buffer

    @property
    def chase_steps(self) -> int:
        return chase_steps(self.settings.size)


def chase_steps(size: int) -> int:
    """Dependent loads per repetition of the latency chase over a buffer of ``size`` bytes."""
    return min(size // CHASE_STRIDE, CHASE_STEPS_MAX)


def check_pages(buffer: object, node: int, role: str) -> dict[str, Any]:
    """The kernel's count of ``buffer``'s pages per node, if they are all on ``node``."""
    counts = page_nodes(buffer)
    if counts.untouched or set(counts) != {node}:
        raise Unmeasurable(
            f"{PLACEMENT_FAILED}the {role} buffer should be all on node {node}; the kernel reports "
            f"pages {dict(counts)} and {counts.untouched} never touched"
        )
    return {"node": node, "pages": {str(node): counts[node]}}


def check_threads(placed: list[ThreadPlacement], node: int) -> list[int]:
    """The CPUs the timing threads ran on, if each stayed on its CPU and that CPU is ``node``'s."""
    node_cpus = set(_libnuma.node_to_cpus(node))
    for cpu, before, after, exact in placed:
        if not exact or before != cpu or after != cpu:
            affinity = "exactly" if exact else "not only"
            raise Unmeasurable(
                f"{PLACEMENT_FAILED}a thread pinned to cpu {cpu} (affinity {affinity} that CPU) "
                f"ran on cpu {before} before and {after} after timing"
            )
        if cpu not in node_cpus:
            raise Unmeasurable(f"{PLACEMENT_FAILED}cpu {cpu} is not one of node {node}'s ({format_ids(node_cpus)})")
    return sorted({cpu for cpu, _, _, _ in placed})
