# Pinned pools: page locking (mlock, munlock), and the slot bookkeeping of a pool:
# one mapping cut into equal slots, a free slot handed out in O(1), and a slot given
# back by the extension itself when the last object viewing it is gone.
#
# Why the Slot object, not the count of buffer exports, decides when a slot is free:
# a NumPy array or memoryview holds a buffer export of the Slot, and an export holds
# a reference to it; torch.frombuffer releases its export at once and keeps only a
# reference. Both keep the Slot alive, so its tp_dealloc (run by the interpreter when
# the last reference goes, with no finalizer ordering to guess) is the moment that
# no array or tensor views the slot any more. The exports are still counted, for
# repr and for the tests.

cimport cython
from cpython.exc cimport PyErr_CheckSignals

for _name, _value in {"MADV_DONTFORK": MADV_DONTFORK, "MADV_DOFORK": MADV_DOFORK}.items():
    globals()[_name] = _value
del _name, _value


def mlock(buf) -> None:
    """mlock(2): keep every page ``buf`` touches resident (never swapped out), faulting
    in any that is not yet there.

    Fails with ENOMEM (or EPERM when the limit is 0) beyond RLIMIT_MEMLOCK unless the
    process has CAP_IPC_LOCK. Locking does not stop the kernel from migrating a page
    to another frame; a page pinned for DMA (cudaHostRegister) cannot move at all.
    """
    cdef Py_buffer view
    cdef char *first
    cdef size_t pages
    cdef int rc, err
    _hold(buf, &view, False)
    try:
        pages = _pages_of(&view, False, &first)
        with nogil:  # locking faults in any missing page: it can take a while
            libc_errno.errno = 0
            rc = numa_api.mlock(first, pages * _PAGE)
            err = libc_errno.errno
        if rc != 0:
            _fail("mlock", err, f"{pages * _PAGE} bytes at {<uintptr_t>first:#x}")
    finally:
        PyBuffer_Release(&view)


def munlock(buf) -> None:
    """munlock(2): let every page ``buf`` touches be swapped again."""
    cdef Py_buffer view
    cdef char *first
    cdef size_t pages
    cdef int rc, err
    _hold(buf, &view, False)
    try:
        pages = _pages_of(&view, False, &first)
        with nogil:
            libc_errno.errno = 0
            rc = numa_api.munlock(first, pages * _PAGE)
            err = libc_errno.errno
        if rc != 0:
            _fail("munlock", err, f"{pages * _PAGE} bytes at {<uintptr_t>first:#x}")
    finally:
        PyBuffer_Release(&view)


cdef double _monotonic() noexcept nogil:
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return now.tv_sec + now.tv_nsec * 1e-9


cdef timespec _deadline_in(double seconds) noexcept nogil:
    cdef double at = _monotonic() + seconds
    cdef timespec deadline
    deadline.tv_sec = <time_t>at
    deadline.tv_nsec = <long>((at - deadline.tv_sec) * 1e9)
    return deadline


# How long one wait for a returned slot lasts before the waiter looks at signals
# (Ctrl-C) and at fences again.
cdef double _WAIT_STEP_S = 0.05
cdef double _FENCE_POLL_S = 0.0005

cdef enum _SlotState:
    _FREE = 0
    _HELD = 1      # handed out: a Slot object exists for it
    _FENCED = 2    # given back while GPU work queued on it may still run
    _LOST = 3      # given back, but no fence could be recorded: never reused


@cython.auto_pickle(False)
cdef class SlotPool:
    """``count`` equal slots of ``slot_bytes`` each, ``stride`` bytes apart, in ``region``.

    :meth:`acquire` hands out a free slot in O(1) as a :class:`Slot`, which exports the
    slot's memory; the slot comes back when that Slot object is gone (see the top of
    this file). ``fence``, when given, is called as ``fence(index)`` as a slot comes
    back and returns an object with ``query()`` and ``synchronize()`` (CUDA events on
    the streams that read the slot): the slot is reused only once it is done.
    ``on_drained()`` is called exactly once, when the pool is closed (or collected)
    and no slot is out any more: that is when the memory may be released.

    The free list is guarded by a pthread mutex that no holder keeps across a Python
    call or a GIL acquisition, so a waiting acquirer can sleep on the condition with
    the GIL released while any thread gives slots back. After fork(), the child's
    copy of a pool refuses to hand out slots: the mapping was made MADV_DONTFORK.
    """

    cdef MappedBuffer region
    cdef char *base
    cdef readonly size_t slot_bytes
    cdef readonly size_t stride
    cdef readonly Py_ssize_t count
    cdef Py_ssize_t *free_stack
    cdef Py_ssize_t free_count
    cdef unsigned char *state
    cdef readonly Py_ssize_t in_use
    cdef readonly Py_ssize_t peak
    cdef readonly Py_ssize_t fenced
    cdef readonly Py_ssize_t lost
    cdef readonly unsigned long long acquired
    cdef readonly unsigned long long waits
    cdef readonly double waited_seconds
    cdef object fence
    cdef list fences
    cdef list fence_order
    cdef object on_drained
    cdef readonly pid_t owner_pid
    cdef readonly bint closed
    cdef bint is_drained
    cdef bint sync_ready
    cdef pthread_mutex_t mutex
    cdef pthread_cond_t returned

    def __cinit__(self, MappedBuffer region not None, size_t slot_bytes, Py_ssize_t count,
                  fence=None, on_drained=None):
        cdef pthread_condattr_t attributes
        cdef Py_ssize_t i
        if slot_bytes == 0 or count <= 0:
            raise ValueError(f"a pool needs slots of at least 1 byte and at least 1 slot, not {count} x {slot_bytes}")
        if region.address == NULL:
            raise ValueError("the region was already freed")
        self.stride = (slot_bytes + _PAGE - 1) & ~(_PAGE - 1)
        if self.stride < slot_bytes or <size_t>count > region.size // self.stride:
            raise ValueError(f"{count} slots of {slot_bytes} bytes ({self.stride} with page rounding) "
                             f"do not fit in a region of {region.size} bytes")
        self.region = region
        self.base = region.address
        self.slot_bytes = slot_bytes
        self.count = count
        self.free_stack = <Py_ssize_t *>malloc(count * sizeof(Py_ssize_t))
        self.state = <unsigned char *>calloc(count, sizeof(unsigned char))
        if self.free_stack == NULL or self.state == NULL:
            raise MemoryError("SlotPool: slot tables")
        for i in range(count):  # slot 0 on top
            self.free_stack[i] = count - 1 - i
        self.free_count = count
        self.fence = fence
        self.fences = [None] * count if fence is not None else []
        self.fence_order = []
        self.on_drained = on_drained
        self.owner_pid = getpid()
        pthread_mutex_init(&self.mutex, NULL)
        pthread_condattr_init(&attributes)
        pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC)
        pthread_cond_init(&self.returned, &attributes)
        pthread_condattr_destroy(&attributes)
        self.sync_ready = True

    def __dealloc__(self):
        # No Slot is out (each holds a reference); fenced slots may still be in flight.
        if self.owner_pid == getpid() and not self.is_drained:
            try:
                self._settle_fences()
            finally:
                self._drain()
        if self.sync_ready:
            pthread_cond_destroy(&self.returned)
            pthread_mutex_destroy(&self.mutex)
        free(self.free_stack)
        free(self.state)

    @property
    def address(self) -> int:
        """Where slot 0 starts; slot i starts ``i * stride`` bytes later."""
        return <uintptr_t>self.base

    @property
    def free_slots(self) -> int:
        """Slots ready to be handed out now."""
        return self.free_count

    cdef int _check_owner(self) except -1:
        if self.owner_pid != getpid():
            raise RuntimeError(
                f"this pool belongs to process {self.owner_pid}; its memory is not mapped in this "
                "forked child (MADV_DONTFORK): make a new pool in the child")
        return 0

    def acquire(self, size_t nbytes, double timeout=-1.0) -> Slot:
        """A free slot exporting its first ``nbytes`` bytes (at most ``slot_bytes``).

        When none is free: wait up to ``timeout`` seconds (< 0: as long as it takes) for
        one to come back, then TimeoutError; RuntimeError once the pool is closed.
        """
        cdef Py_ssize_t index = -1
        self._check_owner()
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit in a slot of {self.slot_bytes} bytes")
        # With the GIL held: no holder of this mutex ever waits for the GIL.
        pthread_mutex_lock(&self.mutex)
        if not self.closed and self.free_count:
            self.free_count -= 1
            index = self.free_stack[self.free_count]
            self._hand_out(index)
        pthread_mutex_unlock(&self.mutex)
        if index < 0:
            index = self._wait_for_slot(timeout)
        return Slot._wrap(self, index, nbytes)

    cdef inline void _hand_out(self, Py_ssize_t index) noexcept:
        """Bookkeeping of a slot taken off the free stack (mutex held)."""
        self.state[index] = _HELD
        self.in_use += 1
        self.acquired += 1
        if self.in_use > self.peak:
            self.peak = self.in_use

    cdef Py_ssize_t _wait_for_slot(self, double timeout) except -1:
        cdef double start = _monotonic()
        cdef double remaining, step
        cdef timespec deadline
        cdef Py_ssize_t index = -1
        cdef bint counted = False
        try:
            while True:
                if self.fenced:
                    self._reap_fences(timeout < 0)
                pthread_mutex_lock(&self.mutex)
                if self.closed:
                    pthread_mutex_unlock(&self.mutex)
                    raise RuntimeError("the pool was closed while waiting for a slot")
                if self.free_count:
                    self.free_count -= 1
                    index = self.free_stack[self.free_count]
                    self._hand_out(index)
                    pthread_mutex_unlock(&self.mutex)
                    return index
                pthread_mutex_unlock(&self.mutex)
                if not counted:
                    counted = True
                    self.waits += 1
                remaining = start + timeout - _monotonic() if timeout >= 0 else _WAIT_STEP_S
                if remaining <= 0:
                    raise TimeoutError(f"all {self.count} slots in use ({self.in_use} held, "
                                       f"{self.fenced} in flight) after {timeout:g} s")
                step = min(remaining, _FENCE_POLL_S if self.fenced else _WAIT_STEP_S)
                with nogil:
                    pthread_mutex_lock(&self.mutex)
                    if not self.free_count and not self.closed:
                        deadline = _deadline_in(step)
                        pthread_cond_timedwait(&self.returned, &self.mutex, &deadline)
                    # Let go of the mutex before taking the GIL back (see the class doc).
                    pthread_mutex_unlock(&self.mutex)
                PyErr_CheckSignals()  # Ctrl-C ends a long wait
        finally:
            if counted:
                self.waited_seconds += _monotonic() - start

    cdef int _reap_fences(self, bint block_on_oldest) except -1:
        """Free the fenced slots whose GPU work is done; with ``block_on_oldest`` and
        none free, wait for the oldest first (the fence releases the GIL meanwhile,
        so another thread may reap the same slots: each is freed by one of them)."""
        cdef Py_ssize_t index
        cdef object fence
        if block_on_oldest and not self.free_count and self.fence_order:
            fence = self.fences[self.fence_order[0]]
            if fence is not None:
                fence.synchronize()
        for index in list(self.fence_order):
            fence = self.fences[index]
            if fence is not None and fence.query():
                self._unfence(index, fence)
        return 0

    cdef void _unfence(self, Py_ssize_t index, object fence):
        """Free a fenced slot whose fence is done, unless another thread just did."""
        if self.fences[index] is fence:
            self.fences[index] = None
            self.fence_order.remove(index)
            self._make_free(index, _FENCED)

    cdef void _make_free(self, Py_ssize_t index, _SlotState was) noexcept:
        pthread_mutex_lock(&self.mutex)
        self.state[index] = _FREE
        self.free_stack[self.free_count] = index
        self.free_count += 1
        if was == _FENCED:
            self.fenced -= 1
        elif was == _HELD:
            self.in_use -= 1
        pthread_cond_signal(&self.returned)
        pthread_mutex_unlock(&self.mutex)

    cdef int _give_back(self, Py_ssize_t index) except -1:
        """A Slot object died (GIL held): its slot is free, or fenced until its GPU work ends."""
        cdef object fence = None
        if self.owner_pid != getpid():
            return 0  # a forked child's copy: nothing of the parent's to give back
        if self.fence is not None:
            try:
                fence = self.fence(index)
                if self.closed:  # nothing will reap it: wait now, before the memory goes
                    fence.synchronize()
                    fence = None
            except BaseException as error:
                # Without a fence nobody can tell when the GPU is done with the slot:
                # never hand it out again rather than risk overwriting a copy in flight.
                self.state[index] = _LOST
                self.lost += 1
                self.in_use -= 1
                import warnings
                warnings.warn(f"slot {index} is retired: its fence could not be recorded ({error!r})",
                              RuntimeWarning, stacklevel=1)
                return 0
        if fence is None:
            self._make_free(index, _HELD)
        else:
            self.fences[index] = fence
            self.fence_order.append(index)
            pthread_mutex_lock(&self.mutex)
            self.state[index] = _FENCED
            self.fenced += 1
            self.in_use -= 1
            pthread_mutex_unlock(&self.mutex)
        if self.closed and self.in_use == 0:
            self._drain()
        return 0

    cdef int _settle_fences(self) except -1:
        """Wait for every fenced slot's GPU work and free it."""
        cdef Py_ssize_t index
        cdef object fence
        for index in list(self.fence_order):
            fence = self.fences[index]
            if fence is not None:
                fence.synchronize()
                self._unfence(index, fence)
        return 0

    cdef int _drain(self) except -1:
        cdef object on_drained = self.on_drained
        if self.is_drained:
            return 0
        self.is_drained = True
        self.on_drained = None
        if on_drained is not None:
            on_drained()
        return 0

    def close(self) -> None:
        """Hand out no more slots; wake every waiter (it raises); wait for the GPU work
        on fenced slots; call on_drained now if no slot is out, else when the last one
        comes back. In a forked child, only marks this copy closed."""
        if self.closed:
            return
        pthread_mutex_lock(&self.mutex)
        self.closed = True
        pthread_cond_broadcast(&self.returned)
        pthread_mutex_unlock(&self.mutex)
        if self.owner_pid != getpid():
            return
        self._settle_fences()
        if self.in_use == 0:
            self._drain()

    @property
    def drained(self) -> bool:
        """True once on_drained has run."""
        return self.is_drained

    def index_of(self, uintptr_t address) -> int:
        """The slot holding ``address``, or -1 when it is outside every slot."""
        cdef uintptr_t start = <uintptr_t>self.base
        cdef Py_ssize_t index
        if address < start:
            return -1
        index = <Py_ssize_t>((address - start) // self.stride)
        if index >= self.count or address - start - index * self.stride >= self.slot_bytes:
            return -1
        return index


@cython.freelist(64)
@cython.auto_pickle(False)
cdef class Slot:
    """One slot of a :class:`SlotPool`, handed out by ``acquire()``: its memory as
    writable bytes (buffer protocol). The slot goes back to the pool when this object
    is gone, which is never before the last array, memoryview or tensor over it."""

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
        return <uintptr_t>(self.pool.base + self.index * self.pool.stride)

    @property
    def capacity(self) -> int:
        """The pool's slot size: the most bytes this slot can hold."""
        return self.pool.slot_bytes

    def __getbuffer__(self, Py_buffer *view, int flags):
        if self.pool.owner_pid != getpid():
            raise BufferError("this slot's memory is not mapped in a forked child (MADV_DONTFORK)")
        view.buf = self.pool.base + self.index * self.pool.stride
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
        if self.pool is not None:
            self.pool._give_back(self.index)

    def __repr__(self) -> str:
        return (f"<Slot {self.index}: {self.nbytes} of {self.pool.slot_bytes} bytes at "
                f"{self.address:#x}, {self.exports} exports>")
