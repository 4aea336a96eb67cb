"""``numafast run``: execute a command bound to nodes or CPUs, like numactl, without it.

CPU affinity and memory policy survive execve(2), so this process binds itself
and then becomes the command. ``--gpu I|auto`` binds as :func:`numafast.bind_rank`
plans for GPU I (``auto``: the launcher's local rank), so that
``torchrun --no-python ... numafast run --gpu auto -- python train.py`` runs
each rank next to its GPU.
"""

from __future__ import annotations

import argparse
import os

from numafast import binding
from numafast.affinity import AffinityMode, MemoryPolicy, bind_rank
from numafast.cli.arguments import count, cpu_list, node_list
from numafast.cli.show import add_topology_arguments, load_topology


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a command bound to NUMA nodes or CPUs (numactl without numactl)",
        description="Bind CPUs and memory policy, then exec COMMAND. Lists in numactl's syntax: 0-2,5; all; !1 (all allowed but 1); +0-1 (the first two allowed).",
    )
    cpus = parser.add_mutually_exclusive_group()
    cpus.add_argument("--cpunodebind", metavar="NODES", type=node_list, help="run on the allowed CPUs of these nodes")
    cpus.add_argument("--physcpubind", metavar="CPUS", type=cpu_list, help="run on these CPUs")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--membind", metavar="NODES", type=node_list, help="allocate only on these nodes (MPOL_BIND)")
    memory.add_argument("--preferred", metavar="NODE", type=int, help="allocate on NODE first (MPOL_PREFERRED)")
    memory.add_argument("--interleave", metavar="NODES", type=node_list, help="interleave pages over these nodes")
    memory.add_argument("--localalloc", action="store_true", help="allocate on the node of the touching CPU")
    gpu = parser.add_argument_group("binding for a GPU (instead of --cpunodebind/--physcpubind)")
    gpu.add_argument(
        "--gpu", metavar="I|auto",
        help="bind as planned for CUDA device I; auto: the local rank's (LOCAL_RANK, SLURM_LOCALID, ...)",
    )
    gpu.add_argument(
        "--mode", choices=[m.value for m in AffinityMode], help="with --gpu: how CPUs are chosen (default: node)"
    )
    gpu.add_argument(
        "--memory", choices=[p.value for p in MemoryPolicy],
        help="with --gpu: memory policy on the GPU's node (default: preferred; an explicit "
        "--membind/--preferred/--interleave/--localalloc replaces it)",
    )
    gpu.add_argument(
        "--nproc-per-node", type=count(1), metavar="N",
        help="with --gpu: ranks on this machine (default: with auto, LOCAL_WORLD_SIZE or the like; else one per GPU)",
    )
    add_topology_arguments(gpu)
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command and its arguments")
    parser.set_defaults(run=run)


def placements(args: argparse.Namespace) -> list[binding.Placement]:
    """The placements the options ask for, each validated (CPUs first, then memory)."""
    chosen: list[binding.Placement] = []
    if args.cpunodebind is not None:
        chosen.append(binding.cpubind(nodes=args.cpunodebind))
    if args.physcpubind is not None:
        chosen.append(binding.cpubind(cpus=args.physcpubind))
    if args.membind is not None:
        chosen.append(binding.membind(args.membind))
    if args.preferred is not None:
        chosen.append(binding.preferred(args.preferred))
    if args.interleave is not None:
        chosen.append(binding.interleave(args.interleave))
    if args.localalloc:
        chosen.append(binding.local_alloc())
    return chosen


GPU_ONLY_OPTIONS = ("mode", "memory", "nproc_per_node", "sysfs", "cuda_visible_devices")


def bind_for_gpu(args: argparse.Namespace) -> None:
    """--gpu: bind the CPUs (and, unless a memory option is given, the memory policy) per the plan."""
    for name in ("cpunodebind", "physcpubind"):
        if getattr(args, name) is not None:
            raise ValueError(f"--gpu chooses the CPUs itself; drop --{name} (or --gpu)")
    explicit_memory = args.localalloc or any(v is not None for v in (args.membind, args.preferred, args.interleave))
    if explicit_memory and args.memory is not None:
        raise ValueError(
            "--memory and an explicit --membind/--preferred/--interleave/--localalloc contradict; give one"
        )
    if args.gpu == "auto":
        local_rank = None
    elif args.gpu.isdecimal():
        local_rank = int(args.gpu)  # rank r drives CUDA device r, among all of them
    else:
        raise ValueError(f"--gpu {args.gpu!r} is neither a CUDA device index nor 'auto'")
    bind_rank(
        local_rank,
        mode=args.mode or AffinityMode.NODE,
        memory=MemoryPolicy.NONE if explicit_memory else args.memory or MemoryPolicy.PREFERRED,
        topology=load_topology(args),
        nproc_per_node=args.nproc_per_node,
    )


def run(args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise ValueError("no command given: numafast run [OPTIONS] -- COMMAND [ARGS...]")
    chosen = placements(args)  # validated before anything is bound
    if args.gpu is not None:
        bind_for_gpu(args)
    else:
        given = [name for name in GPU_ONLY_OPTIONS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies only with --gpu")
    for placement in chosen:
        placement.__enter__()  # never exited: the command inherits the placement
    try:
        os.execvp(command[0], command)
    except FileNotFoundError as error:
        raise ValueError(f"command not found: {command[0]}") from error
    return 127  # not reached: execvp returns only by raising
