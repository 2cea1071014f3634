/* cluster.h - the cluster spec: jobs (ps, worker, chief, evaluator) of tasks at
 * host:port addresses, and which task this process is. Built from TensorFlow's
 * flags (--job_name --task_index --ps_hosts --worker_hosts) and/or the
 * TF_CONFIG JSON; flags win. */
#ifndef RESTPS_CLUSTER_H
#define RESTPS_CLUSTER_H

#include <stddef.h>

#define CLUSTER_DEFAULT_PORT 2222
#define CLUSTER_HOST_MAX 255

typedef struct cluster_addr {
    char host[CLUSTER_HOST_MAX + 1]; /* hostname, IPv4, or IPv6 without brackets */
    int port;
} cluster_addr;

typedef struct cluster_job {
    int n;
    cluster_addr *tasks; /* owned */
} cluster_job;

typedef enum { JOB_PS, JOB_WORKER, JOB_CHIEF, JOB_EVALUATOR, JOB_COUNT } cluster_job_kind;

typedef struct cluster_spec {
    cluster_job jobs[JOB_COUNT];
    cluster_job_kind job; /* this task's job */
    int task_index;
    int ps_default;       /* 1: the ps job is the default, localhost:2222 (no ps list, no TF_CONFIG) */
} cluster_spec;

/* What the process was given. NULL / -1 mean "not given". */
typedef struct cluster_input {
    const char *job_name;
    int task_index;
    const char *ps_hosts, *worker_hosts, *chief_hosts; /* "h:p,h:p" */
    const char *tf_config;                             /* TF_CONFIG's value */
    const char *default_job;                           /* "ps" for psd, "worker" for workerd */
    int no_default_ps; /* 1: a task that needs no ps (workerd --allreduce=ring): no ps list and
                        * no TF_CONFIG leave the ps job empty instead of localhost:2222 */
} cluster_input;

/* Build and check the spec. 0, or -1 with a one-line reason in err. */
int cluster_spec_build(const cluster_input *in, cluster_spec *out, char *err, size_t errlen);
void cluster_spec_free(cluster_spec *c);

/* "host:port" or "[v6]:port"; an address without a port is malformed, as
 * in the flags as in TF_CONFIG. 0 or -1 with err. */
int cluster_parse_addr(const char *s, cluster_addr *out, char *err, size_t errlen);

const char *cluster_job_name(cluster_job_kind k);
/* JOB_COUNT when the name is unknown. */
cluster_job_kind cluster_job_from_name(const char *name);

/* This task's own address, or NULL (an evaluator need not have one). */
const cluster_addr *cluster_self(const cluster_spec *c);

#endif
