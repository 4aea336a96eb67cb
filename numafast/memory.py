"""Node-local memory: fresh NumPy arrays whose pages the kernel put on a chosen node,
and mbind / migrate for buffers that already exist.

A fresh allocation is mapped by numafast itself (mmap), bound with mbind before any
page exists, then faulted in at once: MADV_POPULATE_WRITE (one call per slice,
huge pages where THP allows) from threads pinned to the target node's CPUs, so
the array is ready to use and already local when it is returned.

Interleaving goes round-robin by page, and a transparent huge page is one page:
a 2 MiB buffer in one huge page lands whole on one node. So wherever memory is
spread over several nodes (a fresh allocation, or mbind with "interleave"), only
whole huge pages in a multiple of the node count stay huge (each node gets as
many); the rest is kept in base pages, and every node holds its share to within
one base page, whatever the size.
"""

from __future__ import annotations

import errno
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike

from numafast import _libnuma
from numafast._buffers import PAGE_SIZE, Span, flat_bytes, require_whole_pages
from numafast._validate import allowed_cpus, check_bool, check_node, check_nodes, cpus_near, format_ids, integer
from numafast.errors import (
    InvalidNodeError,
    InvalidSizeError,
    LibnumaError,
    MigrationError,
    NodeMemoryError,
)
from numafast.pages import UNTOUCHED_STATUSES, local_node
from numafast.capabilities import Capability, memory_placement_refused, warn_unplaced
from numafast.policy import MODE_NUMBERS, Mode, raise_explained, refusals_explained
from numafast.private import stacklevel_outside

__all__ = ["allocate", "empty", "mbind", "migrate", "zeros"]

THP_SIZE_FILE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
THP_ENABLED_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Shared memory (memfd, /dev/shm) gets huge pages by its own switch, not by `enabled`.
THP_SHMEM_FILE = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
# Below this much memory per pre-touch thread, starting one costs more than it saves.
BYTES_PER_THREAD = 32 << 20
# Pages the kernel reports busy (-EBUSY: locked, under writeback, being migrated)
# are usually free again within milliseconds.
RETRY_DELAYS_S = (0.001, 0.004, 0.016, 0.064, 0.25)
# Without THP, pages still move in runs this long where each run has one node.
MOVE_RUN_BYTES = 512 * PAGE_SIZE


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
    transparent huge pages where the kernel allows. Interleaved, each node holds its
    share of the pages to within one base page, whatever the size: only whole huge
    pages in a multiple of ``len(nodes)`` are huge (as many on each node), the rest
    is in base pages (a 2 MiB array over 4 nodes: 128 base pages on each; 9 huge
    pages' worth: 2 huge pages on each, and 512 base pages spread over the 4).
    Its contents are zero, as fresh anonymous memory always is.
    """
    dims = check_shape(shape)
    checked = check_dtype(dtype)
    count = math.prod(dims)
    buffer = allocate(count * checked.itemsize, node=node, nodes=nodes, hugepages=hugepages)
    # NumPy's stubs take any buffer (PEP 688) only for Python 3.12 and later.
    return np.frombuffer(buffer, dtype=checked, count=count).reshape(dims)  # type: ignore[call-overload,no-any-return]


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
    nbytes: int,
    *,
    node: int | None = None,
    nodes: Iterable[int] | None = None,
    hugepages: bool = True,
    shared_file: int | None = None,
    pretouch: bool = True,
    unplaced_ok: bool = False,
) -> _libnuma.MappedBuffer:
    """``nbytes`` of fresh memory bound to ``node`` (or interleaved over ``nodes``) and
    already faulted in there; what :func:`empty` and ``numafast.torch.empty`` build on.
    With ``pretouch=False`` no page exists yet: each is placed by the same policy when
    it is first touched, by whichever thread touches it.

    With ``shared_file`` (the descriptor of an empty memfd, grown to ``nbytes`` here)
    the memory is that file mapped shared, for other processes to map too; the
    policy is then the file's own, so it places pages whoever touches them.

    ``unplaced_ok`` is numafast's own memory (pinned pools): where a container's seccomp
    profile refuses mbind, it goes on where the kernel puts it, said once, rather than
    raise as an explicit request does (see :func:`_bind_fresh`).

    Huge pages back it where THP allows and ``hugepages`` asks: all of it on one
    node; interleaved, only whole huge pages in a multiple of the node count, from
    the start, so that every node holds its share to within one base page.
    """
    size = integer(nbytes)
    if size is None or size <= 0:
        raise InvalidSizeError(f"cannot allocate {nbytes!r} bytes: the size must be a positive integer")
    nbytes = size
    hugepages, pretouch = check_bool("hugepages", hugepages), check_bool("pretouch", pretouch)
    unplaced_ok = check_bool("unplaced_ok", unplaced_ok)
    targets = _target_nodes(node, nodes)
    thp = _thp_size(THP_ENABLED_FILE if shared_file is None else THP_SHMEM_FILE)
    # Whole pages: mbind and madvise act on the pages wholly inside a buffer, and the
    # last one is all ours (the array over it uses the first nbytes).
    mapped = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
    huge = _even_huge_bytes(mapped, thp, len(targets)) if hugepages else 0
    alignment = thp if huge else PAGE_SIZE
    _check_room(nbytes, targets, alignment)
    if shared_file is None:
        buffer = _libnuma.mmap_anonymous(mapped, alignment)
    else:
        os.ftruncate(shared_file, mapped)
        buffer = _libnuma.mmap_shared(mapped, shared_file, alignment)
    if thp:
        # Asked either way: a kernel whose THP mode is "always" backs big mappings with
        # huge pages unless told not to, which would make interleave go by 2 MiB. On
        # one node all of it may be huge (a last partial huge page cannot be anyway).
        huge_end = mapped if huge and len(targets) == 1 else huge
        _advise(buffer, 0, huge_end, _libnuma.MADV_HUGEPAGE)
        _advise(buffer, huge_end, mapped, _libnuma.MADV_NOHUGEPAGE)
    mode = Mode.BIND if len(targets) == 1 else Mode.INTERLEAVE
    # Bound before any page exists: each one is placed by the policy as it is faulted in.
    _bind_fresh(buffer, mode, targets, unplaced_ok)
    if not pretouch:
        return buffer
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


def _bind_fresh(buffer: _libnuma.MappedBuffer, mode: Mode, targets: list[int], unplaced_ok: bool) -> None:
    """mbind a fresh allocation. Where the kernel has no NUMA system calls (ENOSYS: built
    without CONFIG_NUMA, or a sandbox answering so), it goes on unbound, where the kernel
    puts it (one node, or none to choose); so does numafast's own memory (``unplaced_ok``:
    pools) where a seccomp profile refuses mbind (EPERM), said once per process. An
    explicit request refused with EPERM raises PolicyNotPermitted, naming cause and fix."""
    try:
        _libnuma.mbind(buffer, MODE_NUMBERS[mode], targets, 0)
    except LibnumaError as error:
        if error.errno == errno.ENOSYS or (error.errno == errno.EPERM and unplaced_ok):
            refused = memory_placement_refused() or [("mbind", Capability(False, str(error), error.errno))]
            warn_unplaced(targets, refused, stacklevel=stacklevel_outside())
            return
        raise_explained(error, f"mbind ({mode.value} {buffer.size} fresh bytes to node {format_ids(targets)})")


def _even_huge_bytes(nbytes: int, huge_page: int, ways: int) -> int:
    """The bytes, from a huge page boundary, that whole huge pages can back and still give
    each of ``ways`` nodes as many: a multiple of ``ways`` huge pages (0 without THP)."""
    return nbytes // (huge_page * ways) * (huge_page * ways) if huge_page else 0


def _advise(buffer: _libnuma.MappedBuffer, start: int, end: int, advice: int) -> None:
    """madvise(2) ``advice`` over bytes [start, end) of ``buffer`` (nothing when empty)."""
    if start < end:
        with memoryview(buffer)[start:end] as part:
            _libnuma.madvise(part, advice)


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
    shared with neighbouring memory and left alone. Raises MigrationError when
    pages stay misplaced after retries (locked, or shared with another process).

    With "interleave" over several nodes, every touched page goes to its turn in
    the round-robin, also one already on one of the nodes (mbind(2) alone would
    leave it), so each node ends up with its share to within one base page. A
    transparent huge page interleaves and moves whole, so as for a fresh
    allocation only whole huge pages in a multiple of the node count stay huge
    (and move whole, one per node in turn); the rest of ``buf`` is marked
    MADV_NOHUGEPAGE (page faults and khugepaged keep it in base pages) and its
    huge pages are split first (madvise MADV_COLD on part of one splits it; where
    the kernel cannot, before Linux 5.4 or in locked memory, they move whole).
    Without ``move``, only that marking is done, so that pages touched later
    spread evenly too. Other modes move pages as mbind(2) does: those off
    ``nodes`` (with "weighted_interleave" a page already on one of them stays).
    """
    if mode not in MBIND_MODES:
        choices = ", ".join(m.value for m in MBIND_MODES)
        raise ValueError(f"mode {str(getattr(mode, 'value', mode))!r}: choose one of {choices}")
    mode = Mode(mode)
    move = check_bool("move", move)
    targets = check_nodes(nodes)
    if mode is Mode.PREFERRED and len(targets) != 1:
        raise InvalidNodeError(f"mode 'preferred' takes one node, not {format_ids(targets)}")
    flat = flat_bytes(buf, writable=True)
    require_whole_pages(flat)
    with refusals_explained(f"numafast.mbind to node {format_ids(targets)}, mode {mode.value}"):
        _mbind(flat, mode, targets, move)


def _mbind(flat: np.ndarray, mode: Mode, targets: list[int], move: bool) -> None:
    """:func:`mbind`'s work, on its validated arguments."""
    policy = MODE_NUMBERS[mode]
    if mode is Mode.INTERLEAVE and len(targets) > 1:
        _interleave_in_place(flat, targets, move)
        return
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


def _interleave_in_place(flat: np.ndarray, targets: list[int], move: bool) -> None:
    """Interleave the whole pages of ``flat`` over ``targets`` (see :func:`mbind`).

    Whole huge pages (whole runs of MOVE_RUN_BYTES without THP) in a multiple of
    the node count form the even part: it is spread by huge page. The rest, at
    either end, is kept in base pages and spread page by page. A page's turn comes
    from its address, as the kernel's own interleave index does for anonymous memory.
    """
    span = Span.of(flat)
    first = -(-span.address // PAGE_SIZE) * PAGE_SIZE
    end = (span.address + span.nbytes) // PAGE_SIZE * PAGE_SIZE
    thp = _thp_size()
    run = thp or MOVE_RUN_BYTES
    even_start = min(-(-first // run) * run, end)
    even_end = even_start + _even_huge_bytes(end - even_start, run, len(targets))
    whole = flat.data  # a memoryview of the same bytes

    def part(start: int, stop: int) -> memoryview:
        return whole[start - span.address : stop - span.address]

    if thp:
        for start, stop in ((first, even_start), (even_end, end)):
            if start < stop and _madvise_if_possible(part(start, stop), _libnuma.MADV_NOHUGEPAGE) and move:
                _split_huge_pages(part, start, stop, thp)
    _libnuma.mbind(whole, MODE_NUMBERS[Mode.INTERLEAVE], targets, 0)
    if not move:
        return
    addresses = first + np.arange((end - first) // PAGE_SIZE, dtype=np.int64) * PAGE_SIZE
    in_even_part = (addresses >= even_start) & (addresses < even_end)
    # Where each page goes: by huge page (run) in the even part, by page elsewhere.
    turn = np.where(in_even_part, addresses // run, addresses // PAGE_SIZE) % len(targets)
    wanted = np.asarray(targets, dtype=np.int32)[turn]
    before = np.frombuffer(_libnuma.move_pages(whole, None, 0, True), dtype=np.int32)
    status = before
    failed: dict[str, int] = {}
    for delay in (0.0, *RETRY_DELAYS_S):
        if not ((status >= 0) & (status != wanted)).any():
            return
        time.sleep(delay)
        # One call, each page to its turn: a huge page of the even part moves whole
        # (all its base pages want the same node); the rest is base pages by now.
        status = np.frombuffer(_libnuma.move_pages(whole, wanted, _libnuma.MPOL_MF_MOVE, True), dtype=np.int32)
        stuck = status[(status < 0) & ~np.isin(status, UNTOUCHED_STATUSES)]
        failed = {errno.errorcode.get(-code, str(code)): int((stuck == code).sum()) for code in np.unique(stuck)}
        status = np.frombuffer(_libnuma.move_pages(whole, None, 0, True), dtype=np.int32)
    misplaced = (status >= 0) & (status != wanted)
    if not misplaced.any():
        return
    raise MigrationError(
        f"mbind: {int(misplaced.sum())} pages could not be moved to their turn in the interleave over "
        f"node {format_ids(targets)} after {len(RETRY_DELAYS_S) + 1} tries: {failed or 'still misplaced'}",
        moved=int(((before != wanted) & (status == wanted)).sum()),
        stuck=failed or {"misplaced": int(misplaced.sum())},
    )


def _madvise_if_possible(part: memoryview, advice: int) -> bool:
    """madvise(2) ``advice`` over ``part``; False where the mapping does not take it
    (EINVAL: locked or huge TLB memory, or a kernel too old for the advice)."""
    try:
        _libnuma.madvise(part, advice)
    except LibnumaError as error:
        if error.errno != errno.EINVAL:
            raise
        return False
    return True


def _split_huge_pages(part: Callable[[int, int], memoryview], start: int, stop: int, huge_page: int) -> None:
    """Split every transparent huge page that [start, stop) touches into base pages.

    MADV_COLD over one base page of a huge page splits it (a huge page it covers
    only in part) and deactivates that one page; on memory that is no huge page it
    only deactivates. A mapping or kernel that refuses MADV_COLD keeps its huge pages.
    """
    for huge_start in range(start // huge_page * huge_page, stop, huge_page):
        page = max(huge_start, start)
        if not _madvise_if_possible(part(page, page + PAGE_SIZE), _libnuma.MADV_COLD):
            return


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
    with refusals_explained(f"numafast.migrate to node {target}"):
        return _migrate(flat, target)


def _migrate(flat: np.ndarray, target: int) -> int:
    """:func:`migrate`'s work, on its validated arguments."""
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


def check_shape(shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, if it has at least one element and no negative dimension.

    A shape is an integer or a sequence of them, Python's or NumPy's; a float, a bool or
    a string is refused with a TypeError naming it."""
    if integer(shape) is not None:
        given: tuple[object, ...] = (shape,)
    elif isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise TypeError(f"shape {shape!r} is neither an integer nor a sequence of integers (like 4096 or (2, 3))")
    else:
        given = tuple(shape)
    dims: list[int] = []
    for dim in given:
        size = integer(dim)
        if size is None:
            raise TypeError(f"shape {shape!r}: {dim!r} is not an integer; dimensions are integers >= 1")
        if size < 0:
            raise InvalidSizeError(f"shape {shape!r}: negative dimension {size}; dimensions are integers >= 1")
        dims.append(size)
    if math.prod(dims) == 0:
        raise InvalidSizeError(f"shape {shape!r} holds no element; numafast allocates whole pages")
    return tuple(dims)


def check_dtype(dtype: object) -> np.dtype:
    """``dtype`` as a NumPy dtype that raw memory can hold; TypeError naming it otherwise."""
    try:
        checked: np.dtype = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TypeError(
            f"dtype {dtype!r} is not a NumPy data type; give one like 'float32', 'uint8', numpy.int64"
        ) from None
    if checked.hasobject:
        raise TypeError(f"dtype {checked} holds Python objects, which cannot live in raw memory; give a numeric dtype")
    if checked.subdtype is not None:
        base, shape = checked.subdtype
        raise TypeError(f"dtype {dtype!r} is a subarray dtype ({base} elements in shape {shape}); give the element dtype "
                        f"{str(base)!r} and add {shape} to the shape")  # fmt: skip
    if checked.itemsize == 0:
        raise TypeError(f"dtype {dtype!r} has no size (0 bytes an element); give a length, like 'S16', 'U8' or 'V4'")
    return checked


def _target_nodes(node: int | None, nodes: int | Iterable[int] | None) -> list[int]:
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
def _thp_size(switch: Path = THP_ENABLED_FILE) -> int:
    """The transparent huge page size; 0 when this kernel has no THP or ``switch`` has
    it off (``never``; ``deny`` for shared memory)."""
    try:
        mode = switch.read_text()
        if "[never]" in mode or "[deny]" in mode:
            return 0
        return int(THP_SIZE_FILE.read_text())
    except OSError:
        return 0
