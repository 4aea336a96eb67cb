# Pinned pools: page locking (mlock, munlock), and the slot bookkeeping of a pool: one
# shared mapping cut into equal slots after a table of one word per slot, each claimed
# with one compare-and-swap by the main process or a DataLoader worker mapping the file.
#
# A slot comes back when its Slot object is deallocated: every array, memoryview or
# tensor over it keeps the Slot alive (a buffer export holds a reference; so does
# torch.frombuffer). That deallocator runs in whichever thread drops the last reference
# (a pin thread, the cycle collector), so it only changes the slot's word and the pool's
# counters: it never calls Python, waits on a GPU event or warns. A slot needing more (a
# CUDA fence recorded, a closed pool's memory released) is marked returned for
# SlotPool.settle(): at the main thread's next Python instruction (a CPython pending
# call) or at the next acquire(), settle() or close(). The cycle collector clears
# neither a Slot, its pool, nor the pool's table, which holds the mapping (no_gc_clear):
# the Slot's deallocator needs them whole.
#
# A fence is asked (query()), never waited on: an event's own wait has no end, and a
# copy behind a kernel that does not end would hang whoever waits. Each wait for one
# polls, the GIL let go between questions and Ctrl-C heard, and lasts no longer than
# FENCE_WAIT_S after the slot came back (see there for what each caller does then).

cimport cython
from libc.stdint cimport int64_t
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals, PyErr_SetObject
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.ref cimport Py_DECREF, Py_INCREF


cdef extern from "Python.h":
    int Py_AddPendingCall(int (*func)(void *) noexcept, void *arg) nogil


cdef extern from *:
    """
    /* Py_IsFinalizing is public from 3.13; before, the same function is private. */
    #if PY_VERSION_HEX >= 0x030D0000
    #define nf_is_finalizing() Py_IsFinalizing()
    #else
    #define nf_is_finalizing() _Py_IsFinalizing()
    #endif
    """
    bint nf_is_finalizing()


cdef extern from *:
    """
    #include <pthread.h>
    /* This process's id without a system call per check (glibc stopped caching
       getpid() in 2.25): read at load, and again in every child that fork() makes,
       by fork() itself before the child runs any code of its own. A pool compares
       it with its owner's before touching anything of the owner's alone (the
       slot bookkeeping, the mutex and the condition variable). */
    static pid_t nf_self_pid;
    static void nf_after_fork_in_child(void) { nf_self_pid = getpid(); }
    static int nf_track_pid(void) {
        nf_self_pid = getpid();
        return pthread_atfork(NULL, NULL, nf_after_fork_in_child);
    }
    static inline pid_t nf_pid(void) { return nf_self_pid; }
    """
    int nf_track_pid() nogil
    pid_t nf_pid() nogil


if nf_track_pid() != 0:
    raise MemoryError("pthread_atfork: no room for numafast's handler")


def mlock(buf, bint on_fault=False) -> None:
    """mlock(2): keep every page ``buf`` touches resident, faulting in any missing one;
    with ``on_fault``, mlock2(2) MLOCK_ONFAULT locks each page at its first touch (a
    kernel before 4.4, without mlock2, locks them all now). Beyond RLIMIT_MEMLOCK,
    without CAP_IPC_LOCK: ENOMEM (EPERM when the limit is 0), the whole range counting
    either way. A locked page may still migrate; one pinned for DMA (cudaHostRegister)
    cannot."""
    _lock_pages(buf, True, on_fault)


def munlock(buf) -> None:
    """munlock(2): let every page ``buf`` touches be swapped again."""
    _lock_pages(buf, False, False)


cdef int _lock_pages(object buf, bint lock, bint on_fault) except -1:
    cdef Py_buffer view
    cdef char *first
    cdef size_t length
    cdef int rc = -1
    cdef int err = libc_errno.ENOSYS
    _hold(buf, &view, False)
    try:
        length = _pages_of(&view, False, &first) * _PAGE
        with nogil:  # locking faults in any missing page: it can take a while
            libc_errno.errno = 0
            if not lock:
                rc = numa_api.munlock(first, length)
                err = libc_errno.errno
            elif on_fault and numa_api.SYS_mlock2 >= 0:
                rc = numa_api.syscall(numa_api.SYS_mlock2, first, length, numa_api.MLOCK_ONFAULT)
                err = libc_errno.errno
            if lock and rc != 0 and err in (libc_errno.ENOSYS, libc_errno.EINVAL):  # no mlock2 (or no ONFAULT) here
                libc_errno.errno = 0
                rc = numa_api.mlock(first, length)
                err = libc_errno.errno
        if rc != 0:
            _fail("mlock" if lock else "munlock", err, f"{length} bytes at {<uintptr_t>first:#x}")
    finally:
        PyBuffer_Release(&view)
    return 0


def remap_private(uintptr_t address, size_t length, int fd, size_t offset) -> None:
    """Map ``length`` bytes of file ``fd`` from ``offset`` private and read-write at
    ``address``, over what is there (MAP_FIXED): reads still see the file's pages, writes
    go to private copies. What a forked child does with its parent's pools (those it
    holds no object for too, found in /proc/self/maps), so that it can read a batch it
    inherited but never write into a slot the parent may hand out again."""
    cdef void *start
    cdef int err = 0
    if address % _PAGE or length % _PAGE or offset % _PAGE or length == 0:
        raise ValueError(f"{length} bytes at {address:#x} (file offset {offset}): not whole pages")
    with nogil:
        libc_errno.errno = 0
        start = numa_api.mmap(<void *>address, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd,
                              <long>offset)
        err = libc_errno.errno
    if start == MAP_FAILED:
        _fail("mmap (MAP_PRIVATE | MAP_FIXED)", err, f"{length} bytes at {address:#x}")


cdef double _monotonic() noexcept nogil:
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return now.tv_sec + now.tv_nsec * 1e-9


# How long one wait for a returned slot lasts before the waiter looks at signals
# (Ctrl-C) and at fences again.
cdef double _WAIT_STEP_S = 0.05
cdef double _FENCE_POLL_S = 0.0005

# How long numafast waits for one copy to the GPU: FENCE_WAIT_S after a slot came back,
# a fence still not done is taken for a kernel that does not end (or a collective
# waiting for a rank that is gone), and no wait for that copy goes on. acquire() and
# reap(wait=True) then raise PoolExhaustedError naming the slot; a closed pool's
# settle() keeps the slot fenced and the memory in place (unregistering or unmapping
# memory a copy still reads is undefined) for a later settle to ask again; a loader's
# batch goes unpinned (numafast.torch.owner_pools); a pool released during a CUDA graph
# capture stays deferred (numafast.pool, _release_deferred). Slots held by arrays or
# tensors are not bound by it: timeout=None waits as long as they are held. A Python
# name, read at each wait: a test may lower it.
FENCE_WAIT_S = 60.0

# The slot table at the start of a pool's mapping: a header, then one 64-bit word per
# slot, ``generation << 40 | state << 32 | pid``, then one per slot for its leaser,
# ``generation << 40 | start time`` (clock ticks after boot, as in /proc/PID/stat: a
# pid alone cannot tell a live worker from a later process given its pid). The
# generation grows each time a slot becomes free, so a stale message about a slot (a
# dead worker's, a batch dropped unread) is never taken for its next use.
#
# Memory order, which x86 gives for free and Arm does not: every change of a slot's
# word is a compare-and-swap with acquire and release order, and every read of it an
# acquire load. So a process that leases a slot (acquire) sees every write to the
# slot's memory that the process which freed it made before freeing it (release):
# the owner's reads of the last batch, a GPU fence's completion. The batch a worker
# writes reaches the owner through the pipe that carries its message (write(2) and
# read(2) order memory like a lock), not through the slot's word. The header is
# written before the magic word is stored with release order; attach() loads the
# magic with acquire order before it reads the rest.
cdef uint64_t _TABLE_MAGIC = 0x314c4f4f50464e4e  # "NNFPOOL1"
cdef Py_ssize_t _TABLE_HEADER_WORDS = 8
cdef uint64_t _PID_BITS = 0xffffffff
cdef uint64_t _STATE_BITS = 0xff
cdef uint64_t _STARTED_BITS = (<uint64_t>1 << 40) - 1
LEASE_STARTED_BITS = _STARTED_BITS  # the bits of a leaser's start time that leases() gives

cdef enum _SlotState:
    _FREE = 0
    _HELD = 1      # held by the owner: a Slot object exists for it
    _FENCED = 2    # given back while GPU work queued on it may still run
    _RETIRED = 3   # never reused: no fence could be recorded for it, or its pool is closed
    _LEASED = 4    # claimed by another process (a worker) that fills it
    _RETURNED = 5  # given back (its Slot object died), its fence not recorded yet
    _GUARDED = 6   # given back while a process forked when it was held may still read it

SLOT_STATES = {"free": _FREE, "held": _HELD, "fenced": _FENCED, "retired": _RETIRED, "leased": _LEASED,
               "returned": _RETURNED, "guarded": _GUARDED}


cdef inline uint64_t _word(uint64_t generation, uint64_t state, uint64_t pid) noexcept nogil:
    return generation << 40 | state << 32 | (pid & _PID_BITS)


cdef inline uint64_t _generation(uint64_t word) noexcept nogil:
    return word >> 40


cdef inline uint64_t _state(uint64_t word) noexcept nogil:
    return (word >> 32) & _STATE_BITS


def slot_table_bytes(Py_ssize_t count) -> int:
    """Bytes before slot 0 in a pool of ``count`` slots: the table, in whole pages;
    InvalidSizeError for a count whose table no address space holds."""
    cdef Py_ssize_t most = (PY_SSIZE_T_MAX - <Py_ssize_t>_PAGE) // 16 - _TABLE_HEADER_WORDS
    if count < 0 or count > most:
        from numafast.errors import InvalidSizeError
        raise InvalidSizeError(f"a slot table of {count} slots: the count must be 0 to {most}")
    return <Py_ssize_t>(((_TABLE_HEADER_WORDS + 2 * count) * 8 + _PAGE - 1) & ~(_PAGE - 1))


@cython.auto_pickle(False)
@cython.no_gc_clear  # a Slot's deallocator writes its word (see the top of this file)
cdef class SlotTable:
    """The slot table of a pool's mapping ``region``, as one process sees it: :meth:`create`
    writes it, :meth:`attach` reads one another process wrote."""

    cdef readonly MappedBuffer region
    cdef uint64_t *words
    cdef readonly Py_ssize_t count
    cdef readonly size_t slot_bytes
    cdef readonly size_t stride
    cdef readonly size_t header_bytes

    def __init__(self) -> None:
        raise TypeError("a SlotTable comes from SlotTable.create() or SlotTable.attach()")

    @staticmethod
    def create(MappedBuffer region not None, size_t slot_bytes, Py_ssize_t count) -> SlotTable:
        """Write an empty table for ``count`` slots of ``slot_bytes`` at the start of ``region``."""
        cdef SlotTable table = SlotTable.__new__(SlotTable)
        cdef size_t stride, header
        cdef Py_ssize_t i
        if slot_bytes == 0 or count <= 0:
            raise ValueError(f"a pool needs slots of at least 1 byte and at least 1 slot, not {count} x {slot_bytes}")
        if region.address == NULL:
            raise ValueError("the region was already freed")
        stride = (slot_bytes + _PAGE - 1) & ~(_PAGE - 1)
        header = slot_table_bytes(count)
        if stride < slot_bytes or region.size < header or <size_t>count > (region.size - header) // stride:
            raise ValueError(f"{count} slots of {slot_bytes} bytes ({stride} with page rounding) and a "
                             f"{header}-byte table do not fit in a region of {region.size} bytes")
        table.words = <uint64_t *>region.address
        for i in range(count):
            table.words[_TABLE_HEADER_WORDS + i] = _word(0, _FREE, 0)
            table.words[_TABLE_HEADER_WORDS + count + i] = 0
        table.words[1] = <uint64_t>count
        table.words[2] = slot_bytes
        table.words[3] = stride
        table.words[4] = header
        nf_store64(&table.words[0], _TABLE_MAGIC)
        table._set(region)
        return table

    @staticmethod
    def attach(MappedBuffer region not None) -> SlotTable:
        """The table at the start of ``region``; ValueError when there is none or it does not fit."""
        cdef SlotTable table = SlotTable.__new__(SlotTable)
        cdef uint64_t *words = <uint64_t *>region.address
        if region.address == NULL or region.size < _PAGE or nf_load64(&words[0]) != _TABLE_MAGIC:
            raise ValueError("this mapping holds no numafast slot table")
        if words[4] + words[1] * words[3] > region.size:
            raise ValueError(f"the slot table says {words[1]} slots of {words[3]} bytes, "
                             f"more than the {region.size} bytes mapped")
        table.words = words
        table._set(region)
        return table

    cdef void _set(self, MappedBuffer region):
        self.region = region
        self.count = <Py_ssize_t>self.words[1]
        self.slot_bytes = <size_t>self.words[2]
        self.stride = <size_t>self.words[3]
        self.header_bytes = <size_t>self.words[4]

    cdef inline uint64_t *_slot_word(self, Py_ssize_t index) noexcept nogil:
        return &self.words[_TABLE_HEADER_WORDS + index]

    cdef inline uint64_t *_leaser_word(self, Py_ssize_t index) noexcept nogil:
        return &self.words[_TABLE_HEADER_WORDS + self.count + index]

    cdef inline bint _unmapped(self) noexcept:
        """The mapping is gone (a released pool): nothing to read, nothing to claim."""
        return self.region.address == NULL

    cdef Py_ssize_t _claim(self, uint64_t state, uint64_t pid, uint64_t started,
                           uint64_t *generation) noexcept nogil:
        """Take the lowest free slot for ``state``/``pid`` (a lease then records ``started``):
        its index (and generation), or -1. The lowest first, so a slot just back, its
        lines likely still cached, is filled next (round-robin kept every slot cold:
        writing a batch was 1.5x slower)."""
        cdef Py_ssize_t index
        cdef uint64_t word
        for index in range(self.count):
            word = nf_load64(self._slot_word(index))
            if _state(word) == _FREE and nf_cas64(self._slot_word(index), word,
                                                  _word(_generation(word), state, pid)):
                generation[0] = _generation(word)
                if state == _LEASED:
                    nf_store64(self._leaser_word(index), _generation(word) << 40 | (started & _STARTED_BITS))
                return index
        return -1

    cdef bint _change(self, Py_ssize_t index, uint64_t generation, uint64_t state, uint64_t pid,
                      uint64_t new_state, uint64_t new_pid, bint next_generation) noexcept nogil:
        """One slot from (generation, state, pid) to (new_state, new_pid), the
        generation advanced when it becomes free; False when it was not in that state."""
        cdef uint64_t *word = self._slot_word(index)
        cdef uint64_t seen = nf_load64(word)
        if _generation(seen) != generation or _state(seen) != state:
            return False
        if pid != _PID_BITS and (seen & _PID_BITS) != pid:
            return False
        return nf_cas64(word, seen, _word(generation + next_generation, new_state, new_pid))

    def claim(self, uint64_t started):
        """Lease a free slot to this process (a worker started at ``started``, in clock
        ticks after boot): ``(index, generation)``, or None when none is free. Never
        waits: the worker sends its batch the copying way, and the owner makes room."""
        cdef uint64_t generation = 0
        cdef Py_ssize_t index
        if self._unmapped():
            return None
        index = self._claim(_LEASED, <uint64_t>nf_pid(), started, &generation)
        return None if index < 0 else (index, generation)

    def unclaim(self, Py_ssize_t index, uint64_t generation, pid=None) -> bool:
        """Free a slot leased to ``pid`` (default: this process) in ``generation``: a
        worker giving up on a batch, or the owner reclaiming a dead worker's slot."""
        cdef uint64_t owner = <uint64_t>(nf_pid() if pid is None else pid)
        self._check_index(index)
        if self._unmapped():
            return False
        return self._change(index, generation, _LEASED, owner, _FREE, 0, True)

    def leases(self) -> list:
        """``(index, generation, pid, started)`` of every slot leased now: ``started`` the
        leaser's start time (modulo 2**40), -1 in the few instructions before it records it."""
        cdef Py_ssize_t index
        cdef uint64_t word, leaser
        cdef long long started
        found = []
        if self._unmapped():
            return found
        for index in range(self.count):
            word = nf_load64(self._slot_word(index))
            if _state(word) == _LEASED:
                leaser = nf_load64(self._leaser_word(index))
                started = <long long>(leaser & _STARTED_BITS) if leaser >> 40 == _generation(word) else -1
                found.append((index, _generation(word), <long>(word & _PID_BITS), started))
        return found

    def states(self) -> list:
        """Each slot's state now (the values of SLOT_STATES); none once unmapped."""
        if self._unmapped():
            return []
        return [<int>_state(nf_load64(self._slot_word(index))) for index in range(self.count)]

    def offset(self, Py_ssize_t index) -> int:
        """Where slot ``index`` starts in the mapping."""
        self._check_index(index)
        return <Py_ssize_t>(self.header_bytes + index * self.stride)

    cdef int _check_index(self, Py_ssize_t index) except -1:
        if index < 0 or index >= self.count:
            raise IndexError(f"slot {index}: this pool has slots 0 to {self.count - 1}")
        return 0


@cython.no_gc_clear  # a Slot's deallocator uses its pool (see the top of this file)
@cython.auto_pickle(False)
cdef class SlotPool:
    """``count`` slots of ``slot_bytes`` in ``region``, after its slot table, handed out as
    :class:`Slot` objects (:meth:`acquire`, or :meth:`adopt` for a worker's lease).

    ``fence(index)``, when given, returns for a slot given back an object whose
    ``query()`` says whether the GPU work reading it is done (CUDA events on the streams
    reading it; None: it cannot be asked now, the thread capturing a CUDA graph): the
    slot is reused once it is done. Fences are only asked, for FENCE_WAIT_S at most
    (see the top of this file). A slot held at a fork and given back is reused once
    the guards of those forks ended (:meth:`guard_held`, :meth:`unguard`).
    ``on_drained()`` is called once the pool is closed and no slot is out (held, in
    flight or leased): the memory may go. Only :meth:`settle` calls them; a SlotPool
    dropped unclosed calls neither.

    The mutex only guards the condition acquire()'s waiters sleep on (GIL released);
    slots change by compare-and-swap. A forked child's copy hands out no slot and never
    touches the mutex or condition, copied as fork() found them (a mutex another thread
    held stays held; glibc's pthread_cond_destroy would wait forever for the waiters
    copied with it).
    """

    cdef readonly SlotTable table
    cdef char *base
    cdef readonly Py_ssize_t in_use
    cdef readonly Py_ssize_t peak
    cdef readonly Py_ssize_t fenced  # in flight: returned, being fenced, or in fences
    cdef readonly Py_ssize_t lost  # retired because no fence could be recorded
    cdef readonly Py_ssize_t guarded  # given back, kept out of use while a fork guard of theirs lasts
    cdef dict guards  # index: the fork guards (see guard_held) of a slot held at those forks
    cdef readonly unsigned long long acquired
    cdef readonly unsigned long long adopted
    cdef readonly unsigned long long reclaimed
    cdef readonly unsigned long long waits
    cdef readonly double waited_seconds
    cdef object fence
    cdef dict fences  # index: the fence recorded for it, oldest first
    cdef dict fenced_at  # index: when its fence was recorded (monotonic s), for FENCE_WAIT_S
    cdef object on_drained
    cdef readonly pid_t owner_pid
    cdef readonly bint closed
    cdef readonly bint drained  # on_drained has run
    cdef bint settle_queued
    cdef bint settling  # a settle() runs: one entered meanwhile asks it to look again
    cdef bint settle_again
    cdef bint abandoned
    cdef public object defer_settle  # see _settle_pending
    cdef pthread_mutex_t mutex
    cdef pthread_cond_t returned

    def __cinit__(self, MappedBuffer region not None, size_t slot_bytes, Py_ssize_t count,
                  fence=None, on_drained=None):
        cdef pthread_condattr_t attributes
        pthread_mutex_init(&self.mutex, NULL)
        pthread_condattr_init(&attributes)
        pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC)
        pthread_cond_init(&self.returned, &attributes)
        pthread_condattr_destroy(&attributes)
        self.owner_pid = nf_pid()  # from here on, __dealloc__ destroys the two
        self.table = SlotTable.create(region, slot_bytes, count)
        self.base = region.address + self.table.header_bytes
        self.fence = fence
        self.fences = {}
        self.fenced_at = {}
        self.guards = {}
        self.on_drained = on_drained

    def __dealloc__(self):
        # No Slot is out and no settle is queued: each holds a reference. owner_pid is
        # still 0 when __cinit__ did not run; a forked child's copy leaves the two alone.
        if self._owned():
            pthread_cond_destroy(&self.returned)
            pthread_mutex_destroy(&self.mutex)

    @property
    def address(self) -> int:
        """Where slot 0 starts; slot i starts ``i * stride`` bytes later."""
        return <uintptr_t>self.base

    cdef inline bint _owned(self) noexcept:
        """Whether this process made the pool (not a forked child's copy)."""
        return self.owner_pid == nf_pid()

    cdef int _check_owner(self, size_t nbytes=0) except -1:
        if not self._owned():
            raise RuntimeError(
                f"this pool belongs to process {self.owner_pid}; a forked child only reads the slots "
                "it inherited: make a new pool in the child")
        if nbytes > self.table.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit in a slot of {self.table.slot_bytes} bytes")
        return 0

    def acquire(self, size_t nbytes, double timeout=-1.0) -> Slot:
        """A free slot exporting its first ``nbytes`` bytes, waiting up to ``timeout`` s
        (< 0: as long as slots are held) for one, then TimeoutError; RuntimeError once the
        pool is closed. PoolExhaustedError (a TimeoutError) sooner when none is free and the
        oldest copy to the GPU has not finished FENCE_WAIT_S after its slot came back."""
        cdef Py_ssize_t index
        self._check_owner(nbytes)
        index = -1 if self.closed else self._take()
        if index < 0:
            index = self._wait_for_slot(timeout)
        return Slot._wrap(self, index, nbytes)

    def adopt(self, Py_ssize_t index, uint64_t generation, size_t nbytes) -> Slot:
        """The slot a worker leased in ``generation`` and filled, as a Slot of ``nbytes``;
        LookupError when that lease is over (reclaimed from a dead worker, or taken)."""
        self._check_owner(nbytes)
        self.table._check_index(index)
        if not self.table._change(index, generation, _LEASED, _PID_BITS, _HELD, <uint64_t>self.owner_pid, False):
            raise LookupError(f"slot {index} of this pool is no longer leased in generation {generation}")
        self._count_out()
        self.adopted += 1
        return Slot._wrap(self, index, nbytes)

    def reclaim(self, Py_ssize_t index, uint64_t generation, long pid) -> bool:
        """Free a slot leased to ``pid`` in ``generation`` (a dead worker's, or a batch
        dropped unread); False when the lease had already ended."""
        self._check_owner()
        if not self.table.unclaim(index, generation, pid):
            return False
        self.reclaimed += 1
        self._signal()
        if self.closed:
            self.settle()
        return True

    cdef Py_ssize_t _take(self) noexcept:
        """Claim the lowest free slot for this process and count it out; -1 when none is free."""
        cdef uint64_t generation = 0
        cdef Py_ssize_t index = self.table._claim(_HELD, <uint64_t>self.owner_pid, 0, &generation)
        if index >= 0:
            self._count_out()
        return index

    cdef inline void _count_out(self) noexcept:
        self.in_use += 1
        self.acquired += 1
        if self.in_use > self.peak:
            self.peak = self.in_use

    cdef Py_ssize_t _wait_for_slot(self, double timeout) except -1:
        cdef double start = _monotonic()
        cdef double remaining, wake_at
        cdef timespec deadline
        cdef Py_ssize_t index
        cdef bint counted = False
        try:
            while True:
                if self.guarded:
                    self.unguard()
                if self.fenced:
                    self._fence_returned()
                    self.reap()  # this loop asks the fences again every _FENCE_POLL_S
                if self.closed:
                    raise RuntimeError("the pool was closed while waiting for a slot")
                index = self._take()
                if index >= 0:
                    return index
                if self.fences:
                    self._check_overdue()
                if not counted:
                    counted = True
                    self.waits += 1
                remaining = start + timeout - _monotonic() if timeout >= 0 else _WAIT_STEP_S
                if remaining <= 0:
                    raise TimeoutError(f"all {self.table.count} slots are in use ({self.in_use} held by arrays or "
                                       f"tensors, {self.fenced} in flight on the GPU, {self.guarded} kept for "
                                       f"processes forked while they were held) and none came back within "
                                       f"{timeout:g} s")
                wake_at = _monotonic() + min(remaining, _FENCE_POLL_S if self.fenced else _WAIT_STEP_S)
                deadline.tv_sec = <time_t>wake_at
                deadline.tv_nsec = <long>((wake_at - deadline.tv_sec) * 1e9)
                with nogil:
                    pthread_mutex_lock(&self.mutex)
                    if not self.closed:
                        pthread_cond_timedwait(&self.returned, &self.mutex, &deadline)
                    # Let go of the mutex before taking the GIL back.
                    pthread_mutex_unlock(&self.mutex)
                PyErr_CheckSignals()  # Ctrl-C ends a long wait
        finally:
            if counted:
                self.waited_seconds += _monotonic() - start

    cdef void _unfence(self, Py_ssize_t index, object fence):
        """Free a fenced slot whose fence is done, unless another thread just did."""
        if self.fences.get(index) is fence:
            del self.fences[index]
            del self.fenced_at[index]
            self.fenced -= 1
            self._make_free(index, nf_load64(self.table._slot_word(index)), _FENCED)

    cdef void _make_free(self, Py_ssize_t index, uint64_t word, uint64_t state) noexcept:
        # A closed pool's slot is retired, not freed: a worker must never lease it again.
        self.table._change(index, _generation(word), state, <uint64_t>self.owner_pid,
                           _RETIRED if self.closed else _FREE, 0, True)
        self._signal()

    cdef void _signal(self) noexcept:
        # The mutex is only ever held for a few instructions (a waiter lets go of it
        # while it sleeps, and never holds it with the GIL), so a Slot's deallocator
        # may take it. Every caller has checked _owned(): a forked child never takes it.
        pthread_mutex_lock(&self.mutex)
        pthread_cond_signal(&self.returned)
        pthread_mutex_unlock(&self.mutex)

    cdef void _give_back(self, Py_ssize_t index) noexcept:
        """A Slot died (its deallocator, GIL held): its slot is free, or with a fence marked
        returned for settle() (see the top of this file)."""
        cdef uint64_t word
        if not self._owned():
            return  # a forked child's copy: nothing of the parent's to give back
        word = nf_load64(self.table._slot_word(index))
        self.in_use -= 1
        if self.guards and not self.closed and index in self.guards:
            self.table._change(index, _generation(word), _HELD, <uint64_t>self.owner_pid, _GUARDED,
                               <uint64_t>self.owner_pid, False)
            self.guarded += 1  # unguard() gives it back once its guards end
            return
        if self.fence is None:
            self._make_free(index, word, _HELD)
        else:
            self.table._change(index, _generation(word), _HELD, <uint64_t>self.owner_pid, _RETURNED,
                               <uint64_t>self.owner_pid, False)
            self.fenced += 1
            self._signal()  # a waiter fences it and looks again
        if self.closed or self.fence is not None:
            self._settle_soon()

    cdef void _settle_soon(self) noexcept:
        """Queue settle() as a pending call (holding a reference to the pool); when the
        queue is full, the next acquire(), settle() or close() settles instead."""
        if self.settle_queued:
            return
        self.settle_queued = True
        Py_INCREF(self)
        if Py_AddPendingCall(_settle_pending, <void *>self) != 0:
            self.settle_queued = False
            Py_DECREF(self)  # never the last reference: the caller holds one

    cdef int _fence_returned(self) except -1:
        """Record a fence for each returned slot (a closed pool's settle() asks it). A slot
        whose fence cannot be recorded is retired: handing it out again could overwrite a
        copy still in flight."""
        cdef Py_ssize_t index
        cdef uint64_t word
        cdef object fence
        cdef uint64_t owner = <uint64_t>self.owner_pid
        if self.fenced == len(self.fences):
            return 0  # none returned since the last look
        for index in range(self.table.count):
            word = nf_load64(self.table._slot_word(index))
            if _state(word) != _RETURNED or not self.table._change(index, _generation(word), _RETURNED, owner,
                                                                   _FENCED, owner, False):
                continue  # not returned, or another thread (while a fence let go of the GIL) took it
            try:
                fence = self.fence(index)
            except BaseException as error:
                self.table._change(index, _generation(word), _FENCED, owner, _RETIRED, 0, False)
                self.fenced -= 1
                self.lost += 1
                import warnings
                warnings.warn(f"slot {index} is retired: its fence could not be recorded ({error!r})",
                              RuntimeWarning, stacklevel=2)
                continue
            self.fences[index] = fence
            self.fenced_at[index] = _monotonic()
        return 0

    cdef object _await_fence(self, Py_ssize_t index, object fence):
        """Ask slot ``index``'s ``fence`` until it is done (True) or cannot be asked now (None:
        this thread captures a CUDA graph), or until FENCE_WAIT_S after the slot came back
        (False: the copy is overdue). Between questions it sleeps with the GIL let go
        (another thread may free the slot meanwhile: done then), and Ctrl-C ends it."""
        cdef double pause = _FENCE_POLL_S
        cdef double left
        cdef timespec step
        while self.fences.get(index) is fence:
            done = fence.query()
            if done is None:
                return None
            if done:
                return True
            left = self.fenced_at[index] + FENCE_WAIT_S - _monotonic()
            if left <= 0:
                return False
            left = min(left, pause)
            pause = min(2 * pause, _WAIT_STEP_S)
            step.tv_sec = <time_t>left
            step.tv_nsec = <long>((left - step.tv_sec) * 1e9)
            with nogil:
                nanosleep(&step, NULL)
            PyErr_CheckSignals()  # Ctrl-C ends the wait
        return True

    cdef int _check_overdue(self) except -1:
        """No slot could be taken: PoolExhaustedError when the oldest fence's copy, asked once
        more, has not finished FENCE_WAIT_S after its slot came back."""
        index, fence = next(iter(self.fences.items()))
        if _monotonic() - self.fenced_at[index] >= FENCE_WAIT_S and not fence.query():
            raise self._overdue(index)
        return 0

    cdef object _overdue(self, Py_ssize_t index):
        from numafast.errors import PoolExhaustedError
        return PoolExhaustedError(
            f"a copy to the GPU from slot {index} has not finished {FENCE_WAIT_S:g} s after the slot came back (a "
            f"kernel that does not end? a collective waiting for a rank that is gone?), and no other of the "
            f"{self.table.count} slots is free ({self.fenced} in flight, {self.in_use} held): a slot is not reused "
            f"while a copy may still read it. Find what the GPU is stuck on (py-spy dump --native shows where each "
            f"thread waits)")

    def guard_held(self, object guard) -> int:
        """Keep each slot this process holds now out of use, once given back, until
        ``guard.ended()``: a process forked now reads those slots through its inherited
        arrays and tensors (see numafast/_process.py ``ForkGuard``). Returns how many."""
        cdef Py_ssize_t index
        cdef Py_ssize_t count = 0
        if not self._owned() or self.closed or not self.in_use:
            return 0
        for index in range(self.table.count):
            if _state(nf_load64(self.table._slot_word(index))) == _HELD:
                self.guards.setdefault(index, []).append(guard)
                count += 1
        return count

    def guarded_by(self, object guard) -> list:
        """The slots ``guard`` keeps (those held at its fork): in a forked child, those it copies."""
        return [index for index, guards in self.guards.items() if guard in guards]

    def unguard(self) -> int:
        """Give back, as a Slot's death would have, each guarded slot whose guards all
        ended; forget guards that ended on slots still held. Returns how many came back."""
        cdef Py_ssize_t index
        cdef Py_ssize_t freed = 0
        cdef uint64_t word
        cdef uint64_t owner = <uint64_t>self.owner_pid
        if not self._owned() or not self.guards:
            return 0
        # Asked first: ended() reads a pipe, letting go of the GIL, and a fork in another
        # thread may add its guard to these lists meanwhile. Below, none is let go of
        # between a look at a list and the change made from it.
        ended = {id(guard) for guards in list(self.guards.values()) for guard in guards if guard.ended()}
        if not ended:
            return 0
        for index, guards in list(self.guards.items()):
            guards[:] = [guard for guard in guards if id(guard) not in ended]
            if guards or self.guards.get(index) is not guards:
                continue
            del self.guards[index]
            word = nf_load64(self.table._slot_word(index))
            if _state(word) != _GUARDED:
                continue
            self.guarded -= 1
            freed += 1
            if self.fence is None:
                self._make_free(index, word, _GUARDED)
            else:  # its copies to the GPU may still run: fenced as any slot given back
                self.table._change(index, _generation(word), _GUARDED, owner, _RETURNED, owner, False)
                self.fenced += 1
                self._settle_soon()
        return freed

    def reap(self, bint wait=False) -> None:
        """Free the fenced slots whose GPU work is done; with ``wait`` and no slot free, wait
        for the oldest fence first (letting go of the GIL: another thread may reap the same
        slots, each freed once), until FENCE_WAIT_S after its slot came back: then, none
        free still, PoolExhaustedError. Records no fence: one is recorded on the recording
        thread's current stream, which must be the main thread's (settle)."""
        cdef Py_ssize_t index
        cdef Py_ssize_t overdue = -1
        if not self._owned() or not self.fenced:
            return
        if wait and self.fences and _FREE not in self.table.states():
            index, fence = next(iter(self.fences.items()))
            if self._await_fence(index, fence) is False:
                overdue = index
        for index, fence in list(self.fences.items()):
            if fence.query():
                self._unfence(index, fence)
        if overdue >= 0 and _FREE not in self.table.states():
            raise self._overdue(overdue)

    def settle(self) -> bool:
        """Record the returned slots' fences and free the slots whose GPU work is done; a
        closed pool instead waits for its fences (until FENCE_WAIT_S after each slot came
        back: one overdue stays fenced, the memory kept, for a later settle to ask again),
        retires its free slots, and calls on_drained once every slot is retired. True once
        drained. A worker may lease a free slot even after close: the compare-and-swap
        that retires it then fails, and the memory goes only once every slot is retired,
        a state no process leaves.

        Python code runs inside a settle (a fence's question, a warning, the finalizers the
        collector runs at an allocation, and with them the pending call a returned slot
        queued), and so may another thread while a fence's wait lets go of the GIL. A
        settle entered meanwhile only asks the one running to look once more: run through,
        it could release the memory (on_drained) under the first, which then reads the
        unmapped slot table (a segfault, seen in a fault soak under load). What comes back
        during that second look is settled by the next settle (acquire, close, a loader's
        next batch, the pending call of a slot returned after it)."""
        if self.drained or not self._owned():
            return self.drained
        if self.settling:
            self.settle_again = True
            return False
        self.settling = True
        try:
            self.settle_again = False
            if not self._settle_once() and self.settle_again:
                self._settle_once()
            return self.drained
        finally:
            self.settling = False

    cdef bint _settle_once(self) except -1:
        """One look of :meth:`settle`."""
        cdef Py_ssize_t index
        cdef uint64_t word
        cdef bint retired = True
        cdef uint64_t state
        cdef object on_drained
        if not self.closed:
            # Workers lease only free slots: a fenced one must be freed by this process once
            # its copy is done, or the workers find every slot taken while the GPU idles.
            # A fence that cannot be asked (a CUDA error) stays: settle() runs as a pending
            # call, in whatever code the main thread runs, so acquire() and reap() raise it.
            try:
                self._fence_returned()
                self.reap()
            except Exception:
                pass
            return False
        self.guards.clear()  # a closed pool reuses no slot: its guarded ones retire below
        self._fence_returned()
        for index, fence in list(self.fences.items()):
            # A fence that cannot be asked now (this thread captures a CUDA graph) counts as
            # done: on_drained then releases the memory only after the capture, once a fence
            # past every stream that may read it is done (numafast.pool, _release_deferred).
            if self._await_fence(index, fence) is not False:
                self._unfence(index, fence)
        for index in range(self.table.count):
            while True:
                word = nf_load64(self.table._slot_word(index))
                state = _state(word)
                if not (state == _FREE or state == _GUARDED or state == _LEASED and self.abandoned) or \
                        self.table._change(index, _generation(word), state, _PID_BITS, _RETIRED, 0, False):
                    if state == _GUARDED and _state(nf_load64(self.table._slot_word(index))) == _RETIRED:
                        self.guarded -= 1  # a closed pool reuses no slot: nothing left to guard
                    break
            retired = retired and _state(nf_load64(self.table._slot_word(index))) == _RETIRED
        if retired:
            self.drained = True  # before on_drained runs: it is called once, even if it raises
            on_drained, self.on_drained = self.on_drained, None
            if on_drained is not None:
                on_drained()
        return self.drained

    def close(self) -> None:
        """Hand out no more slots, wake every waiter (it raises), then :meth:`settle`
        (workers' leases count as out). In a forked child, only marks this copy closed."""
        if not self.closed:
            self._shut()
            self.settle()

    def abandon(self) -> None:
        """Close as the owner is dropped (a finalizer, in any thread), without waiting: the
        memory goes once no slot of this process is out, workers' leases ignored (nobody
        is left to adopt them; a worker's own mapping keeps its writes valid)."""
        if self._owned():
            self.abandoned = True
            self._shut()
            self._settle_soon()

    cdef void _shut(self) noexcept:
        """Mark the pool closed and wake every waiter, under the mutex so that no waiter
        goes to sleep between its look at ``closed`` and the broadcast."""
        if not self._owned():
            self.closed = True  # no waiter of this copy exists to wake, and the mutex is not the child's
            return
        pthread_mutex_lock(&self.mutex)
        self.closed = True
        pthread_cond_broadcast(&self.returned)
        pthread_mutex_unlock(&self.mutex)

    def index_of(self, uintptr_t address) -> int:
        """The slot holding ``address``, or -1 when it is outside every slot."""
        cdef uintptr_t start = <uintptr_t>self.base
        cdef Py_ssize_t index
        if address < start:
            return -1
        index = <Py_ssize_t>((address - start) // self.table.stride)
        if index >= self.table.count or address - start - index * self.table.stride >= self.table.slot_bytes:
            return -1
        return index

    def __reduce__(self):
        raise TypeError(_NOT_PICKLED)


cdef int _settle_pending(void *pool) noexcept with gil:
    """SlotPool._settle_soon's pending call: settle() in the main thread, outside any
    deallocator. An exception, a signal handler's too (Ctrl-C, PyTorch's SIGCHLD handler
    for a dead worker), is left set and -1 returned: CPython raises it in the main
    thread's code (the pool settles again at its next look)."""
    cdef SlotPool slots = <SlotPool>pool
    Py_DECREF(slots)  # the reference _settle_soon took (the local holds one until the end)
    slots.settle_queued = False
    if nf_is_finalizing():
        # The interpreter is ending, its modules' globals already None (settle's Python
        # would fail on them): the kernel takes the mappings and files back at exit.
        return 0
    try:
        # A closed pool's settle waits for its fences and releases its memory: where the
        # main thread holds one of numafast's locks now (the pending call runs between any
        # two instructions), ``defer_settle(settle)`` keeps it for when that lock is let go.
        if slots.closed and slots.defer_settle is not None and slots.defer_settle(slots.settle):
            return 0
        slots.settle()
    except BaseException as error:
        PyErr_SetObject(type(error), error)
        return -1
    return 0


# ---------------------------------------------------------------- a seqlock in shared memory
#
# The pool board (numafast.pool_owner), a shared file its owner rewrites and workers
# read at every batch: word 0 a sequence number, the payload after it. A reader must
# never take a half-written payload, nor the new sequence with old words: a weakly
# ordered CPU (Arm) may make plain stores visible to another CPU in any order, and
# run loads ahead of each other. So, as in Boehm's "Can seqlocks get along with
# programming language memory models?" (2012): the writer stores an odd sequence, a
# release fence (every payload store after it), the payload, then the even sequence
# with release order (every payload store before it). The reader loads the sequence
# with acquire order, copies the payload, and an acquire fence keeps those loads
# before its second load of the sequence: the copy is whole when both saw the same
# even number. Payload words are relaxed atomics, so no word is torn either.

# A reader gives up (BlockingIOError) after this many tries that each found the writer
# at work: the writer holds its GIL through a write of a few hundred bytes, so only a
# writer stopped mid-write (SIGSTOP, a debugger) makes a reader wait longer.
cdef int _SEQLOCK_TRIES = 1000


cdef uint64_t *_seqlock_words(Py_buffer *view, Py_ssize_t payload) except NULL:
    if (<uintptr_t>view.buf) % 8 or view.len < 8 or payload % 8 or payload > view.len - 8:
        raise ValueError(f"a seqlock is 8-byte aligned words, the sequence then the payload: "
                         f"{payload} bytes of payload do not fit in {view.len} bytes at {<uintptr_t>view.buf:#x}")
    return <uint64_t *>view.buf


def seqlock_write(buf, bytes payload not None) -> int:
    """Write ``payload`` (whole 64-bit words) into the seqlock at the start of ``buf``;
    the new, even sequence number. One writer: the GIL, held throughout, keeps this
    process's threads apart; no other process may write."""
    cdef Py_buffer view
    cdef uint64_t *words
    cdef const uint64_t *source = <const uint64_t *>PyBytes_AS_STRING(payload)  # a bytes object's data: 8-byte aligned
    cdef uint64_t sequence
    cdef Py_ssize_t i
    _hold(buf, &view, True)
    try:
        words = _seqlock_words(&view, len(payload))
        sequence = nf_load64_relaxed(&words[0]) | 1  # odd: being written (only this process writes it)
        nf_store64_relaxed(&words[0], sequence)
        nf_fence_release()  # no payload store becomes visible before the odd sequence
        for i in range(len(payload) // 8):
            nf_store64_relaxed(&words[1 + i], source[i])
        nf_store64(&words[0], sequence + 1)  # release: the whole payload before the even sequence
        return <int64_t>(sequence + 1)
    finally:
        PyBuffer_Release(&view)


def seqlock_read(buf, Py_ssize_t payload, int64_t known) -> tuple:
    """``(sequence, payload)``: the first ``payload`` bytes of the seqlock at the start of
    ``buf``, one whole write's, or None while the sequence is still ``known``.
    BlockingIOError when every try found the writer at work."""
    cdef Py_buffer view
    cdef uint64_t *words
    cdef uint64_t *target = NULL
    cdef uint64_t first, second
    cdef Py_ssize_t i
    cdef int tries
    cdef bytes copy = None
    _hold(buf, &view, False)
    try:
        words = _seqlock_words(&view, payload)
        for tries in range(_SEQLOCK_TRIES):
            first = nf_load64(&words[0])  # acquire: the payload loads below stay after it
            if <int64_t>first == known:
                return <int64_t>first, None
            if first & 1:
                continue  # being written
            if copy is None:  # made only when there is something new to copy (a bytes object's data is 8-byte aligned)
                copy = PyBytes_FromStringAndSize(NULL, payload)
                target = <uint64_t *>PyBytes_AS_STRING(copy)
            for i in range(payload // 8):
                target[i] = nf_load64_relaxed(&words[1 + i])
            nf_fence_acquire()  # the payload loads above stay before the second look
            second = nf_load64_relaxed(&words[0])
            if first == second:
                return <int64_t>first, copy
        raise BlockingIOError(f"the seqlock was being written at each of {_SEQLOCK_TRIES} reads")
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------- shared counters
#
# A node's pinned budget (numafast.node_budget): words in a shared file that processes
# change with compare-and-swap or atomic add, each publishing its own bytes and then
# reading everyone's. That order must hold across CPUs for a store followed by loads
# of other words, which acquire and release do not give (two processes could each
# miss the other's add): these are sequentially consistent.

cdef extern from *:
    """
    static inline int nf_cas64_sc(uint64_t *word, uint64_t expected, uint64_t desired) {
        return __atomic_compare_exchange_n(word, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    static inline uint64_t nf_load64_sc(uint64_t *word) { return __atomic_load_n(word, __ATOMIC_SEQ_CST); }
    static inline uint64_t nf_add64_sc(uint64_t *word, uint64_t delta) {
        return __atomic_add_fetch(word, delta, __ATOMIC_SEQ_CST);
    }
    """
    bint nf_cas64_sc(uint64_t *word, uint64_t expected, uint64_t desired) nogil
    uint64_t nf_load64_sc(uint64_t *word) nogil
    uint64_t nf_add64_sc(uint64_t *word, uint64_t delta) nogil


cdef uint64_t *_shared_word(Py_buffer *view, Py_ssize_t index) except NULL:
    if (<uintptr_t>view.buf) % 8 or index < 0 or index >= view.len // 8:
        raise IndexError(f"word {index} of an 8-byte aligned buffer of {view.len} bytes at {<uintptr_t>view.buf:#x}")
    return &(<uint64_t *>view.buf)[index]


def shared_load(buf, Py_ssize_t index) -> int:
    """64-bit word ``index`` of ``buf`` (a shared mapping), loaded sequentially consistent."""
    cdef Py_buffer view
    _hold(buf, &view, True)
    try:
        return nf_load64_sc(_shared_word(&view, index))
    finally:
        PyBuffer_Release(&view)


def shared_cas(buf, Py_ssize_t index, uint64_t expected, uint64_t desired) -> bool:
    """Word ``index`` of ``buf`` from ``expected`` to ``desired`` in one compare-and-swap
    (sequentially consistent); False when it held something else."""
    cdef Py_buffer view
    _hold(buf, &view, True)
    try:
        return nf_cas64_sc(_shared_word(&view, index), expected, desired)
    finally:
        PyBuffer_Release(&view)


def shared_add(buf, Py_ssize_t index, int64_t delta) -> int:
    """Add ``delta`` to word ``index`` of ``buf`` atomically (sequentially consistent);
    the new value, as a signed 64-bit number."""
    cdef Py_buffer view
    _hold(buf, &view, True)
    try:
        return <int64_t>nf_add64_sc(_shared_word(&view, index), <uint64_t>delta)
    finally:
        PyBuffer_Release(&view)


_NOT_PICKLED = (
    "pool memory does not travel by pickle: it is page-locked (and CUDA-registered) in the process "
    "that made it. In a DataLoader, wrap the loader in numafast.torch.NumaLoader, whose workers write "
    "into the pool through its shared mapping; elsewhere, send the tensors (torch copies them into "
    "shared memory) or make a pool in the other process")


@cython.freelist(64)
@cython.no_gc_clear  # its deallocator gives the slot back to its pool (see the top of this file)
@cython.auto_pickle(False)
cdef class Slot:
    """One slot of a :class:`SlotPool` as writable bytes (buffer protocol), given back when
    this object is gone (see the top of this file). In a forked child it stays readable
    (the child's private copy)."""

    cdef SlotPool pool
    cdef readonly Py_ssize_t index
    cdef readonly size_t nbytes
    cdef readonly Py_ssize_t exports
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __init__(self) -> None:
        raise TypeError("a Slot comes from PinnedPool.acquire()")

    @staticmethod
    cdef Slot _wrap(SlotPool pool, Py_ssize_t index, size_t nbytes):
        cdef Slot slot = Slot.__new__(Slot)
        slot.pool = pool
        slot.index = index
        slot.nbytes = nbytes
        slot.shape[0] = <Py_ssize_t>nbytes
        slot.strides[0] = 1
        return slot

    @property
    def address(self) -> int:
        """Where this slot's memory starts."""
        return <uintptr_t>(self.pool.base + self.index * self.pool.table.stride)

    @property
    def capacity(self) -> int:
        """The pool's slot size: the most bytes this slot can hold."""
        return self.pool.table.slot_bytes

    def __getbuffer__(self, Py_buffer *view, int flags):
        view.buf = self.pool.base + self.index * self.pool.table.stride
        view.obj = self
        view.len = <Py_ssize_t>self.nbytes
        view.readonly = 0
        view.itemsize = 1
        view.format = _FORMAT_BYTES if flags & PyBUF_FORMAT else NULL
        view.ndim = 1
        view.shape = self.shape if flags & PyBUF_ND else NULL
        view.strides = self.strides if flags & PyBUF_STRIDES else NULL
        view.suboffsets = NULL
        view.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1

    def __dealloc__(self):
        if self.pool is not None:  # None in a Slot that _wrap did not make (Slot() raises after allocating it)
            self.pool._give_back(self.index)

    def __reduce__(self):
        raise TypeError(_NOT_PICKLED)

    def __repr__(self) -> str:
        return (f"<Slot {self.index}: {self.nbytes} of {self.pool.table.slot_bytes} bytes at "
                f"{self.address:#x}, {self.exports} exports>")
