# Core: errors, bitmask conversion and the topology queries of libnuma.

from libc cimport errno as libc_errno
from libc.string cimport strerror
from numa_api cimport *


class LibnumaError(OSError):
    """A libnuma call or NUMA system call failed; ``call`` names it, ``errno`` says why."""

    def __init__(self, call: str, err: int, detail: str = ""):
        message = f"{call} failed: {strerror(err).decode()}"
        if detail:
            message += f" ({detail})"
        super().__init__(err, message)
        self.call = call


cdef inline object _fail(str call, int err, str detail=""):
    # errno is 0 when libnuma signals failure by its return value alone.
    raise LibnumaError(call, err if err else 22, detail)  # 22 = EINVAL


cdef bitmask *_nodemask_from(object nodes) except NULL:
    """A freshly allocated nodemask with the given node ids set; the caller frees it."""
    cdef bitmask *mask = numa_allocate_nodemask()
    cdef long node
    if mask == NULL:
        raise MemoryError("numa_allocate_nodemask")
    try:
        for node in nodes:
            if node < 0 or <unsigned long>node >= mask.size:
                raise ValueError(f"node {node} is outside 0..{mask.size - 1}")
            numa_bitmask_setbit(mask, <unsigned int>node)
    except BaseException:
        numa_bitmask_free(mask)
        raise
    return mask


cdef bitmask *_cpumask_from(object cpus) except NULL:
    """A freshly allocated cpumask with the given CPU ids set; the caller frees it."""
    cdef bitmask *mask = numa_allocate_cpumask()
    cdef long cpu
    if mask == NULL:
        raise MemoryError("numa_allocate_cpumask")
    try:
        for cpu in cpus:
            if cpu < 0 or <unsigned long>cpu >= mask.size:
                raise ValueError(f"cpu {cpu} is outside 0..{mask.size - 1}")
            numa_bitmask_setbit(mask, <unsigned int>cpu)
    except BaseException:
        numa_bitmask_free(mask)
        raise
    return mask


cdef list _bits_of(const bitmask *mask):
    """The set bits of a bitmask, ascending."""
    cdef unsigned long word_bits = 8 * sizeof(unsigned long)
    cdef unsigned long words = (mask.size + word_bits - 1) // word_bits
    cdef unsigned long w, b, word
    cdef list bits = []
    for w in range(words):
        word = mask.maskp[w]
        b = 0
        while word:
            if word & 1:
                bits.append(<long>(w * word_bits + b))
            word >>= 1
            b += 1
    return bits


cdef list _bits_and_free(bitmask *mask, str call, int err):
    """The set bits of a mask that libnuma allocated for us (then freed); NULL means failure."""
    if mask == NULL:
        _fail(call, err)
    try:
        return _bits_of(mask)
    finally:
        numa_bitmask_free(mask)


cdef int _require_node(long node) except -1:
    """InvalidNodeError naming ``node`` and the nodes here, unless this machine has it.

    libnuma answers an unknown node with ERANGE, ENOENT or a distance of 0, none of
    which says what was wrong; the one check here serves every call that takes a node.
    """
    if numa_nodes_ptr == NULL:  # libnuma found no node directory: leave it to the call
        return 0
    if 0 <= node < <long>numa_nodes_ptr.size and numa_bitmask_isbitset(numa_nodes_ptr, <unsigned int>node):
        return 0
    # Imported here: both modules import this one.
    from numafast._validate import format_ids
    from numafast.errors import InvalidNodeError

    raise InvalidNodeError(f"node {node} does not exist; nodes here: {format_ids(_bits_of(numa_nodes_ptr))}")


cdef int _require_cpu(long cpu) except -1:
    """InvalidCpuSetError naming ``cpu`` and the CPUs here, unless it is one of them."""
    cdef int configured = numa_num_configured_cpus()
    if 0 <= cpu < configured:
        return 0
    from numafast.errors import InvalidCpuSetError

    raise InvalidCpuSetError(f"cpu {cpu} does not exist; CPUs here: 0-{configured - 1}")


# ---------------------------------------------------------------- availability and sizes

def available() -> int:
    """numa_available(): 0 when the kernel has the NUMA system calls, -1 when not."""
    cdef int rc
    with nogil:
        rc = numa_available()
    return rc


def max_node() -> int:
    """numa_max_node(): the highest node id the kernel knows (nodes may be sparse)."""
    cdef int node
    with nogil:  # parses /sys/devices/system/node on first use
        node = numa_max_node()
    return node


def max_possible_node() -> int:
    """numa_max_possible_node(): the highest node id a nodemask can hold."""
    return numa_max_possible_node()


def num_configured_nodes() -> int:
    """numa_num_configured_nodes(): nodes with memory (CPU-less nodes count, memory-less do not)."""
    return numa_num_configured_nodes()


def num_configured_cpus() -> int:
    """numa_num_configured_cpus(): CPUs the system has, offline ones included."""
    return numa_num_configured_cpus()


def num_possible_cpus() -> int:
    """numa_num_possible_cpus(): the number of bits in a cpumask."""
    return numa_num_possible_cpus()


def num_task_cpus() -> int:
    """numa_num_task_cpus(): CPUs this task may run on (its cpuset)."""
    return numa_num_task_cpus()


def num_task_nodes() -> int:
    """numa_num_task_nodes(): nodes this task may allocate on (its cpuset)."""
    return numa_num_task_nodes()


def pagesize() -> int:
    """numa_pagesize(): the base page size in bytes."""
    return numa_pagesize()


def node_size64(int node) -> tuple[int, int]:
    """numa_node_size64(): (total, free) bytes of a node's memory, from its sysfs meminfo."""
    cdef long long free_bytes = 0
    cdef long long total
    cdef int err
    _require_node(node)
    with nogil:
        libc_errno.errno = 0
        total = numa_node_size64(node, &free_bytes)
        err = libc_errno.errno
    if total < 0:
        _fail("numa_node_size64", err, f"node {node}")
    return total, free_bytes


def distance(int node1, int node2) -> int:
    """numa_distance(): the SLIT distance (10 = local), or 0 when the kernel has none."""
    cdef int d
    _require_node(node1)
    _require_node(node2)
    with nogil:
        d = numa_distance(node1, node2)
    return d


def node_of_cpu(int cpu) -> int:
    """numa_node_of_cpu(): the node a CPU belongs to."""
    cdef int node, err
    _require_cpu(cpu)
    with nogil:
        libc_errno.errno = 0
        node = numa_node_of_cpu(cpu)
        err = libc_errno.errno
    if node < 0:
        _fail("numa_node_of_cpu", err, f"cpu {cpu}")
    return node


def node_to_cpus(int node) -> list[int]:
    """numa_node_to_cpus(): the CPUs of a node (empty for a CPU-less node)."""
    cdef bitmask *cpus = numa_allocate_cpumask()
    cdef int rc, err
    if cpus == NULL:
        raise MemoryError("numa_allocate_cpumask")
    try:
        _require_node(node)
        with nogil:
            libc_errno.errno = 0
            rc = numa_node_to_cpus(node, cpus)
            err = libc_errno.errno
        if rc < 0:
            _fail("numa_node_to_cpus", err, f"node {node}")
        return _bits_of(cpus)
    finally:
        numa_bitmask_free(cpus)


def get_mems_allowed() -> list[int]:
    """numa_get_mems_allowed(): the nodes this task may allocate on (its cpuset's mems).

    libnuma reports a refused get_mempolicy (a seccomp filter) only on stderr and
    returns an empty mask; a task always may use some node, so empty means refused.
    """
    cdef bitmask *mask
    cdef int err
    with nogil:
        libc_errno.errno = 0
        mask = numa_get_mems_allowed()
        err = libc_errno.errno
    nodes = _bits_and_free(mask, "numa_get_mems_allowed", err)
    if not nodes:
        _fail("numa_get_mems_allowed", err, "the kernel reported no allowed node")
    return nodes
