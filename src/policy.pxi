# Policy: CPU binding and memory policy (numa_bind, set_mempolicy, sched_setaffinity, ...).
#
# Memory policies and CPU affinity belong to a thread, not to the process: each
# call here acts on the calling thread only (sched_*affinity on the thread id it
# is given). libnuma's void functions report failure only by printing through
# numa_error() and leaving errno set, so those mirrors clear errno before the
# call and raise when it is set afterwards.

from libc.string cimport memset
cimport numa_api  # the raw syscalls, whose names the mirrors below take

# Mode numbers of set_mempolicy(2) (uapi/linux/mempolicy.h), its mode flags (OR'd
# into the mode, and returned OR'd into get_mempolicy's mode) and get_mempolicy's
# flags, published under their C names. (A module-level `MPOL_BIND = MPOL_BIND`
# would name the C constant on both sides, hence the dict.)
for _name, _value in {
    "MPOL_DEFAULT": MPOL_DEFAULT,
    "MPOL_PREFERRED": MPOL_PREFERRED,
    "MPOL_BIND": MPOL_BIND,
    "MPOL_INTERLEAVE": MPOL_INTERLEAVE,
    "MPOL_LOCAL": MPOL_LOCAL,
    "MPOL_PREFERRED_MANY": MPOL_PREFERRED_MANY,
    "MPOL_WEIGHTED_INTERLEAVE": NUMAFAST_MPOL_WEIGHTED_INTERLEAVE,
    "MPOL_F_STATIC_NODES": MPOL_F_STATIC_NODES,
    "MPOL_F_RELATIVE_NODES": MPOL_F_RELATIVE_NODES,
    "MPOL_F_NUMA_BALANCING": MPOL_F_NUMA_BALANCING,
    "MPOL_F_NODE": MPOL_F_NODE,
    "MPOL_F_ADDR": MPOL_F_ADDR,
    "MPOL_F_MEMS_ALLOWED": MPOL_F_MEMS_ALLOWED,
}.items():
    globals()[_name] = _value
del _name, _value


cdef inline _check_void(str call, int err, str detail=""):
    if err:
        _fail(call, err, detail)


# ---------------------------------------------------------------- libnuma: whole-thread binding

def bind(nodes) -> None:
    """numa_bind(): run on the CPUs of ``nodes`` and allocate only from them (MPOL_BIND)."""
    cdef bitmask *mask = _nodemask_from(nodes)
    cdef int err
    try:
        with nogil:
            libc_errno.errno = 0
            numa_bind(mask)
            err = libc_errno.errno
        _check_void("numa_bind", err, f"nodes {list(nodes)}")
    finally:
        numa_bitmask_free(mask)


def run_on_node(int node) -> None:
    """numa_run_on_node(): run on the CPUs of ``node``; -1 runs on all CPUs."""
    cdef int rc, err
    if node != -1:
        _require_node(node)
    with nogil:
        libc_errno.errno = 0
        rc = numa_run_on_node(node)
        err = libc_errno.errno
    if rc < 0:
        _fail("numa_run_on_node", err, f"node {node}")


def run_on_node_mask(nodes) -> None:
    """numa_run_on_node_mask(): run on the CPUs of ``nodes`` (those this task may use)."""
    cdef bitmask *mask = _nodemask_from(nodes)
    cdef int rc, err
    try:
        with nogil:
            libc_errno.errno = 0
            rc = numa_run_on_node_mask(mask)
            err = libc_errno.errno
        if rc < 0:
            _fail("numa_run_on_node_mask", err, f"nodes {list(nodes)}")
    finally:
        numa_bitmask_free(mask)


def get_run_node_mask() -> list[int]:
    """numa_get_run_node_mask(): the nodes whose CPUs the calling thread may run on."""
    cdef bitmask *mask
    cdef int err
    with nogil:
        libc_errno.errno = 0
        mask = numa_get_run_node_mask()
        err = libc_errno.errno
    return _bits_and_free(mask, "numa_get_run_node_mask", err)


# ---------------------------------------------------------------- libnuma: memory policy

def set_membind(nodes) -> None:
    """numa_set_membind(): allocate only from ``nodes`` (MPOL_BIND)."""
    cdef bitmask *mask = _nodemask_from(nodes)
    cdef int err
    try:
        with nogil:
            libc_errno.errno = 0
            numa_set_membind(mask)
            err = libc_errno.errno
        _check_void("numa_set_membind", err, f"nodes {list(nodes)}")
    finally:
        numa_bitmask_free(mask)


def get_membind() -> list[int]:
    """numa_get_membind(): the nodes of an MPOL_BIND policy, else every node."""
    cdef bitmask *mask
    cdef int err
    with nogil:
        libc_errno.errno = 0
        mask = numa_get_membind()
        err = libc_errno.errno
    return _bits_and_free(mask, "numa_get_membind", err)


def set_preferred(int node) -> None:
    """numa_set_preferred(): allocate from ``node`` first, elsewhere when it is full; -1 = local."""
    cdef int err
    if node != -1:
        _require_node(node)
    with nogil:
        libc_errno.errno = 0
        numa_set_preferred(node)
        err = libc_errno.errno
    _check_void("numa_set_preferred", err, f"node {node}")


def preferred() -> int:
    """numa_preferred(): the preferred node of the calling thread (the local node when none)."""
    cdef int node
    with nogil:
        node = numa_preferred()
    return node


def has_preferred_many() -> int:
    """numa_has_preferred_many(): > 0 when libnuma and the kernel offer MPOL_PREFERRED_MANY."""
    cdef int rc
    with nogil:
        rc = numa_has_preferred_many()
    return rc


def set_preferred_many(nodes) -> None:
    """numa_set_preferred_many(): allocate from any of ``nodes`` first (Linux 5.15+)."""
    cdef bitmask *mask = _nodemask_from(nodes)
    cdef int err
    try:
        with nogil:
            libc_errno.errno = 0
            numa_set_preferred_many(mask)
            err = libc_errno.errno
        _check_void("numa_set_preferred_many", err, f"nodes {list(nodes)}")
    finally:
        numa_bitmask_free(mask)


def preferred_many() -> list[int]:
    """numa_preferred_many(): the preferred nodes of the calling thread."""
    cdef bitmask *mask
    cdef int err
    with nogil:
        libc_errno.errno = 0
        mask = numa_preferred_many()
        err = libc_errno.errno
    return _bits_and_free(mask, "numa_preferred_many", err)


def set_interleave_mask(nodes) -> None:
    """numa_set_interleave_mask(): spread new pages round-robin over ``nodes``; empty = stop."""
    cdef bitmask *mask = _nodemask_from(nodes)
    cdef int err
    try:
        with nogil:
            libc_errno.errno = 0
            numa_set_interleave_mask(mask)
            err = libc_errno.errno
        _check_void("numa_set_interleave_mask", err, f"nodes {list(nodes)}")
    finally:
        numa_bitmask_free(mask)


def get_interleave_mask() -> list[int]:
    """numa_get_interleave_mask(): the interleave nodes, empty when not interleaving."""
    cdef bitmask *mask
    cdef int err
    with nogil:
        libc_errno.errno = 0
        mask = numa_get_interleave_mask()
        err = libc_errno.errno
    return _bits_and_free(mask, "numa_get_interleave_mask", err)


def set_localalloc() -> None:
    """numa_set_localalloc(): allocate on the node of the CPU that touches the page."""
    cdef int err
    with nogil:
        libc_errno.errno = 0
        numa_set_localalloc()
        err = libc_errno.errno
    _check_void("numa_set_localalloc", err)


def migrate_pages(int pid, from_nodes, to_nodes) -> int:
    """numa_migrate_pages(): move a process's pages on ``from_nodes`` to ``to_nodes``.

    Returns the number of pages that could not be moved.
    """
    cdef bitmask *source = _nodemask_from(from_nodes)
    cdef bitmask *target = NULL
    cdef int rc, err
    try:
        target = _nodemask_from(to_nodes)
        with nogil:
            libc_errno.errno = 0
            rc = numa_migrate_pages(pid, source, target)
            err = libc_errno.errno
        if rc < 0:
            _fail("numa_migrate_pages", err, f"pid {pid}, {list(from_nodes)} -> {list(to_nodes)}")
        return rc
    finally:
        numa_bitmask_free(source)
        if target != NULL:
            numa_bitmask_free(target)


# ---------------------------------------------------------------- kernel: set_mempolicy / get_mempolicy
#
# These four are on the path of every `with numa_local(...)`, so their masks live
# on the stack rather than in libnuma's heap bitmasks (a malloc and a calloc per
# call). 8192 bits cover the largest CONFIG_NR_CPUS and CONFIG_NODES_SHIFT.

DEF STACK_MASK_WORDS = 128
cdef unsigned long WORD_BITS = 8 * sizeof(unsigned long)


cdef int _fill_mask(bitmask *mask, unsigned long *words, unsigned long bits, object ids, str what) except -1:
    """Point ``mask`` at ``words`` (cleared, ``bits`` wide) with ``ids`` set."""
    cdef unsigned long nwords = (bits + WORD_BITS - 1) // WORD_BITS
    cdef long i
    if nwords > STACK_MASK_WORDS:
        raise OverflowError(f"a {bits}-bit {what} mask is larger than numafast supports")
    memset(words, 0, nwords * sizeof(unsigned long))
    mask.size = bits
    mask.maskp = words
    for i in ids:
        if i < 0 or <unsigned long>i >= bits:
            raise ValueError(f"{what} {i} is outside 0..{bits - 1}")
        words[i // WORD_BITS] |= 1UL << (i % WORD_BITS)
    return 0


cdef inline unsigned long _nodemask_bits() noexcept:
    return <unsigned long>numa_max_possible_node() + 1


def set_mempolicy(int mode, nodes) -> None:
    """set_mempolicy(2): ``mode`` (an MPOL_* mode, mode flags OR'd in) over ``nodes``.

    ``nodes`` is empty for MPOL_DEFAULT and MPOL_LOCAL (and an MPOL_PREFERRED that
    means "local").
    """
    cdef unsigned long words[STACK_MASK_WORDS]
    cdef bitmask mask
    cdef long rc
    cdef int err
    _fill_mask(&mask, words, _nodemask_bits(), nodes, "node")
    with nogil:
        libc_errno.errno = 0
        # maxnode counts one past the highest bit, as libnuma passes it.
        rc = numa_api.set_mempolicy(mode, mask.maskp, mask.size + 1)
        err = libc_errno.errno
    if rc < 0:
        _fail("set_mempolicy", err, f"mode {mode:#x}, nodes {list(nodes)}")


def get_mempolicy(unsigned int flags=0, size_t addr=0) -> tuple[int, list[int]]:
    """get_mempolicy(2): (mode with its mode flags, nodes) of the calling thread.

    With MPOL_F_ADDR the policy of the page at ``addr``; with MPOL_F_NODE|MPOL_F_ADDR
    the first item is the node the page at ``addr`` is on (the kernel faults it in);
    with MPOL_F_MEMS_ALLOWED the nodes are the cpuset's.
    """
    cdef unsigned long words[STACK_MASK_WORDS]
    cdef bitmask mask
    cdef int mode = 0
    cdef long rc
    cdef int err
    _fill_mask(&mask, words, _nodemask_bits(), (), "node")
    with nogil:
        libc_errno.errno = 0
        rc = numa_api.get_mempolicy(&mode, mask.maskp, mask.size + 1, <void *>addr, flags)
        err = libc_errno.errno
    if rc < 0:
        _fail("get_mempolicy", err, f"flags {flags:#x}, addr {addr:#x}")
    return mode, _bits_of(&mask)


# ---------------------------------------------------------------- kernel: CPU affinity of a thread

def sched_setaffinity(int tid, cpus) -> None:
    """numa_sched_setaffinity(): let thread ``tid`` (0 = the caller) run only on ``cpus``.

    The kernel silently drops CPUs outside the thread's cpuset and fails with
    EINVAL when none is left.
    """
    cdef unsigned long words[STACK_MASK_WORDS]
    cdef bitmask mask
    cdef int rc, err
    _fill_mask(&mask, words, numa_num_possible_cpus(), cpus, "cpu")
    with nogil:
        libc_errno.errno = 0
        rc = numa_sched_setaffinity(tid, &mask)
        err = libc_errno.errno
    if rc < 0:
        _fail("sched_setaffinity", err, f"tid {tid}, cpus {list(cpus)}")


def sched_getaffinity(int tid) -> list[int]:
    """numa_sched_getaffinity(): the CPUs thread ``tid`` (0 = the caller) may run on."""
    cdef unsigned long words[STACK_MASK_WORDS]
    cdef bitmask mask
    cdef int rc, err
    _fill_mask(&mask, words, numa_num_possible_cpus(), (), "cpu")
    with nogil:
        libc_errno.errno = 0
        rc = numa_sched_getaffinity(tid, &mask)
        err = libc_errno.errno
    if rc < 0:
        _fail("sched_getaffinity", err, f"tid {tid}")
    return _bits_of(&mask)


def gettid() -> int:
    """gettid(2): the kernel's id of the calling thread (what /proc/self/task lists)."""
    return <long>syscall(SYS_gettid)
