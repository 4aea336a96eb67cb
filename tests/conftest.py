"""The ``numa`` marker: tests that need a multi-node kernel.

``@pytest.mark.numa(nodes=4)`` needs at least 4 online NUMA nodes;
``@pytest.mark.numa(memory_only=True)`` needs a node with memory and no CPUs.
``@pytest.mark.host_only("why")`` marks a test with nothing kernel-specific
(replays of sysfs snapshots): it is skipped inside the guests, where TCG and
the 9p root make each such test take seconds.
Elsewhere such a test is skipped with a reason. Inside a guest booted by
``tests/run_suite.py`` (NUMAFAST_GUEST=1), a marked test whose needs the guest
meets and that still ends skipped is turned into a failure: a guest run must
prove placement, never pass by skipping.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sysfs_truth import cpuless_nodes_with_memory, online_nodes
from time_limit import IN_GUEST, pytest_configure, pytest_runtest_protocol  # noqa: F401 - hooks: every test ends

# Where tests/run_suite.py wants the outcomes of the numa-marked tests.
MARKER_REPORT = os.environ.get("NUMAFAST_MARKER_REPORT")
_marked_outcomes: dict[str, str] = {}


def _unmet_need(marker: pytest.Mark) -> str | None:
    """Why this kernel cannot run a test with this marker, or None if it can."""
    nodes_needed = int(marker.kwargs.get("nodes", 2))
    nodes = online_nodes()
    if len(nodes) < nodes_needed:
        return (
            f"needs {nodes_needed} NUMA nodes, this kernel has {len(nodes)}; "
            "runs in the multi-node guests of tests/run_suite.py"
        )
    if marker.kwargs.get("memory_only") and not cpuless_nodes_with_memory():
        return "needs a memory-only (CPU-less) node; runs in the memory-only guest of tests/run_suite.py"
    return None


@pytest.fixture(autouse=True)
def cold_loader_pools() -> Iterator[None]:
    """Each test's first loader starts without pools: numafast keeps a gone loader's
    pools for the next loader on the node, which would carry one test into the next."""
    loaders = sys.modules.get("numafast.torch")
    if loaders is not None:
        loaders.close_idle_pools()
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        host_only = item.get_closest_marker("host_only")
        if IN_GUEST and host_only is not None:
            item.add_marker(pytest.mark.skip(reason=f"host only: {host_only.args[0]}"))
        marker = item.get_closest_marker("numa")
        if marker is not None and (reason := _unmet_need(marker)) is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("numa")
    if IN_GUEST and marker is not None and report.skipped and _unmet_need(marker) is None:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid}: a numa-marked test was skipped inside a guest that meets its "
            f"needs ({marker.kwargs}); the skip was: {report.longrepr}"
        )
    if marker is not None and (report.when == "call" or report.outcome != "passed"):
        _marked_outcomes.setdefault(item.nodeid, report.outcome)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if MARKER_REPORT:
        Path(MARKER_REPORT).write_text(json.dumps(_marked_outcomes, indent=1, sort_keys=True))
