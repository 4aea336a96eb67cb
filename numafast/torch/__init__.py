"""numafast for PyTorch: node-local tensors, pinned batches, and loaders whose workers,
pin step and host buffers sit on the GPU's NUMA node.

- :func:`empty` / :func:`zeros`: tensors over node-bound, pre-faulted memory;
- :func:`pin`: a nested batch copied into a slot of a :class:`numafast.PinnedPool`;
- :class:`NumaLoader`: a DataLoader (made from one, or as one); its workers run on
  the node and collate each batch straight into a node-local, page-locked slot
  (and, with a CUDA device, the host-to-device copies are queued ahead). Loaders
  that Lightning, Accelerate or Ray Train make from it keep all of that;
- :func:`loader_stats`: how the batches of any such loader arrived;
- :func:`pin_memory_hook`: one line for loaders that keep ``pin_memory=True``.
- :class:`WorkerPlacement`: a ``worker_init_fn`` that binds a plain DataLoader's
  workers to a node (NumaLoader's workers bind themselves), then runs yours.

Importing numafast never imports torch; importing this package does. Only
:mod:`numafast.cuda` touches ``torch.cuda``, and only where CUDA is usable.
"""

from numafast.torch.batch import pin, record_stream
from numafast.torch.hook import PinMemoryHook, pin_memory_hook
from numafast.torch.loader import NumaLoader, WorkerPlacement, loader_stats
from numafast.torch.message import FallbackReason
from numafast.torch.owner_pools import LoaderStats
from numafast.torch.owner_process_pools import close_idle_pools
from numafast.torch.tensors import empty, zeros

__all__ = [
    "FallbackReason",
    "LoaderStats",
    "NumaLoader",
    "PinMemoryHook",
    "WorkerPlacement",
    "close_idle_pools",
    "empty",
    "loader_stats",
    "pin",
    "pin_memory_hook",
    "record_stream",
    "zeros",
]
