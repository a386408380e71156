/* process_vm_readv against memcpy on 4 KiB and on 2 MiB (THP) pages.
 *
 *   cc -O2 scripts/cma-pages.c -o /tmp/cma-pages && /tmp/cma-pages 1048576
 *
 * A parent allocates a 2 MiB-aligned source buffer (after the fork, so no
 * copy-on-write sharing), a child reads BYTES of it with process_vm_readv
 * into its own buffer, 2000 times, with and without MADV_HUGEPAGE on both
 * buffers, and copies the same amount with memcpy inside its own memory.
 * This is what decided braid's single-copy threshold (see
 * single_copy_default in crates/runtime/src/comm/tuning.rs). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define AREA (64u << 20)
#define HUGE (2u << 20)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *area(int thp) {
  char *p = mmap(0, AREA + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { perror("mmap"); exit(1); }
  p = (char *)(((size_t)p + HUGE - 1) & ~(size_t)(HUGE - 1));
  if (thp) madvise(p, AREA, MADV_HUGEPAGE);
  memset(p, 1, AREA);
  return p;
}

static int child(pid_t parent, int rd, int wr, size_t n, int thp) {
  char *dst = area(thp), *src;
  if (read(rd, &src, sizeof src) != sizeof src) return 1;
  const int it = 2000;
  double best = 1e9;
  for (int round = 0; round < 3; round++) {
    double t0 = now();
    for (int i = 0; i < it; i++) {
      struct iovec l = {dst, n}, r = {src, n};
      if (process_vm_readv(parent, &l, 1, &r, 1, 0) != (ssize_t)n) { perror("process_vm_readv"); return 1; }
    }
    double t = (now() - t0) / it;
    if (t < best) best = t;
  }
  double t0 = now();
  for (int i = 0; i < it; i++) memcpy(dst, dst + AREA / 2, n);
  double tm = (now() - t0) / it;
  printf("%-9s %9zu bytes: process_vm_readv %8.2f us %6.2f GB/s | memcpy %8.2f us %6.2f GB/s\n",
         thp ? "2 MiB THP" : "4 KiB", n, best * 1e6, n / best / 1e9, tm * 1e6, n / tm / 1e9);
  if (write(wr, "x", 1) != 1) return 1;
  return 0;
}

static int run(size_t n, int thp) {
  int addr[2], done[2];
  if (pipe(addr) || pipe(done)) { perror("pipe"); return 1; }
  pid_t parent = getpid(), c = fork();
  if (c == 0) exit(child(parent, addr[0], done[1], n, thp));
  char *src = area(thp), b;
  if (write(addr[1], &src, sizeof src) != sizeof src) return 1;
  if (read(done[0], &b, 1) != 1) return 1;
  int st = 0;
  waitpid(c, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}

int main(int argc, char **argv) {
  size_t n = argc > 1 ? strtoul(argv[1], 0, 0) : (1u << 20);
  if (n == 0 || n > AREA / 2) { fprintf(stderr, "usage: %s BYTES (1..32 MiB)\n", argv[0]); return 2; }
  return run(n, 0) || run(n, 1);
}
