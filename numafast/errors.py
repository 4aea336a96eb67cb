"""Exceptions of numafast: each names the problem, the value and what is allowed."""

from __future__ import annotations

from numafast._libnuma import LibnumaError

__all__ = [
    "InvalidCpuSetError",
    "InvalidNodeError",
    "InvalidWeightsError",
    "LibnumaError",
    "NodeNotAllowedError",
    "NumaError",
    "NumaUnavailable",
    "PolicyNotPermitted",
    "PolicyUnsupported",
    # topology and GPU affinity planning
    "InvalidGpuError",
    "PlacementError",
    "TopologyWarning",
    # applying GPU affinity
    "AffinityWarning",
    "LocalRankError",
]


class NumaError(Exception):
    """Base class of numafast's own errors."""


class NumaUnavailable(NumaError, OSError):
    """The kernel (or a container) offers no NUMA system calls: numa_available() < 0."""


class InvalidNodeError(NumaError, ValueError):
    """A node id that this machine does not have."""


class NodeNotAllowedError(NumaError, PermissionError):
    """A node that exists but that this process's cpuset (cgroup, numactl, taskset) forbids."""


class InvalidCpuSetError(NumaError, ValueError):
    """An empty CPU set, or CPUs this machine does not have or this process may not use."""


# ---------------------------------------------------------------- placement (binding, memory policy)


class PolicyNotPermitted(NumaError, PermissionError):
    """The kernel refused a memory policy or CPU binding with EPERM (seccomp, capabilities)."""


class PolicyUnsupported(NumaError, OSError):
    """This kernel or libnuma does not offer the memory policy asked for (too old, no NUMA)."""


class InvalidWeightsError(NumaError, ValueError):
    """Interleave weights that do not fit the nodes, or that the kernel's weights contradict."""
# ---------------------------------------------------------------- topology and GPU affinity planning


class TopologyWarning(UserWarning):
    """A topology file was damaged or missing (NUL bytes, empty, no cache directory, an
    unmatched CUDA_VISIBLE_DEVICES entry): the answer given is a best effort."""


class InvalidGpuError(NumaError, ValueError):
    """A CUDA device index this topology does not have, or one whose NUMA node is unknown."""


class PlacementError(NumaError, ValueError):
    """A CPU placement that cannot be made: e.g. more GPUs on a node than it has cores."""
# ---------------------------------------------------------------- applying GPU affinity (issue 6: bind_rank)


class LocalRankError(NumaError, ValueError):
    """No local rank: none given and no launcher variable set, or one that is not a rank."""


class AffinityWarning(UserWarning):
    """Something in the environment (OpenMP's own pinning) will undo or fight a binding."""
