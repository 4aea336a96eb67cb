"""Which class of memory a mapping holds, and what it probably is.

Classes, most important first: ``page_locked`` memory is the host side of every
copy to a GPU, and once registered for DMA it cannot migrate; ``shared`` memory
is where DataLoader workers hand tensors over (torch's /dev/shm files,
numafast's memfd pools); ``anonymous`` is the heap and the rest of a
process's private data. Mapped files (libraries, datasets read through mmap)
belong to none: they live in the page cache on whichever node first read them,
shared by every process, and no binding of one process places them.
"""

from __future__ import annotations

from enum import Enum

from numafast.cli.check.procfs import Mapping


class MemoryClass(str, Enum):
    PAGE_LOCKED = "page_locked"
    SHARED = "shared"
    ANONYMOUS = "anonymous"

    @property
    def display(self) -> str:
        """How the text output names the class."""
        return {"page_locked": "page-locked", "shared": "shared", "anonymous": "anonymous"}[self.value]


# Shared memory (shmem/tmpfs) as numa_maps names it: POSIX shm, memfd, System V
# segments, and shared anonymous memory, which the kernel backs by a deleted /dev/zero.
SHARED_MEMORY_PREFIXES = ("/dev/shm/", "/memfd:", "/SYSV")
SHARED_ANONYMOUS = "/dev/zero (deleted)"

# Names that tell what a shared mapping is: numafast's pools are memfds named
# "numafast..."; torch (2.13 seen) moves tensors between processes in
# /dev/shm/torch_PID_... files, under both sharing strategies (file_descriptor
# unlinks them at once: "/dev/shm/torch_... (deleted)").
LABELS = (
    ("/memfd:numafast", "numafast pool"),
    ("/dev/shm/torch_", "torch shared tensor"),
)


def is_shared_memory(path: str) -> bool:
    return path.startswith(SHARED_MEMORY_PREFIXES) or path == SHARED_ANONYMOUS


def classify(mapping: Mapping) -> MemoryClass | None:
    """The mapping's class; None for a mapped file's page cache."""
    if mapping.path is not None and not is_shared_memory(mapping.path):
        return None
    if mapping.locked:
        return MemoryClass.PAGE_LOCKED
    if mapping.path is not None:
        return MemoryClass.SHARED
    return MemoryClass.ANONYMOUS


def label(mapping: Mapping) -> str:
    """What the mapping probably is: a numafast pool, a torch tensor, or its kind of memory."""
    path = mapping.path
    if path is None:
        return "anonymous"
    for prefix, name in LABELS:
        if path.startswith(prefix):
            return name
    if path == SHARED_ANONYMOUS:
        return "shared anonymous"
    if path.startswith("/memfd:"):
        return "memfd"
    if path.startswith("/SYSV"):
        return "System V shared memory"
    return "/dev/shm file"
