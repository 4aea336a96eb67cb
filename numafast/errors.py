"""Exceptions of numafast: each names the problem, the value and what is allowed."""

from __future__ import annotations

from numafast._libnuma import LibnumaError

__all__ = ["LibnumaError", "NumaError", "NumaUnavailable"]


class NumaError(Exception):
    """Base class of numafast's own errors."""


class NumaUnavailable(NumaError, OSError):
    """The kernel (or a container) offers no NUMA system calls: numa_available() < 0."""
