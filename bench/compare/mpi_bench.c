/* Open MPI anchor for weft's comparison harness: times MPI collectives the
 * way `weft bench` times its own (a barrier before each iteration, the
 * slowest rank's time per iteration, the median over iterations).
 * `put` is MPI_Put closed by MPI_Win_fence (Open MPI's osc).
 * With TIMING "span" (as `weft bench --timing span`), an iteration's time
 * runs from the first rank's start to the last rank's end on the host's
 * monotonic clock (every rank on one host). With "fresh" (as `weft bench
 * --fresh-inputs`), every rank rewrites its input before each iteration,
 * untimed, as programs compute what they send right before sending it.
 * Usage: mpirun -np 2 [--mca btl tcp,self | vader,self] mpi_bench OPS MINBYTES MAXBYTES FACTOR ITERS WARMUP [window|span] [fresh]
 * Prints: "op bytes median_us" per size on rank 0. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int rank, size, iters, warmup, span, fresh;
static float *A, *B;
/* Bytes of A (the input of every op). */
static size_t a_bytes;

/* Before iteration i with "fresh": every byte of the input stored on this
 * rank's core (the patterns weft bench writes: normal floats). */
static void refresh(int i) {
    if (fresh) memset(A, (i & 1) ? 0x40 : 0x3f, a_bytes);
}

static int want(const char *ops, const char *op) {
    char pat[64], list[512];
    snprintf(list, sizeof list, ",%s,", ops);
    snprintf(pat, sizeof pat, ",%s,", op);
    return strstr(list, pat) != NULL;
}

typedef void (*op_fn)(size_t n, size_t part);

/* Microseconds on the host's monotonic clock, which every rank shares. */
static double host_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static double timeit(op_fn f, size_t n, size_t part) {
    double *t = malloc(sizeof(double) * iters), *s = malloc(sizeof(double) * iters);
    for (int i = 0; i < warmup; i++) {
        refresh(i);
        f(n, part);
    }
    for (int i = 0; i < iters; i++) {
        refresh(i);
        MPI_Barrier(MPI_COMM_WORLD);
        double a = host_clock();
        f(n, part);
        double b = host_clock();
        s[i] = a;
        t[i] = span ? b : b - a;
    }
    MPI_Allreduce(MPI_IN_PLACE, t, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (span) {
        MPI_Allreduce(MPI_IN_PLACE, s, iters, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
        for (int i = 0; i < iters; i++) t[i] -= s[i];
    }
    free(s);
    qsort(t, iters, sizeof(double), cmp);
    double m = t[iters / 2];
    free(t);
    return m;
}

static void all_reduce(size_t n, size_t p) { (void)p; MPI_Allreduce(MPI_IN_PLACE, A, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); }
static void all_gather(size_t n, size_t p) { (void)n; MPI_Allgather(A, (int)p, MPI_FLOAT, B, (int)p, MPI_FLOAT, MPI_COMM_WORLD); }
static void reduce_scatter(size_t n, size_t p) { (void)n; MPI_Reduce_scatter_block(A, B, (int)p, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); }
static void all_to_all(size_t n, size_t p) { (void)n; MPI_Alltoall(A, (int)p, MPI_FLOAT, B, (int)p, MPI_FLOAT, MPI_COMM_WORLD); }
static void broadcast(size_t n, size_t p) { (void)p; MPI_Bcast(A, (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD); }
static void reduce(size_t n, size_t p) { (void)p; MPI_Reduce(A, B, (int)n, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD); }
static void p2p(size_t n, size_t p) { /* chain 0 -> 1 -> ... -> W-1 */
    (void)p;
    if (rank > 0) MPI_Recv(A, (int)n, MPI_FLOAT, rank - 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (rank + 1 < size) MPI_Send(A, (int)n, MPI_FLOAT, rank + 1, 0, MPI_COMM_WORLD);
}
static void sendrecv(size_t n, size_t p) { /* each rank to r+1, from r-1, at once */
    (void)p;
    MPI_Sendrecv(A, (int)n, MPI_FLOAT, (rank + 1) % size, 0, B, (int)n, MPI_FLOAT, (rank + size - 1) % size, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
}
static void barrier(size_t n, size_t p) { (void)n; (void)p; MPI_Barrier(MPI_COMM_WORLD); }
/* One-sided, as weft's put: rank r puts N bytes into rank r+1's window,
 * then every rank closes the epoch (MPI_Win_fence), after which the bytes
 * are in place at the target. The window is allocated per size. */
static MPI_Win win;
static void put(size_t n, size_t p) {
    (void)p;
    if (rank + 1 < size) MPI_Put(A, (int)n, MPI_FLOAT, rank + 1, 0, (int)n, MPI_FLOAT, win);
    MPI_Win_fence(0, win);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 7 || argc > 9) {
        if (rank == 0) fprintf(stderr, "usage: mpi_bench OPS MINBYTES MAXBYTES FACTOR ITERS WARMUP [window|span] [fresh]\n");
        MPI_Finalize();
        return 2;
    }
    const char *ops = argv[1];
    size_t minb = strtoull(argv[2], 0, 10), maxb = strtoull(argv[3], 0, 10), factor = strtoull(argv[4], 0, 10);
    iters = atoi(argv[5]);
    warmup = atoi(argv[6]);
    for (int i = 7; i < argc; i++) {
        span |= strcmp(argv[i], "span") == 0;
        fresh |= strcmp(argv[i], "fresh") == 0;
    }
    struct { const char *name; op_fn f; int full; } table[] = {
        {"all_reduce", all_reduce, 0}, {"all_gather", all_gather, 1}, {"reduce_scatter", reduce_scatter, 1},
        {"all_to_all", all_to_all, 1}, {"broadcast", broadcast, 0}, {"reduce", reduce, 0}, {"p2p", p2p, 0},
        {"sendrecv", sendrecv, 0}, {"put", put, 0},
    };
    for (size_t bytes = minb; bytes <= maxb; bytes *= factor) {
        size_t n = bytes / 4 ? bytes / 4 : 1;
        size_t part = n / size ? n / size : 1, full = part * size;
        a_bytes = (full > n ? full : n) * sizeof(float);
        A = calloc(full > n ? full : n, sizeof(float));
        B = calloc(full > n ? full : n, sizeof(float));
        /* Real data in real pages, as weft bench and gloo_bench use: a
         * buffer calloc left untouched maps the shared zero page, which
         * single-copy reads serve from cache and which flatters the anchor. */
        for (size_t i = 0; i < (full > n ? full : n); i++) A[i] = (float)(rank + 1 + (int)(i % 7)), B[i] = -1.0f;
        float *base = NULL;
        if (want(ops, "put")) {
            MPI_Win_allocate((MPI_Aint)(n * sizeof(float)), sizeof(float), MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
            MPI_Win_fence(0, win);
        }
        for (size_t k = 0; k < sizeof table / sizeof *table; k++) {
            if (!want(ops, table[k].name)) continue;
            double us = timeit(table[k].f, n, part);
            if (rank == 0) printf("%s %zu %.3f\n", table[k].name, (table[k].full ? full : n) * 4, us);
        }
        if (want(ops, "barrier") && bytes == minb) {
            double us = timeit(barrier, 0, 0);
            if (rank == 0) printf("barrier 0 %.3f\n", us);
        }
        if (want(ops, "put")) MPI_Win_free(&win);
        free(A);
        free(B);
    }
    MPI_Finalize();
    return 0;
}
