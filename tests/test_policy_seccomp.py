"""A kernel that refuses the NUMA system calls, as a container's seccomp profile does:
tests/seccomp_exec.c installs a real seccomp filter answering them with EPERM."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
# A system call refused by a filter: how numafast reports it does not depend on the nodes
# (~44 s of the 4-node guest's TCG for a Python child per case).
pytestmark = pytest.mark.host_only("seccomp refusals: the same whatever the nodes")


@pytest.fixture(scope="module")
def under_seccomp(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], subprocess.CompletedProcess[str]]:
    if os.uname().machine != "x86_64":
        pytest.skip("seccomp_exec.c filters x86-64 system call numbers")
    helper = tmp_path_factory.mktemp("seccomp") / "seccomp_exec"
    subprocess.run(["cc", "-O2", "-o", str(helper), str(TESTS / "seccomp_exec.c")], check=True)

    def run(blocked: str, code: str) -> subprocess.CompletedProcess[str]:
        command = [str(helper), blocked, "--", sys.executable, "-c", code]
        return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=TESTS.parent, timeout=300)

    return run


REFUSED = """
import os, numafast
from numafast import _libnuma
def policy():
    try:
        return _libnuma.get_mempolicy()
    except OSError as error:  # get_mempolicy itself blocked
        return error.errno
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[-1]})             # so that numa_local's CPU step really changes something
before = (os.sched_getaffinity(0), policy())
node = _libnuma.node_of_cpu(cpus[0])
try:
    with numafast.numa_local(node):
        print("entered")
except numafast.PolicyNotPermitted as error:
    print("refused:", error)
print("restored" if (os.sched_getaffinity(0), policy()) == before else "HALF-APPLIED")
capability = numafast.capabilities().set_mempolicy
print("set_mempolicy:", capability.available, capability.reason)
"""


def test_set_mempolicy_refused_with_eperm_names_cause_and_remedy_and_undoes_the_cpu_step(under_seccomp) -> None:  # type: ignore[no-untyped-def]
    result = under_seccomp("set_mempolicy", REFUSED)
    assert result.returncode == 0, result.stderr
    refused, restored, capability = result.stdout.splitlines()
    assert refused.startswith("refused: set_mempolicy(preferred, nodes ") and "refused with EPERM" in refused
    assert "seccomp: filter active" in refused and "--cap-add SYS_NICE" in refused
    assert restored == "restored"
    assert capability.startswith("set_mempolicy: False set_mempolicy refused with EPERM; ")


def test_blocked_get_mempolicy_is_said_and_the_other_calls_still_probed(under_seccomp) -> None:  # type: ignore[no-untyped-def]
    # Docker's default profile without CAP_SYS_NICE blocks all three: each is named, with the fix.
    code = (
        "import numafast; c = numafast.capabilities()\n"
        "for item in (c.numa, c.set_mempolicy, c.cpu_affinity): print(item.available, item.reason)"
    )
    result = under_seccomp("get_mempolicy,set_mempolicy,mbind", code)
    assert result.returncode == 0, result.stderr
    numa, set_mempolicy, cpu_affinity = result.stdout.splitlines()
    assert numa.startswith("False get_mempolicy refused with EPERM; ") and "SYS_NICE" in numa
    assert set_mempolicy.startswith("False set_mempolicy refused with EPERM; ") and "no CAP_SYS_NICE" in set_mempolicy
    assert cpu_affinity == "True "


def test_blocked_get_mempolicy_refuses_a_block_before_it_changes_anything(under_seccomp) -> None:  # type: ignore[no-untyped-def]
    result = under_seccomp("get_mempolicy", REFUSED)
    assert result.returncode == 0, result.stderr
    refused, restored, _ = result.stdout.splitlines()
    # The allowed nodes come from /proc/self/status; the refusal is met reading the policy to restore.
    assert refused.startswith("refused: get_mempolicy (reading the policy to restore, before setting preferred on nodes ")
    assert "refused with EPERM" in refused and "--cap-add SYS_NICE" in refused
    assert restored == "restored"


def test_blocked_mbind_and_move_pages_are_reported_with_the_cause(under_seccomp) -> None:  # type: ignore[no-untyped-def]
    code = "import numafast; c = numafast.capabilities()\nfor item in (c.set_mempolicy, c.mbind, c.move_pages): print(item.available, item.reason)"
    result = under_seccomp("mbind,move_pages", code)
    assert result.returncode == 0, result.stderr
    set_mempolicy, mbind, move_pages = result.stdout.splitlines()
    assert set_mempolicy == "True "
    assert mbind.startswith("False mbind refused with EPERM; ") and "SYS_NICE" in mbind
    assert move_pages.startswith("False move_pages refused with EPERM; ")
