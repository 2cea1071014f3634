/* workerd.c - the worker. Training is not built yet; for now workerd joins the
 * cluster, checks every ps task answers, and lists each shard's variables
 * through libps. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster.h"
#include "flags.h"
#include "libps.h"

int main(int argc, char **argv)
{
    const char *job_name = NULL, *ps_hosts = NULL, *worker_hosts = NULL, *chief_hosts = NULL;
    const char *token_file = NULL;
    int task_index = -1, timeout_ms = 10000;
    flag flags[] = {
        {"job_name", FLAG_STRING, &job_name, "this task's job: worker (default) or chief", 0},
        {"task_index", FLAG_INT, &task_index, "this task's index in its job (default 0)", 0},
        {"ps_hosts", FLAG_STRING, &ps_hosts, "comma-separated host:port of the ps tasks (default localhost:2222)", 0},
        {"worker_hosts", FLAG_STRING, &worker_hosts, "comma-separated host:port of the worker tasks (default localhost:2223)", 0},
        {"chief_hosts", FLAG_STRING, &chief_hosts, "host:port of the chief task, if the cluster has one", 0},
        {"auth_token_file", FLAG_STRING, &token_file, "file holding the bearer token psd was started with", 0},
        {"timeout_ms", FLAG_INT, &timeout_ms, "per-request timeout in milliseconds (default 10000)", 0},
    };
    int nflags = (int)(sizeof(flags) / sizeof(flags[0]));
    char err[512];
    int fr = flags_parse(flags, nflags, argc, argv, err, sizeof(err));
    if (fr == 1) {
        flags_help(stdout,
                   "usage: workerd [flags]\n"
                   "The restps worker. Training is not built yet: workerd checks that every ps task\n"
                   "answers and lists the variables each one holds. The cluster comes from the flags\n"
                   "or the TF_CONFIG environment variable; flags win.",
                   flags, nflags);
        return 0;
    }
    if (fr < 0) {
        fprintf(stderr, "workerd: %s (see workerd --help)\n", err);
        return 2;
    }
    if (flags_get(flags, nflags, "task_index")->given && task_index < 0) {
        fprintf(stderr, "workerd: --task_index=%d is negative\n", task_index);
        return 2;
    }
    cluster_input in = {.job_name = job_name,
                        .task_index = task_index,
                        .ps_hosts = ps_hosts,
                        .worker_hosts = worker_hosts ? worker_hosts : (getenv("TF_CONFIG") ? NULL : "localhost:2223"),
                        .chief_hosts = chief_hosts,
                        .tf_config = getenv("TF_CONFIG"),
                        .default_job = "worker"};
    cluster_spec cs;
    if (cluster_spec_build(&in, &cs, err, sizeof(err)) != 0) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    char *token = NULL;
    if (token_file) {
        FILE *f = fopen(token_file, "r");
        char buf[4096] = "";
        if (!f || !fgets(buf, sizeof(buf), f)) {
            fprintf(stderr, "workerd: unable to read token file '%s'\n", token_file);
            return 2;
        }
        fclose(f);
        buf[strcspn(buf, "\r\n")] = '\0';
        token = strdup(buf);
    }
    const cluster_job *ps = &cs.jobs[JOB_PS];
    char **hosts = calloc((size_t)ps->n, sizeof(*hosts));
    for (int i = 0; i < ps->n; i++) {
        const char *fmt = strchr(ps->tasks[i].host, ':') ? "[%s]:%d" : "%s:%d";
        if (asprintf(&hosts[i], fmt, ps->tasks[i].host, ps->tasks[i].port) < 0)
            return 1;
    }
    ps_options opt = {.timeout_ms = timeout_ms, .retries = 2, .token = token};
    ps_client *c = ps_client_new((const char *const *)hosts, ps->n, &opt, err, sizeof(err));
    if (!c) {
        fprintf(stderr, "workerd: %s\n", err);
        return 2;
    }
    int status = 0;
    for (int i = 0; i < ps->n; i++) {
        ps_var_info *v;
        int n;
        int64_t step;
        if (ps_list(c, i, &v, &n, &step) != PS_OK) {
            fprintf(stderr, "workerd: %s\n", ps_error(c));
            status = 1;
            continue;
        }
        printf("ps %d (%s): global_step %lld, %d variables\n", i, hosts[i], (long long)step, n);
        for (int k = 0; k < n; k++) {
            char shape[128];
            tensor_shape_format(&v[k].shape, shape, sizeof(shape));
            printf("  %-32s [%s] version %llu, %llu bytes\n", v[k].name, shape,
                   (unsigned long long)v[k].version, (unsigned long long)v[k].bytes);
        }
        free(v);
    }
    printf("workerd: %s %d: training is not built yet\n", cluster_job_name(cs.job), cs.task_index);
    ps_client_free(c);
    for (int i = 0; i < ps->n; i++)
        free(hosts[i]);
    free(hosts);
    free(token);
    cluster_spec_free(&cs);
    return status;
}
