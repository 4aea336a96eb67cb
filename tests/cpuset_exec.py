#!/usr/bin/env python3
"""Run a command inside a fresh cgroup-v2 cpuset: the kernel's own way of forbidding
nodes and CPUs to a process (what a container or a Slurm job step sees).

Usage: python3 tests/cpuset_exec.py MEMS [--cpus CPUS] -- CMD ARGS...
MEMS and CPUS are kernel lists ("0", "0-1,3"). Needs root and cgroup2 at
/sys/fs/cgroup with the cpuset controller available (true in the test guests).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def enter_cpuset(mems: str, cpus: str | None) -> Path:
    """Create a child cgroup with these mems (and cpus) and move this process into it."""
    controllers = (CGROUP_ROOT / "cgroup.subtree_control").read_text().split()
    if "cpuset" not in controllers:
        (CGROUP_ROOT / "cgroup.subtree_control").write_text("+cpuset")
    group = CGROUP_ROOT / f"numafast-test-{os.getpid()}"
    group.mkdir()
    if cpus is not None:
        (group / "cpuset.cpus").write_text(cpus)
    (group / "cpuset.mems").write_text(mems)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def main(argv: list[str]) -> int:
    # Split at "--" by hand: argparse's REMAINDER would swallow options given after MEMS.
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.exit(__doc__)
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mems")
    parser.add_argument("--cpus")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    enter_cpuset(args.mems, args.cpus)
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
