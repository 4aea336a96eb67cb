# Bench: the timed loops of `numafast bench` (dependent loads, reads, copies), run
# by threads pinned one to a CPU and timed in C with CLOCK_MONOTONIC, GIL released.
#
# A call starts one thread per CPU it is given. Each thread pins itself, asks the
# kernel from inside what that gave (its affinity, sched_getcpu) and waits at a
# gate; the caller opens the gate once every thread has pinned itself, or sends
# them all home when one could not. Every repetition then starts on a barrier, so
# that all threads begin together, and each thread times its own share: a
# repetition lasts from the earliest start to the latest end. Which repetitions
# are warm-up and which figure counts is for the Python layer to decide.

from libc.errno cimport EINVAL
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <errno.h>
    #include <stdint.h>
    #include <stdlib.h>

    /* Read bandwidth: every 8-byte word loaded once, into eight independent sums so
       that no chain of additions limits the rate of loads. */
    static uint64_t numafast_read_words(const char *start, size_t length) {
        const uint64_t *word = (const uint64_t *)start;
        size_t count = length / sizeof(uint64_t), i = 0;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
        for (; i + 8 <= count; i += 8) {
            s0 += word[i]; s1 += word[i + 1]; s2 += word[i + 2]; s3 += word[i + 3];
            s4 += word[i + 4]; s5 += word[i + 5]; s6 += word[i + 6]; s7 += word[i + 7];
        }
        for (; i < count; i++)
            s0 += word[i];
        return s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
    }

    /* STREAM's copy, c[j] = a[j] over doubles, as STREAM writes it: regular stores
       (memcpy, timed apart, may choose non-temporal ones for big copies). */
    static void numafast_copy_doubles(double *destination, const double *source, size_t length) {
        size_t count = length / sizeof(double);
        for (size_t j = 0; j < count; j++)
            destination[j] = source[j];
    }

    /* Latency: each load's address is the value the previous load returned. A link
       that leaves [low, low + span) ends the chase with NULL (a buffer that holds no
       chain never sends a thread into unmapped memory); the check is not on the
       chain of dependent loads, so it costs no latency. */
    static void *numafast_chase(void *cursor, size_t steps, uintptr_t low, uintptr_t span) {
        void **link = (void **)cursor;
        for (size_t i = 0; i < steps; i++) {
            void **next = (void **)*link;
            if ((uintptr_t)next - low > span - sizeof(void *) || ((uintptr_t)next & (sizeof(void *) - 1)))
                return NULL;
            link = next;
        }
        return link;
    }

    static uint64_t numafast_splitmix64(uint64_t *state) {
        uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }

    /* One cycle through the slots at every `stride` bytes of [start, start + length)
       in a random order (a Fisher-Yates shuffle), each slot holding the address of
       the next: no hardware prefetcher can guess the next line. 0, or ENOMEM. */
    static int numafast_chase_links(char *start, size_t length, size_t stride, uint64_t seed) {
        size_t slots = length / stride;
        size_t *order = malloc(slots * sizeof(size_t));
        if (order == NULL)
            return ENOMEM;
        for (size_t i = 0; i < slots; i++)
            order[i] = i;
        for (size_t i = slots - 1; i > 0; i--) {
            size_t j = numafast_splitmix64(&seed) % (i + 1), swap = order[i];
            order[i] = order[j];
            order[j] = swap;
        }
        for (size_t i = 0; i < slots; i++)
            *(char **)(start + order[i] * stride) = start + order[(i + 1) % slots] * stride;
        free(order);
        return 0;
    }
    """
    uint64_t numafast_read_words(const char *start, size_t length) nogil
    void numafast_copy_doubles(double *destination, const double *source, size_t length) nogil
    void *numafast_chase(void *cursor, size_t steps, uintptr_t low, uintptr_t span) nogil
    int numafast_chase_links(char *start, size_t length, size_t stride, uint64_t seed) nogil

cdef enum _Work:
    _READ
    _COPY
    _MEMCPY
    _CHASE

cdef struct _Gate:
    pthread_mutex_t lock
    pthread_cond_t changed
    int arrived             # threads that have tried to pin themselves
    int state               # 0: closed; 1: open, go; -1: stop
    pthread_barrier_t start  # one wait per repetition

cdef struct _TimedJob:
    _Gate *gate
    _Work work
    char *source
    char *destination
    size_t length           # bytes of this thread's share (read, copies)
    size_t steps            # dependent loads per repetition (chase)
    uintptr_t low           # the chase's buffer, for its bounds check
    uintptr_t span
    void *cursor            # where the chase is (it goes on from there)
    int repetitions
    int cpu
    bitmask *pin            # {cpu}
    bitmask *seen           # the affinity the kernel reports once pinned
    long long *started      # per repetition, ns
    long long *ended
    uint64_t sink           # what the reads summed, so that they are not optimized away
    int err                 # errno of a failed pin
    int affinity_exact      # the kernel's affinity is exactly {cpu}
    int cpu_before          # sched_getcpu() before the first repetition
    int cpu_after           # and after the last


cdef inline long long _now_ns() noexcept nogil:
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return <long long>now.tv_sec * 1000000000 + now.tv_nsec


cdef void *_timed_thread(void *arg) noexcept nogil:
    cdef _TimedJob *job = <_TimedJob *>arg
    cdef _Gate *gate = job.gate
    cdef int rep, state
    libc_errno.errno = 0
    if numa_sched_setaffinity(0, job.pin) < 0:
        job.err = libc_errno.errno if libc_errno.errno else EINVAL
    else:
        if numa_sched_getaffinity(0, job.seen) >= 0:
            job.affinity_exact = numa_bitmask_equal(job.seen, job.pin)
        job.cpu_before = sched_getcpu()
    pthread_mutex_lock(&gate.lock)
    gate.arrived += 1
    pthread_cond_broadcast(&gate.changed)
    while gate.state == 0:
        pthread_cond_wait(&gate.changed, &gate.lock)
    state = gate.state
    pthread_mutex_unlock(&gate.lock)
    if state < 0:
        return NULL
    for rep in range(job.repetitions):
        pthread_barrier_wait(&gate.start)
        job.started[rep] = _now_ns()
        if job.work == _READ:
            job.sink += numafast_read_words(job.source, job.length)
        elif job.work == _COPY:
            numafast_copy_doubles(<double *>job.destination, <const double *>job.source, job.length)
        elif job.work == _MEMCPY:
            memcpy(job.destination, job.source, job.length)
        elif job.cursor != NULL:
            job.cursor = numafast_chase(job.cursor, job.steps, job.low, job.span)
        job.ended[rep] = _now_ns()
    job.cpu_after = sched_getcpu()
    return NULL


cdef tuple _run_timed(_Work work, const Py_buffer *source, const Py_buffer *destination,
                      list cpus, size_t steps, int repetitions):
    """Start one pinned thread per CPU of ``cpus``, time ``repetitions`` of ``work``
    and return (seconds per repetition, [(cpu, cpu before, cpu after, affinity exact)])."""
    cdef int threads = len(cpus), created = 0, i, rep, create_err = 0
    cdef size_t share, offset = 0
    cdef _Gate gate
    cdef _TimedJob *jobs = <_TimedJob *>calloc(threads, sizeof(_TimedJob))
    cdef pthread_t *handles = <pthread_t *>calloc(threads, sizeof(pthread_t))
    cdef long long *times = <long long *>calloc(2 * threads * repetitions, sizeof(long long))
    cdef long long first, last
    try:
        if jobs == NULL or handles == NULL or times == NULL:
            raise MemoryError("bench: thread table")
        # Shares of whole cache lines; the last thread takes what is left.
        share = (<size_t>source.len // <size_t>threads) & ~(<size_t>63)
        for i in range(threads):
            jobs[i].gate = &gate
            jobs[i].work = work
            jobs[i].source = <char *>source.buf + offset
            if destination != NULL:
                jobs[i].destination = <char *>destination.buf + offset
            jobs[i].length = share if i < threads - 1 else <size_t>source.len - offset
            offset += jobs[i].length
            jobs[i].steps = steps
            jobs[i].low = <uintptr_t>source.buf
            jobs[i].span = <uintptr_t>source.len
            jobs[i].cursor = source.buf
            jobs[i].repetitions = repetitions
            jobs[i].cpu = cpus[i]
            jobs[i].started = times + 2 * i * repetitions
            jobs[i].ended = jobs[i].started + repetitions
            jobs[i].pin = _cpumask_from([cpus[i]])
            jobs[i].seen = numa_allocate_cpumask()
            if jobs[i].seen == NULL:
                raise MemoryError("numa_allocate_cpumask")
        pthread_mutex_init(&gate.lock, NULL)
        pthread_cond_init(&gate.changed, NULL)
        pthread_barrier_init(&gate.start, NULL, <unsigned>threads)
        gate.arrived = 0
        gate.state = 0
        with nogil:
            for i in range(threads):
                create_err = pthread_create(&handles[i], NULL, _timed_thread, &jobs[i])
                if create_err:
                    break
                created += 1
            pthread_mutex_lock(&gate.lock)
            while gate.arrived < created:
                pthread_cond_wait(&gate.changed, &gate.lock)
            gate.state = 1 if created == threads else -1
            for i in range(created):
                if jobs[i].err:
                    gate.state = -1
            pthread_cond_broadcast(&gate.changed)
            pthread_mutex_unlock(&gate.lock)
            for i in range(created):
                pthread_join(handles[i], NULL)
        pthread_barrier_destroy(&gate.start)
        pthread_cond_destroy(&gate.changed)
        pthread_mutex_destroy(&gate.lock)
        if create_err:
            _fail("pthread_create", create_err, f"thread {created + 1} of {threads}")
        for i in range(threads):
            if jobs[i].err:
                _fail("sched_setaffinity", jobs[i].err, f"pinning a timing thread to cpu {jobs[i].cpu}")
        if work == _CHASE and jobs[0].cursor == NULL:
            raise ValueError("the buffer holds no chain of links (chase_links writes one)")
        seconds = []
        for rep in range(repetitions):
            first, last = jobs[0].started[rep], jobs[0].ended[rep]
            for i in range(1, threads):
                first = min(first, jobs[i].started[rep])
                last = max(last, jobs[i].ended[rep])
            seconds.append((last - first) * 1e-9)
        placed = [(jobs[i].cpu, jobs[i].cpu_before, jobs[i].cpu_after, bool(jobs[i].affinity_exact))
                  for i in range(threads)]
        return seconds, placed
    finally:
        if jobs != NULL:
            for i in range(threads):
                if jobs[i].pin != NULL:
                    numa_bitmask_free(jobs[i].pin)
                if jobs[i].seen != NULL:
                    numa_bitmask_free(jobs[i].seen)
        free(jobs)
        free(handles)
        free(times)


cdef list _timing_cpus(object cpus, int repetitions):
    if repetitions < 1:
        raise ValueError(f"repetitions must be at least 1, not {repetitions}")
    cpus = list(cpus)
    if not cpus:
        raise ValueError("no CPU to run the timing threads on")
    return cpus


def time_read(buf, cpus, int repetitions) -> tuple[list[float], list[tuple[int, int, int, bool]]]:
    """Read every word of ``buf`` once per repetition, shared among threads pinned one
    to each CPU of ``cpus``.

    Returns the seconds of each repetition (earliest start to latest end) and, per
    thread, (its CPU, sched_getcpu() before the first and after the last repetition,
    whether sched_getaffinity said exactly that CPU).
    """
    cdef Py_buffer view
    cdef list cpu_list = _timing_cpus(cpus, repetitions)
    _hold(buf, &view, False)
    try:
        return _run_timed(_READ, &view, NULL, cpu_list, 0, repetitions)
    finally:
        PyBuffer_Release(&view)


def time_copy(source, destination, cpus, int repetitions) -> tuple[list[float], list[tuple[int, int, int, bool]]]:
    """STREAM's copy loop (doubles, regular stores) from ``source`` into ``destination``
    (the same size) once per repetition, shared among threads pinned one to each CPU
    of ``cpus``; returns as time_read."""
    return _time_copy(_COPY, source, destination, cpus, repetitions)


def time_memcpy(source, destination, cpus, int repetitions) -> tuple[list[float], list[tuple[int, int, int, bool]]]:
    """memcpy() ``source`` into ``destination`` (the same size) once per repetition,
    shared among threads pinned one to each CPU of ``cpus``; returns as time_read."""
    return _time_copy(_MEMCPY, source, destination, cpus, repetitions)


cdef tuple _time_copy(_Work work, source, destination, cpus, int repetitions):
    cdef Py_buffer source_view, destination_view
    cdef list cpu_list = _timing_cpus(cpus, repetitions)
    _hold(source, &source_view, False)
    try:
        _hold(destination, &destination_view, True)
        try:
            if source_view.len != destination_view.len:
                raise ValueError(f"copy of {source_view.len} bytes into {destination_view.len}: sizes differ")
            return _run_timed(work, &source_view, &destination_view, cpu_list, 0, repetitions)
        finally:
            PyBuffer_Release(&destination_view)
    finally:
        PyBuffer_Release(&source_view)


def time_chase(buf, int cpu, size_t steps, int repetitions) -> tuple[list[float], list[tuple[int, int, int, bool]]]:
    """Follow ``steps`` links of the chain chase_links wrote into ``buf`` per repetition,
    from one thread pinned to ``cpu`` (each repetition goes on where the last stopped);
    returns as time_read. ValueError when a link leads outside ``buf``."""
    cdef Py_buffer view
    cdef list cpu_list = _timing_cpus([cpu], repetitions)
    if steps < 1:
        raise ValueError("a chase of 0 steps")
    _hold(buf, &view, False)
    try:
        if view.len < <Py_ssize_t>sizeof(void *):
            raise ValueError(f"a buffer of {view.len} bytes holds no link")
        return _run_timed(_CHASE, &view, NULL, cpu_list, steps, repetitions)
    finally:
        PyBuffer_Release(&view)


def chase_links(buf, size_t stride, unsigned long long seed) -> int:
    """Write into ``buf`` one cycle through the slots ``stride`` bytes apart, in a random
    order drawn from ``seed``: each slot holds the address of the next. Returns the
    number of slots."""
    cdef Py_buffer view
    cdef size_t slots
    cdef int err
    if stride < sizeof(void *) or stride % sizeof(void *):
        raise ValueError(f"stride {stride} is not a multiple of {sizeof(void *)} bytes")
    _hold(buf, &view, True)
    try:
        if <uintptr_t>view.buf % sizeof(void *):
            raise ValueError("the buffer does not start at an address aligned for pointers")
        slots = <size_t>view.len // stride
        if slots < 2:
            raise ValueError(f"{view.len} bytes hold fewer than 2 slots of {stride} bytes")
        with nogil:
            err = numafast_chase_links(<char *>view.buf, <size_t>view.len, stride, seed)
        if err:
            raise MemoryError(f"chase_links: an order of {slots} slots")
        return slots
    finally:
        PyBuffer_Release(&view)
