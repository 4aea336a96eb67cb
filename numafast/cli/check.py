"""``numafast check PID...``: audit where running processes execute and keep their memory.

For each process: every thread's allowed CPUs and the nodes they belong to
(/proc/PID/task/TID/status), and its pages per node (/proc/PID/numa_maps).
Placement is wrong when threads may run on more than one node (or on another
node than ``--node``), or when more than ``--max-remote`` of the pages lie on
other nodes. The exit status is non-zero then, so this serves as a health check.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from numafast import _libnuma
from numafast._validate import check_node, format_ids, parse_ids


@dataclass
class Audit:
    """What the kernel reports for one process, and the verdict."""

    pid: int
    thread_cpus: dict[int, list[int]]
    pages: dict[int, int]
    node: int | None
    problems: list[str]

    def remote_share(self) -> float:
        total = sum(self.pages.values())
        return 0.0 if self.node is None or total == 0 else 1 - self.pages.get(self.node, 0) / total


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("check", help="audit the CPU and memory placement of running processes")
    parser.add_argument("pids", metavar="PID", nargs="+", type=int)
    parser.add_argument("--node", type=int, help="the node every thread and page should be on")
    parser.add_argument("--max-remote", type=float, default=0.1, metavar="SHARE",
                        help="largest share of pages allowed on other nodes (default 0.1)")  # fmt: skip
    parser.set_defaults(run=run)


def thread_cpus(pid: int) -> dict[int, list[int]]:
    cpus: dict[int, list[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    cpus[int(task.name)] = parse_ids(line.split(":", 1)[1])
        except FileNotFoundError:  # the thread ended while we looked
            continue
    return cpus


def pages_per_node(pid: int) -> dict[int, int]:
    """Pages of every mapping per node, in base pages, from /proc/PID/numa_maps."""
    pages: dict[int, int] = {}
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        words = line.split()
        page_kb = next((int(w.split("=")[1]) for w in words if w.startswith("kernelpagesize_kB=")), 4)
        for word in words:
            if word[0] == "N" and "=" in word:
                node, count = word[1:].split("=")
                pages[int(node)] = pages.get(int(node), 0) + int(count) * page_kb // 4
    return pages


def audit(pid: int, node: int | None, max_remote: float) -> Audit:
    cpus = thread_cpus(pid)
    nodes_of_threads = {tid: sorted({_libnuma.node_of_cpu(cpu) for cpu in c}) for tid, c in cpus.items()}
    spanned = sorted({n for nodes in nodes_of_threads.values() for n in nodes})
    problems: list[str] = []
    if node is None and len(spanned) == 1:
        node = spanned[0]
    for tid, nodes in sorted(nodes_of_threads.items()):
        if node is None or nodes != [node]:
            problems.append(f"thread {tid} may run on CPUs {format_ids(cpus[tid])} (nodes {format_ids(nodes)})")
    result = Audit(pid, cpus, pages_per_node(pid), node, problems)
    if node is not None and result.remote_share() > max_remote:
        problems.append(f"{result.remote_share():.0%} of the pages are on nodes other than {node}")
    return result


def run(args: argparse.Namespace) -> int:
    if args.node is not None:
        check_node(args.node, need_allowed=False)
    wrong = 0
    for pid in args.pids:
        try:
            result = audit(pid, args.node, args.max_remote)
        except FileNotFoundError:
            print(f"pid {pid}: no such process")
            wrong += 1
            continue
        pages = ", ".join(f"node {n}: {p}" for n, p in sorted(result.pages.items())) or "none"
        verdict = "wrong" if result.problems else "ok"
        where = "unbound" if result.node is None else f"node {result.node}"
        print(f"pid {pid}: {verdict} ({where}; {len(result.thread_cpus)} threads; pages {pages}; "
              f"remote {result.remote_share():.0%})")  # fmt: skip
        for problem in result.problems:
            print(f"  {problem}")
        wrong += bool(result.problems)
    return 1 if wrong else 0
