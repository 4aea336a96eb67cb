"""A repaired binary wheel, checked where it is installed: .ci/wheel-check, .ci/wheel-aarch64.

NUMAFAST_WHEEL_CHECK names the folder the wheel was installed into (a virtual
environment, or a folder the wheel was unpacked into and put on PYTHONPATH), on a
machine, or in a QEMU guest, whose own libnuma is hidden or deleted. These checks
prove, in the process that runs them, that the package under test is the installed
one and that the libnuma it runs on is the copy the wheel bundles. Elsewhere they skip.

The same checks also run as a script, one interpreter in all (in the QEMU guests a
pytest start costs tens of seconds of TCG), followed by `numafast show`:

    NUMAFAST_WHEEL_CHECK=FOLDER python -P tests/test_installed_wheel.py NODES

which also asserts that numafast sees NODES NUMA nodes (the machine's or guest's).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import sys
from pathlib import Path

import pytest

import numafast
from numafast import _libnuma

WHEEL_FOLDER = os.environ.get("NUMAFAST_WHEEL_CHECK")

pytestmark = pytest.mark.skipif(WHEEL_FOLDER is None, reason="checks an installed wheel; runs in .ci/wheel-check")


def test_numafast_is_the_installed_package() -> None:
    assert WHEEL_FOLDER is not None
    for module_file in (numafast.__file__, _libnuma.__file__):
        assert module_file is not None and Path(module_file).is_relative_to(WHEEL_FOLDER), module_file


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
    # Hidden (.ci/without-libnuma) or deleted (in a guest): the wheel needs nothing from apt.
    with pytest.raises(OSError, match="libnuma.so.1"):
        ctypes.CDLL("libnuma.so.1")


def main(argv: list[str]) -> int:
    """The checks above, then `numafast show`, asserting it sees int(argv[0]) nodes."""
    if WHEEL_FOLDER is None or len(argv) != 1 or not argv[0].isdigit():
        sys.exit("usage: NUMAFAST_WHEEL_CHECK=FOLDER python -P tests/test_installed_wheel.py NODES")
    for check in (test_numafast_is_the_installed_package, test_the_libnuma_loaded_is_the_bundled_copy,
                  test_the_system_libnuma_is_not_there):  # fmt: skip
        check()
        print(f"installed wheel: {check.__name__}: ok")
    from numafast.cli import main as numafast_main

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        status = numafast_main(["show", "--json"])
    nodes = json.loads(shown.getvalue())["nodes"]
    print(f"installed wheel: numafast {numafast.__version__} under Python {sys.version.split()[0]}: "
          f"`numafast show --json` exit {status}, {len(nodes)} nodes")  # fmt: skip
    assert status == 0 and len(nodes) == int(argv[0]), (status, len(nodes))
    return numafast_main(["show"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
