# cython: language_level=3, boundscheck=False, wraparound=False
"""numafast._libnuma: a thin, faithful mirror of libnuma and the Linux NUMA system calls.

One Python function per C call, named after it without the ``numa_`` prefix. A C
call that fails raises :class:`LibnumaError` (an ``OSError``) naming the call. The
GIL is released around every call that enters the kernel or reads sysfs. Policy,
validation and friendly errors belong to the pure-Python layer in ``numafast``; the
one exception is a node or CPU id this machine lacks, which every call taking one
refuses with numafast's InvalidNodeError or InvalidCpuSetError, naming those here.

The module is built from several include files, one per concern, so that each
stays small: core (topology queries, bitmask conversion), policy (CPU binding
and memory policy), memory (allocation, mbind, page queries), copy (the
GIL-free gather copy into pinned memory), pool (page locking, pool slots) and
bench (the timed loops of `numafast bench`, on pinned threads).
"""

include "core.pxi"
include "policy.pxi"
include "memory.pxi"
include "copy.pxi"
include "pool.pxi"
include "bench.pxi"
