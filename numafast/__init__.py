"""numafast: NUMA placement for deep-learning input pipelines.

The native layer, :mod:`numafast._libnuma`, mirrors libnuma one call to one
function; this package adds validation, policy and typed objects on top.
"""

from __future__ import annotations

from numafast import _libnuma
from numafast.errors import (
    InvalidCpuSetError,
    InvalidNodeError,
    LibnumaError,
    NodeNotAllowedError,
    NumaError,
    NumaUnavailable,
)

# ---------------------------------------------------------------- memory (issue 5)
from numafast.errors import InvalidBufferError, InvalidSizeError, MigrationError, NodeMemoryError
from numafast.memory import MemoryMode, empty, mbind, migrate, zeros
from numafast.pages import PageNodes, Placement, page_nodes, placement

# ---------------------------------------------------------------- end memory

__version__ = "0.1.0"

__all__ = [
    "InvalidCpuSetError",
    "InvalidNodeError",
    "LibnumaError",
    "NodeNotAllowedError",
    "NumaError",
    "NumaUnavailable",
    "numa_available",
    # memory (issue 5)
    "InvalidBufferError",
    "InvalidSizeError",
    "MemoryMode",
    "MigrationError",
    "NodeMemoryError",
    "PageNodes",
    "Placement",
    "empty",
    "mbind",
    "migrate",
    "page_nodes",
    "placement",
    "zeros",
]


def numa_available() -> bool:
    """True when the kernel offers the NUMA system calls (libnuma's numa_available() >= 0).

    Without them (a kernel built without CONFIG_NUMA, or a seccomp profile that
    blocks get_mempolicy) the package still imports; placement calls then raise
    :class:`NumaUnavailable`.
    """
    return _libnuma.available() >= 0
