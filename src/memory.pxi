# Memory: anonymous mappings that own their pages, madvise, mbind, move_pages,
# numa_alloc_onnode, and the parallel pre-touch that faults a mapping in from its node's CPUs.
#
# Every call that takes a buffer holds it (PyObject_GetBuffer) for the whole call,
# GIL released: the exporter cannot free or resize the memory meanwhile (a
# MappedBuffer or mmap refuses to close, a bytearray to resize), so another
# thread can never pull the pages from under a system call. Calls that change a
# policy or contents work on the whole pages inside the buffer; queries on every
# page the buffer touches.

from cpython cimport array
from cpython.buffer cimport (
    PyBUF_ANY_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_ND,
    PyBUF_STRIDES,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.errno cimport EINVAL
from libc.stdint cimport uintptr_t
from libc.stdlib cimport calloc, free, malloc

cimport numa_api  # the raw calls whose names the mirrors below take

import array as py_array

cdef size_t _PAGE = <size_t>numa_pagesize()
cdef array.array _INT_ARRAY = py_array.array("i")
# move_pages(2) batch: bounds the page-address array we allocate for a big buffer.
cdef size_t _MOVE_BATCH = 1 << 16
cdef char *_FORMAT_BYTES = "B"  # struct format of the exported memory: unsigned bytes

# mbind's flags (uapi/linux/mempolicy.h; policy.pxi publishes the modes) and the
# madvise advice this module uses, published under their C names (the dict: `MPOL_MF_MOVE = MPOL_MF_MOVE`
# would name the C constant on both sides).
for _name, _value in {
    "MPOL_MF_STRICT": MPOL_MF_STRICT,
    "MPOL_MF_MOVE": MPOL_MF_MOVE,
    "MPOL_MF_MOVE_ALL": MPOL_MF_MOVE_ALL,
    "MADV_HUGEPAGE": MADV_HUGEPAGE,
    "MADV_NOHUGEPAGE": MADV_NOHUGEPAGE,
    "MADV_POPULATE_WRITE": MADV_POPULATE_WRITE,
    "MADV_COLD": MADV_COLD,
}.items():
    globals()[_name] = _value
del _name, _value


cdef extern from *:
    """
    /* One write per page that keeps its contents: an atomic OR with 0 is a single
       write access, so the page is faulted in writable at once (a plain read would
       first map the shared zero page and fault a second time). */
    static void numafast_touch_pages(char *start, size_t length, size_t step) {
        for (size_t offset = 0; offset < length; offset += step)
            __atomic_fetch_or(start + offset, 0, __ATOMIC_RELAXED);
    }
    """
    void numafast_touch_pages(char *start, size_t length, size_t step) nogil


cdef size_t _pages_of(const Py_buffer *view, bint whole_pages_only, char **first_page) noexcept:
    """Pages of a held buffer: all it touches, or only those wholly inside it."""
    cdef uintptr_t begin = <uintptr_t>view.buf
    cdef uintptr_t end = begin + <uintptr_t>view.len
    if whole_pages_only:
        begin = (begin + _PAGE - 1) & ~(<uintptr_t>_PAGE - 1)
        end &= ~(<uintptr_t>_PAGE - 1)
    else:
        begin &= ~(<uintptr_t>_PAGE - 1)
        end = (end + _PAGE - 1) & ~(<uintptr_t>_PAGE - 1)
    first_page[0] = <char *>begin
    return (end - begin) // _PAGE if end > begin else 0


cdef int _hold(object buf, Py_buffer *view, bint writable) except -1:
    """PyObject_GetBuffer of any contiguous buffer (writable when asked); release with PyBuffer_Release."""
    return PyObject_GetBuffer(buf, view, PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0))


# ---------------------------------------------------------------- the memory-owning buffer

cdef class MappedBuffer:
    """Memory this module mapped (mmap_anonymous, mmap_shared, alloc_onnode), exported as writable bytes.

    Every NumPy array, memoryview or tensor made over it holds an export, and each
    export holds a reference: the memory is unmapped exactly once, when the last of
    them is gone (or by ``free()``, which refuses while any export lives).
    """

    cdef char *address
    cdef size_t size          # bytes exported
    cdef size_t mapped        # bytes mapped: size rounded up to whole pages
    cdef bint from_libnuma    # numa_alloc_onnode's memory goes back through numa_free
    cdef Py_ssize_t exports
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef object __weakref__

    def __init__(self) -> None:
        raise TypeError("MappedBuffer is made by mmap_anonymous(), mmap_shared() or alloc_onnode()")

    @staticmethod
    cdef MappedBuffer _wrap(char *address, size_t size, size_t mapped, bint from_libnuma):
        cdef MappedBuffer owner = MappedBuffer.__new__(MappedBuffer)
        owner.address = address
        owner.size = size
        owner.mapped = mapped
        owner.from_libnuma = from_libnuma
        owner.shape[0] = <Py_ssize_t>size
        owner.strides[0] = 1
        return owner

    @property
    def address(self) -> int:
        """Start of the memory (0 once freed)."""
        return <uintptr_t>self.address

    @property
    def size(self) -> int:
        """Bytes exported (the mapping itself is rounded up to whole pages)."""
        return self.size

    @property
    def freed(self) -> bool:
        return self.address == NULL

    @property
    def exports(self) -> int:
        """Buffer views that hold this memory now."""
        return self.exports

    def __getbuffer__(self, Py_buffer *view, int flags):
        if self.address == NULL:
            raise ValueError("this MappedBuffer was already freed")
        view.buf = self.address
        view.obj = self
        view.len = <Py_ssize_t>self.size
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = _FORMAT_BYTES
        view.ndim = 1
        view.shape = self.shape if flags & PyBUF_ND else NULL
        view.strides = self.strides if flags & PyBUF_STRIDES else NULL
        view.suboffsets = NULL
        view.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1

    def free(self) -> None:
        """Unmap now. BufferError while views hold the memory; freeing twice is a no-op."""
        cdef uintptr_t address = <uintptr_t>self.address
        cdef int err
        if self.exports:
            raise BufferError(f"{self.exports} views still use this memory; it is freed when they are gone")
        err = self._unmap()
        if err:
            _fail("munmap", err, f"{self.mapped} bytes at {address:#x}")

    cdef int _unmap(self) noexcept:
        """Give the memory back once, GIL released (freeing gigabytes takes a while);
        0, or the errno of a failed munmap."""
        cdef char *address = self.address
        cdef int err = 0
        if address == NULL:
            return 0
        self.address = NULL
        with nogil:
            if self.from_libnuma:
                numa_free(address, self.mapped)
            else:
                libc_errno.errno = 0
                if numa_api.munmap(address, self.mapped) != 0:
                    err = libc_errno.errno
        return err

    def __dealloc__(self):
        # Every export holds a reference, so none is left here.
        self._unmap()

    def __repr__(self) -> str:
        if self.address == NULL:
            return "<MappedBuffer freed>"
        return f"<MappedBuffer {self.size} bytes at {<uintptr_t>self.address:#x}, {self.exports} views>"


def mmap_anonymous(size_t size, size_t alignment=0) -> MappedBuffer:
    """mmap(2) of ``size`` bytes of private anonymous memory, read-write, starting at a
    multiple of ``alignment`` (a power of two; 0 = the page size).

    Aligning to the huge-page size lets the kernel back the mapping with transparent
    huge pages from its first byte (kernels before 6.7 align only to pages).
    """
    return _map("mmap", size, alignment, MAP_PRIVATE | MAP_ANONYMOUS, -1)


def mmap_shared(size_t size, int fd, size_t alignment=0) -> MappedBuffer:
    """mmap(2) of the first ``size`` bytes of file ``fd`` (a memfd), shared and read-write,
    starting at a multiple of ``alignment``.

    Every process that maps the same file sees the same pages: a forked or spawned
    DataLoader worker writes a batch that the main process reads without a copy.
    A memory policy set with mbind on such a mapping is kept on the file itself (the
    kernel's shared policy of a shmem object), so it places the pages whichever
    process faults them in.
    """
    return _map("mmap of a shared file", size, alignment, MAP_SHARED, fd)


cdef MappedBuffer _map(str call, size_t size, size_t alignment, int flags, int fd):
    cdef size_t length, extra, head
    cdef char *start
    cdef char *aligned
    cdef int err = 0
    if size == 0:
        raise ValueError(f"{call} of 0 bytes")
    if alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} is not a power of two")
    extra = alignment - _PAGE if alignment > _PAGE else 0
    if size > (<size_t>-1) - extra - _PAGE:
        raise MemoryError(f"{call} of {size} bytes: larger than the address space")
    length = (size + _PAGE - 1) & ~(_PAGE - 1)
    with nogil:
        libc_errno.errno = 0
        if not extra:
            start = <char *>numa_api.mmap(NULL, length, PROT_READ | PROT_WRITE, flags, fd, 0)
            err = libc_errno.errno
        else:
            # Reserve `extra` bytes more, map at the aligned address inside the
            # reservation, then give back the unaligned head and the tail.
            start = <char *>numa_api.mmap(NULL, length + extra, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            err = libc_errno.errno
            if start != <char *>MAP_FAILED:
                aligned = <char *>((<uintptr_t>start + alignment - 1) & ~(<uintptr_t>alignment - 1))
                head = <size_t>(aligned - start)
                if head:
                    numa_api.munmap(start, head)
                if extra - head:
                    numa_api.munmap(aligned + length, extra - head)
                start = <char *>numa_api.mmap(aligned, length, PROT_READ | PROT_WRITE, flags | MAP_FIXED, fd, 0)
                err = libc_errno.errno
                if start == <char *>MAP_FAILED:
                    numa_api.munmap(aligned, length)
    if start == <char *>MAP_FAILED:
        _fail(call, err, f"{size} bytes")
    return MappedBuffer._wrap(start, size, length, False)


def alloc_onnode(size_t size, int node) -> MappedBuffer:
    """numa_alloc_onnode(): ``size`` bytes bound to ``node``, not yet touched; freed by numa_free."""
    cdef void *start
    cdef int err
    if size == 0:
        raise ValueError("numa_alloc_onnode of 0 bytes")
    with nogil:
        libc_errno.errno = 0
        start = numa_alloc_onnode(size, node)
        err = libc_errno.errno
    if start == NULL:
        _fail("numa_alloc_onnode", err, f"{size} bytes on node {node}")
    return MappedBuffer._wrap(<char *>start, size, size, True)


# ---------------------------------------------------------------- calls on any buffer

def madvise(buf, int advice) -> None:
    """madvise(2) with ``advice`` over the whole pages inside the writable buffer ``buf``."""
    cdef Py_buffer view
    cdef char *first
    cdef size_t pages
    cdef int rc, err
    _hold(buf, &view, True)
    try:
        pages = _pages_of(&view, True, &first)
        with nogil:
            libc_errno.errno = 0
            rc = numa_api.madvise(first, pages * _PAGE, advice)
            err = libc_errno.errno
        if rc != 0:
            _fail("madvise", err, f"advice {advice}, {pages} pages at {<uintptr_t>first:#x}")
    finally:
        PyBuffer_Release(&view)


def mbind(buf, int mode, nodes, unsigned int flags=0) -> None:
    """mbind(2): memory policy ``mode`` over ``nodes`` for the whole pages inside ``buf``.

    With MPOL_MF_MOVE in ``flags`` the pages already there move to fit the policy;
    with MPOL_MF_STRICT as well, pages that could not be moved make it fail with EIO.
    """
    cdef Py_buffer view
    cdef bitmask *mask = NULL
    cdef char *first
    cdef size_t pages
    cdef long rc
    cdef int err
    _hold(buf, &view, True)
    try:
        mask = _nodemask_from(nodes)
        pages = _pages_of(&view, True, &first)
        with nogil:
            libc_errno.errno = 0
            # maxnode counts one past the highest bit, as libnuma passes it.
            rc = numa_api.mbind(first, pages * _PAGE, mode, mask.maskp, mask.size + 1, flags)
            err = libc_errno.errno
        if rc != 0:
            _fail("mbind", err, f"mode {mode}, nodes {list(nodes)}, flags {flags:#x}, {pages} pages")
    finally:
        if mask != NULL:
            numa_bitmask_free(mask)
        PyBuffer_Release(&view)


def move_pages(buf, node=None, int flags=0, bint whole_pages_only=False, int pid=0) -> array.array:
    """move_pages(2) over the pages of ``buf``: all it touches, or only those wholly inside it.

    With ``node`` None it moves nothing (nodes=NULL) and the status of each page is
    the node it is on, or -ENOENT (never touched) / -EFAULT (only read: the shared
    zero page). Otherwise each page moves to ``node`` (an int, or a sequence of
    ints, one per page; ``buf`` must be writable) and its status is the node it is
    on after, or -errno (-EBUSY: in use, try again). Returns the statuses as an
    array('i'), one per page, in address order.
    """
    cdef Py_buffer view
    cdef char *first
    cdef size_t pages, done, count, i
    cdef void **addresses = NULL
    cdef int *targets = NULL
    cdef array.array per_page = None
    cdef int target = -1
    cdef array.array status
    cdef long rc = 0
    cdef int err = 0
    _hold(buf, &view, node is not None)
    try:
        pages = _pages_of(&view, whole_pages_only, &first)
        if isinstance(node, int):
            target = <int>node
        elif node is not None:
            per_page = py_array.array("i", node)
            if <size_t>len(per_page) != pages:
                raise ValueError(f"{len(per_page)} target nodes for {pages} pages")
        status = array.clone(_INT_ARRAY, pages, False)
        addresses = <void **>malloc(min(pages, _MOVE_BATCH) * sizeof(void *) + 1)
        if node is not None:
            targets = <int *>malloc(min(pages, _MOVE_BATCH) * sizeof(int) + 1)
        if addresses == NULL or (node is not None and targets == NULL):
            raise MemoryError("move_pages: page address array")
        with nogil:
            done = 0
            while done < pages:
                count = min(pages - done, _MOVE_BATCH)
                for i in range(count):
                    addresses[i] = first + (done + i) * _PAGE
                    if targets != NULL:
                        targets[i] = per_page.data.as_ints[done + i] if per_page is not None else target
                libc_errno.errno = 0
                rc = numa_api.move_pages(pid, count, addresses, targets,
                                         status.data.as_ints + done, flags)
                err = libc_errno.errno
                if rc < 0:
                    break
                done += count
        if rc < 0:
            detail = "nodes per page" if per_page is not None else f"node {node}"
            _fail("move_pages", err, f"{pages} pages at {<uintptr_t>first:#x}, {detail}")
        return status
    finally:
        free(addresses)
        free(targets)
        PyBuffer_Release(&view)


# ---------------------------------------------------------------- jobs on pinned threads
# The parallel pre-touch here and the gather copy of copy.pxi split their work into
# jobs, one per thread, each thread pinned to the target node's CPUs first.

cdef struct _ThreadJob:
    # The first member of every job struct that _run_jobs runs.
    bitmask *cpus       # pin the thread to these first; NULL: run where started


cdef void _pin_thread(const _ThreadJob *job) noexcept nogil:
    if job.cpus != NULL:
        # Best effort: mbind decides where a page lands, whoever touches it; pinning
        # only has the work done from CPUs near the memory. A cpuset that forbids
        # these CPUs leaves the thread where it was.
        numa_sched_setaffinity(0, job.cpus)


cdef void _run_jobs(void *(*work)(void *) noexcept nogil, char *jobs, size_t job_size, int count) noexcept nogil:
    """work(job) for each of ``count`` jobs laid out ``job_size`` bytes apart, one
    pthread each, all joined before returning. One job with no CPUs to pin to runs
    in the caller; a job whose thread cannot be started (no memory, a thread limit)
    runs in the caller too, unpinned, so that the work is always done."""
    cdef pthread_t *handles
    cdef int i
    if count == 1 and (<_ThreadJob *>jobs).cpus == NULL:
        work(jobs)
        return
    handles = <pthread_t *>calloc(count, sizeof(pthread_t))
    for i in range(count):
        if handles == NULL or pthread_create(&handles[i], NULL, work, jobs + i * job_size) != 0:
            if handles != NULL:
                handles[i] = 0
            (<_ThreadJob *>(jobs + i * job_size)).cpus = NULL
            work(jobs + i * job_size)
    if handles != NULL:
        for i in range(count):
            if handles[i]:
                pthread_join(handles[i], NULL)
        free(handles)


# ---------------------------------------------------------------- parallel pre-touch

cdef struct _TouchJob:
    _ThreadJob thread
    char *start
    size_t length
    int populated       # out: 1 when MADV_POPULATE_WRITE did the work
    int err             # out: errno of a failed madvise, 0 when fine


cdef void *_touch(void *arg) noexcept nogil:
    cdef _TouchJob *job = <_TouchJob *>arg
    cdef int err
    _pin_thread(&job.thread)
    libc_errno.errno = 0
    if numa_api.madvise(job.start, job.length, MADV_POPULATE_WRITE) == 0:
        job.populated = 1
        return NULL
    err = libc_errno.errno
    if err != EINVAL:
        job.err = err
        return NULL
    # EINVAL: a kernel before 5.14 has no MADV_POPULATE_WRITE; fault page by page.
    numafast_touch_pages(job.start, job.length, _PAGE)
    return NULL


def pretouch(buf, cpus, int threads, size_t alignment=0) -> str:
    """Fault in every page ``buf`` touches from ``threads`` threads pinned to ``cpus``.

    Each thread takes one slice (a multiple of ``alignment``, e.g. the huge-page
    size, so no huge page is split between threads; with no ``cpus`` and one thread
    the caller does it) and populates it with
    madvise(MADV_POPULATE_WRITE), or on kernels before 5.14 with one write per page
    that keeps its contents: neither changes a byte, so the partial pages at the
    ends (shared with neighbouring memory) are safe to include. Returns which of
    the two did the work.
    """
    cdef Py_buffer view
    cdef bitmask *mask = NULL
    cdef _TouchJob *jobs = NULL
    cdef char *first
    cdef size_t total, chunk, offset
    cdef int count = 0, i
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    _hold(buf, &view, True)
    try:
        total = _pages_of(&view, False, &first) * _PAGE
        if cpus:
            mask = _cpumask_from(cpus)
        alignment = max(alignment, _PAGE)
        chunk = (total // <size_t>threads + alignment - 1) & ~(alignment - 1)
        chunk = max(chunk, alignment)
        jobs = <_TouchJob *>calloc(threads, sizeof(_TouchJob))
        if jobs == NULL:
            raise MemoryError("pretouch: thread table")
        offset = 0
        while offset < total and count < threads:
            jobs[count].start = first + offset
            jobs[count].length = min(chunk, total - offset)
            jobs[count].thread.cpus = mask
            offset += jobs[count].length
            count += 1
        with nogil:
            _run_jobs(_touch, <char *>jobs, sizeof(_TouchJob), count)
        for i in range(count):
            if jobs[i].err:
                _fail("madvise", jobs[i].err,
                      f"MADV_POPULATE_WRITE of {jobs[i].length} bytes at {<uintptr_t>jobs[i].start:#x}")
        if all(jobs[i].populated for i in range(count)):
            return "madvise(MADV_POPULATE_WRITE)"
        return "a write per page"
    finally:
        free(jobs)
        if mask != NULL:
            numa_bitmask_free(mask)
        PyBuffer_Release(&view)
