"""Any buffer as a flat array of its bytes: the one form the memory calls take.

NumPy arrays, torch CPU tensors, bytearray, memoryview, mmap and numafast's own
MappedBuffer all become a 1-D ``uint8`` NumPy array over the same memory (never a
copy). Holding that array holds the exporter's buffer, so the memory cannot be
freed or resized while a call works on it. torch is looked up, never imported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from numafast import _libnuma
from numafast.errors import InvalidBufferError

PAGE_SIZE = _libnuma.pagesize()


def flat_bytes(obj: object, *, writable: bool) -> np.ndarray:
    """``obj``'s memory as a 1-D uint8 array (no copy).

    Writable use needs a writable, C-contiguous buffer; a query takes any contiguous
    one. Raises InvalidBufferError for anything else, naming what is wrong.
    """
    name = type(obj).__name__
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        obj = _tensor_bytes(obj)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidBufferError(f"a {name} does not expose its memory (no buffer protocol)") from None
    except ValueError as error:  # a released memoryview, a closed mmap, a freed MappedBuffer
        raise InvalidBufferError(f"the memory of this {name} is gone: {error}") from None
    if view.nbytes == 0:
        raise InvalidBufferError(f"this {name} is empty (0 bytes)")
    if writable and view.readonly:
        raise InvalidBufferError(f"this {name} is read-only; placing memory needs a writable buffer")
    if not view.c_contiguous and (writable or not view.contiguous):
        raise InvalidBufferError(
            f"this {name} is not C-contiguous (a strided view?); pass its base, "
            "or a contiguous copy (numpy.ascontiguousarray)"
        )
    if view.c_contiguous:
        return np.frombuffer(view, dtype=np.uint8)
    return np.asarray(view).ravel(order="K").view(np.uint8)  # Fortran order: still one span


def _tensor_bytes(tensor: object) -> object:
    """A torch tensor's memory as a NumPy uint8 array, if it is a dense CPU tensor."""
    torch = sys.modules["torch"]
    assert isinstance(tensor, torch.Tensor)
    if tensor.device.type != "cpu":
        raise InvalidBufferError(f"a tensor on {tensor.device} is not in host memory")
    if tensor.layout != torch.strided:
        raise InvalidBufferError(f"a {tensor.layout} tensor has no single span of memory")
    if not tensor.is_contiguous():
        raise InvalidBufferError("this tensor is not contiguous; pass tensor.contiguous() (a copy)")
    if tensor.numel() == 0:
        raise InvalidBufferError("this tensor is empty (0 elements)")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class Span:
    """Where a flat byte array lies: its first byte and length."""

    address: int
    nbytes: int

    @staticmethod
    def of(flat: np.ndarray) -> Span:
        return Span(flat.__array_interface__["data"][0], flat.nbytes)

    def whole_pages(self) -> int:
        """Pages lying wholly inside the span: those mbind and migrate act on."""
        first = -(-self.address // PAGE_SIZE)
        end = (self.address + self.nbytes) // PAGE_SIZE
        return max(end - first, 0)


def require_whole_pages(flat: np.ndarray) -> int:
    """The number of whole pages inside ``flat``; InvalidBufferError when there is none."""
    span = Span.of(flat)
    pages = span.whole_pages()
    if pages == 0:
        raise InvalidBufferError(
            f"{span.nbytes} bytes at {span.address:#x} hold no whole {PAGE_SIZE}-byte page; "
            "memory policy acts on whole pages (allocate with numafast.empty for small buffers)"
        )
    return pages
