"""Validation of node ids and CPU sets: errors name the value and what is allowed."""

from __future__ import annotations

import os

import pytest

from numafast import InvalidCpuSetError, InvalidNodeError
from numafast._validate import check_cpus, check_node, check_nodes, format_ids, parse_ids
from sysfs_truth import online_nodes


@pytest.mark.parametrize(("text", "ids"), [("0-2,5\n", [0, 1, 2, 5]), ("", []), ("7\x00", [7]), ("0,250-252", [0, 250, 251, 252])])
def test_parse_and_format_round_trip(text: str, ids: list[int]) -> None:
    assert parse_ids(text) == ids
    if ids:
        assert parse_ids(format_ids(ids)) == ids


@pytest.mark.parametrize("text", ["65536", "0-70000", "1,3-65536"])
def test_ids_no_kernel_has_are_refused_before_they_are_counted(text: str) -> None:
    # They were counted out: 0-3000000000 built a list of 3e9 ids (MemoryError, or all memory).
    with pytest.raises(ValueError, match=r"names ids up to \d+: no kernel has one past 65535"):
        parse_ids(text)
    assert parse_ids("65535") == [65535]


def test_online_nodes_pass() -> None:
    assert check_nodes(reversed(online_nodes())) == online_nodes()


@pytest.mark.parametrize("bad", [-1, 4096, "0", 1.0, True, None])
def test_unknown_node_names_value_and_nodes_here(bad: object) -> None:
    with pytest.raises(InvalidNodeError, match=r"nodes here: ") as raised:
        check_node(bad)
    assert repr(bad) in str(raised.value) or str(bad) in str(raised.value)


def test_empty_node_list_is_rejected() -> None:
    with pytest.raises(InvalidNodeError, match="no node given"):
        check_nodes([])


def test_cpus_must_be_allowed_and_not_empty() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert check_cpus(allowed[::-1]) == allowed
    with pytest.raises(InvalidCpuSetError, match="empty CPU set; allowed CPUs: "):
        check_cpus([])
    with pytest.raises(InvalidCpuSetError, match=r"cpu 4095 not allowed; allowed CPUs: "):
        check_cpus([4095])
    with pytest.raises(InvalidCpuSetError, match="not a CPU id"):
        check_cpus([-3])
