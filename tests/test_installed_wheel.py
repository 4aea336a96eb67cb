"""The repaired binary wheel, checked from inside the test run of .ci/wheel-check.

.ci/wheel-check installs the wheel into a fresh virtual environment, hides
Debian's libnuma (a private mount namespace), and runs the host tests from a copy
of tests/ with NUMAFAST_WHEEL_CHECK naming that environment. These tests prove,
in that same pytest process, that the package under test is the installed one
and that the libnuma it runs on is the copy the wheel bundles. Elsewhere they skip.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

import numafast
from numafast import _libnuma

WHEEL_VENV = os.environ.get("NUMAFAST_WHEEL_CHECK")

pytestmark = pytest.mark.skipif(WHEEL_VENV is None, reason="checks the installed wheel; runs in .ci/wheel-check")


def test_numafast_is_the_installed_package() -> None:
    assert WHEEL_VENV is not None
    for module_file in (numafast.__file__, _libnuma.__file__):
        assert module_file is not None and Path(module_file).is_relative_to(WHEEL_VENV), module_file


def test_the_libnuma_loaded_is_the_bundled_copy() -> None:
    assert _libnuma.available() == 0  # libnuma is loaded and working
    mapped = {
        path for line in Path("/proc/self/maps").read_text().splitlines()
        if Path(path := line.split()[-1]).name.startswith("libnuma")
    }  # fmt: skip
    bundled = Path(numafast.__file__).parent.parent / "numafast.libs"
    assert mapped, "no libnuma mapped"
    assert all(Path(path).parent == bundled for path in mapped), mapped


def test_the_system_libnuma_is_not_there() -> None:
    # The namespace of .ci/wheel-check hides it: the wheel needs nothing from apt.
    with pytest.raises(OSError, match="libnuma.so.1"):
        ctypes.CDLL("libnuma.so.1")
