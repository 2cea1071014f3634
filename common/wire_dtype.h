/* wire_dtype.h - 16-bit floats on the wire (safetensors' BF16 and F16): the
 * casts from float32 with round-to-nearest-even and back, and a safetensors
 * body's 16-bit tensors widened to float32. psd keeps float32 master copies
 * and optimizer slots; only bodies travel in 16 bits.
 *
 * F16 gradients carry a loss scale (push metadata `loss_scale`, a power of
 * two from 1 to 2^24): the worker multiplies its float32 gradients by it
 * before the cast (so small ones do not flush to zero) and backs it off when
 * the cast would overflow; the ps divides by it as it widens (exact: a power
 * of two). Every widened value is checked finite as the float32 it becomes. */
#ifndef RESTPS_WIRE_DTYPE_H
#define RESTPS_WIRE_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

typedef enum wire_dtype { WIRE_F32 = 0, WIRE_BF16 = 1, WIRE_F16 = 2 } wire_dtype;

#define WIRE_LOSS_SCALE_MAX 16777216.0 /* 2^24 */

/* "fp32", "bf16" or "fp16" (also "float32", "bfloat16", "float16" and the
 * safetensors names F32, BF16, F16): 0 and *out, else -1. */
int wire_dtype_parse(const char *s, wire_dtype *out);
/* "fp32", "bf16", "fp16" */
const char *wire_dtype_name(wire_dtype d);
/* The safetensors dtype: "F32", "BF16", "F16". */
const char *wire_dtype_st(wire_dtype d);
/* A safetensors float dtype as a wire_dtype, or -1 (not one of the three). */
int wire_dtype_of_st(const char *st_dtype);
/* Bytes per element: 4 or 2. */
size_t wire_dtype_size(wire_dtype d);

/* One value: round-to-nearest-even; a NaN stays a (quiet) NaN; a float16
 * past 65504 (after rounding) is Inf. */
uint16_t wire_f32_to_bf16(float f);
float wire_bf16_to_f32(uint16_t h);
uint16_t wire_f32_to_f16(float f);
float wire_f16_to_f32(uint16_t h);

/* n floats of src, times scale, into dst in dtype d (dst: n * size bytes;
 * F32 copies, times scale). The index of the first element that is not
 * finite in dst (an overflow of the cast, or a NaN/Inf in src), or -1. It
 * stops there: dst is written up to that element's chunk only. */
int64_t wire_encode(wire_dtype d, const float *src, size_t n, float scale, void *dst);

/* n elements of dtype d at src into float32 dst, times scale (1 / the loss
 * scale). The index of the first widened value that is not finite, or -1
 * (then dst holds all n). */
int64_t wire_decode(wire_dtype d, const void *src, size_t n, float scale, float *dst);

/* A parsed body (f, its data section at data) whose BF16/F16 tensors are to
 * become F32: the bytes its data takes then (every tensor 8-byte aligned),
 * or 0 when it has no 16-bit tensor (nothing to do). */
size_t wire_widened_len(const st_file *f);
/* Write f's tensors into dst (wire_widened_len bytes) with the 16-bit ones
 * widened (times scale), and rewrite f's dtypes and offsets to describe dst.
 * 0; or -1 with err ("gradient 'NAME' has Inf at element N (as float32)")
 * when a widened value, or one of an F32 tensor beside them, is not finite
 * (f is then unchanged): every float of dst is checked. */
int wire_widen(st_file *f, const unsigned char *data, float scale, unsigned char *dst, char *err,
               size_t errlen);

#endif
