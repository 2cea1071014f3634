/* tensor.h - what every side knows about a named float32 tensor: valid names,
 * shapes (parse, format, element count), and finite checks. */
#ifndef RESTPS_TENSOR_H
#define RESTPS_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#define TENSOR_MAX_DIMS 8
#define TENSOR_NAME_MAX 128
/* Largest element count we accept: keeps count*4 and offsets far from overflow. */
#define TENSOR_MAX_ELEMS ((int64_t)1 << 40)

typedef struct tensor_shape {
    int ndim;                      /* 0 = scalar (one element) */
    int64_t dims[TENSOR_MAX_DIMS];
} tensor_shape;

/* 0 when `name` matches [A-Za-z0-9_./-]{1,128}, has no "..", no empty path
 * segment, and its last segment is not a reserved route word ("stats", "grad").
 * Else -1 with a reason in err. */
int tensor_name_check(const char *name, char *err, size_t errlen);

/* Parse "784,100" (dimensions > 0, at most TENSOR_MAX_DIMS, product within
 * TENSOR_MAX_ELEMS). An empty string or "scalar" is a scalar. 0 or -1 with err. */
int tensor_shape_parse(const char *s, tensor_shape *out, char *err, size_t errlen);

/* Write "784,100" into buf; returns the length written (truncated safely). */
int tensor_shape_format(const tensor_shape *shape, char *buf, size_t buflen);
/* The X-Shape header value: as tensor_shape_format, but "scalar" for a scalar
 * (a header value cannot be empty). tensor_shape_parse reads both. */
int tensor_shape_header(const tensor_shape *shape, char *buf, size_t buflen);

/* Number of elements: product of dims (1 for a scalar). */
int64_t tensor_shape_numel(const tensor_shape *shape);

int tensor_shape_equal(const tensor_shape *a, const tensor_shape *b);

/* Index of the first NaN or Inf in x[0..n), or -1 when all are finite. */
int64_t tensor_find_nonfinite(const float *x, size_t n);

#endif
