// Cross-core copy probe: is the machine in a slow phase right now?
//
// One thread on CPU A writes 1 MiB, a thread on CPU B copies it out (the
// bytes cross cores just written, as in a shared-memory ring), and one
// thread copies 1 MiB within its own core for comparison; then the two
// threads bounce a counter back and forth, each writing its own cache line
// and reading the other's (the round trip between the cores: about 120 ns
// on this VM calm, 520-720 ns in most moments where its shared-memory
// hand-overs slowed down, though some slow moments kept 120 ns). Prints
// one line per
// sample: the single-core copy and the cross-core hand-over, best and
// mean of 50, in microseconds, and the round trip, mean of 20,000, in
// nanoseconds.
//
//   gcc -O2 -pthread -o cross_core bench/compare/cross_core.c
//   ./cross_core [SAMPLES=10] [CPU_A=0] [CPU_B=1]
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MIB (1 << 20)
#define REPS 50
#define BOUNCES 20000

static _Alignas(64) atomic_long posted;
static _Alignas(64) atomic_long taken;
static _Alignas(64) atomic_long ping;
static _Alignas(64) atomic_long pong;
static char *shared, *src, *dst, *far_dst;
static int cpu_b, samples;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) {
        fprintf(stderr, "cannot bind to CPU %d\n", cpu);
        exit(1);
    }
}

// CPU B, each sample: copy out each megabyte CPU A posts, then say so;
// then answer each bounce.
static void *reader(void *arg) {
    (void)arg;
    pin(cpu_b);
    long k = 0, b = 0;
    for (int s = 0; s < samples; s++) {
        for (int i = 0; i < REPS; i++) {
            k++;
            while (atomic_load_explicit(&posted, memory_order_acquire) != k) {
            }
            memcpy(far_dst, shared, MIB);
            atomic_store_explicit(&taken, k, memory_order_release);
        }
        for (int i = 0; i < BOUNCES; i++) {
            b++;
            while (atomic_load_explicit(&ping, memory_order_acquire) != b) {
            }
            atomic_store_explicit(&pong, b, memory_order_release);
        }
    }
    return NULL;
}

static char *buffer(void) {
    char *p = aligned_alloc(4096, MIB);
    if (!p) exit(1);
    memset(p, 1, MIB);
    return p;
}

int main(int argc, char **argv) {
    samples = argc > 1 ? atoi(argv[1]) : 10;
    int cpu_a = argc > 2 ? atoi(argv[2]) : 0;
    cpu_b = argc > 3 ? atoi(argv[3]) : 1;
    shared = buffer(), src = buffer(), dst = buffer(), far_dst = buffer();
    pin(cpu_a);
    pthread_t t;
    pthread_create(&t, NULL, reader, NULL);
    long k = 0, b = 0;
    for (int s = 0; s < samples; s++) {
        double local = 1e18, cross = 1e18, sum = 0;
        for (int i = 0; i < REPS; i++) {
            double t0 = now_us();
            memcpy(dst, src, MIB);
            __asm__ volatile("" ::"r"(dst) : "memory");
            double t1 = now_us();
            if (t1 - t0 < local) local = t1 - t0;
        }
        for (int i = 0; i < REPS; i++) {
            double t0 = now_us();
            memcpy(shared, src, MIB);
            atomic_store_explicit(&posted, ++k, memory_order_release);
            while (atomic_load_explicit(&taken, memory_order_acquire) != k) {
            }
            double d = now_us() - t0;
            sum += d;
            if (d < cross) cross = d;
        }
        double t0 = now_us();
        for (int i = 0; i < BOUNCES; i++) {
            atomic_store_explicit(&ping, ++b, memory_order_release);
            while (atomic_load_explicit(&pong, memory_order_acquire) != b) {
            }
        }
        double bounce = (now_us() - t0) * 1e3 / BOUNCES;
        printf("local copy %5.0f us   cross-core hand-over %5.0f us (mean %5.0f)   line round trip %4.0f ns\n", local, cross,
               sum / REPS, bounce);
        fflush(stdout);
        struct timespec pause = {0, 100 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
    pthread_join(t, NULL);
    return 0;
}
