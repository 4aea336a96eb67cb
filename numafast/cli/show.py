"""``numafast show``: nodes, distances, GPUs and NICs per node and the allowed sets,
laid out like ``numactl -H`` followed by ``nvidia-smi topo -m``; then, on the live
machine, what placement this process may do (:func:`numafast.capabilities`), each
refusal with its cause and fix: where a user whose NumaLoader runs unplaced looks."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
from collections.abc import Iterator
from typing import Any

from numafast._validate import format_ids
from numafast.capabilities import PROBE_CALLS, Capabilities, Capability, capabilities, memory_placement_refused
from numafast.policy import seccomp_hint
from numafast.topo import PciDevice, Topology, topology


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "show", help="print the NUMA topology, GPUs and NICs, and what placement this process may do"
    )
    add_topology_arguments(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help='print Topology.to_dict() as JSON, with "capabilities" (numafast.capabilities()) on the live machine',
    )
    parser.set_defaults(run=run)


def add_topology_arguments(parser: argparse._ActionsContainer) -> None:
    """--sysfs and --cuda-visible-devices: which topology a subcommand looks at."""
    parser.add_argument(
        "--sysfs", metavar="ROOT", help="read a snapshot: a directory holding a machine's sys/ and proc/"
    )
    parser.add_argument(
        "--cuda-visible-devices",
        metavar="LIST",
        help="with --sysfs: the CUDA_VISIBLE_DEVICES to apply to the snapshot (the live machine uses the environment's)",
    )


def load_topology(args: argparse.Namespace) -> Topology:
    if args.sysfs is None:
        if args.cuda_visible_devices is not None:
            raise ValueError("--cuda-visible-devices applies to a --sysfs snapshot; set CUDA_VISIBLE_DEVICES instead")
        return topology()
    return Topology.from_sysfs(args.sysfs, cuda_visible_devices=args.cuda_visible_devices)


def run(args: argparse.Namespace) -> int:
    machine = load_topology(args)
    # A snapshot is another machine's (or another time's): what this process may do says nothing of it.
    found = capabilities() if args.sysfs is None else None
    print(json.dumps(to_dict(machine, found), indent=1) if args.json else "\n".join(render(machine, found)))
    return 0


def to_dict(machine: Topology, found: Capabilities | None) -> dict[str, Any]:
    """What ``numafast show --json`` prints: the topology, and ``found`` (when given) as "capabilities"."""
    shown = machine.to_dict()
    if found is not None:
        shown["capabilities"] = dataclasses.asdict(found)
    return shown


def render(machine: Topology, found: Capabilities | None = None) -> Iterator[str]:
    """The text of ``numafast show``."""
    yield from render_nodes(machine)
    yield ""
    yield from render_devices(machine)
    yield ""
    yield f"allowed cpus: {format_ids(machine.allowed_cpus)}"
    yield f"allowed nodes: {format_ids(machine.allowed_nodes)}"
    if found is not None:
        yield ""
        yield from render_capabilities(found)


def render_capabilities(found: Capabilities) -> Iterator[str]:
    """What this process may do: the features that work on one line, then those that do
    not, grouped by cause, each cause (with its fix) on the line below; and whether
    NumaLoader and pinned pools run unplaced for it, as they warn."""
    works, refused = _grouped(found)
    yield f"placement this process may do (numafast.capabilities(), kernel {found.kernel}):"
    if not refused:
        yield f"  all of it: {', '.join(works)}"
        return
    yield f"  yes: {', '.join(works) or 'none'}"
    for reason, names in refused.items():
        yield f"  no: {', '.join(names)}"
        yield f"      {reason}"
    if memory_placement_refused():
        yield ("  so NumaLoader's workers and pinned pools run unplaced: their memory goes where the kernel puts it "
               "(CPU binding still applies)")  # fmt: skip


def _grouped(found: Capabilities) -> tuple[list[str], dict[str, list[str]]]:
    """(the features that work, those that do not by their reason). The refusals with
    EPERM share one reason, their calls named together with one cause and fix: a
    container's seccomp profile refuses them at once, and the fix said per feature
    would be said up to six times."""
    works: list[str] = []
    refused: dict[str, list[str]] = {}  # "" gathers every EPERM
    for item in dataclasses.fields(found):
        value = getattr(found, item.name)
        if isinstance(value, Capability):
            if value.available:
                works.append(item.name)
            else:
                refused.setdefault("" if value.errno == errno.EPERM else value.reason, []).append(item.name)
    if "" in refused:
        calls = list(dict.fromkeys(PROBE_CALLS.get(name, name) for name in refused[""]))
        refused[f"{', '.join(calls)} refused with EPERM; {seccomp_hint(*calls)}"] = refused.pop("")
    return works, refused


def _megabytes(value: int | None) -> str:
    return "unknown" if value is None else f"{value >> 20} MB"


def render_nodes(machine: Topology) -> Iterator[str]:
    """numactl -H: node count, each node's CPUs and memory, the distance matrix.

    A CPU-less node that is a GPU's own memory (Grace's HBM nodes, from the NVIDIA
    driver's numa_status: ``Gpu.memory_node``) says whose: ``node 2 cpus: (GPU0 memory)``.
    """
    ids = machine.node_ids
    yield f"available: {len(ids)} nodes ({format_ids(ids)})"
    memory_of: dict[int, list[str]] = {}
    for gpu in machine.gpus:
        if gpu.memory_node is not None:
            memory_of.setdefault(gpu.memory_node, []).append(f"GPU{gpu.index}")
    for node in machine.nodes:
        cpus = " ".join(map(str, node.cpus))
        if not node.cpus and node.id in memory_of:
            cpus = f"({', '.join(memory_of[node.id])} memory)"
        yield f"node {node.id} cpus: {cpus}"
        yield f"node {node.id} size: {_megabytes(node.mem_total)}"
        yield f"node {node.id} free: {_megabytes(node.mem_free)}"
    if machine.cpus_without_node:
        yield f"cpus in no node: {format_ids(machine.cpus_without_node)}"
    yield "node distances:"
    width = max(4, *(len(str(i)) + 1 for i in ids))
    yield "node " + "".join(f"{i:>{width}}" for i in ids)
    for a in ids:
        yield f"{a:>4}:" + "".join(f"{machine.distance(a, b):>{width}}" for b in ids)


def _nic_kind(device: PciDevice) -> str:
    return "IB" if device.pci_class >> 8 == 0x0207 else "ETH"


def render_devices(machine: Topology) -> Iterator[str]:
    """nvidia-smi topo -m: GPUs and NICs against each other, with CPU and NUMA affinity.

    NODE: same NUMA node; SYS: across the inter-node link; X: itself. (PCIe
    switch levels, PIX/PXB, and NVLink are not in sysfs's node files.)
    """
    nics = [device for device in machine.pci if device.is_nic]
    rows: list[tuple[str, int | None, str]] = [
        (f"GPU{gpu.index}", gpu.node, f"{gpu.address} {gpu.uuid or ''}".rstrip()) for gpu in machine.gpus
    ]
    rows += [(f"NIC{i}", nic.node, f"{nic.address} {_nic_kind(nic)}") for i, nic in enumerate(nics)]
    if not rows:
        yield "GPUs: none; NICs: none"
        return
    names = [name for name, _, _ in rows]
    width = max(5, *(len(name) + 1 for name in names))
    yield " " * width + "".join(f"{name:>{width}}" for name in names) + "  CPU Affinity     NUMA Affinity  PCI"
    for name, node, description in rows:
        cells = "".join(f"{_link(name, node, other, other_node):>{width}}" for other, other_node, _ in rows)
        cpus, numa = "unknown", "unknown"
        if node is not None:
            # A CPU-less node (Grace-Hopper's GPU memory) is driven from the nearest CPU node.
            cpu_node = machine.nearest_cpu_node(node)
            cpus = format_ids(machine.node(cpu_node).cpus)
            numa = str(node) if cpu_node == node else f"{node} (cpus of {cpu_node})"
        yield f"{name:<{width}}{cells}  {cpus:<16} {numa:<14} {description}"
    yield ""
    yield "Legend: X = self, NODE = same NUMA node, SYS = crosses the link between nodes, ? = node unknown"


def _link(name: str, node: int | None, other: str, other_node: int | None) -> str:
    if name == other:
        return "X"
    if node is None or other_node is None:
        return "?"
    return "NODE" if node == other_node else "SYS"
