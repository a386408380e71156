/* The yardstick of issue 32 item 5: the best of N memcpy calls of SIZE
 * bytes between two buffers touched beforehand (so no page faults are
 * timed), printed as GB/s (10^9 bytes per second) on one line.
 *
 *   cc -O2 scripts/memcpy-best.c -o /tmp/memcpy-best
 *   /tmp/memcpy-best 67108864 20      # SIZE bytes, N copies
 *
 * scripts/memcpy-ratio.sh builds and runs it beside braid-perf.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    size_t size = argc > 1 ? strtoull(argv[1], 0, 0) : (size_t)64 << 20;
    int n = argc > 2 ? atoi(argv[2]) : 20;
    char *a = aligned_alloc(4096, size), *b = aligned_alloc(4096, size);
    if (!a || !b) {
        perror("aligned_alloc");
        return 1;
    }
    memset(a, 1, size);
    memset(b, 2, size);
    double best = 1e30;
    for (int i = 0; i < n; i++) {
        double t0 = now();
        memcpy(b, a, size);
        double t = now() - t0;
        if (t < best)
            best = t;
        a[i % size] ^= b[(i * 4099) % size]; /* keep the copies */
    }
    printf("%.2f\n", size / best / 1e9);
    return 0;
}
