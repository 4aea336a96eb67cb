"""Process-wide state has one home, numafast/_process.py, and a forked child one reset:
what it inherits and what it forgets is checked here in a real child forked from a
process with loaders, pools, a budget reservation and a persistent iterator, and by
the content of the parent's batches before and after."""

from __future__ import annotations

import ast
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import numafast

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402
from numafast import _process  # noqa: E402
from numafast.torch import fork_watch  # noqa: E402

PACKAGE = Path(numafast.__file__).parent
SEMANTICS = pytest.mark.host_only("what a forked child keeps, the same on any kernel; workers cost seconds under TCG")


class Tagged(Dataset):  # type: ignore[type-arg]
    """Sample i: (a tensor full of i, i)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return torch.full((512,), float(index)), index


def at_fork_hooks() -> dict[str, list[str]]:
    """Every ``os.register_at_fork`` call in numafast's sources: file -> its keywords."""
    found: dict[str, list[str]] = {}
    for source in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.register_at_fork":
                found.setdefault(str(source.relative_to(PACKAGE)), []).extend(k.arg or "" for k in node.keywords)
    return found


def test_a_forked_child_is_reset_in_one_place() -> None:
    hooks = at_fork_hooks()
    in_child = [path for path, keywords in hooks.items() if "after_in_child" in keywords]
    assert in_child == ["_process.py"], hooks


def epoch(loader: Any) -> list[int]:
    """The samples of one epoch, each batch checked by content (values == index)."""
    seen = []
    for values, indices in loader:
        assert torch.equal(values, indices.to(values.dtype)[:, None].expand_as(values))
        seen.extend(indices.tolist())
    return seen


def in_a_forked_child(report: Callable[[], Any]) -> Any:
    """``report()`` as a real ``os.fork()`` child of this process returns it (JSON)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.write(write, json.dumps(report()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        reported = json.loads(pipe.read())
    assert os.waitpid(child, 0)[1] == 0
    return reported


@SEMANTICS
def test_a_forked_child_keeps_and_forgets_what_process_py_says() -> None:
    persistent = numafast.torch.NumaLoader(DataLoader(Tagged(), batch_size=8, num_workers=2, persistent_workers=True))
    assert sorted(epoch(persistent)) == list(range(64))
    dropped = numafast.torch.NumaLoader(DataLoader(Tagged(), batch_size=8, num_workers=1))
    assert sorted(epoch(dropped)) == list(range(64))
    del dropped
    gc.collect()  # its pools go idle, kept for the next loader on their node
    assert _process.idle_pools and _process.reserved > 0 and len(_process.loader_iterators) == 1
    inherited = list(_process.loader_iterators)
    _process.first_time("said in the parent")
    said = sorted(_process.done_once)
    reported = in_a_forked_child(lambda: {
        "pid": _process.pid == os.getpid(), "reserved": _process.reserved,
        "idle": len(_process.idle_pools), "iterators": len(_process.loader_iterators),
        "shut": [getattr(iterator, "_shutdown", None) for iterator in inherited],
        "pools": len(_process.live_pools) > 0, "tokens": sorted(_process.open_tokens),
        "once": sorted(_process.done_once),
    })  # fmt: skip
    assert reported == {"pid": True, "reserved": 0, "idle": 0, "iterators": 0, "shut": [True], "pools": True,
                        "tokens": [], "once": said}
    # The parent's own state is untouched, and its persistent workers serve the next epoch.
    assert _process.idle_pools and _process.reserved > 0 and len(_process.loader_iterators) == 1
    assert sorted(epoch(persistent)) == list(range(64))


def test_a_forked_child_records_the_cpus_it_began_on() -> None:
    """What tells a worker that its worker_init_fn placed it (torch/worker_collate.py): the
    CPUs of the thread that forked it, as they were at the fork."""
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("needs 2 CPUs this process may run on")
    os.sched_setaffinity(0, {min(mine)})
    try:
        reported = in_a_forked_child(lambda: sorted(_process.affinity_at_start))
    finally:
        os.sched_setaffinity(0, mine)
    assert reported == [min(mine)]


@SEMANTICS
def test_a_forked_child_counts_no_replaced_worker_of_its_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the fork watch counts a worker forked in the place of one stuck (no stuck worker needed).
    monkeypatch.setattr(_process, "workers_replaced", _process.workers_replaced + 2)
    assert fork_watch.replaced_workers() >= 2
    assert in_a_forked_child(lambda: [fork_watch.replaced_workers(), _process.workers_replaced]) == [0, 0]
    assert fork_watch.replaced_workers() >= 2  # the parent's count is untouched


@SEMANTICS
def test_a_forked_child_of_a_worker_can_make_batches_while_its_idle_look_held_the_lock() -> None:
    # A worker's idle look holds the lock while it reads the board; a child forked then
    # (a loader iterated inside a worker) must not find it held forever.
    with _process.making_batch:
        assert in_a_forked_child(lambda: _process.making_batch.acquire(timeout=1.0)) is True


@SEMANTICS
def test_a_forked_child_forgets_its_parents_iterators_in_torchs_worker_registry() -> None:
    # torch keys its SIGCHLD registry of workers by id(iterator); a child forked while a
    # persistent iterator lives inherits the entry, and an iterator of its own given the
    # same address (the inherited one freed) raised "_set_worker_pids should be called
    # only once" at its first epoch.
    from torch.utils.data._utils import signal_handling

    persistent = numafast.torch.NumaLoader(DataLoader(Tagged(), batch_size=8, num_workers=2, persistent_workers=True))
    assert sorted(epoch(persistent)) == list(range(64))
    key = id(next(iter(_process.loader_iterators)))

    def register_again() -> str:
        try:
            signal_handling._set_worker_pids(key, (os.getpid(),))
        except ValueError as error:
            return str(error)
        signal_handling._remove_worker_pids(key)
        return "ok"

    assert in_a_forked_child(register_again) == "ok"
    assert sorted(epoch(persistent)) == list(range(64))  # the parent's own entry is untouched


# A loader freed by the collector while this thread holds one of numafast's locks: the
# collector runs at any allocation, so inside close_idle_pools() (idle_mutex held) or a
# node budget's reserve (reserved_mutex held), and a loader's pools go idle there, which
# takes idle_mutex and, closing the idle pools they replace, reserved_mutex.
COLLECTED_UNDER_A_LOCK = r"""
import faulthandler, gc, sys
faulthandler.dump_traceback_later(20, exit=True)  # a hang: every thread's stack, and status 1
import torch
from torch.utils.data import DataLoader, TensorDataset
import numafast, numafast.torch
from numafast import _process

node = numafast.topology().allowed_nodes[0]
dataset = TensorDataset(torch.arange(8.0)[:, None].expand(8, 64).contiguous(), torch.arange(8))

def loader_iterated():
    loader = numafast.torch.NumaLoader(DataLoader(dataset, batch_size=4), node=node)
    assert [labels.tolist() for values, labels in loader if torch.equal(values[:, 0], labels.float())] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    loader.me = loader  # a reference cycle: only the collector frees it
    return loader

first, second = loader_iterated(), loader_iterated()
del first
gc.collect()
print("idle", len(_process.idle_pools))
for lock in ("reserved_mutex", "idle_mutex"):  # at first, the second's pools replace the first's idle ones, which close
    del second
    with getattr(_process, lock):
        gc.collect()
        inside = len(_process.idle_pools)
    print(lock, "idle inside", inside, "after", len(_process.idle_pools), "closed", numafast.torch.close_idle_pools())
    second = loader_iterated()
"""


@SEMANTICS
def test_a_loader_collected_while_its_thread_holds_a_lock_goes_idle_once_let_go() -> None:
    """Its pools go idle when the thread lets go of the lock (before: it waited for
    itself there forever)."""
    result = subprocess.run([sys.executable, "-c", COLLECTED_UNDER_A_LOCK], capture_output=True, text=True,
                            timeout=120, cwd=PACKAGE.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "idle 1",
        "reserved_mutex idle inside 1 after 1 closed 1",
        "idle_mutex idle inside 0 after 1 closed 1",
    ]
