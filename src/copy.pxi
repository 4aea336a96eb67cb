# Copy: the GIL-free gather copy that pins a batch. Many source buffers go into one
# target buffer, each at its own offset; the bytes are split evenly over threads
# pinned to the target node's CPUs, so that a big batch is copied by several cores,
# each near the memory it writes.

from libc.string cimport memcpy

# Each thread's share of the concatenated sources is a multiple of this copy grain:
# a multiple of every cache line (64-256 bytes), so two threads never write one line
# of a target that starts on one, and a share below 4 KiB is not worth a thread. It
# is not a page (4, 16 or 64 KiB, by kernel): every thread runs on the target's node,
# so a page written by two of them lands where it would with one.
cdef size_t _COPY_GRAIN = 4096


cdef struct _CopyPiece:
    const char *source
    char *target
    size_t length


cdef struct _CopyJob:
    _ThreadJob thread
    const _CopyPiece *pieces
    size_t piece_count
    size_t begin        # this job's bytes of the pieces laid end to end: [begin, end)
    size_t end


cdef void *_copy_range(void *arg) noexcept nogil:
    cdef _CopyJob *job = <_CopyJob *>arg
    cdef size_t i, start = 0, low, high
    _pin_thread(&job.thread)
    for i in range(job.piece_count):
        low = max(job.begin, start)
        high = min(job.end, start + job.pieces[i].length)
        if low < high:
            memcpy(job.pieces[i].target + (low - start), job.pieces[i].source + (low - start), high - low)
        start += job.pieces[i].length
        if start >= job.end:
            break
    return NULL


def gather_copy(target, offsets, sources, cpus=(), int threads=1) -> int:
    """Copy each buffer of ``sources`` into the writable buffer ``target`` at the
    matching byte offset of ``offsets``; returns the bytes copied.

    The GIL is released for the copy. With ``cpus``, ``threads`` threads pinned to
    them share the bytes evenly (a thread that cannot be started leaves its share to
    the caller); with no ``cpus`` and one thread, the caller copies. Every buffer is
    held for the whole call, so none can be freed or resized meanwhile.
    """
    cdef Py_buffer target_view
    cdef Py_buffer *views = NULL
    cdef _CopyPiece *pieces = NULL
    cdef _CopyJob *jobs = NULL
    cdef bitmask *mask = NULL
    cdef Py_ssize_t held = 0, count, i, offset
    cdef size_t total = 0, chunk, begin
    cdef int job_count = 0
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    offsets = list(offsets)
    sources = list(sources)
    count = len(sources)
    if len(offsets) != count:
        raise ValueError(f"{len(offsets)} offsets for {count} sources")
    _hold(target, &target_view, True)
    try:
        views = <Py_buffer *>calloc(count + 1, sizeof(Py_buffer))
        pieces = <_CopyPiece *>calloc(count + 1, sizeof(_CopyPiece))
        jobs = <_CopyJob *>calloc(threads, sizeof(_CopyJob))
        if views == NULL or pieces == NULL or jobs == NULL:
            raise MemoryError("gather_copy: piece table")
        for i in range(count):
            offset = offsets[i]
            _hold(sources[i], &views[i], False)
            held += 1
            if offset < 0 or offset > target_view.len or views[i].len > target_view.len - offset:
                raise ValueError(f"source {i}: {views[i].len} bytes at offset {offset} do not fit "
                                 f"in the {target_view.len}-byte target")
            pieces[i].source = <const char *>views[i].buf
            pieces[i].target = <char *>target_view.buf + offset
            pieces[i].length = <size_t>views[i].len
            total += pieces[i].length
        if cpus:
            mask = _cpumask_from(cpus)
        chunk = (total // <size_t>threads + _COPY_GRAIN - 1) & ~(_COPY_GRAIN - 1)
        chunk = max(chunk, _COPY_GRAIN)
        begin = 0
        while begin < total and job_count < threads:
            jobs[job_count].thread.cpus = mask
            jobs[job_count].pieces = pieces
            jobs[job_count].piece_count = <size_t>count
            jobs[job_count].begin = begin
            jobs[job_count].end = min(begin + chunk, total)
            begin = jobs[job_count].end
            job_count += 1
        if job_count:
            with nogil:
                _run_jobs(_copy_range, <char *>jobs, sizeof(_CopyJob), job_count)
        return total
    finally:
        for i in range(held):
            PyBuffer_Release(&views[i])
        free(views)
        free(pieces)
        free(jobs)
        if mask != NULL:
            numa_bitmask_free(mask)
        PyBuffer_Release(&target_view)
