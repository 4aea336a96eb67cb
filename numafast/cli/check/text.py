"""The text ``numafast check`` prints: a line per process, its memory and problems,
and a line for each rank of more than one process."""

from __future__ import annotations

from numafast._validate import format_size
from numafast.cli.check.classes import MemoryClass
from numafast.cli.check.result import ClassUsage, ProcessAudit, RankAudit


def memory_line(memory: dict[MemoryClass, ClassUsage]) -> str:
    """``page-locked node 1 8.0 MiB | anonymous node 0 20.0 MiB, node 1 4.0 KiB``."""
    parts = [f"{memory_class.display} " + ", ".join(f"node {node} {format_size(count)}"
                                                  for node, count in usage.node_bytes.items() if count)
             for memory_class, usage in memory.items() if usage.total()]  # fmt: skip
    return " | ".join(parts) or "none resident"


def head_line(process: ProcessAudit, rank: RankAudit, gpu: int | None) -> str:
    """``pid 4242: wrong (GPU 3 on node 0; python3; 12 threads; remote 64%)``, or why there is no verdict."""
    who = ", ".join(filter(None, [process.name, f"child of {process.ppid}" if process.pid != rank.pid else ""]))
    if process.status == "missing":
        return f"pid {process.pid}: no such process" + (f" ({process.reason})" if process.reason else "")
    if process.status == "unreadable":
        return f"pid {process.pid}: cannot check" + (f" ({who})" if who else "") + f": {process.reason}"
    if process.status == "exited":
        return f"pid {process.pid}: exited during the audit" + (f" ({who})" if who else "")
    where = "unbound" if rank.node is None else f"node {rank.node}"
    if gpu is not None:
        where = f"GPU {gpu} on {where}"
    threads = sum(len(group.tids) for group in process.threads)
    return (f"pid {process.pid}: {process.status} ({where}; {who}; {threads} thread{'s' * (threads != 1)}; "
            f"remote {process.remote_share:.0%})")  # fmt: skip


def process_lines(process: ProcessAudit, rank: RankAudit, gpu: int | None) -> list[str]:
    lines = [head_line(process, rank, gpu)]
    if process.pid == rank.pid and rank.numbering:
        lines.append(f"  {rank.numbering}")
    if process.status in ("ok", "wrong"):
        lines.append(f"  memory: {memory_line(process.memory)}")
        lines += [f"  {problem}" for problem in process.problems]
    return lines


def rank_lines(rank: RankAudit, gpu: int | None) -> list[str]:
    """Every process's lines, then the rank's own verdict where it has descendants."""
    lines = [line for process in rank.processes for line in process_lines(process, rank, gpu)]
    if len(rank.processes) > 1:
        statuses = [process.status for process in rank.processes]
        counts = ", ".join(f"{statuses.count(status)} {status}" for status in dict.fromkeys(statuses))
        lines.append(f"rank {rank.pid}: {rank.status} ({len(rank.processes)} processes: {counts})")
        lines.append(f"  memory: {memory_line(rank.memory)}")
        lines += [f"  {problem}" for problem in rank.problems]
    return lines + [f"  note: {note}" for note in rank.notes]
