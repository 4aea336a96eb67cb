"""No wait without an end on a GPU fence: a slot given back while a copy to the GPU may
still read it is reused once its fence says done, and numafast waits for that no longer
than ``_libnuma.FENCE_WAIT_S`` after the slot came back (a kernel that does not end).
Past it, acquire() and reap(wait=True) raise PoolExhaustedError naming the slot, a
closed pool keeps its memory for a later settle, and a loader's batch arrives unpinned.

No GPU is involved or pretended: fences the test completes by hand stand in for the
CUDA events (as in test_pool.py), the bound is lowered to BOUND_S, and each call that
could wait runs in a thread joined for GUARD_S, so that code which still waits without
an end fails here rather than hangs.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from numafast import _libnuma
from numafast.errors import PoolExhaustedError
from sysfs_truth import PAGE_SIZE

BOUND_S = 0.5  # FENCE_WAIT_S for these tests
GUARD_S = 10.0  # how long a call may take before the test calls its wait one without an end

T = TypeVar("T")


class HandFence:
    """A fence the test completes by hand. ``query()`` is all numafast may ask;
    ``synchronize()`` is a CUDA event's own wait, which has no end and which numafast
    must not call: here it waits until the test completes the fence."""

    def __init__(self, done: bool) -> None:
        self.done = threading.Event()
        if done:
            self.done.set()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait(60)


class HandFences:
    """What a pool calls as each slot comes back (``fence(index)``): a hand fence, never
    done until :meth:`complete` (those made after it are done at once). A PinnedPool
    given it (the tests below that need one) asks its ``device``, and ``at_exit()`` for a
    fence past every copy."""

    device = 0

    def __init__(self) -> None:
        self.made: list[HandFence] = []
        self.all_done = False

    def at_exit(self) -> HandFence:
        self.made.append(HandFence(self.all_done))
        return self.made[-1]

    def __call__(self, index: int) -> HandFence:
        self.made.append(HandFence(self.all_done))
        return self.made[-1]

    def complete(self) -> None:
        self.all_done = True
        for fence in self.made:
            fence.done.set()


@pytest.fixture
def fences(monkeypatch: pytest.MonkeyPatch) -> Any:
    # raising=False: on code without the bound, the test then fails by its guard (a wait
    # without an end), not at this line.
    monkeypatch.setattr(_libnuma, "FENCE_WAIT_S", BOUND_S, raising=False)
    made = HandFences()
    yield made
    made.complete()  # ends a wait that code without the bound would still be in


def ends_within(seconds: float, call: Callable[[], T]) -> T:
    """``call()`` in a thread: its result, or its exception raised here; AssertionError
    when it still waits after ``seconds``."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: a wait without an end"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]  # type: ignore[no-any-return]


def states(slots: Any) -> list[str]:
    names = {value: name for name, value in _libnuma.SLOT_STATES.items()}
    return [names[state] for state in slots.table.states()]


def test_acquire_and_reap_end_with_a_clear_error_when_a_copy_never_ends(fences: HandFences) -> None:
    """acquire(nbytes, None) (timeout -1) and reap(wait=True) with no slot free and the
    oldest copy never done: PoolExhaustedError naming the slot, once FENCE_WAIT_S has
    passed since the slot came back, and at once after that; the slot stays fenced.
    (Was: an event's synchronize(), waited on with no end.)"""
    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(2) + 2 * PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 2, fences)
    held = slots.acquire(PAGE_SIZE)  # slot 0: held by "a tensor"
    came_back = time.monotonic()
    slots.acquire(PAGE_SIZE)  # slot 1: given back at once, "a copy still reads it"
    slots.settle()  # its fence recorded (else the pending call the return queued records it)
    assert states(slots) == ["held", "fenced"]
    with pytest.raises(PoolExhaustedError, match=r"copy to the GPU from slot 1 has not finished 0\.5 s after"):
        ends_within(GUARD_S, lambda: slots.acquire(PAGE_SIZE))
    assert time.monotonic() - came_back >= BOUND_S  # not before the bound
    assert states(slots) == ["held", "fenced"] and slots.fenced == 1  # never handed out under a running copy
    started = time.monotonic()
    with pytest.raises(PoolExhaustedError, match="slot 1 has not finished"):
        ends_within(GUARD_S, lambda: slots.reap(True))  # overdue already: no second wait
    with pytest.raises(PoolExhaustedError, match="slot 1 has not finished"):
        ends_within(GUARD_S, lambda: slots.acquire(PAGE_SIZE, 30.0))  # whatever the timeout
    assert time.monotonic() - started < BOUND_S

    # The bound is only about copies: a slot held by a tensor is waited for as long as it
    # takes (timeout None), past FENCE_WAIT_S, and its own copy, done, is no obstacle.
    fences.complete()
    slots.reap()
    assert states(slots) == ["held", "free"]
    other = slots.acquire(PAGE_SIZE)
    box = [held]
    del held
    threading.Timer(3 * BOUND_S, box.clear).start()
    started = time.monotonic()
    again = ends_within(GUARD_S, lambda: slots.acquire(PAGE_SIZE))
    assert again.index == 0 and time.monotonic() - started >= 2 * BOUND_S
    del again, other
    slots.close()
    assert slots.drained


def test_reap_waits_for_the_oldest_copy_until_the_bound(fences: HandFences) -> None:
    """reap(wait=True), with no slot free, returns as soon as the oldest copy is done, and
    raises once the bound passes with the copy still running."""
    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(1) + PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 1, fences)
    slots.acquire(PAGE_SIZE)
    slots.settle()
    threading.Timer(BOUND_S / 3, fences.made[0].done.set).start()
    ends_within(GUARD_S, lambda: slots.reap(True))  # done before the bound: freed
    assert states(slots) == ["free"]
    slots.acquire(PAGE_SIZE)
    slots.settle()
    came_back = time.monotonic()
    with pytest.raises(PoolExhaustedError, match="slot 0 has not finished"):
        ends_within(GUARD_S, lambda: slots.reap(True))
    assert time.monotonic() - came_back >= BOUND_S * 0.9 and states(slots) == ["fenced"]
    fences.complete()
    slots.close()
    assert slots.drained


def test_a_closed_pool_whose_copy_never_ends_keeps_its_memory_for_a_later_settle(fences: HandFences) -> None:
    """close() and settle() of a pool whose copies never end: each copy waited for until
    the bound, then its slot left fenced and on_drained (the memory's release: unpin,
    unmap) not called, settle() False and no exception; a later settle asks again without
    waiting, and drains the pool once the copies are done. (Was: synchronize(), with no end.)"""
    drained: list[bool] = []
    region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(2) + 2 * PAGE_SIZE)
    slots = _libnuma.SlotPool(region, PAGE_SIZE, 2, fences, lambda: drained.append(True))
    slots.acquire(PAGE_SIZE)  # slot 0: given back before the close, its copy running
    slots.settle()
    box = [slots.acquire(PAGE_SIZE)]  # slot 1: held at the close, given back after it
    try:
        ends_within(GUARD_S, slots.close)
        assert slots.closed and not slots.drained and drained == []
        box.clear()  # its settle (a pending call, or the one below) records its fence and waits
        assert ends_within(GUARD_S, slots.settle) is False
        assert states(slots) == ["fenced", "fenced"] and drained == [] and not region.freed
        started = time.monotonic()
        assert ends_within(GUARD_S, slots.settle) is False  # both overdue: asked once each
        assert time.monotonic() - started < BOUND_S
        fences.complete()
        assert slots.settle() is True
        assert drained == [True] and states(slots) == ["retired", "retired"] and slots.fenced == 0
    finally:
        # Drained here even when the test fails: else the slot comes back with the failure's
        # traceback, in the cycle collector, whose pending settle would call on_drained after
        # the collector cleared it.
        fences.complete()
        box.clear()
        slots.settle()


def test_a_loaders_batch_arrives_unpinned_when_every_slot_stays_in_flight(
    fences: HandFences, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NodePools copying a batch in finds every slot in flight behind a copy that never
    ends: once the bound passes, the batch reaches the consumer as it is (unpinned), with
    the unpinned warning saying why, rather than the receiving thread waiting with no end
    (was: acquire(nbytes, None) on the busy pool). The pools' fences are the hand ones:
    PinnedPool takes them where registering would give it CUDA's (numafast.pool._register,
    replaced; nothing is registered, no CUDA call is made)."""
    torch = pytest.importorskip("torch")
    from numafast import pool as pool_module
    from numafast.pages import local_node
    from numafast.torch.owner_pools import NodePools

    monkeypatch.setattr(pool_module, "_registering_device", lambda mode, device: 0)
    monkeypatch.setattr(pool_module, "_register", lambda *args, **kwargs: fences)
    pools = NodePools(local_node(), 2, lock="off", register="off")
    try:
        copied = [pools._copy(torch.full((1024,), float(index)), None) for index in range(2)]
        assert [batch.tolist() for batch in copied] == [[0.0] * 1024, [1.0] * 1024]
        made = pools.pools[0]
        assert len(pools.pools) == 1 and made._fences is fences and made.in_use == 2
        del copied  # both slots given back while "copies to the GPU still read them"
        made.settle()
        assert made.stats().in_flight == 2
        batch = torch.full((1024,), 7.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            arrived = ends_within(GUARD_S, lambda: pools._copy(batch, None))
        assert arrived is batch and pools.unpinned == 1  # as the DataLoader made it
        said = [str(warning.message) for warning in caught if "unpinned" in str(warning.message)]
        assert len(said) == 1 and "copy to the GPU from slot 0 has not finished" in said[0], said
        assert made.stats().in_flight == 2  # no slot handed out under a running copy
        fences.complete()  # the copies end: the pools go on pinned
        pinned = pools._copy(torch.full((1024,), 8.0), None)
        assert pinned is not batch and made.contains(pinned.data_ptr()) and pinned.tolist() == [8.0] * 1024
        del pinned
    finally:
        fences.complete()
        pools.close()
    assert made.settle() and made.stats().bytes_mapped == 0


def test_a_pool_released_during_a_graph_capture_waits_for_its_copies_within_the_bound(
    fences: HandFences, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registered pool drained while its thread captures a CUDA graph is released only
    after the capture, once a fence recorded then past every stream that may read it is
    done: waited for until the bound (was: torch.cuda.synchronize, with no end), then
    kept deferred and asked again, without waiting, at each pool's settle. The capture
    is numafast's own ``capturing()`` set to say so, the registration and fences are the
    test's (no GPU is involved or pretended, no CUDA call is made)."""
    pytest.importorskip("torch")
    from numafast import cuda, pool as pool_module
    from numafast.pages import local_node

    unregistered: list[int] = []

    class HandRegistration:
        device = 0

        def unregister(self) -> None:
            unregistered.append(1)

    pool = pool_module.PinnedPool(local_node(), PAGE_SIZE, 2, lock="off", register="off")
    resources = pool._resources
    resources.registration = HandRegistration()  # type: ignore[assignment]
    resources.events = fences  # type: ignore[assignment]
    try:
        monkeypatch.setattr(cuda, "capturing", lambda: True)
        pool.close()  # drained at once (no slot out), inside the capture: released later
        assert resources in pool_module._released_later and pool.stats().bytes_mapped > 0
        monkeypatch.setattr(cuda, "capturing", lambda: False)
        started = time.monotonic()
        assert ends_within(GUARD_S, pool.settle) is True  # the slots' part is drained
        assert time.monotonic() - started >= BOUND_S * 0.9  # its after-capture fence waited for, to the bound
        assert resources in pool_module._released_later and pool.stats().bytes_mapped > 0 and not unregistered
        started = time.monotonic()
        ends_within(GUARD_S, pool.settle)
        assert time.monotonic() - started < BOUND_S  # overdue: asked, not waited for again
        assert len(fences.made) == 1 and resources in pool_module._released_later
        fences.complete()
        pool.settle()
        assert resources not in pool_module._released_later
        assert pool.stats().bytes_mapped == 0 and unregistered == [1] and resources.released
    finally:
        fences.complete()
        pool_module._release_deferred()


REENTERED_SETTLE = r"""
import mmap
from numafast import _libnuma

PAGE = mmap.PAGESIZE
region = _libnuma.mmap_anonymous(_libnuma.slot_table_bytes(2) + 2 * PAGE)


class SettlesAgain:
    # A fence whose first question runs Python code that settles the same pool.
    pool = None
    asked = False

    def query(self):
        if not self.asked:
            self.asked = True
            self.pool.settle()
        return True


fence = SettlesAgain()
slots = _libnuma.SlotPool(region, PAGE, 2, lambda index: fence, on_drained=region.free)
fence.pool = slots
slots.acquire(PAGE)  # given back at once: fenced as the pool closes
slots.close()
print(slots.drained, region.freed, slots.table.states() if not region.freed else "")
"""


def test_a_settle_entered_during_a_settle_leaves_the_memory_to_the_first() -> None:
    """Python code runs inside settle() (here a fence's question; in a loader, the
    finalizers the collector runs, and the pending call a returned slot queued). A
    settle entered there ran through and released the memory (on_drained) under the
    first, which then read the unmapped slot table: a segfault (seen once in a fault soak
    under load). In a child process, where that would kill only the child."""
    result = subprocess.run([sys.executable, "-c", REENTERED_SETTLE], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.split()) == (0, ["True", "True"]), (result.returncode, result.stderr)
