/* etag.h - entity tags: If-None-Match against an ETag (RFC 9110 13.1.2, the
 * weak comparison a GET uses), and the ETag of a shard's variables as one
 * body (GET /v1/params, a push's ?return=params answer). */
#ifndef RESTPS_ETAG_H
#define RESTPS_ETAG_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"
#include "wire_dtype.h"

/* Does If-None-Match inm (a list of ETags, W/ ones too, or *; NULL: none)
 * match etag (with its quotes)? */
int etag_matches(const char *inm, const char *etag);

/* The ETag of v[0..n) as one body at global step `step` (the variables'
 * names and versions, the step, the dtype, avg: the moving averages) on
 * the psd started as `instance`: "<instance>-<step>-<16 hex>[-bf16|-fp16][-avg]".
 * It changes whenever any variable's values do. */
void etag_of_params(char *out, size_t cap, const char *instance, const store_snap *v, int n, int64_t step,
                    wire_dtype dt, int avg);

#endif
