"""Which threads change a loader's pools (issue 47: "NodePools is changed by at most two
threads"): its receiving thread and its user's thread, never the thread another loader
receives its batches in; and the grown pools of a loader not iterated now are still
released, by its user's thread, without a call on that loader."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

import numafast.torch  # noqa: E402
from numafast.torch.hook import PinMemoryHook  # noqa: E402
from numafast.torch.owner_pools import SHRINK_EVERY  # noqa: E402
from test_slot_pressure import Images  # noqa: E402  (sample i: an image filled with i, and i)

SEMANTICS = pytest.mark.host_only("loader semantics, the same on any kernel; worker processes cost seconds under TCG")
BATCH = 8


def checked(batches: Iterable[Any], keep: list[Any] | None = None) -> int:
    """Check every batch is the stock one (batch n holds samples 8n..8n+7, each image
    filled with its index); keep them in ``keep`` where given. Returns how many."""
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kept-batches warning, not what is tested here
        for number, (images, labels) in enumerate(batches):
            assert labels.tolist() == list(range(BATCH * number, BATCH * number + BATCH)), (number, labels)
            filled = images.amin((1, 2, 3)), images.amax((1, 2, 3))
            assert torch.equal(filled[0], labels.float()) and torch.equal(filled[1], labels.float())
            if keep is not None:
                keep.append((images, labels))
            count += 1
    return count


def mapped_pool_files() -> set[int]:
    """The inodes of the numafast pool files this process maps, as the kernel says."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {int(line.split()[4]) for line in maps if "numafast-pool-node" in line}


def grown_files(pools: Any) -> set[int]:
    """The inodes of ``pools``' grown pools (all but the first)."""
    return {pool.share().inode for pool in pools.pools[1:]}


def record_changes(pools: Any) -> list[tuple[str, int]]:
    """The (method, thread) of every shrink and publish of ``pools`` from now on: those two
    methods of that one object wrapped to note the calling thread, then run as they are."""
    calls: list[tuple[str, int]] = []

    def recording(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, threading.get_ident()))
            return method(*args, **kwargs)

        return call

    for name in ("shrink", "_publish"):
        setattr(pools, name, recording(name, getattr(pools, name)))
    return calls


def in_thread(work: Callable[[], int]) -> tuple[int, int]:
    """``work()`` run in a thread of its own: its result and that thread's id (an error
    in it raised here)."""
    result: list[int] = []
    errors: list[BaseException] = []
    ident: list[int] = []

    def run() -> None:
        ident.append(threading.get_ident())
        try:
            result.append(work())
        except BaseException as error:  # noqa: BLE001 - raised again in the test's thread
            errors.append(error)

    thread = threading.Thread(target=run, name="other loader's consumer")
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the other loader's thread did not finish in 120 s"
    if errors:
        raise errors[0]
    return result[0], ident[0]


def grown_then_dropped() -> tuple[Any, int]:
    """Loader B: its consumer (this thread) kept an epoch's batches, so its pools grew, then
    dropped them; the grown pools are wholly free now, not yet released. And how many pools."""
    evaluation = numafast.torch.NumaLoader(DataLoader(Images(512), batch_size=BATCH, num_workers=2), lock="off")
    kept: list[Any] = []
    assert checked(evaluation, kept) == 64
    grown = len(evaluation.pools.pools)
    assert grown > 2, evaluation.pools.pools
    del kept
    gc.collect()
    return evaluation, grown


@SEMANTICS
@pytest.mark.parametrize("other", ["NumaLoader", "pin_memory hook"])
def test_another_threads_batches_leave_a_loaders_pools_to_its_own_threads(other: str) -> None:
    """B grew pools for kept batches in this thread and dropped them; loader A then receives
    4 x SHRINK_EVERY batches in another thread (a consumer thread, or the thread a hooked
    DataLoader's batches are received in, as torch's pin thread is): only this thread (B's
    user and receiving thread) ever shrinks or publishes B's pools, so A's thread leaves
    them grown. Once A's batches arrive in this thread, B's grown pools are released with
    no call on B (no iter(), no stats()), in this thread."""
    gc.collect()
    numafast.torch.close_idle_pools()  # B makes new pools: none taken over, sized by others
    evaluation, grown = grown_then_dropped()
    b_pools = evaluation.pools
    grown_inodes = grown_files(b_pools)
    changes = record_changes(b_pools)
    stock = DataLoader(Images(BATCH * 4 * SHRINK_EVERY), batch_size=BATCH, num_workers=2)
    if other == "NumaLoader":
        training: Any = numafast.torch.NumaLoader(stock, lock="off")
        a_pools = training.pools
    else:
        # What pin_memory_hook makes (which needs an accelerator for torch to pin; the
        # thread that receives here stands in for torch's pin thread).
        hook = PinMemoryHook(stock, evaluation.node, None, slots=6, installed=True, reason="")
        training, a_pools = stock, hook.pools
    assert a_pools is not b_pools
    received, other_thread = in_thread(lambda: checked(training))
    assert received == a_pools.received() == 4 * SHRINK_EVERY
    assert other_thread not in {ident for _name, ident in changes}, changes
    assert len(b_pools.pools) == grown, "another loader's thread released B's grown pools"
    assert grown_inodes <= mapped_pool_files()
    assert checked(training) == 4 * SHRINK_EVERY  # in B's user's thread now: its periodic shrink looks at B
    assert len(b_pools.pools) == 1, b_pools.pools  # released with no call on B
    assert not grown_inodes & mapped_pool_files()  # unmapped, the kernel says
    assert {ident for _name, ident in changes} == {threading.get_ident()}, changes
    assert ("_publish", threading.get_ident()) in changes


@SEMANTICS
def test_idle_pools_are_shrunk_by_the_thread_that_let_them_go() -> None:
    """B's loader is dropped while its consumer (this thread) still keeps its batches: its
    pools go idle, grown. Another thread's batches leave them alone; once the kept batches
    are dropped, this thread's next batches release the grown pools."""
    gc.collect()
    numafast.torch.close_idle_pools()
    evaluation = numafast.torch.NumaLoader(DataLoader(Images(512), batch_size=BATCH, num_workers=2), lock="off")
    kept: list[Any] = []
    assert checked(evaluation, kept) == 64
    b_pools = evaluation.pools
    grown, grown_inodes = len(b_pools.pools), grown_files(b_pools)
    assert grown > 2
    changes = record_changes(b_pools)
    del evaluation
    gc.collect()  # let go here: idle, every grown pool still held by `kept`
    assert b_pools.users == 0 and len(b_pools.pools) == grown
    del kept
    gc.collect()
    training = numafast.torch.NumaLoader(DataLoader(Images(BATCH * 4 * SHRINK_EVERY), batch_size=BATCH, num_workers=2),
                                         lock="best-effort")  # fmt: skip
    assert training.pools is not b_pools  # locked unlike B's: new pools, B's stay idle
    _received, other_thread = in_thread(lambda: checked(training))
    assert other_thread not in {ident for _name, ident in changes} and len(b_pools.pools) == grown, changes
    assert grown_inodes <= mapped_pool_files()
    assert checked(training) == 4 * SHRINK_EVERY
    assert len(b_pools.pools) == 1 and {ident for _name, ident in changes} == {threading.get_ident()}, changes
    assert not grown_inodes & mapped_pool_files()


@SEMANTICS
def test_the_pools_of_a_thread_that_ended_are_shrunk_by_the_next_thread_whose_batches_arrive() -> None:
    """B is made and iterated, its batches kept and dropped, in a thread that then ends: the
    next thread whose batches arrive (this one, iterating another loader) becomes the
    user of B's pools and releases the grown ones, with no call on B."""
    gc.collect()
    numafast.torch.close_idle_pools()
    made: list[Any] = []

    def evaluate() -> int:
        evaluation, grown = grown_then_dropped()
        made.append(evaluation)
        return grown

    grown, _ended = in_thread(evaluate)
    b_pools = made[0].pools
    grown_inodes = grown_files(b_pools)
    assert len(b_pools.pools) == grown and grown_inodes <= mapped_pool_files()
    changes = record_changes(b_pools)
    training = numafast.torch.NumaLoader(DataLoader(Images(BATCH * SHRINK_EVERY), batch_size=BATCH, num_workers=2),
                                         lock="off")  # fmt: skip
    assert checked(training) == SHRINK_EVERY
    assert len(b_pools.pools) == 1 and not grown_inodes & mapped_pool_files(), b_pools.pools
    assert {ident for _name, ident in changes} == {threading.get_ident()}, changes


@SEMANTICS
def test_stats_in_another_thread_reports_without_changing_the_pools() -> None:
    """A monitoring thread asking for B's stats (its grown pools free again) reads them and
    changes nothing; stats() in B's own thread releases the grown pools."""
    gc.collect()
    numafast.torch.close_idle_pools()
    evaluation, grown = grown_then_dropped()
    changes = record_changes(evaluation.pools)
    reported, _monitor = in_thread(lambda: len(evaluation.stats().pools))
    assert reported == grown == len(evaluation.pools.pools) and not changes, changes
    assert len(evaluation.stats().pools) == 1
    assert {ident for _name, ident in changes} == {threading.get_ident()}, changes
