"""Exceptions of numafast: each names the problem, the value and what is allowed."""

from __future__ import annotations

from numafast._libnuma import LibnumaError

__all__ = [
    "InvalidBufferError",
    "InvalidCpuSetError",
    "InvalidNodeError",
    "InvalidSizeError",
    "InvalidWeightsError",
    "LibnumaError",
    "MigrationError",
    "NodeMemoryError",
    "NodeNotAllowedError",
    "NumaError",
    "NumaUnavailable",
    "PolicyNotPermitted",
    "PolicyUnsupported",
    # topology and GPU affinity planning
    "InvalidGpuError",
    "PlacementError",
    "TopologyWarning",
    # applying GPU affinity
    "AffinityWarning",
    "LocalRankError",
    # pinned pools
    "CudaUnavailable",
    "MemlockError",
    "LoaderHint",
    "MemlockWarning",
    "PoolClosedError",
    "PoolExhaustedError",
    "PoolForkedError",
    "RegistrationFailed",
    "SlotFull",
    "SlotTooSmallError",
    # loaders
    "SenderDied",
    "WorkerStartError",
]


class NumaError(Exception):
    """Base class of numafast's own errors."""


class NumaUnavailable(NumaError, OSError):
    """The kernel (or a container) offers no NUMA system calls: numa_available() < 0."""


class InvalidNodeError(NumaError, ValueError):
    """A node id that this machine does not have."""


class NodeNotAllowedError(NumaError, PermissionError):
    """A node that exists but that this process's cpuset (cgroup, numactl, taskset) forbids."""


class InvalidCpuSetError(NumaError, ValueError):
    """An empty CPU set, or CPUs this machine does not have or this process may not use."""


# ---------------------------------------------------------------- placement (binding, memory policy)


class PolicyNotPermitted(NumaError, PermissionError):
    """The kernel refused a memory policy or CPU binding with EPERM (seccomp, capabilities)."""


class PolicyUnsupported(NumaError, OSError):
    """This kernel or libnuma does not offer the memory policy asked for (too old, no NUMA)."""


class InvalidWeightsError(NumaError, ValueError):
    """Interleave weights that do not fit the nodes, or that the kernel's weights contradict."""
# ---------------------------------------------------------------- topology and GPU affinity planning


class TopologyWarning(UserWarning):
    """A topology file was damaged or missing (NUL bytes, empty, no cache directory, an
    unmatched CUDA_VISIBLE_DEVICES entry): the answer given is a best effort."""


class InvalidGpuError(NumaError, ValueError):
    """A CUDA device index this topology does not have, or one whose NUMA node is unknown."""


class PlacementError(NumaError, ValueError):
    """A CPU placement that cannot be made: e.g. more GPUs on a node than it has cores."""


# ---------------------------------------------------------------- memory (allocation, mbind, migration)


class InvalidSizeError(NumaError, ValueError):
    """A size or shape that allocates nothing (0 bytes) or is negative."""


class InvalidBufferError(NumaError, ValueError):
    """A buffer numafast cannot place or query: not contiguous, read-only, empty, already
    freed, not in host memory, or holding no whole page."""


class NodeMemoryError(NumaError, MemoryError):
    """A node has too little free memory for a request; the message names the node and its free bytes."""


class MigrationError(NumaError, OSError):
    """Pages the kernel would not move (still busy after retries, shared, no room on the node).

    ``moved`` is how many pages did move; ``stuck`` counts the others by reason.
    """

    def __init__(self, message: str, moved: int, stuck: dict[str, int]):
        super().__init__(message)
        self.moved = moved
        self.stuck = stuck


# ---------------------------------------------------------------- applying GPU affinity


class LocalRankError(NumaError, ValueError):
    """No local rank: none given and no launcher variable set, or one that is not a rank."""


class AffinityWarning(UserWarning):
    """Something in the environment (OpenMP's own pinning) will undo or fight a binding."""


# ---------------------------------------------------------------- pinned pools


class PoolClosedError(NumaError, RuntimeError):
    """A pinned pool used after close() (or its context) ended."""


class PoolForkedError(NumaError, RuntimeError):
    """A pinned pool used in a forked child: its memory belongs to the parent; the child
    only reads the slots it inherited, through a private copy-on-write view."""


class PoolExhaustedError(NumaError, TimeoutError):
    """Every slot of a pinned pool is in use and none came back in time."""


class SlotTooSmallError(NumaError, ValueError):
    """A request or a batch larger than a pool slot; the message names both sizes."""


class MemlockError(NumaError, MemoryError):
    """The kernel refused to page-lock memory (RLIMIT_MEMLOCK without CAP_IPC_LOCK);
    the message names the limit and how to raise it."""


class MemlockWarning(UserWarning):
    """A pool that locks on a best-effort basis (lock='best-effort', or 'auto' where a GPU
    is usable) could not: it goes on with unlocked memory."""


class LoaderHint(UserWarning):
    """A NumaLoader set up so that numafast can do little for it (batches of one sample,
    no workers): what the speed-up needs. Said once per process for each kind."""


class CudaUnavailable(NumaError, RuntimeError):
    """CUDA was asked for (a CUDA device, register='required') but PyTorch with a usable GPU is not here."""


class RegistrationFailed(RuntimeError):
    """cudaHostRegister refused a piece of the memory; the pieces before it were unregistered."""


class SlotFull(Exception):
    """The batch does not fit in the slot: numafast's own signal between the layout engine
    and its callers (the batch then goes as torch would send it), never the user's."""


# ---------------------------------------------------------------- loaders


class SenderDied(RuntimeError):
    """A batch whose DataLoader worker died after sending it: the owner ended the dead
    worker's leases, this batch's slot among them, so it cannot be read."""


class WorkerStartError(RuntimeError):
    """A DataLoader worker never started (stuck in ``os.fork()``) and could not be replaced."""
