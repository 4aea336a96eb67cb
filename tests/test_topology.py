"""Topology read from snapshot trees of real machine shapes (tests/fixtures/, described in
tests/fixtures/make_fixtures.py). Every expected value is worked out by hand from those
descriptions, not computed by numafast."""

from __future__ import annotations

import ast
import filecmp
import json
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

import pytest

import numafast
from numafast import InvalidGpuError, InvalidNodeError, Topology, TopologyWarning
from numafast.cli import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GIB = 1 << 30

# Snapshot replays depend on no kernel: they run on the host. Under the guests' TCG and
# 9p root each of their hundreds of small file reads is slow, so the guests skip them.
pytestmark = pytest.mark.host_only("snapshot replays; nothing kernel-specific")


def load(name: str | Path, **kwargs: object) -> Topology:
    """A fixture by name, or any snapshot tree by its path."""
    return Topology.from_sysfs(FIXTURES / name, **kwargs)  # type: ignore[arg-type]


def load_quietly(name: str | Path, **kwargs: object) -> tuple[Topology, list[str]]:
    """The topology and the TopologyWarning messages its reading gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        topology = load(name, **kwargs)
    return topology, [str(w.message) for w in caught if issubclass(w.category, TopologyWarning)]


def test_committed_trees_are_what_the_generator_writes(tmp_path: Path) -> None:
    from fixtures.make_fixtures import MACHINES, make_all

    make_all(tmp_path)
    for name in MACHINES:
        pending = [filecmp.dircmp(FIXTURES / name, tmp_path / name)]
        while pending:
            cmp = pending.pop()
            assert not cmp.left_only and not cmp.right_only, (name, cmp.left_only, cmp.right_only)
            _, mismatch, errors = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files, shallow=False)
            assert not mismatch and not errors, (name, cmp.left, mismatch, errors)
            pending.extend(cmp.subdirs.values())


# ---------------------------------------------------------------- schema (2-socket Xeon with SMT)


def test_to_dict_has_exactly_the_documented_schema() -> None:
    data = load("xeon-2s-smt").to_dict()
    assert list(data) == ["nodes", "cpus", "pci", "gpus", "allowed_cpus", "allowed_nodes"]
    assert data["nodes"][0] == {
        "id": 0,
        "cpus": [0, 1, 2, 3, 8, 9, 10, 11],
        "mem_total": 64 * GIB,
        "mem_free": 32 * GIB,
        "distances": {"0": 10, "1": 21},
    }
    assert data["nodes"][1]["mem_free"] == 16 * GIB
    assert data["cpus"][9] == {
        "id": 9, "node": 0, "package": 0, "core": 1, "siblings": [1, 9], "llc": [0, 1, 2, 3, 8, 9, 10, 11],
    }  # fmt: skip
    assert data["cpus"][12] == {
        "id": 12, "node": 1, "package": 1, "core": 4, "siblings": [4, 12], "llc": [4, 5, 6, 7, 12, 13, 14, 15],
    }  # fmt: skip
    assert [c["id"] for c in data["cpus"]] == list(range(16))
    assert data["pci"] == [
        {"address": "0000:00:00.0", "vendor": "0x8086", "class": "0x060000", "numa_node": 0, "node": 0, "gpu": False},
        {"address": "0000:18:00.0", "vendor": "0x8086", "class": "0x020000", "numa_node": 0, "node": 0, "gpu": False},
        {"address": "0000:af:00.0", "vendor": "0x10de", "class": "0x030200", "numa_node": 1, "node": 1, "gpu": True},
    ]
    assert data["gpus"] == [{"index": 0, "address": "0000:af:00.0", "node": 1, "memory_node": None, "uuid": None}]
    assert data["allowed_cpus"] == list(range(16))
    assert data["allowed_nodes"] == [0, 1]
    assert json.loads(load("xeon-2s-smt").to_json()) == data


def test_lookups_on_the_xeon() -> None:
    topology = load("xeon-2s-smt")
    assert topology.node_of_cpu(12) == 1
    assert topology.node_of_cpu(3) == 0
    assert topology.node_of_gpu(0) == 1
    assert topology.distance(0, 1) == 21
    assert topology.distance(1, 1) == 10
    assert topology.nearest_cpu_node(1) == 1
    with pytest.raises(InvalidNodeError, match="nodes here: 0-1"):
        topology.distance(0, 2)
    with pytest.raises(InvalidGpuError, match="CUDA devices: 0"):
        topology.gpu(1)
    with pytest.raises(numafast.InvalidCpuSetError, match="online: 0-15"):
        topology.node_of_cpu(16)


def test_objects_are_immutable() -> None:
    topology = load("xeon-2s-smt")
    with pytest.raises(AttributeError):
        topology.nodes[0].id = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        topology.nodes[0].distances[1] = 5  # type: ignore[index]
    with pytest.raises(AttributeError):
        topology.allowed_cpus = ()  # type: ignore[misc]


# ---------------------------------------------------------------- DGX-like: 8 GPUs, NICs, CUDA order

DGX_ORDER = ["0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0",
             "0000:9d:00.0", "0000:c3:00.0", "0000:d1:00.0", "0000:df:00.0"]  # fmt: skip


def dgx_uuid(physical: int) -> str:
    return f"GPU-{physical:08x}-1111-2222-3333-44445555{physical:04x}"


def test_dgx_gpus_in_pci_bus_order_four_per_socket() -> None:
    topology = load("dgx-h100")
    assert [g.address for g in topology.gpus] == DGX_ORDER
    assert [g.index for g in topology.gpus] == list(range(8))
    assert [g.node for g in topology.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.uuid for g in topology.gpus] == [dgx_uuid(i) for i in range(8)]
    assert topology.node(0).cpus == (*range(8), *range(16, 24))
    assert topology.cpu(20).siblings == (4, 20)


def test_dgx_pci_numa_node_minus_one_resolved_from_local_cpulist() -> None:
    device = next(d for d in load("dgx-h100").pci if d.address == "0000:9d:00.0")
    assert device.numa_node is None  # as the kernel says: -1
    assert device.node == 1  # local_cpulist 8-15,24-31 lies in node 1


def test_dgx_nvswitches_and_bmc_vga_are_not_gpus_and_nics_are_found() -> None:
    topology = load("dgx-h100")
    by_address = {d.address: d for d in topology.pci}
    assert not by_address["0000:05:00.0"].is_gpu  # NVSwitch: NVIDIA, bridge class
    assert not by_address["0000:03:00.0"].is_gpu  # ASPEED VGA: display class, not NVIDIA/AMD
    nics = [d.address for d in topology.pci if d.is_nic]
    assert nics == ["0000:18:00.0", "0000:40:00.0", "0000:4f:00.0", "0000:5e:00.0",
                    "0000:9a:00.0", "0000:aa:00.0", "0000:c0:00.0", "0000:ce:00.0", "0000:dc:00.0"]  # fmt: skip


@pytest.mark.parametrize(
    ("visible", "physical"),
    [
        ("4,0", [4, 0]),
        ("7,6,5", [7, 6, 5]),
        (" 3 , 1 ", [3, 1]),
        ("2,9,1", [2]),  # CUDA stops at the first entry naming no device
        ("-1", []),
        ("", []),
        ("GPU-00000005", [5]),  # a unique prefix is enough
        (f"{dgx_uuid(6).upper()},1", [6, 1]),
        ("MIG-GPU-00000003-1111-2222-3333-444455550003/1/0", [3]),  # old MIG form names its GPU
    ],
)
def test_cuda_visible_devices_reorders_and_filters(visible: str, physical: list[int]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TopologyWarning)
        topology = load("dgx-h100", cuda_visible_devices=visible)
    assert [g.address for g in topology.gpus] == [DGX_ORDER[p] for p in physical]
    assert [g.index for g in topology.gpus] == list(range(len(physical)))
    assert [g.node for g in topology.gpus] == [p // 4 for p in physical]


@pytest.mark.parametrize(
    ("visible", "message", "kept"),
    [
        ("2,9,1", r"entry '9' \(position 1\) names no GPU: this machine has 8", 1),
        ("GPU-0000000", "matches 8 GPUs", 0),
        ("0,MIG-3f2e9c1a-0000-1111-2222-333344445555", "matches none of the GPUs here", 1),
        ("1,1", "repeats a device", 1),
        ("0,banana", "is not a device", 1),
        ("--1", r"entry '--1' \(position 0\) is not a device", 0),  # CUDA stops at an entry it cannot read
    ],
)
def test_unusable_cuda_visible_devices_entries_say_why(visible: str, message: str, kept: int) -> None:
    with pytest.warns(TopologyWarning, match=message):
        topology = load("dgx-h100", cuda_visible_devices=visible)
    assert len(topology.gpus) == kept


def test_uuid_without_any_known_uuid_says_it_cannot_be_matched() -> None:
    with pytest.warns(TopologyWarning) as record:
        topology = load("xeon-2s-smt", cuda_visible_devices="GPU-5a8ff1d1")
    message = str(record[0].message)
    assert "'GPU-5a8ff1d1'" in message and "no GPU UUID is known" in message
    assert "proc/driver/nvidia/gpus" in message and "not asked about a snapshot" in message
    assert topology.gpus == ()


def test_asking_gpu_libraries_that_know_no_gpu_says_so() -> None:
    # Neither nvidia-ml-py nor torch.cuda can see a GPU on a machine without one.
    with pytest.warns(TopologyWarning, match=r"NVML \(nvidia-ml-py\) and torch.cuda named none"):
        topology = load("xeon-2s-smt", cuda_visible_devices="GPU-5a8ff1d1", ask_gpu_libraries=True)
    assert topology.gpus == ()


def test_snapshot_never_sees_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    topology = load("dgx-h100")
    assert len(topology.gpus) == 8  # the environment is not the snapshot's
    assert topology.allowed_cpus == tuple(range(32))  # nor is this host's affinity


# ---------------------------------------------------------------- EPYC NPS4: several L3 groups per node


def test_epyc_nps4_nodes_distances_and_l3_groups() -> None:
    topology = load("epyc-nps4")
    assert topology.node_ids == (0, 1, 2, 3)
    assert topology.node(1).cpus == (4, 5, 6, 7, 20, 21, 22, 23)
    assert [topology.distance(0, n) for n in range(4)] == [10, 11, 12, 12]
    assert topology.distance(3, 2) == 11
    assert topology.cpu(0).llc == (0, 1, 16, 17)
    assert topology.cpu(17).llc == (0, 1, 16, 17)
    assert topology.cpu(3).llc == (2, 3, 18, 19)
    assert topology.cpu(30).llc == (14, 15, 30, 31)
    assert topology.cpu(30).core == 14 and topology.cpu(30).package == 0


def test_epyc_onboard_amd_vga_is_a_gpu_but_not_a_cuda_device() -> None:
    topology = load("epyc-nps4")
    vga = next(d for d in topology.pci if d.address == "0000:e1:00.0")
    assert vga.is_gpu
    assert [g.address for g in topology.gpus] == ["0000:01:00.0", "0000:02:00.0", "0000:81:00.0", "0000:c1:00.0"]
    assert [g.node for g in topology.gpus] == [0, 0, 2, 3]


# ---------------------------------------------------------------- Grace-Hopper: CPU-less GPU memory nodes


def test_grace_hopper_cpuless_nodes_and_nearest_cpu_node() -> None:
    topology = load("grace-hopper")
    assert [n.cpus for n in topology.nodes] == [(0, 1, 2, 3), (4, 5, 6, 7), (), (), ()]
    assert topology.node(2).mem_total == 96 * GIB and topology.node(2).mem_free == 95 * GIB
    assert topology.node(4).mem_total == 0
    assert topology.nearest_cpu_node(2) == 0  # 80 to node 0, 120 to node 1
    assert topology.nearest_cpu_node(3) == 1  # 120 to node 0, 80 to node 1
    assert topology.nearest_cpu_node(4) == 0  # 120 to both: the lower id
    assert topology.nearest_cpu_node(1) == 1
    assert [g.node for g in topology.gpus] == [2, 3]
    assert topology.allowed_nodes == (0, 1, 2, 3)


# ---------------------------------------------------------------- Grace (aarch64): GH200, GB200
# Modeled on public numactl dumps (the sources are named in make_fixtures.py's gh200 and gb200).

GB200_MEMORY_NODES = [2, 10, 18, 26]


def test_gh200_grace_node_hbm_node_and_empty_mig_nodes() -> None:
    topology, messages = load_quietly("gh200")
    assert messages == []  # an arm64 tree reads without a complaint
    assert topology.node_ids == tuple(range(9))
    assert [n.id for n in topology.cpu_nodes] == [0] and topology.node(0).cpus == (0, 1, 2, 3)
    assert (topology.node(0).mem_total, topology.node(0).mem_free) == (490037 << 20, 484432 << 20)
    assert (topology.node(1).mem_total, topology.node(1).mem_free) == (97280 << 20, 97279 << 20)
    assert all(topology.node(n).cpus == () and topology.node(n).mem_total == 0 for n in range(2, 9))
    assert [topology.distance(0, n) for n in range(9)] == [10] + [80] * 8
    assert topology.distance(1, 2) == 255 and topology.distance(8, 1) == 255 and topology.distance(5, 0) == 80
    assert [topology.nearest_cpu_node(n) for n in range(9)] == [0] * 9
    assert [(g.index, g.address, g.node, g.memory_node) for g in topology.gpus] == [(0, "0009:01:00.0", 0, 1)]
    assert topology.pci[0].numa_node == 0
    assert topology.allowed_cpus == (0, 1, 2, 3) and topology.allowed_nodes == (0, 1)


def test_gh200_arm64_cpus_one_core_each_one_l3_per_grace() -> None:
    topology = load("gh200")
    assert [(c.id, c.node, c.package, c.core, c.siblings, c.llc) for c in topology.cpus] == [
        (cpu, 0, 0, cpu, (cpu,), (0, 1, 2, 3)) for cpu in range(4)
    ]


def test_gb200_two_graces_four_gpu_memory_nodes_and_their_mig_nodes() -> None:
    topology, messages = load_quietly("gb200")
    assert messages == []
    assert topology.node_ids == tuple(range(34))
    assert [(n.id, n.cpus) for n in topology.cpu_nodes] == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    assert (topology.node(0).mem_total, topology.node(0).mem_free) == (489935 << 20, 370318 << 20)
    assert (topology.node(1).mem_total, topology.node(1).mem_free) == (489795 << 20, 465004 << 20)
    assert (topology.node(2).mem_total, topology.node(2).mem_free) == (188416 << 20, 188415 << 20)
    with_memory = [n.id for n in topology.nodes if n.mem_total]
    assert with_memory == [0, 1, *GB200_MEMORY_NODES]
    assert all(not topology.node(n).cpus for n in range(2, 34))
    # the dump's rows: Graces 40 apart; a Grace 80 from its own GPUs' nodes, 120 from the other's
    assert topology.distance(0, 1) == 40
    assert [topology.distance(0, n) for n in GB200_MEMORY_NODES] == [80, 80, 120, 120]
    assert [topology.distance(1, n) for n in GB200_MEMORY_NODES] == [120, 120, 80, 80]
    assert topology.distance(2, 3) == 11 and topology.distance(2, 9) == 11 and topology.distance(2, 10) == 40
    assert topology.distance(26, 33) == 11 and topology.distance(33, 18) == 40
    assert [topology.nearest_cpu_node(n) for n in GB200_MEMORY_NODES] == [0, 0, 1, 1]
    assert topology.nearest_cpu_node(17) == 0 and topology.nearest_cpu_node(19) == 1


def test_gb200_each_gpu_sits_on_its_grace_and_knows_its_memory_node() -> None:
    topology = load("gb200")
    assert [(g.index, g.address, g.node, g.memory_node) for g in topology.gpus] == [
        (0, "0008:01:00.0", 0, 2), (1, "0009:01:00.0", 0, 10), (2, "0018:01:00.0", 1, 18), (3, "0019:01:00.0", 1, 26),
    ]  # fmt: skip
    assert [g.uuid for g in topology.gpus] == [f"GPU-0b200000-1111-2222-3333-44445555{i:04x}" for i in range(4)]
    assert topology.to_dict()["gpus"][3] == {
        "index": 3, "address": "0019:01:00.0", "node": 1, "memory_node": 26,
        "uuid": "GPU-0b200000-1111-2222-3333-444455550003",
    }  # fmt: skip
    # CUDA_VISIBLE_DEVICES keeps each device's memory node with it
    visible = load("gb200", cuda_visible_devices="3,GPU-0b200000-1111-2222-3333-444455550001")
    assert [(g.address, g.node, g.memory_node) for g in visible.gpus] == [
        ("0019:01:00.0", 1, 26), ("0009:01:00.0", 0, 10),
    ]  # fmt: skip
    assert topology.allowed_nodes == (0, 1, *GB200_MEMORY_NODES)


def test_gb200_full_size_graces_read_like_the_snapshot(tmp_path: Path) -> None:
    """The tray with all 72 Neoverse-V2 cores per Grace: CPUs 0-71 and 72-143, as the dump has
    them; its CPU masks are 144 bits wide (five 32-bit words)."""
    from fixtures.make_fixtures import gb200, Machine

    gb200(Machine(tmp_path), cores=72)
    cpumap = (tmp_path / "sys/devices/system/node/node1/cpumap").read_text()
    assert cpumap == "ffff,ffffffff,ffffff00,00000000,00000000\n"
    topology, messages = load_quietly(tmp_path)
    assert messages == []
    assert [(n.id, n.cpus) for n in topology.cpu_nodes] == [(0, tuple(range(72))), (1, tuple(range(72, 144)))]
    assert topology.cpu(100).llc == tuple(range(72, 144)) and topology.cpu(100).siblings == (100,)
    assert [(g.node, g.memory_node) for g in topology.gpus] == [(0, 2), (0, 10), (1, 18), (1, 26)]


def test_a_gpu_memory_node_the_topology_lacks_is_unknown_with_a_warning(tmp_path: Path) -> None:
    root = tmp_path / "gh200"
    shutil.copytree(FIXTURES / "gh200", root)
    status = root / "proc/driver/nvidia/gpus/0009:01:00.0/numa_status"
    status.write_text("Node:      40\nStatus:    online\n")
    topology, messages = load_quietly(root)
    assert topology.gpus[0].memory_node is None and topology.gpus[0].node == 0
    assert messages == [f"{status}: names node 40, which this topology lacks (nodes 0-8); memory node unknown"]
    status.write_text("Status:    offline\n")  # a driver that has not onlined the GPU's memory
    topology, messages = load_quietly(root)
    assert topology.gpus[0].memory_node is None and messages == []


def test_damaged_nvidia_driver_files_are_skipped_with_a_warning(tmp_path: Path) -> None:
    root = tmp_path / "gh200"
    shutil.copytree(FIXTURES / "gh200", root)
    gpus = root / "proc/driver/nvidia/gpus"
    information = gpus / "0009:01:00.0/information"
    information.write_text("GPU UUID: GPU-0a0b0c0d-1111-2222-3333-444455550000\nBus Location: zz:qq:00.0\n")
    (gpus / "xx:yy:zz").mkdir()
    (gpus / "xx:yy:zz/numa_status").write_text("Node: 1\n")
    topology, messages = load_quietly(root)
    assert [(g.address, g.uuid, g.memory_node) for g in topology.gpus] == [("0009:01:00.0", None, 1)]
    assert messages == [
        f"{information}: 'zz:qq:00.0' is not a PCI address (like 0000:3b:00.0); GPU skipped",
        f"{gpus / 'xx:yy:zz'}: 'xx:yy:zz' is not a PCI address (like 0000:3b:00.0); GPU skipped",
    ]


# ---------------------------------------------------------------- containers: cgroup cpusets


def test_cgroup_v2_container_uses_the_nearest_cpuset_up_the_tree() -> None:
    topology = load("container-cgroup2")
    assert topology.allowed_cpus == (4, 5, 12, 13)
    assert topology.allowed_nodes == (1,)


def test_cgroup_v1_container_without_namespace_uses_its_mount_root() -> None:
    topology = load("container-cgroup1")
    assert topology.allowed_cpus == (0, 1, 8, 9)
    assert topology.allowed_nodes == (0,)


def test_cgroup_v1_cpuset_path_from_proc_self_cpuset(tmp_path: Path) -> None:
    root = tmp_path / "slurm"
    shutil.copytree(FIXTURES / "xeon-2s-smt", root)
    (root / "proc/self/status").unlink()
    (root / "proc/self/cpuset").write_text("/slurm/uid_0/job_7\n")
    (root / "proc/mounts").write_text("cgroup /sys/fs/cgroup/cpuset cgroup rw,cpuset 0 0\n")
    job = root / "sys/fs/cgroup/cpuset/slurm/uid_0/job_7"
    job.mkdir(parents=True)
    (job / "cpuset.cpus").write_text("2-3,10-11\n")
    (job / "cpuset.mems").write_text("0\n")
    (root / "sys/fs/cgroup/cpuset/cpuset.cpus").write_text("0-15\n")
    (root / "sys/fs/cgroup/cpuset/cpuset.mems").write_text("0-1\n")
    topology = Topology.from_sysfs(root)
    assert topology.allowed_cpus == (2, 3, 10, 11)
    assert topology.allowed_nodes == (0,)


def test_status_file_wins_over_cgroup_files(tmp_path: Path) -> None:
    root = tmp_path / "both"
    shutil.copytree(FIXTURES / "container-cgroup2", root)
    (root / "proc/self/status").write_text("Cpus_allowed_list:\t5\nMems_allowed_list:\t1\n")
    topology = Topology.from_sysfs(root)
    assert topology.allowed_cpus == (5,)
    assert topology.allowed_nodes == (1,)


# ---------------------------------------------------------------- offline CPUs, CPUs in no node


def test_offline_cpus_are_dropped_and_cpus_in_no_node_kept() -> None:
    topology = load("offline-cpus")
    assert [c.id for c in topology.cpus] == [0, 1, 2, 4, 5, 7]
    assert topology.node(0).cpus == (0, 1, 2)  # the cpulist's offline CPU 3 is gone
    assert topology.node(1).cpus == (4, 5)
    assert topology.node_of_cpu(7) is None
    assert topology.cpus_without_node == (7,)
    assert topology.cpu(7).llc == (4, 5, 7)
    assert topology.allowed_cpus == (0, 1, 2, 4, 5, 7)  # status allows 0-7, 3 and 6 are offline


def test_without_cpu_online_each_cpus_own_switch_says_whether_it_is_online() -> None:
    # An old kernel's tree: only cpuN/online. Taking every cpuN directory as online
    # gave nodes whose CPU sets held the offline CPUs 2 and 5.
    topology, warnings = load_quietly("per-cpu-online")
    assert [c.id for c in topology.cpus] == [0, 1, 3, 4]
    assert topology.node(0).cpus == (0, 1) and topology.node(1).cpus == (3, 4)
    assert topology.allowed_cpus == (0, 1, 3, 4)
    assert len(warnings) == 1 and "cpu/online: missing or empty; taking the CPUs whose own cpuN/online" in warnings[0]
    assert "offline: 2,5" in warnings[0]


# ---------------------------------------------------------------- sparse node ids, memory-less node


def test_sparse_node_ids_map_distance_columns_by_position() -> None:
    topology = load("sparse-nodes")
    assert topology.node_ids == (0, 1, 4, 5, 252)
    assert topology.to_dict()["nodes"][2]["distances"] == {"0": 32, "1": 32, "4": 10, "5": 16, "252": 60}
    assert topology.distance(252, 1) == 45
    assert topology.distance(5, 4) == 16
    assert topology.nearest_cpu_node(252) == 1
    assert topology.node(5).cpus == (6, 7) and topology.node(5).mem_total == 0
    assert topology.node(252).cpus == () and topology.node(252).mem_total == 256 * GIB
    assert topology.node_of_cpu(6) == 5
    assert topology.allowed_nodes == (0, 1, 4, 252)
    with pytest.raises(InvalidNodeError, match=r"node 2 does not exist; nodes here: 0-1,4-5,252"):
        topology.node(2)


# ---------------------------------------------------------------- no NUMA directory at all


def test_kernel_without_numa_is_one_node_with_every_cpu() -> None:
    topology = load("no-numa")
    assert topology.to_dict()["nodes"] == [
        {"id": 0, "cpus": [0, 1, 2, 3], "mem_total": 8 * GIB, "mem_free": 6 * GIB, "distances": {"0": 10}}
    ]
    assert topology.gpus[0].node == 0  # numa_node -1 on a one-node machine is node 0
    assert topology.pci[0].numa_node is None
    assert topology.allowed_cpus == (0, 1, 2, 3) and topology.allowed_nodes == (0,)


# ---------------------------------------------------------------- damaged files


def test_damaged_snapshot_gives_a_best_effort_answer_and_warnings() -> None:
    topology, messages = load_quietly("damaged")
    assert topology.node(0).cpus == (0, 1)  # cpulist "0-1\n" followed by NUL bytes
    assert topology.node(1).mem_total is None  # empty meminfo
    assert topology.node(0).mem_total == 4 * GIB
    assert topology.distance(1, 0) == 20 and topology.distance(1, 1) == 10  # missing row: no-SLIT defaults
    assert topology.distance(0, 1) == 20
    assert topology.cpu(1).llc == (1,)  # no cache directory: its own SMT siblings
    assert topology.cpu(0).llc == (0, 1)
    assert topology.cpu(2).package is None and topology.cpu(3).package == 1
    assert [d.address for d in topology.pci] == ["0000:03:00.0"]  # the empty-vendor device skipped
    assert topology.pci[0].numa_node is None and topology.gpus[0].node == 1  # from local_cpulist 2-3
    expected = [
        "node0/cpulist: contains NUL bytes",
        "node1/meminfo: empty file",
        "node1/distance: missing",
        "cpu 1: no cache/index*/",
        "physical_package_id: 'garbage' is not an integer",
        "0000:02:00.0/vendor: empty file",
        "0000:02:00.0: no readable vendor or class",
        "0000:03:00.0/numa_node: contains NUL bytes",
    ]
    for fragment in expected:
        assert any(fragment in m for m in messages), (fragment, messages)


def test_a_meminfo_number_in_other_digits_is_no_size(tmp_path: Path) -> None:
    root = tmp_path / "xeon"
    shutil.copytree(FIXTURES / "xeon-2s-smt", root)
    (root / "sys/devices/system/node/node0/meminfo").write_text("Node 0 MemTotal:  \u00b2 kB\n")
    topology, messages = load_quietly(root)
    assert topology.node(0).mem_total is None and topology.node(1).mem_total is not None
    assert any("node0/meminfo: no MemTotal field" in m for m in messages), messages


@pytest.mark.parametrize("root", [None, 5, b"/"])
def test_from_sysfs_names_the_root_it_takes(root: object) -> None:
    with pytest.raises(TypeError, match=r"root must be a str or os.PathLike .*, not " + re.escape(repr(root))):
        Topology.from_sysfs(root)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cuda_visible_devices must be a str as CUDA_VISIBLE_DEVICES holds"):
        load("dgx-h100", cuda_visible_devices=0)


def test_topology_warnings_point_at_the_callers_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        Topology.from_sysfs(FIXTURES / "damaged")
    assert caught and {(w.filename, w.lineno) for w in caught} == {(__file__, line)}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "--1")
    try:
        with pytest.warns(TopologyWarning, match="'--1' .* is not a device") as record:
            line = sys._getframe().f_lineno + 1
            numafast.topology(refresh=True)
        assert {(w.filename, w.lineno) for w in record} == {(__file__, line)}
    finally:
        monkeypatch.undo()
        numafast.topology(refresh=True)


# ---------------------------------------------------------------- mask-only trees, legacy cpusets, caches

NODE0_OF_48 = (*range(12), *range(24, 36))  # socket 0 of the 48-CPU Xeon E5 (make_fixtures.masks_only)
NODE1_OF_48 = (*range(12, 24), *range(36, 48))


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        # cgroup-v1/cpusets.rst's examples of the mask format
        ("00000001", [0]),
        ("40000000,00000000,00000000", [94]),
        ("00000001,00000000,00000000", [64]),
        ("000000ff,00000000", list(range(32, 40))),
        ("00000000,000e3862", [1, 5, 6, 11, 12, 13, 17, 18, 19]),
        # the first word only as wide as the kernel's bitmap (8 and 48 CPUs), a NUL-padded copy
        ("ff\n", list(range(8))),
        ("0000,20000020", [5, 29]),
        ("0100,00010000\x00\x00", [16, 40]),
        ("0", []),
    ],
)
def test_mask_format_is_32_bit_hex_words_most_significant_first(text: str, bits: list[int]) -> None:
    from numafast.topo.files import parse_mask

    assert parse_mask(text) == bits


@pytest.mark.parametrize("text", ["1ffffffff", "0x1f", "ff,,ff", "fg", "0-3"])
def test_text_that_is_no_mask_is_refused(text: str) -> None:
    from numafast.topo.files import parse_mask

    with pytest.raises(ValueError):
        parse_mask(text)


def test_masks_up_to_65536_bits_are_read_in_linear_time_and_wider_ones_refused() -> None:
    from numafast.topo.files import parse_mask

    started = time.monotonic()
    assert parse_mask(",".join(["ffffffff"] * 2048)) == list(range(1 << 16))
    with pytest.raises(ValueError, match="a mask of 20000 words is wider than any kernel's \\(at most 65536 bits\\)"):
        parse_mask(",".join(["ffffffff"] * 20000))  # 180 KB of garbage: quadratic, it took seconds
    assert time.monotonic() - started < 1


def test_a_snapshot_with_only_masks_reads_like_one_with_lists() -> None:
    root = FIXTURES / "masks-only"
    assert (root / "sys/devices/system/node/node0/cpumap").read_text() == "000f,ff000fff\n"
    assert not (root / "sys/devices/system/node/node0/cpulist").exists()
    topology, messages = load_quietly("masks-only")
    assert messages == []
    assert topology.node(0).cpus == NODE0_OF_48
    assert topology.node(1).cpus == NODE1_OF_48
    five, forty = topology.cpu(5), topology.cpu(40)
    assert (five.node, five.package, five.core, five.siblings) == (0, 0, 5, (5, 29))  # thread_siblings 0000,20000020
    assert (forty.node, forty.package, forty.core, forty.siblings) == (1, 1, 16, (16, 40))  # 0100,00010000
    assert five.llc == NODE0_OF_48 and forty.llc == NODE1_OF_48  # shared_cpu_map of the L3
    assert [(g.address, g.node) for g in topology.gpus] == [("0000:82:00.0", 1)]  # numa_node -1, local_cpus
    assert topology.pci[0].numa_node is None
    assert topology.allowed_cpus == NODE0_OF_48  # Cpus_allowed 000f,ff000fff
    assert topology.allowed_nodes == (0,)  # Mems_allowed: 31 words of zeros, then 00000003... & node 0


def test_where_list_and_mask_disagree_the_list_wins_with_a_warning(tmp_path: Path) -> None:
    from fixtures.make_fixtures import Machine

    machine = Machine(tmp_path)  # both forms, as a live kernel writes them
    machine.cpus(range(4), 4)
    for cpu in range(4):
        machine.cpu(cpu, package=0, siblings=[cpu], llc=range(4))
    machine.nodes_online([0, 1])
    machine.node(0, cpus=[0, 1], total_kb=GIB // 1024, free_kb=0, distances=[10, 20])
    machine.node(1, cpus=[2, 3], total_kb=GIB // 1024, free_kb=0, distances=[20, 10])
    machine.write("sys/devices/system/node/node1/cpumap", "e\n")  # CPUs 1-3: taken across a hotplug
    machine.write("sys/devices/system/cpu/cpu0/topology/thread_siblings_list", "zero\n")  # damaged: the mask 1 holds
    machine.write("sys/devices/system/cpu/cpu0/topology/thread_siblings", "3\n")
    topology, messages = load_quietly(tmp_path)
    assert topology.node(1).cpus == (2, 3)
    assert topology.cpu(0).siblings == (0, 1)
    assert any("node1/cpulist says 2-3 but cpumap says 1-3; taking the list" in m for m in messages), messages
    assert any("thread_siblings_list: 'zero' is not a list of ids; ignored" in m for m in messages), messages
    assert len(messages) == 2, messages


def test_legacy_cpuset_filesystem_gives_the_allowed_sets() -> None:
    topology = load("legacy-cpuset")  # /dev/cpuset, type cpuset; proc/self/cpuset names /batch/job42
    assert topology.allowed_cpus == (6, 7, 14, 15)
    assert topology.allowed_nodes == (1,)


def test_cgroup_v1_mounted_noprefix_has_files_without_the_cpuset_prefix(tmp_path: Path) -> None:
    root = tmp_path / "noprefix"
    shutil.copytree(FIXTURES / "container-cgroup1", root)
    (root / "proc/mounts").write_text("cgroup /sys/fs/cgroup/cpuset cgroup rw,cpuset,noprefix 0 0\n")
    cpuset = root / "sys/fs/cgroup/cpuset"
    (cpuset / "cpuset.cpus").rename(cpuset / "cpus")
    (cpuset / "cpuset.mems").rename(cpuset / "mems")
    topology = Topology.from_sysfs(root)
    assert topology.allowed_cpus == (0, 1, 8, 9)
    assert topology.allowed_nodes == (0,)


def test_a_cache_reported_shared_across_packages_is_taken_as_the_package() -> None:
    topology, messages = load_quietly("cross-package-cache")
    assert [(c.id, c.package, c.node, c.siblings) for c in topology.cpus] == [
        (cpu, cpu // 4, cpu // 4, (cpu,)) for cpu in range(8)
    ]
    assert [c.llc for c in topology.cpus] == [(0, 1, 2, 3)] * 4 + [(4, 5, 6, 7)] * 4
    assert messages == [
        "cpu 0-7: the last-level cache is reported shared with CPUs of another package, which no cache is; "
        "taken as the package's CPUs"
    ]


# ---------------------------------------------------------------- the package's shape


def test_topology_package_reads_one_way_files_parts_model() -> None:
    """model.py imports no other module of numafast.topo (it does no I/O: the reading side
    builds topologies and registers Topology.from_sysfs), and topo's imports have no cycle."""
    package = Path(numafast.topo.__file__).parent
    imports: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        imports[path.stem] = {name.rpartition(".")[2] for name in names if name.startswith("numafast.topo.")}
    assert imports["model"] == set()
    assert imports["files"] == set()
    model = ast.walk(ast.parse((package / "model.py").read_text()))
    names_in_model = {getattr(node, "id", getattr(node, "attr", None)) for node in model}
    assert not {"open", "Path", "read_text", "read_bytes", "iterdir"} & names_in_model
    done: set[str] = set()
    while len(done) < len(imports):  # peel off modules whose imports are all done: fails on a cycle
        ready = {module for module, needs in imports.items() if module not in done and needs <= done}
        assert ready, f"import cycle among {sorted(set(imports) - done)}"
        done |= ready
    assert Topology.from_sysfs(FIXTURES / "xeon-2s-smt").node_ids == (0, 1)


# ---------------------------------------------------------------- numafast show


def test_show_json_prints_to_dict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--sysfs", str(FIXTURES / "dgx-h100"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == load("dgx-h100").to_dict()


def test_show_text_reads_like_numactl_and_nvidia_smi_topo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--sysfs", str(FIXTURES / "dgx-h100"), "--cuda-visible-devices", "4,0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "available: 2 nodes (0-1)"
    assert "node 1 cpus: 8 9 10 11 12 13 14 15 24 25 26 27 28 29 30 31" in out
    assert "node 0 size: 1048576 MB" in out and "node 1 free: 921600 MB" in out
    assert out[out.index("node distances:") + 2].split() == ["0:", "10", "21"]
    gpu0 = next(line for line in out if line.startswith("GPU0 "))
    assert gpu0.split()[:3] == ["GPU0", "X", "SYS"]  # GPU0 is physical 9d (node 1), GPU1 is 1b (node 0)
    assert "8-15,24-31" in gpu0 and "0000:9d:00.0" in gpu0
    assert "allowed cpus: 0-31" in out and "allowed nodes: 0-1" in out


def test_show_marks_cpus_in_no_node_and_cpu_less_gpu_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--sysfs", str(FIXTURES / "offline-cpus")]) == 0
    assert "cpus in no node: 7" in capsys.readouterr().out
    assert main(["show", "--sysfs", str(FIXTURES / "grace-hopper")]) == 0
    gpu1 = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("GPU1 "))
    assert "4-7" in gpu1 and "3 (cpus of 1)" in gpu1


def test_show_renders_a_gb200_tray(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--sysfs", str(FIXTURES / "gb200")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "available: 34 nodes (0-33)"
    assert "node 1 cpus: 4 5 6 7" in out and "node 1 size: 489795 MB" in out
    assert "node 18 cpus: (GPU2 memory)" in out and "node 18 size: 188416 MB" in out and "node 19 size: 0 MB" in out
    assert [line for line in out if line.endswith(" memory)")] == [
        "node 2 cpus: (GPU0 memory)", "node 10 cpus: (GPU1 memory)",
        "node 18 cpus: (GPU2 memory)", "node 26 cpus: (GPU3 memory)",
    ]  # fmt: skip
    assert "node 19 cpus: " in out  # an empty MIG node is no GPU's memory
    assert out[out.index("node distances:") + 3].split()[:5] == ["1:", "40", "10", "120", "120"]
    rows = {line.split()[0]: line for line in out if line.startswith("GPU")}
    assert rows["GPU0"].split()[:5] == ["GPU0", "X", "NODE", "SYS", "SYS"]
    assert rows["GPU3"].split()[:5] == ["GPU3", "SYS", "SYS", "NODE", "X"]
    assert rows["GPU2"].split()[5:8] == ["4-7", "1", "0018:01:00.0"]
    assert "allowed nodes: 0-2,10,18,26" in out
    assert main(["show", "--sysfs", str(FIXTURES / "gb200"), "--json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert [(g["node"], g["memory_node"]) for g in gpus] == [(0, 2), (0, 10), (1, 18), (1, 26)]


def test_show_names_a_gpus_memory_node_as_the_process_numbers_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--sysfs", str(FIXTURES / "gh200")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "node 0 cpus: 0 1 2 3" in out and "node 1 cpus: (GPU0 memory)" in out and "node 2 cpus: " in out
    # GPUs as CUDA_VISIBLE_DEVICES numbers them; a hidden GPU's memory node is a plain CPU-less node
    assert main(["show", "--sysfs", str(FIXTURES / "gb200"), "--cuda-visible-devices", "3,1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.endswith(" memory)")] == [
        "node 10 cpus: (GPU1 memory)", "node 26 cpus: (GPU0 memory)",
    ]  # fmt: skip
    assert "node 2 cpus: " in out and "node 18 cpus: " in out
    assert main(["show", "--sysfs", str(FIXTURES / "gh200"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"] == [
        {"index": 0, "address": "0009:01:00.0", "node": 0, "memory_node": 1, "uuid": load("gh200").gpus[0].uuid},
    ]


def test_a_root_without_sys_is_refused_and_an_empty_one_warns(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no copy of a machine's sys/"):
        Topology.from_sysfs(tmp_path / "typo")
    (tmp_path / "sys").mkdir()
    with pytest.warns(TopologyWarning, match="no cpuN directory: no CPUs"):
        empty = Topology.from_sysfs(tmp_path)
    assert empty.cpus == () and empty.node_ids == (0,)


def test_amd_instinct_gpus_are_the_hip_devices_and_the_onboard_vga_is_not(tmp_path: Path) -> None:
    from fixtures.make_fixtures import Machine

    machine = Machine(tmp_path)
    machine.cpus(range(2), 2)
    for cpu in range(2):
        machine.cpu(cpu, package=0, siblings=[cpu], llc=[0, 1])
    # On-board ES1000-style VGA (0x0300), two MI250X-style accelerators (class 0x038000).
    machine.pci("0000:05:00.0", vendor=0x1002, pci_class=0x030000, numa_node=-1, local_cpus=[0, 1])
    machine.pci("0000:c1:00.0", vendor=0x1002, pci_class=0x038000, numa_node=-1, local_cpus=[0, 1])
    machine.pci("0000:29:00.0", vendor=0x1002, pci_class=0x038000, numa_node=-1, local_cpus=[0, 1])
    topology = Topology.from_sysfs(tmp_path)
    assert [d.is_gpu for d in topology.pci] == [True, True, True]
    assert [(g.index, g.address, g.node) for g in topology.gpus] == [(0, "0000:29:00.0", 0), (1, "0000:c1:00.0", 0)]
