"""A whole node's plan: every local rank's GPU, CPUs and memory policy, with the
problems a launcher should hear about before it starts eight processes."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any

from numafast._validate import format_ids, integer, member
from numafast.affinity.modes import AffinityMode, Smt, cpus_for_gpu, job_gpus, resolve_topology, site_of
from numafast.topo import Topology


class MemoryPolicy(str, Enum):
    """Where a rank's host memory (pinned buffers, DataLoader batches) should go."""

    PREFERRED = "preferred"
    """Prefer the GPU's CPU node; spill elsewhere when it is full (numactl --preferred)."""
    BIND = "bind"
    """Only the nodes of the rank's CPUs (numactl --membind): fails rather than spills."""
    INTERLEAVE = "interleave"
    """Pages spread over the nodes of the rank's CPUs (numactl --interleave)."""
    NONE = "none"
    """Leave the process's memory policy alone."""


@dataclass(frozen=True)
class RankPlan:
    """What local rank ``rank`` should do."""

    rank: int
    gpu: int
    gpu_address: str
    gpu_node: int
    """The GPU's own node (a CPU-less HBM node on Grace-Hopper)."""
    cpu_node: int
    """The node whose CPUs drive the GPU (the nearest one to a CPU-less node)."""
    cpus: tuple[int, ...]
    memory_policy: MemoryPolicy
    memory_nodes: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """Every local rank's placement and what is wrong with it, if anything."""

    mode: AffinityMode
    ranks: tuple[RankPlan, ...]
    problems: tuple[str, ...]
    """Overlapping CPU sets, oversubscribed nodes, memory nodes the cpuset forbids."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "ranks": [
                {
                    "rank": r.rank,
                    "gpu": r.gpu,
                    "gpu_address": r.gpu_address,
                    "gpu_node": r.gpu_node,
                    "cpu_node": r.cpu_node,
                    "cpus": list(r.cpus),
                    "memory_policy": r.memory_policy.value,
                    "memory_nodes": list(r.memory_nodes),
                }
                for r in self.ranks
            ],
            "problems": list(self.problems),
        }


def plan(
    nproc_per_node: int | None = None,
    *,
    mode: AffinityMode | str = AffinityMode.NODE,
    topology: Topology | None = None,
    smt: Smt | str = Smt.ALL,
    balanced: bool = True,
    min_cores: int = 1,
    max_cores: int | None = None,
    memory: MemoryPolicy | str = MemoryPolicy.PREFERRED,
    dataloader_workers: int = 0,
) -> Plan:
    """Local rank r drives CUDA device r; this is where each should run and allocate.

    Arguments as for :func:`numafast.cpus_for_gpu`. ``dataloader_workers`` per rank
    count towards each node's load: more processes than the node has allowed physical
    cores is reported as oversubscription.
    """
    machine = resolve_topology(topology)
    chosen_mode = member(AffinityMode, mode, "mode")
    policy = member(MemoryPolicy, memory, "memory")
    workers = integer(dataloader_workers)
    if workers is None or workers < 0:
        raise ValueError(f"dataloader_workers must be a non-negative integer, not {dataloader_workers!r}")
    dataloader_workers = workers
    gpus = job_gpus(machine, nproc_per_node)
    ranks: list[RankPlan] = []
    for rank, gpu in enumerate(gpus):
        site = site_of(machine, gpu)
        cpus = cpus_for_gpu(
            rank, mode=chosen_mode, topology=machine, nproc_per_node=len(gpus), smt=smt,
            balanced=balanced, min_cores=min_cores, max_cores=max_cores,
        )  # fmt: skip
        memory_nodes = _memory_nodes(machine, policy, site.cpu_node, cpus)
        ranks.append(RankPlan(rank, gpu.index, gpu.address, site.node, site.cpu_node, tuple(cpus), policy, memory_nodes))
    problems = [
        *_overlaps(ranks),
        *_oversubscription(machine, ranks, dataloader_workers),
        *_forbidden_memory(machine, ranks),
    ]
    return Plan(chosen_mode, tuple(ranks), tuple(problems))


def _memory_nodes(machine: Topology, policy: MemoryPolicy, cpu_node: int, cpus: list[int]) -> tuple[int, ...]:
    if policy is MemoryPolicy.NONE:
        return ()
    if policy is MemoryPolicy.PREFERRED:
        return (cpu_node,)
    return tuple(sorted({node for cpu in cpus if (node := machine.node_of_cpu(cpu)) is not None}))


def _overlaps(ranks: list[RankPlan]) -> list[str]:
    """Ranks whose CPU sets intersect: the same set shared, or partly overlapping sets."""
    problems: list[str] = []
    sharing: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for r in ranks:
        sharing[r.cpus].append(r.rank)
    for cpus, members in sharing.items():
        if len(members) > 1:
            problems.append(f"ranks {format_ids(members)} share CPUs {format_ids(cpus)}")
    sets = list(sharing)
    for i, a in enumerate(sets):
        for b in sets[i + 1 :]:
            common = set(a).intersection(b)
            if common:
                problems.append(
                    f"ranks {format_ids(sharing[a])} and {format_ids(sharing[b])} overlap on CPUs {format_ids(common)}"
                )
    return problems


def _oversubscription(machine: Topology, ranks: list[RankPlan], workers: int) -> list[str]:
    """Nodes that would run more processes (ranks x (1 + DataLoader workers)) than they have
    allowed physical cores."""
    demand: dict[int, int] = defaultdict(int)
    for r in ranks:
        for node in {machine.node_of_cpu(cpu) for cpu in r.cpus} - {None}:
            demand[node] += 1 + workers  # type: ignore[index]
    allowed = set(machine.allowed_cpus)
    problems: list[str] = []
    for node, processes in sorted(demand.items()):
        cores = {machine.cpu(cpu).core for cpu in machine.node(node).cpus if cpu in allowed}
        if processes > len(cores):
            problems.append(
                f"node {node} is oversubscribed: {processes} processes (ranks x (1 + {workers} DataLoader "
                f"workers)) for {len(cores)} allowed physical cores"
            )
    return problems


def _forbidden_memory(machine: Topology, ranks: list[RankPlan]) -> list[str]:
    allowed = set(machine.allowed_nodes)
    return [
        f"rank {r.rank}: memory node {format_ids(set(r.memory_nodes) - allowed)} is not allowed by the cpuset "
        f"(allowed nodes: {format_ids(allowed)})"
        for r in ranks
        if set(r.memory_nodes) - allowed
    ]
