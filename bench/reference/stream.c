/* STREAM-style reference for `numafast bench`'s read_gbps and copy_gbps: plain C,
   OpenMP, built with the system compiler at -O2 by bench/bench_matrices.py.

   usage: stream BYTES REPETITIONS        (threads: OMP_NUM_THREADS, pinned by OMP_PROC_BIND)

   Three arrays of BYTES each (2 MiB aligned, transparent huge pages asked for,
   first touched in parallel as STREAM does); one untimed warm-up, then the best
   of REPETITIONS. Bytes counted as STREAM counts them: copy c = a, 2 x BYTES;
   triad a = b + s * c, 3 x BYTES; read (sum of a, no STREAM kernel), 1 x BYTES.
   Prints "copy GBPS", "triad GBPS", "read GBPS" (1e9 bytes per second). */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE_PAGE (2UL << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double *array(size_t bytes) {
    double *p = aligned_alloc(HUGE_PAGE, (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
    if (p == NULL) {
        perror("aligned_alloc");
        exit(1);
    }
    madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: stream BYTES REPETITIONS\n");
        return 2;
    }
    size_t bytes = strtoull(argv[1], NULL, 10), n = bytes / sizeof(double);
    int repetitions = atoi(argv[2]);
    double *a = array(bytes), *b = array(bytes), *c = array(bytes);
    const double scalar = 3.0;
    double best_copy = 1e30, best_triad = 1e30, best_read = 1e30;
    volatile uint64_t sink = 0;

#pragma omp parallel for
    for (size_t j = 0; j < n; j++) {
        a[j] = 1.0;
        b[j] = 2.0;
        c[j] = 0.0;
    }
    for (int k = 0; k <= repetitions; k++) {
        double t = now();
#pragma omp parallel for
        for (size_t j = 0; j < n; j++)
            c[j] = a[j];
        double copy = now() - t;

        t = now();
#pragma omp parallel for
        for (size_t j = 0; j < n; j++)
            a[j] = b[j] + scalar * c[j];
        double triad = now() - t;

        /* Eight independent sums per thread, as numafast's read loop. */
        uint64_t total = 0;
        t = now();
#pragma omp parallel reduction(+ : total)
        {
            int threads = omp_get_num_threads(), me = omp_get_thread_num();
            size_t words = bytes / sizeof(uint64_t), share = words / threads;
            const uint64_t *w = (const uint64_t *)a + me * share;
            size_t count = me == threads - 1 ? words - me * share : share, i = 0;
            uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
            for (; i + 8 <= count; i += 8) {
                s0 += w[i]; s1 += w[i + 1]; s2 += w[i + 2]; s3 += w[i + 3];
                s4 += w[i + 4]; s5 += w[i + 5]; s6 += w[i + 6]; s7 += w[i + 7];
            }
            for (; i < count; i++)
                s0 += w[i];
            total += s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
        }
        double read = now() - t;
        sink += total;

        if (k == 0)
            continue; /* warm-up */
        if (copy < best_copy) best_copy = copy;
        if (triad < best_triad) best_triad = triad;
        if (read < best_read) best_read = read;
    }
    printf("copy %.4f\ntriad %.4f\nread %.4f\n", 2.0 * bytes / best_copy / 1e9, 3.0 * bytes / best_triad / 1e9,
           1.0 * bytes / best_read / 1e9);
    return sink == 42; /* never: keeps the sums alive */
}
