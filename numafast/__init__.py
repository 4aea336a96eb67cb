"""numafast: NUMA placement for deep-learning input pipelines.

The native layer, :mod:`numafast._libnuma`, mirrors libnuma one call to one
function; this package adds validation, policy and typed objects on top.
:mod:`numafast.torch` (the PyTorch loader) is imported on first use of
``numafast.torch``: ``import numafast`` never imports torch. Nor NumPy: memory,
pages, pools and bench (:data:`_ON_FIRST_USE`) are imported as first named, so that
a process that only places itself (``numafast run``, a launcher's rank) starts in
about half the time (bench/bench_startup.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from numafast import _libnuma, binding
from numafast.affinity import (
    AffinityMode,
    MemoryPolicy,
    Plan,
    RankPlan,
    Smt,
    bind_rank,
    cpus_for_gpu,
    local_rank_from_environment,
    plan,
    plan_rank,
)
from numafast.binding import (
    bind,
    bind_process,
    cpubind,
    cpus_allowed,
    interleave,
    local_alloc,
    membind,
    numa_local,
    preferred,
    preferred_many,
)
from numafast.capabilities import Capabilities, Capability, capabilities
from numafast.errors import (
    AffinityWarning,
    CudaUnavailable,
    InvalidBufferError,
    InvalidCpuSetError,
    InvalidGpuError,
    InvalidNodeError,
    InvalidSizeError,
    InvalidWeightsError,
    LibnumaError,
    LocalRankError,
    MemlockError,
    MemlockWarning,
    MigrationError,
    NodeMemoryError,
    NodeNotAllowedError,
    NumaError,
    NumaUnavailable,
    PlacementError,
    PolicyNotPermitted,
    PolicyUnsupported,
    PoolClosedError,
    PoolExhaustedError,
    PoolForkedError,
    SlotTooSmallError,
    TopologyWarning,
)
from numafast.policy import Mode, ModeFlag, Policy, get_policy, set_policy
from numafast.topo import Cpu, Gpu, Node, PciDevice, Topology, topology

if TYPE_CHECKING:
    from numafast import torch
    from numafast.cli.bench import BenchResult, bench
    from numafast.memory import empty, mbind, migrate, zeros
    from numafast.pages import PageNodes, PlacementReport, page_nodes, placement
    from numafast.pool import LockMode, PinnedPool, PoolStats, RegisterMode

_ON_FIRST_USE = {
    **dict.fromkeys(("BenchResult", "bench"), "numafast.cli.bench"),
    **dict.fromkeys(("empty", "mbind", "migrate", "zeros"), "numafast.memory"),
    **dict.fromkeys(("PageNodes", "PlacementReport", "page_nodes", "placement"), "numafast.pages"),
    **dict.fromkeys(("LockMode", "PinnedPool", "PoolStats", "RegisterMode"), "numafast.pool"),
}
"""The names exported from the modules that import NumPy (or much else), by module."""

__version__ = "0.1.0"

__all__ = [
    # errors
    "InvalidBufferError",
    "InvalidCpuSetError",
    "InvalidGpuError",
    "InvalidNodeError",
    "InvalidSizeError",
    "InvalidWeightsError",
    "LibnumaError",
    "MigrationError",
    "NodeMemoryError",
    "NodeNotAllowedError",
    "NumaError",
    "NumaUnavailable",
    "PlacementError",
    "PolicyNotPermitted",
    "PolicyUnsupported",
    "TopologyWarning",
    "numa_available",
    # topology
    "Cpu",
    "Gpu",
    "Node",
    "PciDevice",
    "Topology",
    "topology",
    # placement: CPU binding and memory policy
    *binding.__all__,
    "Capabilities",
    "Capability",
    "Mode",
    "ModeFlag",
    "Policy",
    "capabilities",
    "get_policy",
    "set_policy",
    # node-local memory
    "PageNodes",
    "PlacementReport",
    "empty",
    "mbind",
    "migrate",
    "page_nodes",
    "placement",
    "zeros",
    # pinned pools
    "CudaUnavailable",
    "LockMode",
    "MemlockError",
    "MemlockWarning",
    "PinnedPool",
    "PoolClosedError",
    "PoolExhaustedError",
    "PoolForkedError",
    "PoolStats",
    "RegisterMode",
    "SlotTooSmallError",
    # GPU affinity: planning and launching
    "AffinityMode",
    "MemoryPolicy",
    "Plan",
    "RankPlan",
    "Smt",
    "cpus_for_gpu",
    "plan",
    "AffinityWarning",
    "LocalRankError",
    "bind_rank",
    "local_rank_from_environment",
    "plan_rank",
    # what placement is worth here: numafast bench
    "BenchResult",
    "bench",
]


def numa_available() -> bool:
    """True when the kernel offers the NUMA system calls (libnuma's numa_available() >= 0).

    Without them (a kernel built without CONFIG_NUMA, or a seccomp profile that
    blocks get_mempolicy) the package still imports; placement calls then raise
    :class:`NumaUnavailable`.
    """
    return _libnuma.available() >= 0


def __getattr__(name: str) -> object:
    """``numafast.torch`` on first access (it imports PyTorch, which ``import numafast``
    does not), as other packages load an optional heavy part; so each name of
    :data:`_ON_FIRST_USE`, then kept here, and each submodule not imported yet."""
    if name in _ON_FIRST_USE:
        value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
        globals()[name] = value
        return value
    if name != "torch":
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module 'numafast' has no attribute {name!r}")
    try:
        return importlib.import_module("numafast.torch")
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        raise ModuleNotFoundError(
            "numafast.torch needs PyTorch, which this Python does not have: pip install 'numafast[torch]'", name="torch"
        ) from error


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_FIRST_USE})
