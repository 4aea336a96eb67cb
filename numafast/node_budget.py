"""The pinned memory of a node, budgeted for every numafast process on it.

Locked pages cannot be swapped: ranks that each lock a share of a node's memory may
lock all of it together, and the node stalls. So the loader pools of every process
of one user on a node grow within one budget (:func:`budget_bytes`: a quarter of
the node's memory, or of the cgroup's limit where lower), kept in a small shared
file per node (:data:`LEDGER_DIR`): an entry per process, its identity (pid and start
time) and the bytes its pools hold. A process reserves before it maps a pool and
releases once the pool's memory is unmapped; a dead process's bytes stop counting
as soon as another process sees it gone (its entry is reused).

NOTE: lock-free. A process adds its bytes to its own entry first and only then sums
every live entry: two processes reserving at once each see at least the other's
addition (the words are sequentially consistent, src/pool.pxi), so one of them
backs off and the budget is never overshot; nothing waits on a process that may
be stopped or dead, and a process killed at any step leaves only its own entry.
The file is per user (it is created mode 0600) and per PID namespace (its pids
mean nothing in another): processes apart in either do not share a budget.
"""

from __future__ import annotations

import errno
import os
import random
import stat
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import cast

from numafast import _libnuma, _process
from numafast.topo.files import read_lines, read_text

__all__ = ["LEDGER_DIR", "NodeLedger", "Reservation", "budget_bytes", "cgroup_memory_limit", "ledger", "reserve"]

# The budget is this share of the node's memory (or of the cgroup's limit where lower).
SHARE = 4
# Where each node's ledger is: tmpfs, gone at reboot, shared by the processes of a container.
LEDGER_DIR = Path("/dev/shm")
# Entries of a ledger (16 bytes each: who, bytes): the processes of a user on a node at once.
ENTRIES = 512
LEDGER_BYTES = ENTRIES * 16
# How often a reservation that met another one being made at once is tried again, with a
# pause of up to this long between tries.
_ATTEMPTS = 8
_PAUSE_S = 0.002
# cgroup v1 writes "no limit" as LONG_MAX rounded down to pages: anything this large.
_UNLIMITED = 1 << 62
_LOW_32 = 0xFFFFFFFF


def cgroup_memory_limit(root: Path = Path("/")) -> int | None:
    """The lowest memory limit on this process's cgroup and its ancestors (cgroup v2
    ``memory.max``, v1 ``memory.limit_in_bytes``); None when there is none. ``root``
    is where ``proc`` and ``sys`` are (a snapshot's, in tests). Inside a container
    without a cgroup namespace, the process's path names a host directory that is not
    mounted there: the mount's root, the container's own cgroup, is read instead."""
    paths = _cgroup_paths(root)
    limits = []
    for mount, key, name in _memory_mounts(root):
        if key in paths:
            limits += _limits_up(root, mount, paths[key], name)
    return min(limits, default=None)


def _cgroup_paths(root: Path) -> dict[str, str]:
    """This process's cgroup path by hierarchy: "" for v2, "memory" for v1's memory controller."""
    paths = {}
    for line in read_lines(root / "proc/self/cgroup") or []:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            paths[""] = path
        elif "memory" in controllers.split(","):
            paths["memory"] = path
    return paths


def _memory_mounts(root: Path) -> list[tuple[Path, str, str]]:
    """(mount point, hierarchy as in :func:`_cgroup_paths`, limit file) of each cgroup
    hierarchy that may hold a memory limit, from ``proc/mounts``."""
    found = []
    for line in read_lines(root / "proc/mounts") or []:
        words = line.split()
        if len(words) < 4:
            continue
        if words[2] == "cgroup2":
            found.append((Path(words[1]), "", "memory.max"))
        elif words[2] == "cgroup" and "memory" in words[3].split(","):
            found.append((Path(words[1]), "memory", "memory.limit_in_bytes"))
    return found


def _limits_up(root: Path, mount: Path, cgroup: str, name: str) -> list[int]:
    """The limits in file ``name`` from ``cgroup``'s directory up to the mount's root."""
    base = root / mount.relative_to(mount.anchor)
    directory = base / PurePosixPath(cgroup).relative_to("/") if cgroup.startswith("/") else base
    if not directory.is_dir():
        directory = base
    limits = []
    while True:
        text = read_text(directory / name)
        if text and text.isdigit() and int(text) < _UNLIMITED:  # "max" (v2) or LONG_MAX (v1): none
            limits.append(int(text))
        if directory == base or base not in directory.parents:
            return limits
        directory = directory.parent


def budget_bytes(node: int, *, floor: int = 1, root: Path = Path("/")) -> int:
    """The pinned budget of ``node``: a :data:`SHARE` of its memory, or of this process's
    cgroup limit where lower (locking more than that would leave the cgroup's own work
    no room, and the OOM killer would pick from it); at least ``floor``. ``root``: see
    :func:`cgroup_memory_limit`. Per node: a process with pools on two nodes may hold
    each one's budget."""
    memory = _libnuma.node_size64(node)[0]
    limit = cgroup_memory_limit(root)
    return max(min(memory, limit if limit is not None else memory) // SHARE, floor)


def _identity(pid: int, started: int) -> int:
    """An entry's owner: its pid and start time (modulo 2**32: ~497 days of ticks)."""
    return pid << 32 | started & _LOW_32


class NodeLedger:
    """The shared ledger of ``node`` at ``path``: entry ``i`` is words ``2i`` (who:
    :func:`_identity`, 0 when free) and ``2i + 1`` (the bytes its process reserved)."""

    def __init__(self, node: int, path: Path | None) -> None:
        self.node = node
        self.path = path
        self.memory = _map(path)
        self._entry: int | None = None
        self._entry_pid = 0
        self._claiming = threading.Lock()

    # ------------------------------------------------------------ reading

    def entries(self) -> list[tuple[int, int, int]]:
        """(index, pid, bytes) of every entry of a live process; a dead process's entry
        is freed as it is seen (its pages were unlocked when it died)."""
        live = []
        for index in range(ENTRIES):
            who = _libnuma.shared_load(self.memory, 2 * index)
            if who and (who == self._mine() or _alive(who)):
                live.append((index, who >> 32, _libnuma.shared_load(self.memory, 2 * index + 1)))
            elif who:
                _libnuma.shared_cas(self.memory, 2 * index, who, 0)
        return live

    def total(self) -> int:
        """Bytes reserved by every live process."""
        return sum(nbytes for _, _, nbytes in self.entries())

    def mine(self) -> int:
        """Bytes reserved by this process."""
        entry = self._entry if self._entry_pid == _process.pid else None
        return 0 if entry is None else _libnuma.shared_load(self.memory, 2 * entry + 1)

    # ------------------------------------------------------------ changing

    def reserve(self, nbytes: int, limit: int) -> bool:
        """Add ``nbytes`` to this process's entry if every live process's together stay
        within ``limit``; False when they would not (see the NOTE at the top)."""
        entry = self._claim()
        if entry is None:
            return False
        for _attempt in range(_ATTEMPTS):
            _libnuma.shared_add(self.memory, 2 * entry + 1, nbytes)
            if self.total() <= limit:
                return True
            _libnuma.shared_add(self.memory, 2 * entry + 1, -nbytes)
            # Over: for good, or only while another process's reservation is being made.
            time.sleep(random.uniform(0, _PAUSE_S))
            if self.total() + nbytes > limit:
                return False
        return False

    def release(self, nbytes: int) -> None:
        """Take ``nbytes`` that this process reserved off its entry."""
        if self._entry is not None and self._entry_pid == _process.pid:
            _libnuma.shared_add(self.memory, 2 * self._entry + 1, -nbytes)

    def _mine(self) -> int:
        return _identity(_process.pid, _process.started()) if self._entry_pid == _process.pid else -1

    def _claim(self) -> int | None:
        """This process's entry: a free one or a dead process's, taken with one
        compare-and-swap; None when every entry is a live process's."""
        with self._claiming:
            if self._entry is not None and self._entry_pid == _process.pid:
                return self._entry
            me = _identity(_process.pid, _process.started())
            for index in range(ENTRIES):
                who = _libnuma.shared_load(self.memory, 2 * index)
                if (not who or who != me and not _alive(who)) and _libnuma.shared_cas(self.memory, 2 * index, who, me):
                    # Its bytes are the dead owner's until zeroed: counted as this process's
                    # meanwhile, which only refuses more than it must.
                    stale = _libnuma.shared_load(self.memory, 2 * index + 1)
                    _libnuma.shared_add(self.memory, 2 * index + 1, -stale)
                    self._entry, self._entry_pid = index, _process.pid
                    return index
        return None


def _alive(who: int) -> bool:
    """Whether the process an entry names still runs; True where /proc cannot tell."""
    try:
        started = _process.start_time(who >> 32)
    except OSError:
        return True
    return started is not None and started & _LOW_32 == who & _LOW_32


def _map(path: Path | None) -> _libnuma.MappedBuffer:
    """The ledger at ``path`` mapped shared, made if missing; this process's own memory
    where ``path`` is None. Mapped by numafast's extension, which keeps no descriptor
    (Python's mmap keeps a copy of one, which a forked child that closed its inherited
    descriptors and opened files of its own would close under one of them)."""
    if path is None:
        return _libnuma.mmap_anonymous(LEDGER_BYTES)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode) or info.st_mode & 0o022:
            raise OSError(errno.EPERM, "not a regular file of this user's that only it may write", str(path))
        if info.st_size < LEDGER_BYTES:  # made now (two processes making it both grow it the same)
            os.ftruncate(fd, LEDGER_BYTES)
        return _libnuma.mmap_shared(LEDGER_BYTES, fd)
    finally:
        os.close(fd)


def _ledger_path(node: int) -> Path:
    """This user's ledger of ``node`` in this PID namespace."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return LEDGER_DIR / f"numafast-pinned-v1-uid{os.getuid()}-pidns{namespace}-node{node}"


# Each node's ledger, opened once: kept in numafast/_process.py, like what this process reserved.
_ledgers = cast("dict[tuple[int, Path], NodeLedger]", _process.ledgers)


def ledger(node: int) -> NodeLedger:
    """``node``'s ledger (under :data:`LEDGER_DIR` as it is now). Where the file cannot be
    opened, one of this process's own, said once: the budget then bounds this process alone."""
    path = _ledger_path(node)
    with _process.ledgers_mutex:
        known = _ledgers.get((node, path))
        if known is None:
            try:
                known = NodeLedger(node, path)
            except OSError as error:
                known = NodeLedger(node, None)
                if _process.first_time("unshared ledger"):
                    warnings.warn(
                        f"numafast: the pinned memory budget of node {node} cannot be shared with the other "
                        f"processes on it ({error}): this process's loader pools keep within it alone. Make "
                        f"{LEDGER_DIR} a writable tmpfs (docker run --shm-size)", RuntimeWarning, stacklevel=4,
                    )
            _ledgers[(node, path)] = known
        return known


@dataclass
class Reservation:
    """Bytes reserved on a node's ledger (and against this process's cap) for one pool:
    released once, by the process that reserved them, when the pool's memory is gone."""

    book: NodeLedger
    nbytes: int
    owner_pid: int
    released: bool = False

    def release(self) -> None:
        if self.released or self.owner_pid != _process.pid:
            return
        self.released = True
        self.book.release(self.nbytes)
        with _process.reserved_mutex:
            _process.reserved -= self.nbytes


def process_reserved() -> int:
    """Bytes this process reserved, on every node, for pools not released yet."""
    return _process.reserved


def reserve(node: int, nbytes: int, limit: int, cap: int | None = None) -> Reservation | None:
    """``nbytes`` for a pool on ``node``, within the node's budget ``limit`` for every
    process and, where given, within ``cap`` for this process's pools on every node;
    None when either would be overshot."""
    book = ledger(node)
    with _process.reserved_mutex:  # two loaders of this process: one checks and adds at a time
        if cap is not None and _process.reserved + nbytes > cap:
            return None
        if not book.reserve(nbytes, limit):
            return None
        _process.reserved += nbytes
    return Reservation(book, nbytes, _process.pid)
