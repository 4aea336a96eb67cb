"""The machine's NUMA topology: every fact a placement decision needs.

Read live with :func:`topology` or from any copy of a machine's ``sys/`` and
``proc/`` with :meth:`Topology.from_sysfs` (tests replay real machine shapes,
and a plan can be made on a laptop for a DGX).

The package reads one way: ``files`` (the kernel's file formats) -> the parts
(``nodes``, ``cpus``, ``pci``, ``cuda``, ``allowed``) -> ``read``, which puts them
together into ``model``'s immutable objects. The model does no I/O and imports
none of the others; ``read`` registers itself as the reader behind
``Topology.from_sysfs``.
"""

from numafast.topo.model import Cpu, Gpu, Node, PciDevice, Topology
from numafast.topo.read import topology

__all__ = ["Cpu", "Gpu", "Node", "PciDevice", "Topology", "topology"]
