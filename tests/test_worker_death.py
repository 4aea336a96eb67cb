"""A worker killed while it holds the lock of torch's done event (it takes that lock for
every index it reads) does not hang the consumer, neither where torch finds the worker
dead nor in the iterator's shutdown (each takes the lock too): the consumer gets the
DataLoader's error in seconds, the living workers are ended with a warning that says
why, and the next epoch is whole. The stock DataLoader waits there forever.

The worker here takes the lock and kills itself, as the OOM killer would have killed it
in that instant: the lock stays taken for good, as it does after a real death.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numafast.torch  # noqa: E402

pytestmark = pytest.mark.host_only("one process's loader and its workers: nothing the kernel's nodes change")

FATAL = 5  # the sample whose worker dies holding the lock
BOUND_S = 30.0  # on the epoch and its shutdown; the lock's deadline is 2 s


class DiesHoldingTheDoneLock(torch.utils.data.Dataset):  # type: ignore[misc]
    """16 samples; in the first epoch, the worker that reads sample FATAL takes the lock of
    the done event its loop checks (found in torch's ``_worker_loop`` frame) and dies."""

    def __init__(self) -> None:
        self.epoch = 0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> Any:
        if index == FATAL and self.epoch == 0 and torch.utils.data.get_worker_info() is not None:
            frame = sys._getframe()
            while frame.f_code.co_name != "_worker_loop":
                frame = frame.f_back
            frame.f_locals["done_event"]._cond.acquire()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((64,), float(index))


def test_a_worker_killed_holding_the_done_events_lock_does_not_hang_the_consumer() -> None:
    """torch reads the event where it finds the worker dead, then sets it in the
    shutdown: each would wait on the lock forever."""
    data = DiesHoldingTheDoneLock()
    loader = numafast.torch.NumaLoader(data, batch_size=2, num_workers=2, timeout=20)
    iterator = iter(loader)
    workers = list(iterator._workers)
    event = iterator._workers_done_event
    lock = getattr(event, "event", event)._cond
    ended, stuck = threading.Event(), []

    def bound() -> None:
        """Where the consumer still waits on the lock, it is let go (a semaphore any
        thread may release), and the test fails."""
        if not ended.wait(BOUND_S):
            stuck.append(True)
            lock.release()

    threading.Thread(target=bound, daemon=True).start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match="DataLoader worker"):  # torch's SIGCHLD handler: it was killed
                for _batch in iterator:
                    pass
            iterator._shutdown_workers()  # as when the consumer drops the iterator
    finally:
        ended.set()
        assert not stuck, f"the consumer waited on the done event's lock for {BOUND_S:g} s"
    assert not any(worker.is_alive() for worker in workers)
    said = [str(warning.message) for warning in caught]
    assert any("lock of torch's done event stayed taken" in text and "the 1 still alive were ended" in text
               for text in said), said  # fmt: skip

    data.epoch = 1
    values = sorted(int(value) for batch in loader for value in batch[:, 0].tolist())
    assert values == list(range(16))
