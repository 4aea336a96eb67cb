"""Per-rank GPU affinity planning: which CPUs and memory nodes each local rank should use.

Planning is pure computation on a :class:`numafast.Topology`; :func:`bind_rank`
applies one rank's plan to this process.
"""

from numafast.affinity.modes import AffinityMode, Smt, cpus_for_gpu
from numafast.affinity.planning import MemoryPolicy, Plan, RankPlan, plan
from numafast.affinity.apply import bind_rank, local_rank_from_environment, plan_rank

__all__ = [
    "AffinityMode",
    "MemoryPolicy",
    "Plan",
    "RankPlan",
    "Smt",
    "bind_rank",
    "cpus_for_gpu",
    "local_rank_from_environment",
    "plan",
    "plan_rank",
]
