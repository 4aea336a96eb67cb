"""``numafast plan``: every local rank's GPU, CPUs and memory policy, and what is wrong."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

from numafast._validate import format_ids
from numafast.affinity import AffinityMode, MemoryPolicy, Plan, Smt, plan
from numafast.affinity.modes import check_core_counts
from numafast.cli.arguments import UsageError, count
from numafast.cli.show import add_topology_arguments, load_topology
from numafast.topo import Topology
from numafast.topo.cuda import cuda_devices

def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("plan", help="plan each local rank's CPUs and memory from its GPU")
    parser.add_argument("--nproc-per-node", type=count(1), help="ranks on this machine (default: one per GPU)")
    parser.add_argument("--mode", default="node", choices=[m.value for m in AffinityMode], help="default: node")
    parser.add_argument("--smt", default="all", choices=[s.value for s in Smt], help="SMT threads per core")
    parser.add_argument("--unbalanced", action="store_true", help="unique modes: split each node's cores fully")
    parser.add_argument("--min-cores", type=count(1), default=1, help="NVIDIA modes: fewer physical cores is an error")
    parser.add_argument("--max-cores", type=count(1), help="NVIDIA modes: at most this many physical cores per rank")
    parser.add_argument(
        "--memory", default="preferred", choices=[p.value for p in MemoryPolicy],
        help="memory policy on each rank's node (default: preferred)",
    )  # fmt: skip
    parser.add_argument("--workers", type=count(0), default=0, help="DataLoader workers per rank, for the load check")
    add_topology_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        check_core_counts(AffinityMode(args.mode), args.min_cores, args.max_cores, cli=True)
    except ValueError as error:
        raise UsageError(str(error)) from None
    machine = load_topology(args)
    if not machine.gpus:
        raise ValueError(no_gpus(machine, "this machine" if args.sysfs is None else f"the snapshot {args.sysfs}"))
    result = plan(
        args.nproc_per_node, mode=args.mode, topology=machine, smt=args.smt,
        balanced=not args.unbalanced, min_cores=args.min_cores, max_cores=args.max_cores,
        memory=args.memory, dataloader_workers=args.workers,
    )  # fmt: skip
    print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(render(result)))
    return 0


def no_gpus(machine: Topology, name: str) -> str:
    """Why there is nothing to plan (``name``: the machine looked at), and what plan needs:
    said once, whichever options asked."""
    hidden = len(cuda_devices(list(machine.pci)))
    where = (f"CUDA_VISIBLE_DEVICES hides all {hidden} GPUs of {name}" if hidden
             else f"{name} has no GPU (no NVIDIA or AMD display, 3D or accelerator controller on its PCI bus)")  # fmt: skip
    return (
        f"no GPUs to plan for: {where}. plan gives each local rank the CPUs and memory of its GPU's node, "
        "so it needs GPUs that sysfs shows, or a snapshot of a machine with them (--sysfs ROOT, e.g. "
        "tests/fixtures/dgx-h100 in a numafast checkout). "
        "To bind without a GPU: numafast run --cpunodebind NODES --membind NODES -- COMMAND"
    )


def render(result: Plan) -> Iterator[str]:
    yield f"mode: {result.mode.value}, {len(result.ranks)} ranks"
    yield f"{'rank':>4} {'gpu':>3}  {'pci':<12} {'gpu node':>8} {'cpu node':>8}  {'cpus':<20} memory"
    for r in result.ranks:
        memory = r.memory_policy.value + (f" {format_ids(r.memory_nodes)}" if r.memory_nodes else "")
        yield f"{r.rank:>4} {r.gpu:>3}  {r.gpu_address:<12} {r.gpu_node:>8} {r.cpu_node:>8}  {format_ids(r.cpus):<20} {memory}"
    if result.problems:
        yield "problems:"
        yield from (f"  - {problem}" for problem in result.problems)
