"""Per-rank GPU affinity planning: which CPUs and memory nodes each local rank should use.

Pure computation on a :class:`numafast.Topology`; applying a plan (binding) is
done elsewhere.
"""

from numafast.affinity.modes import AffinityMode, Smt, cpus_for_gpu
from numafast.affinity.planning import MemoryPolicy, Plan, RankPlan, plan

__all__ = ["AffinityMode", "MemoryPolicy", "Plan", "RankPlan", "Smt", "cpus_for_gpu", "plan"]
