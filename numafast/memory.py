"""Node-local memory: fresh NumPy arrays whose pages the kernel put on a chosen node,
and mbind / migrate for buffers that already exist.

A fresh allocation is mapped by numafast itself (mmap), bound with mbind before any
page exists, then faulted in at once: MADV_POPULATE_WRITE (one call per slice,
huge pages where THP allows) from threads pinned to the target node's CPUs, so
the array is ready to use and already local when it is returned.
"""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike

from numafast import _libnuma
from numafast._buffers import PAGE_SIZE, flat_bytes, require_whole_pages
from numafast._validate import allowed_cpus, check_node, check_nodes, cpus_near, format_ids
from numafast.errors import (
    InvalidNodeError,
    InvalidSizeError,
    LibnumaError,
    MigrationError,
    NodeMemoryError,
)
from numafast.pages import UNTOUCHED_STATUSES, local_node
from numafast.policy import MODE_NUMBERS, Mode

__all__ = ["allocate", "empty", "mbind", "migrate", "zeros"]

THP_SIZE_FILE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
THP_ENABLED_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Below this much memory per pre-touch thread, starting one costs more than it saves.
BYTES_PER_THREAD = 32 << 20
# Pages the kernel reports busy (-EBUSY: locked, under writeback, being migrated)
# are usually free again within milliseconds.
RETRY_DELAYS_S = (0.001, 0.004, 0.016, 0.064, 0.25)


# The set_mempolicy(2) modes that mbind(2) takes with a set of nodes.
MBIND_MODES = (Mode.BIND, Mode.INTERLEAVE, Mode.PREFERRED, Mode.PREFERRED_MANY, Mode.WEIGHTED_INTERLEAVE)


def empty(
    shape: int | Sequence[int],
    dtype: DTypeLike = float,
    *,
    node: int | None = None,
    nodes: Iterable[int] | None = None,
    hugepages: bool = True,
) -> np.ndarray:
    """A new C-ordered array whose pages are all on ``node`` (or interleaved page by page
    over ``nodes``; default: the calling thread's node), faulted in and ready to use.

    The memory belongs to the array and every view of it (``.base`` keeps it alive)
    and is unmapped once, when the last is gone. ``hugepages`` backs it with
    transparent huge pages where the kernel allows (interleaving then goes by huge
    page). Its contents are zero, as fresh anonymous memory always is.
    """
    dims = check_shape(shape)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects, which cannot live in raw memory")
    count = math.prod(dims)
    buffer = allocate(count * dtype.itemsize, node=node, nodes=nodes, hugepages=hugepages)
    # NumPy's stubs take any buffer (PEP 688) only for Python 3.12 and later.
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(dims)  # type: ignore[call-overload,no-any-return]


def zeros(
    shape: int | Sequence[int],
    dtype: DTypeLike = float,
    *,
    node: int | None = None,
    nodes: Iterable[int] | None = None,
    hugepages: bool = True,
) -> np.ndarray:
    """Like :func:`empty`: fresh anonymous pages are zero, so no second pass is needed."""
    return empty(shape, dtype, node=node, nodes=nodes, hugepages=hugepages)


def allocate(
    nbytes: int, *, node: int | None = None, nodes: Iterable[int] | None = None, hugepages: bool = True
) -> _libnuma.MappedBuffer:
    """``nbytes`` of fresh memory bound to ``node`` (or interleaved over ``nodes``) and
    already faulted in there; what :func:`empty` and ``numafast.torch.empty`` build on."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise InvalidSizeError(f"cannot allocate {nbytes!r} bytes: the size must be a positive integer")
    targets = _target_nodes(node, nodes)
    thp = _thp_size()
    huge = hugepages and thp and nbytes >= thp
    alignment = thp if huge else PAGE_SIZE
    _check_room(nbytes, targets, alignment)
    # Whole pages: mbind and madvise act on the pages wholly inside a buffer, and the
    # last one is all ours (the array over it uses the first nbytes).
    buffer = _libnuma.mmap_anonymous(-(-nbytes // PAGE_SIZE) * PAGE_SIZE, alignment)
    if thp:
        # Asked either way: a kernel whose THP mode is "always" backs big mappings with
        # huge pages unless told not to, which would make interleave go by 2 MiB.
        _libnuma.madvise(buffer, _libnuma.MADV_HUGEPAGE if huge else _libnuma.MADV_NOHUGEPAGE)
    mode = Mode.BIND if len(targets) == 1 else Mode.INTERLEAVE
    # Bound before any page exists: each one is placed by the policy as it is faulted in.
    _libnuma.mbind(buffer, MODE_NUMBERS[mode], targets, 0)
    # Big buffers: threads pinned to the node's CPUs share the zeroing, each on memory
    # near it. Small ones: the caller faults them in at once (pages land on the target
    # all the same; a thread would cost more than the work).
    cpus = _pretouch_cpus(targets) if nbytes >= 2 * BYTES_PER_THREAD else []
    threads = max(1, min(len(cpus), nbytes // BYTES_PER_THREAD))
    try:
        _libnuma.pretouch(buffer, cpus, threads, alignment)
    except LibnumaError as error:
        if error.errno == errno.ENOMEM:
            raise NodeMemoryError(f"{_room_text(targets)}; {nbytes} bytes asked for did not fit") from error
        raise
    return buffer


def mbind(
    buf: object,
    nodes: int | Iterable[int],
    *,
    mode: Mode | str = Mode.BIND,
    move: bool = True,
) -> None:
    """Set the memory policy of ``buf``'s pages: on ``nodes`` (one node or several) as
    ``mode`` says (a numafast.Mode, or its name: bind, interleave, preferred,
    preferred_many on Linux 5.15+, weighted_interleave on 6.9+); with ``move`` the
    pages it already has move there too.

    ``buf`` is any writable C-contiguous buffer (NumPy array, torch CPU tensor,
    bytearray, memoryview, mmap). A policy covers whole pages, so only the pages
    wholly inside ``buf`` are bound and moved; a partial page at either end is
    shared with neighbouring memory and left alone. As mbind(2) does, ``move``
    moves the pages that are off ``nodes``: with "interleave" they are spread over
    the nodes, and a page already on one of them stays (to respread, migrate to
    one node first). Raises MigrationError when pages stay off ``nodes`` after
    retries (locked, or shared with another process).
    """
    if mode not in MBIND_MODES:
        choices = ", ".join(m.value for m in MBIND_MODES)
        raise ValueError(f"mode {str(getattr(mode, 'value', mode))!r}: choose one of {choices}")
    mode = Mode(mode)
    targets = check_nodes([nodes] if isinstance(nodes, int) else nodes)
    if mode is Mode.PREFERRED and len(targets) != 1:
        raise InvalidNodeError(f"mode 'preferred' takes one node, not {format_ids(targets)}")
    flat = flat_bytes(buf, writable=True)
    require_whole_pages(flat)
    policy = MODE_NUMBERS[mode]
    # MPOL_MF_STRICT with MPOL_MF_MOVE: EIO when some page could not be moved.
    flags = _libnuma.MPOL_MF_MOVE | _libnuma.MPOL_MF_STRICT if move else 0
    for delay in (0.0, *RETRY_DELAYS_S):
        time.sleep(delay)
        try:
            _libnuma.mbind(flat, policy, targets, flags)
            return
        except LibnumaError as error:
            if error.errno != errno.EIO:
                raise
    status = np.frombuffer(_libnuma.move_pages(flat, None, 0, True), dtype=np.int32)
    misplaced = int(((status >= 0) & ~np.isin(status, targets)).sum())
    raise MigrationError(
        f"mbind: {misplaced} pages stayed off node {format_ids(targets)} after "
        f"{len(RETRY_DELAYS_S) + 1} tries (locked, or shared with another process)",
        moved=0,
        stuck={"misplaced": misplaced},
    )


def migrate(buf: object, node: int) -> int:
    """Move the pages ``buf`` has to ``node`` (move_pages(2)); returns how many moved.

    ``buf`` is any writable C-contiguous buffer; only the pages wholly inside it are
    moved (a partial page at either end is shared with neighbouring memory). Pages
    never touched have nowhere to move from and are left to their policy. Pages
    the kernel reports busy are retried; MigrationError names those that stayed.
    """
    target = check_node(node)
    flat = flat_bytes(buf, writable=True)
    require_whole_pages(flat)
    before = np.frombuffer(_libnuma.move_pages(flat, None, 0, True), dtype=np.int32)
    after = before
    for delay in (0.0, *RETRY_DELAYS_S):
        time.sleep(delay)
        after = np.frombuffer(_libnuma.move_pages(flat, target, _libnuma.MPOL_MF_MOVE, True), dtype=np.int32)
        if not (after == -errno.EBUSY).any():
            break
    moved = int(((before >= 0) & (before != target) & (after == target)).sum())
    failed = after[(after < 0) & ~np.isin(after, UNTOUCHED_STATUSES)]
    if failed.size:
        stuck = {errno.errorcode.get(-code, str(code)): int((failed == code).sum()) for code in np.unique(failed)}
        raise MigrationError(f"migrate to node {target}: {moved} pages moved, not moved: {stuck}", moved, stuck)
    return moved


def check_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, if it has at least one element and no negative dimension."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise TypeError(f"shape {shape!r}: {dim!r} is not an integer")
        if dim < 0:
            raise InvalidSizeError(f"shape {shape!r}: negative dimension {dim}")
    if math.prod(dims) == 0:
        raise InvalidSizeError(f"shape {shape!r} holds no element; numafast allocates whole pages")
    return tuple(int(d) for d in dims)


def _target_nodes(node: int | None, nodes: Iterable[int] | None) -> list[int]:
    if node is not None and nodes is not None:
        raise ValueError("give node= (bind to one node) or nodes= (interleave), not both")
    if nodes is not None:
        return check_nodes(nodes)
    return [check_node(local_node() if node is None else node)]


def _room_text(nodes: Iterable[int]) -> str:
    return ", ".join(f"node {n} has {_libnuma.node_size64(n)[1]} bytes free" for n in nodes)


def _check_room(nbytes: int, nodes: list[int], alignment: int) -> None:
    """NodeMemoryError before mapping anything when a node cannot hold its share.

    A bound mapping that outgrows its node does not fail politely later: the page
    fault that finds no memory there wakes the OOM killer.
    """
    share = -(-nbytes // len(nodes)) + alignment  # interleaving may give a node one unit more
    for n in nodes:
        free = _libnuma.node_size64(n)[1]
        if share > free:
            asked = f"{nbytes} bytes asked for" + (f" ({share} on each of {len(nodes)} nodes)" if len(nodes) > 1 else "")
            raise NodeMemoryError(f"node {n} has {free} bytes free ({free / 2**30:.2f} GiB); {asked}")


def _pretouch_cpus(nodes: list[int]) -> list[int]:
    """Allowed CPUs of the target nodes; for CPU-less (memory-only) nodes, those of the
    nearest nodes that have some (the pages still land on the target: mbind decides)."""
    allowed = allowed_cpus()
    return cpus_near(nodes, allowed) or sorted(allowed)


@cache
def _thp_size() -> int:
    """The transparent huge page size; 0 when this kernel has no THP or has it off."""
    try:
        if "[never]" in THP_ENABLED_FILE.read_text():
            return 0
        return int(THP_SIZE_FILE.read_text())
    except OSError:
        return 0
