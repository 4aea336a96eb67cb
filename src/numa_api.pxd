# Declarations of libnuma (numa.h), the raw memory-policy system calls it wraps
# (numaif.h) and the few libc calls the extension needs. Declarations only: the
# wrappers live in the .pxi files that _libnuma.pyx includes.

from libc.stdint cimport uint32_t, uint64_t

cdef extern from "<numa.h>" nogil:
    struct bitmask:
        unsigned long size
        unsigned long *maskp

    # The nodes this machine has (libnuma reads them from sysfs when it loads).
    bitmask *numa_nodes_ptr

    int numa_bitmask_isbitset(const bitmask *, unsigned int)
    bitmask *numa_bitmask_setall(bitmask *)
    bitmask *numa_bitmask_clearall(bitmask *)
    bitmask *numa_bitmask_setbit(bitmask *, unsigned int)
    bitmask *numa_bitmask_clearbit(bitmask *, unsigned int)
    unsigned int numa_bitmask_nbytes(bitmask *)
    unsigned int numa_bitmask_weight(const bitmask *)
    bitmask *numa_bitmask_alloc(unsigned int)
    void numa_bitmask_free(bitmask *)
    int numa_bitmask_equal(const bitmask *, const bitmask *)
    void copy_bitmask_to_bitmask(bitmask *, bitmask *)

    int numa_available()
    int numa_max_node()
    int numa_max_possible_node()
    int numa_preferred()
    long long numa_node_size64(int node, long long *freep)
    int numa_pagesize()

    void numa_bind(bitmask *nodes)
    void numa_set_interleave_mask(bitmask *nodemask)
    bitmask *numa_get_interleave_mask()
    bitmask *numa_allocate_nodemask()
    void numa_free_nodemask(bitmask *)
    void numa_set_preferred(int node)
    int numa_has_preferred_many()
    void numa_set_preferred_many(bitmask *)
    bitmask *numa_preferred_many()
    void numa_set_localalloc()
    void numa_set_membind(bitmask *nodemask)
    bitmask *numa_get_membind()
    bitmask *numa_get_mems_allowed()
    int numa_get_interleave_node()

    void *numa_alloc_interleaved_subset(size_t size, bitmask *nodemask)
    void *numa_alloc_interleaved(size_t size)
    void *numa_alloc_onnode(size_t size, int node)
    void *numa_alloc_local(size_t size)
    void *numa_alloc(size_t size)
    void numa_free(void *mem, size_t size)
    void numa_interleave_memory(void *mem, size_t size, bitmask *mask)
    void numa_tonode_memory(void *start, size_t size, int node)
    void numa_tonodemask_memory(void *mem, size_t size, bitmask *mask)
    void numa_setlocal_memory(void *start, size_t size)
    void numa_police_memory(void *start, size_t size)

    int numa_run_on_node_mask(bitmask *mask)
    int numa_run_on_node_mask_all(bitmask *mask)
    int numa_run_on_node(int node)
    bitmask *numa_get_run_node_mask()
    void numa_set_bind_policy(int strict)
    void numa_set_strict(int flag)

    int numa_num_possible_nodes()
    int numa_num_possible_cpus()
    int numa_num_configured_nodes()
    int numa_num_configured_cpus()
    int numa_num_task_cpus()
    int numa_num_task_nodes()
    bitmask *numa_allocate_cpumask()
    void numa_free_cpumask(bitmask *)
    int numa_node_to_cpus(int, bitmask *)
    int numa_node_of_cpu(int cpu)
    int numa_distance(int node1, int node2)

    int numa_migrate_pages(int pid, bitmask *fromnodes, bitmask *tonodes)
    int numa_move_pages(int pid, unsigned long count, void **pages,
                        const int *nodes, int *status, int flags)
    int numa_sched_getaffinity(int pid, bitmask *mask)
    int numa_sched_setaffinity(int pid, bitmask *mask)
    bitmask *numa_parse_nodestring(const char *)
    bitmask *numa_parse_cpustring(const char *)

    # libnuma reports failures of void functions through these hooks and the
    # numa_exit_on_error / numa_exit_on_warn globals.
    int numa_exit_on_error
    int numa_exit_on_warn


cdef extern from "<numaif.h>" nogil:
    long get_mempolicy(int *mode, unsigned long *nmask, unsigned long maxnode,
                       void *addr, unsigned flags)
    long mbind(void *start, unsigned long len, int mode,
               const unsigned long *nmask, unsigned long maxnode, unsigned flags)
    long set_mempolicy(int mode, const unsigned long *nmask, unsigned long maxnode)
    long migrate_pages(int pid, unsigned long maxnode,
                       const unsigned long *frommask, const unsigned long *tomask)
    long move_pages(int pid, unsigned long count, void **pages,
                    const int *nodes, int *status, int flags)

    enum:
        MPOL_DEFAULT
        MPOL_PREFERRED
        MPOL_BIND
        MPOL_INTERLEAVE
        MPOL_LOCAL
        MPOL_F_NODE
        MPOL_F_ADDR
        MPOL_F_MEMS_ALLOWED
        MPOL_MF_STRICT
        MPOL_MF_MOVE
        MPOL_MF_MOVE_ALL


cdef extern from *:
    """
    /* Newer than some numaif.h headers: the kernel ABI values (uapi/linux/mempolicy.h). */
    #ifndef MPOL_PREFERRED_MANY
    #define MPOL_PREFERRED_MANY 5
    #endif
    #define NUMAFAST_MPOL_WEIGHTED_INTERLEAVE 6
    #ifndef MPOL_F_STATIC_NODES
    #define MPOL_F_STATIC_NODES (1 << 15)
    #endif
    #ifndef MPOL_F_RELATIVE_NODES
    #define MPOL_F_RELATIVE_NODES (1 << 14)
    #endif
    #ifndef MPOL_F_NUMA_BALANCING
    #define MPOL_F_NUMA_BALANCING (1 << 13)
    #endif
    """
    enum:
        MPOL_PREFERRED_MANY
        MPOL_F_STATIC_NODES
        MPOL_F_RELATIVE_NODES
        MPOL_F_NUMA_BALANCING
        NUMAFAST_MPOL_WEIGHTED_INTERLEAVE


cdef extern from "<sys/syscall.h>" nogil:
    long syscall(long number, ...)
    enum:
        SYS_gettid

cdef extern from "<sched.h>" nogil:
    int sched_getcpu()


# ---------------------------------------------------------------- memory (src/memory.pxi)
# Anonymous mappings, their advice, and the threads of the parallel pre-touch.

cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)
    void *MAP_FAILED
    enum:
        PROT_READ
        PROT_WRITE
        PROT_NONE
        MAP_PRIVATE
        MAP_SHARED
        MAP_ANONYMOUS
        MAP_FIXED
        MADV_HUGEPAGE
        MADV_NOHUGEPAGE

cdef extern from *:
    """
    /* Linux 5.14 and 5.4 (uapi/asm-generic/mman-common.h); older headers lack them. */
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23
    #endif
    #ifndef MADV_COLD
    #define MADV_COLD 20
    #endif
    """
    enum:
        MADV_POPULATE_WRITE
        MADV_COLD

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_attr_t:
        pass
    int pthread_create(pthread_t *thread, const pthread_attr_t *attr,
                       void *(*start_routine)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t thread, void **retval)


# ---------------------------------------------------------------- threads, clocks, locking
# Shared by the pinned pools (src/pool.pxi: page locking, fork advice, the mutex and
# condition a full pool waits on) and the timed loops of `numafast bench`
# (src/bench.pxi: a gate that opens once every timing thread has pinned itself, a
# barrier that starts each repetition on all threads at once, the monotonic clock).

cdef extern from "<sys/mman.h>" nogil:
    int mlock(const void *addr, size_t length)
    int munlock(const void *addr, size_t length)

cdef extern from *:
    """
    /* mlock2(2), Linux 4.4, called by number: glibc has a wrapper only since 2.27. */
    #ifndef MLOCK_ONFAULT
    #define MLOCK_ONFAULT 1
    #endif
    #ifndef SYS_mlock2
    #  if defined(__x86_64__)
    #    define SYS_mlock2 325
    #  elif defined(__aarch64__)
    #    define SYS_mlock2 284
    #  elif defined(__powerpc64__)
    #    define SYS_mlock2 378
    #  else
    #    define SYS_mlock2 -1
    #  endif
    #endif
    """
    enum:
        MLOCK_ONFAULT
        SYS_mlock2

cdef extern from "<unistd.h>" nogil:
    ctypedef int pid_t
    pid_t getpid()

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    ctypedef int clockid_t
    int clock_gettime(clockid_t clock, timespec *now)
    int nanosleep(const timespec *duration, timespec *remaining)
    enum:
        CLOCK_MONOTONIC

cdef extern from *:
    """
    /* The slot table of a shared pool is read and written by several processes at
       once: every change of a slot's word is one compare-and-swap. */
    static inline int nf_cas64(uint64_t *word, uint64_t expected, uint64_t desired) {
        return __atomic_compare_exchange_n(word, &expected, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
    static inline uint64_t nf_load64(uint64_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
    static inline void nf_store64(uint64_t *word, uint64_t value) { __atomic_store_n(word, value, __ATOMIC_RELEASE); }
    /* A seqlock's data words (the pool board): atomic but unordered by themselves; the
       fences around them order them against the sequence word. */
    static inline uint64_t nf_load64_relaxed(const uint64_t *word) { return __atomic_load_n(word, __ATOMIC_RELAXED); }
    static inline void nf_store64_relaxed(uint64_t *word, uint64_t value) { __atomic_store_n(word, value, __ATOMIC_RELAXED); }
    static inline void nf_fence_acquire(void) { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
    static inline void nf_fence_release(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
    """
    bint nf_cas64(uint64_t *word, uint64_t expected, uint64_t desired) nogil
    uint64_t nf_load64(uint64_t *word) nogil
    void nf_store64(uint64_t *word, uint64_t value) nogil
    uint64_t nf_load64_relaxed(const uint64_t *word) nogil
    void nf_store64_relaxed(uint64_t *word, uint64_t value) nogil
    void nf_fence_acquire() nogil
    void nf_fence_release() nogil

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_mutexattr_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    ctypedef struct pthread_barrier_t:
        pass
    ctypedef struct pthread_barrierattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *mutex, const pthread_mutexattr_t *attr)
    int pthread_mutex_destroy(pthread_mutex_t *mutex)
    int pthread_mutex_lock(pthread_mutex_t *mutex)
    int pthread_mutex_unlock(pthread_mutex_t *mutex)
    int pthread_condattr_init(pthread_condattr_t *attr)
    int pthread_condattr_setclock(pthread_condattr_t *attr, clockid_t clock)
    int pthread_condattr_destroy(pthread_condattr_t *attr)
    int pthread_cond_init(pthread_cond_t *cond, const pthread_condattr_t *attr)
    int pthread_cond_destroy(pthread_cond_t *cond)
    int pthread_cond_wait(pthread_cond_t *cond, pthread_mutex_t *mutex)
    int pthread_cond_timedwait(pthread_cond_t *cond, pthread_mutex_t *mutex, const timespec *deadline)
    int pthread_cond_broadcast(pthread_cond_t *cond)
    int pthread_cond_signal(pthread_cond_t *cond)
    int pthread_barrier_init(pthread_barrier_t *barrier, const pthread_barrierattr_t *attr, unsigned count)
    int pthread_barrier_destroy(pthread_barrier_t *barrier)
    int pthread_barrier_wait(pthread_barrier_t *barrier)
