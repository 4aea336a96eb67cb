/* Pointer-chase reference for `numafast bench`'s latency_ns: plain C, built with the
   system compiler at -O2 by bench/bench_matrices.py.

   usage: chase CPU BYTES STEPS REPETITIONS

   Pins itself to CPU; one buffer of BYTES (2 MiB aligned, transparent huge pages
   asked for) holding one cycle through all its 64-byte lines in a random order;
   STEPS dependent loads per repetition, one untimed warm-up, then the best of
   REPETITIONS. Prints "latency NS" (ns per load). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE_PAGE (2UL << 20)
#define LINE 64

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t next_random(uint64_t *state) { /* xorshift64* */
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return *state * 0x2545F4914F6CDD1DULL;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: chase CPU BYTES STEPS REPETITIONS\n");
        return 2;
    }
    int cpu = atoi(argv[1]), repetitions = atoi(argv[4]);
    size_t bytes = strtoull(argv[2], NULL, 10), steps = strtoull(argv[3], NULL, 10), lines = bytes / LINE;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set)) {
        perror("sched_setaffinity");
        return 1;
    }
    char *buffer = aligned_alloc(HUGE_PAGE, (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
    size_t *order = malloc(lines * sizeof(size_t));
    if (buffer == NULL || order == NULL) {
        perror("malloc");
        return 1;
    }
    madvise(buffer, bytes, MADV_HUGEPAGE);
    memset(buffer, 0, bytes);
    uint64_t state = 88172645463325252ULL;
    for (size_t i = 0; i < lines; i++)
        order[i] = i;
    for (size_t i = lines - 1; i > 0; i--) {
        size_t j = next_random(&state) % (i + 1), swap = order[i];
        order[i] = order[j];
        order[j] = swap;
    }
    for (size_t i = 0; i < lines; i++)
        *(void **)(buffer + order[i] * LINE) = buffer + order[(i + 1) % lines] * LINE;
    free(order);

    void **p = (void **)buffer;
    double best = 1e30;
    for (int k = 0; k <= repetitions; k++) {
        double t = now();
        for (size_t i = 0; i < steps; i++)
            p = (void **)*p;
        t = now() - t;
        if (k > 0 && t < best)
            best = t;
    }
    printf("latency %.3f\n", best / steps * 1e9);
    return p == NULL; /* never: keeps the chase alive */
}
