/* Ordinary against streaming stores into a shared ring of slots: a producer
 * pinned to CPU 0 copies PIECE-KiB pieces into 16 slots, a consumer pinned to
 * CPU 1 adds each slot into a buffer of its own (as a reduction reads a
 * slot). Prints the throughput and each side's speed. What decided
 * crates/runtime/src/slot_stores.rs: on a shared cache ordinary stores won
 * (12 against 7 GB/s); with the CPUs on different dies (see
 * placement-probe.c) the producer's ordinary stores fell to 2.4 GB/s while
 * streaming ones kept 30 and the whole at 8.
 *
 *   cc -O2 -mavx2 scripts/slot-stores.c -o /tmp/slot-stores
 *   /tmp/slot-stores 128 0 256; /tmp/slot-stores 128 1 256   # KiB, streaming?, MiB
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SLOTS 16

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (sched_setaffinity(0, sizeof s, &s)) { perror("sched_setaffinity"); exit(1); }
}

static void stream_copy(char *d, const char *s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
    __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
    _mm256_stream_si256((__m256i *)(d + i), a);
    _mm256_stream_si256((__m256i *)(d + i + 32), b);
  }
  _mm_sfence();
}

int main(int argc, char **argv) {
  if (argc < 4) { fprintf(stderr, "usage: %s PIECE_KIB STREAM(0|1) TOTAL_MIB\n", argv[0]); return 2; }
  size_t piece = (size_t)atoi(argv[1]) << 10;
  int streaming = atoi(argv[2]);
  long total = (long)atoi(argv[3]) << 20, n = total / (long)piece;
  char *shm = mmap(0, SLOTS * piece + 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED || piece % 64) { fprintf(stderr, "bad setup\n"); return 1; }
  memset(shm, 0, SLOTS * piece + 4096);
  _Atomic long *head = (_Atomic long *)(shm + SLOTS * piece), *tail = head + 8;
  double *consumer_s = (double *)(head + 16);
  if (fork() == 0) {
    pin(1);
    float *dst = aligned_alloc(64, piece);
    memset(dst, 0, piece);
    double busy = 0;
    for (long i = 0; i < n; i++) {
      while (atomic_load_explicit(head, memory_order_acquire) <= i) ;
      double t0 = now();
      const float *s = (const float *)(shm + (i % SLOTS) * piece);
      for (size_t k = 0; k < piece / 4; k++) dst[k] += s[k];
      busy += now() - t0;
      atomic_store_explicit(tail, i + 1, memory_order_release);
    }
    *consumer_s = busy;
    _exit(0);
  }
  pin(0);
  char *src = aligned_alloc(64, piece);
  memset(src, 3, piece);
  double busy = 0, start = now();
  for (long i = 0; i < n; i++) {
    while (i - atomic_load_explicit(tail, memory_order_acquire) >= SLOTS) ;
    double t0 = now();
    char *d = shm + (i % SLOTS) * piece;
    if (streaming) stream_copy(d, src, piece); else memcpy(d, src, piece);
    busy += now() - t0;
    atomic_store_explicit(head, i + 1, memory_order_release);
  }
  wait(0);
  double el = now() - start;
  printf("%zu KiB pieces, %s stores: %.2f GB/s through; producer writes %.1f GB/s, consumer reads+adds %.1f GB/s\n",
         piece >> 10, streaming ? "streaming" : "ordinary", total / el / 1e9, total / busy / 1e9,
         total / *consumer_s / 1e9);
  return 0;
}
