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

# ---- placement (issue 4): binding, memory policies, capabilities
from numafast import binding
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
from numafast.errors import InvalidWeightsError, PolicyNotPermitted, PolicyUnsupported
from numafast.policy import Mode, ModeFlag, Policy, get_policy, set_policy

_PLACEMENT_API = [
    *binding.__all__,
    "Capabilities",
    "Capability",
    "InvalidWeightsError",
    "Mode",
    "ModeFlag",
    "Policy",
    "PolicyNotPermitted",
    "PolicyUnsupported",
    "capabilities",
    "get_policy",
    "set_policy",
]
# ---- end placement
# topology (issue 3)
from numafast.errors import InvalidGpuError, PlacementError, TopologyWarning
from numafast.topo import Cpu, Gpu, Node, PciDevice, Topology, topology

# GPU affinity planning (issue 6)
from numafast.affinity import AffinityMode, MemoryPolicy, Plan, RankPlan, Smt, cpus_for_gpu, plan

# applying GPU affinity (issue 6)
from numafast.affinity import bind_rank, local_rank_from_environment, plan_rank
from numafast.errors import AffinityWarning, LocalRankError

__version__ = "0.1.0"

__all__ = [
    "InvalidCpuSetError",
    "InvalidNodeError",
    "LibnumaError",
    "NodeNotAllowedError",
    "NumaError",
    "NumaUnavailable",
    "numa_available",
    *_PLACEMENT_API,
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
    # applying GPU affinity (issue 6)
    "AffinityWarning",
    "LocalRankError",
    "bind_rank",
    "local_rank_from_environment",
    "plan_rank",
]


def numa_available() -> bool:
    """True when the kernel offers the NUMA system calls (libnuma's numa_available() >= 0).

    Without them (a kernel built without CONFIG_NUMA, or a seccomp profile that
    blocks get_mempolicy) the package still imports; placement calls then raise
    :class:`NumaUnavailable`.
    """
    return _libnuma.available() >= 0
