/* jsonmem.h - jansson when memory runs out. Found by the allocation-failure
 * test (tests/system/test_chaos.py), jansson 2.14:
 * - its dumper ignores a failed write of an object's key and goes on, so
 *   json_dumps can return a text with a key missing (invalid JSON, or a
 *   safetensors header that describes other bytes);
 * - its parser reports some failed allocations as syntax errors ("string or
 *   '}' expected"), which would blame the sender for the server's memory.
 * Every binary that links this file gets jansson's allocations counted
 * (json_set_alloc_funcs at load time), per thread. */
#ifndef RESTPS_JSONMEM_H
#define RESTPS_JSONMEM_H

#include <jansson.h>

/* As json_dumps (malloc'd, NUL-ended; free it), or NULL when anything failed. */
char *json_dumps_checked(const json_t *j, size_t flags);

/* How many of jansson's allocations failed in this thread so far: read it
 * before and after a json_load* that failed to tell memory from syntax. */
unsigned long json_failed_allocs(void);

#endif
