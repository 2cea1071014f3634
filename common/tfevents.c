/* tfevents.c - TensorBoard event files: TFRecord framing, hand-encoded
 * Event protocol buffers, and a writer whose thread does the disk I/O. */
#include "tfevents.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "crc32c.h"
#include "log.h"

/* ---------------------------------------------------------- the format */

uint32_t tfevents_masked_crc(const void *buf, size_t len)
{
    uint32_t c = crc32c(buf, len);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static void put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

size_t tfevents_frame(unsigned char *out, const void *data, size_t len)
{
    put_le(out, len, 8);
    put_le(out + 8, tfevents_masked_crc(out, 8), 4);
    memcpy(out + 12, data, len);
    put_le(out + 12 + len, tfevents_masked_crc(data, len), 4);
    return len + TFEVENTS_FRAME_BYTES;
}

/* Protocol buffer wire format: a key is (field << 3) | wire type; 0 varint,
 * 1 fixed 64-bit, 2 length-delimited, 5 fixed 32-bit. */
enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_I32 = 5 };

static size_t varint(unsigned char *p, uint64_t v)
{
    size_t n = 0;
    do {
        unsigned char b = v & 0x7f;
        v >>= 7;
        p[n++] = b | (v ? 0x80 : 0);
    } while (v);
    return n;
}

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >>= 7)
        n++;
    return n;
}

static size_t key(unsigned char *p, int field, int wt) { return varint(p, (uint64_t)(field << 3 | wt)); }

static size_t put_double(unsigned char *p, int field, double d)
{
    uint64_t bits;
    memcpy(&bits, &d, 8);
    size_t n = key(p, field, WT_I64);
    put_le(p + n, bits, 8);
    return n + 8;
}

/* Event's wall_time (1) and step (2). Room: 1 + 8 + 1 + 10. */
static size_t event_head(unsigned char *p, double wall_time, int64_t step)
{
    size_t n = put_double(p, 1, wall_time);
    n += key(p + n, 2, WT_VARINT);
    n += varint(p + n, (uint64_t)step); /* int64: a negative one takes 10 bytes */
    return n;
}

int tfevents_encode_scalar(unsigned char *out, size_t cap, double wall_time, int64_t step,
                           const char *tag, float value)
{
    size_t tl = tag ? strlen(tag) : 0;
    if (tl == 0 || tl > TFEVENTS_TAG_MAX)
        return -EINVAL;
    /* Value{tag = 1, simple_value = 2}; Summary{value = 1}; Event.summary = 5 */
    size_t vlen = 1 + varint_len(tl) + tl + 1 + 4;
    size_t slen = 1 + varint_len(vlen) + vlen;
    size_t need = 20 + 1 + varint_len(slen) + slen;
    if (cap < need)
        return -ENOSPC;
    size_t n = event_head(out, wall_time, step);
    n += key(out + n, 5, WT_LEN);
    n += varint(out + n, slen);
    n += key(out + n, 1, WT_LEN);
    n += varint(out + n, vlen);
    n += key(out + n, 1, WT_LEN);
    n += varint(out + n, tl);
    memcpy(out + n, tag, tl);
    n += tl;
    n += key(out + n, 2, WT_I32);
    uint32_t bits;
    memcpy(&bits, &value, 4);
    put_le(out + n, bits, 4);
    return (int)(n + 4);
}

int tfevents_encode_version(unsigned char *out, size_t cap, double wall_time)
{
    size_t vl = strlen(TFEVENTS_FILE_VERSION);
    if (cap < 9 + 2 + vl)
        return -ENOSPC;
    size_t n = put_double(out, 1, wall_time);
    n += key(out + n, 3, WT_LEN);
    n += varint(out + n, vl);
    memcpy(out + n, TFEVENTS_FILE_VERSION, vl);
    return (int)(n + vl);
}

/* ---------------------------------------------------------- the writer */

typedef struct buf {
    unsigned char *p;
    size_t len, cap;
    size_t records;
} buf;

struct tfevents {
    char who[64];
    char dir[4096];
    int flush_ms;
    tfevents_sample_fn sample;
    void *ctx;

    pthread_mutex_t mu; /* the queue, stop */
    pthread_cond_t cv;
    buf queue;
    int stop;
    int full_logged;
    uint64_t dropped;

    pthread_mutex_t io_mu; /* the file; taken before mu, so writes keep their order */
    buf spare;             /* what a flush writes, swapped with the queue */
    int fd;                /* open only during a flush (open_file), else -1 */
    off_t good;            /* bytes of whole records in the file */
    int failing;           /* the last write failed (logged once) */
    char path[4096 + 256 + 128]; /* dir, host name, the rest */
    pthread_t thread;
};

void tfevents_scalar(tfevents *w, const char *tag, int64_t step, double wall_time, double value)
{
    if (!w)
        return;
    unsigned char ev[TFEVENTS_TAG_MAX + 64];
    int n = tfevents_encode_scalar(ev, sizeof(ev), wall_time, step, tag, (float)value);
    if (n < 0)
        return;
    size_t need = (size_t)n + TFEVENTS_FRAME_BYTES;
    pthread_mutex_lock(&w->mu);
    buf *q = &w->queue;
    if (q->len + need > q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 4096;
        while (cap < q->len + need)
            cap *= 2;
        unsigned char *p = q->len + need <= TFEVENTS_QUEUE_MAX ? realloc(q->p, cap) : NULL;
        if (!p) {
            w->dropped++;
            if (!w->full_logged)
                log_error("%s: tensorboard events for '%s': %s: dropping records until the disk "
                          "catches up",
                          w->who, w->dir, q->len + need > TFEVENTS_QUEUE_MAX ? "queue full" : "out of memory");
            w->full_logged = 1;
            pthread_mutex_unlock(&w->mu);
            return;
        }
        q->p = p;
        q->cap = cap;
    }
    q->len += tfevents_frame(q->p + q->len, ev, (size_t)n);
    q->records++;
    pthread_mutex_unlock(&w->mu);
}

/* mkdir -p; 0 or -errno. */
static int make_dirs(const char *dir)
{
    char p[4096];
    snprintf(p, sizeof(p), "%s", dir);
    for (char *s = p + 1; *s; s++)
        if (*s == '/') {
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST)
                return -errno;
            *s = '/';
        }
    if (mkdir(p, 0755) != 0 && errno != EEXIST)
        return -errno;
    return 0;
}

static int write_all(int fd, const unsigned char *p, size_t n)
{
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -errno;
        if (k == 0)
            return -EIO;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static void io_failed(tfevents *w, const char *what, int rc)
{
    if (!w->failing)
        log_error("%s: tensorboard events: unable to %s '%s': %s (dropping events until a write "
                  "succeeds)",
                  w->who, what, w->path[0] ? w->path : w->dir, strerror(-rc));
    w->failing = 1;
}

/* Create the file and write its first record. Caller holds io_mu. */
static int create_file(tfevents *w)
{
    int rc = make_dirs(w->dir);
    if (rc < 0) {
        io_failed(w, "create the folder", rc);
        return rc;
    }
    char host[256] = "localhost";
    if (gethostname(host, sizeof(host) - 1) != 0 || !host[0])
        snprintf(host, sizeof(host), "localhost");
    host[sizeof(host) - 1] = '\0';
    for (char *s = host; *s; s++)
        if (*s == '/')
            *s = '_';
    long secs = (long)time(NULL);
    for (int k = 0; k < 100; k++) {
        if (k == 0)
            snprintf(w->path, sizeof(w->path), "%s/events.out.tfevents.%ld.%s.%ld", w->dir, secs,
                     host, (long)getpid());
        else
            snprintf(w->path, sizeof(w->path), "%s/events.out.tfevents.%ld.%s.%ld.%d", w->dir, secs,
                     host, (long)getpid(), k);
        w->fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
        if (w->fd >= 0 || errno != EEXIST)
            break;
    }
    if (w->fd < 0) {
        rc = -errno;
        io_failed(w, "create", rc);
        w->path[0] = '\0';
        return rc;
    }
    unsigned char ev[64], rec[64 + TFEVENTS_FRAME_BYTES];
    int n = tfevents_encode_version(ev, sizeof(ev), clk_unix_secs());
    size_t len = tfevents_frame(rec, ev, (size_t)n);
    if ((rc = write_all(w->fd, rec, len)) < 0) {
        io_failed(w, "write", rc);
        close(w->fd);
        w->fd = -1;
        unlink(w->path);
        w->path[0] = '\0';
        return rc;
    }
    w->good = (off_t)len;
    return 0;
}

/* Open the file for a flush (creating it the first time, or again when it
 * was removed). Caller holds io_mu. The file is open only while a flush
 * writes, so between flushes no descriptor holds the folder's filesystem
 * busy: it can be remounted read-only or unmounted, as with checkpoints. */
static int open_file(tfevents *w)
{
    if (w->path[0]) {
        w->fd = open(w->path, O_WRONLY | O_APPEND | O_CLOEXEC);
        if (w->fd >= 0)
            return 0;
        if (errno != ENOENT) {
            int rc = -errno;
            io_failed(w, "open", rc);
            return rc;
        }
        w->path[0] = '\0'; /* removed under us: start a new file */
    }
    return create_file(w);
}

int tfevents_flush(tfevents *w)
{
    if (!w)
        return 0;
    pthread_mutex_lock(&w->io_mu);
    pthread_mutex_lock(&w->mu);
    buf b = w->queue;
    w->queue = w->spare;
    w->queue.len = w->queue.records = 0;
    w->spare = b;
    pthread_mutex_unlock(&w->mu);
    int rc = 0;
    if (b.len) {
        rc = open_file(w);
        if (rc == 0 && (rc = write_all(w->fd, b.p, b.len)) < 0) {
            io_failed(w, "write", rc);
            /* cut off a partly written record: the file stays readable */
            if (ftruncate(w->fd, w->good) != 0) {
                /* the reader stops at the torn record; the next write may succeed */
            }
        } else if (rc == 0) {
            w->good += (off_t)b.len;
            if (w->failing)
                log_info("%s: tensorboard events: writing '%s' again", w->who, w->path);
            w->failing = 0;
        }
        if (w->fd >= 0) {
            if (close(w->fd) != 0 && rc == 0) {
                rc = -errno;
                io_failed(w, "close", rc);
            }
            w->fd = -1;
        }
        if (rc < 0) {
            pthread_mutex_lock(&w->mu);
            w->dropped += b.records;
            pthread_mutex_unlock(&w->mu);
        }
    }
    w->spare.len = w->spare.records = 0;
    pthread_mutex_unlock(&w->io_mu);
    return rc;
}

static void *flush_main(void *arg)
{
    tfevents *w = arg;
    for (;;) {
        struct timespec at = clk_mono_after_ms(w->flush_ms);
        pthread_mutex_lock(&w->mu);
        while (!w->stop && pthread_cond_timedwait(&w->cv, &w->mu, &at) != ETIMEDOUT) {
        }
        int stop = w->stop;
        pthread_mutex_unlock(&w->mu);
        if (w->sample)
            w->sample(w->ctx, w);
        tfevents_flush(w);
        if (stop)
            break;
    }
    return NULL;
}

int tfevents_open(tfevents **out, const char *who, const char *dir, int flush_ms,
                  tfevents_sample_fn sample, void *ctx)
{
    *out = NULL;
    tfevents *w = calloc(1, sizeof(*w));
    if (!w)
        return -ENOMEM;
    snprintf(w->who, sizeof(w->who), "%s", who);
    snprintf(w->dir, sizeof(w->dir), "%s", dir);
    w->flush_ms = flush_ms < 10 ? 10 : flush_ms;
    w->sample = sample;
    w->ctx = ctx;
    w->fd = -1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_mutex_init(&w->io_mu, NULL);
    clk_mono_cond_init(&w->cv);
    if (pthread_create(&w->thread, NULL, flush_main, w) != 0) {
        pthread_mutex_destroy(&w->mu);
        pthread_mutex_destroy(&w->io_mu);
        pthread_cond_destroy(&w->cv);
        free(w);
        return -EAGAIN;
    }
    *out = w;
    return 0;
}

void tfevents_close(tfevents *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL); /* its last round samples and flushes */
    free(w->queue.p);
    free(w->spare.p);
    pthread_mutex_destroy(&w->mu);
    pthread_mutex_destroy(&w->io_mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

void tfevents_path(tfevents *w, char *out, size_t cap)
{
    pthread_mutex_lock(&w->io_mu);
    snprintf(out, cap, "%s", w->path);
    pthread_mutex_unlock(&w->io_mu);
}

uint64_t tfevents_dropped(tfevents *w)
{
    pthread_mutex_lock(&w->mu);
    uint64_t d = w->dropped;
    pthread_mutex_unlock(&w->mu);
    return d;
}
