"""Node-local torch tensors: numafast.torch.empty / zeros, over memory numafast maps.

The tensor is a zero-copy view (torch.frombuffer) of the same node-bound, pre-faulted
memory as :func:`numafast.empty`, which it keeps alive. Importing numafast never
imports torch; importing this module does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from numafast.memory import allocate, check_shape

__all__ = ["empty", "zeros"]


def empty(
    *size: int | Sequence[int],
    dtype: torch.dtype | None = None,
    node: int | None = None,
    nodes: Iterable[int] | None = None,
    hugepages: bool = True,
) -> torch.Tensor:
    """A new contiguous CPU tensor whose pages are all on ``node`` (or interleaved over
    ``nodes``; default: the calling thread's node), faulted in and ready to use.

    ``size`` as for torch.empty (``empty(2, 3)`` or ``empty((2, 3))``); ``dtype``
    defaults to torch.get_default_dtype(). Its contents are zero. Interleaved
    memory is spread as :func:`numafast.empty` spreads it: each node gets its
    share to within one base page, whatever the size.
    """
    shape = _shape(size)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    count = math.prod(shape)
    buffer = allocate(count * dtype.itemsize, node=node, nodes=nodes, hugepages=hugepages)
    # The tensor holds the memoryview, which holds an export of the buffer: the
    # memory outlives every tensor and view made from it.
    return torch.frombuffer(memoryview(buffer), dtype=dtype, count=count).view(shape)


def zeros(
    *size: int | Sequence[int],
    dtype: torch.dtype | None = None,
    node: int | None = None,
    nodes: Iterable[int] | None = None,
    hugepages: bool = True,
) -> torch.Tensor:
    """Like :func:`empty`: fresh anonymous pages are zero, so no second pass is needed."""
    return empty(*size, dtype=dtype, node=node, nodes=nodes, hugepages=hugepages)


def _shape(size: tuple[int | Sequence[int], ...]) -> tuple[int, ...]:
    """torch's two spellings, ``(2, 3)`` and ``((2, 3),)``, as one shape."""
    return check_shape(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)  # type: ignore[arg-type]
