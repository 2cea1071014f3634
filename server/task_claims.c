/* task_claims.c - which process holds each worker task id (task_claims.h). */
#include "task_claims.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store.h" /* STORE_MAX_WORKERS */

typedef struct claim {
    char instance[TASK_INSTANCE_MAX + 1];
    char addr[64];
    int64_t heard_ms;
} claim;

struct task_claims {
    pthread_mutex_t mu;
    claim *w[STORE_MAX_WORKERS]; /* made at a worker's first claim */
};

task_claims *task_claims_new(void)
{
    task_claims *tc = calloc(1, sizeof(*tc));
    if (tc)
        pthread_mutex_init(&tc->mu, NULL);
    return tc;
}

void task_claims_free(task_claims *tc)
{
    if (!tc)
        return;
    for (int i = 0; i < STORE_MAX_WORKERS; i++)
        free(tc->w[i]);
    pthread_mutex_destroy(&tc->mu);
    free(tc);
}

int task_instance_valid(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (s[n] < 0x21 || s[n] > 0x7e || s[n] == '"' || s[n] == '\\' || n >= TASK_INSTANCE_MAX)
            return 0;
    return n > 0;
}

int task_claims_heard(task_claims *tc, int worker, const char *instance, const char *from, int64_t now_ms,
                      int64_t fresh_ms, char *holder, size_t holder_len, char *addr, size_t addr_len,
                      int64_t *ago_ms)
{
    if (worker < 0 || worker >= STORE_MAX_WORKERS)
        return -1;
    pthread_mutex_lock(&tc->mu);
    claim *c = tc->w[worker];
    if (!c && !(c = tc->w[worker] = calloc(1, sizeof(*c)))) {
        pthread_mutex_unlock(&tc->mu);
        return -1;
    }
    if (c->instance[0] && strcmp(c->instance, instance) != 0 && now_ms - c->heard_ms < fresh_ms) {
        snprintf(holder, holder_len, "%s", c->instance);
        snprintf(addr, addr_len, "%s", c->addr);
        *ago_ms = now_ms - c->heard_ms;
        pthread_mutex_unlock(&tc->mu);
        return 1;
    }
    snprintf(c->instance, sizeof(c->instance), "%s", instance);
    snprintf(c->addr, sizeof(c->addr), "%s", from);
    c->heard_ms = now_ms;
    pthread_mutex_unlock(&tc->mu);
    return 0;
}

void task_claims_release(task_claims *tc, int worker, const char *instance)
{
    if (worker < 0 || worker >= STORE_MAX_WORKERS)
        return;
    pthread_mutex_lock(&tc->mu);
    if (tc->w[worker] && strcmp(tc->w[worker]->instance, instance) == 0)
        tc->w[worker]->instance[0] = '\0';
    pthread_mutex_unlock(&tc->mu);
}
