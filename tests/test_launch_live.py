"""``bind_rank``, ``numafast run --gpu`` and ``numafast check --gpu`` on a real kernel.

The machines here have no GPUs, so each test copies this machine's own node and
CPU files into a snapshot and adds PCI entries of NVIDIA GPUs on chosen nodes:
the plan comes from that snapshot (nothing of the live environment leaks in:
Topology.from_sysfs reads only the snapshot), the binding is applied to this
kernel, and every assertion asks the kernel (/proc/PID/status, get_mempolicy,
the node of each page).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sysfs_truth import node_cpus, online_nodes, parse_list, task_status

TESTS = Path(__file__).resolve().parent
LAUNCHER_VARIABLES = (
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE",
    "KMP_AFFINITY", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip
ENV = {
    **{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES},
    "PYTHONPATH": f"{TESTS.parent}:{TESTS}",
}
# The live files a Topology is read from (numafast/topo/nodes.py, cpus.py).
SNAPSHOT_FILES = (
    "sys/devices/system/node/online",
    "sys/devices/system/node/possible",
    "sys/devices/system/node/node*/cpulist",
    "sys/devices/system/node/node*/meminfo",
    "sys/devices/system/node/node*/distance",
    "sys/devices/system/cpu/online",
    "sys/devices/system/cpu/cpu*/topology/physical_package_id",
    "sys/devices/system/cpu/cpu*/topology/thread_siblings_list",
    "sys/devices/system/cpu/cpu*/cache/index*/level",
    "sys/devices/system/cpu/cpu*/cache/index*/type",
    "sys/devices/system/cpu/cpu*/cache/index*/shared_cpu_list",
    "proc/meminfo",
)
# The child's view of itself, asked of the kernel: every thread's Cpus_allowed_list
# from /proc, its memory policy from get_mempolicy, and the nodes of fresh pages.
REPORT = """
import json, os, numpy as np
from sysfs_truth import page_nodes, thread_cpus_of_process, thread_policy
report = {"threads": {tid: cpus for tid, cpus in thread_cpus_of_process().items()}, "policy": thread_policy(),
          "pages": sorted(set(page_nodes(np.ones(1 << 16))))}
print(json.dumps(report))
"""


def snapshot_with_gpus(root: Path, gpu_nodes: list[int]) -> Path:
    """A copy of this machine's topology files under ``root`` with NVIDIA GPUs added:
    CUDA device i (PCI bus order) sits on node ``gpu_nodes[i]``."""
    for pattern in SNAPSHOT_FILES:
        for source in Path("/").glob(pattern):
            target = root / source.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    for index, node in enumerate(gpu_nodes):
        device = root / f"sys/bus/pci/devices/0000:{0x10 + index:02x}:00.0"
        device.mkdir(parents=True)
        for name, text in [("vendor", "0x10de"), ("class", "0x030200"), ("numa_node", str(node)),
                           ("local_cpulist", (root / f"sys/devices/system/node/node{node}/cpulist").read_text())]:
            (device / name).write_text(text.strip() + "\n")  # fmt: skip
    return root


def python(code: str, *prefix: str, **environment: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, optionally under a prefix command, with extra variables."""
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=TESTS.parent, env={**ENV, **environment}, timeout=600)  # fmt: skip


def numafast(*args: str) -> list[str]:
    return [sys.executable, "-m", "numafast", *args]


def report_of(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


# ---------------------------------------------------------------- on any machine (this host has one node)


def test_bind_rank_on_this_machine_warns_about_openmp_pinning(tmp_path: Path) -> None:
    root = snapshot_with_gpus(tmp_path, [online_nodes()[0]])
    code = f"""
import json, warnings, numafast
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    applied = numafast.bind_rank(topology=numafast.Topology.from_sysfs({str(root)!r}))
print(json.dumps([applied.gpu, [str(w.message) for w in caught]]))
""" + REPORT
    node = online_nodes()[0]
    output = python(code, LOCAL_RANK="0", OMP_PROC_BIND="close", KMP_AFFINITY="disabled").stdout.splitlines()
    gpu, messages = json.loads(output[0])
    assert gpu == 0
    assert len(messages) == 1 and messages[0].startswith("OMP_PROC_BIND=close is set: the OpenMP runtime")
    report = json.loads(output[1])
    assert set(map(tuple, report["threads"].values())) == {tuple(node_cpus(node))}
    assert report["policy"] == [1, [node]]  # MPOL_PREFERRED


def test_run_gpu_without_a_local_rank_names_every_variable(tmp_path: Path) -> None:
    root = snapshot_with_gpus(tmp_path, [online_nodes()[0]])
    result = subprocess.run(numafast("run", "--gpu", "auto", "--sysfs", str(root), "--", "true"),
                            capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
    assert result.returncode == 1
    assert "numafast run: no local rank given and none of LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK, " \
           "MPI_LOCALRANKID, PMI_LOCAL_RANK is set" in result.stderr  # fmt: skip


# ---------------------------------------------------------------- the 4-node guest (4 nodes x 1 CPU)

# CUDA devices 0-3 on nodes 2, 0, 3, 1: a rank's node is never its index.
GUEST_GPU_NODES = [2, 0, 3, 1]


@pytest.mark.numa(nodes=4)
@pytest.mark.parametrize(
    ("variables", "options", "node", "policy"),
    [
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "SLURM_LOCALID": "3"}, [], 2, [1, [2]]),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, ["--memory", "bind", "--mode", "exclusive"], 3, [2, [3]]),
        ({}, ["--gpu", "3", "--membind", "0"], 1, [2, [0]]),  # explicit memory replaces the plan's
    ],
    ids=["torchrun", "mpirun", "explicit"],
)
def test_run_gpu_execs_the_command_on_the_gpus_node(
    tmp_path: Path, variables: dict[str, str], options: list[str], node: int, policy: list
) -> None:
    root = snapshot_with_gpus(tmp_path, GUEST_GPU_NODES)
    gpu = [] if "--gpu" in options else ["--gpu", "auto"]
    report = report_of(python(REPORT, *numafast("run", *gpu, *options, "--sysfs", str(root), "--"), **variables))
    assert set(map(tuple, report["threads"].values())) == {tuple(node_cpus(node))}
    assert report["policy"] == policy
    assert report["pages"] == [policy[1][0]]


@pytest.mark.numa(nodes=4)
def test_run_gpu_respects_cuda_visible_devices(tmp_path: Path) -> None:
    root = snapshot_with_gpus(tmp_path, GUEST_GPU_NODES)
    # CUDA device 1 of CUDA_VISIBLE_DEVICES=2,0 is physical GPU 0, on node 2.
    report = report_of(python(REPORT, *numafast("run", "--gpu", "1", "--sysfs", str(root),
                                                "--cuda-visible-devices", "2,0", "--")))  # fmt: skip
    assert set(map(tuple, report["threads"].values())) == {tuple(node_cpus(2))}
    assert report["pages"] == [2]


BIND_RANK_WITH_THREADS = """
import threading, numafast
release = threading.Event()
workers = [threading.Thread(target=release.wait) for _ in range(3)]
for worker in workers:
    worker.start()
applied = numafast.bind_rank(memory="interleave", topology=numafast.Topology.from_sysfs({root!r}))
assert (applied.rank, applied.gpu, applied.cpu_node) == (1, 1, 0), applied
"""


@pytest.mark.numa(nodes=4)
def test_bind_rank_moves_every_thread_and_sets_the_policy(tmp_path: Path) -> None:
    root = snapshot_with_gpus(tmp_path, GUEST_GPU_NODES)
    code = BIND_RANK_WITH_THREADS.format(root=str(root)) + REPORT + "release.set()\n"
    report = report_of(python(code, SLURM_LOCALID="1"))
    assert len(report["threads"]) >= 4  # the main thread and the three waiting ones
    assert set(map(tuple, report["threads"].values())) == {tuple(node_cpus(0))}
    assert report["policy"] == [3, [0]]  # MPOL_INTERLEAVE over the rank's one node
    assert report["pages"] == [0]


@pytest.mark.numa(nodes=4)
def test_check_gpu_tells_a_well_placed_rank_from_a_misplaced_one(tmp_path: Path) -> None:
    root = snapshot_with_gpus(tmp_path, GUEST_GPU_NODES)
    hold = "import numpy, sys; a = numpy.ones(1 << 18); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        numafast("run", "--gpu", "2", "--sysfs", str(root), "--", sys.executable, "-c", hold),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        allowed = parse_list(task_status(pid=child.pid)["Cpus_allowed_list"])
        right, wrong = (
            subprocess.run(numafast("check", "--gpu", gpu, "--max-remote", "0", "--sysfs", str(root), str(child.pid)),
                           capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
            for gpu in ("2", "0")
        )
    finally:
        child.communicate("")
    assert allowed == node_cpus(3)
    assert right.returncode == 0, right.stdout + right.stderr
    assert right.stdout.startswith(f"pid {child.pid}: ok (GPU 2 on node 3;"), right.stdout
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert wrong.stdout.startswith(f"pid {child.pid}: wrong (GPU 0 on node 2;"), wrong.stdout
    assert "(nodes 3); GPU 0 is on node 2" in wrong.stdout
    assert "of anonymous memory (100%) on node 3; GPU 0 is on node 2" in wrong.stdout, wrong.stdout


@pytest.mark.numa(nodes=4)
def test_check_gpu_numbers_gpus_as_the_checked_process_does(tmp_path: Path) -> None:
    root = snapshot_with_gpus(tmp_path, GUEST_GPU_NODES)
    # The rank was started seeing only physical GPU 2 (node 3): its CUDA device 0. The
    # checker's shell sees physical GPU 1 (node 0) as CUDA device 0.
    # Rank and checker run as root without CAP_SYS_PTRACE: the checker may read the rank's
    # /proc files (same user, no more capabilities), not those of another user's process.
    without_ptrace = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"]
    hold = "import numpy, sys; a = numpy.ones(1 << 18); print('ready', flush=True); sys.stdin.read()"
    rank = subprocess.Popen(
        [*without_ptrace, *numafast("run", "--gpu", "2", "--sysfs", str(root), "--", sys.executable, "-c", hold)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**ENV, "CUDA_VISIBLE_DEVICES": "2"},
    )  # fmt: skip
    stranger = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "300"],
                                env={**ENV, "CUDA_VISIBLE_DEVICES": "3"})  # fmt: skip
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "ready\n"
        pids = [str(rank.pid), str(stranger.pid)]
        check = subprocess.run(
            [*without_ptrace, *numafast("check", "--gpu", "0", "--max-remote", "0", "--sysfs", str(root), *pids)],
            capture_output=True, text=True, env={**ENV, "CUDA_VISIBLE_DEVICES": "1"}, timeout=300,
        )  # fmt: skip
    finally:
        rank.communicate("")
        stranger.kill()
        stranger.wait()
    lines = check.stdout.splitlines()
    assert check.returncode == 1, check.stdout + check.stderr  # the stranger cannot be checked
    assert lines[0].startswith(f"pid {rank.pid}: ok (GPU 0 on node 3;"), check.stdout
    assert lines[1] == f"  GPUs numbered by its CUDA_VISIBLE_DEVICES=2 (/proc/{rank.pid}/environ)", check.stdout
    assert lines[2].startswith("  memory: anonymous node 3 "), check.stdout
    assert lines[3].startswith(f"pid {stranger.pid}: cannot check: "), check.stdout
    assert "Permission denied" in lines[3], check.stdout
    assert lines[4] == (
        f"  note: /proc/{stranger.pid}/environ is unreadable (Permission denied); "
        "GPUs numbered by this checker's own CUDA_VISIBLE_DEVICES=1"
    ), check.stdout


def test_snapshot_holds_this_machines_nodes(tmp_path: Path) -> None:
    """The snapshot the other tests plan on is this machine, GPUs added."""
    from numafast import Topology

    root = snapshot_with_gpus(tmp_path, [online_nodes()[-1]])
    replay = Topology.from_sysfs(root)
    assert list(replay.node_ids) == online_nodes()
    assert all(list(replay.node(n).cpus) == node_cpus(n) for n in online_nodes())
    assert [(g.index, g.node) for g in replay.gpus] == [(0, online_nodes()[-1])]
    assert parse_list((root / "sys/devices/system/cpu/online").read_text()) == sorted(c.id for c in replay.cpus)
