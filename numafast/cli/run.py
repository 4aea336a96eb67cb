"""``numafast run``: execute a command bound to nodes or CPUs, like numactl, without it.

CPU affinity and memory policy survive execve(2), so this process binds itself
and then becomes the command.
"""

from __future__ import annotations

import argparse
import os

from numafast import binding
from numafast._validate import parse_ids


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a command bound to NUMA nodes or CPUs (numactl without numactl)",
        description="Bind CPUs and memory policy, then exec COMMAND (lists as '0-2,5').",
    )
    cpus = parser.add_mutually_exclusive_group()
    cpus.add_argument("--cpunodebind", metavar="NODES", help="run on the allowed CPUs of these nodes")
    cpus.add_argument("--physcpubind", metavar="CPUS", help="run on these CPUs")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--membind", metavar="NODES", help="allocate only on these nodes (MPOL_BIND)")
    memory.add_argument("--preferred", metavar="NODE", type=int, help="allocate on NODE first (MPOL_PREFERRED)")
    memory.add_argument("--interleave", metavar="NODES", help="interleave pages over these nodes")
    memory.add_argument("--localalloc", action="store_true", help="allocate on the node of the touching CPU")
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command and its arguments")
    parser.set_defaults(run=run)


def placements(args: argparse.Namespace) -> list[binding.Placement]:
    """The placements the options ask for, each validated (CPUs first, then memory)."""
    chosen: list[binding.Placement] = []
    if args.cpunodebind is not None:
        chosen.append(binding.cpubind(nodes=parse_ids(args.cpunodebind)))
    if args.physcpubind is not None:
        chosen.append(binding.cpubind(cpus=parse_ids(args.physcpubind)))
    if args.membind is not None:
        chosen.append(binding.membind(parse_ids(args.membind)))
    if args.preferred is not None:
        chosen.append(binding.preferred(args.preferred))
    if args.interleave is not None:
        chosen.append(binding.interleave(parse_ids(args.interleave)))
    if args.localalloc:
        chosen.append(binding.local_alloc())
    return chosen


def run(args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise ValueError("no command given: numafast run [OPTIONS] -- COMMAND [ARGS...]")
    for placement in placements(args):
        placement.__enter__()  # never exited: the command inherits the placement
    try:
        os.execvp(command[0], command)
    except FileNotFoundError as error:
        raise ValueError(f"command not found: {command[0]}") from error
    return 127  # not reached: execvp returns only by raising
