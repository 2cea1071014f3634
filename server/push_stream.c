/* push_stream.c - POST /v1/grads applied as its body arrives (push_stream.h). */
#include "push_stream.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire_dtype.h"

/* A header longer than this is read whole with its body (as before). */
#define STREAM_HEADER_MAX ((uint64_t)1 << 20)
/* Elements decoded and applied at a time (a cache-sized piece). */
#define PIECE 2048
/* The first buffer for the prefix and header, and how it grows when the
 * body is read whole (http_server.c's rule: 8x what came, all of it once
 * 512 KiB and 1/128 of it came). */
#define FIRST_BYTES ((uint64_t)64 << 10)
#define WHOLE_AT ((uint64_t)512 << 10)
#define AHEAD 128

enum { PS_HEAD, PS_STREAM, PS_WHOLE };

struct push_stream {
    request *r;
    server *srv;
    uint64_t expect, got; /* Content-Length, bytes so far */
    int mode;
    int oom;              /* a buffer could not grow: 503 after the body */
    blob *buf;            /* PS_HEAD, PS_WHOLE: the bytes so far */
    uint64_t hl;          /* the header's length, once the prefix came (0 before) */
    st_file f;
    int have_f;
    grads_head head;
    float inv_scale;      /* 1 / the loss scale (BF16, F16) */
    store_stream *ss;
    int *order;           /* f's tensors by offset */
    int ti;               /* the tensor (in order) the next byte belongs to */
    uint64_t dpos;        /* the data-section offset of the next byte */
    unsigned char carry[4]; /* an element split between two pieces */
    int ncarry;
    int bad_k;            /* the first tensor (header order) with a NaN or Inf; -1 none */
    int64_t bad_at;
    int bad_nan;
};

static void sink(void *cls, const unsigned char *p, size_t n);

push_stream *push_stream_start(request *r)
{
    push_stream *ps = calloc(1, sizeof(*ps));
    if (!ps)
        return NULL;
    ps->r = r;
    ps->srv = req_srv(r);
    ps->expect = r->expect_len;
    ps->bad_k = -1;
    ps->inv_scale = 1;
    uint64_t first = ps->expect < FIRST_BYTES ? ps->expect : FIRST_BYTES;
    if (!(ps->buf = blob_new(ps->srv->pool, (size_t)first))) {
        free(ps);
        return NULL;
    }
    ps->buf->len = 0;
    http_body_sink(r, sink, ps);
    return ps;
}

/* Append to buf, growing it as http_server.c grows a body. */
static void buf_append(push_stream *ps, const unsigned char *p, size_t n)
{
    if (ps->oom || n == 0)
        return;
    blob *b = ps->buf;
    uint64_t need = (uint64_t)b->len + n; /* <= expect: the layer checks the length */
    if (need > b->cap) {
        uint64_t want = need * 8;
        if (want > ps->expect || (need >= WHOLE_AT && need * AHEAD >= ps->expect))
            want = ps->expect;
        if (want < need)
            want = need;
        size_t used = b->len;
        blob *g = blob_grow(b, (size_t)want);
        if (!g) {
            ps->oom = 1;
            return;
        }
        g->len = used;
        ps->buf = b = g;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

/* The header is in: stream the push when the route's checks pass and the
 * store takes it, else read it whole. */
static void begin(push_stream *ps)
{
    char err[256];
    int status;
    ps->mode = PS_WHOLE;
    if (st_parse_header(ps->buf->data + 8, ps->hl, ps->expect - 8 - ps->hl, &ps->f, err, sizeof(err)) != 0)
        return; /* (st_parse_header freed what it took) */
    ps->have_f = 1;
    if (grads_check_head(ps->r, &ps->f, &ps->head, &status, err, sizeof(err)) != 0)
        return;
    for (int k = 0; k < ps->f.n_tensors; k++)
        if (wire_dtype_of_st(ps->f.tensors[k].dtype) < 0)
            return; /* a sparse gradient's ids */
    ps->inv_scale = (float)(1.0 / ps->head.loss_scale);
    if (!(ps->order = malloc(sizeof(int) * (size_t)(ps->f.n_tensors ? ps->f.n_tensors : 1))))
        return;
    for (int k = 0; k < ps->f.n_tensors; k++)
        ps->order[k] = k;
    for (int i = 1; i < ps->f.n_tensors; i++) /* by offset (few tensors) */
        for (int j = i; j > 0 && ps->f.tensors[ps->order[j]].begin < ps->f.tensors[ps->order[j - 1]].begin; j--) {
            int t = ps->order[j];
            ps->order[j] = ps->order[j - 1];
            ps->order[j - 1] = t;
        }
    if (store_stream_begin(&ps->srv->store, &ps->f, &ps->head.meta, &ps->ss) != STORE_OK)
        return;
    ps->mode = PS_STREAM;
    blob_unref(ps->buf); /* the header's bytes: parsed */
    ps->buf = NULL;
}

/* cnt whole elements of tensor k from src (any alignment), the first at
 * element e0: widened, checked, applied. */
static void elements(push_stream *ps, int k, const unsigned char *src, size_t cnt, size_t e0)
{
    int d = wire_dtype_of_st(ps->f.tensors[k].dtype);
    size_t es = wire_dtype_size((wire_dtype)d);
    float g[PIECE];
    uint16_t h[PIECE];
    for (size_t at = 0; at < cnt;) {
        size_t m = cnt - at < PIECE ? cnt - at : PIECE;
        int64_t bad;
        if (d == WIRE_F32 && ps->bad_k < 0) { /* checked and applied in one pass, from the piece itself */
            bad = store_stream_apply_bytes(ps->ss, k, e0 + at, src + at * es, m);
            if (bad >= 0)
                memcpy(&g[bad], src + (at + (size_t)bad) * es, 4);
        } else if (d == WIRE_F32) { /* refused already: only checked, for the first bad tensor */
            memcpy(g, src + at * es, m * 4);
            bad = tensor_find_nonfinite(g, m);
        } else {
            memcpy(h, src + at * es, m * 2);
            bad = wire_decode((wire_dtype)d, h, m, ps->inv_scale, g);
        }
        if (bad >= 0 && (ps->bad_k < 0 || k < ps->bad_k)) { /* the first of its tensor: its elements come in order */
            ps->bad_k = k;
            ps->bad_at = (int64_t)(e0 + at) + bad;
            ps->bad_nan = isnan(g[bad]);
        }
        if (ps->bad_k < 0 && d != WIRE_F32)
            store_stream_apply(ps->ss, k, e0 + at, g, m);
        at += m;
    }
}

/* n bytes of the data section, at ps->dpos. */
static void stream_bytes(push_stream *ps, const unsigned char *p, size_t n)
{
    const st_file *f = &ps->f;
    while (n > 0) {
        while (ps->ti < f->n_tensors && f->tensors[ps->order[ps->ti]].end <= ps->dpos)
            ps->ti++; /* done, or empty */
        if (ps->ti == f->n_tensors)
            return; /* (the tensors tile the data section: nothing is left) */
        int k = ps->order[ps->ti];
        const st_tensor *t = &f->tensors[k];
        size_t es = wire_dtype_size((wire_dtype)wire_dtype_of_st(t->dtype));
        uint64_t left = t->end - ps->dpos;
        size_t avail = n < left ? n : (size_t)left;
        if (ps->ncarry) { /* complete the element split before */
            size_t c = es - (size_t)ps->ncarry < avail ? es - (size_t)ps->ncarry : avail;
            memcpy(ps->carry + ps->ncarry, p, c);
            ps->ncarry += (int)c;
            p += c;
            n -= c;
            ps->dpos += c;
            if ((size_t)ps->ncarry == es) {
                elements(ps, k, ps->carry, 1, (size_t)((ps->dpos - es - t->begin) / es));
                ps->ncarry = 0;
            }
            continue;
        }
        size_t whole = avail / es;
        if (whole) {
            elements(ps, k, p, whole, (size_t)((ps->dpos - t->begin) / es));
            p += whole * es;
            n -= whole * es;
            ps->dpos += whole * es;
            avail -= whole * es;
        }
        if (avail) { /* part of an element: the rest comes in the next piece */
            memcpy(ps->carry, p, avail);
            ps->ncarry = (int)avail;
            p += avail;
            n -= avail;
            ps->dpos += avail;
        }
    }
}

/* The body sink (http_body_sink): every piece of the body as it came. */
static void sink(void *cls, const unsigned char *p, size_t n)
{
    push_stream *ps = cls;
    while (n > 0) {
        if (ps->mode == PS_STREAM) {
            stream_bytes(ps, p, n);
            ps->got += n;
            return;
        }
        if (ps->mode == PS_WHOLE) {
            buf_append(ps, p, n);
            ps->got += n;
            return;
        }
        /* PS_HEAD: the prefix, then the header */
        uint64_t want = ps->got < 8 ? 8 : 8 + ps->hl;
        size_t c = want - ps->got < n ? (size_t)(want - ps->got) : n;
        buf_append(ps, p, c);
        ps->got += c;
        p += c;
        n -= c;
        if (ps->oom) {
            ps->mode = PS_WHOLE;
        } else if (ps->got == 8) {
            char err[200];
            if (st_read_prefix(ps->buf->data, ps->expect, &ps->hl, err, sizeof(err)) != 0 ||
                ps->hl > STREAM_HEADER_MAX)
                ps->mode = PS_WHOLE; /* refused (or applied) after the body, as before */
        } else if (ps->got == 8 + ps->hl) {
            begin(ps);
        }
    }
}

blob *push_stream_body(push_stream *ps, int *oom)
{
    *oom = ps->oom;
    if (ps->mode == PS_STREAM || ps->oom)
        return NULL;
    return ps->buf;
}

int push_stream_commit(push_stream *ps, const grads_head **head, int64_t *gstep, int *outcome, char *err,
                       size_t errlen)
{
    *head = &ps->head;
    store *st = &ps->srv->store;
    int rc;
    if (ps->bad_k >= 0) { /* refused: nothing changed */
        const st_tensor *t = &ps->f.tensors[ps->bad_k];
        snprintf(err, errlen, "gradient '%s' has %s at element %lld%s", t->name, ps->bad_nan ? "NaN" : "Inf",
                 (long long)ps->bad_at, wire_dtype_of_st(t->dtype) == WIRE_F32 ? "" : " (as float32)");
        rc = STORE_EINVAL;
    } else {
        rc = store_stream_commit(st, ps->ss, &ps->head.meta, gstep, outcome, err, errlen);
    }
    store_stream_end(st, ps->ss);
    ps->ss = NULL;
    return rc;
}

void push_stream_free(push_stream *ps)
{
    if (!ps)
        return;
    store_stream_end(&ps->srv->store, ps->ss);
    blob_unref(ps->buf);
    if (ps->have_f)
        st_file_free(&ps->f);
    free(ps->order);
    free(ps);
}
