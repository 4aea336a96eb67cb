"""A DataLoader worker stuck inside ``os.fork()`` (CPython gh-112275) does not hang a
NumaLoader: it is replaced, or named in an error; a worker that is only slow is not.

The deadlock, made deterministic: a thread holds the interpreter's head lock, without
the GIL, across a chosen fork, as a native thread calling into Python holds it for an
instant on every call (taking a thread state). In Python 3.8 to 3.11.7 the child then
waits for that lock forever inside ``os.fork()``. Where the Python is not affected
(the child starts anyway) those tests skip. Every wait here is bounded: a DataLoader
``timeout``, a deadline of a second, a stuck child killed by the test.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numafast.torch  # noqa: E402
from numafast import _process  # noqa: E402
from numafast.torch import fork_watch  # noqa: E402

pytestmark = pytest.mark.host_only("forks workers in one process: nothing the kernel's nodes change")

DEADLINE_S = 1.0  # START_DEADLINE_S in these tests
BATCHES = 8  # of two samples each


class HeadLockAtFork:
    """Holds CPython's head lock (``_PyRuntime.interpreters.mutex``) in a thread of its
    own, without the GIL, across the forks whose numbers (counted from :meth:`wedge`)
    are given."""

    def __init__(self) -> None:
        api = ctypes.pythonapi
        api.PyInterpreterState_Main.restype = ctypes.c_void_p
        main = api.PyInterpreterState_Main()
        runtime = ctypes.addressof(ctypes.c_char.in_dll(api, "_PyRuntime"))
        words = (ctypes.c_void_p * 64).from_address(runtime)
        # struct pyinterpreters {mutex; head; main; ...}: with one interpreter, head == main.
        found = [words[i - 1] for i in range(1, 63) if words[i] == main and words[i + 1] == main and words[i - 1]]
        if not found:
            pytest.skip("the interpreter's head lock is not where CPython 3.8-3.11 keep it")
        self.mutex = found[0]
        libpython = ctypes.CDLL(None)  # a CDLL call releases the GIL
        self.acquire, self.release = libpython.PyThread_acquire_lock, libpython.PyThread_release_lock
        self.acquire.argtypes, self.release.argtypes = [ctypes.c_void_p, ctypes.c_int], [ctypes.c_void_p]
        self.grab, self.held, self.let_go, self.released = (threading.Event() for _ in range(4))
        self.wedged: set[int] = set()
        self.forks = 0
        self.holding = False
        threading.Thread(target=self._hold, name="head lock holder", daemon=True).start()
        os.register_at_fork(before=self._before, after_in_parent=self._after)

    def wedge(self, *forks: int) -> None:
        """Hold the lock across these forks, counted from 0 at this call.

        First the threads of iterators gone end: a thread that ends (or starts) takes
        the head lock holding the GIL, which the holder needs to let go (a native
        thread's hold is an instant; this one lasts the fork)."""
        gc.collect()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(thread.name in _TRANSIENT for thread in threading.enumerate()):
            time.sleep(0.01)
        self.forks, self.wedged = 0, set(forks)

    def _hold(self) -> None:
        while True:
            self.grab.wait()
            self.grab.clear()
            self.acquire(self.mutex, 1)
            self.held.set()
            self.let_go.wait()
            self.let_go.clear()
            self.release(self.mutex)
            self.released.set()

    def _before(self) -> None:
        self.holding, self.forks = self.forks in self.wedged, self.forks + 1
        if self.holding:
            self.grab.set()
            self.held.wait()
            self.held.clear()

    def _after(self) -> None:
        if self.holding:
            # Released before this thread goes on: it may take the lock itself (with the
            # GIL) to start a thread, and the holder needs the GIL to let go.
            self.holding = False
            self.let_go.set()
            self.released.wait()
            self.released.clear()


# Threads that end soon after their iterator: multiprocessing's queue feeders, numafast's watch.
_TRANSIENT = ("QueueFeederThread", "numafast worker start")
_holder: list[HeadLockAtFork] = []


@pytest.fixture(scope="module")
def head_lock_at_fork() -> HeadLockAtFork:
    """The holder, once this Python is seen to deadlock: a probe child forked with the
    lock held must not get past ``os.fork()`` within a second."""
    if not (3, 8) <= sys.version_info < (3, 11, 8):
        pytest.skip(f"Python {sys.version.split()[0]} re-creates the head lock before a child needs it (gh-112275 fixed)")
    if not _holder:
        _holder.append(HeadLockAtFork())
    holder = _holder[0]
    holder.wedge(0)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            pytest.skip("this Python's child got past os.fork() with the head lock held: not affected")
        time.sleep(0.02)
    assert "futex" in wchan(pid) or not wchan(pid)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return holder


@pytest.fixture(autouse=True)
def no_garbage_loaders() -> None:
    """Loaders of the tests before (held in cycles, by a traceback) collected here, in
    this thread: collected in a thread the next loader starts, a loader's finalizer
    waits for the lock that loader holds while it starts that thread (NodePools.attach
    in numafast/torch/owner_pools.py, let_go in numafast/torch/owner_process_pools.py)."""
    gc.collect()


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fork_watch, "START_DEADLINE_S", DEADLINE_S)
    monkeypatch.setattr(_process, "done_once", _process.done_once - {"worker replaced"})  # said again


def gone(pid: int, within_s: float = 10.0) -> bool:
    """``pid`` reaped within ``within_s`` (a killed process with torch mapped takes a
    while to exit on a loaded machine)."""
    deadline = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wchan(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return ""


def dataset() -> list[Any]:
    return [torch.full((64,), float(i)) for i in range(2 * BATCHES)]


def expected() -> list[list[float]]:
    return [[float(2 * i), float(2 * i + 1)] for i in range(BATCHES)]


def collected(*refs: weakref.ref[Any], within_s: float) -> bool:
    """Every referent collected within ``within_s``, or by the second gc.collect(): in a
    process that ran the whole suite a collection may itself outlast a short deadline
    (50 ms failed once there, after one); a gc.collect() does nothing while another
    thread's collection runs (one whose finalizer released the GIL)."""
    deadline = time.monotonic() + within_s
    for collections in itertools.count(1):
        gc.collect()
        if all(ref() is None for ref in refs):
            return True
        if collections >= 2 and time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return False


def firsts(batches: Iterator[Any]) -> list[Any]:
    return [batch[:, 0].tolist() for batch in batches]


def test_the_stock_dataloader_waits_for_a_worker_stuck_in_fork(head_lock_at_fork: HeadLockAtFork) -> None:
    """What numafast guards against: worker 1 never starts, and torch waits for its
    first batch (here until its ``timeout``; with the default, forever)."""
    loader = torch.utils.data.DataLoader(dataset(), batch_size=2, num_workers=2, timeout=3)
    head_lock_at_fork.wedge(1)
    iterator = iter(loader)
    stuck = iterator._workers[1]
    seen: list[Any] = []
    try:
        with pytest.raises(RuntimeError, match="DataLoader timed out after 3 seconds"):
            for batch in iterator:
                seen.append(batch[:, 0].tolist())
        assert seen == expected()[:1]  # worker 0's first batch; batch 1 is worker 1's
        assert stuck.is_alive() and "futex" in wchan(stuck.pid), wchan(stuck.pid)
        assert Path(f"/proc/{stuck.pid}/comm").read_text().strip() != "pt_data_worker"  # torch's loop never ran
    finally:
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(iterator))  # not an error: killed here
        iterator._worker_pids_set = False
        stuck.kill()
        stuck.join(5)
        iterator._shutdown_workers()
    assert not stuck.is_alive()


def test_numaloader_replaces_a_worker_stuck_in_fork_and_every_epoch_is_whole(
    head_lock_at_fork: HeadLockAtFork, short_deadline: None
) -> None:
    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=20)
    replaced = fork_watch.replaced_workers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            head_lock_at_fork.wedge(epoch % 2)  # worker 0, then 1, then 0 again
            began = time.monotonic()
            iterator = iter(loader)
            stuck = iterator._workers[epoch % 2].pid
            assert firsts(iterator) == expected(), epoch
            assert time.monotonic() - began < DEADLINE_S + 5
            assert gone(stuck)  # killed and reaped
            del iterator
    assert fork_watch.replaced_workers() == replaced + 3
    said = [str(warning.message) for warning in caught if "had not started" in str(warning.message)]
    assert len(said) == 1, said  # once
    assert "DataLoader worker 0 (pid" in said[0] and "replaced by pid" in said[0] and "futex" in said[0], said[0]
    assert "gh-112275" in said[0] and "3.11.8" in said[0] and "forkserver" in said[0], said[0]


def test_persistent_workers_keep_the_worker_forked_in_place_of_a_stuck_one(
    head_lock_at_fork: HeadLockAtFork, short_deadline: None
) -> None:
    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=20, persistent_workers=True)
    head_lock_at_fork.wedge(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = iter(loader)
        assert firsts(first) == expected()
    pids = [worker.pid for worker in first._workers]
    again = iter(loader)  # the same workers, the replacement among them
    assert again is first and firsts(again) == expected()
    assert [worker.pid for worker in again._workers] == pids and all(worker.is_alive() for worker in again._workers)


class Wrapper(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A loader with an iteration of its own over an inner one (Accelerate's DataLoaderShard)."""

    def __init__(self, base: torch.utils.data.DataLoader) -> None:  # type: ignore[type-arg]
        super().__init__(base.dataset)
        self.base_dataloader = base

    def __len__(self) -> int:
        return len(self.base_dataloader)

    def __iter__(self) -> Any:
        yield from self.base_dataloader


@pytest.mark.parametrize("made", ["iterated through", "made from its settings"])
def test_a_worker_stuck_in_fork_is_replaced_where_numaloader_does_not_iterate_itself(
    head_lock_at_fork: HeadLockAtFork, short_deadline: None, made: str
) -> None:
    """NumaLoader(accelerator.prepare(loader)) forks its workers in the loader it iterates
    through; accelerator.prepare(NumaLoader(loader)) in a DataLoader made from its
    settings, with numafast's collate: their workers are watched as a NumaLoader's are."""
    inner = torch.utils.data.DataLoader(dataset(), batch_size=2, num_workers=2, timeout=10)
    numa = numafast.torch.NumaLoader(Wrapper(inner) if made == "iterated through" else inner)
    loader = numa if made == "iterated through" else torch.utils.data.DataLoader(
        numa.dataset, batch_size=2, num_workers=2, timeout=10, collate_fn=numa.collate_fn)  # fmt: skip
    assert (numa._through is not None) == (made == "iterated through")
    replaced = fork_watch.replaced_workers()
    head_lock_at_fork.wedge(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        began = time.monotonic()
        assert firsts(iter(loader)) == expected()
    assert time.monotonic() - began < DEADLINE_S + 5
    assert fork_watch.replaced_workers() == replaced + 1


def test_where_a_worker_cannot_be_replaced_the_error_names_it_and_the_fix(
    head_lock_at_fork: HeadLockAtFork, short_deadline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As with a torch or Python whose internals numafast does not know: the consumer
    gets the error at the stuck worker's first batch, within the deadline, and the
    iteration then ends as it does when a worker dies."""
    monkeypatch.setattr(fork_watch, "_process_forking", lambda: None)  # what a Process runs: unknown
    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=5)
    head_lock_at_fork.wedge(1)
    began = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        iterator = iter(loader)
        stuck = iterator._workers[1].pid
        assert firsts([next(iterator)]) == expected()[:1]
        with pytest.raises(fork_watch.WorkerStartError) as raised:
            next(iterator)
        assert time.monotonic() - began < DEADLINE_S + 3
        text = str(raised.value)
        assert f"DataLoader worker 1 (pid {stuck}) had not started" in text and "futex" in text, text
        assert "could not replace it" in text and "3.11.8" in text and 'multiprocessing_context="forkserver"' in text
        with pytest.raises(RuntimeError, match=f"DataLoader worker \\(pid\\(s\\) {stuck}\\) exited unexpectedly"):
            for _batch in iterator:  # worker 0's batches, then batch 3, worker 1's: never coming
                pass
    del iterator
    assert not Path(f"/proc/{stuck}").exists() or "Z" in Path(f"/proc/{stuck}/stat").read_text().split(")")[-1][:3]


def test_a_dropped_iterator_lets_its_dataset_go_while_a_worker_is_yet_to_start(
    head_lock_at_fork: HeadLockAtFork, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a pending worker runs (kept to fork it again) goes with its iterator, not when
    the watch thread next looks: the loader's pools go idle for the next loader at once."""
    monkeypatch.setattr(fork_watch, "POLL_S", 10.0)  # the watch looks every 0.256 s: it sleeps at the del
    samples = SlowToStart(0)
    loader = numafast.torch.NumaLoader(samples, batch_size=2, num_workers=2, timeout=20)
    gone = weakref.ref(samples), weakref.ref(loader)
    head_lock_at_fork.wedge(1)  # worker 1 stays in os.fork(), pending for the whole test (the deadline is 5 s)
    iterator = iter(loader)
    stuck = iterator._workers[1]
    assert firsts([next(iterator)]) == expected()[:1]  # worker 0's
    time.sleep(1)
    assert "futex" in wchan(stuck.pid) and any(t.name == "numafast worker start" for t in threading.enumerate())
    torch.utils.data._utils.signal_handling._remove_worker_pids(id(iterator))  # not an error: killed here
    iterator._worker_pids_set = False
    stuck.kill()
    stuck.join(5)
    del iterator, loader, samples
    assert collected(*gone, within_s=0.05)  # the watch thread sleeps on: it holds nothing of them


def test_the_watch_holds_no_iterator_while_it_polls_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The poll of the start tokens lets go of the GIL: an iterator the consumer drops
    then goes at once (its pools idle for the next loader), not when the watch's look
    ends, in the watch's thread."""

    class Iterator:
        _shutdown = False

    held = [Iterator()]  # the consumer's reference
    made = weakref.ref(held[0])
    watch = fork_watch._StartWatch(contextlib.nullcontext)
    watch.workers.append(fork_watch._Worker(0, os.getpid(), watch.token()))  # a worker yet to start
    gone_during_poll: list[bool] = []
    poll = fork_watch._unclaimed

    def poll_as_the_consumer_drops_it(tokens: list[Any]) -> set[int]:
        held.clear()
        gone_during_poll.append(made() is None)
        return poll(tokens)

    monkeypatch.setattr(fork_watch, "_unclaimed", poll_as_the_consumer_drops_it)
    thread = threading.Thread(target=watch.run, args=(made,))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and gone_during_poll[:1] == [True]
    assert not watch.tokens  # the watch ended with its iterator, its token closed


def test_the_watch_holds_no_iterator_while_it_kills_a_doomed_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the iterator shuts down, the watch kills the workers whose start error it
    queued, and each kill waits (for torch to let its workers go, then for the process).
    An iterator the consumer drops meanwhile goes in the consumer's thread. Held by the
    watch, it went in the watch's daemon thread: freeing its batches there as the
    interpreter exits aborted the process ("terminate called without an active
    exception", once in ~50 runs of a script whose worker's replacements all died)."""

    class Iterator:
        _shutdown = True

    held = [Iterator()]  # the consumer's reference
    made = weakref.ref(held[0])
    watch = fork_watch._StartWatch(contextlib.nullcontext)
    watch.workers.append(fork_watch._Worker(0, os.getpid(), None))  # started
    watch.doomed.append((object(), 0))  # a worker whose error the consumer has not met
    gone_during_kill: list[bool] = []

    def kill_as_the_consumer_drops_it(process: Any) -> None:
        held.clear()
        gone_during_kill.append(made() is None)

    monkeypatch.setattr(fork_watch, "_kill", kill_as_the_consumer_drops_it)
    thread = threading.Thread(target=watch.run, args=(made,))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and gone_during_kill == [True]


class SlowToStart(torch.utils.data.Dataset[Any]):
    """Each worker's first sample takes ``first_s`` seconds."""

    def __init__(self, first_s: float) -> None:
        self.first_s = first_s
        self.started_in = 0

    def __len__(self) -> int:
        return 2 * BATCHES

    def __getitem__(self, index: int) -> Any:
        if self.started_in != os.getpid():
            self.started_in = os.getpid()
            time.sleep(self.first_s)
        return torch.full((64,), float(index))


def slow_init(worker_id: int) -> None:
    time.sleep(3 * DEADLINE_S / 2 if worker_id == 1 else 0)


def test_a_worker_whose_first_batch_is_only_slow_is_not_replaced(short_deadline: None) -> None:
    """A worker started at its fork: a slow worker_init_fn or first batch is no alarm."""
    loader = numafast.torch.NumaLoader(SlowToStart(3 * DEADLINE_S), batch_size=2, num_workers=2, timeout=20,
                                       worker_init_fn=slow_init)  # fmt: skip
    replaced = fork_watch.replaced_workers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iterator = iter(loader)
        pids = [worker.pid for worker in iterator._workers]
        assert firsts(iterator) == expected()
    assert fork_watch.replaced_workers() == replaced
    assert not [warning for warning in caught if "had not started" in str(warning.message)]
    assert [worker.pid for worker in iterator._workers] == pids


def test_the_watch_ends_once_every_worker_started() -> None:
    """Nothing of the watch is left once the workers run: no thread, no token."""
    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=20)
    iterator = iter(loader)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(t.name == "numafast worker start" for t in threading.enumerate()):
        time.sleep(0.01)
    assert not any(thread.name == "numafast worker start" for thread in threading.enumerate())
    assert not fork_watch._open_tokens
    assert firsts(iterator) == expected()


def test_a_worker_the_watch_kills_is_not_taken_for_one_that_died_even_while_torch_shuts_down() -> None:
    """torch's SIGCHLD handler raises "killed by signal" in the consumer for any
    registered worker killed, also inside the joins of its own shutdown (seen once in CI:
    a replacement killed because the epoch had ended as it was forked). The watch's kill
    takes the worker out of the registered ones first, or, once the iterator is shutting
    down, waits until torch has let them all go."""
    iterator = iter(torch.utils.data.DataLoader(dataset(), batch_size=2, num_workers=2))
    first, second = iterator._workers
    try:
        # Every batch taken (the epoch not yet ended): the workers wait for an index. Killed
        # while it reads one, a worker may hold the lock of torch's done event (each index
        # is checked against it), and torch's shutdown then waits on that lock forever.
        assert len(firsts(itertools.islice(iterator, BATCHES))) == BATCHES
        fork_watch._end(iterator, first)  # iterating: first leaves the registered workers
        time.sleep(0.5)  # the handler runs in this thread, here, if it finds a worker killed
        assert not first.is_alive()

        iterator._shutdown = True  # torch's shutdown, begun: its joins come before its finally
        ending = threading.Thread(target=fork_watch._end, args=(iterator, second))
        ending.start()
        time.sleep(0.5)
        assert second.is_alive()  # the kill waits for torch's finally
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(iterator))  # that finally
        iterator._worker_pids_set = False
        ending.join(10)
        assert not ending.is_alive() and not second.is_alive()
        time.sleep(0.5)
    finally:
        iterator._shutdown = False
        iterator._shutdown_workers()


class Finalized:
    """Garbage in a reference cycle, which only the collector frees; its finalizer
    records the process it ran in."""

    def __init__(self, record: Path) -> None:
        self.record = record
        self.cycle = self

    def __del__(self) -> None:
        with self.record.open("a") as file:
            file.write(f"{os.getpid()}\n")


class Collecting(torch.utils.data.Dataset):  # type: ignore[misc]
    """Four samples, each after a full collection in the worker."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> Any:
        gc.collect()
        return torch.zeros(4)


def test_a_worker_never_runs_the_finalizers_of_garbage_it_inherited(tmp_path: Path) -> None:
    """The parent's garbage still uncollected at the fork stays the parent's: collected in
    a worker, its finalizers (torch's iterator shutting down workers not its own, an
    import amid an import under 3.11) ran there."""
    record = tmp_path / "finalized"
    gc.disable()  # the garbage lives on to the fork, as uncollected garbage does between collections
    try:
        Finalized(record)
        loader = numafast.torch.NumaLoader(Collecting(), batch_size=1, num_workers=2)
        assert sum(1 for _batch in loader) == 4
    finally:
        gc.enable()
    gc.collect()
    assert record.read_text().split() == [str(os.getpid())]  # finalized once, here


# A process whose chosen forks die before numafast's first step after the fork: its own
# after-fork handler, registered before numafast's (handlers run in that order), ends
# the child, as numafast.pool's ends one that cannot make its view of a pool private.
# It iterates off the main thread, where torch's SIGCHLD handler does not report the
# death at once (in the main thread it mostly does, and the watch is not needed).
DIES_BEFORE_IT_STARTS = """
import json, os, sys, threading, warnings
forks, dying = [0], {int(fork) for fork in sys.argv[1].split(",")}

def count() -> None:
    forks[0] += 1

def die() -> None:
    if forks[0] - 1 in dying:
        os._exit(70)

os.register_at_fork(before=count, after_in_child=die)
import torch
import numafast.torch
from numafast.torch import fork_watch

fork_watch.START_DEADLINE_S = 1.0
data = [torch.tensor([index]) for index in range(16)]
loader = numafast.torch.NumaLoader(data, batch_size=2, num_workers=2, timeout=20)
said, error, batches = [], None, []

def consume() -> None:  # off the main thread: no SIGCHLD handler reports the death at once
    global error
    try:
        for batch in loader:
            batches.append(batch[:, 0].tolist())
    except Exception as raised:
        error = f"{type(raised).__name__}: {raised}"

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    consumer = threading.Thread(target=consume)
    consumer.start()
    consumer.join(60)
said = [str(warning.message) for warning in caught if "DataLoader worker" in str(warning.message)]
print(json.dumps({"batches": batches, "error": error, "said": said, "replaced": fork_watch.replaced_workers()}))
"""


def dies_before_it_starts(*forks: int) -> dict[str, Any]:
    """What a loader whose worker forks ``forks`` (counted from 0) die before they start did."""
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(numafast.__file__).parents[1]), *sys.path])}
    ran = subprocess.run([sys.executable, "-c", DIES_BEFORE_IT_STARTS, ",".join(map(str, forks))],
                         capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    outcome: dict[str, Any] = json.loads(ran.stdout.splitlines()[-1])
    return outcome


def test_a_worker_that_died_before_it_started_is_named_as_such_and_replaced() -> None:
    """Not "stuck inside os.fork()": what ended it (its exit status) is said."""
    outcome = dies_before_it_starts(1)
    assert outcome["batches"] == [[2 * number, 2 * number + 1] for number in range(BATCHES)], outcome
    assert outcome["replaced"] == 1 and outcome["error"] is None, outcome
    said = outcome["said"]
    assert len(said) == 1 and "DataLoader worker 1 (pid" in said[0] and "exited with status 70" in said[0], said
    assert "before it started" in said[0] and "replaced by pid" in said[0], said
    assert "os.fork()" not in said[0] and "gh-112275" not in said[0], said


def test_a_worker_whose_replacements_die_too_is_named_in_the_error() -> None:
    outcome = dies_before_it_starts(1, 2, 3, 4)  # worker 1 and the 3 forked in its place
    assert outcome["replaced"] == 3, outcome
    error = outcome["error"] or ""
    assert "WorkerStartError" in error and "exited with status 70 before it started" in error, outcome
    assert "could not replace it" in error and "os.fork()" not in error, outcome


IMPORTING_AT_THE_FORK = """
import importlib.abc, importlib.machinery, sys, threading
import torch
from torch.utils.data import DataLoader
import numafast.torch
inside, gate = threading.Event(), threading.Event()

class Held(importlib.abc.Loader):  # numpy.random's import stops here, its module lock held, until the gate opens
    def __init__(self, real):
        self.real = real
    def create_module(self, spec):
        return self.real.create_module(spec)
    def exec_module(self, module):
        inside.set()
        gate.wait(60)
        self.real.exec_module(module)

class HoldsNumpyRandom(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "numpy.random._pickle" or threading.current_thread().name != "importer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = Held(spec.loader)
        return spec

sys.meta_path.insert(0, HoldsNumpyRandom())
threading.Thread(target=lambda: __import__("numpy.random"), name="importer", daemon=True).start()
inside.wait(2)  # numpy.random loaded already: no wait
loader = numafast.torch.NumaLoader(DataLoader(list(range(16)), batch_size=4, num_workers=2, timeout=15))
try:
    print([batch.tolist() for batch in loader])
except RuntimeError as error:
    print(error)
finally:
    gate.set()
"""


def test_a_thread_importing_numpy_random_at_the_fork_does_not_stop_the_workers() -> None:
    """torch's worker loop seeds numpy.random: its first import in a worker forked while
    another thread was importing it waited for that thread's lock forever (here the
    DataLoader's timeout ended it: "DataLoader timed out after 15 seconds")."""
    import subprocess

    ran = subprocess.run([sys.executable, "-c", IMPORTING_AT_THE_FORK], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip() == str([list(range(n, n + 4)) for n in range(0, 16, 4)]), ran.stdout


_forks_from: list[str] = []  # the thread of each fork of this process, in order
os.register_at_fork(before=lambda: _forks_from.append(threading.current_thread().name))


def test_a_replacement_is_forked_and_registered_in_the_consuming_thread(
    head_lock_at_fork: HeadLockAtFork, short_deadline: None
) -> None:
    """Not in the watch's thread, while the consumer may be inside CUDA, OpenMP or an
    allocator (a replacement forked then may block past its start, unwatched), nor
    racing torch's shutdown in its registry of worker pids (a remove and a put from
    another thread: torch's own remove then fails and skips its terminate loop)."""
    registry = {torch._C._set_worker_pids, torch._C._remove_worker_pids}
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg in registry:
            calls.append(threading.current_thread().name)

    loader = numafast.torch.NumaLoader(dataset(), batch_size=2, num_workers=2, timeout=20)
    replaced = fork_watch.replaced_workers()
    head_lock_at_fork.wedge(1)
    forks = len(_forks_from)
    threading.setprofile(profile)  # the threads started from now on: the watch's
    sys.setprofile(profile)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert firsts(iter(loader)) == expected()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert fork_watch.replaced_workers() == replaced + 1
    consumer = threading.current_thread().name
    assert _forks_from[forks:] == [consumer] * 3  # two workers, then the one in worker 1's place
    assert len(calls) >= 3 and set(calls) == {consumer}, calls  # set, re-set without the stuck one, removed


# Garbage made at the last moment before a worker's fork, and a handler that allocates
# in the child before numafast's first step (registered before numafast's, it runs
# first): enough to set the collector off there, with it on.
COLLECTS_BEFORE_NUMAFAST = """
import gc, os, sys
record = sys.argv[1]

class Finalized:
    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        with open(record, "a") as file:
            file.write(f"{os.getpid()}\\n")

forks = [0]

def garbage() -> None:
    forks[0] += 1
    if forks[0] == 1:
        Finalized()

def allocate() -> None:
    [[] for _ in range(2000)]

os.register_at_fork(before=garbage, after_in_child=allocate)
import torch
import numafast.torch

assert gc.isenabled()
loader = numafast.torch.NumaLoader([torch.zeros(4) for _ in range(8)], batch_size=2, num_workers=2)
assert sum(1 for _batch in loader) == 4 and gc.isenabled()
gc.collect()
print(os.getpid())
"""


def test_a_worker_never_runs_the_finalizers_of_garbage_it_inherited_even_with_the_collector_on(
    tmp_path: Path,
) -> None:
    """The collector may run in the child before numafast's first step there (any
    allocation in an earlier after-fork handler): it is off from the fork until then."""
    import subprocess

    record = tmp_path / "finalized"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(numafast.__file__).parents[1]), *sys.path])}
    ran = subprocess.run([sys.executable, "-c", COLLECTS_BEFORE_NUMAFAST, str(record)], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert record.read_text().split() == [ran.stdout.split()[-1]]  # finalized once, in the parent
