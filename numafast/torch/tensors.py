"""Node-local torch tensors: numafast.torch.empty / zeros, over memory numafast maps.

The tensor is a zero-copy view (torch.frombuffer) of the same node-bound, pre-faulted
memory as :func:`numafast.empty`, which it keeps alive.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from numafast.memory import allocate, check_shape

__all__ = ["empty", "zeros"]


def empty(
    *size: int | Sequence[int],
    dtype: torch.dtype | str | None = None,
    node: int | None = None,
    nodes: Iterable[int] | None = None,
    hugepages: bool = True,
) -> torch.Tensor:
    """A new contiguous CPU tensor whose pages are all on ``node`` (or interleaved over
    ``nodes`` as :func:`numafast.empty` spreads them; default: the calling thread's
    node), faulted in and ready to use. Its contents are zero.

    ``size`` as for torch.empty (``empty(2, 3)`` or ``empty((2, 3))``); ``dtype`` a
    torch.dtype or its name ("float32", "torch.uint8"), by default torch.get_default_dtype().
    """
    shape = check_shape(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
    checked = torch.get_default_dtype() if dtype is None else _dtype(dtype)
    count = math.prod(shape)
    buffer = allocate(count * checked.itemsize, node=node, nodes=nodes, hugepages=hugepages)
    # The tensor holds the memoryview, which holds an export of the buffer: the
    # memory outlives every tensor and view made from it.
    return torch.frombuffer(memoryview(buffer), dtype=checked, count=count).view(shape)


# Fresh anonymous pages are zero: empty's tensor is zeros' already, no second pass needed.
zeros = empty


def _dtype(dtype: object) -> torch.dtype:
    """A torch.dtype, or one named as torch names it ("float32", "torch.float32")."""
    named = dtype if isinstance(dtype, torch.dtype) else None
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        named = found if isinstance(found, torch.dtype) else None
    if named in _QUANTIZED:  # torch.frombuffer of one crashes the process
        raise TypeError(
            f"dtype {named} is quantized: its tensors carry a scale and zero point, which raw memory does not; "
            "make a float tensor here and quantize it (torch.quantize_per_tensor)"
        )
    if named is not None:
        return named
    raise TypeError(
        f"dtype {dtype!r} is not a torch dtype; give a torch.dtype or its name: "
        "'float32', 'float16', 'bfloat16', 'float64', 'uint8', 'int8', 'int32', 'int64', 'bool', ..."
    )


_QUANTIZED = {getattr(torch, name) for name in ("quint8", "qint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, name)}
