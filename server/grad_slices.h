/* grad_slices.h - a dense variable's gradient given by element ids (top-k
 * sparsification: workerd --topk_ratio sends the largest elements of each
 * gradient and keeps the rest for later pushes). In a push body,
 * "NAME:ids" (I64 or I32 [n]: indices into NAME's flattened elements, each
 * 0..numel-1, no two alike) and "NAME:values" (F32 or BF16 [n]) stand for
 * the dense float32 gradient of NAME's shape that holds those values at
 * those elements and zeros elsewhere. The push is then applied as that dense
 * gradient would be: sync averaging, every optimizer, each value checked
 * finite as the float32 it becomes, all or nothing.
 *
 * The names are a sparse table's gradient's (sparse_set.h): the variable
 * they name tells them apart (a table's pair is left as it is). */
#ifndef RESTPS_GRAD_SLICES_H
#define RESTPS_GRAD_SLICES_H

#include "bufpool.h"
#include "safetensors.h"
#include "store.h"

/* The body (f, its data section at data) with every dense variable's pair
 * made its dense gradient: *out a blob of pool holding the whole new body
 * (prefix, header, data; the other tensors and the metadata as they were).
 * 0 with *out (NULL: f holds no such pair), -1 a bad pair (err says: a 400),
 * -2 out of memory. */
int grad_slices_densify(store *s, bufpool *pool, const st_file *f, const unsigned char *data, blob **out,
                        char *err, size_t errlen);

#endif
