/* What this CPU's conversions allow an f16 sum (issue 32 item 2: f16 at
 * f32's speed per byte): the loop braid's f16 Sum runs (widen two halves to
 * f32, add, round back), bare, with 512-bit and with 256-bit conversions,
 * beside the f32 sum of the same bytes, on buffers of SIZE bytes each that
 * stay in cache between passes. Prints GB/s of output (10^9 bytes per
 * second) per round; the rounds alternate the three loops.
 *
 *   cc -O2 scripts/f16-bound.c -o /tmp/f16-bound
 *   /tmp/f16-bound 65536 5        # SIZE bytes, ROUNDS
 *
 * Needs AVX-512 F and F16C (it says so and exits 2 without them).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f,f16c"), noinline)) static void
sum_f16_512(uint16_t *d, const uint16_t *x, const uint16_t *y, size_t n) {
    for (size_t i = 0; i + 16 <= n; i += 16) {
        __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(x + i)));
        __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(y + i)));
        __m256i h = _mm512_cvtps_ph(_mm512_add_ps(a, b), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_si256((void *)(d + i), h);
    }
}

__attribute__((target("avx2,f16c"), noinline)) static void
sum_f16_256(uint16_t *d, const uint16_t *x, const uint16_t *y, size_t n) {
    for (size_t i = 0; i + 8 <= n; i += 8) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(x + i)));
        __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(y + i)));
        __m128i h = _mm256_cvtps_ph(_mm256_add_ps(a, b), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((void *)(d + i), h);
    }
}

__attribute__((target("avx512f"), noinline)) static void
sum_f32_512(float *d, const float *x, const float *y, size_t n) {
    for (size_t i = 0; i + 16 <= n; i += 16)
        _mm512_storeu_ps(d + i, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
}

int main(int argc, char **argv) {
    size_t bytes = argc > 1 ? strtoull(argv[1], 0, 0) : 65536;
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("f16c")) {
        fprintf(stderr, "f16-bound: this CPU lacks AVX-512 F or F16C\n");
        return 2;
    }
    bytes = (bytes + 63) / 64 * 64;
    if (bytes == 0) {
        fprintf(stderr, "f16-bound: SIZE must be at least 1 byte\n");
        return 1;
    }
    /* Six buffers in one allocation, each 320 bytes further from a 4 KiB
     * boundary than the one before, so that no two of a loop's streams alias
     * in the load/store unit (4 KiB aliasing would slow one loop and not
     * another, depending on where the allocator put them). */
    size_t stride = (bytes + 4095) / 4096 * 4096 + 320;
    char *base = aligned_alloc(4096, 6 * stride);
    if (!base) {
        perror("aligned_alloc");
        return 1;
    }
    uint16_t *x = (void *)base, *y = (void *)(base + stride), *d = (void *)(base + 2 * stride);
    float *fx = (void *)(base + 3 * stride), *fy = (void *)(base + 4 * stride),
          *fd = (void *)(base + 5 * stride);
    for (size_t i = 0; i < bytes / 2; i++)
        x[i] = y[i] = 0x3c00; /* 1.0 */
    for (size_t i = 0; i < bytes / 4; i++)
        fx[i] = fy[i] = 1.0f;
    long passes = (long)(2e9 / (double)bytes) + 1;
    printf("# %zu B per buffer, %ld passes per loop; GB/s of output\n", bytes, passes);
    printf("# round  f16_512  f16_256  f32_512\n");
    for (int r = 1; r <= rounds; r++) {
        double t = now();
        for (long k = 0; k < passes; k++)
            sum_f16_512(d, x, y, bytes / 2);
        double a = bytes * (double)passes / (now() - t) / 1e9;
        t = now();
        for (long k = 0; k < passes; k++)
            sum_f16_256(d, x, y, bytes / 2);
        double b = bytes * (double)passes / (now() - t) / 1e9;
        t = now();
        for (long k = 0; k < passes; k++)
            sum_f32_512(fd, fx, fy, bytes / 4);
        double c = bytes * (double)passes / (now() - t) / 1e9;
        printf("%7d  %7.1f  %7.1f  %7.1f\n", r, a, b, c);
    }
    /* Results that depend on the sums, so no loop is dropped. */
    return (d[1] != 0x4000) + (fd[1] != 2.0f);
}
