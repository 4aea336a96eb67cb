"""``numafast.torch.WorkerPlacement``: a plain DataLoader's ``worker_init_fn`` that puts
each worker on a node (for loaders that keep their own collate, with
``pin_memory_hook``), then runs the user's function. Each sample reports, from inside
its worker, where the kernel lets that worker run and allocate, and its index."""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import pytest

from sysfs_truth import node_cpus, online_nodes, thread_policy

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402
from numafast.torch import WorkerPlacement  # noqa: E402

NODE = online_nodes()[-1]
MPOL_PREFERRED, MPOL_BIND = 1, 2
SEMANTICS = pytest.mark.host_only("worker processes cost seconds under TCG; binding itself is tested in test_binding")

_user_init: list[int] = []  # in a worker: the ids the user's own function was called with


def user_init(worker_id: int) -> None:
    _user_init.append(worker_id)


class WhereAmI(Dataset):  # type: ignore[type-arg]
    """Sample i: i, and what the kernel says of the worker that loads it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, Any]:
        mode, nodes = thread_policy()
        return {"index": index, "cpus": sorted(os.sched_getaffinity(0)), "mode": mode & 0xFF, "nodes": nodes,
                "user_init": list(_user_init)}


def samples(placement: WorkerPlacement) -> list[dict[str, Any]]:
    loader = DataLoader(WhereAmI(), batch_size=None, num_workers=2, worker_init_fn=placement)
    return sorted(loader, key=lambda sample: sample["index"])


@SEMANTICS
@pytest.mark.parametrize("strict", [False, True])
def test_each_worker_runs_and_allocates_on_the_node_then_calls_the_users_function(strict: bool) -> None:
    allowed = sorted(set(node_cpus(NODE)) & os.sched_getaffinity(0)) or None  # a node without CPUs: its nearest
    got = samples(WorkerPlacement(NODE, strict=strict, then=user_init))
    assert [sample["index"] for sample in got] == list(range(8))
    for sample in got:
        if allowed is not None:
            assert sample["cpus"] == allowed, sample
        assert (sample["mode"], sample["nodes"]) == (MPOL_BIND if strict else MPOL_PREFERRED, [NODE]), sample
        assert len(sample["user_init"]) == 1 and sample["user_init"][0] in (0, 1), sample  # once, with its id


def test_a_placement_survives_pickling_for_spawned_workers() -> None:
    placement = WorkerPlacement(NODE, strict=True, then=user_init)
    assert pickle.loads(pickle.dumps(placement)) == placement


@pytest.mark.parametrize(("options", "error", "said"), [
    ({"node": 4096}, "InvalidNodeError", "node 4096 does not exist"),
    ({"node": NODE, "strict": "yes"}, "TypeError", "strict must be True or False, not 'yes'"),
    ({"node": NODE, "then": 5}, "TypeError", "then must be the user's worker_init_fn"),
])  # fmt: skip
def test_a_placement_is_checked_where_it_is_made(options: dict[str, Any], error: str, said: str) -> None:
    # Each was taken as given, to fail (or, strict="yes", bind loosely) in every worker.
    with pytest.raises(Exception, match=said) as raised:
        WorkerPlacement(**options)
    assert type(raised.value).__name__ == error


def test_numa_loaders_strict_takes_only_a_bool() -> None:
    # strict="yes" was kept as given, and its workers' memory only preferred the node.
    with pytest.raises(TypeError, match="strict must be True or False, not 'yes'"):
        numafast.torch.NumaLoader(WhereAmI(), strict="yes")
    assert numafast.torch.NumaLoader(WhereAmI(), strict=np.bool_(True)).strict is True
