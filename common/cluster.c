/* cluster.c - build and validate the cluster spec from flags and TF_CONFIG. */
#include "cluster.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *job_names[JOB_COUNT] = {"ps", "worker", "chief", "evaluator"};

const char *cluster_job_name(cluster_job_kind k)
{
    return k < JOB_COUNT ? job_names[k] : "?";
}

cluster_job_kind cluster_job_from_name(const char *name)
{
    for (int i = 0; i < JOB_COUNT; i++)
        if (name && strcmp(name, job_names[i]) == 0)
            return (cluster_job_kind)i;
    return JOB_COUNT;
}

static int host_char_ok(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '-' || c == '_';
}

int cluster_parse_addr(const char *s, cluster_addr *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    const char *host = s, *host_end, *port = NULL;
    if (!s || !*s) {
        snprintf(err, errlen, "empty address, expected host:port");
        return -1;
    }
    if (s[0] == '[') { /* [v6]:port */
        host = s + 1;
        host_end = strchr(host, ']');
        if (!host_end || host_end == host) {
            snprintf(err, errlen, "malformed address '%s': unterminated '['", s);
            return -1;
        }
        for (const char *p = host; p < host_end; p++)
            if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f') ||
                  (*p >= 'A' && *p <= 'F') || *p == ':' || *p == '.')) {
                snprintf(err, errlen, "malformed address '%s': bad IPv6 literal", s);
                return -1;
            }
        if (host_end[1] == ':')
            port = host_end + 2;
        else if (host_end[1] != '\0') {
            snprintf(err, errlen, "malformed address '%s': expected ':' after ']'", s);
            return -1;
        }
    } else {
        host_end = strchr(s, ':');
        if (host_end) {
            port = host_end + 1;
        } else {
            host_end = s + strlen(s);
        }
        if (host_end == host) {
            snprintf(err, errlen, "malformed address '%s': empty host", s);
            return -1;
        }
        for (const char *p = host; p < host_end; p++)
            if (!host_char_ok(*p)) {
                snprintf(err, errlen, "malformed address '%s': bad character in host", s);
                return -1;
            }
    }
    size_t hl = (size_t)(host_end - host);
    if (hl > CLUSTER_HOST_MAX) {
        snprintf(err, errlen, "malformed address '%.64s...': host too long", s);
        return -1;
    }
    if (!port) {
        snprintf(err, errlen, "malformed address '%s': no port (want %s)", s,
                 s[0] == '[' ? "[v6]:port" : "host:port");
        return -1;
    }
    memcpy(out->host, host, hl);
    out->host[hl] = '\0';
    if (*port < '0' || *port > '9') {
        snprintf(err, errlen, "malformed address '%s': port is not a number", s);
        return -1;
    }
    errno = 0;
    char *end;
    long v = strtol(port, &end, 10);
    if (*end != '\0' || errno || v < 1 || v > 65535) {
        snprintf(err, errlen, "malformed address '%s': port must be 1-65535", s);
        return -1;
    }
    out->port = (int)v;
    return 0;
}

static void job_free(cluster_job *j)
{
    free(j->tasks);
    j->tasks = NULL;
    j->n = 0;
}

static int job_from_list(cluster_job *j, const char *list, const char *what, char *err,
                         size_t errlen)
{
    job_free(j);
    size_t n = 1;
    for (const char *p = list; *p; p++)
        n += *p == ',';
    j->tasks = calloc(n, sizeof(cluster_addr));
    if (!j->tasks) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    const char *p = list;
    for (size_t i = 0; i < n; i++) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        char buf[CLUSTER_HOST_MAX + 16];
        if (len >= sizeof(buf)) {
            snprintf(err, errlen, "%s: address %zu is too long", what, i);
            return -1;
        }
        memcpy(buf, p, len);
        buf[len] = '\0';
        char aerr[200];
        if (cluster_parse_addr(buf, &j->tasks[i], aerr, sizeof(aerr)) != 0) {
            snprintf(err, errlen, "%s: %s", what, aerr);
            return -1;
        }
        j->n++;
        p = e ? e + 1 : p + len;
    }
    return 0;
}

static int job_from_json(cluster_job *j, json_t *arr, const char *name, char *err,
                         size_t errlen)
{
    job_free(j);
    if (!json_is_array(arr)) {
        snprintf(err, errlen, "TF_CONFIG: cluster.%s is not a list of \"host:port\" strings", name);
        return -1;
    }
    size_t n = json_array_size(arr);
    j->tasks = calloc(n ? n : 1, sizeof(cluster_addr));
    if (!j->tasks) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        char aerr[200];
        if (!json_is_string(v)) {
            snprintf(err, errlen, "TF_CONFIG: cluster.%s[%zu] is not a string", name, i);
            return -1;
        }
        if (cluster_parse_addr(json_string_value(v), &j->tasks[i], aerr, sizeof(aerr)) != 0) {
            snprintf(err, errlen, "TF_CONFIG: cluster.%s[%zu]: %s", name, i, aerr);
            return -1;
        }
        j->n++;
    }
    return 0;
}

static int from_tf_config(const char *text, cluster_spec *c, char **job_name, int *index,
                          char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        snprintf(err, errlen, "TF_CONFIG: bad JSON: %s at line %d column %d", jerr.text,
                 jerr.line, jerr.column);
        return -1;
    }
    int rc = -1;
    if (!json_is_object(root)) {
        snprintf(err, errlen, "TF_CONFIG: not a JSON object");
        goto out;
    }
    json_t *cl = json_object_get(root, "cluster");
    if (cl) {
        if (!json_is_object(cl)) {
            snprintf(err, errlen, "TF_CONFIG: \"cluster\" is not an object");
            goto out;
        }
        const char *k;
        json_t *v;
        json_object_foreach(cl, k, v)
        {
            cluster_job_kind kind = cluster_job_from_name(k);
            if (kind == JOB_COUNT) {
                snprintf(err, errlen, "TF_CONFIG: unknown job '%s' (expected ps, worker, chief or evaluator)", k);
                goto out;
            }
            if (job_from_json(&c->jobs[kind], v, k, err, errlen) != 0)
                goto out;
        }
    }
    json_t *task = json_object_get(root, "task");
    if (task) {
        if (!json_is_object(task)) {
            snprintf(err, errlen, "TF_CONFIG: \"task\" is not an object");
            goto out;
        }
        json_t *t = json_object_get(task, "type"), *i = json_object_get(task, "index");
        if (t) {
            if (!json_is_string(t)) {
                snprintf(err, errlen, "TF_CONFIG: task.type is not a string");
                goto out;
            }
            *job_name = strdup(json_string_value(t));
        }
        if (i) {
            if (!json_is_integer(i)) {
                snprintf(err, errlen, "TF_CONFIG: task.index is not an integer");
                goto out;
            }
            json_int_t v = json_integer_value(i);
            if (v < 0 || v > 1000000) {
                snprintf(err, errlen, "TF_CONFIG: task.index %lld out of range", (long long)v);
                goto out;
            }
            *index = (int)v;
        }
    }
    rc = 0;
out:
    json_decref(root);
    return rc;
}

int cluster_spec_build(const cluster_input *in, cluster_spec *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    char *tf_job = NULL;
    int tf_index = -1;
    if (in->tf_config && *in->tf_config &&
        from_tf_config(in->tf_config, out, &tf_job, &tf_index, err, errlen) != 0)
        goto fail;
    if (in->ps_hosts && job_from_list(&out->jobs[JOB_PS], in->ps_hosts, "--ps_hosts", err, errlen))
        goto fail;
    if (in->worker_hosts &&
        job_from_list(&out->jobs[JOB_WORKER], in->worker_hosts, "--worker_hosts", err, errlen))
        goto fail;
    if (in->chief_hosts &&
        job_from_list(&out->jobs[JOB_CHIEF], in->chief_hosts, "--chief_hosts", err, errlen))
        goto fail;

    const char *job = in->job_name ? in->job_name : tf_job ? tf_job : in->default_job;
    out->job = cluster_job_from_name(job);
    if (out->job == JOB_COUNT) {
        snprintf(err, errlen, "unknown job '%s' (expected ps, worker, chief or evaluator)",
                 job ? job : "");
        goto fail;
    }
    if (in->task_index < -1) {
        snprintf(err, errlen, "task index %d is negative", in->task_index);
        goto fail;
    }
    out->task_index = in->task_index >= 0 ? in->task_index : tf_index >= 0 ? tf_index : 0;

    /* The single-machine default, as the original example: one ps on localhost
     * (not for a task that needs none: its own address may well be that one). */
    if (out->jobs[JOB_PS].n == 0 && !in->ps_hosts && !(in->tf_config && *in->tf_config) &&
        !in->no_default_ps) {
        char def[32];
        snprintf(def, sizeof(def), "localhost:%d", CLUSTER_DEFAULT_PORT);
        if (job_from_list(&out->jobs[JOB_PS], def, "default ps", err, errlen))
            goto fail;
        out->ps_default = 1;
    }
    if (out->jobs[JOB_CHIEF].n > 1) {
        snprintf(err, errlen, "the chief job has %d tasks, at most 1 is allowed",
                 out->jobs[JOB_CHIEF].n);
        goto fail;
    }
    if (out->job != JOB_EVALUATOR) {
        const cluster_job *own = &out->jobs[out->job];
        if (own->n == 0) {
            snprintf(err, errlen, "job '%s' has no tasks in the cluster (give --%s_hosts)",
                     cluster_job_name(out->job), cluster_job_name(out->job));
            goto fail;
        }
        if (out->task_index >= own->n) {
            snprintf(err, errlen, "task index %d out of range: job '%s' has %d task%s",
                     out->task_index, cluster_job_name(out->job), own->n, own->n == 1 ? "" : "s");
            goto fail;
        }
    }
    /* Two tasks cannot share one address. */
    for (int a = 0; a < JOB_COUNT; a++)
        for (int i = 0; i < out->jobs[a].n; i++)
            for (int b = a; b < JOB_COUNT; b++)
                for (int k = (b == a ? i + 1 : 0); k < out->jobs[b].n; k++) {
                    const cluster_addr *x = &out->jobs[a].tasks[i], *y = &out->jobs[b].tasks[k];
                    if (x->port == y->port && strcmp(x->host, y->host) == 0) {
                        snprintf(err, errlen, "%s:%d is given twice (%s %d and %s %d)", x->host,
                                 x->port, job_names[a], i, job_names[b], k);
                        goto fail;
                    }
                }
    free(tf_job);
    return 0;
fail:
    free(tf_job);
    cluster_spec_free(out);
    return -1;
}

void cluster_spec_free(cluster_spec *c)
{
    for (int i = 0; i < JOB_COUNT; i++)
        job_free(&c->jobs[i]);
}

const cluster_addr *cluster_self(const cluster_spec *c)
{
    if (c->job == JOB_COUNT || c->task_index >= c->jobs[c->job].n)
        return NULL;
    return &c->jobs[c->job].tasks[c->task_index];
}
