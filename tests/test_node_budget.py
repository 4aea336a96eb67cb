"""The pinned memory of a node, one budget for every numafast process on it (issue 45,
fault 7): loaders in two processes growing their pools at once never lock more than
the budget together (asked of the kernel: VmLck of each process), a killed process's
share comes back, the cgroup's memory limit bounds it; and (fault 3) a retired pool
is released outside the per-batch mutex. Each test keeps its ledger in its own
directory, away from the node's real one."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from numafast import _libnuma, _process, node_budget
from numafast.pool import MEMFD_PREFIX
from test_pool_fork import descriptors_naming

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SEMANTICS = pytest.mark.host_only("a budget shared by processes: the same on any kernel; workers cost seconds under TCG")
# Small enough that two loaders keeping every batch (8 MiB of slots each) run past it.
BUDGET = 3 << 20


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(node_budget, "LEDGER_DIR", tmp_path)
    yield tmp_path


# ---------------------------------------------------------------- the cgroup's limit


def test_cgroup_v2_limit_is_the_lowest_on_the_path_up() -> None:
    # worker: max; ctr: 4 GiB; pod1: 16 GiB.
    assert node_budget.cgroup_memory_limit(FIXTURES / "container-cgroup2") == 4 << 30


def test_cgroup_v1_limit_is_read_at_the_mount_root_inside_a_container() -> None:
    # /docker/abc is the host's path, not mounted in the container: its own cgroup is the mount's root.
    assert node_budget.cgroup_memory_limit(FIXTURES / "container-cgroup1") == 8 << 30


def test_no_memory_limit_anywhere_is_none(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/job\n4:memory:/job\n")
    (tmp_path / "proc/mounts").write_text(
        "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\ncgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
    )
    (tmp_path / "sys/fs/cgroup/job").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/job/memory.max").write_text("max\n")
    (tmp_path / "sys/fs/cgroup/memory/job").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/memory/job/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert node_budget.cgroup_memory_limit(tmp_path) is None
    assert node_budget.cgroup_memory_limit(FIXTURES / "dgx-h100") is None


def test_the_budget_is_a_quarter_of_the_node_or_of_the_cgroup_limit_where_lower() -> None:
    memory = _libnuma.node_size64(0)[0]
    assert node_budget.budget_bytes(0, root=FIXTURES / "dgx-h100") == memory // 4
    assert node_budget.budget_bytes(0, root=FIXTURES / "container-cgroup2") == min(memory, 4 << 30) // 4


# ---------------------------------------------------------------- the ledger

STRESS = """
import mmap, random, sys
from pathlib import Path
from numafast import _libnuma, node_budget
node_budget.LEDGER_DIR = Path(sys.argv[1])
limit, rounds = int(sys.argv[2]), int(sys.argv[4])
book = node_budget.ledger(0)
with open(sys.argv[3], "r+b") as file:
    held = mmap.mmap(file.fileno(), 4096)
print("ready", flush=True)
sys.stdin.readline()
granted = most = 0
for _ in range(rounds):
    nbytes = random.randint(1, limit // 2)
    if book.reserve(nbytes, limit):
        granted += 1
        most = max(most, _libnuma.shared_add(held, 0, nbytes))  # what every process holds now
        _libnuma.shared_add(held, 0, -nbytes)
        book.release(nbytes)
print(granted, most, book.mine())
"""


def start_together(commands: list[list[str]]) -> list[subprocess.Popen[str]]:
    """Start each command, wait until each says it is ready, then let them all go at once."""
    children = [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        for command in commands
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    return children


@SEMANTICS
def test_reservations_racing_in_two_processes_never_hold_more_than_the_limit(tmp_path: Path) -> None:
    held = tmp_path / "held"
    held.write_bytes(bytes(4096))
    limit = 1000
    command = [sys.executable, "-c", STRESS, str(tmp_path), str(limit), str(held), "3000"]
    children = start_together([command, command])
    outputs = [child.communicate(timeout=240)[0].split() for child in children]
    for granted, most, left in outputs:
        assert int(granted) > 0 and 0 < int(most) <= limit and int(left) == 0, outputs


def test_a_ledger_holds_no_descriptor_a_forked_child_could_have_reused(ledger_dir: Path) -> None:
    """The ledger is mapped with no descriptor kept open (Python's mmap keeps a copy of
    one, which a child that closed its inherited descriptors and opened its own files
    would close under one of them when the ledger it inherited goes)."""
    book = node_budget.ledger(0)
    assert book.path is not None and book.path.parent == ledger_dir
    assert descriptors_naming(str(book.path)) == []


def test_a_dead_process_entry_stops_counting_and_is_reused(ledger_dir: Path) -> None:
    book = node_budget.ledger(0)
    code = (
        "import sys; from pathlib import Path; from numafast import node_budget\n"
        f"node_budget.LEDGER_DIR = Path({str(ledger_dir)!r})\n"
        "assert node_budget.ledger(0).reserve(700, 1000)\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=ENV, cwd=ROOT)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    assert [(pid, nbytes) for _, pid, nbytes in book.entries()] == [(child.pid, 700)]
    assert not book.reserve(400, 1000)  # the live child's 700 count
    child.kill()
    child.wait(timeout=60)
    assert [(pid, nbytes) for _, pid, nbytes in book.entries()] == [(_process.pid, 0)]  # the child's is free again
    assert book.reserve(1000, 1000) and [(pid, nbytes) for _, pid, nbytes in book.entries()] == [(_process.pid, 1000)]
    book.release(1000)


# ---------------------------------------------------------------- loaders in two processes

LOADER = """
import sys, warnings
sys.path.insert(0, "tests")
from pathlib import Path
from test_slot_pressure import DataLoader, Images, numafast, torch, vmlck
from numafast import node_budget
node_budget.LEDGER_DIR, node_budget.SHARE = Path(sys.argv[1]), int(sys.argv[2])
stock = DataLoader(Images(512), batch_size=8, num_workers=2)
loader = numafast.torch.NumaLoader(stock, lock="best-effort")  # locked as with a GPU: the kernel counts it (VmLck)
print("ready", flush=True)
sys.stdin.readline()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # batches past the budget arrive unpinned, warned about
    kept = list(loader)  # every batch kept: the pools grow until the budget refuses more
same = all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(stock, kept))
stats = loader.stats()
print(same, len(kept), stats.unpinned, stats.pinned_bytes, stats.max_pinned_bytes, vmlck(), flush=True)
sys.stdin.readline()
"""


def loader_command(ledger: Path) -> list[str]:
    share = _libnuma.node_size64(0)[0] // BUDGET  # the node's budget: BUDGET bytes
    return [sys.executable, "-c", LOADER, str(ledger), str(share)]


def vmlck_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmLck:")[1].split()[0]) * 1024


def finish(children: list[subprocess.Popen[str]]) -> list[list[str]]:
    """What each loader child printed after its run (it then waits, holding its batches)."""
    results = []
    for child in children:
        assert child.stdout is not None
        results.append(child.stdout.readline().split())
    return results


def let_go(children: list[subprocess.Popen[str]]) -> None:
    for child in children:
        if child.poll() is None:
            child.communicate("exit\n", timeout=60)


@SEMANTICS
def test_two_processes_growing_loader_pools_at_once_stay_within_the_node_budget(ledger_dir: Path) -> None:
    pytest.importorskip("torch")
    children = start_together([loader_command(ledger_dir)] * 2)
    try:
        results = finish(children)
        locked = [vmlck_of(child.pid) for child in children]  # both hold every batch they kept
        total = node_budget.ledger(0).total()
    finally:
        let_go(children)
    for same, count, unpinned, pinned, budget, _ in results:
        assert (same, count) == ("True", "64"), results
        assert int(unpinned) > 0 and int(budget) >= BUDGET, results
    budget = int(results[0][4])
    assert sum(locked) <= budget, (locked, budget)  # the kernel's word: together within the one budget
    assert total == sum(int(result[3]) for result in results) == sum(locked)  # the ledger agrees
    assert sum(locked) > budget // 2  # and the budget was used, not refused early


@SEMANTICS
def test_a_killed_loader_process_share_comes_back(ledger_dir: Path) -> None:
    pytest.importorskip("torch")
    (first,) = start_together([loader_command(ledger_dir)])
    try:
        held = int(finish([first])[0][3])
        assert held > BUDGET // 2 and node_budget.ledger(0).total() == held
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        let_go([first])
    (second,) = start_together([loader_command(ledger_dir)])
    try:
        (result,) = finish([second])
        locked = vmlck_of(second.pid)
    finally:
        let_go([second])
    assert result[0] == "True" and int(result[3]) == locked > BUDGET // 2, (result, locked, held)


# ---------------------------------------------------------------- one process


@SEMANTICS
def test_a_loaders_pools_reserve_on_the_ledger_and_give_back_as_released(ledger_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from numafast.torch.owner_pools import NodePools
    from numafast.torch import close_idle_pools
    from numafast.torch.owner_process_pools import pinned_bytes

    book = node_budget.ledger(0)
    # Pools of earlier tests' loaders may still be reserved (on the ledger they were made
    # with): let those go that can, and count this test's own.
    gc.collect()
    close_idle_pools()
    reserved, pinned = node_budget.process_reserved(), pinned_bytes()
    pools = NodePools(0, 2, lock="off")
    kept = [pools.pin(torch.full((1 << 16,), float(i))) for i in range(6)]
    assert [float(t[0]) for t in kept] == [float(i) for i in range(6)]
    assert book.mine() == node_budget.process_reserved() - reserved == pinned_bytes() - pinned > 0 and pools.grown
    del kept
    pools.close()
    assert book.mine() == node_budget.process_reserved() - reserved == pinned_bytes() - pinned == 0


# ---------------------------------------------------------------- fault 3: released outside the mutex


def released_under_a_lock(pool: Any, held: Callable[[], bool] = _process.holds_a_lock) -> list[tuple[bool, int]]:
    """Record, as ``pool``'s memory is released, whether the releasing thread ``held`` a
    lock then (by default any of numafast's: NodePools' mutex, the budget's), and which
    thread it was."""
    seen: list[tuple[bool, int]] = []
    unpin = pool._resources.unpin

    def watched() -> None:
        seen.append((held(), threading.get_ident()))
        unpin()

    pool._resources.unpin = watched
    return seen


def maps_inode(inode: int) -> bool:
    """Whether a pool's file numbered ``inode`` is mapped here. The number alone could
    name a mapped library too: file systems number their inodes apart."""
    return any(fields[4] == str(inode) and fields[5].startswith(f"/memfd:{MEMFD_PREFIX}")
               for fields in map(str.split, Path("/proc/self/maps").read_text().splitlines()) if len(fields) > 5)


def released_soon(inode: int) -> bool:
    """Whether the file ``inode`` is still mapped once the main thread's pending calls have
    run: at its next call, or (where CPython 3.11 cleared the main thread's eval breaker,
    as a signal handled in another thread does) once it takes the GIL again. No call on
    the pools in between: only the pending call can release them."""
    deadline = time.monotonic() + 10
    while (mapped := maps_inode(inode)) and time.monotonic() < deadline:
        time.sleep(0.01)  # taking the GIL back recomputes the eval breaker
    return mapped


def test_a_retired_pools_last_slot_dropped_under_the_mutex_is_released_after_it(ledger_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from numafast.torch.owner_pools import NodePools

    pools = NodePools(0, 2, lock="off")
    batch = pools.pin(torch.zeros(1 << 12))
    old = pools.pools[0]
    inode = old.share().inode
    seen = released_under_a_lock(old)
    assert pools.make_room(1 << 20, more=False) and old in pools.retired  # a larger batch: the pool retires
    with pools._mutex:  # as a receive holds it
        del batch  # its slot comes back; the pending call settling the pool runs at the next call
        inside = maps_inode(inode)
    after = released_soon(inode)
    assert (inside, after, list(seen)) == (True, False, [(False, threading.get_ident())])
    pools.close()


def test_a_settle_queued_as_the_main_thread_waits_for_the_mutex_runs_after_it(ledger_dir: Path) -> None:
    """Another thread (a second loader's receiving thread) holds the mutex and drops the
    last slot of a retired pool while the main thread waits for the mutex: the pending call
    settling that pool runs as the main thread's acquire() returns, before any record of a
    holder could be set after it. It waits for the mutex to be let go, not run under it."""
    torch = pytest.importorskip("torch")
    from numafast.torch.owner_pools import NodePools

    pools = NodePools(0, 2, lock="off")
    batch = [pools.pin(torch.zeros(1 << 12))]
    old = pools.pools[0]
    inode = old.share().inode
    assert pools.make_room(1 << 20, more=False) and old in pools.retired
    seen = released_under_a_lock(old)
    main = threading.get_ident()
    holding = threading.Event()
    errors: list[str] = []

    def other() -> None:
        with pools._mutex:
            holding.set()
            deadline = time.monotonic() + 10  # until the main thread is in the mutex's __enter__, waiting
            while (frame := sys._current_frames().get(main)) is None or frame.f_code.co_name not in ("__enter__", "acquire"):
                if time.monotonic() > deadline:
                    errors.append("the main thread never waited for the mutex")
                    break
                time.sleep(0.001)
            batch.clear()  # the retired pool's last slot comes back: its settle is queued for the main thread

    thread = threading.Thread(target=other, name="another loader's receiving thread")
    thread.start()
    assert holding.wait(10)
    with pools._mutex:  # waits for the other thread; the pending call runs as the wait ends
        inside = list(seen)
    thread.join(10)
    assert not thread.is_alive() and not errors, errors
    assert (inside, released_soon(inode), list(seen)) == ([], False, [(False, main)])
    pools.close()


def test_a_settle_queued_as_the_main_thread_holds_another_loaders_mutex_runs_after_it(ledger_dir: Path) -> None:
    """Two loaders in one process: the main thread holds loader A's mutex (a stats(), a
    shrink, a receive) as the last slot of loader B's retired pool is dropped. B's settle
    (waiting for the GPU copies, unregistering, unmapping) waits for A's mutex to be let
    go: A's receiving thread must not wait behind it."""
    torch = pytest.importorskip("torch")
    from numafast.torch.owner_pools import NodePools

    a, b = NodePools(0, 2, lock="off"), NodePools(0, 2, lock="off")
    batch = [b.pin(torch.zeros(1 << 12))]
    old = b.pools[0]
    inode = old.share().inode
    assert b.make_room(1 << 20, more=False) and old in b.retired
    seen = released_under_a_lock(old)
    with a._mutex:
        batch.clear()  # B's retired pool's last slot comes back: its settle is queued for this thread
        inside = (list(seen), maps_inode(inode))  # calls: the pending call has run by now
    assert (inside, released_soon(inode), list(seen)) == (([], True), False, [(False, threading.get_ident())])
    a.close()
    b.close()


RELEASED_WHILE_RESERVING = """
import sys
from pathlib import Path
import numafast
from numafast import _process, node_budget
node_budget.LEDGER_DIR = Path(sys.argv[1])
pool = numafast.PinnedPool(0, 4096, 1, lock="off", register="off")
pool.release_with(node_budget.reserve(0, 4096, 1 << 40))
slot = [pool.acquire()]
pool.close()  # with its slot out: released as the slot comes back
book = node_budget.ledger(0)
reserve = book.reserve

def slot_back_while_reserving(nbytes, limit):
    slot.clear()  # as a batch freed here (by the collector, by another thread) gives it back
    return reserve(nbytes, limit)  # a call: the pending call releasing the pool runs here

book.reserve = slot_back_while_reserving
assert node_budget.reserve(0, 4096, 1 << 40) is not None
print(pool._resources.released, _process.reserved, book.mine())
"""


def test_a_pool_released_while_this_thread_reserves_waits_for_the_reservation(ledger_dir: Path) -> None:
    """A closed pool's last slot comes back while the main thread is inside reserve(),
    holding the budget's lock: the release it queues, which gives the pool's share back
    under that lock, runs once the lock is let go (before: the thread waited for itself)."""
    done = subprocess.run([sys.executable, "-c", RELEASED_WHILE_RESERVING, str(ledger_dir)], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout.split()) == (0, ["True", "4096", "4096"]), done.stderr


def test_a_retired_pool_whose_dead_workers_lease_is_reclaimed_is_released_outside_the_mutex(ledger_dir: Path) -> None:
    pytest.importorskip("torch")
    from numafast.pool_worker import PoolView
    from numafast.torch.owner_pools import NodePools

    pools = NodePools(0, 2, lock="off")
    assert pools.make_room(1 << 12, more=False)
    old = pools.pools[0]
    handle = old.share()
    leased, die = os.pipe(), os.pipe()
    worker = os.fork()
    if worker == 0:  # a worker that leases a slot and dies without sending it
        os.write(leased[1], b"1" if PoolView(handle).lease() is not None else b"0")
        os.read(die[0], 1)
        os._exit(0)
    assert os.read(leased[0], 1) == b"1"
    seen = released_under_a_lock(old, pools._mutex._lock._is_owned)  # released while making room: not per batch
    assert pools.make_room(1 << 20, more=False) and old in pools.retired and old.stats().bytes_mapped  # leased
    os.write(die[1], b"x")
    assert os.waitpid(worker, 0)[1] == 0
    for end in (*leased, *die):
        os.close(end)
    # Asked for more room, the pools look at their counters: the dead worker's lease ends, the retired pool goes.
    assert pools.make_room(1 << 12, more=True)
    assert seen == [(False, threading.get_ident())] and old.stats().bytes_mapped == 0
    pools.close()


def test_two_threads_reserving_in_one_process_keep_an_explicit_cap(ledger_dir: Path) -> None:
    cap = node_budget.process_reserved() + 10_000  # what pools of earlier tests still hold, and 10 x 1000
    start = threading.Barrier(4)
    got: list[node_budget.Reservation] = []

    def grab() -> None:
        start.wait(timeout=30)
        for _ in range(200):
            reservation = node_budget.reserve(0, 1000, 1 << 40, cap)
            if reservation is not None:
                got.append(reservation)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(got) == 10 and node_budget.process_reserved() == cap and node_budget.ledger(0).mine() == 10_000
    for reservation in got:
        reservation.release()
    assert node_budget.process_reserved() == cap - 10_000 and node_budget.ledger(0).mine() == 0
