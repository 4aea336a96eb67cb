"""Process-wide state, in one place: every registry and flag that describes this
process (its pid, its pools, the node budget it reserved, its loaders' pools and
iterators, a worker's boards, the fork watch's tokens), and the one reset a child
that ``os.fork()`` makes runs first (:func:`_forked`).

NOTE: what a forked child inherits has its one answer in :func:`_forked`, item by
item; other modules reach this state as ``_process.NAME`` (never rebinding it: names
rebound here are read through the module, containers are only changed in place). This
module imports nothing of numafast's but the names of ``private.py`` (which imports
nothing), so that every layer can use it. Kept elsewhere: per-iterator state of the
fork watch (with each iterator, weakly: a child's inherited iterators are shut down
here, ``loader_iterators``), caches that describe no process (placements, struct
formats, layouts) and per-thread bindings.

The pid is cached for the checks made per batch (is this the pools' owner? a worker
forked since?) without a system call each: glibc no longer caches ``getpid()``. A
spawned child imports this anew. And what tells one process from another that the
kernel later gives the same pid: its start time (:func:`started`, :func:`start_time`).
A pid alone is no identity: pids are reused once the process that had one is gone and
reaped, within seconds on a busy machine where ``pid_max`` is small (32768 by default
before systemd raised it)."""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import os
import select
import signal
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from numafast.private import ITERATOR_SHUTDOWN, ITERATOR_WORKER_PIDS_SET, REMOVE_WORKER_PIDS, signal_handling

# ------------------------------------------------------------ this process

pid: int = os.getpid()
"""This process's id, set anew in a forked child: what is compared with a pool's or a
board's maker before anything only that process may do (a forked child has a copy)."""
_started: int | None = None  # this process's start time, read at the first call of started()
affinity_at_start: frozenset[int] = frozenset(os.sched_getaffinity(0))
"""The CPUs this process could run on as it began (at its fork; in a spawned one, as it
imported numafast): a DataLoader worker on others at its first batch, all of them its
node's, was placed there by the user's own ``worker_init_fn``, and stays there
(binding.py ``bind_if_permitted``)."""

done_once: set[str] = set()
"""What this process did once and never again, by key: the warnings said once (an
unlocked pool, an unregistered one, an unshared budget ledger, a replaced worker, each
LoaderHint, a loader collated in another process, memory placement refused), the pools'
exit hook (see :func:`first_time`)."""
workers_replaced = 0
"""Workers of this process's loaders replaced because they never started (torch/fork_watch.py)."""

# ------------------------------------------------------------ numafast's locks

class _Held(threading.local):
    """Per thread: how many DeferringLocks it holds or waits for, and the calls waiting
    until it holds none."""

    depth = 0

    def __init__(self) -> None:
        self.deferred: list[Callable[[], object]] = []


held = _Held()
"""This thread's DeferringLocks (``.depth``) and what waits for it to let go of them
(``.deferred``, see :func:`run_deferred`)."""


class DeferringLock:
    """A lock of numafast's (NodePools' per-batch mutex, the locks below) whose holder
    puts off the release of a pool closed while its slots were out. That release is
    queued by the deallocator of the pool's last slot as a pending call, which CPython
    runs in the main thread between any two of its instructions, so possibly inside a
    held lock: it waits for GPU copies and unmaps (other threads would wait behind it)
    and gives a node budget's share back (under ``reserved_mutex``, which this thread
    may hold: it would wait for itself). :func:`defer_until_unlocked` keeps it until the
    thread has let go of every such lock. A waiting thread counts as holding: a pending
    call runs as its ``acquire()`` returns, before it could say it holds the lock."""

    __slots__ = ("_lock",)

    def __init__(self, reentrant: bool = False) -> None:
        self._lock: Any = threading.RLock() if reentrant else threading.Lock()

    def acquire(self, blocking: bool = True) -> bool:
        held.depth += 1
        try:
            if self._lock.acquire(blocking):
                return True
        except BaseException:
            let_go()
            raise
        let_go()
        return False

    def release(self) -> None:
        self._lock.release()
        let_go()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def holds_a_lock() -> bool:
    """Whether the calling thread holds (or waits for) a DeferringLock."""
    return held.depth > 0


def defer_until_unlocked(call: Callable[[], object]) -> bool:
    """Keep ``call`` until the calling thread lets go of its last DeferringLock; False
    (call it now) where it holds none."""
    if not held.depth:
        return False
    held.deferred.append(call)
    return True


def let_go() -> None:
    """One DeferringLock of this thread's let go (or not taken): at the last, the calls
    kept for then run (:func:`run_deferred`)."""
    held.depth -= 1
    if not held.depth and held.deferred:
        run_deferred()


def run_deferred() -> None:
    """Run the calls kept until this thread held no DeferringLock; where one raises, those
    after it run at the next lock let go."""
    deferred, held.deferred = held.deferred, []
    for index, call in enumerate(deferred):
        try:
            call()
        except BaseException:
            held.deferred[:0] = deferred[index + 1:]
            raise


# ------------------------------------------------------------ pinned pools (numafast/pool.py)

live_pools: weakref.WeakSet[Any] = weakref.WeakSet()
"""Every open PinnedPool: closed at exit."""
pool_files: weakref.WeakSet[Any] = weakref.WeakSet()
"""Every pool's memory not released yet (pool.py ``_Resources``): also a pool being
made, and one whose PinnedPool is gone while its slots are still viewed."""
released_later: list[Any] = []
"""Registered pools drained while their thread captured a CUDA graph (pool.py ``_release_deferred``)."""
FORK_REMAP_FAILED_STATUS = 70
"""The exit status of a forked child that cannot make its view of a pool private."""


class ForkGuard:
    """The slots this process held at one fork, for the children of that fork.

    A child reads its inherited arrays and tensors through a private view of the pool
    (see :func:`_forked`), which still reads the pool's file where the child has not
    written: once the parent reused such a slot, the child would read the parent's next
    batch there, or see the parent's writes into the batch it holds. So the child copies
    those slots into memory of its own first thing (a pool's ``copy_guarded``), the parent
    waits up to :data:`FORK_COPY_WAIT_S` for that, and each slot given back meanwhile
    stays out of use (a pool's ``guard_held``) until the guard ends. A NumaLoader's
    DataLoader worker (a fork the start watch arms) copies as much as
    :data:`WORKER_COPY_BYTES` (the loop's last batch, still bound as the next epoch
    forks): past it (a consumer keeping batches), N workers would each copy every held
    slot before they could start, N times the bytes held; it copies nothing then, is not
    waited for, and its guard lasts until it exits. What tells: a pipe whose write end
    (close-on-exec) only the child holds, the parent's copy closed once forked; the
    child closes it once its copy is made, so the read end kept here reads end-of-file
    then, or when the child exits or execs (a worker, or a child that could not copy)."""

    __slots__ = ("_read", "_mutex", "__weakref__")

    def __init__(self, read: int | None) -> None:
        self._read = read
        """The pipe's read end; None: no descriptor was free for a pipe at the fork, and
        the guard never ends (the slots stay out of use until their pool closes)."""
        self._mutex = threading.Lock()
        fork_guards.add(self)

    def ended(self, wait_s: float = 0.0) -> bool:
        """Whether no process holds the write end any more, waiting up to ``wait_s``. Two
        threads may ask at once (the forking one waits here while a receiving one looks):
        the read end is read and closed under the guard's mutex, and the wait, outside it,
        only ends early where another thread closed it meanwhile."""
        if self._read is None:
            return False
        if wait_s > 0:
            with self._mutex:
                if self._read < 0:
                    return True
                waiting = select.poll()  # not select(): a descriptor numbered past 1023 is refused there
                waiting.register(self._read, select.POLLIN)
            waiting.poll(wait_s * 1000)
        with self._mutex:
            if self._read < 0:
                return True
            try:
                if os.read(self._read, 1):
                    return False  # nothing is ever written; a byte changes nothing
            except BlockingIOError:
                return False
            self._close()
            return True

    def close(self) -> None:
        with self._mutex:
            self._close()

    def forget(self) -> None:
        """In a forked child: close its copy of the read end, and take a new mutex (another
        thread of the parent may have held the old one at the fork)."""
        self._mutex = threading.Lock()
        self._close()

    def _close(self) -> None:
        read, self._read = self._read, -1
        if read is not None and read >= 0:
            os.close(read)

    def __del__(self) -> None:
        self.close()


fork_guards: weakref.WeakSet[ForkGuard] = weakref.WeakSet()
"""Every fork guard not collected yet (its pools hold it): a child closes its copies."""
WORKER_COPY_BYTES = 64 << 20
"""The most a DataLoader worker copies of the slots held at its fork (see :class:`ForkGuard`)."""
guard_writes: set[int] = set()
"""The write ends of the guards of forks under way in this process's threads (one
thread's may be open as another forks: see ``_copied_guarded``)."""
kept_guard_writes: set[int] = set()
"""The write ends this process keeps of its parent's guard (it copied nothing: a worker,
or a child that could not): its own children close them (see ``_copied_guarded``)."""
FORK_COPY_WAIT_S = 2.0
"""How long the parent waits, after a fork, for the child's copy of the slots held at
it (milliseconds, normally; a child stuck in the fork never makes it: see
torch/fork_watch.py). Past it the parent goes on, those slots out of use until the
child has exited."""


def _guard_held_slots() -> None:
    """Before a fork, in the forking thread: every slot this process holds is guarded
    for the child (:class:`ForkGuard`); nothing where none is held. The fork watch's
    before-fork step (registered later, so run first) has said whether the child is a
    worker (``forking.pending``). Run again from the start where a signal handler
    raised inside it (:func:`at_fork_step`): a guard made already is kept."""
    pools = [pool for pool in list(live_pools) if pool.in_use]
    if not pools:
        return
    guard, write = getattr(forking, "guard", None), getattr(forking, "guard_write", None)
    if guard is None or write is None:
        try:
            read, write = os.pipe()  # both close-on-exec
            os.set_blocking(read, False)
        except OSError:  # no descriptor free (EMFILE): an exception here is only printed, and the fork goes on
            read, write = None, -1
        guard = ForkGuard(read)
        forking.guard, forking.guard_write, forking.guard_copied = guard, write, True
        if write >= 0:
            guard_writes.add(write)
    held = sum(pool.guard_held(guard) * pool.slot_bytes for pool in pools)
    forking.guard_copied = held <= WORKER_COPY_BYTES or getattr(forking, "pending", None) is None
    if not held:
        forking.guard = forking.guard_write = None
        guard.close()
        if write >= 0:
            guard_writes.discard(write)
            os.close(write)


def _guarded_in_parent() -> None:
    """After the fork, in the parent: only the child holds the guard's write end now;
    wait for its copy (not a worker's: it copies nothing), then hand out again what was
    given back meanwhile."""
    guard, write = getattr(forking, "guard", None), getattr(forking, "guard_write", None)
    if guard is None or write is None:
        return
    if write >= 0:
        guard_writes.discard(write)
        forking.guard_write = _CLOSED  # before it is closed: run again (at_fork_step), this step closes it once
        os.close(write)
    elif write != _CLOSED:
        forking.guard = forking.guard_write = None
        if first_time("fork guard without a pipe"):
            warnings.warn(
                "numafast: no file descriptor was free at this fork (the open-files limit, ulimit -n), so the "
                "pool slots held at it stay out of use until their pool closes, for the child to go on reading "
                "the batches it inherited; raise the limit (ulimit -n, resource.setrlimit(RLIMIT_NOFILE))",
                RuntimeWarning, stacklevel=3,  # this step, at_fork_step's, the caller of os.fork()
            )
        return
    if forking.guard_copied and guard.ended(FORK_COPY_WAIT_S):
        for pool in list(live_pools):
            pool.unguard()
    forking.guard = forking.guard_write = None


_CLOSED = -2  # forking.guard_write once the parent closed it


def _copied_guarded() -> None:
    """In a forked child: the slots held at its fork copied into its own memory, then its
    guard's write end closed (see :class:`ForkGuard`). Where one cannot be copied, and in
    a worker, the write end stays open: the parent keeps those slots out of use until
    this child exits. The write ends of forks other threads had under way at this one
    are their children's to hold: closed here, or those slots would wait for this child.
    So are those the parent kept of its own parent's guard: a process it forks in turn (a
    worker's helper) does not read the batches that guard keeps, and would keep them out
    of use for as long as it lives."""
    guard, write = getattr(forking, "guard", None), getattr(forking, "guard_write", None)
    forking.guard = forking.guard_write = None
    for other in (guard_writes | kept_guard_writes) - {write}:
        with contextlib.suppress(OSError):
            os.close(other)
    guard_writes.clear()
    kept_guard_writes.clear()
    if guard is None or write is None:
        return
    if forking.guard_copied:
        try:
            for pool in list(live_pools):
                pool.copy_guarded(guard)
        except (OSError, MemoryError):
            pass
        else:
            if write >= 0:
                os.close(write)
            return
    if write >= 0:
        kept_guard_writes.add(write)


# ------------------------------------------------------------ the node budget (numafast/node_budget.py)

ledgers: dict[Any, Any] = {}
"""Each node's ledger in /dev/shm, opened once, by (node, path)."""
ledgers_mutex = DeferringLock()
reserved = 0
"""What this process reserved on every node: what an explicit max_pinned_bytes bounds."""
reserved_mutex = DeferringLock()

# ------------------------------------------------------------ loaders' pools (numafast/torch/owner_process_pools.py)

loader_pools: weakref.WeakSet[Any] = weakref.WeakSet()
"""Every NodePools of this process (each adds itself): what max_pinned_bytes bounds together."""
idle_pools: dict[Any, Any] = {}
"""NodePools no loader uses any more, by (node, lock, register): the next loader's."""
idle_mutex = DeferringLock()
"""Guards idle_pools and every NodePools' ``users``."""
replacing: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""In a forked child: the pools made here in the place of each set inherited from the
parent, so that the loaders over one inherited set (the user's and a framework's copy
of it) land in one set here too, as they did there."""
loader_iterators: weakref.WeakSet[Any] = weakref.WeakSet()
"""torch's iterators over NumaLoaders of this process that have workers, and those the
fork watch found forking with numafast's collate (a loader iterated through, a
framework's copy: torch/fork_watch.py ``_found_watch``)."""
receivers: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""The receivers of this process by id: what a message names to become its batch (torch/message.py)."""

# ------------------------------------------------------------ a DataLoader worker (numafast/torch/worker_collate.py)

board_readers: dict[Any, Any] = {}
"""In a worker: the board of each loader it serves, mapped once, by (owner pid, inode)."""
making_batch = threading.Lock()
"""Held by a worker's collate while it makes a batch, and by its idle look at the board
between batches (numafast/torch/worker_collate.py): the idle look waits its turn."""
idle_watch_pid = 0
"""The worker process whose idle look runs (a child of it has none: it compares its pid)."""
iterating: tuple[int, int] = (0, 0)
"""(this process's pid, the pid of the process its DataLoader runs in), read once per process."""

# ------------------------------------------------------------ the fork watch (numafast/torch/fork_watch.py)

forking = threading.local()
"""Per thread: ``.watch``, the start watch arming this thread's forks; ``.pending``, the
read end of the start token of the fork under way; ``.collecting``, whether the
collector was on before it; ``.begin``, see torch/fork_watch.py ``_found_watch``;
``.guard`` and ``.guard_write``, the :class:`ForkGuard` of the fork under way and the
write end of its pipe."""
open_tokens: set[int] = set()
"""Every start token's read end this process holds (a child closes its copies)."""
STARTED = b"s"
"""A start token's one byte: whoever reads it decides whether the worker started."""


def first_time(key: str) -> bool:
    """True the first time ``key`` is asked for in this process (or in its parent, before
    the fork): for what is said or done once per process."""
    if key in done_once:
        return False
    done_once.add(key)
    return True


def _forked() -> None:
    """A forked child's first step, item by item: what it inherits, what it forgets.

    - ``pid``, its start time and the CPUs it may run on: its own, read anew.
    - ``done_once``: kept. The child does not repeat a warning its parent said, and it
      inherits its parent's exit hooks (``atexit`` is copied by the fork).
    - ``workers_replaced``: 0. It counts the workers of this process's own loaders
      replaced; those its parent replaced are not the child's.
    - The pools (``live_pools``, ``pool_files``, ``released_later``): inherited, and
      still its parent's; each file's mappings are made private here (those private
      already stay: a grandchild reads what its parent inherited), so that the child
      only reads the slots it inherited (workers that fill slots map the file again,
      shared). One that cannot exits here, saying why on stderr: an exception raised in
      an at-fork hook is only printed, and the child would go on writing into its
      parent's slots unseen. The slots the parent held at the fork are then copied
      into the child's own memory, which ends the fork's guard (``ForkGuard``); the
      child closes its copies of the parent's guards, of the write ends of forks
      other threads had under way (``guard_writes``), and of those the parent kept of
      its own parent's guard (``kept_guard_writes``).
    - The node budget: the ledgers stay open (the same files, shared); nothing is
      reserved (the parent's pools are not the child's to release); its locks (the
      ledgers', each ledger's claiming lock, the reservation's), which another thread
      of the parent may have held at the fork, are made anew.
    - Loaders' pools: inherited in ``loader_pools`` (each knows its owner's pid); no idle
      pools (those inherited are the parent's: never taken, never closed here), a new
      ``idle_mutex``, no replacements; inherited iterators are marked shut down and forgotten: their
      workers, queues and done event are the parent's, and dropping one in the child
      would run torch's shutdown on them (set the shared done event, send each worker
      its end), ending the parent's epoch; marked, it ends with nothing done (and a
      persistent one reset here is replaced, see torch/fork_watch.py ``_Iterating``). Their
      workers leave torch's SIGCHLD registry (keyed by the iterator's id: an iterator
      of the child's own at the same address could not register its workers).
      ``receivers`` stay: messages name their owner's pid, which is not this one.
    - A worker's boards (``board_readers``): inherited, the same shared mappings;
      ``idle_watch_pid`` and ``iterating`` are keyed by pid, so stale here by design;
      ``making_batch`` is made anew (the parent's idle look may have held it at the fork:
      a worker of a loader iterated in this child would wait for it forever).
    - The fork watch: this child's own forks are not watched; it claims its start token
      (a watched worker), closes its copies of the parent's tokens, freezes what it
      inherited for the collector and turns the collector back on, and exits at once
      where the parent condemned it already (only slow, it must not race the worker
      forked in its place).
    """
    global pid, _started, affinity_at_start, workers_replaced, ledgers_mutex, reserved, reserved_mutex, idle_mutex
    global making_batch
    pid = os.getpid()
    _started = None
    affinity_at_start = frozenset(os.sched_getaffinity(0))
    workers_replaced = 0
    _pools_made_private()
    _copied_guarded()
    for guard in list(fork_guards):
        guard.forget()  # the parent's read ends: its pools are not this child's to reuse
    ledgers_mutex, reserved_mutex, idle_mutex = DeferringLock(), DeferringLock(), DeferringLock()
    making_batch = threading.Lock()
    reserved = 0
    for book in ledgers.values():
        book._claiming = threading.Lock()
    idle_pools.clear()
    replacing.clear()
    handling = signal_handling() if loader_iterators else None
    for iterator in list(loader_iterators):
        setattr(iterator, ITERATOR_SHUTDOWN, True)  # torch's iterator: its __del__ shuts down only what is not
        if handling is not None and getattr(iterator, ITERATOR_WORKER_PIDS_SET, False) is True:
            getattr(handling, REMOVE_WORKER_PIDS)(id(iterator))  # this process's copy of torch's registry
            setattr(iterator, ITERATOR_WORKER_PIDS_SET, False)
    loader_iterators.clear()
    if not _start_claimed():
        os._exit(0)


def _pools_made_private() -> None:
    """The child's views of its parent's pools made private; exit where one cannot be."""
    for file in list(pool_files):
        try:
            file.view_privately()
        except OSError as error:
            message = (
                f"numafast: process {pid}, forked from {os.getppid()}, cannot make its view of the "
                f"node-{file.node} pool private ({error}); it would write into the slots its parent hands "
                f"out, so it exits now with status {FORK_REMAP_FAILED_STATUS}\n"
            )
            try:
                os.write(2, message.encode())
            finally:
                os._exit(FORK_REMAP_FAILED_STATUS)


def _start_claimed() -> bool:
    """The fork watch's part: claim this child's start token (True where none was
    pending, or where the child took it first), and drop the parent's tokens."""
    token: int | None = getattr(forking, "pending", None)
    collecting, forking.collecting = getattr(forking, "collecting", False), False
    forking.pending = forking.watch = forking.begin = None  # this child's own forks are not watched
    started = token is None or claim(token)
    for fd in open_tokens:
        try:
            os.close(fd)
        except OSError:
            pass
    open_tokens.clear()
    if token is not None:
        # The parent's garbage not yet collected (an old iterator in a reference cycle) is
        # the worker's too: collected here, it would run the parent's finalizers in the
        # worker (torch's iterator shuts down workers not its own), and under 3.11 one
        # that imports, run amid an import, kills the worker (gh-91351: KeyError in
        # importlib's _ModuleLock.acquire). Frozen, the collector never looks at what
        # the worker inherited; nor does it write to those pages, so they stay shared.
        gc.freeze()
    if collecting:
        gc.enable()
    return started


def claim(read: int) -> bool:
    """Take a start token's byte: True for the first to read it (in the child: it
    starts; in the parent: it condemns the child)."""
    try:
        return os.read(read, 1) == STARTED  # b"" (EOF) once taken
    except BlockingIOError:
        return False
    except OSError:
        return True  # never a reason to stop a worker


def raised_by_signal_handler(error: BaseException) -> bool:
    """Whether a Python signal handler raised ``error``. CPython runs handlers in the main
    thread between any two bytecodes, so inside whatever it was doing: PyTorch's SIGCHLD
    handler raises "DataLoader worker (pid N) is killed by signal" from within a
    take-over or an at-fork step."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handlers = {getattr(getattr(handler, "__func__", handler), "__code__", None)
                for handler in map(signal.getsignal, signal.valid_signals())}  # fmt: skip
    return any(frame.f_code in handlers for frame, _line in traceback.walk_tb(error.__traceback__))


FORK_STEP_TRIES = 3


def at_fork_step(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` as an at-fork hook, run to its end where a signal handler raises inside
    it (Ctrl-C's; PyTorch's SIGCHLD handler, for a worker that died): a signal that came
    during the fork is handled at the first instruction of the first hook, and would
    leave the step half done (its guard's write end open for good, the collector off).
    So the step, written to be run again from the start, is run again, up to
    FORK_STEP_TRIES times. The handler's exception is then raised, which CPython only
    prints ("Exception ignored in"), as it does for any hook's: raising it again in the
    caller is not possible from here, as a handler made to run again would run in the
    next hook (logging's releases its lock there)."""

    def run() -> None:
        caught: BaseException | None = None
        for _ in range(FORK_STEP_TRIES):
            try:
                step()
                break
            except BaseException as error:
                if not raised_by_signal_handler(error):
                    raise
                caught = caught or error
        if caught is not None:
            raise caught

    return functools.wraps(step)(run)


os.register_at_fork(after_in_child=_forked)
os.register_at_fork(before=at_fork_step(_guard_held_slots), after_in_parent=at_fork_step(_guarded_in_parent))


# What opening /proc/PID/stat fails with once the process is gone (ESRCH: reaped while read).
_GONE = (errno.ENOENT, errno.ESRCH)


def start_time(process: int | str = "self") -> int | None:
    """When ``process`` started, in clock ticks after boot (/proc/PID/stat's 22nd field,
    ``starttime``); None when it is gone, or dead and not yet reaped (a zombie, whose
    pid is still taken but which runs no more). Any other failure to read it (EMFILE
    under a low ``ulimit -n``, ENFILE, EACCES) says nothing of the process and raises
    the OSError: taken for "gone", it would free a live worker's slot for a second batch. Two processes that had the same pid
    one after the other do not have the same start time: it counts clock ticks (10 ms
    at USER_HZ 100), and the kernel hands out pids in a cycle, so a pid comes back
    only after every other free one up to pid_max (32768 or 4194304) was handed out,
    far more forks than one tick holds; unless a tool asks for that pid
    (/proc/sys/kernel/ns_last_pid, clone3's set_tid: checkpoint/restore)."""
    try:
        with open(f"/proc/{process}/stat", "rb") as stat:
            line = stat.read()
    except OSError as error:
        if error.errno in _GONE:
            return None
        raise
    # The command name, in parentheses, may hold spaces and parentheses: the fields
    # start after the last ')'. The third field, the state, comes first there.
    fields = line.rpartition(b")")[2].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])


CHILD_EXIT_WAIT_S = 5.0
"""How long :func:`wait_child_exited` waits for a dead child's last thread."""


def wait_child_exited(pid: int) -> None:
    """Wait, up to :data:`CHILD_EXIT_WAIT_S`, until this process's child ``pid``, gone as
    :func:`start_time` says (its main thread a zombie), has exited as ``waitpid`` sees it:
    a killed process's other threads end after its main one, and freeing a large heap
    takes a while. It is not reaped: that stays its parent's code's to do (torch's
    ``is_alive()``). At once for a process that is not a child, or is reaped already."""
    deadline = time.monotonic() + CHILD_EXIT_WAIT_S
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def started() -> int:
    """This process's start time (see :func:`start_time`), read once per process."""
    global _started
    if _started is None:
        here = start_time("self")
        if here is None:
            raise OSError(f"cannot read /proc/self/stat in process {os.getpid()}: is /proc mounted?")
        _started = here
    return _started
