"""What placement works on this machine, and why not: :func:`capabilities`.

Containers and old kernels differ: a seccomp profile may answer set_mempolicy,
mbind or move_pages with EPERM, a kernel before 5.15 lacks MPOL_PREFERRED_MANY, one before 6.9 lacks
MPOL_WEIGHTED_INTERLEAVE. The probes run once, in a short-lived thread of their
own: memory policy and CPU affinity are per thread, so whatever a probe sets
dies with that thread and the caller's placement is never touched.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
from dataclasses import dataclass, fields
from functools import cache

from numafast import _libnuma, _process
from numafast._validate import allowed_nodes, format_ids
from numafast.errors import LibnumaError
from numafast.policy import seccomp_hint


@dataclass(frozen=True)
class Capability:
    """Whether a feature works here; ``reason`` says why not (empty when it does)."""

    available: bool
    reason: str = ""
    errno: int = 0
    """The errno of the kernel's refusal (0 when it works, or none was asked)."""


@dataclass(frozen=True)
class Capabilities:
    """The result of :func:`capabilities`: one :class:`Capability` per feature."""

    numa: Capability
    """The NUMA system calls exist (libnuma's numa_available())."""
    set_mempolicy: Capability
    """A thread may set its memory policy (what every memory context manager needs)."""
    preferred_many: Capability
    """MPOL_PREFERRED_MANY (Linux 5.15+, libnuma 2.0.15+): :func:`numafast.preferred_many`."""
    weighted_interleave: Capability
    """MPOL_WEIGHTED_INTERLEAVE (Linux 6.9+): :func:`numafast.interleave` with ``weights=``."""
    cpu_affinity: Capability
    """A thread may set its CPU affinity (what numa_local and cpubind need)."""
    mbind: Capability
    """A range of memory may get its own policy (what :func:`numafast.empty` and :func:`numafast.mbind` need)."""
    move_pages: Capability
    """The kernel says where each page is (:func:`numafast.page_nodes`, :func:`numafast.migrate`)."""
    kernel: str
    """The kernel release (uname -r)."""

    def __str__(self) -> str:
        lines = [f"kernel {self.kernel}"]
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, Capability):
                lines.append(f"{item.name:>20}: {'yes' if value.available else 'no: ' + value.reason}")
        return "\n".join(lines)


def _refusal(call: str, error: LibnumaError, needs: str = "") -> Capability:
    code = error.errno or 0
    if code == errno.EPERM:
        return Capability(False, f"{call} refused with EPERM; {seccomp_hint(call.partition('(')[0])}", code)
    if code in (errno.EINVAL, errno.ENOSYS) and needs:
        kernel = os.uname().release
        return Capability(False, f"{call} refused ({error.strerror}): {needs}, this kernel is {kernel}", code)
    if code == errno.ENOSYS:
        return Capability(False, f"{call} refused with ENOSYS: this kernel has no NUMA support (CONFIG_NUMA)", code)
    return Capability(False, str(error), code)


def _probe_set_mempolicy(node: int) -> Capability:
    try:
        _libnuma.set_mempolicy(_libnuma.MPOL_PREFERRED, [node])
    except LibnumaError as error:
        return _refusal("set_mempolicy", error)
    return Capability(True)


def _probe_preferred_many(node: int) -> Capability:
    if _libnuma.has_preferred_many() <= 0:
        return Capability(False, "libnuma or the kernel lacks MPOL_PREFERRED_MANY (needs Linux 5.15+, libnuma 2.0.15+)")
    try:
        _libnuma.set_mempolicy(_libnuma.MPOL_PREFERRED_MANY, [node])
    except LibnumaError as error:
        return _refusal("set_mempolicy(MPOL_PREFERRED_MANY)", error, "MPOL_PREFERRED_MANY needs Linux 5.15+")
    return Capability(True)


def _probe_weighted_interleave(node: int) -> Capability:
    try:
        _libnuma.set_mempolicy(_libnuma.MPOL_WEIGHTED_INTERLEAVE, [node])
    except LibnumaError as error:
        return _refusal("set_mempolicy(MPOL_WEIGHTED_INTERLEAVE)", error, "MPOL_WEIGHTED_INTERLEAVE needs Linux 6.9+")
    return Capability(True)


def _probe_cpu_affinity() -> Capability:
    try:
        _libnuma.sched_setaffinity(0, _libnuma.sched_getaffinity(0))
    except LibnumaError as error:
        return _refusal("sched_setaffinity", error)
    return Capability(True)


def _probe_mbind_and_move_pages(node: int) -> tuple[Capability, Capability]:
    """mbind a fresh one-page mapping to ``node``, touch it, and ask move_pages where it is."""
    page = _libnuma.mmap_anonymous(_libnuma.pagesize())
    try:
        try:
            _libnuma.mbind(page, _libnuma.MPOL_PREFERRED, [node])
            mbind = Capability(True)
        except LibnumaError as error:
            mbind = _refusal("mbind", error)
        memoryview(page)[0] = 1  # first touch: the page now exists
        try:
            _libnuma.move_pages(page)
            move_pages = Capability(True)
        except LibnumaError as error:
            move_pages = _refusal("move_pages", error)
    finally:
        page.free()
    return mbind, move_pages


def _probe_numa() -> Capability:
    if _libnuma.available() < 0:
        return Capability(False, "numa_available() < 0: the kernel has no NUMA system calls (ENOSYS)", errno.ENOSYS)
    try:  # libnuma counts only ENOSYS as unavailable; a seccomp profile answers EPERM
        _libnuma.get_mempolicy()
    except LibnumaError as error:
        return _refusal("get_mempolicy", error)
    return Capability(True)


def _probes() -> dict[str, Capability]:
    """Every probe, in a thread of its own: whatever a probe sets ends with that thread."""
    results: dict[str, Capability] = {}
    failures: list[BaseException] = []

    def probe() -> None:
        try:
            results["cpu_affinity"] = _probe_cpu_affinity()
            results["numa"] = _probe_numa()
            if results["numa"].errno not in (0, errno.EPERM):  # a refused get_mempolicy says nothing of the others
                missing = Capability(False, f"no NUMA system calls: {results['numa'].reason}", results["numa"].errno)
                results.update(
                    set_mempolicy=missing, preferred_many=missing, weighted_interleave=missing,
                    mbind=missing, move_pages=missing,
                )  # fmt: skip
                return
            node = allowed_nodes()[0]
            results["set_mempolicy"] = setting = _probe_set_mempolicy(node)
            if setting.available:
                results["preferred_many"] = _probe_preferred_many(node)
                results["weighted_interleave"] = _probe_weighted_interleave(node)
            else:  # no mode at all, new or old
                results["preferred_many"] = results["weighted_interleave"] = setting
            results["mbind"], results["move_pages"] = _probe_mbind_and_move_pages(node)
        except BaseException as error:  # handed to the caller below
            failures.append(error)

    thread = threading.Thread(target=probe, name="numafast-capabilities")
    thread.start()
    thread.join()
    if failures:
        raise failures[0]
    return results


@cache
def capabilities() -> Capabilities:
    """Probe once what placement works here (cached for the life of the process)."""
    return Capabilities(**_probes(), kernel=os.uname().release)


# ---------------------------------------------------------------- placement numafast does on its own

# NOTE: who asked decides what a refusal does. Where a container's seccomp profile refuses
# the memory policy calls (EPERM: Docker's default, Kubernetes' RuntimeDefault, without
# CAP_SYS_NICE) or the kernel has no NUMA (ENOSYS), an explicit request (numa_local and
# the other blocks, bind, bind_process, numafast.empty/allocate, mbind, migrate) raises
# PolicyNotPermitted / PolicyUnsupported naming the call, the cause and the fix: the user
# asked for that placement and must not believe it happened. Placement numafast does on
# its own (NumaLoader's workers and the scope they fork in, pinned pools) goes on without
# memory policy, CPU binding kept, said once per process at the user's line
# (warn_unplaced): training in a default container must work, only less well placed.

_MEMORY_CALLS = ("numa", "set_mempolicy", "mbind")  # get_mempolicy (the numa probe), set_mempolicy, mbind
PROBE_CALLS = {"numa": "get_mempolicy", "preferred_many": "set_mempolicy", "weighted_interleave": "set_mempolicy",
               "cpu_affinity": "sched_setaffinity"}  # fmt: skip
"""The system call each capability's probe makes, where its name is not that call."""


def memory_placement_refused() -> list[tuple[str, Capability]]:
    """The memory placement calls the kernel refuses here outright (EPERM, ENOSYS), as
    (call, capability): empty where numafast can place memory (cached: NumaLoader asks
    at every iteration)."""
    found = capabilities()
    refused = [(name, getattr(found, name)) for name in _MEMORY_CALLS
               if getattr(found, name).errno in (errno.EPERM, errno.ENOSYS)]  # fmt: skip
    return [(PROBE_CALLS.get(name, name), capability) for name, capability in refused]


def unplaced_text(nodes: list[int], refused: list[tuple[str, Capability]]) -> str:
    """Why memory meant for ``nodes`` goes where the kernel puts it, and what (if anything) to do."""
    calls = ", ".join(call for call, _ in refused)
    where = f"not placed on node {format_ids(nodes)} but where the kernel puts it"
    if all(capability.errno == errno.ENOSYS for _, capability in refused):
        return (
            f"{calls}: this kernel has no NUMA support (ENOSYS), so numafast's memory (pinned pools, arrays) is "
            f"{where}; everything else works. Nothing to do: such a kernel has one memory node. This is said once"
        )
    return (
        f"{calls} refused with EPERM, so numafast's memory (pinned pools, the loader's workers' memory) is {where}; "
        f"CPU binding still applies and everything else works. Why: {seccomp_hint(*(call for call, _ in refused))}. "
        "This is said once"
    )


def warn_unplaced(nodes: list[int], refused: list[tuple[str, Capability]], stacklevel: int) -> None:
    """Say once per process that numafast's own placement (pools, NumaLoader) goes on without
    memory policy; ``stacklevel`` as warnings.warn's, from the caller: the user's line."""
    if _process.first_time("memory placement refused"):
        warnings.warn(unplaced_text(nodes, refused), RuntimeWarning, stacklevel=stacklevel + 1)
