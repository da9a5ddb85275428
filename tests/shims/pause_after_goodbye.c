/* An LD_PRELOAD shim for the teardown tests: after a process writes a
 * cpu-tcp goodbye frame (a bare 24-byte header of kind 2), it sleeps
 * PAUSE_AFTER_GOODBYE_MS milliseconds, as a leaving rank does when the
 * scheduler takes the core from it between two goodbyes (what 256 ranks
 * on 2 cores did to a fixed time budget for saying goodbye). Only send()
 * and sendmsg() are wrapped: cpu-tcp writes frames with nothing else. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* The header's first 8 bytes: magic "WFT1" (0x57465431, little endian),
 * kind 2 (goodbye), lead 0, two zero bytes. Tag and length are zero too. */
static const unsigned char GOODBYE[24] = {0x31, 0x54, 0x46, 0x57, 2};

static void pause_if_goodbye(const unsigned char *head, size_t head_len, ssize_t written) {
    if (written != (ssize_t)sizeof GOODBYE || head_len < sizeof GOODBYE || memcmp(head, GOODBYE, sizeof GOODBYE) != 0)
        return;
    const char *ms = getenv("PAUSE_AFTER_GOODBYE_MS");
    long n = ms ? atol(ms) : 500;
    if (n < 0)
        n = 0;
    struct timespec t = {n / 1000, (n % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}

ssize_t send(int fd, const void *buf, size_t len, int flags) {
    static ssize_t (*real)(int, const void *, size_t, int);
    if (!real)
        real = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
    ssize_t n = real(fd, buf, len, flags);
    pause_if_goodbye(buf, len, n);
    return n;
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
    static ssize_t (*real)(int, const struct msghdr *, int);
    if (!real)
        real = (ssize_t (*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
    ssize_t n = real(fd, msg, flags);
    /* Gather the message's first bytes across its pieces. */
    unsigned char head[sizeof GOODBYE];
    size_t got = 0;
    for (size_t i = 0; i < msg->msg_iovlen && got < sizeof head; i++) {
        size_t k = msg->msg_iov[i].iov_len < sizeof head - got ? msg->msg_iov[i].iov_len : sizeof head - got;
        memcpy(head + got, msg->msg_iov[i].iov_base, k);
        got += k;
    }
    pause_if_goodbye(head, got, n);
    return n;
}
