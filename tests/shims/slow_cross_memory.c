/* An LD_PRELOAD shim for the shm tests: after the first SLOW_CMA_AFTER
 * calls (default 0), cross-memory copies (process_vm_readv,
 * process_vm_writev) take SLOW_CMA_NS_PER_BYTE more nanoseconds per byte
 * copied (default 2: 2 ms a MiB), as where a hypervisor makes the kernel
 * pin every page. A slow phase that starts mid-run: shm has to find, while
 * the run goes, that the ring has become the cheaper scheme. At exit the
 * process prints how many copies it made ("slow_cross_memory: N copies"). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>

static long calls;

__attribute__((destructor)) static void report(void) {
    fprintf(stderr, "slow_cross_memory: %ld copies\n", __atomic_load_n(&calls, __ATOMIC_RELAXED));
}

static void pause_for(ssize_t bytes) {
    const char *after = getenv("SLOW_CMA_AFTER");
    if (__atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED) < (after ? atol(after) : 0) || bytes <= 0)
        return;
    const char *v = getenv("SLOW_CMA_NS_PER_BYTE");
    long per = v ? atol(v) : 2;
    if (per <= 0)
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
    pause_for(n);
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
