/* fuzz_cluster.c - the cluster spec (common/cluster.c): --job_name,
 * --task_index, --ps_hosts, --worker_hosts, --chief_hosts and TF_CONFIG.
 *
 * Input: newline-separated fields
 *   default job ("ps" or "worker"; anything else: "ps")
 *   --job_name        ("-": not given)
 *   --task_index      (a number; "-": not given)
 *   --ps_hosts, --worker_hosts, --chief_hosts   ("-": not given)
 *   TF_CONFIG         (the rest, newlines included; empty: not given)
 * Each host list is also given to cluster_parse_addr whole. An accepted spec
 * names this task inside its job, and every address has a host and a port. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cluster.h"
#include "fuzz_util.h"

static const char *given(const char *s)
{
    return strcmp(s, "-") == 0 ? NULL : s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *f[7];
    for (int i = 0; i < 6; i++)
        f[i] = fuzz_field(&data, &size, '\n');
    f[6] = malloc(size + 1);
    FUZZ_CHECK(f[6]);
    if (size)
        memcpy(f[6], data, size);
    f[6][size] = '\0';

    char err[512] = "";
    cluster_addr a;
    for (int i = 3; i < 6; i++)
        if (cluster_parse_addr(f[i], &a, err, sizeof(err)) == 0)
            FUZZ_CHECK(a.host[0] && a.port >= 1 && a.port <= 65535);

    cluster_input in = {
        .job_name = given(f[1]),
        .task_index = -1,
        .ps_hosts = given(f[3]),
        .worker_hosts = given(f[4]),
        .chief_hosts = given(f[5]),
        .tf_config = f[6],
        .default_job = strcmp(f[0], "worker") == 0 ? "worker" : "ps",
    };
    if (given(f[2])) {
        char *end;
        long v = strtol(f[2], &end, 10);
        if (*end == '\0' && v >= -1000 && v <= 1000000)
            in.task_index = (int)v;
    }
    cluster_spec c;
    err[0] = '\0';
    if (cluster_spec_build(&in, &c, err, sizeof(err)) == 0) {
        FUZZ_CHECK(c.job < JOB_COUNT && c.task_index >= 0);
        FUZZ_CHECK(c.job == JOB_EVALUATOR || cluster_self(&c) != NULL);
        FUZZ_CHECK(c.jobs[JOB_CHIEF].n <= 1);
        for (int j = 0; j < JOB_COUNT; j++)
            for (int i = 0; i < c.jobs[j].n; i++)
                FUZZ_CHECK(c.jobs[j].tasks[i].host[0] && c.jobs[j].tasks[i].port >= 1 &&
                           c.jobs[j].tasks[i].port <= 65535);
        cluster_spec_free(&c);
    } else {
        FUZZ_CHECK(err[0] != '\0');
    }
    for (int i = 0; i < 7; i++)
        free(f[i]);
    return 0;
}
