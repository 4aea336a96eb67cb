"""What the kernel says, read straight from /sys with no numafast code: the
independent truth that tests compare numafast's answers with."""

from __future__ import annotations

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
