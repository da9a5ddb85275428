/*
 * A weft backend plugin in plain C: point-to-point transfers over Unix
 * domain sockets between ranks on one host. weft runs every collective on
 * top of it. Rendezvous goes through the host's store services; sockets
 * live in the abstract namespace, so nothing is left on disk.
 *
 * Build: cc -O2 -shared -fPIC -I core/include -o libweft-backend-c-uds.so weft_uds.c
 *
 * Progress is single-threaded: `start` queues a batch, `wait` moves bytes
 * (reading every peer so that two ranks sending to each other never block
 * each other) until the batch is done, the timeout passes, or `abort`.
 */
#define _GNU_SOURCE
#include "weft_plugin.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifndef WEFT_UDS_NAME
#define WEFT_UDS_NAME "c-uds"
#endif

typedef struct msg { /* a message that arrived before its receive */
    struct msg *next;
    uint32_t peer;
    uint64_t tag;
    char *data;
    size_t len;
} msg;

typedef struct {
    weft_p2p_v1_t op;
    size_t done; /* bytes moved (sends count the 16-byte header too) */
    int complete;
} xfer;

typedef struct request {
    xfer *x;
    size_t n;
} request;

typedef struct {
    unsigned char hdr[16];
    size_t hdr_got;
    char *dst; /* where the payload goes: a posted receive or `own` */
    char *own; /* malloc'd buffer of an unexpected message */
    size_t len, got;
    uint64_t tag;
    xfer *target;
} reader;

typedef struct {
    uint32_t rank, size;
    int *fd;
    int *gone; /* peer closed its end cleanly (between frames) */
    reader *rd;
    msg *unexpected;
    request *cur;
    volatile int aborted;
    char err[512];
    int32_t err_peer;
    const weft_host_v1_t *host;
} ctx_t;

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static weft_status fail(ctx_t *c, weft_status s, int32_t peer, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    c->err_peer = peer;
    return s;
}

static void addr_of(struct sockaddr_un *a, socklen_t *len, uint64_t nonce, uint32_t rank) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "weft-uds-%016llx-%u", (unsigned long long)nonce, rank);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static weft_status probe(char *why, size_t cap) {
    (void)why;
    (void)cap;
    return WEFT_OK;
}

static void destroy(void *p) {
    ctx_t *c = p;
    if (!c) return;
    for (uint32_t i = 0; i < c->size; i++)
        if (c->fd[i] >= 0) close(c->fd[i]);
    for (msg *m = c->unexpected; m;) {
        msg *n = m->next;
        free(m->data);
        free(m);
        m = n;
    }
    for (uint32_t i = 0; i < c->size; i++) free(c->rd[i].own);
    free(c->fd);
    free(c->gone);
    free(c->rd);
    free(c->cur ? c->cur->x : NULL);
    free(c->cur);
    free(c);
}

static weft_status init(const weft_init_v1_t *a, void **out, char *err, size_t cap) {
    ctx_t *c = calloc(1, sizeof *c);
    if (!c) return WEFT_ERR_BACKEND;
    c->rank = a->rank;
    c->size = a->size;
    c->host = a->host;
    c->err_peer = -1;
    c->fd = malloc(sizeof(int) * a->size);
    c->rd = calloc(a->size, sizeof(reader));
    c->gone = calloc(a->size, sizeof(int));
    for (uint32_t i = 0; i < a->size; i++) c->fd[i] = -1;
    const weft_host_v1_t *h = a->host;
    int64_t deadline = now_ms() + a->timeout_ms;

    uint64_t nonce = 0;
    size_t len = 0;
    if (a->rank == 0) {
        nonce = ((uint64_t)getpid() << 32) ^ (uint64_t)now_ms() ^ (uint64_t)(uintptr_t)c;
        if (h->store_set(h->host_ctx, "nonce", &nonce, sizeof nonce) != WEFT_OK) goto store_fail;
    } else if (h->store_get(h->host_ctx, "nonce", a->timeout_ms, &nonce, sizeof nonce, &len) != WEFT_OK || len != sizeof nonce) {
        goto store_fail;
    }
    struct sockaddr_un sa;
    socklen_t sl;
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    addr_of(&sa, &sl, nonce, a->rank);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sl) != 0 || listen(lfd, (int)a->size) != 0) {
        snprintf(err, cap, "c-uds: cannot listen: %s", strerror(errno));
        if (lfd >= 0) close(lfd);
        destroy(c);
        return WEFT_ERR_BACKEND;
    }
    char key[32];
    snprintf(key, sizeof key, "ready/%u", a->rank);
    h->store_set(h->host_ctx, key, "1", 1);
    /* Connect to lower ranks (their listener is ready once their key is set). */
    for (uint32_t p = 0; p < a->rank; p++) {
        snprintf(key, sizeof key, "ready/%u", p);
        const char *keys[1] = {key};
        if (h->store_wait(h->host_ctx, keys, 1, deadline - now_ms()) != WEFT_OK) goto store_fail;
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        addr_of(&sa, &sl, nonce, p);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sl) != 0 || write(fd, &a->rank, 4) != 4) {
            snprintf(err, cap, "c-uds: rank %u cannot connect to rank %u: %s", a->rank, p, strerror(errno));
            if (fd >= 0) close(fd);
            close(lfd);
            destroy(c);
            return WEFT_ERR_BACKEND;
        }
        c->fd[p] = fd;
    }
    /* Accept higher ranks, each announcing its rank. */
    for (uint32_t k = a->rank + 1; k < a->size; k++) {
        struct pollfd pf = {lfd, POLLIN, 0};
        int64_t left = deadline - now_ms();
        if (left <= 0 || poll(&pf, 1, (int)left) != 1) {
            snprintf(err, cap, "c-uds: rank %u timed out waiting for higher ranks to connect", a->rank);
            close(lfd);
            destroy(c);
            return WEFT_ERR_TIMEOUT;
        }
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        uint32_t peer = 0;
        if (fd < 0 || read(fd, &peer, 4) != 4 || peer <= a->rank || peer >= a->size || c->fd[peer] >= 0) {
            if (fd >= 0) close(fd);
            k--; /* a stray: keep waiting for the right peer */
            continue;
        }
        c->fd[peer] = fd;
    }
    close(lfd);
    *out = c;
    return WEFT_OK;
store_fail:
    snprintf(err, cap, "c-uds: rendezvous through the store failed");
    destroy(c);
    return WEFT_ERR_TIMEOUT;
}

/* Find the oldest receive of the current batch waiting for (peer, tag). */
static xfer *posted(ctx_t *c, uint32_t peer, uint64_t tag) {
    if (!c->cur) return NULL;
    for (size_t i = 0; i < c->cur->n; i++) {
        xfer *x = &c->cur->x[i];
        if (x->op.kind == WEFT_P2P_RECV && !x->complete && x->done == 0 && x->op.peer == peer && x->op.tag == tag) {
            /* done == 0 and not claimed by a reader */
            int claimed = 0;
            for (uint32_t p = 0; p < c->size; p++)
                if (c->rd[p].target == x) claimed = 1;
            if (!claimed) return x;
        }
    }
    return NULL;
}

/* Read what is available from `peer`. Returns WEFT_OK or an error. */
static weft_status pump_in(ctx_t *c, uint32_t peer) {
    reader *r = &c->rd[peer];
    for (;;) {
        ssize_t n;
        if (r->hdr_got < 16) {
            n = recv(c->fd[peer], r->hdr + r->hdr_got, 16 - r->hdr_got, MSG_DONTWAIT);
        } else {
            if (r->got == r->len) n = 0; /* zero-length payload: nothing to read */
            else n = recv(c->fd[peer], r->dst + r->got, r->len - r->got, MSG_DONTWAIT);
        }
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return WEFT_OK;
            return fail(c, WEFT_ERR_PEER_LOST, (int32_t)peer, "c-uds: connection to rank %u broke: %s", peer, strerror(errno));
        }
        if (n == 0 && r->hdr_got == 0) { /* closed between frames: fine unless needed */
            close(c->fd[peer]);
            c->fd[peer] = -1;
            c->gone[peer] = 1;
            return WEFT_OK;
        }
        if (n == 0 && !(r->hdr_got == 16 && r->got == r->len))
            return fail(c, WEFT_ERR_PEER_LOST, (int32_t)peer, "c-uds: rank %u closed its connection in the middle of a message", peer);
        if (r->hdr_got < 16) {
            r->hdr_got += (size_t)n;
            if (r->hdr_got < 16) continue;
            memcpy(&r->tag, r->hdr, 8);
            memcpy(&r->len, r->hdr + 8, 8);
            r->got = 0;
            xfer *x = posted(c, peer, r->tag);
            if (x && x->op.len != r->len)
                return fail(c, WEFT_ERR_BACKEND, -1, "c-uds: size mismatch: rank %u sent %zu bytes, %zu expected", peer, r->len, x->op.len);
            if (x) {
                r->target = x;
                r->dst = x->op.buf;
            } else {
                r->own = malloc(r->len ? r->len : 1);
                if (!r->own) return fail(c, WEFT_ERR_BACKEND, -1, "c-uds: out of memory");
                r->dst = r->own;
            }
        } else {
            r->got += (size_t)n;
        }
        if (r->got == r->len) { /* frame complete */
            xfer *late = r->target ? NULL : posted(c, peer, r->tag);
            if (late && late->op.len != r->len)
                return fail(c, WEFT_ERR_BACKEND, -1, "c-uds: size mismatch: rank %u sent %zu bytes, %zu expected", peer, r->len, late->op.len);
            if (late) { /* its receive was posted while the frame arrived */
                if (r->len) memcpy(late->op.buf, r->own, r->len);
                late->done = r->len;
                late->complete = 1;
                free(r->own);
            } else if (r->target) {
                r->target->done = r->len;
                r->target->complete = 1;
            } else {
                msg *m = malloc(sizeof *m), **tail = &c->unexpected;
                m->next = NULL;
                m->peer = peer;
                m->tag = r->tag;
                m->data = r->own;
                m->len = r->len;
                while (*tail) tail = &(*tail)->next;
                *tail = m;
            }
            r->target = NULL;
            r->own = NULL;
            r->hdr_got = 0;
            r->got = r->len = 0;
        }
    }
}

/* Write what fits for the first unfinished send to each peer. */
static weft_status pump_out(ctx_t *c, int *want_out) {
    for (size_t i = 0; i < c->cur->n; i++) {
        xfer *x = &c->cur->x[i];
        if (x->op.kind != WEFT_P2P_SEND || x->complete || want_out[x->op.peer]) continue;
        want_out[x->op.peer] = 1; /* later sends to this peer wait their turn */
        unsigned char hdr[16];
        memcpy(hdr, &x->op.tag, 8);
        memcpy(hdr + 8, &x->op.len, 8);
        while (!x->complete) {
            ssize_t n = x->done < 16 ? send(c->fd[x->op.peer], hdr + x->done, 16 - x->done, MSG_DONTWAIT | MSG_NOSIGNAL)
                                     : send(c->fd[x->op.peer], (char *)x->op.buf + (x->done - 16), x->op.len - (x->done - 16), MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
                return fail(c, WEFT_ERR_PEER_LOST, (int32_t)x->op.peer, "c-uds: send to rank %u failed: %s", x->op.peer, strerror(errno));
            }
            x->done += (size_t)n;
            if (x->done == 16 + x->op.len) x->complete = 1;
        }
        if (x->complete) want_out[x->op.peer] = 0, i = (size_t)-1; /* rescan: the next send may start */
    }
    return WEFT_OK;
}

static weft_status start(void *p, const weft_p2p_v1_t *ops, size_t n, int64_t timeout_ms, void **out) {
    ctx_t *c = p;
    (void)timeout_ms;
    if (c->aborted) return fail(c, WEFT_ERR_ABORTED, -1, "c-uds: aborted");
#ifdef WEFT_UDS_TEST_FAIL_RANK /* for weft's misbehaving-plugin tests only */
    if (c->rank == WEFT_UDS_TEST_FAIL_RANK) return fail(c, WEFT_ERR_BACKEND, -1, "c-uds: injected failure on rank %u", c->rank);
#endif
    if (c->cur) return fail(c, WEFT_ERR_INVALID, -1, "c-uds: a batch is already running");
    request *q = calloc(1, sizeof *q);
    q->x = calloc(n ? n : 1, sizeof(xfer));
    q->n = n;
    for (size_t i = 0; i < n; i++) {
        q->x[i].op = ops[i];
        if (ops[i].peer >= c->size || ops[i].peer == c->rank) {
            free(q->x);
            free(q);
            return fail(c, WEFT_ERR_INVALID, -1, "c-uds: bad peer %u", ops[i].peer);
        }
        if (ops[i].kind == WEFT_P2P_RECV) { /* take a message that came early */
            for (msg **m = &c->unexpected; *m; m = &(*m)->next) {
                if ((*m)->peer == ops[i].peer && (*m)->tag == ops[i].tag) {
                    msg *hit = *m;
                    if (hit->len != ops[i].len) {
                        free(q->x);
                        free(q);
                        return fail(c, WEFT_ERR_BACKEND, -1, "c-uds: size mismatch: rank %u sent %zu bytes, %zu expected", hit->peer, hit->len, ops[i].len);
                    }
                    if (hit->len) memcpy(ops[i].buf, hit->data, hit->len);
                    q->x[i].complete = 1;
                    *m = hit->next;
                    free(hit->data);
                    free(hit);
                    break;
                }
            }
        }
    }
    c->cur = q;
    *out = q;
    return WEFT_OK;
}

static void release(ctx_t *c, request *q) {
    for (uint32_t p = 0; p < c->size; p++) {
        reader *r = &c->rd[p];
        if (r->target && r->target >= q->x && r->target < q->x + q->n) {
            /* A frame is arriving into this batch's buffer: keep it as unexpected. */
            r->own = malloc(r->len ? r->len : 1);
            memcpy(r->own, r->dst, r->got);
            r->dst = r->own;
            r->target = NULL;
        }
    }
    if (c->cur == q) c->cur = NULL;
    free(q->x);
    free(q);
}

static weft_status wait_(void *p, void *req, int64_t timeout_ms) {
    ctx_t *c = p;
    request *q = req;
    int64_t deadline = now_ms() + timeout_ms;
    int *busy = calloc(c->size, sizeof(int));
    struct pollfd *pf = calloc(c->size, sizeof *pf);
    weft_status s = WEFT_PENDING;
    for (;;) {
        if (c->aborted) { s = fail(c, WEFT_ERR_ABORTED, -1, "c-uds: aborted"); break; }
        memset(busy, 0, sizeof(int) * c->size);
        if ((s = pump_out(c, busy)) != WEFT_OK) break;
        s = WEFT_PENDING;
        int nfd = 0;
        for (uint32_t i = 0; i < c->size; i++) {
            if (c->fd[i] < 0) continue;
            pf[nfd].fd = c->fd[i];
            pf[nfd].events = POLLIN | (busy[i] ? POLLOUT : 0);
            pf[nfd].revents = 0;
            nfd++;
        }
        int done = 1;
        for (size_t i = 0; i < q->n; i++) {
            done &= q->x[i].complete;
            if (!q->x[i].complete && c->gone[q->x[i].op.peer]) {
                s = fail(c, WEFT_ERR_PEER_LOST, (int32_t)q->x[i].op.peer, "c-uds: rank %u left while this rank still needed it", q->x[i].op.peer);
                goto out;
            }
        }
        if (done) { s = WEFT_OK; break; }
        int64_t left = deadline - now_ms();
        if (left < 0) break;
        if (poll(pf, (nfds_t)nfd, (int)(left > 50 ? 50 : left)) < 0 && errno != EINTR) {
            s = fail(c, WEFT_ERR_BACKEND, -1, "c-uds: poll: %s", strerror(errno));
            break;
        }
        for (int k = 0; k < nfd; k++) {
            if (!(pf[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            for (uint32_t i = 0; i < c->size; i++)
                if (c->fd[i] == pf[k].fd && (s = pump_in(c, i)) != WEFT_OK) goto out;
            s = WEFT_PENDING;
        }
    }
out:
    free(busy);
    free(pf);
    if (s != WEFT_PENDING) release(c, q);
    return s;
}

static void cancel(void *p, void *req) { release(p, req); }

static void abort_(void *p) {
    ctx_t *c = p;
    c->aborted = 1;
    for (uint32_t i = 0; i < c->size; i++)
        if (c->fd[i] >= 0) shutdown(c->fd[i], SHUT_RDWR);
}

static const char *last_error(void *p, int32_t *peer) {
    ctx_t *c = p;
    if (peer) *peer = c->err_peer;
    return c->err;
}

const weft_backend_v1_t weft_backend_v1 = {
    .struct_size = sizeof(weft_backend_v1_t),
    .abi_version = WEFT_PLUGIN_ABI_VERSION,
    .name = WEFT_UDS_NAME,
    .devices = WEFT_DEVICE_CPU,
    .layouts = WEFT_LAYOUT_DENSE,
    .priority = 1,
    .probe = probe,
    .init = init,
    .destroy = destroy,
    .start = start,
    .wait = wait_,
    .cancel = cancel,
    .abort = abort_,
    .last_error = last_error,
};
