"""A process that places its threads and memory as told, for ``numafast check`` to audit.

    python3 tests/placed_process.py [--cpu-node N] [--map KIND:MIB:NODE[:lock][:NAME]]...
                                    [--child N]... [--exit-child]

``--cpu-node N`` limits every thread to node N's CPUs. Each ``--map`` makes a fresh
mapping of KIND (``anon``: private anonymous; ``shared``: shared anonymous;
``memfd``: a memfd called NAME; ``shm``: /dev/shm/NAME, unlinked once mapped, as
torch does) and touches every page under a bind policy to NODE (``task``: under the
policy the process was started with), then mlocks it with ``lock``. Each ``--child N``
forks a child that moves to node N's CPUs and touches 4 MiB of its own under a bind
policy to N. The policies are set with set_mempolicy(2) (libnuma's wrapper, through ctypes) around the first
touch only, since a policy acts when a page is first touched.

Prints one JSON line, ``{"pid", "children": [pid...], "maps": [{"kind", "start",
"bytes", "name"}]}``, then waits for stdin to close; the children end with it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
from pathlib import Path

from sysfs_truth import node_cpus

LIBC = ctypes.CDLL(None, use_errno=True)
LIBNUMA = ctypes.CDLL("libnuma.so.1", use_errno=True)  # glibc has no set_mempolicy wrapper
MPOL_BIND = 2
PAGE = mmap.PAGESIZE


def set_mempolicy(mode: int, mask: int) -> None:
    bits = ctypes.c_ulong(mask)
    if LIBNUMA.set_mempolicy(mode, ctypes.byref(bits) if mask else None, 64 if mask else 0) != 0:
        raise OSError(ctypes.get_errno(), "set_mempolicy")


def get_mempolicy() -> tuple[int, int]:
    mode, bits = ctypes.c_int(), ctypes.c_ulong()
    if LIBNUMA.get_mempolicy(ctypes.byref(mode), ctypes.byref(bits), 64, None, 0) != 0:
        raise OSError(ctypes.get_errno(), "get_mempolicy")
    return mode.value, bits.value


def touch_on(buffer: mmap.mmap, node: str) -> None:
    """Write every page, under a bind policy to ``node`` (``task``: the process's own),
    then give the thread its policy back."""
    before = get_mempolicy()
    if node != "task":
        set_mempolicy(MPOL_BIND, 1 << int(node))
    for offset in range(0, len(buffer), PAGE):
        buffer[offset] = 1
    set_mempolicy(*before)


def make_mapping(kind: str, size: int, name: str) -> mmap.mmap:
    if kind == "anon":
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "shared":
        return mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    if kind == "memfd":
        fd = os.memfd_create(name)
    elif kind == "shm":
        path = Path("/dev/shm") / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        path.unlink()
    else:
        raise ValueError(f"mapping kind {kind!r}: not anon, shared, memfd or shm")
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size)
    os.close(fd)
    return mapping


def start_child(node: int, done: tuple[int, int]) -> tuple[int, int]:
    """Fork a child on ``node`` holding 4 MiB there; (its pid, a pipe it writes when ready)."""
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(done[1])  # else the child holds the pipe open and never sees it close
        os.sched_setaffinity(0, node_cpus(node))
        held = make_mapping("anon", 4 << 20, "")
        touch_on(held, str(node))
        os.write(ready_write, b"1")
        os.read(done[0], 1)  # returns at EOF: the parent has ended
        os._exit(0)
    os.close(ready_write)
    return pid, ready_read


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-node", type=int)
    parser.add_argument("--map", action="append", default=[])
    parser.add_argument("--child", type=int, action="append", default=[])
    args = parser.parse_args()
    if args.cpu_node is not None:
        os.sched_setaffinity(0, node_cpus(args.cpu_node))
    done_read, done_write = os.pipe()
    children = [start_child(node, (done_read, done_write)) for node in args.child]
    for _, ready in children:
        assert os.read(ready, 1) == b"1"
    keep: list[mmap.mmap] = []
    maps = []
    for spec in args.map:
        kind, mib, node, *rest = spec.split(":")
        lock = "lock" in rest
        name = next((word for word in rest if word != "lock"), f"placed-{kind}-{len(keep)}")
        mapping = make_mapping(kind, int(mib) << 20, name)
        touch_on(mapping, node)
        start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        if lock and LIBC.mlock(ctypes.c_void_p(start), ctypes.c_size_t(len(mapping))) != 0:
            raise OSError(ctypes.get_errno(), "mlock")
        keep.append(mapping)
        maps.append({"kind": kind, "start": start, "bytes": len(mapping), "name": name, "locked": lock})
    print(json.dumps({"pid": os.getpid(), "children": [pid for pid, _ in children], "maps": maps}), flush=True)
    sys.stdin.read()
    os.close(done_write)
    for pid, _ in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
