"""Where memory is: the node of every page of a buffer, and a report for whole batches.

The kernel answers (move_pages(2) with no target nodes), page by page; nothing here
trusts how the memory was allocated.
"""

from __future__ import annotations

import dataclasses
import errno
import sys
from collections.abc import Iterator, Mapping

import numpy as np

from numafast import _libnuma
from numafast._buffers import Span, flat_bytes
from numafast._validate import allowed_cpus, check_node
from numafast.errors import InvalidBufferError, LibnumaError
from numafast.policy import refusals_explained

__all__ = ["PageNodes", "PlacementReport", "local_node", "page_nodes", "placement", "count_statuses"]

# Page statuses of a move_pages(2) query for pages with no frame of their own yet:
# never touched (-ENOENT) or only read, so backed by the shared zero page (-EFAULT).
UNTOUCHED_STATUSES = (-errno.ENOENT, -errno.EFAULT)


class PageNodes(dict[int, int]):
    """{node: pages} for the pages of a buffer that have memory, plus ``untouched``:
    the pages that have none yet (never written), which land where policy says on
    their first touch."""

    def __init__(self, counts: Mapping[int, int], untouched: int = 0):
        super().__init__(sorted(counts.items()))
        self.untouched = untouched

    @property
    def touched(self) -> int:
        return sum(self.values())

    @property
    def total(self) -> int:
        return self.touched + self.untouched

    def __repr__(self) -> str:
        return f"PageNodes({dict(self)}, untouched={self.untouched})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PageNodes):
            return dict(self) == dict(other) and self.untouched == other.untouched
        return dict.__eq__(self, other)

    __hash__ = None  # mutable, like dict


def count_statuses(status: np.ndarray) -> PageNodes:
    """PageNodes from the per-page statuses of a move_pages(2) query."""
    touched = status[status >= 0]
    untouched = int(np.isin(status, UNTOUCHED_STATUSES).sum())
    failed = status[(status < 0) & ~np.isin(status, UNTOUCHED_STATUSES)]
    if failed.size:
        raise LibnumaError("move_pages", int(-failed[0]), f"status of {failed.size} pages")
    counts = np.bincount(touched) if touched.size else np.zeros(0, dtype=np.int64)
    return PageNodes({node: int(n) for node, n in enumerate(counts) if n}, untouched)


def page_nodes(buf: object) -> PageNodes:
    """{node: pages} of every page ``buf`` touches (edge pages included), asked of the kernel.

    ``buf`` is any contiguous buffer: NumPy array, torch CPU tensor, bytearray,
    memoryview, mmap. Pages never written are counted apart, in ``.untouched``.
    """
    flat = flat_bytes(buf, writable=False)
    with refusals_explained("numafast.page_nodes"):
        return count_statuses(np.frombuffer(_libnuma.move_pages(flat), dtype=np.int32))


def local_node() -> int:
    """The node of the calling thread: that of all its allowed CPUs when they share one,
    else that of the CPU it runs on now (field 39 of /proc/thread-self/stat)."""
    nodes = {_libnuma.node_of_cpu(cpu) for cpu in allowed_cpus()}
    if len(nodes) == 1:
        return nodes.pop()
    with open("/proc/thread-self/stat") as f:
        # Fields after the command name, which may hold spaces and parentheses.
        fields = f.read().rpartition(")")[2].split()
    return _libnuma.node_of_cpu(int(fields[39 - 3]))


@dataclasses.dataclass(frozen=True)
class PlacementReport:
    """Where a batch's memory is: pages per node over all its buffers, and the share of
    the touched pages that is remote from ``node``."""

    node: int
    pages: PageNodes
    leaves: dict[str, PageNodes]
    skipped: dict[str, str]  # path -> why it has no host pages to count (a GPU tensor, ...)

    @property
    def remote_pages(self) -> int:
        return self.pages.touched - self.pages.get(self.node, 0)

    @property
    def remote_share(self) -> float:
        """Remote pages / touched pages (0.0 when nothing is touched yet)."""
        return self.remote_pages / self.pages.touched if self.pages.touched else 0.0

    def __str__(self) -> str:
        lines = [
            f"{self.pages.touched} pages on nodes {dict(self.pages)}, {self.pages.untouched} untouched; "
            f"{self.remote_share:.1%} remote from node {self.node}"
        ]
        lines += [f"  {path or '<root>'}: {counts!r}" for path, counts in self.leaves.items()]
        lines += [f"  {path or '<root>'}: skipped, {why}" for path, why in self.skipped.items()]
        return "\n".join(lines)


def placement(obj: object, node: int | None = None) -> PlacementReport:
    """One report of where ``obj``'s memory is: an array, a tensor, or a nested batch of
    dicts, lists, tuples and dataclasses of them.

    ``node`` is the node the batch should be on (default: the calling thread's, see
    local_node). Memory two leaves share (the same buffer twice) counts once; leaves
    that are no host buffer (GPU tensors, strided views) and objects it cannot see
    into (a custom batch class, a set) are listed in ``skipped`` with the reason;
    scalars (str, int, float, None) hold no memory to place and are left out.
    """
    target = local_node() if node is None else check_node(node, need_allowed=False)
    leaves: dict[str, PageNodes] = {}
    skipped: dict[str, str] = {}
    seen: set[Span] = set()
    total: dict[int, int] = {}
    untouched = 0
    for path, leaf in _leaves(obj, "", set()):
        if not _is_buffer(leaf):
            skipped[path] = (
                f"a {type(leaf).__name__} is none of a buffer, mapping, list, tuple or dataclass: "
                "numafast cannot see into it"
            )
            continue
        try:
            flat = flat_bytes(leaf, writable=False)
        except InvalidBufferError as error:
            skipped[path] = str(error)
            continue
        with refusals_explained("numafast.placement"):
            counts = count_statuses(np.frombuffer(_libnuma.move_pages(flat), dtype=np.int32))
        leaves[path] = counts
        span = Span.of(flat)
        if span not in seen:
            seen.add(span)
            for n, pages in counts.items():
                total[n] = total.get(n, 0) + pages
            untouched += counts.untouched
    return PlacementReport(target, PageNodes(total, untouched), leaves, skipped)


_SCALARS = (str, int, float, complex, bool, type(None))


def _is_buffer(obj: object) -> bool:
    if isinstance(obj, _SCALARS):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return True
    try:
        memoryview(obj).release()  # type: ignore[arg-type]
    except TypeError:
        return False
    except ValueError:
        return True  # a buffer whose memory is gone: reported as skipped
    return True


def _leaves(obj: object, path: str, parents: set[int]) -> Iterator[tuple[str, object]]:
    """(path, leaf) for every buffer in a nested batch; ``parents`` guards against cycles."""
    if _is_buffer(obj):
        yield path, obj
        return
    if id(obj) in parents:
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children: Iterator[tuple[str, object]] = (
            (f"{path}.{field.name}", getattr(obj, field.name)) for field in dataclasses.fields(obj)
        )
    elif isinstance(obj, Mapping):
        children = ((f"{path}[{key!r}]", value) for key, value in obj.items())
    elif isinstance(obj, (list, tuple)):
        children = ((f"{path}[{index}]", value) for index, value in enumerate(obj))
    elif isinstance(obj, _SCALARS):
        return  # no memory of its own to place (a label, a count)
    else:
        yield path, obj  # an object numafast cannot see into: placement() lists it as skipped
        return
    parents.add(id(obj))
    for child_path, child in children:
        yield from _leaves(child, child_path, parents)
    parents.discard(id(obj))
