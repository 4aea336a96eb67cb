"""PCI functions from ``sys/bus/pci/devices`` and the NUMA node each hangs off."""

from __future__ import annotations

from pathlib import Path

from numafast.topo.files import read_id_set, read_int, warn
from numafast.topo.model import Node, PciDevice

PCI_DIR = Path("sys/bus/pci/devices")


def pci_sort_key(address: str) -> tuple[int, ...]:
    """'0000:3b:00.0' -> (0, 0x3b, 0, 0): PCI bus order, the order CUDA_DEVICE_ORDER=PCI_BUS_ID uses."""
    try:
        domain, bus, slot_function = address.split(":")
        slot, function = slot_function.split(".")
        return (int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16))
    except ValueError:
        return (1 << 32, 0, 0, 0)


def resolve_node(numa_node: int | None, local_cpus: list[int] | None, nodes: list[Node]) -> int | None:
    """The node a device belongs to.

    ``numa_node`` (from the firmware's _PXM) when known; else the one node whose
    CPUs hold all of the device's ``local_cpulist`` (or its mask ``local_cpus``);
    else node 0 on a one-node machine; else None (firmware says nothing and
    local_cpulist spans nodes).
    """
    node_ids = [node.id for node in nodes]
    if numa_node is not None and numa_node in node_ids:
        return numa_node
    if local_cpus:
        local = set(local_cpus)
        holders = [node.id for node in nodes if local.intersection(node.cpus)]
        if len(holders) == 1:
            return holders[0]
    if len(node_ids) == 1:
        return node_ids[0]
    return None


def read_pci(root: Path, nodes: list[Node]) -> list[PciDevice]:
    """Every PCI function, in bus order, with its raw and resolved node."""
    devices: list[PciDevice] = []
    try:
        paths = sorted(pci_device_dirs(root), key=lambda path: pci_sort_key(path.name))
    except OSError as error:
        warn(f"{root / PCI_DIR}: unreadable ({error.strerror}); no PCI devices")
        return devices
    for path in paths:
        vendor = read_int(path / "vendor", base=16)
        pci_class = read_int(path / "class", base=16)
        if vendor is None or pci_class is None:
            warn(f"{path}: no readable vendor or class; device skipped")
            continue
        raw_node = read_int(path / "numa_node")
        numa_node = raw_node if raw_node is not None and raw_node >= 0 else None
        node = resolve_node(numa_node, read_id_set(path / "local_cpulist", path / "local_cpus"), nodes)
        devices.append(PciDevice(path.name, vendor, pci_class, numa_node, node))
    return devices


def pci_device_dirs(root: Path) -> list[Path]:
    """The device directories (or symlinks to them) of ``sys/bus/pci/devices``; none if absent."""
    directory = root / PCI_DIR
    return list(directory.iterdir()) if directory.is_dir() else []
