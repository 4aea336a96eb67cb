"""A batch a forked child inherited reads, in the child, what it held at the fork, however
the parent goes on: a slot the parent held at a fork is reused only once every child of
that fork has exited or exec'd (numafast/_process.py ``ForkGuard``). Checked by content,
in scripts run in their own processes (a fork of the test process would copy pytest's
threads' locks): the child reads the batch after the parent dropped it and refilled
every slot it could."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from numafast import _process

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.host_only("fork and copy-on-write are alike on any kernel; ~5 s a script under TCG")

# A pool of SLOTS slots; `batch` (slot 0) filled with 7 and held; the child forked then
# reads `batch` only when asked (child_reads), after the parent dropped it.
FORKED = """
import os, sys, time
import numpy as np
import numafast
from numafast import _process
pool = numafast.PinnedPool(0, 4096, SLOTS, lock="off")
slot = pool.acquire()
batch = np.asarray(slot)
batch[:] = 7
del slot

def fork_reader(array):  # a child forked now, which reads `array` when asked: the call returned asks it
    ready, go = os.pipe()
    answer_read, answer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(ready, 1)
        os.write(answer, f"{array[0]} {array[-1]}".encode())
        os._exit(0)

    def reads():
        os.write(go, b"x")
        seen = os.read(answer_read, 64).decode()
        os.waitpid(pid, 0)
        return seen
    return reads

child = fork_reader(batch)
del batch

def child_reads():
    print("child reads", child())
"""


def run(script: str, slots: int = 1, preamble: str = FORKED) -> list[str]:
    """``script`` after ``preamble`` (:data:`FORKED` with a pool of ``slots``), run in a
    new interpreter: its printed lines."""
    code = preamble.replace("SLOTS", str(slots)) + textwrap.dedent(script)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_a_batch_a_forked_child_inherited_reads_the_same_after_the_parent_reuses_the_pool() -> None:
    """The parent refills every slot it can get, many times, after dropping the batch:
    the child still reads 7 (before ForkGuard: 9, the parent's next batch in that slot)."""
    lines = run("""
        for round in range(20):
            taken = [np.asarray(pool.acquire(timeout=0)) for _ in range(pool.stats().free)]
            for memory in taken:
                memory[:] = 9
            refilled = len(taken)
            del taken, memory
        print("refilled", refilled)  # every slot, the batch's too
        child_reads()
    """, slots=3)  # fmt: skip
    assert lines == ["refilled 3", "child reads 7 7"]


def test_the_child_reads_the_batch_as_it_was_at_the_fork_whatever_the_parent_writes_into_it() -> None:
    """The parent, still holding the batch, writes into it after the fork: the child
    reads what was there at the fork, as with any memory forked (before: 8, the
    parent's write, seen through the pool's file)."""
    lines = run("""
        held = np.asarray(pool.acquire(timeout=0))
        held[:] = 5
        second = fork_reader(held)
        held[:] = 8
        print("second child reads", second())
        child_reads()
    """, slots=2)  # fmt: skip
    assert lines == ["second child reads 5 5", "child reads 7 7"]


def test_a_closed_pools_batch_held_at_the_fork_reads_in_the_child_as_it_was_then() -> None:
    """A pool closed while a batch is held (a loader's pool retired by a resize) reuses
    no slot, but the parent may still write into the batch it holds: the child copies
    that slot too (before: 8, the parent's write, seen through the pool's file)."""
    lines = run("""
        held = np.asarray(pool.acquire(timeout=0))
        held[:] = 5
        pool.close()
        second = fork_reader(held)
        held[:] = 8
        print("second child reads", second())
        child_reads()
    """, slots=2)  # fmt: skip
    assert lines == ["second child reads 5 5", "child reads 7 7"]


def test_once_forked_the_parent_hands_the_slot_out_again_at_once() -> None:
    """The child copies what it inherited before the parent's fork returns: the one
    slot, dropped by the parent, is handed out again at once, the child still alive."""
    lines = run("""
        again = np.asarray(pool.acquire(timeout=0))
        again[:] = 9
        print("guarded", getattr(pool.stats(), "guarded", None))
        child_reads()
    """)  # fmt: skip
    assert lines == ["guarded 0", "child reads 7 7"]


def test_a_grandchild_reads_the_batch_its_parent_inherited_not_the_pools_file() -> None:
    """The child forks in turn (a fork-context Pool, a DataLoader of its own, a fork-based
    checkpoint saver) after the parent refilled the slot: the grandchild reads the 7 the
    child inherited (before: 9, its view of the first process's pool made anew from
    the file, over the child's copy)."""
    lines = run("""
        ready, go = os.pipe()
        answer_read, answer = os.pipe()
        pid = os.fork()  # the child: `batch`, 7, held at the fork
        if pid == 0:
            os.read(ready, 1)
            grandchild = os.fork()
            if grandchild == 0:
                os.write(answer, f"{batch[0]} {batch[-1]}".encode())
                os._exit(0)
            os.waitpid(grandchild, 0)
            os.write(answer, f" child {batch[0]} {batch[-1]}".encode())
            os._exit(0)
        del batch
        again = np.asarray(pool.acquire(timeout=0))
        again[:] = 9
        os.write(go, b"x")
        os.waitpid(pid, 0)
        print("grandchild reads", os.read(answer_read, 64).decode())
    """, preamble=FORKED.split("child = fork_reader")[0])  # fmt: skip
    assert lines == ["grandchild reads 7 7 child 7 7"]


# The same, but the child cannot copy the slots (made to fail here, as running out of
# memory would): the parent keeps them out of use while that child lives.
UNCOPIED = """
import numafast.pool
from numafast import _process
def cannot_copy(pool, guard):
    raise OSError(12, "Cannot allocate memory")
numafast.pool.PinnedPool.copy_guarded = cannot_copy
_process.FORK_COPY_WAIT_S = 0.2
"""


def test_a_slot_a_child_could_not_copy_is_handed_out_again_once_it_has_exited() -> None:
    """The one slot, held at the fork and dropped, is out of use while the child lives
    (the error says why), and handed out again once it has exited."""
    lines = run(UNCOPIED + FORKED.replace("SLOTS", "1") + textwrap.dedent("""
        try:
            pool.acquire(timeout=0)
        except numafast.PoolExhaustedError as error:
            print("refused:", "1 kept for processes forked while they were held" in str(error))
        child_reads()
        again = np.asarray(pool.acquire(timeout=0))
        print("again", again.shape[0], pool.stats().guarded, pool.stats().in_use)
    """), preamble="")  # fmt: skip
    assert lines == ["refused: True", "child reads 7 7", "again 4096 0 1"]


def test_a_process_forked_by_a_child_that_could_not_copy_does_not_hold_its_guard() -> None:
    """A child that could not copy (as a DataLoader worker past WORKER_COPY_BYTES) forks
    a helper that lives on: the slot comes back into use once the child has exited, not
    once the helper has (before: guarded 1 while the helper lived)."""
    lines = run(UNCOPIED + """
        import os, time
        import numpy as np
        import numafast
        pool = numafast.PinnedPool(0, 4096, 1, lock="off")
        slot = pool.acquire()
        batch = np.asarray(slot)
        batch[:] = 7
        del slot
        release, go = os.pipe()
        child = os.fork()
        if child == 0:  # it cannot copy: it keeps its guard's write end
            if os.fork() == 0:
                os.read(release, 1)  # the helper lives until the parent lets it go
            os._exit(0)
        del batch
        os.waitpid(child, 0)
        deadline = time.monotonic() + 10
        while pool.stats().guarded and time.monotonic() < deadline:
            pool.unguard()
            time.sleep(0.05)
        print("guarded", pool.stats().guarded)
        os.write(go, b"x")
    """.replace("\n        ", "\n"), preamble="")  # fmt: skip
    assert lines == ["guarded 0"]


# A signal handler that raises (Ctrl-C's, PyTorch's SIGCHLD handler for a dead worker),
# run at the first instruction of an at-fork step, as for a signal that came during the
# fork: made to happen there by a trace function, which calls the handler itself.
INTERRUPTED = """
import signal, sys
class Interrupted(Exception):
    pass
def interrupt(signum, frame):
    raise Interrupted(signum)
signal.signal(signal.SIGUSR1, interrupt)
def interrupting(step):
    first = [True]
    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == step and first[0]:
            first[0] = False
            interrupt(signal.SIGUSR1, frame)
    return tracer
"""


def test_a_fork_step_a_signal_handler_interrupted_still_ends_the_guard() -> None:
    """Interrupted at its first instruction, the parent's step after the fork is run again:
    it closes the guard's write end, so the slot held at the fork is used again once
    dropped (before: the step was skipped, the write end stayed open and the slot
    guarded for good). The handler's exception is printed, as CPython does for a hook's."""
    lines = run(INTERRUPTED + """
        held = np.asarray(pool.acquire(timeout=0))
        held[:] = 5
        sys.settrace(interrupting("_guarded_in_parent"))
        second = fork_reader(held)
        sys.settrace(None)
        held[:] = 8
        del held
        pool.unguard()
        print("second child reads", second(), "guarded", pool.stats().guarded)
        child_reads()
    """.replace("\n        ", "\n"), slots=2, preamble=FORKED + INTERRUPTED.replace("SLOTS", "2"))  # fmt: skip
    assert lines == ["second child reads 5 5 guarded 0", "child reads 7 7"]


def test_the_collector_is_on_again_after_a_fork_step_a_signal_handler_interrupted() -> None:
    """The fork watch turns the collector off for a worker's fork; interrupted at its
    first instruction, its step after the fork is run again and turns it back on
    (before: it stayed off for the rest of the process)."""
    pytest.importorskip("torch")
    lines = run("""
        import gc
        import numafast.torch.fork_watch
        from numafast import _process
        _process.forking.collecting = True  # as the watch's step before a worker's fork leaves it
        gc.disable()
        sys.settrace(interrupting("_after_fork_in_parent"))
        if os.fork() == 0:
            os._exit(0)
        sys.settrace(None)
        os.wait()
        print("collecting", gc.isenabled())
    """.replace("\n        ", "\n"), preamble="import os\n" + INTERRUPTED)  # fmt: skip
    assert lines == ["collecting True"]


def test_a_child_that_could_not_copy_lets_its_slots_go_when_it_execs() -> None:
    """A child that execs another program has no inherited batch left: its guard ends at
    the exec (close-on-exec), while that program still runs."""
    lines = run(UNCOPIED + FORKED.replace("SLOTS", "2") + textwrap.dedent("""
        held = np.asarray(pool.acquire(timeout=0))
        runner = os.fork()
        if runner == 0:
            os.execv("/bin/sleep", ["sleep", "60"])
        del held
        child_reads()  # the guard of the first fork ends with that child
        deadline = time.monotonic() + 10
        while pool.stats().guarded and time.monotonic() < deadline:
            pool.unguard()
            time.sleep(0.05)
        print("guarded", pool.stats().guarded, "still sleeping", os.waitpid(runner, os.WNOHANG) == (0, 0))
        os.kill(runner, 9)
        os.waitpid(runner, 0)
    """), preamble="")  # fmt: skip
    assert lines == ["child reads 7 7", "guarded 0 still sleeping True"]


def test_closing_the_pool_retires_its_guarded_slot_and_the_child_still_reads_it() -> None:
    """A closed pool reuses no slot: its memory is released while the child lives, and
    the child's own view of the file still reads the batch."""
    lines = run("""
        pool.close()
        print("released", pool.stats().bytes_mapped == 0, pool.stats().guarded)
        child_reads()
    """)  # fmt: skip
    assert lines == ["released True 0", "child reads 7 7"]


def test_a_fork_with_no_descriptor_free_keeps_the_held_slot_for_the_child_and_says_so() -> None:
    """No descriptor is free for the guard's pipe at the fork (the open-files limit
    reached): the slot held stays out of use, the child still reads its 7 after the
    parent refilled every slot it could, and one warning names the limit. (The
    pipe's OSError was only printed, the fork went on unguarded, and the child read
    the parent's 9.)"""
    lines = run("""
        import resource, warnings
        ready, go = os.pipe()
        answer_read, answer = os.pipe()
        lowest_free = os.open("/dev/null", os.O_RDONLY)
        os.close(lowest_free)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
            pid = os.fork()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if pid == 0:
            os.read(ready, 1)
            os.write(answer, f"{batch[0]} {batch[-1]}".encode())
            os._exit(0)
        del batch
        taken = [np.asarray(pool.acquire(timeout=0)) for _ in range(pool.stats().free)]
        for memory in taken:
            memory[:] = 9
        print("refilled", len(taken), "guarded", pool.stats().guarded)
        os.write(go, b"x")
        print("child reads", os.read(answer_read, 64).decode())
        os.waitpid(pid, 0)
        print([str(warning.message)[:60] for warning in said], {warning.filename for warning in said})
    """, slots=2, preamble=FORKED.split("child = fork_reader")[0])  # fmt: skip
    assert lines == ["refilled 1 guarded 1", "child reads 7 7",
                     "['numafast: no file descriptor was free at this fork (the open'] {'<string>'}"]  # fmt: skip


def test_a_child_forked_by_one_thread_does_not_hold_another_threads_guard() -> None:
    """Thread B forks a long-lived child while the main thread's fork of the held slot
    is under way (between its before- and after-fork steps, where the GIL lets another
    thread in). B's child must not keep the main thread's guard open: it did (the write
    end is close-on-exec, not closed at fork), so that fork waited its 2 s for nothing
    and the slot, dropped, stayed out of use for as long as B's child lived."""
    lines = run("""
        import os, threading
        main = threading.main_thread()
        fork_b, b_forked = threading.Event(), threading.Event()

        def in_the_middle_of_mains_fork():  # registered before numafast's: runs before its after-fork step
            if threading.current_thread() is main and not fork_b.is_set():
                fork_b.set()
                b_forked.wait(30)

        os.register_at_fork(after_in_parent=in_the_middle_of_mains_fork)
        import numpy as np
        import numafast
        pool = numafast.PinnedPool(0, 4096, 2, lock="off")
        batch = np.asarray(pool.acquire())
        batch[:] = 7
        stop_read, stop = os.pipe()
        b_child = []

        def thread_b():
            fork_b.wait(30)
            pid = os.fork()
            if pid == 0:
                os.read(stop_read, 1)  # lives until told
                os._exit(0)
            b_child.append(pid)
            b_forked.set()

        other = threading.Thread(target=thread_b)
        other.start()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        other.join(30)
        os.waitpid(pid, 0)
        del batch
        pool.unguard()
        print("b forked", bool(b_child), "guarded", pool.stats().guarded, "free", pool.stats().free)
        os.write(stop, b"x")
        os.waitpid(b_child[0], 0)
    """, preamble="")  # fmt: skip
    assert lines == ["b forked True guarded 0 free 2"]


def test_a_fork_while_no_slot_is_held_guards_nothing() -> None:
    """No slot held, no guard: nothing is kept, no descriptor is opened."""
    lines = run("""
        child_reads()
        fds = len(os.listdir("/proc/self/fd"))
        other = os.fork()
        if other == 0:
            os._exit(0)
        os.waitpid(other, 0)
        print("guards", len(_process.fork_guards), "new fds", len(os.listdir("/proc/self/fd")) - fds)
    """)  # fmt: skip
    assert lines == ["child reads 7 7", "guards 0 new fds 0"]


LOADER = """
import os, warnings
import torch
from torch.utils.data import Dataset
import numafast.torch

class Tagged(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, index):
        return torch.full((3, 32, 32), float(index)), index

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as said:
    loader = numafast.torch.NumaLoader(Tagged(), batch_size=8, num_workers=2, persistent_workers=PERSISTENT, node=0)
    images, labels = next(iter(loader))
    ready, go = os.pipe()
    answer_read, answer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(ready, 1)
        os.write(answer, repr((labels.tolist(), sorted(set(images.flatten().tolist())))).encode())
        os._exit(0)
    del images, labels
    for epoch in range(4):
        for images, labels in loader:
            assert images[:, 0, 0, 0].tolist() == [float(i) for i in labels.tolist()]
    del images, labels
    os.write(go, b"x")
    print("child reads", os.read(answer_read, 4096).decode())
    os.waitpid(pid, 0)
    stats = loader.stats()
print("copied", {reason: count for reason, count in stats.fallbacks.items() if reason != "first batches"})
print("warnings", [str(warning.message) for warning in said if "numafast" in str(warning.filename) + str(warning.message)])
"""


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent-workers", "workers-per-epoch"])
def test_a_loaders_batch_a_forked_child_inherited_reads_its_own_samples(persistent: bool) -> None:
    """A NumaLoader's first batch (samples 0-7), held at a fork; the parent then drops it
    and runs four epochs through the same slots: the child reads samples 0-7, with no
    warning and no batch copied for want of a slot."""
    pytest.importorskip("torch")
    code = LOADER.replace("PERSISTENT", str(persistent))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"child reads {([0, 1, 2, 3, 4, 5, 6, 7], [float(i) for i in range(8)])!r}",
        "copied {}",
        "warnings []",
    ]


# A consumer keeps the first epoch's 10 batches (80 MiB: more than a worker copies) and
# lets the dataset hold one of them; the second epoch's workers read it at every
# sample while the consumer drops the kept batches, and say how much of the pools' files
# each holds a private copy of.
KEEPING = """
import torch
from torch.utils.data import Dataset
import numafast.torch
from numafast.pool import MEMFD_PREFIX

def copied_kib():
    kib, private = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                private = fields[1].endswith("p") and MEMFD_PREFIX in line
            elif private and fields[0] == "Private_Dirty:":
                kib += int(fields[1])
    return kib

class Tagged(Dataset):
    kept = None
    def __len__(self):
        return 80
    def __getitem__(self, index):
        read = None
        if self.kept is not None:
            images, labels = self.kept
            read = (labels.tolist(), sorted(set(images[:, 0].tolist())), copied_kib())
        return torch.full((1 << 18,), float(index)), index, repr(read)

dataset = Tagged()
loader = numafast.torch.NumaLoader(dataset, batch_size=8, num_workers=2, timeout=60, node=0)
kept = list(loader)
dataset.kept = kept[1][:2]
reads = set()
for number, (images, labels, read) in enumerate(loader):
    assert images[:, 0].tolist() == [float(i) for i in range(8 * number, 8 * number + 8)], number
    reads.update(read)
    kept.pop()
print(sorted(reads))
"""


def test_a_loaders_workers_copy_nothing_of_the_batches_held_and_read_them_whole() -> None:
    """A NumaLoader's workers, forked while the consumer holds batches, copy none of them
    (each copied every held slot before it started: N workers times the bytes held, and
    past the fork watch's deadline a WorkerStartError), and those slots stay out of use
    while the workers live: a batch the dataset holds reads the same in them at every
    sample, as the consumer drops the batches and the pools go on."""
    pytest.importorskip("torch")
    result = subprocess.run([sys.executable, "-c", KEEPING], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [repr([repr(([8, 9, 10, 11, 12, 13, 14, 15], [float(i) for i in range(8, 16)], 0))])]


def test_a_guard_closed_while_another_thread_waits_on_it_ends_that_wait_without_error() -> None:
    """The forking thread waits on the guard while a receiving thread finds it ended and
    closes it: the wait says ended. (It read the closed descriptor: OSError EBADF, in
    an after-fork handler, which skipped handing the guarded slots out again.)"""
    read, write = os.pipe()
    os.set_blocking(read, False)
    guard = _process.ForkGuard(read)
    said: list[object] = []

    def wait() -> None:
        try:
            said.append(guard.ended(0.5))
        except OSError as error:
            said.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    guard.close()
    waiter.join(10)
    os.close(write)
    assert said == [True]
    assert guard.ended() and guard.ended(0.1)
