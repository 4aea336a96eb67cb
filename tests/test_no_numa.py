"""A kernel without NUMA (issue 45): its NUMA system calls answer ENOSYS, for real, under
the seccomp filter of tests/seccomp_exec.c. Pinned pools still run, unplaced, with one
warning that points at the user's line."""

from __future__ import annotations

import pytest

from test_policy_seccomp import under_seccomp  # noqa: F401  (the fixture)

pytestmark = pytest.mark.host_only("seccomp refusals: the same whatever the nodes")

NO_NUMA = "get_mempolicy:ENOSYS,set_mempolicy:ENOSYS,mbind:ENOSYS,migrate_pages:ENOSYS,move_pages:ENOSYS"

POOLS = """
import warnings
import numpy as np
import numafast
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pools = [numafast.PinnedPool(0, 1 << 16, 4, lock="off") for _ in range(2)]
    slots = [pool.acquire(1 << 16) for pool in pools for _ in range(4)]
for index, slot in enumerate(slots):
    np.asarray(slot)[:] = index  # every slot its own bytes
print(all((np.asarray(slot) == index).all() for index, slot in enumerate(slots)))
for warning in caught:
    print(warning.category.__name__, warning.filename, warning.lineno, warning.message)
"""


@pytest.mark.parametrize("blocked", [NO_NUMA, "mbind:ENOSYS"])
def test_pools_run_unplaced_on_a_kernel_without_numa_with_one_warning(under_seccomp, blocked: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    result = under_seccomp(blocked, POOLS)
    assert result.returncode == 0, result.stderr
    same, *said = result.stdout.splitlines()
    assert same == "True"
    assert len(said) == 1, said  # two pools, one warning
    category, filename, line, message = said[0].split(" ", 3)
    assert (category, filename, line) == ("RuntimeWarning", "<string>", "7")  # the line that made the pool
    calls, said_why = message.split(": ", 1)  # the calls refused, each named
    assert calls == ("mbind" if blocked == "mbind:ENOSYS" else "get_mempolicy, set_mempolicy, mbind")
    assert said_why.startswith("this kernel has no NUMA support (ENOSYS)") and "not placed on node 0" in message
    assert "Nothing to do" in message
