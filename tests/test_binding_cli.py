"""``numafast run`` and ``numafast check``: the child's placement as its /proc and
the kernel report it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sysfs_truth import node_cpus, online_nodes

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
REPORT = (
    "import json, os; import numpy as np; from sysfs_truth import page_nodes, thread_policy;"
    "print(json.dumps([sorted(os.sched_getaffinity(0)), thread_policy(), sorted(set(page_nodes(np.ones(1 << 17))))]))"
)


def numafast(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "numafast", *args], capture_output=True, text=True,
                          cwd=TESTS.parent, env=ENV, timeout=300)  # fmt: skip


def test_run_execs_the_command_with_cpus_and_policy_it_inherits() -> None:
    cpu, node = max(os.sched_getaffinity(0)), online_nodes()[0]
    result = numafast("run", "--physcpubind", str(cpu), "--preferred", str(node), "--", sys.executable, "-c", REPORT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[cpu], [1, [node]], [node]]


@pytest.mark.host_only("argument checks, a CLI start each (~10 s under the guests' TCG): the same on any kernel")
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--membind", "4095", "--", "true"], "node 4095 does not exist; nodes here"),
        (["--physcpubind", "4095", "--", "true"], "cpu 4095 not allowed; allowed CPUs"),
        (["--preferred", "0"], "no command given"),
        (["--", "no-such-command-here"], "command not found: no-such-command-here"),
    ],
)
def test_run_refuses_bad_input_clearly(options: list[str], message: str) -> None:
    result = numafast("run", *options)
    assert result.returncode == 1 and f"numafast run: {message}" in result.stderr, result.stderr


def test_check_reports_this_process_and_a_missing_one() -> None:
    result = numafast("check", str(os.getpid()), "999999999")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[-1] == "pid 999999999: no such process"


@pytest.mark.numa(nodes=4)
def test_run_binds_a_child_to_a_node_and_check_audits_it() -> None:
    result = numafast("run", "--cpunodebind", "2", "--membind", "2", "--", sys.executable, "-c", REPORT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [node_cpus(2), [2, [2]], [2]]

    child = subprocess.Popen(
        [sys.executable, "-m", "numafast", "run", "--cpunodebind", "1", "--membind", "1", "--",
         sys.executable, "-c", "import numpy, sys; a = numpy.ones(1 << 21); sys.stdout.write('ready\\n');"
         "sys.stdout.flush(); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        right = numafast("check", "--node", "1", str(child.pid))
        wrong = numafast("check", "--node", "3", str(child.pid))
    finally:
        child.communicate("")
    assert right.returncode == 0 and right.stdout.startswith(f"pid {child.pid}: ok (node 1;"), right.stdout
    assert wrong.returncode == 1 and f"pid {child.pid}: wrong (node 3;" in wrong.stdout, wrong.stdout
    assert "(nodes 1); expected on node 3 (--node)" in wrong.stdout
    assert "of anonymous memory (100%) on node 1; expected on node 3 (--node)" in wrong.stdout, wrong.stdout


@pytest.mark.numa(nodes=4)
def test_check_flags_an_unbound_process_on_a_multi_node_machine() -> None:
    result = numafast("check", str(os.getpid()))
    assert result.returncode == 1 and "wrong (unbound;" in result.stdout, result.stdout
