/* Where the hypervisor runs two of this VM's CPUs right now: a cache-line
 * ping-pong between processes pinned to CPU 0 and CPU 1 (0.08-0.12 us per
 * round trip when they share a last-level cache, 0.34-0.40 us when they sit
 * on different dies), and the cost of a context switch on one CPU (two
 * processes yielding to each other). Run it next to a benchmark to tell
 * which placement a slow round met.
 *
 *   cc -O2 scripts/placement-probe.c -o /tmp/placement-probe && /tmp/placement-probe
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

int main(void) {
  volatile long *flag = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (flag == MAP_FAILED) { perror("mmap"); return 1; }
  const long yields = 200000, trips = 200000;
  double t0 = now();
  pid_t c = fork();
  if (c == 0) { pin(0); for (long i = 0; i < yields; i++) sched_yield(); _exit(0); }
  pin(0);
  for (long i = 0; i < yields; i++) sched_yield();
  waitpid(c, 0, 0);
  double yield_us = (now() - t0) / (2.0 * yields) * 1e6;
  *flag = 0;
  c = fork();
  if (c == 0) {
    pin(1);
    for (long i = 1; i <= trips; i++) { while (*flag != 2 * i - 1) ; *flag = 2 * i; }
    _exit(0);
  }
  t0 = now();
  for (long i = 1; i <= trips; i++) { *flag = 2 * i - 1; while (*flag != 2 * i) ; }
  double trip_us = (now() - t0) / trips * 1e6;
  waitpid(c, 0, 0);
  printf("ping-pong CPU 0 <-> 1: %.3f us per round trip (%s); yield between two processes on CPU 0: %.2f us\n",
         trip_us, trip_us > 0.25 ? "different dies" : "shared cache", yield_us);
  return 0;
}
