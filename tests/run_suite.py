#!/usr/bin/env python3
"""The whole test suite: pytest on this host, then inside two QEMU guests whose
kernels have real multi-node NUMA topologies (see tests/numa_vm.py):

* ``4-nodes``: 4 nodes of one CPU each, distances 10/16/32;
* ``memory-only``: 3 nodes, 2 CPUs, node 2 has memory and no CPUs; only the
  tests marked ``numa`` (the ones that need its topology: every other test has
  run on a multi-node kernel in the 4-node guest already).

Two aarch64 guests run only when named (``--guest aarch64``; CI's .ci/aarch64),
on Debian's arm64 kernel and a root of Debian arm64 packages, with numafast's
extension cross-compiled into the tree first (tests/aarch64_vm.py), under the
guest's own python3 (3.11) and no torch (importing it under TCG takes minutes):

* ``aarch64``: 4 nodes of one CPU each, distances 10/16/32: the topology,
  placement, memory, pool and board test files (AARCH64_TESTS), less a few
  slow ones that test nothing of the architecture (AARCH64_SLOW);
* ``aarch64-grace``: Grace-like, 2 nodes of 2 CPUs and 2 CPU-less nodes with
  memory (a GPU's HBM on Grace); the tests of those files marked
  ``numa(memory_only=True)``;
* ``aarch64-16k``: the 4-node topology on Debian's arm64-16k kernel (16 KiB pages,
  checked in the guest first): numafast built natively there from its sdist with
  pip and gcc (aarch64_vm.NATIVE_BUILD), then ``aarch64``'s tests on that build.

Tests marked ``@pytest.mark.numa`` skip on a one-node host and must run in a
guest that meets their needs (tests/conftest.py fails them otherwise). Each run
prints its counts; the last line is the total. Exit status 0 only if every run
passed and every guest ran numa-marked tests.

The first guest named runs beside the host run, in a process of its own whose
output is printed when it ends (also kept in .test-results/logs/): a TCG guest
alone keeps 1.1-1.2 of the 2-core development machine's cores busy. Side by side
each runs slower (there, in CI: the 4-node guest 1,864 s instead of 1,133, the
host 934 s instead of 715), and the three runs took 1,865 s instead of 2,111.
``--one-at-a-time`` runs everything in turn.

Usage: python3 tests/run_suite.py [--host-only | --no-host] [--guest NAME]... [--one-at-a-time] [-- PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aarch64_vm
from numa_vm import FOUR_NODES, MEMORY_ONLY, GuestTopology, run_in_guest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / ".test-results"
GUESTS: dict[str, GuestTopology] = {
    "4-nodes": FOUR_NODES,
    "memory-only": MEMORY_ONLY,
    "aarch64": aarch64_vm.AARCH64_FOUR_NODES,
    "aarch64-grace": aarch64_vm.AARCH64_GRACE,
    "aarch64-16k": aarch64_vm.AARCH64_FOUR_NODES,
}
# The guests run when none is named: the x86-64 ones (the aarch64 lane is .ci/aarch64).
DEFAULT_GUESTS = ["4-nodes", "memory-only"]
AARCH64_GUESTS = {"aarch64", "aarch64-grace", "aarch64-16k"}
# Each aarch64 guest's kernel, by page size in KiB.
AARCH64_PAGE_KIB = {"aarch64": 4, "aarch64-grace": 4, "aarch64-16k": 16}
# What the aarch64 guests test: topology, placement, memory, pools and the board.
AARCH64_TESTS = sorted(
    {f"tests/{name}" for name in ("test_topology_live.py", "test_binding_live.py", "test_memory_live.py",
                                  "test_pages_live.py", "test_libnuma.py", "test_pool_share.py")}
    | {str(path.relative_to(REPO)) for pattern in ("test_pool*.py", "test_board*.py")
       for path in (REPO / "tests").glob(pattern) if "cuda" not in path.name}  # CUDA: none there
)  # fmt: skip
# Left out there, each ~20-70 s under aarch64 TCG and nothing of the architecture in
# it: cgroup cpusets (three tests), a spawned (not forked) process, 64 claimers at once,
# filling a node until the OOM killer comes (the x86 memory-only guest runs it).
AARCH64_SLOW = "not (cpuset or spawned_process_maps or many_processes_claiming or node_is_full)"
# The test files with numa-marked tests: the only ones the memory-only guest collects
# (importing the other 46, torch's and the frameworks' among them, took ~2 of its
# ~4.5 minutes under TCG, to deselect every test in them).
NUMA_MARKED_TESTS = sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py")
                           if "pytest.mark.numa" in path.read_text())  # fmt: skip
# Each guest's own pytest arguments: the memory-only guest runs the marked tests alone,
# which keeps CI within its 40 minutes (its unmarked tests took ~310 s and repeated
# the 4-node guest's run).
GUEST_ARGS: dict[str, list[str]] = {
    "4-nodes": [],
    "memory-only": ["-mnuma"],
    "aarch64": [*AARCH64_TESTS, "-k", AARCH64_SLOW],
    "aarch64-grace": [*(t for t in AARCH64_TESTS if "memory_only=True" in (REPO / t).read_text()),
                      "-k", AARCH64_SLOW, "-m", "numa(memory_only=True)"],
    "aarch64-16k": [*AARCH64_TESTS, "-k", AARCH64_SLOW],
}
# The 4-node guest took 1,133 s alone on the 2-core machine, 1,864 s beside the host run.
GUEST_TIMEOUT_S = 2700
LOGS = RESULTS / "logs"  # the output of each run beside another


@dataclass
class RunResult:
    name: str
    exit_code: int
    seconds: float
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    marked_ran: int = 0
    marked_skipped: int = 0

    def line(self) -> str:
        return (
            f"{self.name:>11}: {self.passed} passed, {self.failed} failed, {self.skipped} skipped"
            f" | numa-marked: {self.marked_ran} ran, {self.marked_skipped} skipped"
            f" | exit {self.exit_code} | {self.seconds:.1f} s"
        )


def _pytest_command(name: str, extra: list[str], python: str = sys.executable) -> list[str]:
    """pytest on all of tests/ (the memory-only guest: NUMA_MARKED_TESTS), or on the
    paths given among the extra arguments."""
    paths = [] if any(not a.startswith("-") for a in extra) else NUMA_MARKED_TESTS if name == "memory-only" else ["tests"]
    return [
        python, "-m", "pytest", "-q", *paths,
        f"--junitxml={RESULTS / f'{name}.xml'}", *extra,
    ]  # fmt: skip


def _collect(result: RunResult) -> RunResult:
    """Fill the counts from the run's JUnit XML and numa-marker report."""
    xml_path = RESULTS / f"{result.name}.xml"
    if xml_path.exists():
        suite = ElementTree.parse(xml_path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        assert suite is not None
        total = int(suite.get("tests", 0))
        result.failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        result.skipped = int(suite.get("skipped", 0))
        result.passed = total - result.failed - result.skipped
    marker_path = RESULTS / f"{result.name}.markers.json"
    if marker_path.exists():
        outcomes = json.loads(marker_path.read_text()).values()
        result.marked_ran = sum(o != "skipped" for o in outcomes)
        result.marked_skipped = sum(o == "skipped" for o in outcomes)
    return result


def run_host(extra: list[str]) -> RunResult:
    print("==== host: pytest", flush=True)
    env = {**os.environ, "NUMAFAST_MARKER_REPORT": str(RESULTS / "host.markers.json")}
    start = time.monotonic()
    code = subprocess.call(_pytest_command("host", extra), cwd=REPO, env=env)
    return _collect(RunResult("host", code, time.monotonic() - start))


def start_beside(name: str, extra: list[str]) -> Callable[[], RunResult]:
    """Guest ``name``'s run in a process of its own, beside this one's runs, its output
    in LOGS/NAME.log; what waits for it (its guest ends at GUEST_TIMEOUT_S), prints
    that output and counts the run."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{name}.log"
    print(f"==== guest {name}: beside the runs below; its output follows theirs ({log.relative_to(REPO)})", flush=True)
    start = time.monotonic()
    with log.open("wb") as out:
        # setpriv: it ends with this process, as its guest ends with it (numa_vm's qemu).
        process = subprocess.Popen(["setpriv", "--pdeathsig", "TERM", "--", sys.executable, __file__, "--no-host",
                                    "--guest", name, "--", *extra],
                                   cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    ended: list[float] = []  # when it ended, which may be long before it is waited for

    def wait() -> None:
        process.wait()
        ended.append(time.monotonic())

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()

    def finish() -> RunResult:
        waiter.join()
        sys.stdout.write(log.read_text(errors="replace"))
        sys.stdout.flush()
        return _checked(_collect(RunResult(name, process.returncode, ended[0] - start)))

    return finish


def _checked(result: RunResult) -> RunResult:
    """``result``, failed where its guest ran no numa-marked test."""
    if result.exit_code == 0 and result.marked_ran == 0:
        print(f"run_suite: guest {result.name} ran no numa-marked test", file=sys.stderr)
        result.exit_code = 1
    return result


def _aarch64_package() -> Path:
    """What pip installs in the 16 KiB-page guest: the tree's sdist, built here, or the
    file $NUMAFAST_AARCH64_16K_PACKAGE names (a cp311 aarch64 wheel, to test it there)."""
    named = os.environ.get("NUMAFAST_AARCH64_16K_PACKAGE")
    return Path(named).resolve() if named else aarch64_vm.sdist(RESULTS / "sdist")


def run_guest(name: str, extra: list[str]) -> RunResult:
    topology = GUESTS[name]
    print(f"==== guest {name}: {topology.describe()}: pytest", flush=True)
    env = {
        "NUMAFAST_GUEST": "1",
        "NUMAFAST_MARKER_REPORT": str(RESULTS / f"{name}.markers.json"),
        # Plugins such as hypothesis' cost ~10 s per pytest start under TCG.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        # Policies act at first touch: give large arrays fresh mappings (see README).
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    start = time.monotonic()
    if name in AARCH64_GUESTS:
        # The guest's own python3, on the root made (and the extension cross-built) by main().
        command = _pytest_command(name, [*GUEST_ARGS[name], *extra], python="python3")
        page_kib = AARCH64_PAGE_KIB[name]
        shared: list[Path] = []
        if page_kib != 4:  # pytest on numafast as pip builds it there from the sdist
            package = _aarch64_package()
            shared = [] if package.is_relative_to(REPO) else [package.parent]  # the tree is shared already
            command = ["bash", "-c", aarch64_vm.NATIVE_BUILD, name, str(package), str(page_kib * 1024), *command]
        code = run_in_guest(command, topology, cwd=REPO, env=env, timeout=GUEST_TIMEOUT_S, root=aarch64_vm.root_dir(),
                            kernel=aarch64_vm.kernel(page_kib), rw=shared)  # fmt: skip
    else:
        command = _pytest_command(name, [*GUEST_ARGS[name], *extra])
        code = run_in_guest(command, topology, cwd=REPO, env=env, timeout=GUEST_TIMEOUT_S)
    return _checked(_collect(RunResult(name, code, time.monotonic() - start)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-only", action="store_true", help="skip the guest runs")
    parser.add_argument("--no-host", action="store_true", help="skip the host run")
    parser.add_argument("--guest", action="append", choices=sorted(GUESTS),
                        help=f"only these guests (default: {', '.join(DEFAULT_GUESTS)})")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="run the first guest after the host run, not beside it")
    parser.add_argument("pytest_args", nargs="*", help="passed on to every pytest run")
    args = parser.parse_args()
    guests = [] if args.host_only else args.guest or DEFAULT_GUESTS
    runs = guests if args.no_host else ["host", *guests]
    RESULTS.mkdir(exist_ok=True)
    for stale in RESULTS.iterdir():  # only this run's: CI's aarch64 phase runs apart from the others
        if stale.name.split(".")[0] in runs:
            stale.unlink()

    beside = None
    if not args.no_host and guests and guests[0] not in AARCH64_GUESTS and not args.one_at_a_time:
        beside = start_beside(guests[0], args.pytest_args)
        guests = guests[1:]
    results = [] if args.no_host else [run_host(args.pytest_args)]
    if guests:
        if AARCH64_GUESTS & set(guests):
            print("==== aarch64: the arm64 root, the extension cross-built", flush=True)
            try:
                aarch64_vm.build_extension(aarch64_vm.prepare())
                # Compiled here (numafast's modules, the test modules as pytest rewrites
                # them), each .pyc is the guest's too: same Python 3.11, same pytest.
                subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                                *AARCH64_TESTS], cwd=REPO, stdout=subprocess.DEVNULL, check=False)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
                print(f"run_suite: no aarch64 guest: {error}", file=sys.stderr)
                results += [RunResult(name, 1, 0.0) for name in guests if name in AARCH64_GUESTS]
                guests = [name for name in guests if name not in AARCH64_GUESTS]
        for name in guests:
            results.append(run_guest(name, args.pytest_args))
    if beside is not None:
        results.insert(1, beside())

    print("==== summary")
    for result in results:
        print(result.line())
    passed = sum(r.passed for r in results)
    failed = sum(r.failed for r in results)
    skipped = sum(r.skipped for r in results)
    # A run that died before writing its counts still fails the suite.
    failed += sum(1 for r in results if r.exit_code != 0 and r.failed == 0)
    print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
    return 0 if all(r.exit_code == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
