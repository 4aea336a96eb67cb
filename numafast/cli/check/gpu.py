"""Where ``--gpu I`` is for a checked process: CUDA device I as that process numbers it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from numafast._validate import check_node
from numafast.affinity.modes import site_of
from numafast.cli.check.verdict import Expectation
from numafast.topo import Topology


def cuda_visible_devices_of(pid: int) -> tuple[str | None, str]:
    """The ``CUDA_VISIBLE_DEVICES`` process ``pid`` was started with (None: unset) and a line
    saying how its GPUs are numbered, and from where.

    /proc/PID/environ holds the environment the process was exec'd with (a change
    it made to os.environ later is not there). Where it cannot be read (another
    user's process without CAP_SYS_PTRACE), this process's own value is used, and
    the line says so. FileNotFoundError when there is no such process.
    """
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        raise FileNotFoundError(f"no process {pid}") from None
    except OSError as error:
        own = os.environ.get("CUDA_VISIBLE_DEVICES")
        return own, (
            f"note: /proc/{pid}/environ is unreadable ({error.strerror}); GPUs numbered by "
            + _numbered_by("this checker's own", "this checker's environment", own)
        )
    for entry in environ.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name == b"CUDA_VISIBLE_DEVICES":
            text = value.decode(errors="replace")
            return text, f"GPUs numbered by {_numbered_by('its', 'its environment', text)} (/proc/{pid}/environ)"
    return None, f"GPUs numbered by {_numbered_by('its', 'its environment', None)} (/proc/{pid}/environ)"


def _numbered_by(whose: str, environment: str, visible: str | None) -> str:
    if visible is None:
        return f"{environment}, which has no CUDA_VISIBLE_DEVICES: all, in PCI bus order"
    return f"{whose} CUDA_VISIBLE_DEVICES={visible}"


class GpuSites:
    """Where ``--gpu`` is for each process: in the topology its CUDA_VISIBLE_DEVICES shows
    (read once per distinct value)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.topologies: dict[str | None, Topology] = {}

    def numbering(self, pid: int) -> tuple[str | None, str]:
        """The CUDA_VISIBLE_DEVICES that numbers ``pid``'s GPUs, and a line saying which."""
        if self.args.cuda_visible_devices is not None:
            visible = self.args.cuda_visible_devices
            return visible, f"GPUs numbered by --cuda-visible-devices {visible}"
        return cuda_visible_devices_of(pid)

    def expectation(self, visible: str | None) -> Expectation:
        """Where the rank belongs: the CPU node that drives --gpu as ``visible`` numbers GPUs.

        Pages count as local on that node, on the GPU's node where it is CPU-less, and on
        the GPU's own memory node (``Gpu.memory_node``: on Grace the GPU's HBM, a CPU-less
        node apart from the Grace node the GPU hangs off)."""
        if visible not in self.topologies:
            live = self.args.sysfs is None
            root = "/" if live else self.args.sysfs
            self.topologies[visible] = Topology.from_sysfs(root, cuda_visible_devices=visible, ask_gpu_libraries=live)
        machine = self.topologies[visible]
        gpu = machine.gpu(self.args.gpu)
        site = site_of(machine, gpu)
        check_node(site.cpu_node, need_allowed=False)
        local = {site.cpu_node, site.node}
        reason = f"GPU {self.args.gpu} is on node {site.cpu_node}"
        if gpu.memory_node is not None:
            local.add(gpu.memory_node)
            reason += f" (its memory: node {gpu.memory_node})"
        return Expectation(site.cpu_node, tuple(sorted(local)), reason, "numafast run --gpu auto")
