// Gloo anchor for weft's comparison harness: times Gloo's collectives the
// way `weft bench` times its own (a barrier before each iteration, the
// slowest rank's time per iteration, the median over iterations).
// Ranks come from RANK / WORLD_SIZE (run it under `weft run`); rendezvous
// through a FileStore in GLOO_STORE_DIR.
// With TIMING "span" (as `weft bench --timing span`), an iteration's time
// runs from the first rank's start to the last rank's end on the host's
// monotonic clock (steady_clock; every rank on one host). With "fresh" (as
// `weft bench --fresh-inputs`), every rank rewrites its input before each
// iteration, untimed.
// Usage: gloo_bench OPS MINBYTES MAXBYTES FACTOR ITERS WARMUP [window|span] [fresh]
// Prints: "op bytes median_us" per size on rank 0.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

using Ctx = std::shared_ptr<gloo::Context>;

static void barrier(const Ctx &c) {
    gloo::BarrierOptions o(c);
    gloo::barrier(o);
}

using Reduce = void (*)(void *, const void *, const void *, size_t);

static void all_reduce_in_place(const Ctx &c, std::vector<double> &t, Reduce f) {
    gloo::AllreduceOptions o(c);
    o.setOutput(t.data(), t.size());
    o.setReduceFunction(f);
    gloo::allreduce(o);
}

/// The median over iterations of the slowest rank's time; with `starts`,
/// `t` holds end times and each iteration's time is the latest end less
/// the earliest start.
static double median_of_max(const Ctx &c, std::vector<double> t, std::vector<double> *starts) {
    all_reduce_in_place(c, t, static_cast<Reduce>(&gloo::max<double>));
    if (starts) {
        all_reduce_in_place(c, *starts, static_cast<Reduce>(&gloo::min<double>));
        for (size_t i = 0; i < t.size(); i++) t[i] -= (*starts)[i];
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

/// Untimed iterations before each timing (argument WARMUP).
static int warmup = 3;
/// Whether iterations are timed as spans (argument TIMING).
static bool span = false;
/// Whether each rank rewrites its input before every iteration, untimed
/// (argument "fresh", as `weft bench --fresh-inputs`).
static bool fresh = false;
/// The input every op reads (the current size's `a`).
static std::vector<float> *input = nullptr;

/// Before iteration i with "fresh": every byte of the input stored on this
/// rank's core (the patterns weft bench writes: normal floats).
static void refresh(int i) {
    if (fresh && input) memset(input->data(), (i & 1) ? 0x40 : 0x3f, input->size() * sizeof(float));
}

static double host_clock_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double timeit(const Ctx &c, int iters, const std::function<void()> &f) {
    for (int i = 0; i < warmup; i++) {
        refresh(i);
        f();
    }
    std::vector<double> t, s;
    for (int i = 0; i < iters; i++) {
        refresh(i);
        barrier(c);
        double a = host_clock_us();
        f();
        double b = host_clock_us();
        s.push_back(a);
        t.push_back(span ? b : b - a);
    }
    return median_of_max(c, t, span ? &s : nullptr);
}

int main(int argc, char **argv) {
    if (argc < 7 || argc > 9) {
        fprintf(stderr, "usage: gloo_bench OPS MINBYTES MAXBYTES FACTOR ITERS WARMUP [window|span] [fresh]\n");
        return 2;
    }
    int rank = atoi(getenv("RANK")), size = atoi(getenv("WORLD_SIZE"));
    std::string ops = argv[1];
    size_t minb = strtoull(argv[2], 0, 10), maxb = strtoull(argv[3], 0, 10), factor = strtoull(argv[4], 0, 10);
    int iters = atoi(argv[5]);
    warmup = atoi(argv[6]);
    for (int i = 7; i < argc; i++) {
        span |= std::string(argv[i]) == "span";
        fresh |= std::string(argv[i]) == "fresh";
    }
    gloo::transport::tcp::attr attr("127.0.0.1");
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(getenv("GLOO_STORE_DIR"));
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->connectFullMesh(store, dev);
    Ctx c = ctx;
    auto want = [&](const char *op) { return ("," + ops + ",").find(std::string(",") + op + ",") != std::string::npos; };
    for (size_t bytes = minb; bytes <= maxb; bytes *= factor) {
        size_t n = std::max<size_t>(bytes / 4, 1);
        size_t part = std::max<size_t>(n / size, 1), full = part * size;
        std::vector<float> a(full, 1.0f), b(full, 0.0f);
        input = &a;
        auto report = [&](const char *op, size_t nbytes, double us) {
            if (rank == 0) printf("%s %zu %.3f\n", op, nbytes, us);
        };
        if (want("all_reduce")) {
            double best = 1e300;
            for (auto algo : {gloo::AllreduceOptions::Algorithm::RING, gloo::AllreduceOptions::Algorithm::BCUBE}) {
                double us = timeit(c, iters, [&] {
                    gloo::AllreduceOptions o(c);
                    o.setAlgorithm(algo);
                    o.setOutput(a.data(), n);
                    o.setReduceFunction(static_cast<void (*)(void *, const void *, const void *, size_t)>(&gloo::sum<float>));
                    gloo::allreduce(o);
                });
                best = std::min(best, us);
            }
            report("all_reduce", n * 4, best);
        }
        if (want("all_gather")) {
            report("all_gather", full * 4, timeit(c, iters, [&] {
                gloo::AllgatherOptions o(c);
                o.setInput(a.data(), part);
                o.setOutput(b.data(), full);
                gloo::allgather(o);
            }));
        }
        if (want("broadcast")) {
            report("broadcast", n * 4, timeit(c, iters, [&] {
                gloo::BroadcastOptions o(c);
                o.setOutput(a.data(), n);
                o.setRoot(0);
                gloo::broadcast(o);
            }));
        }
        if (want("reduce")) {
            report("reduce", n * 4, timeit(c, iters, [&] {
                gloo::ReduceOptions o(c);
                o.setInput(a.data(), n);
                o.setOutput(b.data(), n);
                o.setRoot(0);
                o.setReduceFunction(static_cast<void (*)(void *, const void *, const void *, size_t)>(&gloo::sum<float>));
                gloo::reduce(o);
            }));
        }
        if (want("all_to_all")) {
            report("all_to_all", full * 4, timeit(c, iters, [&] {
                gloo::AlltoallOptions o(c);
                o.setInput(a.data(), full);
                o.setOutput(b.data(), full);
                gloo::alltoall(o);
            }));
        }
        if (want("p2p")) { /* chain 0 -> 1 -> ... -> W-1 */
            auto buf = c->createUnboundBuffer(a.data(), n * 4);
            uint64_t slot = 0;
            report("p2p", n * 4, timeit(c, iters, [&] {
                if (rank > 0) {
                    buf->recv(rank - 1, slot);
                    buf->waitRecv();
                }
                if (rank + 1 < size) {
                    buf->send(rank + 1, slot);
                    buf->waitSend();
                }
            }));
        }
        if (want("barrier") && bytes == minb) report("barrier", 0, timeit(c, iters, [&] { barrier(c); }));
    }
    return 0;
}
