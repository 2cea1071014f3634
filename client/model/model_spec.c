/* model_spec.c - --model=SPEC into a model_layout: the grammar of model.h
 * (mlp:H,..., cnn, a layer list), TensorFlow's padding rule, the layers with
 * their per-example shapes, the tensors with their names and offsets, and the
 * canonical spec. A bad spec is one line naming the bad part. */
#include "errmsg.h"
#include "model/model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CNN_SPEC "conv:5x5x32,pool:2,conv:5x5x64,pool:2,dense:1024,dropout:0.4,dense:10"

typedef enum item_kind { ITEM_CONV, ITEM_POOL, ITEM_DENSE, ITEM_DROPOUT } item_kind;

typedef struct item {
    item_kind kind;
    int kh, kw, c; /* conv: kernel and output channels; pool: kh = kw = K */
    int stride;
    int same;
    int units;     /* dense */
    float rate;    /* dropout */
} item;

int model_tf_padding(int in, int k, int s, int same, int *out, int *pad_before, int *pad_after)
{
    if (in < 1 || k < 1 || s < 1)
        return -1;
    int o, total;
    if (same) {
        o = (in + s - 1) / s;
        long t = (long)(o - 1) * s + k - in;
        total = t > 0 ? (int)t : 0;
    } else {
        if (k > in)
            return -1;
        o = (in - k + 1 + s - 1) / s;
        total = 0;
    }
    if (out)
        *out = o;
    if (pad_before)
        *pad_before = total / 2;
    if (pad_after)
        *pad_after = total - total / 2;
    return 0;
}

int model_shape_format(model_shape s, char *buf, size_t buflen)
{
    return snprintf(buf, buflen, "%d,%d,%d", s.h, s.w, s.c);
}

/* A decimal integer 1..MODEL_MAX_DIM at *p (digits only), advancing *p. */
static int parse_dim(const char **p, int *v)
{
    const char *s = *p;
    long x = 0;
    int n = 0;
    while (*s >= '0' && *s <= '9') {
        x = x * 10 + (*s - '0');
        if (x > MODEL_MAX_DIM)
            return -1;
        s++;
        n++;
    }
    if (n == 0 || x < 1)
        return -1;
    *v = (int)x;
    *p = s;
    return 0;
}

int model_shape_parse(const char *s, model_shape *out)
{
    int d[3];
    const char *p = s;
    for (int i = 0; i < 3; i++) {
        if (!p || parse_dim(&p, &d[i]) != 0)
            return -1;
        if (i < 2 && *p++ != ',')
            return -1;
    }
    if (*p)
        return -1;
    out->h = d[0];
    out->w = d[1];
    out->c = d[2];
    return 0;
}

/* [/S][:same|:valid] at *p; the rest of the item must be empty. */
static int parse_stride_padding(const char *p, int *stride, int *same)
{
    if (*p == '/') {
        p++;
        if (parse_dim(&p, stride) != 0)
            return -1;
    }
    if (*p == ':') {
        p++;
        if (strcmp(p, "same") == 0)
            *same = 1;
        else if (strcmp(p, "valid") == 0)
            *same = 0;
        else
            return -1;
        return 0;
    }
    return *p ? -1 : 0;
}

#define WANT_AN_ITEM "want conv:KHxKWxC, pool:K, dense:N or dropout:R"

/* One list item (NUL-terminated text) into it; the message says what it wants. */
static int parse_item(const char *s, item *it, const char **want)
{
    memset(it, 0, sizeof(*it));
    const char *p;
    if (strncmp(s, "conv:", 5) == 0) {
        *want = "want conv:KHxKWxC[/S][:same|:valid] with sizes 1..1048576";
        p = s + 5;
        it->kind = ITEM_CONV;
        it->stride = 1;
        it->same = 1;
        if (parse_dim(&p, &it->kh) != 0 || *p++ != 'x' || parse_dim(&p, &it->kw) != 0 ||
            *p++ != 'x' || parse_dim(&p, &it->c) != 0)
            return -1;
        return parse_stride_padding(p, &it->stride, &it->same);
    }
    if (strncmp(s, "pool:", 5) == 0) {
        *want = "want pool:K[/S][:same|:valid] with sizes 1..1048576";
        p = s + 5;
        it->kind = ITEM_POOL;
        it->same = 1;
        if (parse_dim(&p, &it->kh) != 0)
            return -1;
        it->kw = it->kh;
        it->stride = it->kh;
        return parse_stride_padding(p, &it->stride, &it->same);
    }
    if (strncmp(s, "dense:", 6) == 0) {
        *want = "want dense:N with N in 1..1048576";
        p = s + 6;
        it->kind = ITEM_DENSE;
        if (parse_dim(&p, &it->units) != 0 || *p)
            return -1;
        return 0;
    }
    if (strncmp(s, "dropout:", 8) == 0) {
        *want = "want dropout:R with a drop rate 0 <= R < 1";
        p = s + 8;
        it->kind = ITEM_DROPOUT;
        if (!((*p >= '0' && *p <= '9') || *p == '.'))
            return -1;
        char *end;
        errno = 0;
        double r = strtod(p, &end);
        if (end == p || *end || errno || !(r >= 0.0 && r < 1.0) || !((float)r < 1.0f))
            return -1;
        it->rate = (float)r;
        return 0;
    }
    *want = WANT_AN_ITEM;
    return -1;
}

/* The shortest %g text that reads back as the same float. */
static void format_rate(float r, char *buf, size_t len)
{
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, len, "%.*g", prec, (double)r);
        if (strtof(buf, NULL) == r)
            return;
    }
}

/* a * b within limit (both >= 0), else -1. */
static int mul_within(size_t a, size_t b, size_t limit, size_t *out)
{
    if (a != 0 && b > limit / a)
        return -1;
    *out = a * b;
    return 0;
}

typedef struct builder {
    model_layout *ly;
    size_t off;
    char *err;
    size_t errlen;
    const char *spec;
} builder;

static model_layer *add_layer(builder *b, layer_kind kind, model_shape in, model_shape out)
{
    model_layout *ly = b->ly;
    if (ly->n_layers == MODEL_MAX_LAYERS) {
        errmsg(b->err, b->errlen, "model \"%s\": more than %d layers", b->spec, MODEL_MAX_LAYERS);
        return NULL;
    }
    size_t n_in = 0, n_out = 0;
    if (mul_within((size_t)in.h * (size_t)in.w, (size_t)in.c, MODEL_MAX_ACT, &n_in) != 0 ||
        mul_within((size_t)out.h * (size_t)out.w, (size_t)out.c, MODEL_MAX_ACT, &n_out) != 0) {
        errmsg(b->err, b->errlen, "model \"%s\": layer %d's activation has more than %zu floats",
               b->spec, ly->n_layers, MODEL_MAX_ACT);
        return NULL;
    }
    model_layer *l = &ly->layers[ly->n_layers++];
    memset(l, 0, sizeof(*l));
    l->kind = kind;
    l->in = in;
    l->out = out;
    l->in_numel = n_in;
    l->out_numel = n_out;
    l->w = l->b = -1;
    l->stride = 1;
    if (n_in > ly->max_act)
        ly->max_act = n_in;
    if (n_out > ly->max_act)
        ly->max_act = n_out;
    return l;
}

static int add_tensor(builder *b, int layer, const char *name, int ndim, const int *dims, int fan_in)
{
    model_layout *ly = b->ly;
    if (ly->n_tensors == MODEL_MAX_TENSORS)
        return errmsg(b->err, b->errlen, "model \"%s\": more than %d tensors", b->spec,
                      MODEL_MAX_TENSORS);
    model_tensor *t = &ly->tensors[ly->n_tensors];
    memset(t, 0, sizeof(*t));
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->shape.ndim = ndim;
    size_t n = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape.dims[i] = dims[i];
        if (mul_within(n, (size_t)dims[i], MODEL_MAX_PARAMS, &n) != 0)
            n = MODEL_MAX_PARAMS + 1;
    }
    if (n > MODEL_MAX_PARAMS || b->off + n > MODEL_MAX_PARAMS)
        return errmsg(b->err, b->errlen, "model \"%s\": %s takes it past %zu parameters", b->spec,
                      name, MODEL_MAX_PARAMS);
    t->numel = n;
    t->offset = b->off;
    t->layer = layer;
    t->fan_in = fan_in;
    b->off += n;
    return ly->n_tensors++;
}

static int add_relu(builder *b, model_shape s)
{
    return add_layer(b, LAYER_RELU, s, s) ? 0 : -1;
}

/* A dense layer (after a flatten if its input is not flat) named stem_w, stem_b. */
static int add_dense(builder *b, model_shape *cur, int units, const char *stem)
{
    if (cur->h != 1 || cur->w != 1) {
        model_shape flat = {1, 1, 0};
        size_t n = (size_t)cur->h * (size_t)cur->w * (size_t)cur->c;
        if (n > MODEL_MAX_ACT)
            return errmsg(b->err, b->errlen, "model \"%s\": activation too large", b->spec);
        flat.c = (int)n;
        if (!add_layer(b, LAYER_FLATTEN, *cur, flat))
            return -1;
        *cur = flat;
    }
    model_shape out = {1, 1, units};
    int li = b->ly->n_layers;
    model_layer *l = add_layer(b, LAYER_DENSE, *cur, out);
    if (!l)
        return -1;
    char wn[MODEL_NAME_MAX], bn[MODEL_NAME_MAX];
    snprintf(wn, sizeof(wn), "%s_w", stem);
    snprintf(bn, sizeof(bn), "%s_b", stem);
    int wd[2] = {cur->c, units}, bd[1] = {units};
    int w = add_tensor(b, li, wn, 2, wd, cur->c);
    if (w < 0)
        return -1;
    int bi = add_tensor(b, li, bn, 1, bd, 0);
    if (bi < 0)
        return -1;
    b->ly->layers[li].w = w;
    b->ly->layers[li].b = bi;
    *cur = out;
    return 0;
}

static int build_mlp(builder *b, const char *list)
{
    model_layout *ly = b->ly;
    int hidden[MODEL_MAX_ITEMS], n = 0;
    const char *p = list;
    while (*p) {
        if (n == MODEL_MAX_ITEMS - 1)
            return errmsg(b->err, b->errlen, "model \"%s\": more than %d hidden layers", b->spec,
                          MODEL_MAX_ITEMS - 1);
        const char *start = p;
        if (parse_dim(&p, &hidden[n]) != 0 || (*p && *p != ',')) {
            const char *e = strchr(start, ',');
            int len = e ? (int)(e - start) : (int)strlen(start);
            return errmsg(b->err, b->errlen,
                          "model \"%s\": hidden layer \"%.*s\": want unit counts 1..%d like mlp:100 or mlp:256,128",
                          b->spec, len, start, MODEL_MAX_DIM);
        }
        n++;
        if (*p == ',') {
            p++;
            if (!*p)
                return errmsg(b->err, b->errlen, "model \"%s\": trailing comma", b->spec);
        }
    }
    model_shape cur = ly->input;
    for (int i = 0; i <= n; i++) {
        char stem[MODEL_NAME_MAX];
        if (i == n)
            snprintf(stem, sizeof(stem), "sm");
        else if (n == 1)
            snprintf(stem, sizeof(stem), "hid");
        else
            snprintf(stem, sizeof(stem), "hid%d", i);
        if (add_dense(b, &cur, i == n ? ly->n_classes : hidden[i], stem) != 0)
            return -1;
        if (i < n && add_relu(b, cur) != 0)
            return -1;
    }
    /* canonical: "mlp:" and the counts as plain decimals */
    size_t len = (size_t)snprintf(ly->spec, sizeof(ly->spec), "mlp:");
    for (int i = 0; i < n && len < sizeof(ly->spec); i++)
        len += (size_t)snprintf(ly->spec + len, sizeof(ly->spec) - len, "%s%d", i ? "," : "",
                                hidden[i]);
    return 0;
}

static int build_list(builder *b, const char *list)
{
    model_layout *ly = b->ly;
    item items[MODEL_MAX_ITEMS];
    const char *texts[MODEL_MAX_ITEMS];
    char buf[MODEL_SPEC_MAX];
    snprintf(buf, sizeof(buf), "%s", list);
    int n = 0;
    char *save = NULL;
    if (!buf[0] || buf[strlen(buf) - 1] == ',' || buf[0] == ',' || strstr(buf, ",,"))
        return errmsg(b->err, b->errlen, "model \"%s\": an empty item (want items separated by single commas)",
                      b->spec);
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (n == MODEL_MAX_ITEMS)
            return errmsg(b->err, b->errlen, "model \"%s\": more than %d items", b->spec,
                          MODEL_MAX_ITEMS);
        const char *want = "";
        if (parse_item(tok, &items[n], &want) != 0) {
            if (n == 0 && strcmp(want, WANT_AN_ITEM) == 0) /* not a spec at all: its forms */
                return errmsg(b->err, b->errlen,
                              "model \"%s\": item 1 \"%s\" is not a model: want mlp:H1,H2,... (e.g. mlp:100; "
                              "mlp: alone is softmax regression), cnn, or a layer list of conv:KHxKWxC[/S][:same|:valid], "
                              "pool:K[/S][:same|:valid], dense:N and dropout:R ending in dense:%d "
                              "(e.g. conv:5x5x32,pool:2,dense:128,dense:%d)",
                              b->spec, tok, b->ly->n_classes, b->ly->n_classes);
            return errmsg(b->err, b->errlen, "model \"%s\": item %d \"%s\": %s", b->spec, n + 1, tok,
                          want);
        }
        texts[n++] = tok;
    }
    const item *last = &items[n - 1];
    if (last->kind != ITEM_DENSE)
        return errmsg(b->err, b->errlen,
                      "model \"%s\": the last item \"%s\" must be dense:%d (the logits)", b->spec,
                      texts[n - 1], ly->n_classes);
    if (last->units != ly->n_classes)
        return errmsg(b->err, b->errlen,
                      "model \"%s\": the last item \"%s\" gives the logits: want dense:%d (the classes)",
                      b->spec, texts[n - 1], ly->n_classes);

    model_shape cur = ly->input;
    int n_conv = 0, n_fc = 0, flat = 0;
    size_t len = 0;
    ly->spec[0] = '\0';
    for (int i = 0; i < n; i++) {
        const item *it = &items[i];
        char canon[96];
        if (it->kind == ITEM_CONV || it->kind == ITEM_POOL) {
            if (flat)
                return errmsg(b->err, b->errlen, "model \"%s\": item %d \"%s\" follows a dense layer (conv and pool come before the dense layers)",
                              b->spec, i + 1, texts[i]);
            int oh, ow, pt, pb, pl, pr;
            if (model_tf_padding(cur.h, it->kh, it->stride, it->same, &oh, &pt, &pb) != 0 ||
                model_tf_padding(cur.w, it->kw, it->stride, it->same, &ow, &pl, &pr) != 0)
                return errmsg(b->err, b->errlen,
                              "model \"%s\": item %d \"%s\": a %dx%d window is larger than its %dx%d input under valid padding",
                              b->spec, i + 1, texts[i], it->kh, it->kw, cur.h, cur.w);
            model_shape out = {oh, ow, it->kind == ITEM_CONV ? it->c : cur.c};
            int li = ly->n_layers;
            model_layer *l = add_layer(b, it->kind == ITEM_CONV ? LAYER_CONV2D : LAYER_MAXPOOL, cur, out);
            if (!l)
                return -1;
            l->kh = it->kh;
            l->kw = it->kw;
            l->stride = it->stride;
            l->same = it->same;
            l->pad_top = pt;
            l->pad_bottom = pb;
            l->pad_left = pl;
            l->pad_right = pr;
            if (it->kind == ITEM_CONV) {
                char wn[MODEL_NAME_MAX], bn[MODEL_NAME_MAX];
                snprintf(wn, sizeof(wn), "conv%d_w", n_conv);
                snprintf(bn, sizeof(bn), "conv%d_b", n_conv);
                n_conv++;
                size_t fan = (size_t)it->kh * (size_t)it->kw * (size_t)cur.c;
                if (fan > (size_t)1 << 30)
                    return errmsg(b->err, b->errlen, "model \"%s\": item %d \"%s\": fan-in too large",
                                  b->spec, i + 1, texts[i]);
                int wd[4] = {it->kh, it->kw, cur.c, it->c}, bd[1] = {it->c};
                int w = add_tensor(b, li, wn, 4, wd, (int)fan);
                if (w < 0)
                    return -1;
                int bi = add_tensor(b, li, bn, 1, bd, 0);
                if (bi < 0)
                    return -1;
                ly->layers[li].w = w;
                ly->layers[li].b = bi;
                if (add_relu(b, out) != 0)
                    return -1;
                snprintf(canon, sizeof(canon), "conv:%dx%dx%d/%d:%s", it->kh, it->kw, it->c,
                         it->stride, it->same ? "same" : "valid");
            } else {
                snprintf(canon, sizeof(canon), "pool:%d/%d:%s", it->kh, it->stride,
                         it->same ? "same" : "valid");
            }
            cur = out;
        } else if (it->kind == ITEM_DENSE) {
            char stem[MODEL_NAME_MAX];
            if (i == n - 1)
                snprintf(stem, sizeof(stem), "sm");
            else
                snprintf(stem, sizeof(stem), "fc%d", n_fc++);
            if (add_dense(b, &cur, it->units, stem) != 0)
                return -1;
            if (i < n - 1 && add_relu(b, cur) != 0)
                return -1;
            flat = 1;
            snprintf(canon, sizeof(canon), "dense:%d", it->units);
        } else {
            model_layer *l = add_layer(b, LAYER_DROPOUT, cur, cur);
            if (!l)
                return -1;
            l->rate = it->rate;
            l->scale = 1.0f / (1.0f - it->rate);
            l->dropout_index = ly->n_dropout++;
            char r[32];
            format_rate(it->rate, r, sizeof(r));
            snprintf(canon, sizeof(canon), "dropout:%s", r);
        }
        int w = snprintf(ly->spec + len, sizeof(ly->spec) - len, "%s%s", i ? "," : "", canon);
        if (w < 0 || (size_t)w >= sizeof(ly->spec) - len)
            return errmsg(b->err, b->errlen, "model \"%s\": the canonical spec is longer than %d bytes",
                          b->spec, MODEL_SPEC_MAX - 1);
        len += (size_t)w;
    }
    return 0;
}

int model_layout_init(model_layout *layout, const char *spec, model_shape input, int n_classes,
                      char *err, size_t errlen)
{
    memset(layout, 0, sizeof(*layout));
    if (!spec)
        return errmsg(err, errlen, "model: no spec");
    size_t spec_len = strlen(spec);
    if (spec_len >= MODEL_SPEC_MAX)
        return errmsg(err, errlen, "model \"%.40s...\": %zu bytes: a spec has at most %d bytes", spec,
                      spec_len, MODEL_SPEC_MAX - 1);
    for (const char *p = spec; *p; p++)
        if (*p <= ' ' || *p > '~')
            return errmsg(err, errlen, "model \"%s\": a space or control character at byte %d",
                          spec, (int)(p - spec));
    if (input.h < 1 || input.w < 1 || input.c < 1 || input.h > MODEL_MAX_DIM ||
        input.w > MODEL_MAX_DIM || input.c > MODEL_MAX_DIM ||
        (size_t)input.h * (size_t)input.w * (size_t)input.c > MODEL_MAX_ACT)
        return errmsg(err, errlen, "model: input shape %d,%d,%d out of range", input.h, input.w,
                      input.c);
    if (n_classes < 2 || n_classes > MODEL_MAX_DIM)
        return errmsg(err, errlen, "model: %d classes (2..%d allowed)", n_classes, MODEL_MAX_DIM);
    layout->input = input;
    layout->n_classes = n_classes;
    layout->n_in = (size_t)input.h * (size_t)input.w * (size_t)input.c;
    layout->max_act = layout->n_in;
    builder b = {layout, 0, err, errlen, spec};
    int rc;
    if (strncmp(spec, "mlp:", 4) == 0)
        rc = build_mlp(&b, spec + 4);
    else if (strcmp(spec, "cnn") == 0)
        rc = build_list(&b, CNN_SPEC);
    else if (!spec[0])
        rc = errmsg(err, errlen, "model: an empty spec (want mlp:H,..., cnn or a layer list)");
    else
        rc = build_list(&b, spec);
    if (rc != 0) {
        char keep[1024];
        snprintf(keep, sizeof(keep), "%s", err && errlen ? err : "");
        memset(layout, 0, sizeof(*layout));
        if (err && errlen)
            snprintf(err, errlen, "%s", keep);
        return -1;
    }
    layout->n_params = b.off;
    return 0;
}
