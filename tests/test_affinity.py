"""GPU affinity plans on the fixture machines (tests/fixtures/make_fixtures.py describes
them). Every expected CPU set is worked out by hand from the modes' documented
semantics (PyTorch's torch/numa/binding.py, NVIDIA gpu_affinity's set_affinity)."""

from __future__ import annotations

import json
import re
import shutil
from functools import cache
from pathlib import Path

import pytest

import numafast
from numafast import InvalidGpuError, PlacementError, Topology, cpus_for_gpu, plan
from numafast.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"
pytestmark = pytest.mark.host_only("plans on snapshots; nothing kernel-specific")


@cache
def replay(name: str) -> Topology:
    return Topology.from_sysfs(FIXTURES / name)


def dgx() -> Topology:
    """Nodes 0: CPUs 0-7,16-23 and 1: 8-15,24-31 (core n = CPUs n, n+16); GPUs 0-3 on node 0."""
    return replay("dgx-h100")


def epyc() -> Topology:
    """NPS4: node n holds cores 4n..4n+3 (+16 for SMT), two L3 groups each; GPUs 0,1 on node 0, 2 on 2, 3 on 3."""
    return replay("epyc-nps4")


def grace() -> Topology:
    """Grace CPUs 0-3 (node 0), 4-7 (node 1); GPU 0's memory node 2, GPU 1's node 3."""
    return replay("grace-hopper")


def gb200() -> Topology:
    """Graces: node 0 CPUs 0-3, node 1 CPUs 4-7; GPUs 0-1 on node 0 (memory nodes 2, 10),
    GPUs 2-3 on node 1 (memory nodes 18, 26); the GPU PCI numa_node is the Grace's."""
    return replay("gb200")


def with_status(tmp_path: Path, name: str, cpus: str, mems: str) -> Topology:
    """A fixture machine whose process is restricted to these CPUs and nodes."""
    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root)
    (root / "proc/self/status").write_text(f"Cpus_allowed_list:\t{cpus}\nMems_allowed_list:\t{mems}\n")
    return Topology.from_sysfs(root)


# ---------------------------------------------------------------- PyTorch's modes


def test_node_mode_gives_every_allowed_cpu_of_the_gpus_node() -> None:
    assert cpus_for_gpu(0, topology=dgx()) == [*range(8), *range(16, 24)]
    assert cpus_for_gpu(5, mode="node", topology=dgx()) == [*range(8, 16), *range(24, 32)]
    assert cpus_for_gpu(5, mode="node", topology=dgx(), smt="one") == list(range(8, 16))


def test_socket_mode_spans_every_node_of_the_package() -> None:
    assert cpus_for_gpu(2, mode="socket", topology=epyc()) == list(range(32))  # NPS4: 4 nodes, 1 socket
    assert cpus_for_gpu(6, mode="socket", topology=dgx()) == [*range(8, 16), *range(24, 32)]


def test_exclusive_splits_the_nodes_cores_among_its_gpus() -> None:
    assert cpus_for_gpu(0, mode="exclusive", topology=dgx()) == [0, 1, 16, 17]
    assert cpus_for_gpu(6, mode="exclusive", topology=dgx()) == [12, 13, 28, 29]  # third GPU of node 1
    assert cpus_for_gpu(6, mode="exclusive", topology=dgx(), smt="one") == [12, 13]


def test_exclusive_gives_lower_gpus_the_extra_cores_when_uneven() -> None:
    # 3 GPUs on node 0's 8 cores: 3 + 3 + 2
    assert cpus_for_gpu(0, mode="exclusive", topology=dgx(), nproc_per_node=3) == [0, 1, 2, 16, 17, 18]
    assert cpus_for_gpu(1, mode="exclusive", topology=dgx(), nproc_per_node=3) == [3, 4, 5, 19, 20, 21]
    assert cpus_for_gpu(2, mode="exclusive", topology=dgx(), nproc_per_node=3) == [6, 7, 22, 23]


def test_exclusive_fails_when_a_gpu_would_get_no_core(tmp_path: Path) -> None:
    restricted = with_status(tmp_path, "dgx-h100", "0,16,8-15,24-31", "0-1")  # node 0: one core
    with pytest.raises(PlacementError, match=r"node 0 has 1 allowed physical cores for 4 GPUs"):
        cpus_for_gpu(1, mode="exclusive", topology=restricted)
    assert cpus_for_gpu(4, mode="exclusive", topology=restricted) == [8, 9, 24, 25]


def test_core_complex_gives_each_gpu_its_own_l3_group() -> None:
    assert cpus_for_gpu(0, mode="core-complex", topology=epyc()) == [0, 1, 16, 17]
    assert cpus_for_gpu(1, mode="core-complex", topology=epyc()) == [2, 3, 18, 19]
    assert cpus_for_gpu(2, mode="core-complex", topology=epyc()) == [8, 9, 24, 25]
    assert cpus_for_gpu(3, mode="core-complex", topology=epyc()) == [12, 13, 28, 29]


def test_core_complex_prefers_groups_with_more_allowed_cpus(tmp_path: Path) -> None:
    restricted = with_status(tmp_path, "epyc-nps4", "1-31", "0-3")  # CCX {0,1,16,17} loses CPU 0
    assert cpus_for_gpu(0, mode="core-complex", topology=restricted) == [2, 3, 18, 19]
    assert cpus_for_gpu(1, mode="core-complex", topology=restricted) == [1, 16, 17]


def test_core_complex_wraps_when_gpus_outnumber_groups() -> None:
    # one L3 per socket on the DGX: all four GPUs of node 0 get that one group
    assert cpus_for_gpu(3, mode="core-complex", topology=dgx()) == [*range(8), *range(16, 24)]


# ---------------------------------------------------------------- NVIDIA gpu_affinity's modes


def test_all_mode_with_max_and_min_cores() -> None:
    assert cpus_for_gpu(0, mode="all", topology=dgx()) == [*range(8), *range(16, 24)]
    assert cpus_for_gpu(0, mode="all", topology=dgx(), max_cores=3) == [0, 1, 2, 16, 17, 18]
    with pytest.raises(PlacementError, match="8 physical cores .* fewer than min_cores=9"):
        cpus_for_gpu(0, mode="all", topology=dgx(), min_cores=9)


def test_single_and_single_unique() -> None:
    assert cpus_for_gpu(3, mode="single", topology=dgx()) == [0, 16]
    assert cpus_for_gpu(3, mode="single", topology=dgx(), smt="one") == [0]
    assert cpus_for_gpu(3, mode="single-unique", topology=dgx()) == [3, 19]
    assert cpus_for_gpu(7, mode="single-unique", topology=dgx()) == [11, 27]


def test_unique_contiguous_and_interleaved_on_the_dgx() -> None:
    assert cpus_for_gpu(1, mode="unique-contiguous", topology=dgx()) == [2, 3, 18, 19]
    assert cpus_for_gpu(1, mode="unique-interleaved", topology=dgx()) == [1, 5, 17, 21]
    assert cpus_for_gpu(0, mode="unique-contiguous", topology=dgx(), smt="one") == [0, 1]


def test_balanced_gives_every_gpu_the_smallest_share() -> None:
    # node 0: 4 cores for 2 GPUs (2 each); nodes 2 and 3: 4 cores for 1 GPU
    assert cpus_for_gpu(2, mode="unique-contiguous", topology=epyc()) == [8, 9, 24, 25]
    assert cpus_for_gpu(2, mode="unique-contiguous", topology=epyc(), balanced=False) == [8, 9, 10, 11, 24, 25, 26, 27]
    assert cpus_for_gpu(0, mode="unique-interleaved", topology=epyc()) == [0, 2, 16, 18]
    assert cpus_for_gpu(1, mode="unique-interleaved", topology=epyc()) == [1, 3, 17, 19]


# ---------------------------------------------------------------- allowed CPUs, odd GPU nodes


def test_only_allowed_cpus_are_returned() -> None:
    container = Topology.from_sysfs(FIXTURES / "container-cgroup2")  # cpuset 4-5,12-13
    assert cpus_for_gpu(0, topology=container) == [4, 5, 12, 13]
    assert cpus_for_gpu(0, mode="exclusive", topology=container) == [4, 5, 12, 13]


def test_gpu_whose_node_is_wholly_forbidden_is_an_error() -> None:
    container = Topology.from_sysfs(FIXTURES / "container-cgroup1")  # cpuset 0-1,8-9; GPU on node 1
    with pytest.raises(PlacementError, match=r"no allowed CPU for GPU 0 \(node 1.*allowed CPUs: 0-1,8-9"):
        cpus_for_gpu(0, topology=container)


def test_grace_hopper_gpu_uses_the_nearest_cpu_node() -> None:
    assert cpus_for_gpu(0, topology=grace()) == [0, 1, 2, 3]
    assert cpus_for_gpu(1, topology=grace()) == [4, 5, 6, 7]
    assert cpus_for_gpu(1, mode="exclusive", topology=grace()) == [4, 5, 6, 7]


def test_grace_blackwell_gpus_run_on_their_own_grace() -> None:
    assert [cpus_for_gpu(gpu, topology=gb200()) for gpu in range(4)] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert [cpus_for_gpu(gpu, mode="exclusive", topology=gb200()) for gpu in range(4)] == [
        [0, 1], [2, 3], [4, 5], [6, 7],
    ]  # fmt: skip
    assert cpus_for_gpu(2, mode="socket", topology=gb200()) == [4, 5, 6, 7]  # one Grace, one package
    assert cpus_for_gpu(0, topology=replay("gh200")) == [0, 1, 2, 3]


def test_grace_blackwell_full_size_exclusive_splits_each_grace_between_its_two_gpus(tmp_path: Path) -> None:
    from fixtures.make_fixtures import Machine
    from fixtures.make_fixtures import gb200 as make_gb200

    make_gb200(Machine(tmp_path), cores=72)
    tray = Topology.from_sysfs(tmp_path)
    result = plan(mode="exclusive", topology=tray)
    assert [r.cpus for r in result.ranks] == [
        tuple(range(0, 36)), tuple(range(36, 72)), tuple(range(72, 108)), tuple(range(108, 144)),
    ]  # fmt: skip
    assert [r.memory_nodes for r in result.ranks] == [(0,), (0,), (1,), (1,)] and result.problems == ()


def test_gpu_with_unknown_node(tmp_path: Path) -> None:
    root = tmp_path / "dgx"
    shutil.copytree(FIXTURES / "dgx-h100", root)
    (root / "sys/bus/pci/devices/0000:9d:00.0/local_cpulist").write_text("0-31\n")  # and numa_node -1
    (root / "sys/bus/pci/devices/0000:9d:00.0/local_cpus").write_text("ffffffff\n")  # the same as a mask
    unknown = Topology.from_sysfs(root)
    with pytest.raises(InvalidGpuError, match=r"CUDA device 4 \(0000:9d:00.0\) has no known NUMA node"):
        cpus_for_gpu(4, topology=unknown)
    # the other GPUs still plan; node 1's cores are split among GPUs 5-7 only: 3 + 3 + 2
    assert cpus_for_gpu(5, mode="exclusive", topology=unknown) == [8, 9, 10, 24, 25, 26]
    with pytest.raises(InvalidGpuError, match="CUDA device 4"):
        plan(topology=unknown)
    # one node: the GPU's numa_node -1 means node 0
    assert cpus_for_gpu(0, topology=Topology.from_sysfs(FIXTURES / "no-numa")) == [0, 1, 2, 3]


def test_bad_arguments_name_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="mode='bogus' is not one of 'node', 'socket'"):
        cpus_for_gpu(0, mode="bogus", topology=dgx())
    with pytest.raises(ValueError, match="smt='two'"):
        cpus_for_gpu(0, smt="two", topology=dgx())
    with pytest.raises(InvalidGpuError, match="GPU 8 is not one of the job's CUDA devices 0-7"):
        cpus_for_gpu(8, topology=dgx())
    with pytest.raises(InvalidGpuError, match="GPU 3 is not one of the job's CUDA devices 0-1"):
        cpus_for_gpu(3, topology=dgx(), nproc_per_node=2)
    with pytest.raises(InvalidGpuError, match="nproc_per_node=9 but this topology has 8 CUDA devices"):
        cpus_for_gpu(0, topology=dgx(), nproc_per_node=9)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"mode": "all", "min_cores": 5, "max_cores": 2}, "min_cores=5 exceeds max_cores=2: no rank can get at least 5"),
        ({"mode": "node", "max_cores": 2}, "max_cores=2 does nothing in mode node (PyTorch's modes"),
        ({"mode": "exclusive", "min_cores": 2}, "min_cores=2 does nothing in mode exclusive"),
        ({"mode": "single", "max_cores": 4}, "max_cores=4 does nothing in mode single: it gives each rank one core"),
    ],
)
def test_core_counts_that_contradict_or_that_the_mode_ignores_are_refused(knobs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        cpus_for_gpu(0, topology=dgx(), **knobs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(topology=dgx(), **knobs)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["tests/fixtures/dgx-h100", 5])
def test_a_topology_that_is_no_topology_is_refused_naming_the_type(given: object) -> None:
    message = rf"topology must be a numafast.Topology .* or None for this machine's, not {re.escape(repr(given))}"
    for call in (cpus_for_gpu, numafast.plan_rank, numafast.bind_rank):
        with pytest.raises(TypeError, match=message):
            call(0, topology=given)  # type: ignore[operator]
    with pytest.raises(TypeError, match=message):
        plan(topology=given)  # type: ignore[arg-type]


# ---------------------------------------------------------------- plan()


def test_exclusive_plan_of_the_dgx_is_clean() -> None:
    result = plan(8, mode="exclusive", topology=dgx())
    assert [r.gpu for r in result.ranks] == list(range(8))
    assert result.ranks[6].cpus == (12, 13, 28, 29)
    assert result.ranks[6].gpu_address == "0000:d1:00.0"
    assert [r.memory_nodes for r in result.ranks] == [(0,)] * 4 + [(1,)] * 4
    assert result.problems == ()


def test_node_plan_flags_shared_cpus_and_oversubscription() -> None:
    result = plan(mode="node", topology=dgx(), dataloader_workers=2)
    assert "ranks 0-3 share CPUs 0-7,16-23" in result.problems
    assert "ranks 4-7 share CPUs 8-15,24-31" in result.problems
    # 4 ranks x (1 + 2 workers) = 12 processes on 8 cores
    assert any(p.startswith("node 0 is oversubscribed: 12 processes") and "8 allowed physical cores" in p
               for p in result.problems)  # fmt: skip
    assert plan(mode="node", topology=dgx(), dataloader_workers=1).problems == (
        "ranks 0-3 share CPUs 0-7,16-23",
        "ranks 4-7 share CPUs 8-15,24-31",
    )


def test_plan_memory_policies_and_grace_hopper_nodes() -> None:
    grace_plan = plan(mode="node", topology=grace())
    assert [(r.gpu_node, r.cpu_node, r.memory_nodes) for r in grace_plan.ranks] == [(2, 0, (0,)), (3, 1, (1,))]
    socket = plan(1, mode="socket", topology=epyc(), memory="bind")
    assert socket.ranks[0].memory_nodes == (0, 1, 2, 3)
    assert plan(1, topology=epyc(), memory="none").ranks[0].memory_nodes == ()


def test_grace_blackwell_plans_put_each_rank_and_its_memory_on_its_grace() -> None:
    result = plan(mode="exclusive", topology=gb200())
    assert [(r.gpu, r.gpu_address, r.gpu_node, r.cpu_node, r.memory_nodes) for r in result.ranks] == [
        (0, "0008:01:00.0", 0, 0, (0,)), (1, "0009:01:00.0", 0, 0, (0,)),
        (2, "0018:01:00.0", 1, 1, (1,)), (3, "0019:01:00.0", 1, 1, (1,)),
    ]  # fmt: skip
    assert result.problems == ()
    for memory in ("bind", "interleave"):  # the CPUs' nodes: never a GPU's HBM node
        assert [r.memory_nodes for r in plan(mode="node", topology=gb200(), memory=memory).ranks] == [
            (0,), (0,), (1,), (1,),
        ]  # fmt: skip
    node_plan = plan(mode="node", topology=gb200())
    assert node_plan.problems == ("ranks 0-1 share CPUs 0-3", "ranks 2-3 share CPUs 4-7")
    gh200_plan = plan(topology=replay("gh200"))
    assert [(r.gpu_node, r.cpu_node, r.cpus, r.memory_nodes) for r in gh200_plan.ranks] == [(0, 0, (0, 1, 2, 3), (0,))]


def test_plan_cli_on_a_grace_blackwell_snapshot(capsys: pytest.CaptureFixture[str]) -> None:
    root = str(FIXTURES / "gb200")
    assert main(["plan", "--sysfs", root, "--mode", "exclusive", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == plan(mode="exclusive", topology=gb200()).to_dict()
    assert main(["plan", "--sysfs", root, "--mode", "exclusive", "--cuda-visible-devices", "2,3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("   ")]
    assert rows == [
        ["0", "0", "0018:01:00.0", "1", "1", "4-5", "preferred", "1"],
        ["1", "1", "0019:01:00.0", "1", "1", "6-7", "preferred", "1"],
    ]


def test_plan_flags_a_memory_node_the_cpuset_forbids(tmp_path: Path) -> None:
    restricted = with_status(tmp_path, "xeon-2s-smt", "0-15", "0")
    result = plan(topology=restricted)
    assert result.ranks[0].memory_nodes == (1,)
    assert result.problems == ("rank 0: memory node 1 is not allowed by the cpuset (allowed nodes: 0)",)


def test_plan_cli_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    root = str(FIXTURES / "dgx-h100")
    assert main(["plan", "--sysfs", root, "--nproc-per-node", "8", "--mode", "exclusive", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == plan(8, mode="exclusive", topology=dgx()).to_dict()
    assert main(["plan", "--sysfs", root, "--mode", "node", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "   6   6  0000:d1:00.0        1        1  8-15,24-31" in out
    assert "node 1 is oversubscribed" in out
    assert main(["plan", "--sysfs", root, "--nproc-per-node", "9"]) == 1
    assert "nproc_per_node=9 but this topology has 8 CUDA devices" in capsys.readouterr().err
