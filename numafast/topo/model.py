"""The immutable objects a topology is made of, its lookups and its JSON form."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Protocol

from numafast._validate import format_ids
from numafast.errors import InvalidCpuSetError, InvalidGpuError, InvalidNodeError

# What a NUMA distance is when the kernel has no SLIT (ACPI's LOCAL/REMOTE_DISTANCE).
LOCAL_DISTANCE = 10
REMOTE_DISTANCE = 20

NVIDIA = 0x10DE
AMD = 0x1002
GPU_VENDORS = (NVIDIA, AMD)
# PCI base class 0x03 (display), subclass 0x00 (VGA) or 0x02 (3D controller); AMD's
# Instinct accelerators (MI100, MI200) call themselves 0x80 (other display controller).
GPU_CLASSES = (0x0300, 0x0302)
AMD_COMPUTE_CLASSES = (0x0302, 0x0380)
# PCI base class 0x02 (network): 0x0200 Ethernet, 0x0207 InfiniBand.
NIC_CLASSES = (0x0200, 0x0207)


@dataclass(frozen=True, slots=True)
class Node:
    """A NUMA node: its online CPUs (none for HBM, CXL or GPU memory), memory and distances."""

    id: int
    cpus: tuple[int, ...]
    mem_total: int | None
    """Bytes of memory (0 for a memory-less node); None when meminfo could not be read."""
    mem_free: int | None
    distances: Mapping[int, int] = field(hash=False)
    """SLIT distance from this node to each node (10 = local)."""


@dataclass(frozen=True, slots=True)
class Cpu:
    """An online logical CPU and what it shares with others."""

    id: int
    node: int | None
    """None for a CPU that no node lists (reported, not dropped)."""
    package: int | None
    """physical_package_id, the socket; None when unreadable."""
    core: int
    """The physical core, named by its smallest SMT sibling's id."""
    siblings: tuple[int, ...]
    """SMT siblings, this CPU included."""
    llc: tuple[int, ...]
    """CPUs sharing this CPU's last-level cache (highest-level Unified or Data cache)."""


@dataclass(frozen=True, slots=True)
class PciDevice:
    """A PCI function and the node it hangs off."""

    address: str
    """'0000:3b:00.0' (domain:bus:device.function)."""
    vendor: int
    pci_class: int
    """24-bit class code: base class, subclass, programming interface (0x030200)."""
    numa_node: int | None
    """The kernel's numa_node as read; None for -1 (firmware did not say)."""
    node: int | None
    """The resolved node: numa_node, else from local_cpulist, else 0 on a one-node machine."""

    @property
    def is_gpu(self) -> bool:
        """A display or 3D controller of NVIDIA or AMD (or an AMD Instinct accelerator)."""
        subclass = self.pci_class >> 8
        if self.vendor == AMD and subclass in AMD_COMPUTE_CLASSES:
            return True
        return self.vendor in GPU_VENDORS and subclass in GPU_CLASSES

    @property
    def is_nic(self) -> bool:
        """An Ethernet or InfiniBand controller."""
        return self.pci_class >> 8 in NIC_CLASSES


@dataclass(frozen=True, slots=True)
class Gpu:
    """A CUDA device as the process sees it (after CUDA_VISIBLE_DEVICES)."""

    index: int
    address: str
    node: int | None
    uuid: str | None
    """'GPU-...' or, for a MIG instance, 'MIG-...'; None when unknown."""
    memory_node: int | None = None
    """The CPU-less node that is this GPU's own memory, where the kernel runs it as one
    (Grace Hopper, Grace Blackwell over NVLink-C2C; POWER9 over NVLink), as the NVIDIA
    driver's numa_status names it; None elsewhere. ``node`` is where the GPU hangs off
    the PCI tree: on Grace the Grace's node, whose CPUs drive it."""


@dataclass(frozen=True)
class Topology:
    """Nodes, CPUs, PCI devices, GPUs and the allowed sets of one machine (or snapshot).

    Build one with :func:`numafast.topology` (this machine, cached) or
    :meth:`Topology.from_sysfs` (a directory holding a copy of ``sys/`` and ``proc/``).
    """

    nodes: tuple[Node, ...]
    cpus: tuple[Cpu, ...]
    pci: tuple[PciDevice, ...]
    gpus: tuple[Gpu, ...]
    allowed_cpus: tuple[int, ...]
    """CPUs the process may run on (its affinity / cpuset)."""
    allowed_nodes: tuple[int, ...]
    """Nodes the process may allocate on (its cpuset's mems)."""

    @classmethod
    def from_sysfs(
        cls,
        root: str | os.PathLike[str],
        *,
        cuda_visible_devices: str | None = None,
        ask_gpu_libraries: bool = False,
    ) -> Topology:
        """Read a topology from ``root/sys`` and ``root/proc``, nothing else.

        The running process's environment never leaks in: CUDA device order is PCI
        bus order filtered by ``cuda_visible_devices`` only when it is given.
        ``ask_gpu_libraries`` lets NVML or torch name GPU UUIDs; only meaningful
        for this machine's own ``/``. The reading is done by
        :func:`numafast.topo.read.read_topology`, which registers itself here.
        """
        if _sysfs_reader is None:
            raise RuntimeError("numafast.topo.read registers the sysfs reader; import numafast.topo")
        return _sysfs_reader(root, cuda_visible_devices=cuda_visible_devices, ask_gpu_libraries=ask_gpu_libraries)

    # ---------------------------------------------------------------- lookups

    @cached_property
    def _nodes_by_id(self) -> Mapping[int, Node]:
        return MappingProxyType({node.id: node for node in self.nodes})

    @cached_property
    def _cpus_by_id(self) -> Mapping[int, Cpu]:
        return MappingProxyType({cpu.id: cpu for cpu in self.cpus})

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(node.id for node in self.nodes)

    @property
    def cpu_nodes(self) -> tuple[Node, ...]:
        """Nodes that have CPUs."""
        return tuple(node for node in self.nodes if node.cpus)

    @property
    def cpus_without_node(self) -> tuple[int, ...]:
        """Online CPUs that no node lists."""
        return tuple(cpu.id for cpu in self.cpus if cpu.node is None)

    def node(self, node_id: int) -> Node:
        try:
            return self._nodes_by_id[node_id]
        except (KeyError, TypeError):
            raise InvalidNodeError(
                f"node {node_id!r} does not exist; nodes here: {format_ids(self.node_ids)}"
            ) from None

    def cpu(self, cpu_id: int) -> Cpu:
        try:
            return self._cpus_by_id[cpu_id]
        except (KeyError, TypeError):
            online = format_ids(self._cpus_by_id)
            raise InvalidCpuSetError(f"cpu {cpu_id!r} is not an online CPU; online: {online}") from None

    def gpu(self, index: int) -> Gpu:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        known = format_ids(gpu.index for gpu in self.gpus)
        raise InvalidGpuError(f"no CUDA device {index!r} in this topology; CUDA devices: {known}")

    def node_of_cpu(self, cpu_id: int) -> int | None:
        """The node of an online CPU; None when no node lists it."""
        return self.cpu(cpu_id).node

    def node_of_gpu(self, index: int) -> int | None:
        """The node of CUDA device ``index``; None when firmware and local_cpulist do not say."""
        return self.gpu(index).node

    def distance(self, a: int, b: int) -> int:
        """The SLIT distance from node ``a`` to node ``b`` (10 = local)."""
        self.node(b)
        return self.node(a).distances[b]

    def nearest_cpu_node(self, node_id: int) -> int:
        """The closest node that has CPUs: ``node_id`` itself if it has some.

        A CPU-less node (HBM, CXL, a Grace-Hopper GPU's memory) is driven from the
        CPU node at the smallest distance; ties go to the lower node id.
        """
        node = self.node(node_id)
        if node.cpus:
            return node.id
        candidates = self.cpu_nodes
        if not candidates:
            raise InvalidNodeError(f"no node has CPUs, so none is nearest to node {node_id}")
        return min(candidates, key=lambda other: (node.distances[other.id], other.id)).id

    # ---------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        """Plain data in numafast's documented schema (ids are ints, lists sorted)."""
        return {
            "nodes": [
                {
                    "id": node.id,
                    "cpus": sorted(node.cpus),
                    "mem_total": node.mem_total,
                    "mem_free": node.mem_free,
                    "distances": {str(other): d for other, d in sorted(node.distances.items())},
                }
                for node in self.nodes
            ],
            "cpus": [
                {
                    "id": cpu.id,
                    "node": cpu.node,
                    "package": cpu.package,
                    "core": cpu.core,
                    "siblings": sorted(cpu.siblings),
                    "llc": sorted(cpu.llc),
                }
                for cpu in self.cpus
            ],
            "pci": [
                {
                    "address": device.address,
                    "vendor": f"0x{device.vendor:04x}",
                    "class": f"0x{device.pci_class:06x}",
                    "numa_node": device.numa_node,
                    "node": device.node,
                    "gpu": device.is_gpu,
                }
                for device in self.pci
            ],
            "gpus": [
                {
                    "index": gpu.index,
                    "address": gpu.address,
                    "node": gpu.node,
                    "memory_node": gpu.memory_node,
                    "uuid": gpu.uuid,
                }
                for gpu in self.gpus
            ],
            "allowed_cpus": sorted(self.allowed_cpus),
            "allowed_nodes": sorted(self.allowed_nodes),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)


class SysfsReader(Protocol):
    """What builds a :class:`Topology` from a snapshot's files (numafast.topo.read.read_topology)."""

    def __call__(
        self, root: str | os.PathLike[str], *, cuda_visible_devices: str | None, ask_gpu_libraries: bool
    ) -> Topology: ...


# The model does no I/O and imports no reader: the reading side, which builds
# topologies from files (files -> parts -> model), registers itself here so that
# Topology.from_sysfs keeps working for users.
_sysfs_reader: SysfsReader | None = None


def register_sysfs_reader(reader: SysfsReader) -> None:
    """Make ``reader`` the function behind :meth:`Topology.from_sysfs`."""
    global _sysfs_reader
    _sysfs_reader = reader
