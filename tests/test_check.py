"""``numafast check`` on this host: the /proc files of tests/fixtures/proc (captured in the
4-node guest by tests/fixtures/proc/capture.py; host-mbind-policies.numa_maps on a 6.18 host),
bad input, and processes that cannot be audited. The live audits are in test_check_live.py."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from numafast._validate import parse_ids
from numafast.cli import main
from numafast.cli.check.classes import MemoryClass, classify, label
from numafast.cli.check.gpu import GpuSites
from numafast.cli.check.procfs import Mapping, Process, Thread, descendants, join, parse_numa_maps, parse_smaps
from numafast.cli.check.result import CheckReport
from numafast.cli.check.verdict import Expectation, audit_process, parse_policy, rank_memory

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures" / "proc"
SNAPSHOTS = TESTS / "fixtures"
ENV = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
MIB = 1 << 20
# The guest the fixtures come from has one CPU per node: CPU i is on node i.
GUEST_NODES = [0, 1, 2, 3]


# Replays of captured files: nothing of the running kernel, so not run again in the guests.
replay = pytest.mark.host_only("replays /proc files captured in the 4-node guest")
# Audits against a Grace machine's sysfs snapshot: nothing of the running kernel either
# (each read of a snapshot takes seconds under the guests' TCG emulation).
grace_snapshot = pytest.mark.host_only("audits against a Grace sysfs snapshot")


def guest_node_of_cpu(cpu: int) -> int:
    return cpu


def fixture_process(case: str) -> Process:
    """A process as captured: its main thread, and its mappings."""
    status = dict(line.split(":\t", 1) for line in (FIXTURES / f"{case}.status").read_text().splitlines())
    cpus, mems = (tuple(parse_ids(status[field])) for field in ("Cpus_allowed_list", "Mems_allowed_list"))
    thread = Thread(int(status["Pid"]), cpus, mems)
    mappings = join(parse_numa_maps((FIXTURES / f"{case}.numa_maps").read_text()),
                    parse_smaps((FIXTURES / f"{case}.smaps").read_text()))  # fmt: skip
    return Process(int(status["Pid"]), int(status["PPid"]), status["Name"], (thread,), mappings)


def placed(case: str) -> dict[int, dict[str, object]]:
    """{start: what tests/placed_process.py says it mapped there} for a fixture case."""
    return {entry["start"]: entry for entry in json.loads((FIXTURES / f"{case}.json").read_text())["maps"]}


def on_node(node: int, reason: str = "") -> Expectation:
    return Expectation(node, (node,), reason or f"expected on node {node} (--node)",
                       f"numafast run --cpunodebind {node} --membind {node}")  # fmt: skip


def by_start(process: Process) -> dict[int, Mapping]:
    return {mapping.start: mapping for mapping in process.mappings}


@replay
def test_numa_maps_paths_policies_and_pages_parse_as_the_kernel_wrote_them() -> None:
    process = fixture_process("interleave-all-locked-pool")
    mappings = by_start(process)
    for start, entry in placed("interleave-all-locked-pool").items():
        mapping = mappings[start]
        assert mapping.size == entry["bytes"] and mapping.policy == "interleave:0-3"
        # every page touched under interleave over 4 nodes: a quarter on each, except that a
        # private mapping may get a transparent huge page, 2 MiB on one node
        assert sum(mapping.node_bytes.values()) == entry["bytes"] and sorted(mapping.node_bytes) == GUEST_NODES
        if entry["kind"] != "anon":
            assert set(mapping.node_bytes.values()) == {mapping.size // 4}, entry
    pool = mappings[next(s for s, e in placed("interleave-all-locked-pool").items() if e["kind"] == "memfd")]
    assert pool.path == "/memfd:numafast-pool-0 (deleted)" and pool.locked and pool.shared
    libraries = [m for m in process.mappings if m.path and m.path.endswith(".so") or m.path and ".so." in m.path]
    assert libraries and all(classify(m) is None for m in libraries)


@replay
def test_policies_with_spaces_and_flags_parse() -> None:
    lines = parse_numa_maps((FIXTURES / "host-mbind-policies.numa_maps").read_text())
    policies = [line.policy for line in lines]
    assert policies == ["prefer (many)=relative:0", "bind:0", "prefer:0", "interleave=static:0", "weighted interleave:0"]
    assert [parse_policy(p) for p in policies] == [
        ("prefer (many)", [0]), ("bind", [0]), ("prefer", [0]), ("interleave", [0]), ("weighted interleave", [0])
    ]
    assert all(line.node_bytes == {0: MIB} and line.path is None for line in lines)


@replay
def test_mappings_are_classified_and_named() -> None:
    kinds = {"memfd": (MemoryClass.PAGE_LOCKED, "numafast pool"), "shm": (MemoryClass.SHARED, "torch shared tensor"),
             "shared": (MemoryClass.SHARED, "shared anonymous"), "anon": (MemoryClass.ANONYMOUS, "anonymous")}  # fmt: skip
    mappings = by_start(fixture_process("interleave-all-locked-pool"))
    for start, entry in placed("interleave-all-locked-pool").items():
        assert (classify(mappings[start]), label(mappings[start])) == kinds[str(entry["kind"])], entry


@replay
def test_shared_memory_on_other_nodes_is_counted_and_named() -> None:
    audit = audit_process(fixture_process("node1-shared-on-3"), on_node(1), 0.1, GUEST_NODES, guest_node_of_cpu)
    shared = audit.memory[MemoryClass.SHARED]
    # placed_process put the shared anonymous memory and the memfd on node 3, the /dev/shm file on node 2
    assert shared.labels == {"torch shared tensor": {2: 4 * MIB}, "numafast pool": {3: 4 * MIB},
                             "shared anonymous": {3: 4 * MIB}}  # fmt: skip
    assert audit.status == "wrong" and audit.problems == [
        "12.0 MiB of shared memory (100%) on node 2 4.0 MiB, node 3 8.0 MiB "
        "(numafast pool 4.0 MiB, shared anonymous 4.0 MiB, torch shared tensor 4.0 MiB); expected on node 1 (--node)"
    ]
    assert set(audit.memory[MemoryClass.ANONYMOUS].node_bytes) == {1}  # the heap: touched under bind:1


@replay
def test_a_child_on_another_node_is_wrong_for_its_threads_and_memory() -> None:
    audit = audit_process(fixture_process("node1-shared-on-3-child1"), on_node(1, "the rank runs on node 1"), 0.1,
                          GUEST_NODES, guest_node_of_cpu)  # fmt: skip
    assert audit.problems[0] == f"thread {audit.pid} may run on CPUs 2 (nodes 2); the rank runs on node 1"
    assert audit.problems[1].startswith("4.0 MiB of anonymous memory (")
    assert audit.problems[1].endswith(") on node 2; the rank runs on node 1")


@replay
def test_an_interleaved_locked_pool_is_reported_with_policy_size_cause_and_fix() -> None:
    audit = audit_process(fixture_process("interleave-all-locked-pool"), on_node(0), 0.1, GUEST_NODES,
                          guest_node_of_cpu)  # fmt: skip
    locked = next(f for f in audit.policies if f.memory_class is MemoryClass.PAGE_LOCKED)
    assert (locked.policy, locked.size, locked.labels) == ("interleave:0-3", 8 * MIB, ["numafast pool"])
    assert locked.inherited
    assert locked.node_bytes == {node: 2 * MIB for node in GUEST_NODES}
    assert locked.cause == (
        "started under numactl --interleave=all (or set_mempolicy): page-locked staging buffers interleaved over nodes 0-3"
    )
    assert locked.fix == "start the rank with `numafast run --cpunodebind 0 --membind 0` instead"
    assert {f.memory_class for f in audit.policies} == set(MemoryClass)
    assert any(p.startswith("6.0 MiB of page-locked memory (75%) on node 1 2.0 MiB, node 2 2.0 MiB, node 3 2.0 MiB")
               for p in audit.problems), audit.problems  # fmt: skip


@replay
@pytest.mark.parametrize(
    ("case", "node", "policy", "numactl"),
    [
        ("preferred-2", 1, "prefer:2", "--preferred=2"),
        ("preferred-many-0-1", 0, "prefer (many):0-1", "--preferred-many=0-1"),
    ],
)
def test_prefer_policies_off_the_node_are_findings(case: str, node: int, policy: str, numactl: str) -> None:
    audit = audit_process(fixture_process(case), on_node(node), 0.1, GUEST_NODES, guest_node_of_cpu)
    assert audit.status == "wrong"
    finding = next(f for f in audit.policies if f.memory_class is MemoryClass.ANONYMOUS)
    assert finding.policy == policy and finding.inherited
    assert finding.cause.startswith(f"started under numactl {numactl} (or set_mempolicy): anonymous memory preferring")


@replay
def test_a_policy_on_the_expected_node_is_no_finding() -> None:
    process = fixture_process("node1-shared-on-3")  # every mapping shows bind:1, the process's policy
    assert all(m.policy == "bind:1" for m in process.mappings)
    assert audit_process(process, on_node(1), 1.0, GUEST_NODES, guest_node_of_cpu).policies == []


def test_pages_on_a_grace_hopper_gpus_own_node_are_local() -> None:
    # CPUs on node 0, the GPU's HBM is node 2: both are local to the GPU; node 1 is remote.
    gpu = Expectation(0, (0, 2), "GPU 0 is on node 0", "numafast run --gpu auto")
    pages = {0: 50 * MIB, 2: 30 * MIB, 1: 20 * MIB}
    process = Process(1, 0, "rank", (Thread(1, (0,), (0, 1, 2)),), (Mapping(0, "default", None, False, False, 0, pages),))
    assert audit_process(process, gpu, 0.2, [0, 1, 2], lambda cpu: 0).remote_share == pytest.approx(0.2)
    assert audit_process(process, gpu, 0.2, [0, 1, 2], lambda cpu: 0).status == "ok"
    assert audit_process(process, gpu, 0.19, [0, 1, 2], lambda cpu: 0).status == "wrong"


def grace_site(snapshot: str, gpu: int, visible: str | None = None) -> Expectation:
    """What ``numafast check --gpu GPU --sysfs tests/fixtures/SNAPSHOT`` expects of a rank."""
    args = argparse.Namespace(sysfs=str(SNAPSHOTS / snapshot), cuda_visible_devices=visible, gpu=gpu)
    return GpuSites(args).expectation(visible)


def grace_rank(cpus: tuple[int, ...], mems: tuple[int, ...], pages: dict[int, int]) -> Process:
    return Process(1, 0, "rank", (Thread(1, cpus, mems),), (Mapping(0, "default", None, False, False, 0, pages),))


@grace_snapshot
def test_a_rank_with_pages_on_its_grace_gpus_memory_node_is_local() -> None:
    # GB200 tray: GPUs 0 and 1 hang off Grace node 0 (CPUs 0-3); their HBM is nodes 2 and 10.
    # (GPUs on node 0 only: the expected node must exist on the host that runs the check.)
    gpu1 = grace_site("gb200", 1)
    assert (gpu1.node, gpu1.local_nodes, gpu1.reason) == (0, (0, 10), "GPU 1 is on node 0 (its memory: node 10)")
    rank = grace_rank((0, 1, 2, 3), (0, 10), {0: 40 * MIB, 10: 60 * MIB})
    audit = audit_process(rank, gpu1, 0.1, list(range(34)), lambda cpu: 0)
    assert (audit.status, audit.remote_share, audit.problems) == ("ok", 0.0, [])
    # the other GPU's memory on the same Grace is not this GPU's: remote
    other = audit_process(grace_rank((0, 1, 2, 3), (0, 2), {0: 40 * MIB, 2: 60 * MIB}), gpu1, 0.1, list(range(34)),
                          lambda cpu: 0)  # fmt: skip
    assert other.status == "wrong" and other.remote_share == pytest.approx(0.6)
    assert other.problems == ["60.0 MiB of anonymous memory (60%) on node 2; GPU 1 is on node 0 (its memory: node 10)"]
    # memory bound to the GPU's memory node is no misplacing policy; bound to the other GPU's it is
    bound = Process(1, 0, "rank", (Thread(1, (0,), (0, 10)),), (Mapping(0, "bind:10", None, False, False, 0, {10: MIB}),))
    assert audit_process(bound, gpu1, 0.1, list(range(34)), lambda cpu: 0).policies == []
    elsewhere = Process(1, 0, "rank", (Thread(1, (0,), (0, 2)),), (Mapping(0, "bind:2", None, False, False, 0, {2: MIB}),))
    assert [f.policy for f in audit_process(elsewhere, gpu1, 1.0, list(range(34)), lambda cpu: 0).policies] == ["bind:2"]


@grace_snapshot
def test_a_gpus_memory_node_follows_the_processs_gpu_numbering() -> None:
    gh200 = grace_site("gh200", 0)
    assert (gh200.node, gh200.local_nodes) == (0, (0, 1))
    rank = grace_rank((0, 1), (0, 1), {0: MIB, 1: 9 * MIB})
    assert audit_process(rank, gh200, 0.1, list(range(9)), lambda cpu: 0).status == "ok"
    # CUDA_VISIBLE_DEVICES=1,0: the process's GPU 0 is the tray's GPU 1, whose memory is node 10
    assert grace_site("gb200", 0, "1,0").local_nodes == (0, 10)
    assert grace_site("gb200", 1, "1,0").local_nodes == (0, 2)


@grace_snapshot
def test_check_gpu_on_a_grace_snapshot_reports_the_memory_node_as_local(capsys: pytest.CaptureFixture[str]) -> None:
    with bound_shell_with_a_child() as (shell, _sleep):
        status = main(["check", "--json", "--process-only", "--gpu", "0", "--sysfs", str(SNAPSHOTS / "gb200"),
                       "--cuda-visible-devices", "1", str(shell)])  # fmt: skip
        report = CheckReport.from_json(capsys.readouterr().out)
    rank = report.ranks[0]
    assert (rank.node, rank.local_nodes, rank.expected) == (0, [0, 10], "GPU 0 is on node 0 (its memory: node 10)")
    assert status == 0 and rank.status == "ok", rank.problems


def test_shared_memory_of_several_processes_counts_once_and_locked_wins() -> None:
    pool = {0: 8 * MIB}
    identity = ("00:01", 7, 0)
    main = Mapping(0x1000, "default", "/memfd:numafast-pool (deleted)", True, True, 8 * MIB, pool, identity)
    worker = Mapping(0x9000, "default", "/memfd:numafast-pool (deleted)", True, False, 8 * MIB, {0: MIB}, identity)
    processes = [Process(pid, 1, "python3", (), (mapping,)) for pid, mapping in ((10, main), (11, worker), (12, worker))]
    memory = rank_memory(processes)
    assert list(memory) == [MemoryClass.PAGE_LOCKED] and memory[MemoryClass.PAGE_LOCKED].node_bytes == pool


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "ten"])
def test_max_remote_must_be_a_share(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["check", "--max-remote", value, str(os.getpid())])
    assert exit.value.code == 2
    assert f"argument --max-remote: '{value}' is not a share in 0..1" in capsys.readouterr().err


def test_an_unknown_node_names_the_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--node", "99", str(os.getpid())]) == 1
    assert "numafast check: node 99 does not exist; nodes here: " in capsys.readouterr().err


def numafast(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "numafast", *args], capture_output=True, text=True,
                          cwd=TESTS.parent, env=ENV, timeout=300)  # fmt: skip


@contextmanager
def bound_shell_with_a_child() -> Iterator[tuple[int, int]]:
    """(sh, its child sleep), both bound to node 0's CPUs and memory: a rank that is ok anywhere.
    Bound by ``numafast run`` (numactl may not run where the installed wheel is tested,
    with the system's libnuma hidden)."""
    command = [sys.executable, "-m", "numafast", "run", "--cpunodebind", "0", "--membind", "0", "--", "sh", "-c", "sleep 300; true"]
    shell = subprocess.Popen(command, env=ENV, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while not descendants(shell.pid):
            if shell.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the bound shell did not start its child: {shell.stderr.read() if shell.stderr else ''}")
            time.sleep(0.02)
        yield shell.pid, descendants(shell.pid)[0][0]
    finally:
        for child, *_rest in descendants(shell.pid):
            os.kill(child, signal.SIGKILL)
        shell.kill()
        shell.wait()


def test_a_rank_and_its_child_are_ok_and_an_unknown_pid_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    with bound_shell_with_a_child() as (shell, sleep):
        status = main(["check", str(shell), "999999999"])
        lines = capsys.readouterr().out.splitlines()
    assert status == 1 and lines[-1] == "pid 999999999: no such process"
    assert lines[0].startswith(f"pid {shell}: ok (node 0; sh; 1 thread; remote 0%)"), lines
    assert lines[2].startswith(f"pid {sleep}: ok (node 0; sleep, child of {shell}; 1 thread; remote 0%)"), lines
    assert lines[4] == f"rank {shell}: ok (2 processes: 2 ok)", lines


def test_json_round_trips_is_checked_and_process_only_looks_at_the_pid_alone(capsys: pytest.CaptureFixture[str]) -> None:
    with bound_shell_with_a_child() as (shell, sleep):
        assert main(["check", "--json", "--process-only", str(shell), "999999999"]) == 1
        text = capsys.readouterr().out
    report = CheckReport.from_json(text)
    assert CheckReport.from_json(report.to_json()) == report
    assert [rank.status for rank in report.ranks] == ["ok", "missing"] and not report.ok
    assert [process.pid for process in report.ranks[0].processes] == [shell]
    assert report.settings == {"node": None, "gpu": None, "max_remote": 0.1, "descendants": False}
    document = json.loads(text)
    document["ranks"][1]["status"] = "fine"
    with pytest.raises(ValueError, match="status 'fine' is not one of ok, wrong"):
        CheckReport.from_json(json.dumps(document))
    document["ranks"][1]["status"], document["ok"] = "ok", False
    with pytest.raises(ValueError, match="contradicts"):
        CheckReport.from_json(json.dumps(document))
    with pytest.raises(ValueError, match="not a numafast.check/1 document"):
        CheckReport.from_json(json.dumps({"schema": "numafast.bench/1"}))


CHURN = """
import subprocess, sys
print('ready', flush=True)
while True:
    subprocess.run(['true'])
"""


@pytest.mark.host_only("five audits of a racing rank: under TCG each takes seconds")
def test_a_rank_whose_children_come_and_go_is_audited_without_a_traceback() -> None:
    churn = subprocess.Popen([sys.executable, "-c", CHURN], stdout=subprocess.PIPE, text=True)
    try:
        assert churn.stdout is not None and churn.stdout.readline() == "ready\n"
        results = [numafast("check", "--max-remote", "1", str(churn.pid)) for _ in range(5)]
    finally:
        churn.kill()
        churn.wait()
    for result in results:
        assert result.returncode == 0 and result.stderr == "", result.stdout + result.stderr
        assert result.stdout.startswith(f"pid {churn.pid}: ok ("), result.stdout
