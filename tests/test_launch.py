"""Which rank binds where (plan_rank, the plan bind_rank applies) and how bad input is
refused, on the fixture snapshots (tests/fixtures/make_fixtures.py describes them).
Expected CPU sets are worked out by hand as in tests/test_affinity.py; that
placement really happens is asserted by the kernel in tests/test_launch_live.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from numafast import (
    InvalidCpuSetError,
    InvalidGpuError,
    LocalRankError,
    Topology,
    bind_rank,
    get_policy,
    local_rank_from_environment,
    plan_rank,
)
from numafast.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DGX = Topology.from_sysfs(FIXTURES / "dgx-h100")  # GPUs 0-3 on node 0 (CPUs 0-7,16-23), 4-7 on node 1
pytestmark = pytest.mark.host_only("plans on snapshots; nothing kernel-specific")
LAUNCHER_VARIABLES = (
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE",
)  # fmt: skip


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts outside any launcher."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("variables", "rank"),
    [
        ({"LOCAL_RANK": "5"}, 5),
        ({"SLURM_LOCALID": "4"}, 4),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 3),
        ({"MPI_LOCALRANKID": "2"}, 2),
        ({"PMI_LOCAL_RANK": "1"}, 1),
        ({"SLURM_LOCALID": "0", "LOCAL_RANK": "6"}, 6),  # torchrun under srun: torchrun's rank wins
    ],
)
def test_local_rank_comes_from_the_innermost_launcher(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], rank: int
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    applied = plan_rank(topology=DGX)
    assert (applied.rank, applied.gpu) == (rank, rank)
    assert applied.cpus == ((*range(8), *range(16, 24)) if rank < 4 else (*range(8, 16), *range(24, 32)))
    assert applied.memory_nodes == ((0,) if rank < 4 else (1,))


def test_the_launchers_local_size_is_the_number_of_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exclusive mode splits node 0's 8 cores among the job's GPUs there: 4 GPUs by default.
    assert plan_rank(1, mode="exclusive", topology=DGX).cpus == (2, 3, 18, 19)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # GPUs 0-2: 3 + 3 + 2 cores
    assert plan_rank(mode="exclusive", topology=DGX).cpus == (3, 4, 5, 19, 20, 21)
    assert plan_rank(1, mode="exclusive", topology=DGX, nproc_per_node=2).cpus == (4, 5, 6, 7, 20, 21, 22, 23)
    # An explicit rank means CUDA device `rank` among all of them, whatever the launcher says.
    assert plan_rank(1, mode="exclusive", topology=DGX).cpus == (2, 3, 18, 19)
    assert local_rank_from_environment() == (1, "LOCAL_RANK", 3)


def test_cuda_visible_devices_renumbers_the_ranks_gpus() -> None:
    visible = Topology.from_sysfs(FIXTURES / "dgx-h100", cuda_visible_devices="6,1")
    applied = plan_rank(0, topology=visible, memory="bind")
    assert (applied.gpu, applied.gpu_address, applied.cpu_node) == (0, "0000:d1:00.0", 1)
    assert applied.memory_nodes == (1,) and applied.memory_policy.value == "bind"


def test_grace_hopper_rank_runs_on_the_nearest_cpu_node() -> None:
    applied = plan_rank(1, topology=Topology.from_sysfs(FIXTURES / "grace-hopper"))
    assert (applied.gpu_node, applied.cpu_node, applied.cpus, applied.memory_nodes) == (3, 1, (4, 5, 6, 7), (1,))


def test_gpu_with_unknown_node(tmp_path: Path) -> None:
    root = tmp_path / "dgx"
    shutil.copytree(FIXTURES / "dgx-h100", root)
    (root / "sys/bus/pci/devices/0000:9d:00.0/local_cpulist").write_text("0-31\n")  # and numa_node -1
    (root / "sys/bus/pci/devices/0000:9d:00.0/local_cpus").write_text("ffffffff\n")  # the same as a mask
    with pytest.raises(InvalidGpuError, match=r"CUDA device 4 \(0000:9d:00.0\) has no known NUMA node"):
        bind_rank(4, topology=Topology.from_sysfs(root))
    # One node: numa_node -1 means node 0.
    assert plan_rank(0, topology=Topology.from_sysfs(FIXTURES / "no-numa")).cpus == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("variables", "call", "error", "message"),
    [
        ({}, {}, LocalRankError, "no local rank given and none of LOCAL_RANK, SLURM_LOCALID, "
         "OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, PMI_LOCAL_RANK is set"),
        ({"SLURM_LOCALID": "one"}, {}, LocalRankError, "SLURM_LOCALID='one' is not an integer >= 0"),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, {}, LocalRankError, "LOCAL_WORLD_SIZE='0' is not an integer >= 1"),
        ({}, {"local_rank": -1}, LocalRankError, "local_rank must be an integer >= 0, not -1"),
        ({}, {"local_rank": True}, LocalRankError, "local_rank must be an integer >= 0, not True"),
        ({}, {"local_rank": 8}, InvalidGpuError, "local rank 8 has no GPU: the job's 8 ranks drive CUDA devices 0-7"),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, {}, InvalidGpuError,
         "LOCAL_RANK=2 has no GPU: the job's 2 ranks drive CUDA devices 0-1"),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "9"}, {}, InvalidGpuError,
         "LOCAL_WORLD_SIZE=9 ranks on this machine, but it has 8 CUDA devices (0-7)"),
        ({}, {"local_rank": 0, "mode": "numa"}, ValueError, "mode='numa' is not one of 'node', 'socket'"),
        ({}, {"local_rank": 0, "memory": "local"}, ValueError,
         "memory='local' is not one of 'preferred', 'bind', 'interleave', 'none'"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], call: dict, error: type[Exception], message: str
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    cpus_before, policy_before = os.sched_getaffinity(0), get_policy()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        bind_rank(**call, topology=DGX)
    assert os.sched_getaffinity(0) == cpus_before and get_policy() == policy_before


def test_a_plan_whose_cpus_this_machine_lacks_is_refused_and_nothing_changes() -> None:
    cpus_before, policy_before = os.sched_getaffinity(0), get_policy()
    big = Topology.from_sysfs(FIXTURES / "epyc-nps4")  # CPUs 0-31; this process may use fewer
    with pytest.raises(InvalidCpuSetError, match="not allowed; allowed CPUs"):
        bind_rank(3, mode="node", topology=big)
    assert os.sched_getaffinity(0) == cpus_before and get_policy() == policy_before


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--gpu", "0", "--cpunodebind", "0"], "--gpu chooses the CPUs itself; drop --cpunodebind"),
        (["--gpu", "0", "--memory", "bind", "--membind", "0"], "--memory and an explicit --membind"),
        (["--gpu", "first"], "--gpu 'first' is neither a CUDA device index nor 'auto'"),
        (["--mode", "exclusive"], "--mode applies only with --gpu"),
        (["--sysfs", "/", "--preferred", "0"], "--sysfs applies only with --gpu"),
        (["--gpu", "8"], "local rank 8 has no GPU"),
    ],
)
def test_run_gpu_refuses_conflicting_options(capsys: pytest.CaptureFixture[str], options: list[str], message: str) -> None:
    assert main(["run", *options, "--sysfs", str(FIXTURES / "dgx-h100"), "--", "true"]) == 1
    assert f"numafast run: {message}" in capsys.readouterr().err


def test_check_gpu_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--sysfs", str(FIXTURES / "dgx-h100"), str(os.getpid())]) == 1
    assert "numafast check: --sysfs and --cuda-visible-devices apply only with --gpu" in capsys.readouterr().err
    assert main(["check", "--gpu", "9", "--sysfs", str(FIXTURES / "dgx-h100"), str(os.getpid())]) == 1
    assert capsys.readouterr().out.splitlines()[0] == (
        f"pid {os.getpid()}: cannot check: no CUDA device 9 in this topology; CUDA devices: 0-7"
    )
    assert main(["check", "--gpu", "0", "--cuda-visible-devices", "0", str(os.getpid())]) == 1
    assert "--cuda-visible-devices applies to a --sysfs snapshot" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["check", "--gpu", "0", "--node", "0", str(os.getpid())])
    assert "not allowed with argument" in capsys.readouterr().err
