"""``numafast check PID...``: audit where a training rank runs and keeps its memory.

For each PID and every process below it (DataLoader workers; ``--process-only``
looks at the PID alone): each thread's allowed CPUs and memory nodes
(/proc/PID/task/TID/status), its memory per class and node (page-locked,
shared, anonymous: /proc/PID/numa_maps joined with /proc/PID/smaps; see
classes.py), the memory policies that place pages elsewhere, a verdict per
process and one for the rank (verdict.py). The node expected is ``--node``, the
node that drives ``--gpu`` (pages on the GPU's own memory node count as local
too: on Grace its HBM node, ``Gpu.memory_node``, or the GPU's node where that is
CPU-less), or else the one node the PID's threads run on. The exit status is non-zero when a rank is wrong or
cannot be audited, so this serves as a health check; ``--json`` prints schema
``numafast.check/1`` (result.py).

``--gpu I`` is CUDA device I as the checked process numbers it: by the
``CUDA_VISIBLE_DEVICES`` it was started with (/proc/PID/environ), so the answer
does not depend on the shell the check runs from. Where that file cannot be read,
the checker's own variable numbers the GPUs, and the output says so.
"""

from __future__ import annotations

import argparse
import math
import os
from datetime import datetime, timezone
from pathlib import Path

import numafast
from numafast import _libnuma
from numafast._validate import check_node, format_ids, online_nodes
from numafast.cli.check.gpu import GpuSites
from numafast.cli.check.procfs import Process, ProcessGone, ProcessUnreadable, descendants, hidden_pid_note, read_process
from numafast.cli.check.classes import MemoryClass
from numafast.cli.check.result import CheckReport, ClassUsage, ProcessAudit, RankAudit
from numafast.cli.check.text import rank_lines
from numafast.cli.check.verdict import Expectation, audit_process, rank_memory, remote_problems
from numafast.cli.show import add_topology_arguments
from numafast.errors import InvalidGpuError
from numafast.policy import seccomp_state


def share(text: str) -> float:
    """``--max-remote``: a share of the pages, 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a share in 0..1 (0.1: at most 10% of the pages remote)")
    return value


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("check", help="audit the CPU and memory placement of running ranks and their workers")
    parser.add_argument("pids", metavar="PID", nargs="+", type=int)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--node", type=int, help="the node every thread and page should be on")
    where.add_argument(
        "--gpu", type=int, metavar="I",
        help="CUDA device I's node, as numafast plan places it (numbered per the process's own CUDA_VISIBLE_DEVICES)",
    )
    parser.add_argument("--max-remote", type=share, default=0.1, metavar="SHARE",
                        help="largest share (0..1) of each class of memory allowed on other nodes (default 0.1)")
    parser.add_argument("--process-only", action="store_true",
                        help="audit each PID alone, not the processes it started (DataLoader workers)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema numafast.check/1)")
    add_topology_arguments(parser)
    parser.set_defaults(run=run)  # fmt: skip


def expectation_from_threads(process: Process) -> Expectation:
    """Where a rank belongs when not told: the one node its threads may run on."""
    nodes = sorted({_libnuma.node_of_cpu(cpu) for thread in process.threads for cpu in thread.cpus})
    if len(nodes) == 1:
        node = nodes[0]
        return Expectation(node, (node,), f"the rank runs on node {node}",
                           f"numafast run --cpunodebind {node} --membind {node}")  # fmt: skip
    return Expectation(None, (), f"the rank may run on nodes {format_ids(nodes)}", "numafast run --gpu auto")


def audit_descendant(pid: int, ppid: int, expectation: Expectation,
                     args: argparse.Namespace) -> tuple[ProcessAudit, Process | None]:  # fmt: skip
    try:
        process = read_process(pid)
    except ProcessGone:
        return ProcessAudit(pid, "exited", ppid, reason="exited during the audit"), None
    except ProcessUnreadable as error:
        return ProcessAudit(pid, "unreadable", ppid, reason=str(error)), None
    return audit_process(process, expectation, args.max_remote, list(online_nodes()), _libnuma.node_of_cpu), process


STATUS_WORDS = {"missing": "no such process", "exited": "exited during the audit", "unreadable": "cannot be read"}


def unaudited(pid: int, status: str, reason: str | None, numbering: str | None = None) -> RankAudit:
    """A rank whose main process could not be audited, and why."""
    return RankAudit(pid, status, None, [], "", numbering, problems=[reason or STATUS_WORDS[status]],
                     processes=[ProcessAudit(pid, status, reason=reason)])  # fmt: skip


def expectation_of(root: Process, args: argparse.Namespace, gpu_sites: GpuSites | None,
                   visible: str | None) -> Expectation:  # fmt: skip
    """Where the rank belongs: --gpu's node, --node, or where its main process's threads run."""
    if gpu_sites is not None:
        return gpu_sites.expectation(visible)
    if args.node is not None:
        return Expectation(args.node, (args.node,), f"expected on node {args.node} (--node)",
                           f"numafast run --cpunodebind {args.node} --membind {args.node}")  # fmt: skip
    return expectation_from_threads(root)


def rank_problems(audits: list[ProcessAudit], memory: dict[MemoryClass, ClassUsage], expectation: Expectation,
                  max_remote: float) -> list[str]:  # fmt: skip
    """The rank's memory classes off its node, then each process that is wrong or unreadable."""
    if expectation.node is None:
        problems = [f"{expectation.reason}: not bound to one node"]
    else:
        problems = remote_problems(memory, expectation, max_remote)
    for audit in audits:
        if audit.status in ("wrong", "unreadable"):
            first = audit.problems[0] if audit.problems else audit.reason
            more = f" (and {len(audit.problems) - 1} more)" if len(audit.problems) > 1 else ""
            problems.append(f"pid {audit.pid} ({audit.name or 'unknown'}) is {audit.status}: {first}{more}")
    return problems


def placement_notes(pid: int) -> list[str]:
    """Why ``pid``'s memory may sit where the kernel put it: a seccomp filter without
    CAP_SYS_NICE, as in a container under Docker's (or Kubernetes' RuntimeDefault)
    default profile, where set_mempolicy and mbind answer EPERM and numafast runs unplaced."""
    state, nice = seccomp_state(pid)
    if state != "filter active" or nice is not False:
        return []
    return [
        f"memory placement likely refused in pid {pid}: EPERM (seccomp: filter active, no CAP_SYS_NICE); "
        "Docker's default profile allows set_mempolicy and mbind only with CAP_SYS_NICE: run the container with "
        "--cap-add SYS_NICE (Kubernetes: add SYS_NICE to securityContext.capabilities.add), or a seccomp "
        "profile that allows them"
    ]


def audit_rank(pid: int, args: argparse.Namespace, gpu_sites: GpuSites | None) -> RankAudit:
    """The rank whose main process is ``pid``: it, its descendants, and the verdict."""
    if not Path(f"/proc/{pid}").exists():
        return unaudited(pid, "missing", hidden_pid_note())
    numbering = visible = None
    try:
        if gpu_sites is not None:
            visible, numbering = gpu_sites.numbering(pid)
        root = read_process(pid)
        expectation = expectation_of(root, args, gpu_sites, visible)
    except (ProcessGone, FileNotFoundError):
        return unaudited(pid, "exited", "exited during the audit", numbering)
    except (ProcessUnreadable, InvalidGpuError, PermissionError) as error:
        return unaudited(pid, "unreadable", str(error), numbering)
    processes = [root]
    audits = [audit_process(root, expectation, args.max_remote, list(online_nodes()), _libnuma.node_of_cpu)]
    # The checker itself may be a descendant (`numafast check $$`); it is no part of the rank.
    for child, parent in [] if args.process_only else [d for d in descendants(pid) if d[0] != os.getpid()]:
        audit, process = audit_descendant(child, parent, expectation, args)
        audits.append(audit)
        processes += [process] if process is not None else []
    memory = rank_memory(processes)
    problems = rank_problems(audits, memory, expectation, args.max_remote)
    return RankAudit(pid, "wrong" if problems else "ok", expectation.node, list(expectation.local_nodes),
                     expectation.reason, numbering, memory, problems, audits, placement_notes(pid))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    gpu_sites = GpuSites(args) if args.gpu is not None else None
    if gpu_sites is None and (args.sysfs is not None or args.cuda_visible_devices is not None):
        raise ValueError("--sysfs and --cuda-visible-devices apply only with --gpu")
    if args.cuda_visible_devices is not None and args.sysfs is None:
        raise ValueError("--cuda-visible-devices applies to a --sysfs snapshot; without it each process's own is used")
    if args.node is not None:
        check_node(args.node, need_allowed=False)
    created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    settings = {"node": args.node, "gpu": args.gpu, "max_remote": args.max_remote, "descendants": not args.process_only}
    report = CheckReport(numafast.__version__, created, settings, [audit_rank(pid, args, gpu_sites) for pid in args.pids])
    if args.json:
        print(report.to_json())
    else:
        for rank in report.ranks:
            print("\n".join(rank_lines(rank, args.gpu)))
    return 0 if report.ok else 1
