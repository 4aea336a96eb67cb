"""``numafast check PID...``: audit where running processes execute and keep their memory.

For each process: every thread's allowed CPUs and the nodes they belong to
(/proc/PID/task/TID/status), and the pages of its own memory (anonymous and
shared memory, not the page cache of mapped files) per node (/proc/PID/numa_maps).
Placement is wrong when threads may run on more than one node (or on another
node than ``--node``, or than the node that drives ``--gpu``), or when more than
``--max-remote`` of the pages lie on other nodes (for a GPU on a CPU-less node,
as on Grace-Hopper, pages on the GPU's own memory node count as local too). The
exit status is non-zero then, so this serves as a health check.

``--gpu I`` is CUDA device I as the checked process numbers it: by the
``CUDA_VISIBLE_DEVICES`` it was started with (/proc/PID/environ), so the answer
does not depend on the shell the check runs from. Where that file cannot be read,
the checker's own variable numbers the GPUs, and the output says so.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from numafast import _libnuma
from numafast._validate import check_node, format_ids, parse_ids
from numafast.affinity.modes import site_of
from numafast.cli.show import add_topology_arguments
from numafast.errors import InvalidGpuError
from numafast.topo import Topology
from numafast.topo.files import read_fields


@dataclass
class Audit:
    """What the kernel reports for one process, and the verdict."""

    pid: int
    thread_cpus: dict[int, list[int]]
    pages: dict[int, int]
    node: int | None
    problems: list[str]
    local_nodes: tuple[int, ...] = ()
    """Nodes whose pages count as local besides ``node`` (a GPU's own memory node)."""

    def remote_share(self) -> float:
        total = sum(self.pages.values())
        if self.node is None or total == 0:
            return 0.0
        local = sum(self.pages.get(node, 0) for node in {self.node, *self.local_nodes})
        return 1 - local / total


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("check", help="audit the CPU and memory placement of running processes")
    parser.add_argument("pids", metavar="PID", nargs="+", type=int)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--node", type=int, help="the node every thread and page should be on")
    where.add_argument(
        "--gpu", type=int, metavar="I",
        help="CUDA device I's node, as numafast plan places it (numbered per the process's own CUDA_VISIBLE_DEVICES)",
    )
    parser.add_argument("--max-remote", type=float, default=0.1, metavar="SHARE",
                        help="largest share of pages allowed on other nodes (default 0.1)")  # fmt: skip
    add_topology_arguments(parser)
    parser.set_defaults(run=run)


def thread_cpus(pid: int) -> dict[int, list[int]]:
    cpus: dict[int, list[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = read_fields(task / "status")  # None: the thread ended while we looked
        if fields is not None and "Cpus_allowed_list" in fields:
            cpus[int(task.name)] = parse_ids(fields["Cpus_allowed_list"])
    return cpus


# Shared memory shows in numa_maps as a file: POSIX shm, memfd, System V segments.
SHARED_MEMORY_FILES = ("/dev/shm/", "/memfd:", "/SYSV")


def is_own_memory(words: list[str]) -> bool:
    """Whether a numa_maps mapping holds the process's own data: anonymous memory or shared
    memory (DataLoader workers pass tensors through /dev/shm or memfd).

    Mapped files (the Python binary, libtorch, NumPy's libraries) live in the page cache on
    whichever node first read them and are shared by every process: no binding of this
    process places them, so they say nothing about its placement.
    """
    file = next((word[len("file=") :] for word in words if word.startswith("file=")), None)
    return file is None or file.startswith(SHARED_MEMORY_FILES)


def pages_per_node(pid: int) -> dict[int, int]:
    """Pages of the process's own memory per node, in base pages, from /proc/PID/numa_maps."""
    pages: dict[int, int] = {}
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        words = line.split()
        if not is_own_memory(words):
            continue
        page_kb = next((int(w.split("=")[1]) for w in words if w.startswith("kernelpagesize_kB=")), 4)
        for word in words:
            if word[0] == "N" and "=" in word:
                node, count = word[1:].split("=")
                pages[int(node)] = pages.get(int(node), 0) + int(count) * page_kb // 4
    return pages


def audit(pid: int, node: int | None, max_remote: float, local_nodes: tuple[int, ...] = ()) -> Audit:
    cpus = thread_cpus(pid)
    nodes_of_threads = {tid: sorted({_libnuma.node_of_cpu(cpu) for cpu in c}) for tid, c in cpus.items()}
    spanned = sorted({n for nodes in nodes_of_threads.values() for n in nodes})
    problems: list[str] = []
    if node is None and len(spanned) == 1:
        node = spanned[0]
    for tid, nodes in sorted(nodes_of_threads.items()):
        if node is None or nodes != [node]:
            problems.append(f"thread {tid} may run on CPUs {format_ids(cpus[tid])} (nodes {format_ids(nodes)})")
    result = Audit(pid, cpus, pages_per_node(pid), node, problems, local_nodes)
    if node is not None and result.remote_share() > max_remote:
        local = format_ids({node, *local_nodes})
        problems.append(f"{result.remote_share():.0%} of the pages are on nodes other than {local}")
    return result


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

    def site(self, visible: str | None) -> tuple[int, tuple[int, ...]]:
        """(the CPU node that drives --gpu, the GPU's own memory node) as ``visible`` numbers GPUs."""
        if visible not in self.topologies:
            live = self.args.sysfs is None
            root = "/" if live else self.args.sysfs
            self.topologies[visible] = Topology.from_sysfs(root, cuda_visible_devices=visible, ask_gpu_libraries=live)
        machine = self.topologies[visible]
        site = site_of(machine, machine.gpu(self.args.gpu))
        check_node(site.cpu_node, need_allowed=False)
        return site.cpu_node, (site.node,)


def run(args: argparse.Namespace) -> int:
    gpu_sites = GpuSites(args) if args.gpu is not None else None
    if gpu_sites is None and (args.sysfs is not None or args.cuda_visible_devices is not None):
        raise ValueError("--sysfs and --cuda-visible-devices apply only with --gpu")
    if args.cuda_visible_devices is not None and args.sysfs is None:
        raise ValueError("--cuda-visible-devices applies to a --sysfs snapshot; without it each process's own is used")
    if args.node is not None:
        check_node(args.node, need_allowed=False)
    wrong = 0
    for pid in args.pids:
        node: int | None = args.node
        local_nodes: tuple[int, ...] = ()
        numbering = ""
        try:
            if gpu_sites is not None:
                visible, numbering = gpu_sites.numbering(pid)
                node, local_nodes = gpu_sites.site(visible)
            result = audit(pid, node, args.max_remote, local_nodes)
        except FileNotFoundError:
            print(f"pid {pid}: no such process")
            wrong += 1
            continue
        except (InvalidGpuError, PermissionError) as error:
            print(f"pid {pid}: cannot check: {error}")
            if numbering:
                print(f"  {numbering}")
            wrong += 1
            continue
        pages = ", ".join(f"node {n}: {p}" for n, p in sorted(result.pages.items())) or "none"
        verdict = "wrong" if result.problems else "ok"
        where = "unbound" if result.node is None else f"node {result.node}"
        if args.gpu is not None:
            where = f"GPU {args.gpu} on {where}"
        print(f"pid {pid}: {verdict} ({where}; {len(result.thread_cpus)} threads; pages {pages}; "
              f"remote {result.remote_share():.0%})")  # fmt: skip
        if numbering:
            print(f"  {numbering}")
        for problem in result.problems:
            print(f"  {problem}")
        wrong += bool(result.problems)
    return 1 if wrong else 0
