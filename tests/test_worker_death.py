"""A worker killed while it holds the lock of torch's done event (it takes that lock for
every index it reads) does not hang the consumer, neither where torch finds the worker
dead nor in the iterator's shutdown (each takes the lock too): the consumer gets the
DataLoader's error in seconds, the living workers are ended with a warning that says
why, and the next epoch is whole. The stock DataLoader waits there forever.

The worker here takes the lock and kills itself, as the OOM killer would have killed it
in that instant: the lock stays taken for good, as it does after a real death.

A worker killed while its batch, sent through its descriptor server, waits to be read
ends the epoch with torch's error for a dead worker too, not with the socket's.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numafast.torch  # noqa: E402

pytestmark = pytest.mark.host_only("one process's loader and its workers: nothing the kernel's nodes change")

FATAL = 5  # the sample whose worker dies holding the lock
BOUND_S = 30.0  # on the epoch and its shutdown; the lock's deadline is 2 s


class DiesHoldingTheDoneLock(torch.utils.data.Dataset):  # type: ignore[misc]
    """16 samples; in the first epoch, the worker that reads sample FATAL takes the lock of
    the done event its loop checks (found in torch's ``_worker_loop`` frame) and dies, once
    ``die`` is set (the consumer is iterating: before, torch's SIGCHLD handler would raise
    in the test's own setup)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.die = multiprocessing.get_context("fork").Event()

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> Any:
        if index == FATAL and self.epoch == 0 and torch.utils.data.get_worker_info() is not None:
            frame = sys._getframe()
            while frame.f_code.co_name != "_worker_loop":
                frame = frame.f_back
            self.die.wait(BOUND_S)
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
                data.die.set()
                for _batch in iterator:
                    pass
            iterator._shutdown_workers()  # as when the consumer drops the iterator
    finally:
        ended.set()
        assert not stuck, f"the consumer waited on the done event's lock for {BOUND_S:g} s"
    assert not any(worker.is_alive() for worker in workers)
    said = [str(warning.message) for warning in caught]
    assert any("lock of torch's done event stayed taken" in text and "killed by SIGKILL" in text
               and "the 1 still alive were ended" in text for text in said), said  # fmt: skip

    data.epoch = 1
    values = sorted(int(value) for batch in loader for value in batch[:, 0].tolist())
    assert values == list(range(16))


def done_lock(frame: Any) -> Any:
    """The lock of the done event of the torch worker loop ``frame`` runs in."""
    while frame.f_code.co_name != "_worker_loop":
        frame = frame.f_back
    return frame.f_locals["done_event"]._cond


HOLD_S = 3.5  # longer than the 2 s a dead holder is waited for


class SlowToLetGoOfTheDoneLock(torch.utils.data.Dataset):  # type: ignore[misc]
    """16 samples; the worker that reads the last one holds the lock of the done event for
    HOLD_S in a thread of its own, as a worker stopped (descheduled, swapped out, paused
    by a debugger) while it checks the event holds it: alive, and it lets go."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> Any:
        if index == 15 and torch.utils.data.get_worker_info() is not None:
            lock, taken = done_lock(sys._getframe()), threading.Event()

            def hold() -> None:
                with lock:
                    taken.set()
                    time.sleep(HOLD_S)

            threading.Thread(target=hold, daemon=True).start()
            taken.wait(5)
        return torch.tensor([index, os.getpid()])


def test_a_worker_slow_to_let_go_of_the_done_events_lock_is_waited_for() -> None:
    """The holder is alive: the shutdown waits for it (it lets go in seconds), and the
    workers end as torch ends them; none is killed, no warning."""
    loader = numafast.torch.NumaLoader(SlowToLetGoOfTheDoneLock(), batch_size=2, num_workers=2, timeout=20)
    iterator = iter(loader)
    workers = list(iterator._workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [batch[:, 0].tolist() for batch in iterator]  # the shutdown waits on the lock at the end
    assert batches == [[2 * number, 2 * number + 1] for number in range(8)]
    assert not [str(warning.message) for warning in caught if "done event" in str(warning.message)]
    for worker in workers:
        worker.join(10)
    assert [worker.exitcode for worker in workers] == [0, 0]


def off_the_main_thread(consume: Callable[[], None]) -> bool:
    """Whether ``consume()``, run in a thread of its own, ended within BOUND_S. As in a
    process whose main thread never iterated: no SIGCHLD handler of torch's. (One that an
    earlier test's iterator installed checks every registered worker, the consumer's
    too, and would raise a kill in the main thread, as a signal comes.)"""
    handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        consumer.join(BOUND_S)
    finally:
        signal.signal(signal.SIGCHLD, handler)
    return not consumer.is_alive()


def test_off_the_main_thread_a_worker_killed_holding_the_lock_does_not_hang_the_consumer() -> None:
    """An iterator made off the main thread has no SIGCHLD handler: torch finds the dead
    worker at its next look (every 5 s) and reads the event (is_set) to mark it gone."""
    data = DiesHoldingTheDoneLock()
    data.die.set()  # no SIGCHLD handler off the main thread: the death may come at once
    loader = numafast.torch.NumaLoader(data, batch_size=2, num_workers=2)
    outcome: list[Any] = []

    def consume() -> None:
        iterator = iter(loader)
        outcome.append(list(iterator._workers))
        try:
            for _batch in iterator:
                pass
        except BaseException as error:  # noqa: BLE001 - the outcome is checked below
            # Not the error itself: its traceback holds this frame, so the iterator, and
            # the batches it received out of order, whose slots the next epoch would miss.
            outcome.append((type(error), str(error)))
        finally:  # as when the consumer drops the iterator (its workers leave torch's SIGCHLD registry)
            iterator._shutdown_workers()
        outcome.append("shut down")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert off_the_main_thread(consume), "the consumer waited on the done event's lock"
    processes, (kind, error), ended = outcome
    # Also where a batch the worker sent before it died (a first batch, through its
    # descriptor server) is read first: see the last test.
    assert issubclass(kind, RuntimeError) and "exited unexpectedly" in error and ended == "shut down", outcome
    assert not any(process.is_alive() for process in processes)
    said = [str(warning.message) for warning in caught]
    assert any("lock of torch's done event stayed taken" in text and "the 1 still alive were ended" in text
               for text in said), said  # fmt: skip

    data.epoch = 1
    values = sorted(int(value) for batch in loader for value in batch[:, 0].tolist())
    assert values == list(range(16))


class DiesWithItsSecondBatchUnread(torch.utils.data.Dataset):  # type: ignore[misc]
    """8 samples for one worker, which dies as the OOM killer would take it while its
    second batch waits in the queue: that batch (samples 2 and 3, 16x larger than the
    first, so it is sent the copying way, through the worker's descriptor server) can
    no longer be read once the consumer has the first (``folder``/taken), since the
    server stops (a dying process's sockets close first); 0.3 s later the worker is
    killed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        if index == 3 and torch.utils.data.get_worker_info() is not None:
            threading.Thread(target=self.die, daemon=True).start()
        return torch.full((64 if index < 2 else 1024,), float(index))

    def die(self) -> None:
        from multiprocessing import resource_sharer

        if wait_for(self.folder / "taken"):
            resource_sharer._resource_sharer.stop()  # type: ignore[attr-defined]
            (self.folder / "stopped").touch()
            time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)


def wait_for(path: Path) -> bool:
    """Whether ``path`` exists within BOUND_S."""
    deadline = time.monotonic() + BOUND_S
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_dying_workers_batch_that_cannot_be_read_ends_the_epoch_with_torchs_error(tmp_path: Path) -> None:
    """Off the main thread (no SIGCHLD handler: as a framework that trains in a thread
    of its own), torch sees the worker alive where the read fails and would raise the
    socket's error as it came; the consumer gets torch's error for a dead worker."""
    loader = numafast.torch.NumaLoader(DiesWithItsSecondBatchUnread(tmp_path), batch_size=2, num_workers=1)
    outcome: list[Any] = []

    def consume() -> None:
        iterator = iter(loader)
        try:
            outcome.append(next(iterator)[:, 0].tolist())
            (tmp_path / "taken").touch()
            outcome.append(wait_for(tmp_path / "stopped"))
            next(iterator)
        except BaseException as error:  # noqa: BLE001 - the outcome is checked below
            outcome.append(error)
        finally:
            iterator._shutdown_workers()

    assert off_the_main_thread(consume), "the consumer waited"
    first, stopped, error = outcome
    assert first == [0.0, 1.0] and stopped, outcome
    assert isinstance(error, RuntimeError) and "exited unexpectedly" in str(error), repr(error)
    assert isinstance(error.__cause__, (OSError, EOFError)), repr(error.__cause__)  # the read that failed
