"""Applying a plan: bind this process to the CPUs and memory of its local rank's GPU.

What a launcher wrapper (numactl, NVIDIA's gpu_affinity, torchrun's
``--numa-binding``) does, from inside the process: the local rank comes from
the launcher's environment, the GPU is CUDA device ``local_rank`` (as
``CUDA_VISIBLE_DEVICES`` numbers them), and the CPUs and memory policy are
:func:`numafast.plan`'s for that rank.
"""

from __future__ import annotations

import os
import warnings

from numafast._validate import check_cpus, format_ids, integer
from numafast.affinity.modes import AffinityMode, Smt, resolve_topology
from numafast.affinity.planning import MemoryPolicy, RankPlan, plan
from numafast.binding import cpus_allowed, move_every_thread
from numafast.errors import AffinityWarning, InvalidGpuError, LocalRankError
from numafast.policy import Mode, Policy, get_policy, refusals_explained, set_mempolicy, set_policy
from numafast.topo import Topology

__all__ = ["LOCAL_RANK_VARIABLES", "bind_rank", "local_rank_from_environment", "plan_rank"]

# Each launcher's local rank and local size variables, innermost launcher first:
# torchrun started by srun sees LOCAL_RANK and also SLURM_LOCALID (0 for every
# rank that one srun task started), so LOCAL_RANK must win.
LOCAL_RANK_VARIABLES: tuple[tuple[str, str], ...] = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun, torch.distributed.launch
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),  # srun
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI's mpirun
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Intel MPI (Hydra)
    ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),  # Cray PMI, PMIx
)

# OpenMP runtimes pin their threads themselves when these ask for it, each to its
# own idea of the CPUs; the values listed mean "do not pin".
OPENMP_AFFINITY_VARIABLES: dict[str, tuple[str, ...]] = {
    "KMP_AFFINITY": ("disabled", "none"),
    "OMP_PROC_BIND": ("false",),
    "GOMP_CPU_AFFINITY": (),
}

# The set_mempolicy(2) mode of each memory policy a plan can ask for (NONE sets none).
_MODES = {
    MemoryPolicy.PREFERRED: Mode.PREFERRED,
    MemoryPolicy.BIND: Mode.BIND,
    MemoryPolicy.INTERLEAVE: Mode.INTERLEAVE,
}


def local_rank_from_environment() -> tuple[int, str, int | None]:
    """(local rank, the variable it came from, local size or None) from the launcher's environment."""
    for rank_variable, size_variable in LOCAL_RANK_VARIABLES:
        if rank_variable in os.environ:
            rank = _environment_int(rank_variable, minimum=0)
            size = _environment_int(size_variable, minimum=1) if size_variable in os.environ else None
            return rank, rank_variable, size
    names = ", ".join(rank for rank, _ in LOCAL_RANK_VARIABLES)
    raise LocalRankError(
        f"no local rank given and none of {names} is set: start this under torchrun, srun or mpirun, "
        "or pass the local rank"
    )


def _environment_int(name: str, *, minimum: int) -> int:
    text = os.environ[name]
    if not text.strip().isdecimal() or int(text) < minimum:
        raise LocalRankError(f"{name}={text!r} is not an integer >= {minimum}")
    return int(text)


def bind_rank(
    local_rank: int | None = None,
    *,
    mode: AffinityMode | str = AffinityMode.NODE,
    memory: MemoryPolicy | str = MemoryPolicy.PREFERRED,
    topology: Topology | None = None,
    nproc_per_node: int | None = None,
    smt: Smt | str = Smt.ALL,
    balanced: bool = True,
    min_cores: int = 1,
    max_cores: int | None = None,
) -> RankPlan:
    """Bind every thread of this process to the CPUs of local rank ``local_rank``'s GPU,
    and the calling thread's memory policy to the rank's memory nodes; return the rank's plan.

    ``local_rank`` defaults to the launcher's (LOCAL_RANK, SLURM_LOCALID,
    OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, PMI_LOCAL_RANK, first one set),
    and then ``nproc_per_node`` to the launcher's local size variable next to it
    (LOCAL_WORLD_SIZE, ...); otherwise there is one rank per GPU. Rank r drives CUDA
    device r of ``topology`` (default: this machine's, numbered as
    CUDA_VISIBLE_DEVICES says).
    ``mode``, ``smt``, ``balanced``, ``min_cores`` and ``max_cores`` are as for
    :func:`numafast.cpus_for_gpu`; ``memory`` is a :class:`MemoryPolicy`.

    The kernel sets another thread's CPUs but not its memory policy: threads that
    already exist keep theirs, threads started afterwards (DataLoader workers,
    pin-memory threads) inherit the caller's. Call this first thing in the rank,
    before torch starts its pools. Everything is validated before anything
    changes, and a failure half-way undoes what was done.
    """
    rank_plan = plan_rank(
        local_rank, mode=mode, memory=memory, topology=topology, nproc_per_node=nproc_per_node,
        smt=smt, balanced=balanced, min_cores=min_cores, max_cores=max_cores,
    )  # fmt: skip
    cpus = check_cpus(rank_plan.cpus, cpus_allowed())
    _warn_about_openmp_pinning(rank_plan)
    if rank_plan.memory_policy is MemoryPolicy.NONE:  # CPUs only: no memory-policy call at all
        move_every_thread(cpus)
        return rank_plan
    with refusals_explained(f"bind_rank, memory={rank_plan.memory_policy.value!r}; memory='none' binds CPUs only"):
        policy_before = get_policy()
        set_policy(Policy(_MODES[rank_plan.memory_policy], rank_plan.memory_nodes))
    try:
        move_every_thread(cpus)
    except BaseException:
        set_mempolicy(*policy_before.to_kernel())
        raise
    return rank_plan


def plan_rank(
    local_rank: int | None = None,
    *,
    mode: AffinityMode | str = AffinityMode.NODE,
    memory: MemoryPolicy | str = MemoryPolicy.PREFERRED,
    topology: Topology | None = None,
    nproc_per_node: int | None = None,
    smt: Smt | str = Smt.ALL,
    balanced: bool = True,
    min_cores: int = 1,
    max_cores: int | None = None,
) -> RankPlan:
    """What :func:`bind_rank` would apply, with the same arguments; changes nothing."""
    launcher_size: tuple[str, int] | None = None  # (variable, value) when the launcher sets nproc_per_node
    if local_rank is None:
        local_rank, variable, environment_size = local_rank_from_environment()
        source = f"{variable}={local_rank}"
        if nproc_per_node is None and environment_size is not None:
            nproc_per_node = environment_size
            launcher_size = (dict(LOCAL_RANK_VARIABLES)[variable], environment_size)
    elif (rank := integer(local_rank)) is None or rank < 0:
        raise LocalRankError(f"local_rank must be an integer >= 0, not {local_rank!r}")
    else:
        local_rank = rank
        source = f"local rank {local_rank}"
    machine = resolve_topology(topology)
    if launcher_size is not None and launcher_size[1] > len(machine.gpus):
        raise InvalidGpuError(
            f"{launcher_size[0]}={launcher_size[1]} ranks on this machine, but it has {len(machine.gpus)} CUDA devices "
            f"({format_ids(gpu.index for gpu in machine.gpus)})"
        )
    result = plan(
        nproc_per_node, mode=mode, topology=machine, smt=smt, balanced=balanced,
        min_cores=min_cores, max_cores=max_cores, memory=memory,
    )  # fmt: skip
    if local_rank >= len(result.ranks):
        if not result.ranks:
            raise InvalidGpuError(f"{source} has no GPU: this topology has no CUDA device (see CUDA_VISIBLE_DEVICES)")
        gpus = format_ids(r.gpu for r in result.ranks)
        raise InvalidGpuError(f"{source} has no GPU: the job's {len(result.ranks)} ranks drive CUDA devices {gpus}")
    return result.ranks[local_rank]


def _warn_about_openmp_pinning(rank_plan: RankPlan) -> None:
    for name, harmless in OPENMP_AFFINITY_VARIABLES.items():
        value = os.environ.get(name)
        if value is not None and value.strip().lower() not in harmless:
            warnings.warn(
                f"{name}={value} is set: the OpenMP runtime will pin its threads itself, possibly off "
                f"rank {rank_plan.rank}'s CPUs {format_ids(rank_plan.cpus)}; unset it to keep numafast's binding",
                AffinityWarning,
                stacklevel=3,
            )
