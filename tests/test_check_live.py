"""``numafast check`` on live ranks in the 4-node guest: each rank is set up by
tests/placed_process.py under numactl, and every verdict is compared with what the test
set up and with the kernel's own numa_maps, smaps and status files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from numafast.cli import main
from numafast.cli.check.classes import MemoryClass
from numafast.cli.check.procfs import ProcessGone, descendants, read_process
from numafast.cli.check.result import CheckReport, ProcessAudit
from numafast.cli.check.text import rank_lines
from sysfs_truth import kib, node_cpus, numa_maps, parse_list, smaps_of, task_status

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
PLACED = [sys.executable, str(TESTS / "placed_process.py")]
MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


@contextmanager
def placed(*command: str) -> Iterator[dict[str, Any]]:
    """Run a placed process (tests/placed_process.py, maybe under numactl or sh); yield what it reports."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert process.stdout is not None
        yield json.loads(process.stdout.readline())
    finally:
        process.communicate("", timeout=60)


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, CheckReport]:
    """``numafast check --json ARGS``, run in this process (a new Python costs seconds under
    TCG), its exit status and its report, which must round-trip."""
    status = main(["check", "--json", *args])
    captured = capsys.readouterr()
    assert captured.err == "", captured.err
    report = CheckReport.from_json(captured.out)
    assert CheckReport.from_json(report.to_json()) == report
    assert status == (0 if report.ok else 1)
    return status, report


def text_of(report: CheckReport) -> str:
    """The text ``numafast check`` prints for this report."""
    return "".join(line + "\n" for rank in report.ranks for line in rank_lines(rank, None))


def kernel_bytes(pid: int, start: int) -> dict[int, int]:
    """The kernel's bytes per node of the mapping at ``start`` of process ``pid``."""
    return {node: pages * PAGE for node, pages in numa_maps(pid)[start][1].items() if pages}


def own_memory_nodes(pid: int) -> set[int]:
    """Nodes holding pages of the process's anonymous and shared memory, read straight from
    /proc/PID/numa_maps (mapped files, in the page cache, left out)."""
    nodes: set[int] = set()
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        if " file=" in line and not any(f" file={kind}" in line for kind in ("/memfd:", "/dev/shm/", "/dev/zero")):
            continue
        nodes |= {int(word[1 : word.index("=")]) for word in line.split() if word[0] == "N" and word[1].isdigit()}
    return nodes


def command_name(pid: int) -> str:
    """The process's name as the kernel keeps it (/proc/PID/comm): the basename of the file
    it executed, at most 15 characters, so ``python`` for a venv's interpreter, not always
    ``python3``."""
    return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")


def audit_of(report: CheckReport, pid: int) -> ProcessAudit:
    return next(process for rank in report.ranks for process in rank.processes if process.pid == pid)


@pytest.mark.numa(nodes=4)
def test_shared_anonymous_memfd_and_dev_shm_memory_on_wrong_nodes_is_counted_and_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    maps = ["--map", "shared:8:3", "--map", "memfd:8:3:numafast-pool-test", "--map", "shm:8:2:torch_9_9_0"]
    with placed("numactl", "--cpunodebind=1", "--membind=1", *PLACED, *maps) as rank:
        pid = rank["pid"]
        name = command_name(pid)
        kernel = {entry["kind"]: kernel_bytes(pid, entry["start"]) for entry in rank["maps"]}
        status, report = check(capsys, "--node", "1", str(pid))
    assert kernel == {"shared": {3: 8 * MIB}, "memfd": {3: 8 * MIB}, "shm": {2: 8 * MIB}}
    audit = audit_of(report, pid)
    shared = audit.memory[MemoryClass.SHARED]
    assert shared.labels == {"shared anonymous": kernel["shared"], "numafast pool": kernel["memfd"],
                             "torch shared tensor": kernel["shm"]}  # fmt: skip
    problem = ("24.0 MiB of shared memory (100%) on node 2 8.0 MiB, node 3 16.0 MiB (numafast pool 8.0 MiB, "
               "shared anonymous 8.0 MiB, torch shared tensor 8.0 MiB); expected on node 1 (--node)")  # fmt: skip
    assert audit.status == "wrong" and audit.problems == [problem], audit.problems  # threads, heap: node 1
    assert report.ranks[0].status == "wrong" and status == 1
    assert text_of(report).startswith(f"pid {pid}: wrong (node 1; {name}; 1 thread; remote ")
    assert f"  {problem}\n" in text_of(report), text_of(report)


@pytest.mark.numa(nodes=4)
def test_children_bound_elsewhere_are_found_and_named(capsys: pytest.CaptureFixture[str]) -> None:
    with placed("numactl", "--cpunodebind=1", "--membind=1", *PLACED, "--child", "2", "--child", "1") as rank:
        pid, (stray, good) = rank["pid"], rank["children"]
        name = command_name(stray)
        stray_cpus = parse_list(task_status(pid=stray)["Cpus_allowed_list"])
        stray_nodes = {node for start, (_, pages) in numa_maps(stray).items() for node, n in pages.items() if n}
        status, report = check(capsys, str(pid))
    assert stray_cpus == node_cpus(2) and 2 in stray_nodes  # as the test set it up
    [rank_audit] = report.ranks
    assert [p.pid for p in rank_audit.processes] == [pid, stray, good]
    assert [p.status for p in rank_audit.processes] == ["ok", "wrong", "ok"]
    assert rank_audit.node == 1 and rank_audit.expected == "the rank runs on node 1"
    thread_problem = f"thread {stray} may run on CPUs {','.join(map(str, stray_cpus))} (nodes 2); the rank runs on node 1"
    stray_audit = audit_of(report, stray)
    assert stray_audit.ppid == pid and stray_audit.problems[0] == thread_problem
    assert any(p.startswith("4.0 MiB of anonymous memory (") and p.endswith(") on node 2; "
               "the rank runs on node 1") for p in stray_audit.problems), stray_audit.problems  # fmt: skip
    assert rank_audit.status == "wrong"
    assert f"pid {stray} ({name}) is wrong: {thread_problem} (and 1 more)" in rank_audit.problems
    assert f"pid {stray}: wrong (node 1; {name}, child of {pid}; 1 thread; remote " in text_of(report)
    assert f"rank {pid}: wrong (3 processes: 2 ok, 1 wrong)\n" in text_of(report) and status == 1


@pytest.mark.numa(nodes=4)
def test_a_child_started_under_interleave_all_with_a_locked_buffer_is_reported_with_policy_and_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The rank (sh) is on node 0; it starts a worker under numactl --interleave=all, which
    # locks an 8 MiB pool first touched under that policy.
    worker = f"numactl --interleave=all {' '.join(PLACED)} --cpu-node 0 --map memfd:8:task:lock:numafast-pool-0"
    with placed("numactl", "--cpunodebind=0", "--membind=0", "sh", "-c", f"{worker}; true") as child:
        [pool] = child["maps"]
        kernel = kernel_bytes(child["pid"], pool["start"])
        kernel_policy = numa_maps(child["pid"])[pool["start"]][0]
        locked_bytes = kib(smaps_of(pool["start"], child["pid"])["Locked"])
        parent = int(task_status(pid=child["pid"])["PPid"])
        _, report = check(capsys, str(parent))
    assert kernel == {node: 2 * MIB for node in range(4)} and kernel_policy == "interleave:0-3"
    assert locked_bytes == 8 * MIB
    audit = audit_of(report, child["pid"])
    [finding] = [f for f in audit.policies if f.memory_class is MemoryClass.PAGE_LOCKED]
    assert (finding.policy, finding.size, finding.node_bytes, finding.labels) == ("interleave:0-3", 8 * MIB, kernel,
                                                                                  ["numafast pool"])  # fmt: skip
    cause = ("started under numactl --interleave=all (or set_mempolicy): "
             "page-locked staging buffers interleaved over nodes 0-3")
    assert finding.inherited and finding.cause == cause
    assert finding.fix == "start the rank with `numafast run --cpunodebind 0 --membind 0` instead"
    assert report.ranks[0].processes[0].status == "ok" and report.ranks[0].status == "wrong"
    line = f"  8.0 MiB of page-locked memory (numafast pool) under interleave:0-3: {cause}; fix: {finding.fix}\n"
    assert line in text_of(report), text_of(report)
    assert "  6.0 MiB of page-locked memory (75%) on node 1 2.0 MiB, node 2 2.0 MiB, node 3 2.0 MiB" in text_of(report)


@pytest.mark.numa(nodes=4)
def test_a_well_placed_rank_with_workers_is_ok(capsys: pytest.CaptureFixture[str]) -> None:
    maps = ["--map", "memfd:8:task:lock:numafast-pool-0", "--map", "shm:4:task:torch_1_1_0"]
    with placed("numactl", "--cpunodebind=2", "--membind=2", *PLACED, *maps, "--child", "2", "--child", "2") as rank:
        pids = [rank["pid"], *rank["children"]]
        kernel_nodes = {node for pid in pids for node in own_memory_nodes(pid)}
        pool_kernel = kernel_bytes(rank["pid"], rank["maps"][0]["start"])
        status, report = check(capsys, str(rank["pid"]))
    assert pool_kernel == {2: 8 * MIB} and kernel_nodes == {2}
    assert status == 0 and report.ok, text_of(report)
    [rank_audit] = report.ranks
    assert [p.pid for p in rank_audit.processes] == pids and rank_audit.node == 2
    assert all(p.status == "ok" and p.remote_share == 0 for p in rank_audit.processes)
    assert rank_audit.memory[MemoryClass.PAGE_LOCKED].node_bytes == pool_kernel
    assert f"rank {rank['pid']}: ok (3 processes: 3 ok)\n" in text_of(report), text_of(report)


def test_a_process_that_exits_during_the_audit_is_reported_as_exited(capsys: pytest.CaptureFixture[str]) -> None:
    # bound to node 0, so that the rank is ok on a machine of several nodes too; by numafast
    # run, since numactl cannot run where the installed wheel is tested (libnuma hidden)
    hold = "import subprocess, sys; child = subprocess.Popen(['sleep', '300']); print(child.pid, flush=True); sys.stdin.read()"
    bound = [sys.executable, "-m", "numafast", "run", "--cpunodebind", "0", "--membind", "0", "--"]
    parent = subprocess.Popen([*bound, sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=ENV)  # fmt: skip
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert descendants(parent.pid) == [(child, parent.pid)]
        assert read_process(child).name == "sleep"
        os.kill(child, signal.SIGKILL)  # its parent does not reap it: a zombie, /proc/PID still there
        deadline = time.monotonic() + 60
        while Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.05)
        with pytest.raises(ProcessGone):
            read_process(child)
        status = main(["check", "--max-remote", "1", str(parent.pid)])
    finally:
        parent.communicate("")
    printed = capsys.readouterr()
    assert status == 0 and printed.err == "", printed  # a worker that ended is no fault of the rank
    assert f"pid {child}: exited during the audit (child of {parent.pid})" in printed.out.splitlines(), printed.out
    assert f"rank {parent.pid}: ok (2 processes: 1 ok, 1 exited)" in printed.out, printed.out


WITHOUT_PTRACE = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"]


@contextmanager
def stranger() -> Iterator[int]:
    """Another user's process, which a checker without CAP_SYS_PTRACE may not read."""
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "300"])
    try:
        while Path(f"/proc/{other.pid}/status").read_text().count("65534") < 2:  # setpriv done
            time.sleep(0.05)
        probe = subprocess.run([*WITHOUT_PTRACE, "cat", f"/proc/{other.pid}/numa_maps"], capture_output=True)
        if probe.returncode == 0:
            pytest.skip("this kernel lets root without CAP_SYS_PTRACE read another user's numa_maps "
                        "(a user namespace); the 4-node guest runs this test")  # fmt: skip
        yield other.pid
    finally:
        other.kill()
        other.wait()


def test_another_users_process_is_reported_unreadable() -> None:
    with stranger() as pid:
        result = subprocess.run([*WITHOUT_PTRACE, sys.executable, "-m", "numafast", "check", str(pid)],
                                capture_output=True, text=True, cwd=TESTS.parent, env=ENV, timeout=300)  # fmt: skip
    assert result.returncode == 1 and result.stderr == "", result.stderr
    assert result.stdout == (
        f"pid {pid}: cannot check: /proc/{pid}/numa_maps: Permission denied (another user's process, or one this "
        "checker may not trace; reading it needs that user or CAP_SYS_PTRACE)\n"
    )


def test_a_pid_hidden_by_hidepid_is_missing_with_the_reason() -> None:
    # hidepid hides a process from a reader that may not ptrace it, unless the reader is
    # in the mount's gid= group, which is root's group by default: another gid is given.
    with stranger() as pid:
        command = (f"mount -t proc -o hidepid=2,gid=65533 proc /proc && exec {' '.join(WITHOUT_PTRACE)} "
                   f"{sys.executable} -m numafast check {pid}")  # fmt: skip
        result = subprocess.run(["unshare", "--mount", "sh", "-c", command], capture_output=True, text=True,
                                cwd=TESTS.parent, env=ENV, timeout=300)  # fmt: skip
    assert result.returncode == 1 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"pid {pid}: no such process (/proc is mounted with hidepid="), result.stdout
    assert result.stdout.endswith(": other users' processes are invisible here)\n"), result.stdout
