"""The machine's NUMA topology: every fact a placement decision needs.

Read live with :func:`topology` or from any copy of a machine's ``sys/`` and
``proc/`` with :meth:`Topology.from_sysfs` (tests replay real machine shapes,
and a plan can be made on a laptop for a DGX).
"""

from numafast.topo.model import Cpu, Gpu, Node, PciDevice, Topology
from numafast.topo.read import topology

__all__ = ["Cpu", "Gpu", "Node", "PciDevice", "Topology", "topology"]
