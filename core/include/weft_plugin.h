/*
 * weft_plugin.h: the contract between weft and a backend plugin.
 * ABI major version 1.
 *
 * A plugin is a shared library (libweft-backend-NAME.so) that exports one
 * data symbol per ABI major version it implements:
 *
 *     const weft_backend_v1_t weft_backend_v1 = { ... };
 *
 * weft looks for the newest version it knows first and adapts older ones.
 * Every struct starts with its own size and ABI version, so fields can be
 * appended in later minor revisions: a reader uses only the fields that fit
 * in struct_size. Only C types cross: opaque handles, (pointer, length)
 * buffers, integer codes and 64-bit millisecond timeouts.
 *
 * Ownership
 *  - Strings and arrays passed by weft are valid only during the call,
 *    except (a) the p2p buffers of a started request, which stay valid
 *    until that request completes or is cancelled, and (b) the host table
 *    `weft_init_v1_t.host`, which stays valid until `destroy`.
 *  - `name` and the strings returned by `last_error` are owned by the
 *    plugin (`last_error`'s until the next call on the same ctx).
 *  - Host services never hand out memory: the caller provides buffers.
 *
 * Threading
 *  - `probe` may be called at any time from any thread.
 *  - `init` and `destroy` are called once per group (per ctx).
 *  - For one ctx, `start`, `wait`, `cancel` and the collectives are called
 *    from one thread at a time. Without WEFT_PLUGIN_CONCURRENT in `flags`,
 *    one request is outstanding at a time (weft runs a group's ops in
 *    order). With it, several may be (a scope's sends and receives, a
 *    collective's step), started in the order they were issued: `start`
 *    never waits for a peer, and `wait` on any request (with any timeout,
 *    0 included) makes progress on every outstanding one, so requests
 *    complete in whatever order the peers allow.
 *  - `abort` may be called from any thread, also while another call on the
 *    same ctx is running; it must make that call return promptly.
 *  - Host services may be called from any thread during `init` and during
 *    any op. A plugin must not call back into weft otherwise, and must not
 *    call a host service from inside `log`.
 *  - Nothing may unwind across this boundary (C++ exceptions, Rust panics):
 *    return a status instead.
 */
#ifndef WEFT_PLUGIN_H
#define WEFT_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WEFT_PLUGIN_ABI_VERSION 1

/* Status codes returned by every call. */
typedef int32_t weft_status;
#define WEFT_OK 0
#define WEFT_PENDING 1          /* wait: not finished yet */
#define WEFT_ERR_TIMEOUT 2
#define WEFT_ERR_PEER_LOST 3    /* last_error's *peer names the rank */
#define WEFT_ERR_INVALID 4
#define WEFT_ERR_UNSUPPORTED 5
#define WEFT_ERR_ABORTED 6
#define WEFT_ERR_BACKEND 7

/* Element types (same codes as weft::DType). */
#define WEFT_F32 0
#define WEFT_F64 1
#define WEFT_F16 2
#define WEFT_BF16 3
#define WEFT_I8 4
#define WEFT_U8 5
#define WEFT_I32 6
#define WEFT_I64 7
#define WEFT_U32 8
#define WEFT_U64 9
#define WEFT_BOOL 10

/* Reduce ops (same codes as weft::ReduceOp). */
#define WEFT_OP_SUM 0
#define WEFT_OP_PRODUCT 1
#define WEFT_OP_MIN 2
#define WEFT_OP_MAX 3
#define WEFT_OP_AVG 4
#define WEFT_OP_BAND 5
#define WEFT_OP_BOR 6
#define WEFT_OP_BXOR 7
#define WEFT_OP_PREMUL_SUM 8

/* Device and layout bits. */
#define WEFT_DEVICE_CPU (1u << 0)
#define WEFT_DEVICE_CUDA (1u << 1)
#define WEFT_LAYOUT_DENSE (1u << 0)
#define WEFT_LAYOUT_SPARSE_COO (1u << 1)

/* Plugin flags (weft_backend_v1_t.flags). */
#define WEFT_PLUGIN_CONCURRENT (1u << 0) /* see Threading above */

/* Log levels. */
#define WEFT_LOG_ERROR 0
#define WEFT_LOG_WARN 1
#define WEFT_LOG_INFO 2
#define WEFT_LOG_DEBUG 3

/* Services weft offers a plugin: the group's store (a namespace private to
 * this backend in this group) and logging. */
typedef struct weft_host_v1_t {
    uint32_t struct_size;
    uint32_t abi_version;
    void *host_ctx; /* pass back as the first argument */
    weft_status (*store_set)(void *host_ctx, const char *key, const void *value, size_t len);
    /* Wait up to timeout_ms for key. On WEFT_OK, copies min(*len, cap)
     * bytes into buf and sets *len to the value's full length. */
    weft_status (*store_get)(void *host_ctx, const char *key, int64_t timeout_ms, void *buf, size_t cap, size_t *len);
    weft_status (*store_add)(void *host_ctx, const char *key, int64_t delta, int64_t *value);
    weft_status (*store_wait)(void *host_ctx, const char *const *keys, size_t num_keys, int64_t timeout_ms);
    void (*log)(void *host_ctx, int32_t level, const char *message);
} weft_host_v1_t;

/* What a plugin gets for each group. */
typedef struct weft_init_v1_t {
    uint32_t struct_size;
    uint32_t abi_version;
    uint32_t rank;
    uint32_t size;
    int64_t timeout_ms; /* setup must finish within it */
    size_t num_hints;
    const char *const *hint_keys;
    const char *const *hint_values;
    const weft_host_v1_t *host;
} weft_init_v1_t;

#define WEFT_P2P_SEND 0
#define WEFT_P2P_RECV 1

/* One transfer of a batch. A receive must get exactly `len` bytes; a
 * message of another length is WEFT_ERR_BACKEND. Receives match the oldest
 * message from `peer` with the same `tag`.
 * Unlike the other structs this one is an array element, so it has no
 * size/version header: its layout is fixed for ABI v1, and a change to it
 * comes with a new major version (weft_backend_v2). */
typedef struct weft_p2p_v1_t {
    uint32_t kind; /* WEFT_P2P_SEND or WEFT_P2P_RECV */
    uint32_t peer;
    uint64_t tag;
    void *buf; /* read-only for sends */
    size_t len;
} weft_p2p_v1_t;

typedef struct weft_backend_v1_t {
    uint32_t struct_size; /* sizeof(weft_backend_v1_t) as the plugin knows it */
    uint32_t abi_version; /* WEFT_PLUGIN_ABI_VERSION */
    const char *name;
    uint32_t devices; /* WEFT_DEVICE_* bits */
    uint32_t layouts; /* WEFT_LAYOUT_* bits */
    int32_t priority; /* rank in "auto"; built-in cpu-tcp is 10 */

    /* WEFT_OK if usable here; otherwise write why (NUL-terminated) into why. */
    weft_status (*probe)(char *why, size_t cap);
    /* Create the per-group context; collective (every rank calls it). On
     * error write a message (NUL-terminated) into err. */
    weft_status (*init)(const weft_init_v1_t *args, void **ctx, char *err, size_t cap);
    void (*destroy)(void *ctx);

    /* Start a batch of transfers, to be finished within timeout_ms. The
     * plugin copies `ops` if it needs them later; the buffers stay valid
     * until the request completes or is cancelled. A plugin may complete
     * the whole batch inside start. */
    weft_status (*start)(void *ctx, const weft_p2p_v1_t *ops, size_t num_ops, int64_t timeout_ms, void **request);
    /* Wait up to timeout_ms (0 polls). WEFT_PENDING: still running. Any
     * other status: finished, and the request is released. */
    weft_status (*wait)(void *ctx, void *request, int64_t timeout_ms);
    /* Give up a request: after this returns, its buffers are not touched
     * and the request is released. */
    void (*cancel)(void *ctx, void *request);
    /* Fail every running and later call on ctx promptly (see Threading). */
    void (*abort)(void *ctx);
    /* Message for the last error on ctx; sets *peer to the lost rank for
     * WEFT_ERR_PEER_LOST, else -1. May return NULL. */
    const char *(*last_error)(void *ctx, int32_t *peer);

    /* Optional native collectives on host memory (NULL: weft runs its
     * generic algorithms over start/wait). Blocking, within timeout_ms. */
    weft_status (*all_reduce)(void *ctx, void *buf, size_t count, int32_t dtype, int32_t op, double premul_factor, int64_t timeout_ms);
    weft_status (*broadcast)(void *ctx, void *buf, size_t bytes, uint32_t root, int64_t timeout_ms);
    weft_status (*barrier)(void *ctx, int64_t timeout_ms);

    /* Appended in ABI 1.1 (zero when struct_size ends before it). */
    uint32_t flags; /* WEFT_PLUGIN_* bits */
} weft_backend_v1_t;

#ifdef __cplusplus
}
#endif

#endif /* WEFT_PLUGIN_H */
