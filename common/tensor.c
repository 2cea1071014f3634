/* tensor.c - names, shapes and finite checks for float32 tensors. */
#include "tensor.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int name_char_ok(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '.' || c == '/' || c == '-';
}

int tensor_name_check(const char *name, char *err, size_t errlen)
{
    size_t n = name ? strlen(name) : 0;
    if (n == 0 || n > TENSOR_NAME_MAX) {
        snprintf(err, errlen, "name must be 1 to %d characters", TENSOR_NAME_MAX);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        if (!name_char_ok(name[i])) {
            snprintf(err, errlen, "name '%.*s' has a character outside [A-Za-z0-9_./-]",
                     (int)(n > 64 ? 64 : n), name);
            return -1;
        }
    }
    if (strstr(name, "..")) {
        snprintf(err, errlen, "name '%s' contains '..'", name);
        return -1;
    }
    if (name[0] == '/' || name[n - 1] == '/' || strstr(name, "//")) {
        snprintf(err, errlen, "name '%s' has an empty path segment", name);
        return -1;
    }
    const char *last = strrchr(name, '/');
    last = last ? last + 1 : name;
    if (strcmp(last, "stats") == 0 || strcmp(last, "grad") == 0) {
        snprintf(err, errlen, "name '%s' ends in the reserved segment '%s'", name, last);
        return -1;
    }
    return 0;
}

int tensor_shape_parse(const char *s, tensor_shape *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    if (!s) {
        snprintf(err, errlen, "missing shape");
        return -1;
    }
    while (*s == ' ')
        s++;
    if (*s == '\0' || strcmp(s, "scalar") == 0)
        return 0; /* scalar: HTTP headers cannot be empty, so "scalar" says it */
    int64_t numel = 1;
    const char *p = s;
    for (;;) {
        while (*p == ' ')
            p++;
        if (*p < '0' || *p > '9') {
            snprintf(err, errlen, "shape '%s': dimension is not a positive integer", s);
            return -1;
        }
        errno = 0;
        char *end;
        long long d = strtoll(p, &end, 10);
        if (errno == ERANGE || d <= 0 || d > TENSOR_MAX_ELEMS) {
            snprintf(err, errlen, "shape '%s': dimension out of range", s);
            return -1;
        }
        if (out->ndim == TENSOR_MAX_DIMS) {
            snprintf(err, errlen, "shape '%s': more than %d dimensions", s, TENSOR_MAX_DIMS);
            return -1;
        }
        if (numel > TENSOR_MAX_ELEMS / d) {
            snprintf(err, errlen, "shape '%s': element count overflows", s);
            return -1;
        }
        numel *= d;
        out->dims[out->ndim++] = d;
        p = end;
        while (*p == ' ')
            p++;
        if (*p == '\0')
            return 0;
        if (*p != ',') {
            snprintf(err, errlen, "shape '%s': expected ',' between dimensions", s);
            return -1;
        }
        p++;
    }
}

int tensor_shape_format(const tensor_shape *shape, char *buf, size_t buflen)
{
    size_t used = 0;
    if (buflen)
        buf[0] = '\0';
    for (int i = 0; i < shape->ndim; i++) {
        int w = snprintf(buf + used, buflen > used ? buflen - used : 0, "%s%lld",
                         i ? "," : "", (long long)shape->dims[i]);
        if (w < 0)
            break;
        used += (size_t)w;
        if (used >= buflen) {
            used = buflen ? buflen - 1 : 0;
            break;
        }
    }
    return (int)used;
}

int64_t tensor_shape_numel(const tensor_shape *shape)
{
    int64_t n = 1;
    for (int i = 0; i < shape->ndim; i++)
        n *= shape->dims[i];
    return n;
}

int tensor_shape_equal(const tensor_shape *a, const tensor_shape *b)
{
    if (a->ndim != b->ndim)
        return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->dims[i] != b->dims[i])
            return 0;
    return 1;
}

int64_t tensor_find_nonfinite(const float *x, size_t n)
{
    /* Integer OR-sweep over the exponent bits first (vectorizes), then locate.
     * An all-ones exponent (NaN or Inf) plus one exponent step sets bit 31. */
    uint32_t flag = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &x[i], 4);
        flag |= (b & 0x7f800000u) + 0x00800000u;
    }
    if (!(flag & 0x80000000u))
        return -1;
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return (int64_t)i;
    return -1;
}

int tensor_shape_header(const tensor_shape *shape, char *buf, size_t buflen)
{
    if (shape->ndim == 0)
        return snprintf(buf, buflen, "scalar");
    return tensor_shape_format(shape, buf, buflen);
}
