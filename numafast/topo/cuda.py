"""CUDA device order: PCI bus order, then ``CUDA_VISIBLE_DEVICES`` reorders and filters.

CUDA numbers devices in PCI bus order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (and,
in practice, on machines whose GPUs are all alike, which is every training box).
``CUDA_VISIBLE_DEVICES`` then lists the devices the process sees, in order, as
integers, ``GPU-<uuid>`` or ``MIG-<uuid>`` entries (unique prefixes are enough);
CUDA stops at the first entry that names no device. Matching a UUID needs to
know each GPU's UUID: NVIDIA's driver writes it to
``/proc/driver/nvidia/gpus/ADDR/information``; NVML or torch can say it too on
the live machine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from numafast._validate import format_ids
from numafast.topo.files import read_fields, warn
from numafast.topo.model import AMD, AMD_COMPUTE_CLASSES, NVIDIA, Gpu, PciDevice

NVIDIA_GPU_INFO = Path("proc/driver/nvidia/gpus")
# A PCI address as NVML and the driver write it: [domain:]bus:slot.function, in hex.
PCI_ADDRESS = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")
# A CUDA_VISIBLE_DEVICES index, as CUDA reads one (ASCII digits; a negative one hides the rest).
DEVICE_INDEX = re.compile(r"-?[0-9]+")


def normalize_address(address: str) -> str:
    """'00000000:3B:00.0' (NVML's busId) -> '0000:3b:00.0' (sysfs's name); ValueError
    naming the text for anything that is not a PCI address."""
    match = PCI_ADDRESS.fullmatch(address.strip().lower())
    if match is None:
        raise ValueError(f"{address!r} is not a PCI address (like 0000:3b:00.0)")
    domain, bus, slot, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{slot}.{function}"


def _driver_address(written: str, source: Path) -> str | None:
    """:func:`normalize_address` of an address the driver wrote (``source``: the file or
    directory name it is in); None, with a warning, when it is damaged."""
    try:
        return normalize_address(written)
    except ValueError as error:
        warn(f"{source}: {error}; GPU skipped")
        return None


def driver_uuids(root: Path) -> dict[str, str]:
    """UUID -> PCI address of each GPU, from the NVIDIA driver's proc files."""
    uuids: dict[str, str] = {}
    directory = root / NVIDIA_GPU_INFO
    if not directory.is_dir():
        return uuids
    for path in sorted(directory.iterdir()):
        fields = read_fields(path / "information") or {}
        uuid = fields.get("GPU UUID")
        written, source = (fields["Bus Location"], path / "information") if "Bus Location" in fields else (path.name, path)
        if uuid and (address := _driver_address(written, source)):
            uuids[uuid] = address
    return uuids


def driver_memory_nodes(root: Path, node_ids: Sequence[int]) -> dict[str, int]:
    """PCI address -> the NUMA node that is the GPU's own memory, from the NVIDIA driver's
    ``/proc/driver/nvidia/gpus/ADDR/numa_status`` ('Node: 2'), written where the kernel
    runs GPU memory as a node (Grace Hopper, Grace Blackwell; POWER9). hwloc's Linux
    backend reads the same line to mark such a node GPUMemory. A GPU whose memory is not
    onlined has no Node line; a node this topology lacks is reported and left out."""
    nodes: dict[str, int] = {}
    directory = root / NVIDIA_GPU_INFO
    if not directory.is_dir():
        return nodes
    for path in sorted(directory.iterdir()):
        value = (read_fields(path / "numa_status") or {}).get("Node", "")
        if not value.isdecimal() or (address := _driver_address(path.name, path)) is None:
            continue
        if int(value) not in node_ids:
            warn(
                f"{path / 'numa_status'}: names node {int(value)}, which this topology lacks "
                f"(nodes {format_ids(node_ids)}); memory node unknown"
            )
            continue
        nodes[address] = int(value)
    return nodes


def nvml_uuids() -> dict[str, str]:
    """UUID -> PCI address of each GPU and MIG instance (a MIG maps to its GPU), from NVML.

    Empty when nvidia-ml-py is missing or NVML finds no driver.
    """
    try:
        import pynvml
    except ImportError:
        return {}
    uuids: dict[str, str] = {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return uuids
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
            address = normalize_address(bus_id.decode() if isinstance(bus_id, bytes) else bus_id)
            uuids[_text(pynvml.nvmlDeviceGetUUID(handle))] = address
            try:
                mig_count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
            except pynvml.NVMLError:  # not MIG-capable
                mig_count = 0
            for mig_index in range(mig_count):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
                except pynvml.NVMLError:  # no instance in this slot
                    continue
                uuids[_text(pynvml.nvmlDeviceGetUUID(mig))] = address
    except pynvml.NVMLError as error:
        warn(f"NVML could not list GPU UUIDs: {error}")
    finally:
        pynvml.nvmlShutdown()
    return uuids


def torch_uuids() -> dict[str, str]:
    """UUID -> PCI address of each device torch.cuda sees (numafast.cuda, the one
    module that touches torch.cuda, asks); empty without torch or CUDA."""
    try:
        from numafast import cuda
    except ImportError:
        return {}
    return cuda.device_uuids() if cuda.usable() else {}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def cuda_devices(devices: list[PciDevice]) -> list[PciDevice]:
    """The GPUs CUDA (or HIP) numbers, in PCI bus order.

    NVIDIA GPUs when there are any: an AMD display controller next to them is a
    server's on-board VGA, not a compute device. Else AMD's compute GPUs (3D or
    Instinct class) when there are any, for the same reason; else every AMD GPU
    (a workstation's Radeon is a VGA controller that HIP drives).
    """
    gpus = [device for device in devices if device.is_gpu]
    nvidia = [device for device in gpus if device.vendor == NVIDIA]
    amd_compute = [device for device in gpus if device.vendor == AMD and device.pci_class >> 8 in AMD_COMPUTE_CLASSES]
    return nvidia or amd_compute or gpus


def match_uuid(entry: str, uuids: Mapping[str, str]) -> list[str]:
    """Known UUIDs that ``entry`` names (a whole UUID or a unique prefix, any case).

    The old MIG form ``MIG-GPU-<uuid>/<gi>/<ci>`` names its parent GPU's UUID.
    """
    wanted = entry.lower()
    if wanted.startswith("mig-gpu-"):
        wanted = wanted[len("mig-") :].split("/")[0]
    return [uuid for uuid in uuids if uuid.lower().startswith(wanted)]


def visible_gpus(
    devices: list[PciDevice],
    cuda_visible_devices: str | None,
    uuids: Mapping[str, str],
    uuid_sources: str,
    memory_nodes: Mapping[str, int] | None = None,
) -> list[Gpu]:
    """The CUDA devices in index order, as ``cuda_visible_devices`` (None: unset) shows them.

    ``uuids`` maps known UUIDs to PCI addresses; ``uuid_sources`` says where they
    were looked for, for the message when an entry cannot be matched. ``memory_nodes``
    maps a PCI address to its GPU's own memory node (:func:`driver_memory_nodes`).
    """
    memory_of = memory_nodes or {}
    physical = cuda_devices(devices)
    uuid_of = {address: uuid for uuid, address in uuids.items() if uuid.startswith("GPU-")}
    if cuda_visible_devices is None:
        return [
            Gpu(index, device.address, device.node, uuid_of.get(device.address), memory_of.get(device.address))
            for index, device in enumerate(physical)
        ]
    by_address = {device.address: device for device in physical}
    gpus: list[Gpu] = []
    for position, raw in enumerate(cuda_visible_devices.split(",")):
        entry = raw.strip()
        stop = f"CUDA sees no device from index {len(gpus)} on, nor does this topology"
        if DEVICE_INDEX.fullmatch(entry):
            number = int(entry)
            if not 0 <= number < len(physical):
                if number >= 0:  # a negative index is the usual way to hide every GPU
                    warn(
                        f"CUDA_VISIBLE_DEVICES entry {entry!r} (position {position}) names no GPU: "
                        f"this machine has {len(physical)}; {stop}"
                    )
                break
            device = physical[number]
            uuid = uuid_of.get(device.address)
        elif entry[:4].upper() in ("GPU-", "MIG-"):
            matches = match_uuid(entry, uuids)
            if len(matches) != 1:
                if matches:
                    problem = f"matches {len(matches)} GPUs ({', '.join(sorted(matches))})"
                elif uuids:
                    problem = f"matches none of the GPUs here ({', '.join(sorted(uuids))})"
                else:
                    problem = f"cannot be matched: no GPU UUID is known ({uuid_sources})"
                warn(f"CUDA_VISIBLE_DEVICES entry {entry!r} (position {position}) {problem}; {stop}")
                break
            uuid = matches[0]
            if uuids[uuid] not in by_address:
                warn(f"CUDA_VISIBLE_DEVICES entry {entry!r}: its PCI device {uuids[uuid]} is not in sysfs; {stop}")
                break
            device = by_address[uuids[uuid]]
        else:
            if entry or position:
                warn(f"CUDA_VISIBLE_DEVICES entry {entry!r} (position {position}) is not a device; {stop}")
            break
        if any(gpu.address == device.address and gpu.uuid == uuid for gpu in gpus):
            warn(f"CUDA_VISIBLE_DEVICES entry {entry!r} (position {position}) repeats a device; {stop}")
            break
        gpus.append(Gpu(len(gpus), device.address, device.node, uuid, memory_of.get(device.address)))
    return gpus
