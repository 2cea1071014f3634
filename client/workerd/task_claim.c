/* task_claim.c - a worker claims its task id on ps 0 before it does
 * anything else (psd's task_claims.h): two workers started with the same
 * --task_index would both be the chief, or train as one task; the second is
 * refused within seconds, naming the process and address that hold the id.
 * A process killed and restarted at once finds its old self's claim still
 * fresh: it waits for it to lapse (heartbeats come every second, a claim
 * lapses after 3 s of silence), so only a holder that is still heard from
 * makes it give up. */
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "clock.h"
#include "workerd/train.h"

void train_task_instance(char *out, size_t n)
{
    char host[49] = "?";
    if (gethostname(host, sizeof(host) - 1) != 0)
        snprintf(host, sizeof(host), "?");
    host[sizeof(host) - 1] = '\0';
    for (char *p = host; *p; p++) /* the ps takes printable characters, no quotes */
        if (*p < 0x21 || *p > 0x7e || *p == '"' || *p == '\\')
            *p = '_';
    unsigned r;
    if (getrandom(&r, sizeof(r), 0) != sizeof(r))
        r = (unsigned)clk_mono_ns();
    snprintf(out, n, "pid-%ld@%s/%08x", (long)getpid(), host, r);
}

/* How long a refused claim is retried: the holder's claim lapses after 3 s
 * without its heartbeat. */
#define CLAIM_WAIT_SECS 4.5

int train_claim_task(const train_config *c, ps_client *pc, const char *instance)
{
    json_t *body = json_pack("{s:i,s:s}", "worker", c->trainer, "instance", instance);
    if (!body) {
        fprintf(stderr, "workerd: out of memory\n");
        return -1;
    }
    double start = clk_mono_secs();
    int said = 0, rc = 0;
    for (;;) {
        int prc = ps_json(pc, 0, "POST", "/v1/heartbeat", body, 1, NULL);
        if (prc == PS_OK)
            break;
        if (prc != PS_EHTTP || ps_http_status(pc) != 409)
            break; /* an older ps, or one down: the steps' own retries say so */
        if (clk_mono_secs() - start > CLAIM_WAIT_SECS || train_stop_requested()) {
            fprintf(stderr,
                    "workerd: %s: refused: %s; each task needs its own --task_index (this one: pid %ld)\n",
                    c->name, ps_error(pc), (long)getpid());
            rc = -1;
            break;
        }
        if (!said) {
            printf("%s: %s; if that is this task's previous process, its claim lapses within 3 s: waiting\n",
                   c->name, ps_error(pc));
            fflush(stdout);
            said = 1;
        }
        train_sleep(0.5);
    }
    json_decref(body);
    if (rc == 0 && said)
        printf("%s: task id %d is this process's now\n", c->name, c->trainer);
    return rc;
}
