"""One test per private name numafast relies on (numafast/private.py), against the
installed CPython, torch and frameworks: a release that moves one fails the test named
after it. Each is checked by what numafast does with it, on real torch iterators and
processes; a torch item is skipped where torch is not installed (CI's 3.12 and 3.13
environments), a framework's where the framework is not.
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

from numafast import private

# The same Python, torch and frameworks in a guest: nothing the kernel's nodes change
# (its two framework imports alone took 113 s of the 4-node guest's run).
pytestmark = pytest.mark.host_only("private names of CPython, torch and frameworks: the same on any kernel")

FORK = multiprocessing.get_context("fork")
WORKERS = 2


def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is not installed in this environment")


# ------------------------------------------------------------ CPython


def test_getframe() -> None:
    """The very ``sys._getframe``: the same depth, frames with ``f_back``, ``f_code``, ``f_locals``."""
    assert private.getframe is sys._getframe
    marker = object()

    def inner() -> Any:
        return private.getframe(1)

    frame = inner()
    assert frame.f_code is test_getframe.__code__
    assert frame.f_locals["marker"] is marker
    assert frame.f_back is not None


_forking: list[BaseProcess | None] = []  # what the before-fork hook found, while the list is not empty


def _find_process_forking() -> None:
    if not _forking:
        return
    frame: Any = private.getframe(1)  # the caller of os.fork() (this hook runs inside it)
    for _ in range(8):
        held = frame.f_locals.get(private.POPEN_PROCESS_LOCAL) if frame is not None else None
        if isinstance(held, BaseProcess):
            _forking.append(held)
            return
        frame = frame.f_back if frame is not None else None


os.register_at_fork(before=_find_process_forking)


def test_popen_process_local() -> None:
    """A before-fork hook finds the Process being started in a local so named, a few frames up."""
    process = FORK.Process(target=time.sleep, args=(0,))
    _forking.append(None)
    try:
        process.start()
    finally:
        found = _forking[1:]
        _forking.clear()
    process.join(10)
    assert found == [process]


def test_process_run_attributes() -> None:
    """A Process keeps its target, args and kwargs under these names until it starts."""
    kwargs = {"secs": 0}
    process = FORK.Process(target=time.sleep, args=(0,), kwargs=kwargs)
    assert [getattr(process, name) for name in private.PROCESS_RUN_ATTRIBUTES] == [time.sleep, (0,), kwargs]


def _event_is_set(event: Any) -> bool:
    """Event.is_set() as numafast's _DoneEvent does it, under the condition's lock."""
    condition, flag = getattr(event, private.EVENT_CONDITION), getattr(event, private.EVENT_FLAG)
    assert condition.acquire(False)
    try:
        if flag.acquire(False):
            flag.release()
            return True
        return False
    finally:
        condition.release()


def test_event_condition() -> None:
    """An Event's condition: its lock is the one set() and is_set() take (a hold keeps them out)."""
    event = FORK.Event()
    condition = getattr(event, private.EVENT_CONDITION)
    assert condition.acquire(False)
    try:
        setter = threading.Thread(target=event.set, daemon=True)
        setter.start()
        setter.join(0.2)
        assert setter.is_alive(), "Event.set() did not wait for the condition's lock"
        condition.notify_all()
    finally:
        condition.release()
    setter.join(10)
    assert event.is_set()


def test_event_flag() -> None:
    """An Event's flag: taken (and given back) exactly when the event is set; set as set() sets it."""
    event = FORK.Event()
    assert not _event_is_set(event)
    event.set()
    assert _event_is_set(event) and _event_is_set(event)
    other = FORK.Event()
    condition, flag = getattr(other, private.EVENT_CONDITION), getattr(other, private.EVENT_FLAG)
    with condition:  # Event.set() as _DoneEvent does it
        flag.acquire(False)
        flag.release()
        condition.notify_all()
    assert other.is_set()


def test_not_a_child_error() -> None:
    """join() and is_alive() of a Process raise this, saying so, in a process not its parent."""
    process = FORK.Process(target=time.sleep, args=(5,))
    process.start()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the Process is its parent's
            said = []
            for call in (lambda: process.join(0), process.is_alive):
                try:
                    call()
                except private.NOT_A_CHILD_ERROR as error:
                    said.append(str(error))
            os._exit(0 if said == ["can only join a child process", "can only test a child process"] else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        process.kill()
        process.join(10)


def test_argparse_types() -> None:
    """The classes of add_subparsers()'s result and of an argument group."""
    parser = argparse.ArgumentParser()
    kinds = [getattr(argparse, name) for name in private.ARGPARSE_TYPES]
    assert isinstance(parser.add_subparsers(), kinds[0])
    assert isinstance(parser.add_argument_group("group"), kinds[1])


# ------------------------------------------------------------ torch's multi-worker iterator


def _loader(**options: Any) -> Any:
    _torch()
    from torch.utils.data import DataLoader

    settings: dict[str, Any] = dict(batch_size=2, num_workers=WORKERS, multiprocessing_context="fork")
    return DataLoader(list(range(32)), **{**settings, **options})


@pytest.fixture(scope="module")
def running() -> Iterator[Any]:
    """A torch iterator with its workers started and a batch taken."""
    _torch()
    iterator = iter(_loader())
    next(iterator)
    yield iterator
    iterator._shutdown_workers()


def test_multi_worker_iterator(running: Any) -> None:
    """The class of a DataLoader's iterator with workers, where numafast finds it; its
    instances can become a subclass's (``__class__`` swap) and back."""
    kind = private.multi_worker_iterator()
    assert sys.modules[private.DATALOADER_MODULE].__name__ == private.DATALOADER_MODULE
    assert kind is type(running) and kind.__name__ == private.MULTI_WORKER_ITERATOR
    running.__class__ = type(kind.__name__, (kind,), {})
    running.__class__ = kind


def test_iterator_workers(running: Any) -> None:
    """A list of the workers' Processes, by worker index, alive."""
    processes = getattr(running, private.ITERATOR_WORKERS)
    assert isinstance(processes, list) and len(processes) == WORKERS
    assert all(isinstance(process, BaseProcess) and process.is_alive() for process in processes)


def test_iterator_worker_pids_set(running: Any) -> None:
    """True while the workers are registered for torch's SIGCHLD check."""
    assert getattr(running, private.ITERATOR_WORKER_PIDS_SET) is True


def test_iterator_shutdown() -> None:
    """False while running; set, the iterator's shutdown does nothing (what a forked child
    does to an iterator it inherited); True after, with the workers let go."""
    iterator = iter(_loader())
    next(iterator)
    assert getattr(iterator, private.ITERATOR_SHUTDOWN) is False
    processes = list(getattr(iterator, private.ITERATOR_WORKERS))
    setattr(iterator, private.ITERATOR_SHUTDOWN, True)
    iterator._shutdown_workers()
    assert all(process.is_alive() for process in processes)
    assert not getattr(iterator, private.ITERATOR_DONE_EVENT).is_set()
    setattr(iterator, private.ITERATOR_SHUTDOWN, False)
    iterator._shutdown_workers()
    assert getattr(iterator, private.ITERATOR_SHUTDOWN) is True
    assert getattr(iterator, private.ITERATOR_WORKER_PIDS_SET) is False
    assert not any(process.is_alive() for process in processes)


def test_iterator_received() -> None:
    """The task number of the next batch yielded: one more with each batch."""
    iterator = iter(_loader())
    try:
        for number in range(3):
            assert getattr(iterator, private.ITERATOR_RECEIVED) == number
            next(iterator)
        assert getattr(iterator, private.ITERATOR_RECEIVED) == 3
    finally:
        iterator._shutdown_workers()


def test_iterator_task_info(running: Any) -> None:
    """Task number -> (worker index,) while awaited, (worker index, data) once come early."""
    tasks = getattr(running, private.ITERATOR_TASK_INFO)
    assert isinstance(tasks, dict) and tasks
    received = getattr(running, private.ITERATOR_RECEIVED)
    for task, info in tasks.items():
        assert isinstance(task, int) and task >= received
        assert isinstance(info, tuple) and len(info) in (1, 2) and info[0] in range(WORKERS)


def _wait_for(release: Any, worker_id: int) -> None:
    if worker_id == 1:
        release.wait(60)


def test_iterator_result_queue() -> None:
    """An ExceptionWrapper put there as ``(task, error)`` for a task a worker never sends is
    raised by the iterator at that batch (a stuck worker's error), and the other
    worker's batches still come."""
    from functools import partial

    release = FORK.Event()
    iterator = iter(_loader(worker_init_fn=partial(_wait_for, release)))
    try:
        assert next(iterator).tolist() == [0, 1]  # worker 0's; task 1 is worker 1's, which waits
        waiting = min(task for task, info in getattr(iterator, private.ITERATOR_TASK_INFO).items() if info == (1,))
        assert waiting == getattr(iterator, private.ITERATOR_RECEIVED) == 1
        try:
            raise LookupError("never started")
        except LookupError:
            error = private.exception_wrapper()(where="in DataLoader worker process 1")
        getattr(iterator, private.ITERATOR_RESULT_QUEUE).put((waiting, error))
        with pytest.raises(LookupError, match="never started"):
            next(iterator)
    finally:
        release.set()
        iterator._shutdown_workers()


def test_iterator_done_event() -> None:
    """A multiprocessing Event, read from the iterator as it shuts down (so a replacement
    put there is the one set)."""
    iterator = iter(_loader())
    next(iterator)
    event = getattr(iterator, private.ITERATOR_DONE_EVENT)
    assert isinstance(event, multiprocessing.synchronize.Event) and not event.is_set()
    calls: list[str] = []

    class Recording:
        def set(self) -> None:
            calls.append("set")
            event.set()

        def is_set(self) -> bool:
            return event.is_set()

    setattr(iterator, private.ITERATOR_DONE_EVENT, Recording())
    iterator._shutdown_workers()
    assert "set" in calls and event.is_set()


def test_iterator_collate() -> None:
    """The collate function its workers run: the loader's."""
    loader = _loader()
    iterator = iter(loader)
    try:
        assert getattr(iterator, private.ITERATOR_COLLATE) is loader.collate_fn
    finally:
        iterator._shutdown_workers()


def test_iterator_try_get_data() -> None:
    """``_try_get_data(timeout)``: its timeout has a default; it returns (got, (task, data))."""
    iterator = iter(_loader())
    method = getattr(private.multi_worker_iterator(), private.ITERATOR_TRY_GET_DATA)
    assert inspect.signature(method).parameters["timeout"].default is not inspect.Parameter.empty
    try:
        got, data = getattr(iterator, private.ITERATOR_TRY_GET_DATA)(10.0)
        assert got is True and isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], int)
    finally:
        iterator._shutdown_workers()


def test_iterator_reset() -> None:
    """``_reset(loader, first_iter=False)``: a persistent loader's next epoch calls it on the
    iterator it keeps, then returns the loader's iterator as the call left it."""
    loader = _loader(persistent_workers=True)
    first = iter(loader)
    parameters = inspect.signature(getattr(private.multi_worker_iterator(), private.ITERATOR_RESET)).parameters
    assert list(parameters)[:3] == ["self", "loader", "first_iter"] and parameters["first_iter"].default is False
    fresh, calls = object(), []

    def reset(self: Any, loader: Any, first_iter: bool = False) -> None:
        calls.append(first_iter)
        setattr(loader, private.LOADER_ITERATOR, fresh)

    try:
        setattr(loader, private.LOADER_ITERATOR, type("Kept", (), {private.ITERATOR_RESET: reset})())
        assert loader.__iter__() is fresh and calls == [False]
    finally:
        first._shutdown_workers()


def test_worker_exited_message() -> None:
    """torch's error for a worker found dead as a batch is awaited, in ``_try_get_data``."""
    _torch()
    from torch.utils.data import dataloader

    method = getattr(getattr(dataloader, private.MULTI_WORKER_ITERATOR), private.ITERATOR_TRY_GET_DATA)
    assert f'f"{private.WORKER_EXITED_MESSAGE}"' in inspect.getsource(method)


def test_worker_killed_message() -> None:
    """A registered worker killed: torch's SIGCHLD handler, a Python function, raises this."""
    iterator = iter(_loader())
    next(iterator)
    handler = signal.getsignal(signal.SIGCHLD)
    assert hasattr(handler, "__code__"), handler
    process = getattr(iterator, private.ITERATOR_WORKERS)[0]
    check = private.signal_handling()._error_if_any_worker_fails  # type: ignore[union-attr]
    try:
        with pytest.raises(RuntimeError) as raised:
            os.kill(process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                check()
                time.sleep(0.01)
        assert str(raised.value).startswith(private.WORKER_KILLED_MESSAGE.format(pid=process.pid)), raised.value
    finally:
        for _ in range(3):
            try:
                iterator._shutdown_workers()
                break
            except RuntimeError:  # the handler again, for another worker it saw end
                continue


def test_loader_iterator() -> None:
    """A DataLoader's persistent iterator: None before the first epoch, the iterator after;
    set to None, the next epoch makes a new one."""
    loader = _loader(persistent_workers=True)
    assert getattr(loader, private.LOADER_ITERATOR) is None
    first = iter(loader)
    assert getattr(loader, private.LOADER_ITERATOR) is first
    setattr(loader, private.LOADER_ITERATOR, None)
    second = iter(loader)
    assert second is not first and getattr(loader, private.LOADER_ITERATOR) is second
    for iterator in (first, second):
        iterator._shutdown_workers()


def test_loader_get_iterator() -> None:
    """DataLoader's ``__iter__`` makes its iterator with this method."""
    _torch()
    from torch.utils.data import DataLoader

    made = iter([42])

    class Loader(DataLoader[Any]):
        pass

    setattr(Loader, private.LOADER_GET_ITERATOR, lambda self: made)
    assert iter(Loader(list(range(4)))) is made


# ------------------------------------------------------------ torch's helpers


def test_set_worker_pids_and_remove_worker_pids() -> None:
    """Per key, pids set once (twice is an error: numafast removes first), and removed."""
    _torch()
    module = private.signal_handling()
    assert module is not None and module.__name__ == private.SIGNAL_HANDLING_MODULE
    put, remove = getattr(module, private.SET_WORKER_PIDS), getattr(module, private.REMOVE_WORKER_PIDS)
    process = FORK.Process(target=time.sleep, args=(5,))
    process.start()
    key = id(process)
    try:
        put(key, (process.pid,))
        with pytest.raises(ValueError):
            put(key, (process.pid,))
        remove(key)
        put(key, (process.pid,))
        remove(key)
    finally:
        process.kill()
        process.join(10)


def test_exception_wrapper() -> None:
    """``ExceptionWrapper(exc_info, where=...)`` or, in an except block, ``(where=...)``;
    ``reraise()`` raises the exception's type with its message and where."""
    _torch()
    wrap = private.exception_wrapper()
    assert wrap.__module__ == private.EXCEPTION_WRAPPER_MODULE and wrap.__name__ == private.EXCEPTION_WRAPPER
    given = wrap((KeyError, KeyError("given"), None), where="in DataLoader worker process 3")
    with pytest.raises(KeyError, match="in DataLoader worker process 3"):
        given.reraise()
    try:
        raise ValueError("handled")
    except ValueError:
        current = wrap(where="in the main process")
    with pytest.raises(ValueError, match="handled") as raised:
        current.reraise()
    assert "in the main process" in str(raised.value)


def test_pin_thread_name() -> None:
    """torch's pin thread names itself so (seen in /proc, as in_pin_thread reads it)."""
    torch = _torch()
    from torch.utils.data._utils import pin_memory

    from numafast.torch.message import in_pin_thread

    assert f'_set_thread_name("{private.PIN_THREAD_NAME}")' in inspect.getsource(pin_memory)
    seen: list[bool] = []

    def named() -> None:
        seen.append(in_pin_thread())
        torch.multiprocessing._set_thread_name(private.PIN_THREAD_NAME)
        seen.append(in_pin_thread())

    thread = threading.Thread(target=named)
    thread.start()
    thread.join(10)
    assert seen == [False, True]


def test_torch_collate() -> None:
    """torch's collate with a map per type, its tensor stacking (keyword ``collate_fn_map``),
    and the default map, which stacks tensors with it."""
    torch = _torch()
    import importlib

    module = importlib.import_module(private.TORCH_COLLATE_MODULE)
    collate, stack, default_map = (getattr(module, name) for name in private.TORCH_COLLATE_NAMES)
    assert default_map[torch.Tensor] is stack
    for function in (collate, stack):
        assert inspect.signature(function).parameters["collate_fn_map"].kind is inspect.Parameter.KEYWORD_ONLY
    batch = collate([(torch.tensor([1, 2]), 3), (torch.tensor([4, 5]), 6)], collate_fn_map=default_map)
    assert batch[0].tolist() == [[1, 2], [4, 5]] and batch[1].tolist() == [3, 6]


def test_cudart_calls() -> None:
    """The CUDA runtime calls numafast makes, on the module ``torch.cuda.cudart()`` returns."""
    torch = _torch()
    assert callable(torch.cuda.cudart)
    runtime = getattr(torch._C, "_cudart", None)
    if runtime is None:
        pytest.skip(f"torch {torch.__version__} is built without CUDA")
    for name in private.CUDART_CALLS:
        assert callable(getattr(runtime, name)), name


# ------------------------------------------------------------ frameworks


def test_lightning_saved_arguments() -> None:
    """A DataLoader made in a Lightning hook keeps its arguments so."""
    _torch()
    data = pytest.importorskip("lightning.fabric.utilities.data", reason="Lightning is not installed here")
    from torch.utils.data import DataLoader

    dataset = list(range(4))
    with data._replace_dunder_methods(DataLoader, "dataset"):
        loader = DataLoader(dataset, batch_size=2)
    args, kwargs, names = (vars(loader)[name] for name in private.LIGHTNING_SAVED_ARGUMENTS)
    assert args == (dataset,) and kwargs == {"batch_size": 2} and names == ("dataset",)


def test_ray_inner_loader() -> None:
    """Ray Train's wrapped loader keeps the loader it wraps there."""
    torch = _torch()
    utils = pytest.importorskip("ray.train.torch.train_loop_utils", reason="Ray Train is not installed here")
    loader = _loader(num_workers=0, multiprocessing_context=None)
    wrapped = utils._WrappedDataLoader(loader, torch.device("cpu"), False)
    assert vars(wrapped)[private.RAY_INNER_LOADER] is loader
