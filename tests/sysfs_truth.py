"""What the kernel says, read straight from /sys with no numafast code: the
independent truth that tests compare numafast's answers with."""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

NODE_DIR = Path("/sys/devices/system/node")


def parse_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the kernel's cpulist/nodelist format)."""
    ids: list[int] = []
    for part in text.strip().strip("\x00").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        ids.extend(range(int(first), int(last or first) + 1))
    return ids


def online_nodes() -> list[int]:
    path = NODE_DIR / "online"
    return parse_list(path.read_text()) if path.exists() else [0]


def node_cpus(node: int) -> list[int]:
    return parse_list((NODE_DIR / f"node{node}" / "cpulist").read_text())


def node_distances(node: int) -> list[int]:
    return [int(d) for d in (NODE_DIR / f"node{node}" / "distance").read_text().split()]


def node_meminfo(node: int) -> dict[str, int]:
    """Fields of nodeN/meminfo in bytes ('Node 0 MemTotal:  4810956 kB')."""
    fields: dict[str, int] = {}
    for line in (NODE_DIR / f"node{node}" / "meminfo").read_text().splitlines():
        words = line.split()
        if len(words) >= 4:
            fields[words[2].rstrip(":")] = int(words[3]) * (1024 if words[-1] == "kB" else 1)
    return fields


def cpuless_nodes_with_memory() -> list[int]:
    return [n for n in online_nodes() if not node_cpus(n) and node_meminfo(n).get("MemTotal", 0) > 0]


# ---------------------------------------------------------------- pages (memory tests)
# Where a page is, asked without move_pages(2): its frame number from
# /proc/self/pagemap (PFNs read as 0 without CAP_SYS_ADMIN; the guests run as
# root), and the node whose memory block holds that frame, from the
# /sys/devices/system/node/nodeN/memoryM links.

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_PFN_MASK = (1 << 55) - 1
_PRESENT = 1 << 63
_EXCLUSIVE = 1 << 56


@cache
def memory_block_nodes() -> dict[int, int]:
    """{memory block number: node} for the memory the kernel has online."""
    blocks: dict[int, int] = {}
    for node in online_nodes():
        for entry in (NODE_DIR / f"node{node}").glob("memory[0-9]*"):
            blocks[int(entry.name.removeprefix("memory"))] = node
    return blocks


@cache
def memory_block_size() -> int:
    return int((Path("/sys/devices/system/memory/block_size_bytes")).read_text(), 16)


def _pagemap_entries(address: int, length: int) -> list[int]:
    first, last = address // PAGE_SIZE, (address + length - 1) // PAGE_SIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        data = pagemap.read((last - first + 1) * 8)
    return list(struct.unpack(f"{last - first + 1}Q", data))


@cache
def zero_page_pfn() -> int:
    """The frame of the shared zero page, which a read of fresh memory maps; -1 where
    the kernel gives such a read a page of its own (then mapped exclusively)."""
    with mmap.mmap(-1, PAGE_SIZE) as fresh:
        fresh[0]  # a read fault
        view = memoryview(fresh)
        entry = _pagemap_entries(buffer_address(view)[0], 1)[0]
        view.release()
    return -1 if entry & _EXCLUSIVE else entry & _PFN_MASK


def pagemap_nodes(address: int, length: int) -> list[int | None]:
    """The node of every page of [address, address + length), None for a page with no
    frame of its own yet (never touched, or only read: the zero page)."""
    nodes: list[int | None] = []
    blocks, block_size, zero = memory_block_nodes(), memory_block_size(), zero_page_pfn()
    for entry in _pagemap_entries(address, length):
        pfn = entry & _PFN_MASK
        if not entry & _PRESENT or pfn == zero:
            nodes.append(None)
            continue
        if pfn == 0:
            raise PermissionError("/proc/self/pagemap hides frame numbers: run as root (CAP_SYS_ADMIN)")
        nodes.append(blocks[pfn * PAGE_SIZE // block_size])
    return nodes


_KPF_MLOCKED = 1 << 33  # /proc/kpageflags (include/uapi/linux/kernel-page-flags.h)


def pages_mlocked(address: int, length: int) -> bool:
    """Whether every page of [address, address + length) is present in this process
    and mlocked, asked of /proc/self/pagemap and /proc/kpageflags (root only)."""
    entries = _pagemap_entries(address, length)
    if not all(entry & _PRESENT for entry in entries):
        return False
    with open("/proc/kpageflags", "rb") as kpageflags:
        for entry in entries:
            pfn = entry & _PFN_MASK
            if pfn == 0:
                raise PermissionError("/proc/self/pagemap hides frame numbers: run as root (CAP_SYS_ADMIN)")
            kpageflags.seek(pfn * 8)
            if not struct.unpack("Q", kpageflags.read(8))[0] & _KPF_MLOCKED:
                return False
    return True


def vma_of(address: int) -> tuple[int, int] | None:
    """(start, end) of the mapping in /proc/self/maps that holds ``address``, if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, _, end = line.split(None, 1)[0].partition("-")
            if int(start, 16) <= address < int(end, 16):
                return int(start, 16), int(end, 16)
    return None


def numa_maps(pid: int | str = "self") -> dict[int, tuple[str, dict[int, int]]]:
    """{mapping start: (policy, {node: pages})} from /proc/PID/numa_maps."""
    mappings: dict[int, tuple[str, dict[int, int]]] = {}
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        words = line.split()
        counts = {
            int(word[1 : word.index("=")]): int(word.partition("=")[2])
            for word in words[2:]
            if word[0] == "N" and word[1].isdigit()
        }
        mappings[int(words[0], 16)] = (words[1], counts)
    return mappings


def numa_maps_of(address: int) -> tuple[str, dict[int, int]]:
    """(policy, {node: pages}) of the mapping holding ``address``, from /proc/self/numa_maps."""
    vma = vma_of(address)
    assert vma is not None, f"{address:#x} is not mapped"
    mapping = numa_maps().get(vma[0])
    assert mapping is not None, f"no numa_maps line for the mapping at {vma[0]:#x}"
    return mapping


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding ``address``, from /proc/self/smaps."""
    vma = vma_of(address)
    assert vma is not None, f"{address:#x} is not mapped"
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(None, 1)[0] and not line[0].isupper():
                inside = int(line.partition("-")[0], 16) == vma[0]
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


@contextmanager
def pinned_to_one_cpu() -> Iterator[int]:
    """Keep the calling thread on one of its CPUs (so "the caller's node" holds still
    while a test looks); yields the CPU's node, read from sysfs."""
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    os.sched_setaffinity(0, {cpu})
    try:
        yield next(n for n in online_nodes() if cpu in node_cpus(n))
    finally:
        os.sched_setaffinity(0, allowed)

# ---------------------------------------------------------------- placement truth (issue 4)
# Where a page is and where a thread may run, asked of the kernel: /proc files,
# and for a page's node get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR) through the raw,
# one-to-one mirror in numafast._libnuma (the only numafast code used here).

def buffer_address(buffer: object) -> tuple[int, int]:
    """(address, length in bytes) of a writable buffer (NumPy array, bytearray, mmap)."""
    import numpy

    view = numpy.frombuffer(buffer, dtype=numpy.uint8) if not isinstance(buffer, numpy.ndarray) else buffer
    return view.__array_interface__["data"][0], view.nbytes


def page_nodes(buffer: object) -> list[int]:
    """The node of every whole page inside ``buffer``, in order (touch the pages first:
    the query faults an untouched page in under the calling thread's policy)."""
    from numafast import _libnuma

    address, length = buffer_address(buffer)
    first = -(-address // PAGE_SIZE) * PAGE_SIZE
    flags = _libnuma.MPOL_F_NODE | _libnuma.MPOL_F_ADDR
    return [_libnuma.get_mempolicy(flags, page)[0] for page in range(first, address + length - PAGE_SIZE + 1, PAGE_SIZE)]


def thread_policy() -> tuple[int, list[int]]:
    """The calling thread's memory policy: get_mempolicy(2)'s (mode word, nodes)."""
    from numafast import _libnuma

    return _libnuma.get_mempolicy()


def task_status(tid: int | str = "self", pid: int | str = "self") -> dict[str, str]:
    """/proc/PID/task/TID/status as a dict (tid 'self' means /proc/PID/status)."""
    path = Path(f"/proc/{pid}/status") if tid == "self" else Path(f"/proc/{pid}/task/{tid}/status")
    return dict(line.split(":\t", 1) for line in path.read_text().splitlines() if ":\t" in line)


def thread_cpus_of_process(pid: int | str = "self") -> dict[int, list[int]]:
    """Cpus_allowed_list of every thread of a process, from /proc/PID/task/*/status."""
    return {
        int(task.name): parse_list(task_status(task.name, pid)["Cpus_allowed_list"])
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


def nearest_cpu_nodes(node: int) -> list[int]:
    """The nodes with CPUs at the smallest distance from ``node`` (itself if it has CPUs)."""
    with_cpus = [n for n in online_nodes() if node_cpus(n)]
    distances = node_distances(node)
    nodes = online_nodes()
    best = min(distances[nodes.index(n)] for n in with_cpus)
    return [n for n in with_cpus if distances[nodes.index(n)] == best]


def numa_maps_pages(address: int, length: int, pid: int | str = "self") -> dict[int, int]:
    """{node: pages} of the mappings that overlap [address, address + length), from
    /proc/PID/numa_maps (NumPy's madvise(MADV_HUGEPAGE) splits one malloc'd block in two)."""
    starts = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low < address + length and address < high:
            starts.add(low)
    pages: dict[int, int] = {}
    for start, (_policy, counts) in numa_maps(pid).items():
        if start in starts:
            for node, count in counts.items():
                pages[node] = pages.get(node, 0) + count
    return pages


# ---------------------------------------------------------------- pinned pools (issue 10)


def smaps_of(address: int, pid: int | str = "self") -> dict[str, str]:
    """The /proc/PID/smaps fields of the mapping holding ``address`` ('Locked' -> '4096 kB',
    'VmFlags' -> 'rd wr mr mw me lo dc ...'); empty when nothing is mapped there."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
            if inside:
                fields["range"] = head
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def kib(field: str) -> int:
    """'4096 kB' -> 4194304."""
    number, _, unit = field.partition(" ")
    assert unit == "kB", field
    return int(number) * 1024


@cache
def transparent_huge_page_size() -> int:
    """The PMD huge page size the kernel backs anonymous memory with; 0 when THP is off."""
    base = Path("/sys/kernel/mm/transparent_hugepage")
    try:
        if "[never]" in (base / "enabled").read_text():
            return 0
        return int((base / "hpage_pmd_size").read_text())
    except OSError:
        return 0
