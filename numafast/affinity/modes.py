"""Which CPUs the process driving one GPU should run on: PyTorch's and NVIDIA
gpu_affinity's modes, computed on any :class:`Topology` (live or a snapshot).

Pure: nothing here changes the process; :func:`cpus_for_gpu` only answers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from numafast._validate import format_ids, integer, member
from numafast.errors import InvalidGpuError, PlacementError
from numafast.topo import Gpu, Topology, topology



class AffinityMode(str, Enum):
    """How a GPU's CPUs are chosen. The first four are PyTorch's (torchrun --numa-binding),
    the rest NVIDIA gpu_affinity's (scope "node")."""

    NODE = "node"
    """Every allowed CPU of the GPU's node."""
    SOCKET = "socket"
    """Every allowed CPU of every node of the GPU's package."""
    EXCLUSIVE = "exclusive"
    """The node's physical cores split evenly among the node's GPUs (lower indices get one
    extra when uneven), SMT siblings together; an error if a GPU would get no core."""
    CORE_COMPLEX = "core-complex"
    """One whole last-level-cache group per GPU: groups with more allowed CPUs first, then
    lower CPU ids; wraps around when the node has more GPUs than groups."""
    ALL = "all"
    """Every allowed physical core of the GPU's node (at most max_cores)."""
    SINGLE = "single"
    """The node's first allowed physical core: GPUs of one node share it."""
    SINGLE_UNIQUE = "single-unique"
    """One physical core per GPU, the first of its node not taken by a lower GPU index."""
    UNIQUE_CONTIGUOUS = "unique-contiguous"
    """The node's cores in contiguous, disjoint blocks, one per GPU of the node."""
    UNIQUE_INTERLEAVED = "unique-interleaved"
    """The node's cores dealt out round-robin, disjoint, one share per GPU of the node."""


class Smt(str, Enum):
    """Which logical CPUs of a chosen physical core are returned."""

    ALL = "all"
    """Every allowed SMT sibling."""
    ONE = "one"
    """Only the core's lowest allowed CPU (one thread per core)."""


@dataclass(frozen=True)
class GpuSite:
    """Where one of the job's GPUs sits: its node, and the CPU node that drives it."""

    gpu: Gpu
    node: int
    cpu_node: int


def job_gpus(machine: Topology, nproc_per_node: int | None) -> list[Gpu]:
    """The job's GPUs: CUDA devices 0 .. nproc_per_node-1 (all of them by default)."""
    if nproc_per_node is None:
        return list(machine.gpus)
    count = integer(nproc_per_node)
    if count is None or count < 1:
        raise InvalidGpuError(f"nproc_per_node must be a positive integer, not {nproc_per_node!r}")
    nproc_per_node = count
    if nproc_per_node > len(machine.gpus):
        raise InvalidGpuError(
            f"nproc_per_node={nproc_per_node} but this topology has {len(machine.gpus)} CUDA devices"
            f" ({format_ids(g.index for g in machine.gpus)})"
        )
    return list(machine.gpus[:nproc_per_node])


def site_of(machine: Topology, gpu: Gpu) -> GpuSite:
    """The GPU's node and the CPU node that drives it (the nearest one for a CPU-less node)."""
    if gpu.node is None:
        raise InvalidGpuError(
            f"CUDA device {gpu.index} ({gpu.address}) has no known NUMA node: its numa_node is -1 "
            "and its local_cpulist spans several nodes; choose its CPUs explicitly"
        )
    return GpuSite(gpu, gpu.node, machine.nearest_cpu_node(gpu.node))


def allowed_cpus_of_node(machine: Topology, node: int) -> list[int]:
    allowed = set(machine.allowed_cpus)
    return [cpu for cpu in machine.node(node).cpus if cpu in allowed]


def cores_of(machine: Topology, cpus: Sequence[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (SMT siblings together), cores in id order."""
    by_core: dict[int, list[int]] = defaultdict(list)
    for cpu in sorted(cpus):
        by_core[machine.cpu(cpu).core].append(cpu)
    return [by_core[core] for core in sorted(by_core)]


def share_of(rank: int, count: int, items: int) -> slice:
    """The ``rank``-th of ``count`` contiguous shares of ``items``, lower ranks one extra when uneven."""
    per, extra = divmod(items, count)
    start = rank * per + min(rank, extra)
    return slice(start, start + per + (1 if rank < extra else 0))


def cpus_for_gpu(
    gpu: int,
    *,
    mode: AffinityMode | str = AffinityMode.NODE,
    topology: Topology | None = None,
    nproc_per_node: int | None = None,
    smt: Smt | str = Smt.ALL,
    balanced: bool = True,
    min_cores: int = 1,
    max_cores: int | None = None,
) -> list[int]:
    """The sorted CPU ids the process driving CUDA device ``gpu`` should run on.

    ``topology`` defaults to this machine's (:func:`numafast.topology`). The job's GPUs
    are CUDA devices ``0 .. nproc_per_node-1`` (default: all); the modes that share a
    node's cores share them among the job's GPUs on that node. Only allowed CPUs
    (affinity, cpuset) are returned. A GPU on a CPU-less node (Grace-Hopper) is driven
    from the nearest CPU node. ``balanced``, ``min_cores`` and ``max_cores`` are
    NVIDIA gpu_affinity's knobs: equal core counts across nodes for the unique modes,
    an error below ``min_cores`` physical cores, a cap of ``max_cores``.
    """
    machine = resolve_topology(topology)
    chosen_mode = member(AffinityMode, mode, "mode")
    threads = member(Smt, smt, "smt")
    gpus = job_gpus(machine, nproc_per_node)
    index = integer(gpu)
    if index is None or not 0 <= index < len(gpus):
        devices = f"0-{len(gpus) - 1}" if gpus else "(none: this topology has no GPU)"
        raise InvalidGpuError(f"GPU {gpu!r} is not one of the job's CUDA devices {devices}")
    gpu = index
    min_cores = _core_count(min_cores, "min_cores", 1)
    if max_cores is not None:
        max_cores = _core_count(max_cores, "max_cores", 1)
    check_core_counts(chosen_mode, min_cores, max_cores)
    site = site_of(machine, gpus[gpu])
    # The other GPUs count where their node is known; one with an unknown node only
    # fails a request about itself.
    sites = [site if g.index == gpu else site_of(machine, g) for g in gpus if g.node is not None or g.index == gpu]
    cores = _cores_for(machine, sites, site, chosen_mode, balanced)
    if chosen_mode not in _PYTORCH_MODES:
        if len(cores) < min_cores:
            raise PlacementError(
                f"GPU {gpu} would get {len(cores)} physical cores in mode {chosen_mode.value!r}, "
                f"fewer than min_cores={min_cores}"
            )
        if max_cores is not None:
            cores = cores[:max_cores]
    cpus = sorted(cpu for core in cores for cpu in (core[:1] if threads is Smt.ONE else core))
    if not cpus:
        node = site.cpu_node
        raise PlacementError(
            f"no allowed CPU for GPU {gpu} (node {node}, CPUs {format_ids(machine.node(node).cpus)}); "
            f"allowed CPUs: {format_ids(machine.allowed_cpus)}"
        )
    return cpus


def _core_count(value: object, name: str, least: int) -> int:
    """A core-count knob as an int of at least ``least``; ValueError naming the option
    otherwise (max_cores=0 would leave a rank no CPU)."""
    count = integer(value)
    if count is None or count < least:
        raise ValueError(f"{name}={value!r}: give an integer >= {least} (a count of physical cores per rank)")
    return count


_PYTORCH_MODES = (AffinityMode.NODE, AffinityMode.SOCKET, AffinityMode.EXCLUSIVE, AffinityMode.CORE_COMPLEX)
# The modes in which max_cores caps a rank's cores: NVIDIA's modes that give several.
CAPPED_MODES = (AffinityMode.ALL, AffinityMode.UNIQUE_CONTIGUOUS, AffinityMode.UNIQUE_INTERLEAVED)
ONE_CORE_MODES = (AffinityMode.SINGLE, AffinityMode.SINGLE_UNIQUE)


def check_core_counts(mode: AffinityMode, min_cores: int, max_cores: int | None, *, cli: bool = False) -> None:
    """Refuse core counts that contradict each other or that ``mode`` would ignore: a
    placement must not quietly differ from what was asked. ValueError naming the knobs,
    spelled as ``numafast plan``'s options with ``cli``."""

    def spelled(name: str) -> str:
        return f"--{name.replace('_', '-')}" if cli else name

    def knob(name: str, value: object) -> str:
        return f"{spelled(name)} {value}" if cli else f"{name}={value!r}"

    def example(*knobs: str) -> str:
        return " ".join(("--mode all", *knobs)) if cli else ", ".join(("mode='all'", *knobs))

    if max_cores is not None and min_cores > max_cores:
        raise ValueError(
            f"{knob('min_cores', min_cores)} exceeds {knob('max_cores', max_cores)}: no rank can get at least "
            f"{min_cores} and at most {max_cores} physical cores; give {spelled('min_cores')} <= {spelled('max_cores')}"
        )
    capped = ", ".join(m.value for m in CAPPED_MODES)
    if mode in ONE_CORE_MODES and max_cores is not None and max_cores > 1:
        raise ValueError(
            f"{knob('max_cores', max_cores)} does nothing in mode {mode.value}: it gives each rank one core; "
            f"{spelled('max_cores')} caps the modes that give several ({capped}), "
            f"e.g. {example(knob('max_cores', max_cores))}"
        )
    ignored = [knob(name, value) for name, value in (("min_cores", min_cores), ("max_cores", max_cores))
               if value is not None and (name == "max_cores" or value > 1)]  # fmt: skip
    if mode in _PYTORCH_MODES and ignored:
        verb = "does" if len(ignored) == 1 else "do"
        raise ValueError(
            f"{' and '.join(ignored)} {verb} nothing in mode {mode.value} (PyTorch's modes take whole nodes, "
            f"sockets or shares); they apply to NVIDIA's modes, e.g. {example(*ignored)}"
        )


def resolve_topology(given: Topology | None) -> Topology:
    """The topology a planning call was given, else this machine's (cached); TypeError
    for anything else (a path is read with Topology.from_sysfs)."""
    if given is None:
        return topology()
    if not isinstance(given, Topology):
        raise TypeError(
            f"topology must be a numafast.Topology (numafast.topology(), or Topology.from_sysfs(ROOT) "
            f"for a snapshot) or None for this machine's, not {given!r}"
        )
    return given


def _cores_for(
    machine: Topology, sites: list[GpuSite], site: GpuSite, mode: AffinityMode, balanced: bool
) -> list[list[int]]:
    """The chosen physical cores (each a list of allowed CPUs) for ``site``'s GPU, before smt/min/max."""
    gpu = site.gpu.index
    node_cores = cores_of(machine, allowed_cpus_of_node(machine, site.cpu_node))
    # The job's GPUs driven from the same CPU node, in index order.
    peers = [s.gpu.index for s in sites if s.cpu_node == site.cpu_node]
    rank = peers.index(gpu)
    if mode is AffinityMode.NODE or mode is AffinityMode.ALL:
        return node_cores
    if mode is AffinityMode.SOCKET:
        return cores_of(machine, _socket_cpus(machine, site.cpu_node))
    if mode is AffinityMode.EXCLUSIVE:
        if len(node_cores) < len(peers):
            raise PlacementError(
                f"node {site.cpu_node} has {len(node_cores)} allowed physical cores for "
                f"{len(peers)} GPUs (CUDA devices {format_ids(peers)}): GPU {gpu} would get none"
            )
        return node_cores[share_of(rank, len(peers), len(node_cores))]
    if mode is AffinityMode.CORE_COMPLEX:
        groups = _cache_groups(machine, site.cpu_node)
        return cores_of(machine, groups[rank % len(groups)]) if groups else []
    if mode is AffinityMode.SINGLE:
        return node_cores[:1]
    if mode is AffinityMode.SINGLE_UNIQUE:
        return _single_unique(machine, sites, gpu)
    return _unique(machine, sites, site, rank, len(peers), mode, balanced)


def _socket_cpus(machine: Topology, node: int) -> list[int]:
    """Allowed CPUs of every node that shares a package with ``node``'s allowed CPUs."""
    packages = {machine.cpu(cpu).package for cpu in allowed_cpus_of_node(machine, node)}
    return [
        cpu
        for other in machine.nodes
        if any(machine.cpu(c).package in packages for c in other.cpus)
        for cpu in allowed_cpus_of_node(machine, other.id)
    ]


def _cache_groups(machine: Topology, node: int) -> list[list[int]]:
    """The node's allowed CPUs by last-level cache: larger groups first, then by lowest CPU."""
    groups: dict[int, list[int]] = defaultdict(list)
    for cpu in allowed_cpus_of_node(machine, node):
        groups[min(machine.cpu(cpu).llc)].append(cpu)
    return sorted(groups.values(), key=lambda cpus: (-len(cpus), min(cpus)))


def _single_unique(machine: Topology, sites: list[GpuSite], gpu: int) -> list[list[int]]:
    """GPU by GPU in index order, the first core of its node that no lower GPU took."""
    taken: set[int] = set()
    for site in sites:
        free = [core for core in cores_of(machine, allowed_cpus_of_node(machine, site.cpu_node)) if core[0] not in taken]
        if not free:
            raise PlacementError(
                f"node {site.cpu_node} has no physical core left for GPU {site.gpu.index} in mode 'single-unique'"
            )
        taken.add(free[0][0])
        if site.gpu.index == gpu:
            return free[:1]
    raise AssertionError("unreachable: gpu is one of the sites")


def _unique(
    machine: Topology, sites: list[GpuSite], site: GpuSite, rank: int, peers: int, mode: AffinityMode, balanced: bool
) -> list[list[int]]:
    """unique-contiguous / unique-interleaved: disjoint shares of the node's cores.

    Balanced, every GPU of the job gets the smallest per-GPU share any node can give
    (the node's surplus cores are left out); unbalanced, each node's cores are split
    among its own GPUs.
    """
    node_cores = cores_of(machine, allowed_cpus_of_node(machine, site.cpu_node))
    per_gpu = len(node_cores) // peers
    if balanced:
        counts: dict[int, int] = defaultdict(int)
        for other in sites:
            counts[other.cpu_node] += 1
        per_gpu = min(len(cores_of(machine, allowed_cpus_of_node(machine, n))) // c for n, c in counts.items())
        node_cores = node_cores[: per_gpu * peers]
    if mode is AffinityMode.UNIQUE_INTERLEAVED:
        return node_cores[rank::peers]
    return node_cores[rank * per_gpu : (rank + 1) * per_gpu]
