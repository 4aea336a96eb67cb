"""A worker's message that cannot become its batch on arrival (its pool gone, its lease
over, the copy failing) reaches the consumer as a worker's error does: at that batch,
saying which worker's batch and why, and the next ``next()`` goes on with the next
batch, in order; under the pin_memory hook, PyTorch's pin thread lives on. Save a
batch whose worker died after sending it: the DataLoader's own error for a dead worker.

Each loader here has a DataLoader ``timeout``: a batch lost on its way would fail the
test in seconds, not hang it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import platform
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numafast.torch  # noqa: E402
from numafast import _process  # noqa: E402
from numafast.torch.hook import PinMemoryHook  # noqa: E402
from numafast.torch.message import Fallback, FallbackReason, SenderDied, SlotBatch, receivers  # noqa: E402
from torch._utils import ExceptionWrapper  # noqa: E402

pytestmark = pytest.mark.host_only("the batch's path in one process: nothing the kernel's nodes change")

BATCHES = 8  # of two samples each
TIMEOUT_S = 10  # DataLoader(timeout=): the bound on a test whose batch went missing


def dataset() -> list[Any]:
    return [torch.full((256,), float(i)) for i in range(2 * BATCHES)]


def expected() -> list[list[float]]:
    return [[float(2 * i), float(2 * i + 1)] for i in range(BATCHES)]


def outcomes(iterator: Iterator[Any]) -> list[Any]:
    """Each ``next()``: the batch's first values, or the exception it raised; up to the
    end, or a second exception (one is expected: a second, a DataLoader timeout, says
    the iteration lost its way)."""
    seen: list[Any] = []
    while len(seen) <= 2 * BATCHES:
        try:
            batch = next(iterator)
        except StopIteration:
            return seen
        except Exception as error:  # noqa: BLE001 - what the consumer meets
            seen.append(error)
            if sum(isinstance(outcome, BaseException) for outcome in seen) > 1:
                return seen
        else:
            seen.append(batch[:, 0].tolist())
            del batch
    raise AssertionError(f"more outcomes than batches: {seen}")


def spoil_one(receiver: Any, spoil: Callable[[SlotBatch], None], at: int) -> list[SlotBatch]:
    """Make the ``at``-th message that ``receiver`` receives unreceivable (by ``spoil``,
    as a real fault would make it); returns the spoiled messages."""
    real = receiver.receive
    spoiled: list[SlotBatch] = []

    def receive(message: SlotBatch) -> Any:
        if len(spoiled) < 1 and receive.calls == at:  # type: ignore[attr-defined]
            spoil(message)
            spoiled.append(message)
        receive.calls += 1  # type: ignore[attr-defined]
        return real(message)

    receive.calls = 0  # type: ignore[attr-defined]
    receiver.receive = receive  # the instance's: what a message's arrival looks up
    return spoiled


def stale_lease(message: SlotBatch) -> None:
    message.generation += 1000  # the slot's lease ended: adopt refuses it


def pool_gone(message: SlotBatch) -> None:
    message.inode = 0  # a pool these pools do not have (any more)


def oversized(message: SlotBatch) -> None:
    message.nbytes = 1 << 40  # more than its slot holds: adopt refuses it, its lease untouched


def check_one_error_in_place(seen: list[Any], kind: type[Exception], why: str) -> None:
    """One batch raised ``kind`` naming a worker's batch and ``why``; every other batch
    came, in order."""
    errors = [index for index, outcome in enumerate(seen) if isinstance(outcome, BaseException)]
    assert len(errors) == 1, seen
    error = seen[errors[0]]
    assert isinstance(error, kind), repr(error)
    text = str(error)
    assert "taking over batch" in text and "of DataLoader worker process" in text and why in text, text
    assert [outcome for outcome in seen if not isinstance(outcome, BaseException)] == [
        batch for index, batch in enumerate(expected()) if index != errors[0]
    ], seen


@pytest.mark.parametrize(
    ("spoil", "kind", "why"),
    [(stale_lease, LookupError, "no longer leased"), (pool_gone, RuntimeError, "no longer has")],
    ids=["stale lease", "pool gone"],
)
def test_a_batch_that_cannot_be_taken_over_raises_in_its_place_and_the_rest_follow(
    spoil: Callable[[SlotBatch], None], kind: type[Exception], why: str
) -> None:
    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    assert [batch[:, 0].tolist() for batch in loader] == expected()  # the pools exist: every batch lands
    spoiled = spoil_one(loader.pools, spoil, at=3)
    seen = outcomes(iter(loader))
    assert len(spoiled) == 1
    check_one_error_in_place(seen, kind, why)
    assert f"batch {spoiled[0].number} of DataLoader worker process {spoiled[0].worker}" in str(
        next(outcome for outcome in seen if isinstance(outcome, BaseException))
    )
    assert [batch[:, 0].tolist() for batch in loader] == expected()  # and the next epoch is whole


def test_a_batch_not_taken_over_gives_its_slot_back_while_its_worker_lives() -> None:
    """A take-over that fails before the slot is adopted ends the worker's lease: with
    persistent workers, which never exit, the slot would otherwise stay leased for good."""
    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=TIMEOUT_S,
                                       persistent_workers=True)  # fmt: skip
    assert [batch[:, 0].tolist() for batch in loader] == expected()
    spoil_one(loader.pools, oversized, at=3)
    seen = outcomes(iter(loader))
    errors = [outcome for outcome in seen if isinstance(outcome, BaseException)]
    assert len(errors) == 1 and "do not fit in a slot" in str(errors[0]), seen
    workers = loader._iterator._workers
    assert all(worker.is_alive() for worker in workers)
    assert sum(pool.stats().leased for pool in loader.pools.pools) == 0, loader.stats()
    assert [batch[:, 0].tolist() for batch in loader] == expected()


def test_a_receive_error_under_the_pin_memory_hook_leaves_torchs_pin_thread_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PyTorch's own pin thread unpickles the messages (torch runs it only with an
    accelerator: it is made to run here, with its copy to pinned memory left out)."""
    accelerator = getattr(torch, "accelerator", None)
    pin_module = torch.utils.data._utils.pin_memory
    needed = ("is_available", "current_accelerator", "current_device_index", "set_device_index")
    if accelerator is None or not all(hasattr(accelerator, name) for name in needed):
        pytest.skip("this torch's DataLoader does not ask torch.accelerator whether to pin")
    if not torch.accelerator.is_available():
        monkeypatch.setattr(accelerator, "is_available", lambda: True)
        monkeypatch.setattr(accelerator, "current_accelerator", lambda: torch.device("cuda"))
        monkeypatch.setattr(accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(pin_module, "pin_memory", lambda data, device=None: data)  # numafast's slots are pinned
    loader = torch.utils.data.DataLoader(dataset(), batch_size=2, num_workers=2, pin_memory=True, timeout=TIMEOUT_S)
    hook = PinMemoryHook(loader, 0, None, slots=8, installed=True, reason="")  # what pin_memory_hook makes
    assert hook.pools is not None
    assert [batch[:, 0].tolist() for batch in loader] == expected()
    spoil_one(hook.pools, stale_lease, at=2)
    iterator = iter(loader)
    pin_thread = iterator._pin_memory_thread
    seen = outcomes(iterator)
    check_one_error_in_place(seen, LookupError, "no longer leased")
    assert pin_thread.is_alive() or iterator._shutdown  # it ended with the iteration, not at the error
    assert [batch[:, 0].tolist() for batch in loader] == expected()
    hook.remove()


class DyingWorker(torch.utils.data.Dataset):  # type: ignore[misc]
    """dataset(), whose worker 0 ends, once ``dying`` is set, in its second batch
    (samples 4 and 5), after its first was sent; with exit status 0, which PyTorch's
    SIGCHLD handler lets pass (it raises for a failure): the DataLoader sees the death
    when it reads the queue."""

    def __init__(self, main_thread_only: bool = False) -> None:
        self.samples = dataset()
        self.dying = False
        self.main_thread_only = main_thread_only
        """Its main thread ends first, another LINGER_S later: as a killed worker's do,
        where freeing a large heap takes a while."""

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        info = torch.utils.data.get_worker_info()
        if self.dying and info is not None and info.id == 0 and index == 4:
            time.sleep(0.5)  # the queue's feeder thread sends the first batch
            if self.main_thread_only:
                threading.Thread(target=lambda: (time.sleep(LINGER_S), os._exit(0))).start()
                ctypes.CDLL(None).syscall(SYS_EXIT[platform.machine()], 0)  # this thread alone
            os._exit(0)
        return self.samples[index]


LINGER_S = 3.0
SYS_EXIT = {"x86_64": 60, "aarch64": 93}  # exit(2), which ends the calling thread alone


def test_a_batch_whose_worker_died_after_sending_it_raises_the_dataloaders_dead_worker_error() -> None:
    """The owner ends a dead worker's leases when it sees the death (here stats(); in a
    job, a worker asking for slots), the one of its batch still queued too. That batch
    raises what the DataLoader raises for a worker that died, caused by SenderDied; the
    DataLoader stops waiting for that worker, and the other's batches follow."""
    data = DyingWorker()
    loader = numafast.torch.NumaLoader(data, batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    assert [batch[:, 0].tolist() for batch in loader] == expected()  # the pools exist: batches travel in slots
    data.dying = True
    iterator = iter(loader)
    dead = iterator._workers[0]
    dead.join(TIMEOUT_S)
    assert dead.exitcode == 0
    loader.stats()  # ends the dead worker's leases
    seen = outcomes(iterator)
    error = seen[0]
    assert isinstance(error, RuntimeError), seen
    assert str(error).startswith(f"DataLoader worker (pid(s) {dead.pid}) exited unexpectedly"), str(error)
    cause = error.__cause__
    assert isinstance(cause, SenderDied), repr(cause)
    assert f"DataLoader worker process 0 (pid {dead.pid}) died after sending batch 1 of DataLoader worker process 0" in (
        str(cause)
    ), str(cause)
    assert seen[1:] == [batch for index, batch in enumerate(expected()) if index not in (0, 2)], seen
    data.dying = False
    assert [batch[:, 0].tolist() for batch in loader] == expected()  # and the next epoch is whole


def test_a_dead_worker_whose_last_thread_still_exits_is_named_by_the_dataloader_not_senderdied() -> None:
    """A dead worker's main thread is a zombie in /proc while its other threads still
    exit: the owner ends its leases then, but the DataLoader sees it alive until the last
    thread is gone, and re-raised SenderDied as it came (before). The take-over waits for
    that, so the DataLoader's own error for a dead worker is raised."""
    data = DyingWorker(main_thread_only=True)
    loader = numafast.torch.NumaLoader(data, batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    assert [batch[:, 0].tolist() for batch in loader] == expected()  # the pools exist: batches travel in slots
    data.dying = True
    iterator = iter(loader)
    dead = iterator._workers[0]
    deadline = time.monotonic() + TIMEOUT_S
    while _process.start_time(dead.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _process.start_time(dead.pid) is None and dead.is_alive()  # a zombie main thread, another running
    loader.stats()  # ends the dead worker's leases
    seen = outcomes(iterator)
    error = seen[0]
    assert isinstance(error, RuntimeError) and not isinstance(error, SenderDied), repr(error)
    assert str(error).startswith(f"DataLoader worker (pid(s) {dead.pid}) exited unexpectedly"), str(error)
    assert seen[1:] == [batch for index, batch in enumerate(expected()) if index not in (0, 2)], seen


def test_a_worker_killed_during_a_take_over_raises_the_dataloaders_error_not_the_batchs() -> None:
    """PyTorch's SIGCHLD handler runs between two bytecodes of whatever the main thread
    is doing; for a worker killed as a batch is taken over, it raises "killed by signal"
    inside the take-over. That is the DataLoader's error, not that batch's: it passes as
    it came, and the DataLoader says the worker died (it was wrapped as "Caught
    RuntimeError in the main process, taking over batch ...")."""
    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    assert [batch[:, 0].tolist() for batch in loader] == expected()  # the pools exist: batches travel in slots
    iterator = iter(loader)
    killed = iterator._workers[0]

    def kill_the_worker() -> None:
        loader.pools.before_receive = lambda: None
        os.kill(killed.pid, signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT_S
        while _process.start_time(killed.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.001)  # until it is a zombie: its SIGCHLD is sent
        time.sleep(0.1)  # the handler runs at the interpreter's next check: in this loop or this sleep

    loader.pools.before_receive = kill_the_worker
    with warnings.catch_warnings(record=True) as said, pytest.raises(RuntimeError) as raised:
        warnings.simplefilter("always")
        next(iterator)
    # The DataLoader's own error for a dead worker, raised from the handler's.
    error = raised.value
    named = re.fullmatch(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly", str(error))
    assert named is not None, str(error)
    # Killed while it held torch's done-event lock (descheduled there, on a loaded machine), the
    # worker takes its sibling with it: numafast ends that one, saying so, and the DataLoader names both.
    held_the_lock = any("the lock of torch's done event stayed taken" in str(warning.message) for warning in said)
    pids = {int(pid) for pid in named.group(1).split(", ")}
    assert pids == {killed.pid} or (held_the_lock and killed.pid in pids), (str(error), [str(w.message) for w in said])
    assert str(error.__cause__).startswith(f"DataLoader worker (pid {killed.pid}) is killed by signal: Killed"), repr(
        error.__cause__
    )
    del iterator
    assert [batch[:, 0].tolist() for batch in loader] == expected()  # and the next epoch is whole


class Refusing:
    """A receiver whose every take-over fails, as a pool that cannot be read would."""

    def receive(self, message: SlotBatch) -> Any:
        raise LookupError(f"slot {message.index} of this pool is no longer leased in generation {message.generation}")

    def copy_in(self, fallback: Fallback) -> Any:
        raise MemoryError("no pinned memory left for a copy")


def test_an_unreceivable_message_becomes_the_wrapped_error_of_its_worker_batch() -> None:
    """Unpickled where its receiver lives, a message that cannot become its batch is
    what a worker sends when collating raised: torch's ExceptionWrapper, naming the
    worker, its batch's number, the slot, and the error with its traceback."""
    receiver = Refusing()
    owner_id = 10**9 + 7
    receivers[owner_id] = receiver
    try:
        slot = pickle.loads(pickle.dumps(SlotBatch(os.getpid(), owner_id, 99, 3, 12, 512, b"", (), 1, 4)))
        copied = pickle.loads(pickle.dumps(Fallback(os.getpid(), owner_id, torch.ones(2), FallbackReason.NO_FREE_SLOT,
                                                    "", 0, 2)))  # fmt: skip
    finally:
        del receivers[owner_id]
    assert isinstance(slot, ExceptionWrapper) and isinstance(copied, ExceptionWrapper)
    with pytest.raises(LookupError) as raised:
        slot.reraise()
    text = str(raised.value)
    assert "batch 4 of DataLoader worker process 1 (slot 3 of pool file 99, lease 12)" in text, text
    assert "no longer leased in generation 12" in text and "Traceback" in text, text
    with pytest.raises(MemoryError, match=r"batch 2 of DataLoader worker process 0 \(sent to be copied: no free slot"):
        copied.reraise()


def test_a_message_still_says_which_worker_sent_it_after_travelling() -> None:
    """Where no receiver takes it, the message keeps its worker and number."""
    moved = pickle.loads(pickle.dumps(SlotBatch(os.getpid() + 10**6, 1, 7, 0, 1, 512, b"", (), 3, 9, 4242)))
    assert isinstance(moved, SlotBatch) and (moved.worker, moved.number, moved.sender) == (3, 9, 4242)


def test_workers_number_their_batches_from_one_each_epoch() -> None:
    """The numbers the messages carry are each worker's own count, from 1, per process."""
    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=TIMEOUT_S)
    list(loader)  # the pools exist
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()
    real = loader.pools.receive

    def receive(message: SlotBatch) -> Any:
        with lock:
            seen.append((message.worker, message.number))
        return real(message)

    loader.pools.receive = receive  # type: ignore[method-assign]
    assert [batch[:, 0].tolist() for batch in loader] == expected()
    assert sorted(seen) == sorted((worker, number) for worker in (0, 1) for number in range(1, BATCHES // 2 + 1)), seen
