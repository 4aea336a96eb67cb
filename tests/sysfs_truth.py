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
        entry = _pagemap_entries(_address(view), 1)[0]
        view.release()
    return -1 if entry & _EXCLUSIVE else entry & _PFN_MASK


def _address(view: memoryview) -> int:
    # The one way to get a buffer's address without ctypes or numafast.
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).__array_interface__["data"][0])


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


def vma_of(address: int) -> tuple[int, int] | None:
    """(start, end) of the mapping in /proc/self/maps that holds ``address``, if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, _, end = line.split(None, 1)[0].partition("-")
            if int(start, 16) <= address < int(end, 16):
                return int(start, 16), int(end, 16)
    return None


def numa_maps_of(address: int) -> tuple[str, dict[int, int]]:
    """(policy, {node: pages}) of the mapping holding ``address``, from /proc/self/numa_maps."""
    vma = vma_of(address)
    assert vma is not None, f"{address:#x} is not mapped"
    with open("/proc/self/numa_maps") as numa_maps:
        for line in numa_maps:
            words = line.split()
            if int(words[0], 16) == vma[0]:
                counts = {
                    int(word[1 : word.index("=")]): int(word.partition("=")[2])
                    for word in words[2:]
                    if word[0] == "N" and word[1].isdigit()
                }
                return words[1], counts
    raise AssertionError(f"no numa_maps line for the mapping at {vma[0]:#x}")


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
