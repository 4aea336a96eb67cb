"""Run a thread on a node's CPUs and allocate its memory there.

Context managers (also usable as decorators; on a generator function, around each
resumption of its generators) change the calling thread's CPU affinity and/or
memory policy, and on exit restore exactly what was there before (CPU mask,
policy mode, nodes and flags), also when the body raises:
:func:`numa_local`, :func:`cpubind`, :func:`membind`, :func:`preferred`,
:func:`preferred_many`, :func:`interleave`, :func:`local_alloc`.
:func:`bind` and :func:`bind_process` change placement for good.

Kernel semantics (see README, "Placement"): affinity and memory policy belong to
one thread; threads and forked children inherit them when they are created; a
context manager therefore affects only the thread that entered it.
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import threading
from collections.abc import Callable, Generator, Iterable
from contextlib import ContextDecorator
from pathlib import Path
from typing import Any, TypeVar

from numafast import _libnuma
from numafast._validate import allowed_nodes, check_bool, check_cpus, cpus_near, format_ids, id_list, integer, parse_ids
from numafast._validate import check_nodes as _check_nodes
from numafast.capabilities import capabilities, memory_placement_refused
from numafast.errors import (
    InvalidCpuSetError,
    InvalidWeightsError,
    LibnumaError,
    NodeNotAllowedError,
    PolicyNotPermitted,
    PolicyUnsupported,
)
from numafast.topo.allowed import from_cgroup as allowed_from_cgroup
from numafast.topo.files import read_fields
from numafast.policy import (
    FLAG_BITS, MODE_NUMBERS, Mode, ModeFlag, mode_flags, raise_refusal, refusals_explained, seccomp_hint, set_mempolicy,
)  # fmt: skip

__all__ = [
    "bind",
    "bind_process",
    "cpubind",
    "cpus_allowed",
    "interleave",
    "local_alloc",
    "membind",
    "numa_local",
    "preferred",
    "preferred_many",
]

WEIGHTS_DIR = Path("/sys/kernel/mm/mempolicy/weighted_interleave")


# ---------------------------------------------------------------- which CPUs a node means


def _cpus_at_start() -> set[int]:
    """The CPUs the process (its main thread) was allowed when numafast was imported.

    A launcher's taskset or numactl restriction is respected this way, as libnuma
    does; a thread numafast binds later does not narrow it.
    """
    fields = read_fields(Path("/proc/self/status")) or {}
    if "Cpus_allowed_list" in fields:
        return set(parse_ids(fields["Cpus_allowed_list"]))
    return set(os.sched_getaffinity(0))


_CPUS_AT_START = _cpus_at_start()


def cpus_allowed() -> set[int]:
    """CPUs this process may be bound to: its cpuset's, within what it was started with."""
    cpuset_cpus, _mems = allowed_from_cgroup(Path("/"))
    return _CPUS_AT_START if cpuset_cpus is None else _CPUS_AT_START & set(cpuset_cpus)


def _node_cpus(node: int, allowed: set[int]) -> list[int]:
    """The allowed CPUs of ``node``; for a CPU-less node those of its nearest node(s) with CPUs."""
    own = _libnuma.node_to_cpus(node)
    cpus = cpus_near([node], allowed)
    if own and not set(own) & allowed:
        raise NodeNotAllowedError(
            f"node {node}'s CPUs {format_ids(own)} are all outside the CPUs this process may use ({format_ids(allowed)})"
        )
    if not cpus:
        raise InvalidCpuSetError(f"no node has CPUs this process may use ({format_ids(allowed)})")
    return cpus


def _cpus_for(cpus: int | Iterable[int] | None, nodes: int | Iterable[int] | None) -> list[int]:
    """The CPU list of ``cpubind``/``bind``-style arguments, validated against :func:`cpus_allowed`."""
    if (cpus is None) == (nodes is None):
        raise TypeError("give exactly one of cpus= or nodes=")
    allowed = cpus_allowed()
    if nodes is not None:
        return sorted({cpu for node in _check_nodes(nodes) for cpu in _node_cpus(node, allowed)})
    return check_cpus(cpus, allowed)


# ---------------------------------------------------------------- the kernel calls, with refusals explained


def _check_node(node: object) -> int:
    return _check_nodes([node])[0]


def _set_affinity(tid: int, cpus: list[int]) -> None:
    try:
        _libnuma.sched_setaffinity(tid, cpus)
    except LibnumaError as error:
        if error.errno == errno.EPERM:
            hint = seccomp_hint("sched_setaffinity")
            raise PolicyNotPermitted(f"sched_setaffinity(tid {tid}) refused with EPERM; {hint}") from error
        if error.errno == errno.EINVAL:
            raise InvalidCpuSetError(
                f"cpus {format_ids(cpus)} are all outside this thread's cpuset; "
                f"allowed CPUs: {format_ids(cpus_allowed())}"
            ) from error
        raise


def _mode_word(mode: Mode, flags: Iterable[ModeFlag | str]) -> int:
    word = MODE_NUMBERS[mode]
    for flag in mode_flags(flags):
        word |= FLAG_BITS[flag]
    return word


# ---------------------------------------------------------------- the context manager behind them all


class _Entries(threading.local):
    """Per thread: (placement, what it saved) of every block entered and not yet left."""

    def __init__(self) -> None:
        self.stack: list[tuple[Placement, tuple[list[int] | None, bool, tuple[int, list[int]] | None]]] = []


_entries = _Entries()


# The calls every block makes, bound once (a module attribute lookup each is measurable).
_sched_getaffinity = _libnuma.sched_getaffinity
_sched_setaffinity = _libnuma.sched_setaffinity
_get_mempolicy = _libnuma.get_mempolicy
_set_mempolicy = _libnuma.set_mempolicy


class Placement(ContextDecorator):
    """A CPU set and/or memory policy for the calling thread, restored exactly on exit.

    ``cpus`` None leaves the affinity alone, ``mode_word`` None the memory policy.
    A placement holds no state of its own: what a ``with`` saved is kept per
    thread, so one placement may be entered by many threads at once, nested, and
    used as a decorator.
    """

    __slots__ = ("_cpus", "_mode_word", "_nodes")

    def __init__(self, cpus: list[int] | None, mode_word: int | None, nodes: list[int]) -> None:
        self._cpus, self._mode_word, self._nodes = cpus, mode_word, nodes

    def __enter__(self) -> Placement:
        cpus, mode_word, nodes = self._cpus, self._mode_word, self._nodes
        saved_cpus = saved_policy = None
        cpus_changed = False
        # A call that would change nothing is skipped.
        if cpus is not None:
            saved_cpus = _sched_getaffinity(0)
            if cpus != saved_cpus:
                _set_affinity(0, cpus)
                cpus_changed = True
        if mode_word is not None:
            try:
                saved_policy = _get_mempolicy()
                if saved_policy[0] != mode_word or saved_policy[1] != nodes:
                    _set_mempolicy(mode_word, nodes)
            except BaseException as error:
                if cpus_changed and saved_cpus is not None:  # never leave half of the placement applied
                    _sched_setaffinity(0, saved_cpus)
                if isinstance(error, LibnumaError):
                    raise_refusal(error, mode_word, nodes)
                raise
        _entries.stack.append((self, (saved_cpus, cpus_changed, saved_policy)))
        return self

    def __call__(self, func: F) -> F:
        """As a decorator: the placement holds while ``func`` runs. For a generator
        function, while its body runs: around every resumption, not between them (the
        caller's code between two items runs under the caller's own placement)."""
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"a placement cannot decorate {func.__qualname__}, a coroutine or async generator "
                "function: its thread runs other tasks at every await, which would run under it "
                "too; enter the block with `with` around code that does not await"
            )
        if inspect.isgeneratorfunction(func):
            return _around_each_resumption(self, func)  # type: ignore[return-value]
        return super().__call__(func)

    def __exit__(self, *exc_info: object) -> None:
        stack = _entries.stack
        if stack and stack[-1][0] is self:
            saved = stack.pop()[1]
        else:  # blocks left out of order (generators): find ours
            index = max((i for i, (placement, _) in enumerate(stack) if placement is self), default=-1)
            if index < 0:
                raise RuntimeError(
                    "this placement block was not entered in this thread: a block is left by the thread that "
                    "entered it, once for each time it entered (affinity and memory policy are per thread)"
                )
            saved = stack.pop(index)[1]
        saved_cpus, cpus_changed, saved_policy = saved
        try:
            # The body may have changed either meanwhile; reading the CPUs is
            # cheaper than setting them, so they are set only if they differ.
            if saved_cpus is not None and (cpus_changed or _sched_getaffinity(0) != saved_cpus):
                _sched_setaffinity(0, saved_cpus)
        finally:
            if saved_policy is not None:
                _set_mempolicy(*saved_policy)


F = TypeVar("F", bound=Callable[..., Any])


def _around_each_resumption(
    placement: Placement, func: Callable[..., Generator[Any, Any, Any]]
) -> Callable[..., Generator[Any, Any, Any]]:
    """``func``'s generators, each step of which (next, send, throw, close) runs inside ``placement``."""

    @functools.wraps(func)
    def generator(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        with placement:
            inner = func(*args, **kwargs)
        step: Callable[[Any], Any] = inner.send
        given: Any = None
        while True:
            with placement:
                try:
                    item = step(given)
                except StopIteration as stop:
                    return stop.value
            try:
                given = yield item
                step = inner.send
            except GeneratorExit:
                with placement:
                    inner.close()
                raise
            except BaseException as error:
                step, given = inner.throw, error

    return generator


# numa_local's placement per (node, strict), validated once: topology does not
# change while a job runs, and a cpuset that changes later is still enforced by
# the kernel (it drops forbidden CPUs, and refuses a forbidden node with EINVAL,
# which entering turns into NodeNotAllowedError).
_numa_local_placements: dict[tuple[int, bool], Placement] = {}
_BIND = MODE_NUMBERS[Mode.BIND]
_PREFERRED = MODE_NUMBERS[Mode.PREFERRED]


def numa_local(node: int, *, strict: bool = False) -> Placement:
    """Run on ``node``'s allowed CPUs and allocate new pages on ``node``.

    ``strict=False`` prefers the node (MPOL_PREFERRED): when it is full, pages come
    from another node rather than the OOM killer ending a data loader.
    ``strict=True`` binds (MPOL_BIND): the node or nothing. A node without CPUs
    (CXL or HBM memory, Grace-Hopper GPU memory) runs on its nearest CPU node(s)
    by numa_distance and allocates on itself.
    """
    placement = _numa_local_placements.get((node, strict)) if type(node) is int and type(strict) is bool else None
    if placement is None:
        strict = check_bool("strict", strict)
        checked = _check_node(node)
        cpus = _node_cpus(checked, cpus_allowed())
        placement = Placement(cpus, _BIND if strict else _PREFERRED, [checked])
        _numa_local_placements[(checked, strict)] = placement
    return placement


def numa_local_if_permitted(node: int, *, strict: bool = False) -> Placement:
    """:func:`numa_local` for the placement numafast does on its own (NumaLoader's workers
    and the scope they fork in): where the kernel refuses memory policies (a container's
    seccomp profile: EPERM; no NUMA: ENOSYS), its CPU part alone, which containers allow.
    The caller says so once (:func:`numafast.capabilities.warn_unplaced`); an explicit
    numa_local raises PolicyNotPermitted instead, and so does ``strict=True``, which asks
    for the node or nothing."""
    strict = check_bool("strict", strict)
    placement = numa_local(node, strict=strict)
    if strict or not memory_placement_refused():
        return placement
    return Placement(placement._cpus, None, [])


def bind_if_permitted(node: int, *, strict: bool = False, began_on: frozenset[int] | None = None) -> None:
    """:func:`bind` as :func:`numa_local_if_permitted` places: a NumaLoader worker binds so.
    ``began_on``: the CPUs the thread began on. Where it runs on others now, all of them
    the node's, something put it there on purpose (a worker's ``worker_init_fn``, one CPU
    per worker): its CPUs stay, and only its memory policy is set. Elsewhere (an OpenMP
    runtime bound it to its first CPU, on another node) it moves to the node's CPUs."""
    placement = numa_local_if_permitted(node, strict=strict)
    if began_on is not None and placement._cpus is not None:
        now = set(_sched_getaffinity(0))
        if now != began_on and now <= set(placement._cpus):
            placement = Placement(None, placement._mode_word, placement._nodes)
    placement.__enter__()
    _entries.stack.pop()  # never exited: the change stays


def cpubind(*, cpus: int | Iterable[int] | None = None, nodes: int | Iterable[int] | None = None) -> Placement:
    """Run only on ``cpus``, or on the allowed CPUs of ``nodes`` (each one id or a list);
    memory policy untouched."""
    return Placement(_cpus_for(cpus, nodes), None, [])


def membind(nodes: int | Iterable[int], *, flags: Iterable[ModeFlag | str] = ()) -> Placement:
    """Allocate only on ``nodes`` (MPOL_BIND): when they are full, the OOM killer, not another node."""
    return Placement(None, _mode_word(Mode.BIND, flags), _check_nodes(nodes))


def preferred(node: int, *, flags: Iterable[ModeFlag | str] = ()) -> Placement:
    """Allocate on ``node`` while it has free memory, elsewhere after (MPOL_PREFERRED)."""
    return Placement(None, _mode_word(Mode.PREFERRED, flags), [_check_node(node)])


def preferred_many(nodes: int | Iterable[int], *, flags: Iterable[ModeFlag | str] = ()) -> Placement:
    """Allocate on any of ``nodes`` while they have memory (MPOL_PREFERRED_MANY, Linux 5.15+)."""
    _require("preferred_many")
    return Placement(None, _mode_word(Mode.PREFERRED_MANY, flags), _check_nodes(nodes))


def interleave(
    nodes: int | Iterable[int], *, weights: Iterable[int] | None = None, flags: Iterable[ModeFlag | str] = ()
) -> Placement:
    """Spread new pages round-robin over ``nodes`` (MPOL_INTERLEAVE).

    ``weights`` (one per node, 1-255) asks for weighted interleave (Linux 6.9+):
    node i gets weights[i] pages in turn. The kernel keeps these weights system-wide
    in /sys/kernel/mm/mempolicy/weighted_interleave/nodeN, not per thread; numafast
    does not rewrite a setting that every process shares, so the weights must
    already be set there (the error says how) and are checked to match.
    """
    try:
        given = id_list(nodes)
    except TypeError:
        given = [nodes]  # _check_nodes names what is wrong with it
    checked = _check_nodes(given)
    if weights is None:
        return Placement(None, _mode_word(Mode.INTERLEAVE, flags), checked)
    wanted = _check_weights([int(node) for node in given], weights)  # type: ignore[call-overload]
    _require("weighted_interleave")
    _match_system_weights(wanted)
    return Placement(None, _mode_word(Mode.WEIGHTED_INTERLEAVE, flags), checked)


def local_alloc() -> Placement:
    """Allocate on the node of the CPU that touches each page (MPOL_LOCAL)."""
    return Placement(None, MODE_NUMBERS[Mode.LOCAL], [])


def _require(feature: str) -> None:
    capability = getattr(capabilities(), feature)
    if not capability.available:
        raise PolicyUnsupported(f"{feature} is not available here: {capability.reason}")


def _check_weights(nodes: list[int], weights: object) -> dict[int, int]:
    """{node: its weight}, one integer in 1..255 for each node given once; else InvalidWeightsError."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
        raise InvalidWeightsError(f"weights {weights!r} is not a list: give one weight (1..255) per node, in order")
    given = list(weights)
    if len(given) != len(nodes):
        raise InvalidWeightsError(f"{len(given)} weights for {len(nodes)} nodes {nodes}; give one per node")
    values = [integer(weight) for weight in given]
    for weight, value in zip(given, values):
        if value is None or not 1 <= value <= 255:
            raise InvalidWeightsError(f"weight {weight!r} is not an integer in 1..255")
    if len(set(nodes)) != len(nodes):
        twice = format_ids(node for node in nodes if nodes.count(node) > 1)
        raise InvalidWeightsError(f"node {twice} given more than once in {nodes}: with weights, give each node once")
    return dict(zip(nodes, values))  # type: ignore[arg-type]


def _match_system_weights(wanted: dict[int, int]) -> None:
    """InvalidWeightsError unless the kernel's system-wide weights are ``wanted``."""
    system = {node: int((WEIGHTS_DIR / f"node{node}").read_text()) for node in wanted}
    if system != wanted:
        commands = "; ".join(f"echo {w} > {WEIGHTS_DIR}/node{n}" for n, w in wanted.items())
        raise InvalidWeightsError(
            f"weights {wanted} differ from the kernel's system-wide weights {system}; the kernel "
            f"has no per-thread weights: an administrator sets them ({commands})"
        )


# ---------------------------------------------------------------- persistent binding


def bind(node: int, *, strict: bool = False) -> None:
    """Bind the calling thread for good: ``node``'s CPUs, and memory there (as numa_local)."""
    placement = numa_local(node, strict=strict)
    placement.__enter__()
    _entries.stack.pop()  # never exited: the change stays


def move_every_thread(cpus: list[int]) -> dict[int, list[int]]:
    """Set every thread's CPU affinity to ``cpus``; return {thread id: its CPUs before}.

    Threads are listed in /proc/self/task; one that ends meanwhile (ESRCH) is
    skipped. On failure the threads already moved are put back before raising.
    """
    moved: dict[int, list[int]] = {}
    try:
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                before = _libnuma.sched_getaffinity(tid)
                _set_affinity(tid, cpus)
            except LibnumaError as error:
                if error.errno != errno.ESRCH:
                    raise
            else:
                moved[tid] = before
    except BaseException:
        restore_thread_cpus(moved)
        raise
    return moved


def restore_thread_cpus(moved: dict[int, list[int]]) -> None:
    """Put back the CPUs :func:`move_every_thread` recorded (threads that ended are skipped)."""
    for tid, before in moved.items():
        try:
            _libnuma.sched_setaffinity(tid, before)
        except LibnumaError:
            pass


def bind_process(node: int, *, strict: bool = False, migrate: bool = False) -> list[int]:
    """Move every thread of this process to ``node``'s CPUs; set the calling thread's policy.

    The kernel offers no way to change another thread's memory policy, so only
    the caller's is set (threads created afterwards inherit it). ``migrate=True``
    also moves pages already touched on other nodes to ``node``. Returns the ids
    of the threads that were moved.
    """
    migrate = check_bool("migrate", migrate)
    placement = numa_local(node, strict=strict)
    cpus, nodes = placement._cpus, placement._nodes
    moved = move_every_thread(cpus)  # type: ignore[arg-type]
    try:
        set_mempolicy(placement._mode_word, nodes)  # type: ignore[arg-type]
    except BaseException:
        restore_thread_cpus(moved)  # never leave half of the placement applied
        raise
    if migrate:
        others = [n for n in allowed_nodes() if n != node]
        if others:
            with refusals_explained(f"bind_process(node {node}, migrate=True) moving this process's pages"):
                _libnuma.migrate_pages(0, others, nodes)
    return sorted(moved)
