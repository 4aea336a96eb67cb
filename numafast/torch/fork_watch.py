"""A DataLoader worker that never starts is replaced, or named in a clear error, not
waited for forever.

Why a forked worker can be stuck before it runs a line of its own: ``os.fork()`` copies
the interpreter's locks as they are, held ones included, and only the forking thread
lives on in the child. CPython 3.8 to 3.11.7 (and 3.12.0) walk the child's thread
states under the interpreter's *head lock* before they re-create it (gh-112275), and
another thread takes that lock without the GIL whenever it gets a thread state: a
native thread that calls into Python (torch and NCCL callbacks, tokenizers, telemetry,
a ctypes callback) does so on every call. If it held the lock at the fork, the child
waits inside ``os.fork()`` forever, and the DataLoader for its batches. (A C library's
``pthread_atfork`` handler waiting on a lock held at the fork ends the same way, on any
Python.) An import lock held at the fork stops a worker later, past its start: torch's
worker loop seeds ``numpy.random``, whose first import in a worker forked while another
thread was importing it waits forever. So it is imported here, before any worker forks
(which spares each worker that import too).

So each worker claims a start token (a pipe holding one byte) in an after-fork hook,
which runs before multiprocessing's bootstrap, so before the worker reads any index.
One that has not by ``START_DEADLINE_S`` (or ended before it could) is condemned (the
parent takes its token), forked again with the same target and arguments (worker id,
seeds, index queue) in its place among torch's workers, and killed: the epoch's batches
are unchanged. Where that cannot be done, the consumer meets a
:class:`WorkerStartError` at that worker's first batch. Either way a warning says so,
once. The watch's thread only condemns: the replacement is forked, and torch's record
of the workers changed, in the thread that iterates, where torch forked the first (see
:class:`_Iterating`). Watched are the workers :func:`watch_starts`
forks and those of a torch iterator found forking with numafast's collate function (a
loader NumaLoader iterates through, Accelerate's ``base_dataloader``). Nothing is done
per batch.

A worker that dies holding the lock of torch's done event does not hang the consumer
either (:class:`_DoneEvent`), and an exception that leaves the iterator does not keep
it, nor its workers (:class:`_Iterating`).
"""

from __future__ import annotations

import gc
import os
import select
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import numpy.random  # noqa: F401 - before any worker forks: see above

from numafast import _process
from numafast.errors import WorkerStartError
from numafast.private import (
    EVENT_CONDITION, EVENT_FLAG, ITERATOR_COLLATE, ITERATOR_DONE_EVENT, ITERATOR_RECEIVED, ITERATOR_RESULT_QUEUE,
    ITERATOR_SHUTDOWN, ITERATOR_TASK_INFO, ITERATOR_WORKER_PIDS_SET, ITERATOR_WORKERS, LOADER_GET_ITERATOR,
    LOADER_ITERATOR, NOT_A_CHILD_ERROR,
    POPEN_PROCESS_LOCAL, PROCESS_RUN_ATTRIBUTES, REMOVE_WORKER_PIDS, SET_WORKER_PIDS, WORKER_EXITED_MESSAGE,
    exception_wrapper, getframe, multi_worker_iterator, signal_handling,
)  # fmt: skip
from numafast.torch.worker_collate import SlotCollate

__all__ = ["MAX_RESTARTS", "START_DEADLINE_S", "WorkerStartError", "replaced_workers", "watch_starts"]

START_DEADLINE_S = 5.0
"""How long after its fork (and after its last sibling started) a worker has to run
its first line: a worker starts in milliseconds; one stuck in the fork never does."""
MAX_RESTARTS = 3
"""Workers forked in the place of one stuck before the loader gives up with an error."""
POLL_S = 0.02
"""How often the watch looks at the tokens (the first looks come sooner)."""
_SHUTDOWN_WAIT_S = 30.0  # torch's shutdown joins each worker for up to 5 s before it lets them go

Iterated = TypeVar("Iterated")
Held = TypeVar("Held")


_Run = dict[str, Any]
"""What a forked Process runs, as its constructor's arguments: target, args, kwargs, name, daemon."""


@dataclass
class _Token:
    """A start token: the read end of a pipe holding one byte (who reads it: :func:`numafast._process.claim`)."""

    read: int
    forked_at: float
    run: _Run | None
    """What the process forked runs (multiprocessing drops it from the Process once
    started); moved to ``_runs`` when the watch attaches: None for a replacement's fork."""


@dataclass
class _Worker:
    """One of torch's workers: its index in ``_workers``, its pid, its token (None once it
    started or was condemned)."""

    index: int
    pid: int
    token: _Token | None
    restarts: int = 0


_local = _process.forking  # per thread: the watch arming its forks, the fork's token (see numafast/_process.py)
_open_tokens = _process.open_tokens  # every token fd of this process (a child closes its copies)
_runs: weakref.WeakKeyDictionary[Any, list[_Run | None]] = weakref.WeakKeyDictionary()
"""Per iterator, what each of its workers runs, to fork it again in its place. Kept with
the iterator, not the watch: the arguments hold the dataset and the collate function
(a NumaLoader's pools), which must go the moment the iterator does."""


def replaced_workers() -> int:
    """Workers of this process's loaders replaced because they never started."""
    return _process.workers_replaced


def watch_starts(
    make: Callable[[], Iterated], fork_scope: Callable[[], AbstractContextManager[Any]] = nullcontext
) -> Iterated:
    """``make()`` (a DataLoader's ``__iter__``), with a start watch on every worker it
    forks; ``fork_scope()`` is entered around the fork of a worker in another's place.
    The watch keeps ``fork_scope`` while a worker is yet to start, so it must not hold
    the loader, whose pools go idle with it."""
    watch = _StartWatch(fork_scope)
    outer, _local.watch = getattr(_local, "watch", None), watch
    try:
        iterator = make()
    except BaseException:
        watch.close()
        raise
    finally:
        _local.watch = outer
    _extend(iterator)
    _bound_done_event(iterator)
    if watch.attach(iterator):
        made = weakref.ref(iterator)
        threading.Thread(target=watch.run, args=(made,), name="numafast worker start", daemon=True).start()
    return iterator


class _StartWatch:
    """The start tokens of the workers one iterator forked, and the thread that waits for
    them to be claimed."""

    def __init__(self, fork_scope: Callable[[], AbstractContextManager[Any]]) -> None:
        self.fork_scope = fork_scope
        self.tokens: list[_Token] = []
        self.workers: list[_Worker] = []
        self.last_start = 0.0  # when a worker last started (or stopped being waited for)
        self.condemned: list[tuple[_Worker, str, str]] = []  # (worker, what, cause): for the iterating thread
        self.doomed: list[tuple[Any, int]] = []  # (process, task): see _fail
        self.lock = threading.Lock()  # between the watch's thread and the iterating one

    def token(self) -> _Token:
        """A new token, for the fork about to happen (the before-fork hook)."""
        read, write = os.pipe()
        _open_tokens.add(read)
        os.set_blocking(read, False)  # shared with the child: a claim never waits
        os.write(write, _process.STARTED)
        os.close(write)  # nothing more is written: once the byte is taken, a read gets EOF
        token = _Token(read, time.monotonic(), None if self.workers else _process_forking())
        self.tokens.append(token)
        return token

    def attach(self, iterator: Any) -> bool:
        """Pair the tokens with ``iterator``'s workers (torch's ``_workers``, one fork each, in
        order); False, the tokens closed, where there is nothing to watch."""
        if not self.tokens:
            return False  # no worker forked (none asked for, or spawned, or served by a forkserver)
        processes = getattr(iterator, ITERATOR_WORKERS, None) if isinstance(iterator, _Iterating) else None
        if not isinstance(processes, list) or len(processes) != len(self.tokens):
            self.close()  # not torch's iterator as known: its workers cannot be told apart, nor replaced
            return False
        _runs[iterator] = [token.run for token in self.tokens]
        _watches[iterator] = self
        for index, (process, token) in enumerate(zip(processes, self.tokens)):
            token.run = None
            self.workers.append(_Worker(index, getattr(process, "pid", None) or 0, token))
        return True

    def close(self) -> None:
        for token in self.tokens:
            _close(token)
        self.tokens.clear()

    def run(self, made: weakref.ref[Any]) -> None:
        """The watch thread, until no worker is left to wait for (nor to replace)."""
        try:
            looks = 0
            while self._look(made):
                looks += 1
                time.sleep(min(POLL_S, 0.001 * 2 ** min(looks, 8)))
        finally:
            self.close()

    def _look(self, made: weakref.ref[Any]) -> bool:
        """One look at the workers; False when there is nothing left to watch. The iterator
        is held only where it is needed, not across the poll and close of the tokens (each
        lets go of the GIL): held there as the consumer drops it, it would outlive that
        moment, its pools not yet idle for the next loader, and end in this thread."""
        if not self.workers:  # found forking (_found_watch): it attaches once torch started all the workers
            iterator = made()
            if iterator is None or getattr(iterator, ITERATOR_SHUTDOWN, False):
                return False
            if getattr(iterator, ITERATOR_WORKER_PIDS_SET, False) is not True:
                return bool(self.tokens) and time.monotonic() < self.tokens[0].forked_at + 60
            _bound_done_event(iterator)
            return self.attach(iterator)
        with self.lock:
            return self._look_at_workers(made)

    def _look_at_workers(self, made: weakref.ref[Any]) -> bool:
        """:meth:`_look` at the attached workers' tokens: condemn the late, and wake the
        iterating thread to replace them."""
        now = time.monotonic()
        unclaimed = _unclaimed(self.tokens)  # the pending workers' tokens are this watch's open ones
        for worker in self.workers:
            if worker.token is not None and worker.token.read not in unclaimed:
                self._release(worker, worker.token)
                self.last_start = now
        started = sum(worker.token is None for worker in self.workers)
        late = [(worker, worker.token) for worker in self.workers if worker.token is not None and (
                now >= max(worker.token.forked_at, self.last_start) + START_DEADLINE_S
                or _ended(worker.pid))]  # fmt: skip
        # Gone, or torch ended its workers: one that wakes up yet exits at once.
        if getattr(made(), ITERATOR_SHUTDOWN, True):
            for worker in self.workers:
                if worker.token is not None:
                    _process.claim(worker.token.read)
            for process, _task in self.doomed:
                _end_after_shutdown(made, process)
            return False
        for worker, token in late:
            self._late(worker, token, started)
        if late and self.condemned:
            _wake(made)
        return any(worker.token is not None for worker in self.workers) or bool(self.condemned or self.doomed)

    def _release(self, worker: _Worker, token: _Token) -> None:
        """No more waiting for ``worker`` to claim ``token``: it is closed."""
        _close(token)
        self.tokens.remove(token)
        worker.token = None

    def _late(self, worker: _Worker, token: _Token, started: int) -> None:
        """``worker`` missed its deadline, or ended before it started: condemned, for the
        iterating thread to replace it, or to queue its error (:meth:`serve`)."""
        waited = time.monotonic() - token.forked_at
        condemned = _process.claim(token.read)
        self._release(worker, token)
        if not condemned:  # it started after all, just now
            self.last_start = time.monotonic()
            return
        ended = _ended(worker.pid)
        if ended is None:
            what = (f"DataLoader worker {worker.index} (pid {worker.pid}) had not started {waited:.1f} s after it was "
                    f"forked ({started} of its {len(self.workers)} workers had): {_stuck_in(worker.pid)}")
            cause = f" {_cause()}; {_FIX}"
        else:
            what = (f"DataLoader worker {worker.index} (pid {worker.pid}) {ended} before it started, {waited:.1f} s "
                    "after it was forked: before numafast's first step after the fork, which runs before any code "
                    "of the worker, so a handler of the fork that ran before it (os.register_at_fork) or a signal "
                    "ended it")
            cause = ""
        self.condemned.append((worker, what, cause))

    def serve(self, iterator: Any) -> None:
        """In the thread that iterates, as it waits for a batch: fork the condemned
        workers' replacements (or queue their errors), and kill the stuck workers whose
        error the consumer met. There, where torch forked the first workers, the thread
        that forks is not inside CUDA, OpenMP or an allocator (a child forked meanwhile
        from another thread inherits their locks held, and may block past its start,
        unwatched), and torch's record of the workers changes in the thread that ends
        them (from another, it raced torch's shutdown)."""
        if not (self.condemned or self.doomed):
            return
        with self.lock:
            condemned, self.condemned = self.condemned, []
            for worker, what, cause in condemned:
                self._in_place(iterator, worker, what, cause)
            self._settle_doomed(iterator)

    def _in_place(self, iterator: Any, worker: _Worker, what: str, cause: str) -> None:
        """Replace the condemned ``worker``, else queue its error; warn, once."""
        why_not = self._replace(iterator, worker)
        if why_not is not None:
            self._fail(iterator, worker, f"{what}. numafast could not replace it: {why_not}.{cause}")
            return
        if _process.first_time("worker replaced"):
            replaced = (f"numafast: {what}. It was replaced by pid {worker.pid}, forked in its place before it read "
                        f"any index, so the epoch's batches are unchanged.{cause}")
            warnings.warn(replaced, RuntimeWarning, stacklevel=1)

    def _replace(self, iterator: Any, worker: _Worker) -> str | None:
        """Fork ``worker`` again in its place among the iterator's workers and kill the
        stuck one; None when done, else why it cannot be."""
        old = _worker_process(iterator, worker.index)
        if old is None or getattr(old, "pid", None) != worker.pid:
            return f"its DataLoader iterator's _workers are not the processes it forked ({_UNKNOWN_TORCH})"
        run = _runs[iterator][worker.index]
        if run is None:
            return "its fork did not come from a multiprocessing Process's start() (a Python numafast does not know)"
        if _worker_pids(iterator) is None:
            return f"torch's signal handling has no _set_worker_pids and _remove_worker_pids ({_UNKNOWN_TORCH})"
        if worker.restarts >= MAX_RESTARTS:
            return f"the {MAX_RESTARTS} workers forked in its place did not start either"
        replacement = type(old)(**run)
        forks = len(self.tokens)
        outer, _local.watch = getattr(_local, "watch", None), self  # its token is this watch's
        try:
            with self.fork_scope():
                replacement.start()
        except Exception as error:  # noqa: BLE001 - said in the error the consumer gets
            return f"forking a worker in its place failed ({error!r})"
        finally:
            _local.watch = outer
        getattr(iterator, ITERATOR_WORKERS)[worker.index] = replacement
        _end(iterator, old)
        _process.workers_replaced += 1
        worker.pid = replacement.pid
        worker.restarts += 1
        if len(self.tokens) == forks + 1:
            worker.token = self.tokens[-1]
            worker.token.forked_at = time.monotonic()  # its deadline counts from now, whoever started since
        else:
            self.last_start = time.monotonic()  # forked without a token: nothing to wait for
        return None

    def _fail(self, iterator: Any, worker: _Worker, message: str) -> None:
        """Queue ``message`` as a :class:`WorkerStartError` for the stuck worker's first
        batch (as a worker's own error is), to kill the worker once the consumer met it;
        where no batch can carry it, kill it now: torch's own check of its workers then
        ends the iteration, as when a worker dies."""
        warnings.warn(message, RuntimeWarning, stacklevel=1)  # whatever happens to the exception
        process = _worker_process(iterator, worker.index)
        self.last_start = time.monotonic()  # as a start does: the siblings' deadlines count from now
        if process is None:
            return
        task = _queue_error(iterator, worker.index, message)
        if task is not None:
            self.doomed.append((process, task))
        else:
            _kill(process)

    def _settle_doomed(self, iterator: Any) -> None:
        """Kill the stuck workers whose error the consumer has met (see :meth:`_fail`)."""
        received = getattr(iterator, ITERATOR_RECEIVED, None)
        for process, task in list(self.doomed):
            if not isinstance(received, int) or received > task:
                _end(iterator, process)
                self.doomed.remove((process, task))


# ------------------------------------------------------------ the fork hooks


# Each is run again from the start where a signal handler raised inside it (_process.at_fork_step).


def _before_fork() -> None:
    watch = getattr(_local, "watch", None) or _found_watch()
    if watch is None:
        _local.pending = None
    elif getattr(_local, "pending", None) is None:  # one token per fork
        _local.pending = watch.token().read
    # A worker's collector stays off until its first step freezes what it inherited (see
    # numafast._process._start_claimed): the after-fork handlers registered before numafast's run first.
    if watch is not None and not getattr(_local, "collecting", False) and gc.isenabled():
        _local.collecting = True
        gc.disable()


def _after_fork_in_parent() -> None:
    if getattr(_local, "collecting", False):
        gc.enable()  # first, and again where run again: enabling twice changes nothing
        _local.collecting = False
    _local.pending = None
    begin, _local.begin = getattr(_local, "begin", None), None
    if begin is not None:  # the first fork of an iterator found forking: its watch thread
        watch, made = begin
        threading.Thread(target=watch.run, args=(made,), name="numafast worker start", daemon=True).start()


_found: weakref.WeakKeyDictionary[Any, _StartWatch] = weakref.WeakKeyDictionary()
"""The watches of iterators found forking (:func:`_found_watch`), a pin_memory_hook's
loader's among them."""


def _found_watch() -> _StartWatch | None:
    """The watch of the torch iterator forking now, when numafast's collate is its
    workers' (found in the frames of its ``__init__``); None for any other fork."""
    try:
        kind = multi_worker_iterator()
        if kind is None:
            return None
        iterator = _held_above(getframe(2), 16, kind, "self", function="__init__")
        if iterator is None or not isinstance(getattr(iterator, ITERATOR_COLLATE, None), SlotCollate):
            return None
        watch = _found.get(iterator)
        if watch is None:
            _extend(iterator)
            # Its workers are this process's: a forked child marks it shut down (see
            # numafast._process._forked), so that dropping it there (a loader iterated
            # through, a framework's copy) does not end this process's epoch.
            _process.loader_iterators.add(iterator)
            watch = _found[iterator] = _StartWatch(nullcontext)
            _local.begin = (watch, weakref.ref(iterator))
        return watch
    except Exception:  # noqa: BLE001 - never a reason for a fork to fail
        return None


# The child's step: numafast/_process.py.
os.register_at_fork(
    before=_process.at_fork_step(_before_fork), after_in_parent=_process.at_fork_step(_after_fork_in_parent)
)


def _process_forking() -> _Run | None:
    """What the multiprocessing Process being started in this thread runs (read from the
    frames of its ``start()``, the only place that still has them), or None."""
    from multiprocessing.process import BaseProcess

    frame = getframe(2)  # the before-fork hook; then the caller of os.fork(), up to start()
    process = _held_above(frame, 8, BaseProcess, POPEN_PROCESS_LOCAL, "self")
    if process is None:
        return None
    target, args, kwargs = (getattr(process, part, None) for part in PROCESS_RUN_ATTRIBUTES)
    if callable(target) and isinstance(args, tuple) and isinstance(kwargs, dict):
        return dict(target=target, args=args, kwargs=kwargs, name=process.name, daemon=bool(process.daemon))
    return None


def _held_above(frame: FrameType | None, depth: int, kind: type[Held], *names: str, function: str = "") -> Held | None:
    """The first ``kind`` in a local of one of ``names``, in ``frame`` or its callers (``depth``
    frames at most; those of a function so named, where ``function`` is given), or None."""
    for _ in range(depth):
        if frame is None:
            return None
        if not function or frame.f_code.co_name == function:
            for name in names:
                held = frame.f_locals.get(name)
                if isinstance(held, kind):
                    return held
        frame = frame.f_back
    return None


def _unclaimed(tokens: list[_Token]) -> set[int]:
    """The read ends of ``tokens`` whose byte is still there (their worker has not started)."""
    poller = select.poll()
    for token in tokens:
        poller.register(token.read, select.POLLIN)
    return {fd for fd, events in poller.poll(0) if events & select.POLLIN}


def _ended(pid: int) -> str | None:
    """How this process's child ``pid`` ended, or None while it runs. Only looked at
    (``WNOWAIT``): multiprocessing reaps it, and torch reads its status."""
    try:
        status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "ended" if pid > 0 else None  # reaped already (multiprocessing reaps at each start)
    except OSError:
        return None
    if status is None or status.si_pid == 0:
        return None
    return _how_it_ended(status.si_status if status.si_code == os.CLD_EXITED else -status.si_status)


def _close(token: _Token) -> None:
    if token.read in _open_tokens:
        _open_tokens.discard(token.read)
        os.close(token.read)


# ------------------------------------------------------------ torch's iterator


def _worker_pids(iterator: Any) -> Callable[[tuple[int, ...]], None] | None:
    """A function that makes ``pids`` the iterator's workers for torch's SIGCHLD check
    (so that a killed worker is not taken for one that died), or None where torch's
    signal handling is not as known."""
    module = signal_handling()
    remove = getattr(module, REMOVE_WORKER_PIDS, None)
    put = getattr(module, SET_WORKER_PIDS, None)
    registered = getattr(iterator, ITERATOR_WORKER_PIDS_SET, None)
    if not callable(remove) or not callable(put) or not isinstance(registered, bool):
        return None

    def set_pids(pids: tuple[int, ...]) -> None:
        # Only in the thread that iterates, where torch's shutdown runs too: never between the two calls.
        # Else torch let them go (or is about to).
        if getattr(iterator, ITERATOR_WORKER_PIDS_SET) and not getattr(iterator, ITERATOR_SHUTDOWN):
            try:
                remove(id(iterator))
            finally:  # also where a signal handler raised in between (torch's SIGCHLD check)
                put(id(iterator), pids)

    return set_pids


def _worker_process(iterator: Any, index: int) -> Any:
    """Worker ``index`` of torch's ``_workers``, or None."""
    processes = getattr(iterator, ITERATOR_WORKERS, None)
    return processes[index] if isinstance(processes, list) and index < len(processes) else None


def _queue_error(iterator: Any, index: int, message: str) -> int | None:
    """Put ``message`` on the iterator's result queue as worker ``index``'s error for the
    first batch the iterator waits for from it (torch's ``_task_info``): that batch, or
    None where there is none or it cannot be done."""
    try:
        waiting = [task for task, info in list(getattr(iterator, ITERATOR_TASK_INFO).items()) if info == (index,)]
        task: int = min(waiting)
        wrap = exception_wrapper()
        error = wrap((WorkerStartError, WorkerStartError(message), None), where=f"in DataLoader worker process {index}")
        getattr(iterator, ITERATOR_RESULT_QUEUE).put((task, error))
    except Exception:  # noqa: BLE001 - none waiting, or not torch's iterator as known: then the worker is killed
        return None
    return task


def _end(iterator: Any, process: Any) -> None:
    """Kill ``process``, one of ``iterator``'s workers or one just taken out of them,
    without torch taking it for a worker that died: torch's SIGCHLD handler raises "killed
    by signal" in the consumer for any registered worker killed, even inside the joins of
    its own shutdown. So the process leaves the registered workers first; once the
    iterator is shutting down (torch unregisters them all at its end), the kill waits for
    that instead (:func:`_end_after_shutdown`)."""
    if getattr(iterator, ITERATOR_SHUTDOWN, False):
        _end_after_shutdown(weakref.ref(iterator), process)
        return
    if (pids := _worker_pids(iterator)) is not None:
        pids(tuple(worker.pid for worker in getattr(iterator, ITERATOR_WORKERS, []) if worker is not process))
    _kill(process)


def _end_after_shutdown(made: weakref.ref[Any], process: Any) -> None:
    """:func:`_end` once the iterator ``made`` names shuts down: the kill waits until torch
    let its workers go, up to ``_SHUTDOWN_WAIT_S``. The iterator is looked at, never held
    across a wait, so one the consumer drops meanwhile goes in the consumer's thread: in
    the watch's, a daemon, torch's shutdown and the freeing of its batches could still
    run as the interpreter exits, and a tensor over a slot freed then aborts the process
    (its deleter takes the GIL, and a daemon thread taking it then exits by a forced
    unwind: "terminate called without an active exception")."""
    deadline = time.monotonic() + _SHUTDOWN_WAIT_S
    while getattr(made(), ITERATOR_WORKER_PIDS_SET, False) is True and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _kill(process)


def _kill(process: Any) -> None:
    """SIGKILL: a process stuck in fork may have inherited a handler that only sets a flag
    for SIGTERM. Then reaped (waited for up to 5 s, in the watch thread: one left a
    zombie is reaped by multiprocessing at its next start of a process)."""
    try:
        process.kill()
        process.join(5.0)
    except (OSError, ValueError, NOT_A_CHILD_ERROR, AttributeError):
        pass


# ------------------------------------------------------------ torch's iterator, in the thread that iterates


_WAKE = -1  # the task number of the message that wakes the iterating thread (torch's are >= 0)
_watches: weakref.WeakKeyDictionary[Any, _StartWatch] = weakref.WeakKeyDictionary()  # per iterator


class _Iterating:
    """torch's multi-worker iterator, with numafast's part in the thread that iterates.

    Its wait for a batch also does what the start watch asks of that thread
    (:meth:`_StartWatch.serve`), woken for it by a ``_WAKE`` message, which is no batch.

    And an exception leaving it does not keep it alive. torch raises a worker's error
    again in the consumer from a local variable (``ExceptionWrapper.reraise``): the
    exception's traceback holds that frame, which holds the exception, a reference cycle
    through every frame below the consumer's, each holding the iterator. Only the
    collector freed it: an epoch ended by an exception left its workers running, their
    slots leased (read as batches the consumer keeps), and registered for torch's SIGCHLD
    check, which reported one that died later as the next epoch's. Here, as an exception
    leaves ``__next__``, the frames below it (all finished) are cleared and ``__next__``'s
    own lets the iterator go: the exception, kept or not, holds nothing of the iterator,
    which goes with the consumer's last reference, as at a ``break``. The iterator itself
    is unchanged: the consumer may catch the error and call ``next()`` again (PyTorch's
    own tests do).

    A batch that cannot be read because its worker is dying (one sent the copying way,
    through the worker's descriptor server, whose socket closes before the worker can be
    reaped) ends the epoch with torch's error for a dead worker, as torch's own look
    says a moment later, not with the socket's ``ConnectionResetError``: see
    :func:`_raise_if_a_worker_died`."""

    def __next__(self) -> Any:
        try:
            return super().__next__()  # type: ignore[misc]
        except BaseException as error:
            traceback.clear_frames(error.__traceback__.tb_next if error.__traceback__ is not None else None)
            del self
            raise

    def _try_get_data(self, timeout: float | None = None) -> tuple[bool, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            watch = _watches.get(self)
            if watch is not None:
                watch.serve(self)
            left = () if deadline is None else (max(deadline - time.monotonic(), 0.0),)  # torch's default, or the rest
            try:
                got, data = super()._try_get_data(*left)  # type: ignore[misc]
            except (OSError, EOFError) as error:  # torch saw every worker alive: it raises the error as it came
                _raise_if_a_worker_died(self, error)
                raise
            if not (got and isinstance(data, tuple) and len(data) == 2 and data[0] == _WAKE):
                return got, data

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        # A persistent iterator inherited through fork (a loader iterated through, a
        # framework's copy, whose loader keeps it): its workers, queues and done event are
        # the parent's. Reset here, it would send them the new epoch and read the parent's
        # batches off their shared queue. The loader gets an iterator of this process's
        # own instead (DataLoader.__iter__ returns the one it holds after the reset); the
        # inherited one, marked shut down at the fork, goes with nothing done.
        if not first_iter and _made_in.get(self, _process.pid) != _process.pid:
            setattr(loader, LOADER_ITERATOR, getattr(loader, LOADER_GET_ITERATOR)())
            return
        super()._reset(loader, first_iter)  # type: ignore[misc]


_DYING_S = 2.0
"""How long a worker is given to be seen dead once its batch could not be read (a dying
process's sockets close before it can be reaped: milliseconds)."""


def _raise_if_a_worker_died(iterator: Any, error: BaseException) -> None:
    """torch's error for a dead worker (WORKER_EXITED_MESSAGE), from ``error``, where one of
    ``iterator``'s workers is dead or dies within _DYING_S; else nothing (the caller
    raises ``error`` as it came)."""
    processes = getattr(iterator, ITERATOR_WORKERS, None)
    if not isinstance(processes, list):
        return
    deadline = time.monotonic() + _DYING_S
    while True:
        # Ended abnormally: a worker that torch told to end (its IterableDataset's share
        # exhausted) exits with 0, and is no reason to hide the error as it came.
        dead = [str(process.pid) for process in processes if process.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(WORKER_EXITED_MESSAGE.format(pids_str=", ".join(dead))) from error
        if time.monotonic() >= deadline:
            return
        time.sleep(POLL_S)


def _wake(made: weakref.ref[Any]) -> None:
    """Wake the thread that iterates the iterator ``made`` names where it waits for a batch
    (see :class:`_Iterating`); its queue held, not the iterator (see :func:`_end_after_shutdown`)."""
    try:
        getattr(made(), ITERATOR_RESULT_QUEUE).put((_WAKE, None))
    except Exception:  # noqa: BLE001 - gone, or closed: it waits no more
        pass


_extended: dict[type, type] = {}  # per class of torch's iterator, its subclass with _Iterating
_made_in: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # per iterator, the pid it was made in


def _extend(iterator: Any) -> None:
    """Make ``iterator``, torch's multi-worker iterator (any other is left as it is), an
    :class:`_Iterating` one."""
    base = multi_worker_iterator()
    kind = type(iterator)
    if base is None or not isinstance(iterator, base) or issubclass(kind, _Iterating):
        return
    if kind not in _extended:
        _extended[kind] = type(kind.__name__, (_Iterating, kind), {"__module__": __name__})
    try:
        iterator.__class__ = _extended[kind]
    except TypeError:  # a subclass with a layout of its own (__slots__): left as it is, unwatched
        return
    _made_in[iterator] = _process.pid


# ------------------------------------------------------------ torch's done event

_DONE_LOCK_WAIT_S = 2.0  # a living holder keeps the lock for microseconds: past this, is one dead?
_DONE_LOCK_LIVE_WAIT_S = 60.0  # held this long with every worker alive: the holder is stopped, not slow
_DONE_LOCK_POLL_S = 0.01  # the longest pause between two tries (the first come sooner)


class _DoneEvent:
    """torch's ``_workers_done_event`` as its iterator sets and reads it, with an end.

    torch tells its workers to exit through a multiprocessing Event, which each worker
    reads for every index it receives. ``Event.set()`` and ``is_set()`` take the event's
    lock, a semaphore the processes share: a worker killed while it holds it (by the OOM
    killer or a SIGKILL, in the microseconds of its check) leaves it taken for good, and
    the consumer waits forever where torch reads or sets the event: where it finds a
    worker dead, and in the iterator's shutdown (torch's SIGCHLD handler ends such a wait
    only for a worker that dies during it). Here the lock is tried, never waited for
    unbounded, and the event read or set under that very hold. Tried until a deadline on
    the monotonic clock: a timed wait on the semaphore (``sem_timedwait``) counts on the
    wall clock, which a clock step moves. Taken for ``_DONE_LOCK_WAIT_S`` while a worker
    died abnormally, or for ``_DONE_LOCK_LIVE_WAIT_S`` with all alive (one stopped holding
    it), the lock is lost: no worker can read the event again, nor end its loop, so the
    living workers are ended, out of torch's registered workers first (so that it does
    not take them for workers that died), and the event reads as the iterator last set
    it. A holder alive and only slow (descheduled, swapped out) is waited for."""

    def __init__(self, event: Any, iterator: Any) -> None:
        self.event = event
        self.condition = getattr(event, EVENT_CONDITION)  # its lock: what set() and is_set() hold
        self.flag = getattr(event, EVENT_FLAG)  # a semaphore, 1 once set
        self.iterator = weakref.ref(iterator)  # the iterator holds this: no cycle
        self.processes: list[Any] = getattr(iterator, ITERATOR_WORKERS)  # torch's very list (a replacement goes in)
        self.done = False
        self.lock_lost = False

    def set(self) -> None:
        self.done = True
        if self._take_lock():
            try:  # Event.set() under the hold taken here
                self.flag.acquire(False)
                self.flag.release()
                self.condition.notify_all()  # none waits: torch's workers only read the event
            finally:
                self.condition.release()

    def is_set(self) -> bool:
        if not self._take_lock():
            return self.done
        try:  # Event.is_set() under the hold taken here
            if self.flag.acquire(False):
                self.flag.release()
                return True
            return False
        finally:
            self.condition.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.event, name)

    def _take_lock(self) -> bool:
        """The event's lock, taken by this thread (True), or lost for good (False)."""
        if self.lock_lost:
            return False
        lock = self.condition
        began = time.monotonic()
        pause = 0.0005
        while not lock.acquire(False):
            waited = time.monotonic() - began
            if waited >= _DONE_LOCK_LIVE_WAIT_S or (waited >= _DONE_LOCK_WAIT_S and (dead := self._died())):
                self._lose(waited, dead if waited < _DONE_LOCK_LIVE_WAIT_S else [])
                return False
            time.sleep(pause)
            pause = min(2 * pause, _DONE_LOCK_POLL_S)
        return True

    def _died(self) -> list[str]:
        """The workers that ended abnormally (the holder is among them, if it is dead)."""
        died = []
        for process in list(self.processes):
            code = process.exitcode  # reaped here where it has exited, as torch's own look does
            if code is not None and code != 0:
                died.append(f"pid {process.pid} {_how_it_ended(code)}")
        return died

    def _lose(self, waited: float, dead: list[str]) -> None:
        self.lock_lost = True
        alive = [process for process in list(self.processes) if process.is_alive()]
        why = (f"a DataLoader worker died holding it ({', '.join(dead)}: killed, by the OOM killer or a SIGKILL, in "
               "the instant it checked the event)" if dead else
               "every DataLoader worker is alive: the one holding it is stopped (SIGSTOP, a debugger)")  # fmt: skip
        warnings.warn(
            f"numafast: the lock of torch's done event stayed taken for {waited:.0f} s: {why}. No worker can read "
            f"that event again, so the {len(alive)} still alive were ended, where torch would have waited for them "
            "forever",
            RuntimeWarning, stacklevel=4)  # fmt: skip
        iterator = self.iterator()
        if iterator is not None and (pids := _worker_pids(iterator)) is not None:
            pids(())
        for process in alive:
            _kill(process)


def _how_it_ended(code: int) -> str:
    """A process's exit as multiprocessing's ``exitcode`` gives it (negative: the signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _bound_done_event(iterator: Any) -> None:
    """Make ``iterator``'s done event a :class:`_DoneEvent` (a torch iterator with workers)."""
    event = getattr(iterator, ITERATOR_DONE_EVENT, None)
    processes = getattr(iterator, ITERATOR_WORKERS, None)
    known = hasattr(event, EVENT_CONDITION) and hasattr(event, EVENT_FLAG) and isinstance(processes, list)
    if event is not None and not isinstance(event, _DoneEvent) and known:
        setattr(iterator, ITERATOR_DONE_EVENT, _DoneEvent(event, iterator))


# ------------------------------------------------------------ what to tell the user


def _stuck_in(pid: int) -> str:
    """What process ``pid`` is blocked in, as /proc tells (its state, kernel wait channel,
    system call, and kernel stack where readable)."""
    proc = Path(f"/proc/{pid}")
    said: list[str] = []
    try:
        said.append("state " + (proc / "stat").read_text().rsplit(")", 1)[1].split()[0])
        wchan = (proc / "wchan").read_text().strip()
        if wchan and wchan != "0":
            said.append(f"waiting in {wchan}")
        call = (proc / "syscall").read_text().split()[0]
        if call.isdigit():
            said.append(f"system call {_SYSCALLS.get((os.uname().machine, int(call)), call)}")
    except (OSError, IndexError):
        pass
    try:
        frames = [line.split()[-1] for line in (proc / "stack").read_text().splitlines() if line.strip()]
        if frames:
            said.append("kernel stack " + " <- ".join(frames[:3]))
    except (OSError, IndexError):
        pass
    where = ", ".join(said) if said else "/proc does not say what"
    return (f"it is stuck inside os.fork() itself ({where}): it never reached numafast's first step after the fork, "
            "which runs before any code of the worker")


# The system calls a child stuck in a fork may wait in, by machine (aarch64 has no
# poll or pause: ppoll serves both).
_SYSCALLS = {("x86_64", 202): "futex", ("x86_64", 7): "poll", ("x86_64", 271): "ppoll", ("x86_64", 34): "pause",
             ("aarch64", 98): "futex", ("aarch64", 73): "ppoll"}

_UNKNOWN_TORCH = "a torch version numafast does not know"
_FIX = ('fix: Python >= 3.11.8 or >= 3.12.1, or multiprocessing_context="forkserver" '
        "(workers forked from a server process that runs no other threads)")


def _cause() -> str:
    version = sys.version_info
    if version < (3, 11, 8) or version[:3] == (3, 12, 0):
        return (f"This is the fork deadlock of CPython {version.major}.{version.minor}.{version.micro} (gh-112275): a "
                "thread that calls into Python from native code held the interpreter's head lock at the fork")
    return ("This Python has CPython's fork deadlock fixed: a lock held by another thread at the fork (a C library's "
            "pthread_atfork handler?) stopped it")
