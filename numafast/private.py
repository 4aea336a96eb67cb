"""Every private name of torch, CPython and the frameworks that numafast relies on.

Each is named here once, with what numafast uses it for and where;
``tests/test_private_contract.py`` checks each one, by the name it has here, under
every torch CI tests (2.11, 2.13, 2.14.1) and every Python: a release that moves one
fails that test, not a training job. The use sites import these names instead of
spelling them. Importing this module imports no torch: the torch-side accessors import
it when called, and those that read torch's modules only find them loaded already.

Spelled elsewhere, each with its reason: ``numafast/torch/slot.py`` imports
:data:`TORCH_COLLATE_NAMES` from :data:`TORCH_COLLATE_MODULE` directly (typed names a
module-level import keeps typed); ``numafast/cli`` annotates
with :data:`ARGPARSE_TYPES`; ``numafast/cuda.py`` calls :data:`CUDART_CALLS` on the
runtime object ``torch.cuda.cudart()`` returns (or one passed in its place).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

# ------------------------------------------------------------ CPython

getframe: Callable[[int], FrameType] = sys._getframe
"""The caller's frame (the very builtin: the same depth as ``sys._getframe``): the
warnings' ``stacklevel`` past numafast, and torch (:func:`stacklevel_outside`), and the
start watch's walk to the Process being started and to torch's iterator forking
(torch/fork_watch.py ``_process_forking``, ``_found_watch``)."""


NUMAFAST_DIR = os.path.dirname(__file__) + os.sep
"""numafast's own files, which a warning points past (see :func:`stacklevel_outside`)."""


def stacklevel_outside(prefixes: tuple[str, ...] = (NUMAFAST_DIR,), start: int = 1) -> int:
    """The ``stacklevel``, counted from the function ``start`` frames above this call (1:
    the one calling it), of the first caller whose file is under none of ``prefixes``:
    the user's line, which a warning points at; 2 where none is (a library's thread)."""
    frame: FrameType | None = getframe(start)
    level = 1
    while frame is not None:
        if not frame.f_code.co_filename.startswith(prefixes):
            return level
        frame, level = frame.f_back, level + 1
    return 2

POPEN_PROCESS_LOCAL = "process_obj"
"""The local of ``multiprocessing.popen_fork.Popen.__init__`` and ``_launch`` holding the
Process being started, read in the before-fork hook (torch/fork_watch.py
``_process_forking``) to fork a worker stuck in its fork again."""

PROCESS_RUN_ATTRIBUTES = ("_target", "_args", "_kwargs")
"""What a ``multiprocessing`` Process runs (``start()`` drops them once it is launched),
read from the one being started to fork it again (torch/fork_watch.py ``_process_forking``)."""

EVENT_CONDITION = "_cond"
"""A ``multiprocessing.synchronize.Event``'s Condition, whose lock ``set()`` and
``is_set()`` hold: tried with a deadline by torch/fork_watch.py ``_DoneEvent``."""

EVENT_FLAG = "_flag"
"""That Event's Semaphore, 1 once set: read and set under that lock by torch/fork_watch.py
``_DoneEvent``."""

NOT_A_CHILD_ERROR: type[Exception] = AssertionError
"""What a ``multiprocessing`` Process's ``join()``, ``is_alive()`` and ``exitcode`` raise
in a process that is not its parent ("can only join a child process", "can only test a
child process"): torch/fork_watch.py ``_kill`` ends a worker from the watch's thread, where
a forked child may run it too."""

ARGPARSE_TYPES = ("_SubParsersAction", "_ActionsContainer")
"""argparse's classes of ``add_subparsers()``'s result and of an argument group:
annotations of the subcommands' ``add_parser`` functions (numafast/cli)."""

# ------------------------------------------------------------ torch's multi-worker iterator

DATALOADER_MODULE = "torch.utils.data.dataloader"
MULTI_WORKER_ITERATOR = "_MultiProcessingDataLoaderIter"
"""torch's iterator with workers, found in :data:`DATALOADER_MODULE` (never imported
from here): made :class:`~numafast.torch.fork_watch._Iterating` by a ``__class__`` swap
(torch/fork_watch.py ``_extend``), and looked for above a fork (``_found_watch``)."""

ITERATOR_WORKERS = "_workers"
"""The iterator's list of worker Processes, by worker index: the start watch pairs its
tokens with them and puts a replacement in place (torch/fork_watch.py), the done event
looks at their exits (``_DoneEvent``)."""

ITERATOR_WORKER_PIDS_SET = "_worker_pids_set"
"""True while the iterator's workers are registered for torch's SIGCHLD check
(torch/fork_watch.py: the watch attaches then; ``_end`` waits for it to go)."""

ITERATOR_SHUTDOWN = "_shutdown"
"""True once the iterator shut its workers down: the watch stops (torch/fork_watch.py), and
an iterator a forked child inherits is marked so, so that its ``__del__`` does nothing
(numafast/_process.py ``_forked``)."""

ITERATOR_RECEIVED = "_rcvd_idx"
"""The task number of the next batch the iterator yields: a stuck worker's error was met
once it is past (torch/fork_watch.py ``_settle_doomed``)."""

ITERATOR_TASK_INFO = "_task_info"
"""Task number -> ``(worker index,)`` while its batch is awaited: the task a stuck
worker's error is queued as (torch/fork_watch.py ``_queue_error``)."""

ITERATOR_RESULT_QUEUE = "_worker_result_queue"
"""The queue of ``(task, data)`` the workers send: a stuck worker's error, and the wake-up
of the iterating thread, are put on it (torch/fork_watch.py ``_queue_error``, ``_wake``)."""

ITERATOR_DONE_EVENT = "_workers_done_event"
"""The multiprocessing Event that tells the workers to exit: replaced by
torch/fork_watch.py ``_DoneEvent``, which never waits unbounded for its lock."""

ITERATOR_COLLATE = "_collate_fn"
"""The collate function the iterator's workers run: numafast's marks a torch iterator
found forking as a NumaLoader's (torch/fork_watch.py ``_found_watch``)."""

ITERATOR_TRY_GET_DATA = "_try_get_data"
"""``_try_get_data(self, timeout)`` -> ``(got, data)``, the iterator's one wait for a
batch, which raises "DataLoader worker (pid(s) N) exited unexpectedly" for a dead worker
(:data:`WORKER_EXITED_MESSAGE`): overridden by torch/fork_watch.py ``_Iterating`` to serve
the start watch in the thread that iterates."""

ITERATOR_RESET = "_reset"
"""``_reset(self, loader, first_iter=False)``, called by a persistent loader's
``__iter__`` on the iterator it keeps, which then returns :data:`LOADER_ITERATOR` as it
is after the call: overridden by torch/fork_watch.py ``_Iterating``, so that one
inherited through fork hands the loader a new iterator of the child's own instead of
restarting the parent's workers."""

WORKER_EXITED_MESSAGE = "DataLoader worker (pid(s) {pids_str}) exited unexpectedly"
"""torch's error where a worker is found dead as a batch is awaited: what a
:class:`~numafast.errors.SenderDied` raised out of the queue's ``get`` becomes
(torch/message.py), and what torch/fork_watch.py ``_raise_if_a_worker_died`` raises
where a dying worker's batch cannot be read."""

WORKER_KILLED_MESSAGE = "DataLoader worker (pid {pid}) is killed by signal: "
"""The start of the error torch's SIGCHLD handler raises (a Python function, so its frame
is in the traceback) for a registered worker killed: ``_process.raised_by_signal_handler``
finds it, and a take-over lets it pass as it came."""

LOADER_ITERATOR = "_iterator"
"""A DataLoader's persistent iterator (None until the first epoch): NumaLoader drops one
its process inherited, and reuses its own (torch/loader.py); an inherited one's reset
replaces it (torch/fork_watch.py ``_Iterating._reset``)."""

LOADER_GET_ITERATOR = "_get_iterator"
"""The DataLoader method ``__iter__`` makes its iterator with: a loader that keeps
DataLoader's iterates over its own settings (torch/loader.py ``iterates_itself``); an
inherited iterator's reset makes the child's own with it (torch/fork_watch.py)."""

# ------------------------------------------------------------ torch's helpers

SIGNAL_HANDLING_MODULE = "torch.utils.data._utils.signal_handling"
SET_WORKER_PIDS = "_set_worker_pids"
REMOVE_WORKER_PIDS = "_remove_worker_pids"
"""``_set_worker_pids(key, pids)`` and ``_remove_worker_pids(key)`` of
:data:`SIGNAL_HANDLING_MODULE`: the workers torch's SIGCHLD check watches, per
iterator (``id(iterator)``), changed so that a worker numafast kills is not taken for
one that died (torch/fork_watch.py ``_worker_pids``)."""

EXCEPTION_WRAPPER_MODULE = "torch._utils"
EXCEPTION_WRAPPER = "ExceptionWrapper"
"""``ExceptionWrapper(exc_info=None, where=...)``, raised again by the iterator
(``reraise()``) at the batch it stands for: a message that cannot become its batch
(torch/message.py ``_failed``), a stuck worker's error (torch/fork_watch.py
``_queue_error``)."""

PIN_THREAD_NAME = "pt_data_pin"
"""The kernel name torch's pin thread gives itself
(``torch.multiprocessing._set_thread_name`` in torch.utils.data._utils.pin_memory):
how torch/message.py ``in_pin_thread`` knows it (torch/hook.py binds it)."""

TORCH_COLLATE_MODULE = "torch.utils.data._utils.collate"
TORCH_COLLATE_NAMES = ("collate", "collate_tensor_fn", "default_collate_fn_map")
"""torch's collate with a map of functions per type, its tensor stacking, and the
default map: numafast's collate into a slot extends them (torch/slot.py)."""

CUDART_CALLS = ("cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString")
"""What numafast calls on ``torch.cuda.cudart()`` (``torch._C._cudart`` in CUDA builds):
registering the pools' memory with CUDA (cuda.py ``Registration``)."""

# ------------------------------------------------------------ frameworks

LIGHTNING_SAVED_ARGUMENTS = ("__pl_saved_args", "__pl_saved_kwargs", "__pl_saved_arg_names")
"""Where Lightning keeps the arguments a DataLoader was made with inside a
``*_dataloader`` hook, to make the same class again from them with its
DistributedSampler (lightning.fabric.utilities.data: ``_wrap_init_method``,
``_get_dataloader_init_args_and_kwargs``): numafast's collate function is put among
them (torch/loader.py ``_travel_with_lightnings_arguments``)."""

RAY_INNER_LOADER = "_dataloader"
"""Where Ray Train's ``_WrappedDataLoader`` keeps the loader it wraps: followed to a
NumaLoader's stats (torch/loader.py ``loader_stats``)."""


# ------------------------------------------------------------ accessors


def multi_worker_iterator() -> type | None:
    """torch's multi-worker iterator class, where torch's DataLoader is loaded (None
    elsewhere: nothing is imported)."""
    kind = getattr(sys.modules.get(DATALOADER_MODULE), MULTI_WORKER_ITERATOR, None)
    return kind if isinstance(kind, type) else None


def signal_handling() -> ModuleType | None:
    """torch's DataLoader signal handling module (None where it has moved)."""
    try:
        from torch.utils.data._utils import signal_handling as module
    except ImportError:
        return None
    return module


def exception_wrapper() -> Any:
    """torch's ``ExceptionWrapper`` class (untyped in some torch versions)."""
    from torch._utils import ExceptionWrapper

    return ExceptionWrapper
