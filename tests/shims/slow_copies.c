/* An LD_PRELOAD shim for the shm tests: a slow phase that starts mid-run,
 * for one way of copying and not the other, so that shm has to find,
 * while the run goes, that the other scheme has become the cheaper.
 *
 * - Cross-memory copies (process_vm_readv, process_vm_writev): after the
 *   first SLOW_CMA_AFTER calls, each takes SLOW_CMA_NS_PER_BYTE more
 *   nanoseconds per byte copied, as where a hypervisor makes the kernel
 *   pin every page.
 * - Large copies in the process (memcpy of at least 16 KiB: the ring's
 *   pieces and an op's own outputs): after the first SLOW_MEMCPY_AFTER,
 *   each takes SLOW_MEMCPY_NS_PER_BYTE more, as copies through shared
 *   memory do where a VM's cores hand lines over slowly. Copies weft
 *   streams to memory (kernels::copy from 4 MiB, a ring's reads of
 *   messages from 16 MiB) call no memcpy and are not slowed.
 *
 * Unset or 0: no slower. At exit the process prints how many of each it
 * made ("slow_copies: N cross-memory, M large memcpy"). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>

/* Copies of at least this many bytes count as large. */
#define LARGE (16 << 10)

static long cma_calls, memcpy_calls;

__attribute__((destructor)) static void report(void) {
    fprintf(stderr, "slow_copies: %ld cross-memory, %ld large memcpy\n", __atomic_load_n(&cma_calls, __ATOMIC_RELAXED),
            __atomic_load_n(&memcpy_calls, __ATOMIC_RELAXED));
}

static long env_long(const char *name) {
    const char *v = getenv(name);
    return v ? atol(v) : 0;
}

/* Count one copy of `bytes` in *calls; past `after` copies, sleep `per`
 * ns a byte. */
static void pause_for(long *calls, long bytes, long after, long per) {
    if (__atomic_fetch_add(calls, 1, __ATOMIC_RELAXED) < after || bytes <= 0 || per <= 0)
        return;
    long long ns = (long long)bytes * per;
    struct timespec t = {ns / 1000000000LL, ns % 1000000000LL};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}

typedef ssize_t (*copy_fn)(pid_t, const struct iovec *, unsigned long, const struct iovec *, unsigned long, unsigned long);

/* The real `name` (found once into *real), then the pause. */
static ssize_t slowed(copy_fn *real, const char *name, pid_t pid, const struct iovec *local, unsigned long nl,
                      const struct iovec *remote, unsigned long nr, unsigned long flags) {
    if (!*real)
        *real = (copy_fn)dlsym(RTLD_NEXT, name);
    ssize_t n = (*real)(pid, local, nl, remote, nr, flags);
    pause_for(&cma_calls, n, env_long("SLOW_CMA_AFTER"), env_long("SLOW_CMA_NS_PER_BYTE"));
    return n;
}

ssize_t process_vm_readv(pid_t pid, const struct iovec *local, unsigned long nl, const struct iovec *remote, unsigned long nr,
                         unsigned long flags) {
    static copy_fn real;
    return slowed(&real, "process_vm_readv", pid, local, nl, remote, nr, flags);
}

ssize_t process_vm_writev(pid_t pid, const struct iovec *local, unsigned long nl, const struct iovec *remote, unsigned long nr,
                          unsigned long flags) {
    static copy_fn real;
    return slowed(&real, "process_vm_writev", pid, local, nl, remote, nr, flags);
}

/* memcpy is memmove here (a superset), then the pause for large ones; the
 * environment is read once (getenv is not async-signal-safe, and memcpy
 * is called everywhere). */
void *memcpy(void *dst, const void *src, size_t n) {
    memmove(dst, src, n);
    if (n >= LARGE) {
        static long after = -1, per;
        if (__atomic_load_n(&after, __ATOMIC_ACQUIRE) < 0) {
            __atomic_store_n(&per, env_long("SLOW_MEMCPY_NS_PER_BYTE"), __ATOMIC_RELAXED);
            __atomic_store_n(&after, env_long("SLOW_MEMCPY_AFTER"), __ATOMIC_RELEASE);
        }
        pause_for(&memcpy_calls, (long)n, __atomic_load_n(&after, __ATOMIC_ACQUIRE), __atomic_load_n(&per, __ATOMIC_RELAXED));
    }
    return dst;
}
