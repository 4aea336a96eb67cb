"""An epoch that ends in an exception, or an iterator dropped mid-epoch, ends its
workers then, without the collector: at most the live iterator's workers remain, and
torch's SIGCHLD check never reports an old iterator's worker in a later epoch.

The stock DataLoader leaves a failed epoch's iterator, and so its workers, to the
collector: torch raises a worker's error again from a local variable, a reference cycle
through every frame below the consumer's. With the collector off (as between two of
its runs) each failed epoch leaves its workers running. A dataset's error does not end
the epoch by itself: the consumer may catch it and go on, as with the stock loader.

Every sample carries its index and the pid of the worker that read it; every batch is
checked. Live workers are counted by the kernel (this process's children not yet
reaped). Every wait has an end.
"""

from __future__ import annotations

import gc
import os
import signal
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numafast.torch  # noqa: E402
from time_limit import children  # noqa: E402

pytestmark = pytest.mark.host_only("one process's loaders and their workers: nothing the kernel's nodes change")

SAMPLES = 16  # 8 batches of two
FAILING = 5  # the sample whose read raises: batch 2 fails, batches 0 and 1 come before it
EPOCHS = 3
GONE_WITHIN_S = 10.0  # torch's shutdown joins a worker in milliseconds; a loaded machine is slower


class Tagged(torch.utils.data.Dataset):  # type: ignore[misc]
    """Sample i is (i, pid of the worker that read it); reading ``failing`` raises."""

    def __init__(self, failing: int | None = FAILING) -> None:
        self.failing = failing

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> Any:
        if index == self.failing:
            raise ValueError(f"sample {index} is unreadable")
        return torch.tensor([index, os.getpid()], dtype=torch.int64)


_before: set[int] = set()  # the children the tests before left (each test's failure is its own)


def live_children() -> set[int]:
    """This process's children that have not exited (a zombie is not counted), but those
    the tests before left."""
    alive = set()
    for pid in set(children()) - _before:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
        except OSError:
            pass
    return alive


def settled_children(at_most: int) -> set[int]:
    """The live children, once there are ``at_most`` of them or GONE_WITHIN_S passed."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while len(alive := live_children()) > at_most and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


def check(batch: Any, number: int) -> int:
    """``batch`` is batch ``number`` (its samples' indices); the pid of the worker that made it."""
    assert batch[:, 0].tolist() == [2 * number, 2 * number + 1], (number, batch)
    pids = set(batch[:, 1].tolist())
    assert len(pids) == 1, batch
    return pids.pop()


def failed_epoch(loader: Any) -> set[int]:
    """One epoch as a plain ``for`` loop runs it, ended by the dataset's error: the batches
    before the failing one are right; the pids of the workers that made them."""
    pids: set[int] = set()
    seen = 0
    try:
        for number, batch in enumerate(loader):
            pids.add(check(batch, number))
            seen += 1
    except ValueError as error:
        assert f"sample {FAILING} is unreadable" in str(error)
    else:
        raise AssertionError("the epoch did not fail")
    assert seen == FAILING // 2
    return pids


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The collector off, as between two of its runs: only reference counts free anything."""
    gc.collect()
    _before.clear()
    _before.update(settled_children(0))
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.fixture
def kept_warnings() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_the_stock_dataloader_leaves_a_failed_epochs_workers_to_the_collector(no_collector: None) -> None:
    """What numafast goes beyond: each failed epoch leaves its two workers running."""
    loader = torch.utils.data.DataLoader(Tagged(), batch_size=2, num_workers=2, timeout=20)
    left: list[weakref.ref[Any]] = []
    for epoch in range(EPOCHS):
        iterator = iter(loader)
        left.append(weakref.ref(iterator))
        failed_epoch(iterator)
        del iterator
        assert len(settled_children(2 * (epoch + 1))) == 2 * (epoch + 1)
    assert all(ref() is not None for ref in left)
    for ref in left:
        # What the collector would do, but in 5 s a worker: it finalizes the index queues
        # first (a weakref callback), and torch's shutdown then waits for workers that
        # never get its last message.
        ref()._shutdown_workers()
    assert not settled_children(0)


def test_a_failed_epoch_ends_its_workers_without_the_collector(
    no_collector: None, kept_warnings: list[warnings.WarningMessage]
) -> None:
    loader = numafast.torch.NumaLoader(Tagged(), batch_size=2, num_workers=2, timeout=20)
    for epoch in range(EPOCHS):
        pids = failed_epoch(loader)
        assert not (pids & settled_children(0)), epoch
        assert not settled_children(0), epoch
    loader.dataset.failing = None
    assert [check(batch, number) > 0 for number, batch in enumerate(loader)] == [True] * (SAMPLES // 2)
    assert not settled_children(0)
    said = [str(warning.message) for warning in kept_warnings]
    assert not [text for text in said if "keeps tensors" in text], said  # no batch was kept


def test_the_consumer_may_catch_a_batchs_error_and_go_on(no_collector: None) -> None:
    """The error is the consumer's to handle, the epoch goes on; the iterator dropped
    mid-epoch ends its workers then, the exception kept or not."""
    loader = numafast.torch.NumaLoader(Tagged(), batch_size=2, num_workers=2, timeout=20)
    iterator = iter(loader)
    workers = {process.pid for process in iterator._workers}
    assert [check(next(iterator), number) in workers for number in range(2)] == [True, True]
    with pytest.raises(ValueError, match=f"sample {FAILING} is unreadable") as raised:
        next(iterator)  # batch 2
    assert [check(next(iterator), number) in workers for number in range(3, 5)] == [True, True]
    assert settled_children(2) == workers
    del iterator  # mid-epoch; the error is still held (by pytest's record of it)
    assert not settled_children(0)
    assert raised.value is not None


def test_a_kept_error_does_not_keep_its_epochs_workers(no_collector: None) -> None:
    """Errors logged for later (a list of them, pytest's record, sys.last_value) hold
    their traceback: that holds nothing of the iterator."""
    loader = numafast.torch.NumaLoader(Tagged(), batch_size=2, num_workers=2, timeout=20)
    errors: list[BaseException] = []
    for _epoch in range(EPOCHS):
        try:
            for _batch in loader:
                pass
        except ValueError as error:
            errors.append(error)
        assert not settled_children(0)
    assert len(errors) == EPOCHS


def test_an_old_epochs_worker_is_never_reported_as_the_current_ones(no_collector: None) -> None:
    """torch's SIGCHLD handler checks the workers of every iterator still registered: one
    left alive by a failed epoch, its worker killed during the next epoch, was reported
    there as "DataLoader worker (pid N) is killed by signal"."""
    loader = numafast.torch.NumaLoader(Tagged(), batch_size=2, num_workers=2, timeout=20)
    old = failed_epoch(loader)
    loader.dataset.failing = None
    seen = 0
    for number, batch in enumerate(loader):
        assert check(batch, number) not in old
        if number == 1:
            for pid in old & live_children():
                os.kill(pid, signal.SIGKILL)  # the old epoch's worker, where it still runs
        seen += 1
        time.sleep(0.05)  # the handler runs in this thread, if it finds a registered worker killed
    assert seen == SAMPLES // 2
    assert not settled_children(0)
