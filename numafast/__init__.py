"""numafast: NUMA placement for deep-learning input pipelines.

The native layer, :mod:`numafast._libnuma`, mirrors libnuma one call to one
function; this package adds validation, policy and typed objects on top.
"""

from __future__ import annotations

from numafast import _libnuma
from numafast.errors import (
    InvalidCpuSetError,
    InvalidNodeError,
    LibnumaError,
    NodeNotAllowedError,
    NumaError,
    NumaUnavailable,
)

# topology (issue 3)
from numafast.errors import InvalidGpuError, PlacementError, TopologyWarning
from numafast.topology import Cpu, Gpu, Node, PciDevice, Topology, topology

# GPU affinity planning (issue 6)
from numafast.affinity import AffinityMode, MemoryPolicy, Plan, RankPlan, Smt, cpus_for_gpu, plan

__version__ = "0.1.0"

__all__ = [
    "InvalidCpuSetError",
    "InvalidNodeError",
    "LibnumaError",
    "NodeNotAllowedError",
    "NumaError",
    "NumaUnavailable",
    "numa_available",
    # topology (issue 3)
    "Cpu",
    "Gpu",
    "InvalidGpuError",
    "Node",
    "PciDevice",
    "PlacementError",
    "Topology",
    "TopologyWarning",
    "topology",
    # GPU affinity planning (issue 6)
    "AffinityMode",
    "MemoryPolicy",
    "Plan",
    "RankPlan",
    "Smt",
    "cpus_for_gpu",
    "plan",
]


def numa_available() -> bool:
    """True when the kernel offers the NUMA system calls (libnuma's numa_available() >= 0).

    Without them (a kernel built without CONFIG_NUMA, or a seccomp profile that
    blocks get_mempolicy) the package still imports; placement calls then raise
    :class:`NumaUnavailable`.
    """
    return _libnuma.available() >= 0
