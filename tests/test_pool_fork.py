"""Fork and the pools: a child forked by another thread at any step of a pool's
making views it privately; a child that cannot is stopped, saying why; a child
never touches its parent's mutex or condition variable; a lease is its process's,
not its pid's, which the kernel gives again to a later process.

What the child's mappings are is read from /proc/self/maps in the child; whether a
process runs, and since when, from /proc/PID/stat.
"""

from __future__ import annotations

import errno
import gc
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import numafast
from numafast import _libnuma, _process, pool as pool_module
from numafast.pool_worker import PoolView
from sysfs_truth import online_nodes

TESTS = Path(__file__).resolve().parent
NODES = online_nodes()
MIB = 1 << 20


def pool_mappings() -> list[str]:
    """The permissions of each mapping of a pool's memfd in this process."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [line.split()[1] for line in lines if "/memfd:numafast-pool-node" in line]


def pool_mappings_of_a_child() -> list[str]:
    """:func:`pool_mappings` as a child forked now sees them, after the at-fork handlers."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.write(write_end, " ".join(pool_mappings()).encode() or b"none")
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    report = os.read(read_end, 4096).decode().split()
    os.close(read_end)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return [] if report == ["none"] else report


def fork_from_another_thread_at(owner: Any, name: str, make: Callable[[], object]) -> tuple[list[str], object]:
    """Run ``make()`` in a thread; when it calls ``owner.name`` (a step of a pool's
    making), this thread forks right before that step runs, while the making thread
    waits. Returns the permissions of the pool mappings the child had after the
    at-fork handlers (the child reports them, then ends), and what ``make`` made."""
    real = getattr(owner, name)
    at_step, forked = threading.Event(), threading.Event()
    made: list[object] = []

    def step(*args: object, **kwargs: object) -> object:
        if not at_step.is_set():
            at_step.set()
            forked.wait(60)  # releases the GIL: the other thread forks now
        return real(*args, **kwargs)

    def making() -> None:
        made.append(make())

    setattr(owner, name, step)
    try:
        thread = threading.Thread(target=making)
        thread.start()
        assert at_step.wait(60)
        report = pool_mappings_of_a_child()  # only this thread is there
    finally:
        forked.set()
        thread.join(60)
        setattr(owner, name, real)
    return report, made[0]


# The steps of PinnedPool's making, each of which lets go of the GIL: a child may be
# forked by another thread (a DataLoader's iter()) at any of them.
STEPS = {
    "before the memfd is mapped": (pool_module, "allocate"),
    "mapped, inside allocate": (_libnuma, "mbind"),  # allocate() binds the mapping it has just made
    "mapped, before it is locked": (_libnuma, "mlock"),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_child_forked_while_another_thread_makes_a_pool_views_it_privately(step: str) -> None:
    before = pool_mappings()
    owner, name = STEPS[step]
    make = lambda: numafast.PinnedPool(NODES[0], MIB, 2, lock="best-effort")  # noqa: E731 - locks without a GPU too
    mappings, pool = fork_from_another_thread_at(owner, name, make)
    assert isinstance(pool, numafast.PinnedPool)
    try:
        assert not [perms for perms in mappings if perms[3] == "s"], mappings  # no shared view in the child
        expected = len(before) + (0 if step == "before the memfd is mapped" else 1)
        assert len(mappings) == expected, (before, mappings)  # the pool being made is there, privately
        assert pool_mappings().count("rw-s") == before.count("rw-s") + 1  # the parent's own stays shared
        slot = pool.acquire()
        np.asarray(slot)[:] = 3
        del slot
    finally:
        pool.close()


def test_a_child_forked_while_a_pools_slots_outlive_it_views_them_privately() -> None:
    """A pool object dropped while an array still views a slot: its memory lives on, and a
    forked child must still see it privately."""
    array = np.asarray(numafast.PinnedPool(NODES[0], MIB, 2).acquire())
    gc.collect()
    report = pool_mappings_of_a_child()
    assert report and not [perms for perms in report if perms[3] == "s"], report
    del array


FAILING_REMAP = """
import os, resource, sys
import numafast
pool = numafast.PinnedPool(0, 1 << 20, 2, lock="off")
soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
# Below what this process already maps privately: the kernel refuses the child's
# private, writable remap of the pool (ENOMEM), as it does under strict overcommit.
resource.setrlimit(resource.RLIMIT_DATA, (4096, hard))
pid = os.fork()
if pid == 0:
    os.write(1, b"the child ran its own code\\n")
    os._exit(0)
resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
print("child status", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
slot = pool.acquire()  # the parent goes on
print("parent acquired slot", slot.index, flush=True)
"""


@pytest.mark.host_only("a Python child: the remap fails the same way on any kernel")
def test_a_child_that_cannot_view_a_pool_privately_ends_saying_why() -> None:
    result = subprocess.run([sys.executable, "-c", FAILING_REMAP], capture_output=True, text=True, timeout=120,
                            cwd=TESTS.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"child status {pool_module.FORK_REMAP_FAILED_STATUS}",
                                          "parent acquired slot 0"], result.stdout  # fmt: skip
    assert "cannot make its view of the node-0 pool private" in result.stderr, result.stderr
    assert "Cannot allocate memory" in result.stderr and "exits now with status 70" in result.stderr, result.stderr


def test_a_forked_child_leaves_its_parents_mutex_and_waiters_alone() -> None:
    """A thread of the parent waits for a slot (on the pool's condition variable) as the
    child is forked. The child closes and drops its copy of the pool: it must not lock
    the mutex, broadcast or destroy the condition (glibc's destroy would wait for the
    copied waiter, which never leaves), and must end at once; the parent's waiter
    gets the slot that comes back."""
    pool = numafast.PinnedPool(NODES[0], 4096, 1)
    held = pool.acquire()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=30).index))
    waiter.start()
    deadline = time.monotonic() + 10
    while not pool.stats().waits and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pool.stats().waits == 1
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            pool.close()
            pool.close()
            with pytest.raises(numafast.PoolForkedError):
                pool.acquire()
            code = 0
        finally:
            os._exit(code)  # the child's copies of the pool are dropped at exit, unreleased
    started = time.monotonic()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and time.monotonic() - started < 10
    del held
    waiter.join(10)
    assert got == [0] and not pool.closed
    pool.close()


def descriptors_naming(part: str) -> list[int]:
    """This process's descriptors whose file's name holds ``part``."""
    named = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if part in os.readlink(f"/proc/self/fd/{fd}"):
                named.append(fd)
        except OSError:
            pass  # the one listing the directory, closed by now
    return named


def same_file(fd: int, other: int) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.fstat(other))
    except OSError:
        return False  # closed


def test_a_child_that_reused_a_boards_descriptor_numbers_keeps_its_own_files(tmp_path: Path) -> None:
    """A forked child closes the descriptors it inherited (as a daemon does) and opens a
    file of its own under each number that the loader's pool board held. Dropping the
    board it inherited must leave those files open: only the board's own file is closed."""
    from numafast.pool_owner import PoolBoard

    board = PoolBoard()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            log = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT)
            taken = descriptors_naming("numafast-pool-board")
            for fd in taken:
                os.dup2(log, fd)  # closes the inherited one, the number now the child's file
            board.close()
            del board
            gc.collect()
            kept = [fd for fd in taken if same_file(fd, log)]
            os.write(write_end, f"{len(taken)} {len(kept)}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as said:
        taken, kept = said.read().split()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 and int(taken) >= 1 and kept == taken
    board.close()


# ---------------------------------------------------------------- leases and pids


def lease_and_die(handle: Any) -> int:
    """Fork a process that leases a slot and is killed holding it; its pid, reaped."""
    pid = os.fork()
    if pid == 0:
        try:
            if PoolView(handle).lease() is not None:
                os.kill(os.getpid(), 9)
        finally:
            os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -9
    return pid


def test_a_lease_whose_pid_names_another_process_now_is_ended() -> None:
    """The lease of a process that died, whose pid the table now names a live process
    by (the kernel reuses pids): that process started at another time, so the lease is
    not its, and reclaim_orphans ends it. A live leaser's lease stays, also while its
    start time is not yet recorded (the moment after its compare-and-swap)."""
    with numafast.PinnedPool(NODES[0], 4096, 3) as pool:
        handle = pool.share()
        dead = lease_and_die(handle)
        table = pool._slots.table
        (index, generation, pid, started), = table.leases()
        assert pid == dead and started >= 0
        words = np.frombuffer(pool._resources.region, dtype=np.uint64, count=table.header_bytes // 8)
        # This process (started well before the leaser) now has the leaser's pid, as a
        # process the kernel gives the same pid would.
        words[8 + index] = words[8 + index] & ~np.uint64(0xFFFFFFFF) | np.uint64(os.getpid())
        assert table.leases() == [(index, generation, os.getpid(), started)]
        assert _process.start_time(os.getpid()) != started
        assert pool.reclaim_orphans() == 1 and table.leases() == []

        go_read, go_write = os.pipe()
        lease_read, lease_write = os.pipe()
        live = os.fork()
        if live == 0:  # leases, says so, and lives until told
            try:
                lease = PoolView(handle).lease()
                os.write(lease_write, b"leased" if lease else b"none")
                os.read(go_read, 1)
            finally:
                os._exit(0)
        assert os.read(lease_read, 10) == b"leased"
        (index, generation, pid, started), = table.leases()
        assert (pid, started) == (live, _process.start_time(live))
        assert pool.reclaim_orphans() == 0  # alive, and the same process
        words[8 + table.count + index] = 0  # as in the instant before the leaser records its start
        assert table.leases() == [(index, generation, live, -1)]
        assert pool.reclaim_orphans() == 0  # a live pid with no start recorded yet: alive
        os.write(go_write, b"x")
        assert os.waitstatus_to_exitcode(os.waitpid(live, 0)[1]) == 0
        assert pool.reclaim_orphans() == 1  # gone: ended whatever its record says
        for fd in (go_read, go_write, lease_read, lease_write):
            os.close(fd)
        del words


NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def test_a_lease_whose_pid_the_kernel_gave_to_a_new_process_is_ended() -> None:
    """The real thing: the leaser dies, and the kernel gives its pid to a new process
    (asked to with ns_last_pid, which needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)."""
    if not os.access(NS_LAST_PID, os.W_OK):
        pytest.skip(f"{NS_LAST_PID} is not writable here: a pid cannot be asked for")
    with numafast.PinnedPool(NODES[0], 4096, 2) as pool:
        dead = lease_and_die(pool.share())
        # A start time counts clock ticks (10 ms at USER_HZ 100): a pid that the kernel
        # gives again by itself comes round only after every other pid (pid_max), never
        # in the tick its first process started; asked for at once, it could.
        time.sleep(0.05)
        go_read, go_write = os.pipe()
        for _ in range(50):  # another process on the machine may take the pid first
            try:
                NS_LAST_PID.write_text(str(dead - 1))
            except OSError as error:
                pytest.skip(f"writing {NS_LAST_PID}: {error}")
            again = os.fork()
            if again == 0:
                try:
                    os.read(go_read, 1)
                finally:
                    os._exit(0)
            if again == dead:
                break
            os.kill(again, 9)
            os.waitpid(again, 0)
        else:
            pytest.skip(f"the kernel never gave pid {dead} again in 50 tries")
        try:
            assert _process.start_time(dead) is not None  # the pid runs again: a new process
            assert pool.reclaim_orphans() == 1 and pool._slots.table.leases() == []
        finally:
            os.write(go_write, b"x")
            os.waitpid(again, 0)
            os.close(go_read)
            os.close(go_write)


def test_start_times_tell_processes_apart_and_a_zombie_is_not_running() -> None:
    assert _process.start_time("self") == _process.started() == _process.start_time(os.getpid())
    assert _process.start_time(os.getppid()) is not None
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _process.start_time(pid) is None  # dead, not yet reaped
    os.waitpid(pid, 0)
    assert _process.start_time(pid) is None
    parent_started = _process.started()  # read, and kept, before the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write_end, f"{_process.started()} {_process.start_time('self')}".encode())
        finally:
            os._exit(0)
    cached, fresh = map(int, os.read(read_end, 100).split())
    os.waitpid(pid, 0)
    assert cached == fresh != parent_started  # the child's own (this process started seconds before it)
    os.close(read_end)
    os.close(write_end)


def fds_used_up() -> list[int]:
    """Descriptors opened until this process may open no more (EMFILE), to close after."""
    opened: list[int] = []
    try:
        while True:
            opened.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as error:
        assert error.errno == errno.EMFILE, error
    return opened


def test_a_live_workers_lease_stays_while_proc_cannot_be_read() -> None:
    """Only ENOENT/ESRCH say a process is gone. Out of descriptors (a consumer keeping
    every batch under `ulimit -n 128`), /proc/PID/stat cannot be opened: the live
    leaser's slot must stay leased, never be handed out for a second batch."""
    with numafast.PinnedPool(NODES[0], 4096, 2) as pool:
        handle = pool.share()
        go_read, go_write = os.pipe()
        lease_read, lease_write = os.pipe()
        live = os.fork()
        if live == 0:  # leases, says so, and lives until told
            try:
                os.close(lease_read)
                os.write(lease_write, b"leased" if PoolView(handle).lease() else b"none")
                os.read(go_read, 1)
            finally:
                os._exit(0)
        os.close(lease_write)  # the child's copy alone: a child that fails is read as EOF
        try:
            assert os.read(lease_read, 10) == b"leased"
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
            filler = fds_used_up()
            try:
                with pytest.raises(OSError) as error:
                    _process.start_time(live)
                freed = pool.reclaim_orphans()
            finally:
                for fd in filler:
                    os.close(fd)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert error.value.errno == errno.EMFILE
            assert freed == 0 and len(pool._slots.table.leases()) == 1
            assert _process.start_time(live) is not None
        finally:
            os.write(go_write, b"x")
            os.waitpid(live, 0)
            for fd in (go_read, go_write, lease_read):
                os.close(fd)
        assert pool.reclaim_orphans() == 1  # gone now, and /proc says so
