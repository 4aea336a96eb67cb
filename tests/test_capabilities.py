"""capabilities(): what works here, probed once and without touching the caller."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numafast
from numafast import _libnuma

TESTS = Path(__file__).resolve().parent


def kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


def test_capabilities_match_this_kernel() -> None:
    found = numafast.capabilities()
    assert found.kernel == os.uname().release
    assert found.numa.available and found.set_mempolicy.available and found.cpu_affinity.available
    assert found.mbind.available and found.move_pages.available
    assert found.preferred_many.available == (kernel_at_least(5, 15) and _libnuma.has_preferred_many() > 0)
    assert found.weighted_interleave.available == kernel_at_least(6, 9)
    if not found.weighted_interleave.available:
        assert "needs Linux 6.9+" in found.weighted_interleave.reason
    assert numafast.capabilities() is found  # probed once
    assert "weighted_interleave" in str(found)


def test_first_probe_leaves_the_callers_placement_alone() -> None:
    code = (
        "import os; from numafast import _libnuma; import numafast\n"
        "_libnuma.set_mempolicy(_libnuma.MPOL_INTERLEAVE, [0]); os.sched_setaffinity(0, {0})\n"
        "before = (os.sched_getaffinity(0), _libnuma.get_mempolicy())\n"
        "numafast.capabilities()\n"
        "print(before == (os.sched_getaffinity(0), _libnuma.get_mempolicy()))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=TESTS.parent)
    assert result.stdout.strip() == "True", result.stderr
