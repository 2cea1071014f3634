/* task_claims.h - which process holds each worker task id. Every workerd
 * sends, with its heartbeat, an instance string of its own (host/pid/random:
 * workerd/task_claim.c); the first instance heard for a task id holds it,
 * and a heartbeat from another instance while the holder is still heard from
 * (within fresh_ms) is refused, naming the holder and its address: two
 * workers started with the same --task_index, which TensorFlow would let
 * train as one. A holder not heard from for fresh_ms (a process killed and
 * restarted) gives way to the next instance; a process that leaves says so
 * with its last heartbeat ("leaving": true), which frees the id at once (a
 * rerun). A heartbeat without an instance (older workers, a pipeline stage)
 * claims nothing. */
#ifndef RESTPS_TASK_CLAIMS_H
#define RESTPS_TASK_CLAIMS_H

#include <stddef.h>
#include <stdint.h>

/* The longest instance string, and the characters it may hold. */
#define TASK_INSTANCE_MAX 96

typedef struct task_claims task_claims;

task_claims *task_claims_new(void);
void task_claims_free(task_claims *tc);

/* 1: s is an instance string (1 to TASK_INSTANCE_MAX printable ASCII
 * characters other than quotes and backslashes). */
int task_instance_valid(const char *s);

/* A heartbeat of `instance` for worker (0 to STORE_MAX_WORKERS - 1) from
 * address `from`, at now_ms (CLOCK_MONOTONIC): 0 it holds the id (claimed
 * or renewed); 1 another instance, heard from within fresh_ms, holds it:
 * its instance, address and how long ago it was heard in holder/addr/ago_ms;
 * -1 out of memory. */
int task_claims_heard(task_claims *tc, int worker, const char *instance, const char *from, int64_t now_ms,
                      int64_t fresh_ms, char *holder, size_t holder_len, char *addr, size_t addr_len,
                      int64_t *ago_ms);

/* instance leaves: worker's id is free (if instance held it). */
void task_claims_release(task_claims *tc, int worker, const char *instance);

#endif
