/* test_cluster.c - common/cluster.c: the cluster spec from TensorFlow-style
 * flags and from TF_CONFIG (the JSON TensorFlow documents), flags winning. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "cluster.h"

/* An input with nothing given. */
static cluster_input none(const char *default_job)
{
    cluster_input in = {.job_name = NULL, .task_index = -1, .default_job = default_job};
    return in;
}

static void expect_addr(const cluster_addr *a, const char *host, int port)
{
    assert_non_null(a);
    assert_string_equal(a->host, host);
    assert_int_equal(a->port, port);
}

/* Helpers report the caller's line (cmocka's _fail) for the XML report. */
static void build_ok_at(const cluster_input *in, cluster_spec *c, const char *file, int line)
{
    char err[512] = "";
    if (cluster_spec_build(in, c, err, sizeof(err)) != 0) {
        print_error("cluster_spec_build failed: %s\n", err);
        _fail(file, line);
    }
}
#define build_ok(in, c) build_ok_at(in, c, __FILE__, __LINE__)

static void build_fails_at(const cluster_input *in, const char *what, const char *file, int line)
{
    cluster_spec c;
    char err[512] = "";
    int rc = cluster_spec_build(in, &c, err, sizeof(err));
    if (rc == 0) {
        cluster_spec_free(&c);
        print_error("accepted (%s)\n", what);
        _fail(file, line);
    }
    if (rc != -1 || err[0] == '\0' || strchr(err, '\n')) {
        print_error("%s: rc %d, want -1 with a one-line reason, got '%s'\n", what, rc, err);
        _fail(file, line);
    }
}
#define build_fails(in, what) build_fails_at(in, what, __FILE__, __LINE__)

static void test_defaults(void **state)
{
    (void)state;
    cluster_input in = none("ps");
    cluster_spec c;
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_PS);
    assert_int_equal(c.task_index, 0);
    assert_int_equal(c.jobs[JOB_PS].n, 1);
    expect_addr(&c.jobs[JOB_PS].tasks[0], "localhost", 2222);
    assert_int_equal(c.jobs[JOB_WORKER].n, 0);
    assert_int_equal(c.jobs[JOB_CHIEF].n, 0);
    assert_int_equal(c.jobs[JOB_EVALUATOR].n, 0);
    expect_addr(cluster_self(&c), "localhost", 2222);
    cluster_spec_free(&c);

    /* an empty TF_CONFIG is the same as none */
    in.tf_config = "";
    build_ok(&in, &c);
    expect_addr(cluster_self(&c), "localhost", 2222);
    cluster_spec_free(&c);

    /* a worker by default, with no worker list: an error that says so */
    cluster_input w = none("worker");
    build_fails(&w, "worker without --worker_hosts");
    w.worker_hosts = "localhost:2223";
    build_ok(&w, &c);
    assert_int_equal(c.job, JOB_WORKER);
    expect_addr(cluster_self(&c), "localhost", 2223);
    expect_addr(&c.jobs[JOB_PS].tasks[0], "localhost", 2222);
    cluster_spec_free(&c);
}

static void test_flags_only(void **state)
{
    (void)state;
    cluster_input in = none("ps");
    in.job_name = "worker";
    in.task_index = 1;
    in.ps_hosts = "ps0.example.com:2222,ps1.example.com:2222";
    in.worker_hosts = "10.0.0.1:2222,10.0.0.2:2223,w3:2222";
    in.chief_hosts = "chief:2224";
    cluster_spec c;
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_WORKER);
    assert_int_equal(c.task_index, 1);
    assert_int_equal(c.jobs[JOB_PS].n, 2);
    expect_addr(&c.jobs[JOB_PS].tasks[0], "ps0.example.com", 2222);
    expect_addr(&c.jobs[JOB_PS].tasks[1], "ps1.example.com", 2222);
    assert_int_equal(c.jobs[JOB_WORKER].n, 3);
    expect_addr(&c.jobs[JOB_WORKER].tasks[0], "10.0.0.1", 2222);
    expect_addr(&c.jobs[JOB_WORKER].tasks[1], "10.0.0.2", 2223);
    expect_addr(&c.jobs[JOB_WORKER].tasks[2], "w3", 2222);
    assert_int_equal(c.jobs[JOB_CHIEF].n, 1);
    expect_addr(&c.jobs[JOB_CHIEF].tasks[0], "chief", 2224);
    expect_addr(cluster_self(&c), "10.0.0.2", 2223);
    cluster_spec_free(&c);
}

/* TensorFlow's documented TF_CONFIG for a parameter-server cluster. */
static const char *TF_CONFIG_PS =
    "{\n"
    "    \"cluster\": {\n"
    "        \"chief\": [\"host0:2222\"],\n"
    "        \"worker\": [\"host1:2222\", \"host2:2222\", \"host3:2222\"],\n"
    "        \"ps\": [\"host4:2222\", \"host5:2222\"]\n"
    "    },\n"
    "    \"task\": {\"type\": \"ps\", \"index\": 1},\n"
    "    \"environment\": \"cloud\"\n"
    "}\n";

static void test_tf_config_only(void **state)
{
    (void)state;
    cluster_input in = none("ps");
    in.tf_config = TF_CONFIG_PS;
    cluster_spec c;
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_PS);
    assert_int_equal(c.task_index, 1);
    assert_int_equal(c.jobs[JOB_CHIEF].n, 1);
    expect_addr(&c.jobs[JOB_CHIEF].tasks[0], "host0", 2222);
    assert_int_equal(c.jobs[JOB_WORKER].n, 3);
    expect_addr(&c.jobs[JOB_WORKER].tasks[0], "host1", 2222);
    expect_addr(&c.jobs[JOB_WORKER].tasks[2], "host3", 2222);
    assert_int_equal(c.jobs[JOB_PS].n, 2);
    expect_addr(&c.jobs[JOB_PS].tasks[0], "host4", 2222);
    expect_addr(&c.jobs[JOB_PS].tasks[1], "host5", 2222);
    assert_int_equal(c.jobs[JOB_EVALUATOR].n, 0);
    expect_addr(cluster_self(&c), "host5", 2222);
    cluster_spec_free(&c);

    /* the chief of the same cluster */
    in.tf_config = "{\"cluster\": {\"chief\": [\"host0:2222\"], \"worker\": [\"host1:2222\"],"
                   " \"ps\": [\"host4:2222\"]}, \"task\": {\"type\": \"chief\", \"index\": 0}}";
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_CHIEF);
    expect_addr(cluster_self(&c), "host0", 2222);
    cluster_spec_free(&c);

    /* the evaluator is not in the cluster (as TensorFlow's docs show it) */
    in.tf_config = "{\"cluster\": {\"chief\": [\"host0:2222\"], \"worker\": [\"host1:2222\"],"
                   " \"ps\": [\"host4:2222\"]}, \"task\": {\"type\": \"evaluator\", \"index\": 0}}";
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_EVALUATOR);
    assert_int_equal(c.task_index, 0);
    assert_null(cluster_self(&c));
    cluster_spec_free(&c);

    /* ... or listed in it */
    in.tf_config = "{\"cluster\": {\"chief\": [\"host0:2222\"], \"worker\": [\"host1:2222\"],"
                   " \"ps\": [\"host4:2222\"], \"evaluator\": [\"host6:2222\"]},"
                   " \"task\": {\"type\": \"evaluator\", \"index\": 0}}";
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_EVALUATOR);
    assert_int_equal(c.jobs[JOB_EVALUATOR].n, 1);
    expect_addr(cluster_self(&c), "host6", 2222);
    cluster_spec_free(&c);

    /* no task: the default job, index 0 */
    in.tf_config = "{\"cluster\": {\"ps\": [\"a:1\", \"b:2\"]}}";
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_PS);
    expect_addr(cluster_self(&c), "a", 1);
    cluster_spec_free(&c);
}

static void test_flags_override_tf_config(void **state)
{
    (void)state;
    cluster_input in = none("ps");
    in.tf_config = TF_CONFIG_PS; /* says ps 1 of host4, host5 */
    in.job_name = "worker";
    in.task_index = 2;
    in.ps_hosts = "p0:3000";
    cluster_spec c;
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_WORKER);
    assert_int_equal(c.task_index, 2);
    /* --ps_hosts replaced the TF_CONFIG list */
    assert_int_equal(c.jobs[JOB_PS].n, 1);
    expect_addr(&c.jobs[JOB_PS].tasks[0], "p0", 3000);
    /* the rest still from TF_CONFIG */
    assert_int_equal(c.jobs[JOB_WORKER].n, 3);
    assert_int_equal(c.jobs[JOB_CHIEF].n, 1);
    expect_addr(cluster_self(&c), "host3", 2222);
    cluster_spec_free(&c);

    /* only the index from a flag */
    in = none("ps");
    in.tf_config = TF_CONFIG_PS;
    in.task_index = 0;
    build_ok(&in, &c);
    assert_int_equal(c.job, JOB_PS);
    assert_int_equal(c.task_index, 0);
    expect_addr(cluster_self(&c), "host4", 2222);
    cluster_spec_free(&c);

    /* --worker_hosts replaces TF_CONFIG's workers */
    in = none("ps");
    in.tf_config = TF_CONFIG_PS;
    in.worker_hosts = "wa:1,wb:2";
    build_ok(&in, &c);
    assert_int_equal(c.jobs[JOB_WORKER].n, 2);
    expect_addr(&c.jobs[JOB_WORKER].tasks[1], "wb", 2);
    cluster_spec_free(&c);
}

static void test_errors(void **state)
{
    (void)state;
    cluster_input in = none("ps");
    in.job_name = "master";
    build_fails(&in, "unknown job name");
    in = none(NULL);
    build_fails(&in, "no job at all");

    in = none("ps");
    in.task_index = 1; /* only localhost:2222 */
    build_fails(&in, "index 1 of 1 ps task");
    in.ps_hosts = "a:1,b:2";
    in.task_index = 2;
    build_fails(&in, "index 2 of 2");

    /* malformed host:port lists */
    const char *bad_lists[] = {
        "host:",          /* no port digits */
        "host:x",         /* port not a number */
        "host:22x",       /* trailing garbage */
        "host:0",         /* port 0 */
        "host:65536",     /* one past the last port */
        "host:70000",     /* port 70000 */
        "host:-1",        /* negative port */
        "",               /* empty list */
        "a:1,,b:2",       /* empty entry */
        "a:1,",           /* trailing comma */
        ",a:1",           /* leading comma */
        ":2222",          /* empty host */
        "ho st:1",        /* bad host character */
        "a:1:2",          /* two colons without brackets */
        "[::1",           /* unterminated bracket */
        "[]:1",           /* empty IPv6 literal */
        "[::1]2222",      /* missing ':' after ']' */
        "[::1]:",         /* no port digits */
        "[::1]:0",        /* port 0 */
        "[fe80::1%eth0]:1", /* not an IPv6 literal character */
        "a:1,a:1",        /* the same address twice */
        "h1",             /* no port (issue 37): host:port, as the docs say */
        "a:1,h1",         /* no port, the second entry */
        "[::1]",          /* no port after an IPv6 literal */
    };
    for (size_t i = 0; i < sizeof(bad_lists) / sizeof(bad_lists[0]); i++) {
        in = none("ps");
        in.ps_hosts = bad_lists[i];
        build_fails(&in, bad_lists[i]);
    }
    /* an address shared between jobs */
    in = none("ps");
    in.ps_hosts = "h:1";
    in.worker_hosts = "h:1";
    build_fails(&in, "ps and worker on one address");
    /* two chiefs */
    in = none("ps");
    in.chief_hosts = "c1:1,c2:1";
    build_fails(&in, "two chiefs");

    /* TF_CONFIG errors */
    const char *bad_tf[] = {
        "{",                                                           /* bad JSON */
        "{\"cluster\": {\"ps\": [\"a:1\"]}",                           /* bad JSON */
        "not json",
        "[]",                                                          /* not an object */
        "{\"cluster\": []}",                                           /* cluster not an object */
        "{\"cluster\": {\"ps\": \"a:1\"}}",                            /* job not a list */
        "{\"cluster\": {\"ps\": [1]}}",                                /* entry not a string */
        "{\"cluster\": {\"ps\": [\"a:0\"]}}",                          /* port 0 */
        "{\"cluster\": {\"ps\": [\"a:1\"], \"master\": [\"m:1\"]}}",   /* unknown job */
        "{\"cluster\": {\"ps\": [\"a:1\"]}, \"task\": {\"type\": \"ps\", \"index\": -1}}",
        "{\"cluster\": {\"ps\": [\"a:1\"]}, \"task\": {\"type\": \"ps\", \"index\": 1}}",
        "{\"cluster\": {\"ps\": [\"a:1\"]}, \"task\": {\"type\": \"ps\", \"index\": \"0\"}}",
        "{\"cluster\": {\"ps\": [\"a:1\"]}, \"task\": {\"type\": 3, \"index\": 0}}",
        "{\"cluster\": {\"ps\": [\"a:1\"]}, \"task\": {\"type\": \"master\", \"index\": 0}}",
        /* task type not in the cluster */
        "{\"cluster\": {\"ps\": [\"a:1\"]}, \"task\": {\"type\": \"worker\", \"index\": 0}}",
        "{\"cluster\": {\"ps\": [\"a:1\"]}, \"task\": {\"type\": \"chief\", \"index\": 0}}",
        /* a TF_CONFIG without ps does not fall back to localhost for psd */
        "{\"cluster\": {\"worker\": [\"w:1\"]}}",
        /* duplicate keys */
        "{\"cluster\": {\"ps\": [\"a:1\"], \"ps\": [\"b:1\"]}}",
        /* an entry without a port (issue 37), in any job */
        "{\"cluster\": {\"ps\": [\"h1\"]}, \"task\": {\"type\": \"ps\", \"index\": 0}}",
        "{\"cluster\": {\"ps\": [\"a:1\"], \"worker\": [\"w:2\", \"w3\"]}}",
        "{\"cluster\": {\"ps\": [\"[::1]\"]}}",
    };
    for (size_t i = 0; i < sizeof(bad_tf) / sizeof(bad_tf[0]); i++) {
        in = none("ps");
        in.tf_config = bad_tf[i];
        build_fails(&in, bad_tf[i]);
    }
}

/* cluster.h: "NULL / -1 mean 'not given'". Any other negative index is a given,
 * invalid index (psd --task_index=-3) and must be refused, not read as 0. */
static void test_negative_flag_index(void **state)
{
    (void)state;
    cluster_input in = none("ps");
    in.task_index = -3;
    build_fails(&in, "--task_index=-3");
    in = none("ps");
    in.ps_hosts = "a:1,b:2";
    in.task_index = -2;
    build_fails(&in, "--task_index=-2 with two ps tasks");
}

static void test_parse_addr(void **state)
{
    (void)state;
    cluster_addr a;
    char err[256];
    assert_int_equal(cluster_parse_addr("[::1]:2222", &a, err, sizeof(err)), 0);
    expect_addr(&a, "::1", 2222);
    assert_int_equal(cluster_parse_addr("[2001:db8::a:B]:65535", &a, err, sizeof(err)), 0);
    expect_addr(&a, "2001:db8::a:B", 65535);
    assert_int_equal(cluster_parse_addr("[::ffff:127.0.0.1]:1", &a, err, sizeof(err)), 0);
    expect_addr(&a, "::ffff:127.0.0.1", 1);
    assert_int_equal(cluster_parse_addr("127.0.0.1:80", &a, err, sizeof(err)), 0);
    expect_addr(&a, "127.0.0.1", 80);
    assert_int_equal(cluster_parse_addr("my-host_1.local:8080", &a, err, sizeof(err)), 0);
    expect_addr(&a, "my-host_1.local", 8080);
    assert_int_equal(cluster_parse_addr("h:007", &a, err, sizeof(err)), 0);
    expect_addr(&a, "h", 7);

    /* a 255-character host fits, 256 does not */
    char host[300];
    memset(host, 'h', 255);
    strcpy(host + 255, ":1");
    assert_int_equal(cluster_parse_addr(host, &a, err, sizeof(err)), 0);
    assert_int_equal(strlen(a.host), 255);
    memset(host, 'h', 256);
    strcpy(host + 256, ":1");
    assert_int_equal(cluster_parse_addr(host, &a, err, sizeof(err)), -1);

    assert_int_equal(cluster_parse_addr(NULL, &a, err, sizeof(err)), -1);
    assert_int_equal(cluster_parse_addr("", &a, err, sizeof(err)), -1);
    assert_int_equal(cluster_parse_addr("::1:2222", &a, err, sizeof(err)), -1);
    assert_int_equal(cluster_parse_addr("h:99999999999999999999", &a, err, sizeof(err)), -1);
    assert_int_equal(cluster_parse_addr("h: 1", &a, err, sizeof(err)), -1);

    /* an IPv6 cluster end to end */
    cluster_input in = none("ps");
    in.ps_hosts = "[::1]:2222,[::1]:2223";
    in.task_index = 1;
    cluster_spec c;
    build_ok(&in, &c);
    expect_addr(cluster_self(&c), "::1", 2223);
    cluster_spec_free(&c);
}

static void test_job_names_and_self(void **state)
{
    (void)state;
    assert_string_equal(cluster_job_name(JOB_PS), "ps");
    assert_string_equal(cluster_job_name(JOB_WORKER), "worker");
    assert_string_equal(cluster_job_name(JOB_CHIEF), "chief");
    assert_string_equal(cluster_job_name(JOB_EVALUATOR), "evaluator");
    assert_int_equal(cluster_job_from_name("ps"), JOB_PS);
    assert_int_equal(cluster_job_from_name("worker"), JOB_WORKER);
    assert_int_equal(cluster_job_from_name("chief"), JOB_CHIEF);
    assert_int_equal(cluster_job_from_name("evaluator"), JOB_EVALUATOR);
    assert_int_equal(cluster_job_from_name("master"), JOB_COUNT);
    assert_int_equal(cluster_job_from_name("PS"), JOB_COUNT);
    assert_int_equal(cluster_job_from_name(""), JOB_COUNT);
    assert_int_equal(cluster_job_from_name(NULL), JOB_COUNT);

    /* cluster_self on hand-made specs */
    cluster_addr addrs[2] = {{"x", 1}, {"y", 2}};
    cluster_spec c;
    memset(&c, 0, sizeof(c));
    c.jobs[JOB_WORKER].n = 2;
    c.jobs[JOB_WORKER].tasks = addrs;
    c.job = JOB_WORKER;
    c.task_index = 1;
    assert_ptr_equal(cluster_self(&c), &addrs[1]);
    c.task_index = 2;
    assert_null(cluster_self(&c));
    c.job = JOB_EVALUATOR;
    c.task_index = 0;
    assert_null(cluster_self(&c));
    c.job = JOB_COUNT;
    assert_null(cluster_self(&c));
}

/* issue 37: an address without a port is refused alike from --ps_hosts and
 * from TF_CONFIG, with a message naming the entry and what is wanted */
static void test_no_port_names_the_entry(void **state)
{
    (void)state;
    cluster_spec c;
    char err[512] = "";
    cluster_input in = none("ps");
    in.tf_config = "{\"cluster\":{\"ps\":[\"h1\"],\"worker\":[\"w:1\"]},\"task\":{\"type\":\"ps\",\"index\":0}}";
    assert_int_equal(cluster_spec_build(&in, &c, err, sizeof(err)), -1);
    assert_string_equal(err, "TF_CONFIG: cluster.ps[0]: malformed address 'h1': no port (want host:port)");
    in = none("ps");
    in.ps_hosts = "a:1,h1";
    assert_int_equal(cluster_spec_build(&in, &c, err, sizeof(err)), -1);
    assert_string_equal(err, "--ps_hosts: malformed address 'h1': no port (want host:port)");
    in = none("worker");
    in.worker_hosts = "[::1]";
    assert_int_equal(cluster_spec_build(&in, &c, err, sizeof(err)), -1);
    assert_string_equal(err, "--worker_hosts: malformed address '[::1]': no port (want [v6]:port)");
}

/* issue 37: the ps job from the default is marked so (workerd's wait says
 * so), and a task that needs no ps (the ring) gets no default ps, so that
 * localhost:2222 may be its own address */
static void test_default_ps(void **state)
{
    (void)state;
    cluster_spec c;
    cluster_input in = none("worker");
    in.worker_hosts = "localhost:2223";
    build_ok(&in, &c);
    assert_int_equal(c.ps_default, 1);
    expect_addr(&c.jobs[JOB_PS].tasks[0], "localhost", 2222);
    cluster_spec_free(&c);

    in.ps_hosts = "localhost:2222"; /* the same address, given */
    build_ok(&in, &c);
    assert_int_equal(c.ps_default, 0);
    cluster_spec_free(&c);

    in = none("worker");
    in.tf_config = "{\"cluster\":{\"ps\":[\"localhost:2222\"],\"worker\":[\"localhost:2223\"]}}";
    build_ok(&in, &c);
    assert_int_equal(c.ps_default, 0);
    cluster_spec_free(&c);

    /* a ring whose worker 0 is at the default ps's address */
    in = none("worker");
    in.worker_hosts = "localhost:2222,localhost:2223";
    build_fails(&in, "worker 0 at the default ps's address, with a ps");
    in.no_default_ps = 1;
    build_ok(&in, &c);
    assert_int_equal(c.jobs[JOB_PS].n, 0);
    assert_int_equal(c.ps_default, 0);
    expect_addr(cluster_self(&c), "localhost", 2222);
    cluster_spec_free(&c);
    /* a ps list given is still the cluster's, and still checked */
    in.ps_hosts = "localhost:2223";
    build_fails(&in, "a given ps on a worker's address");
    in.ps_hosts = "h1";
    build_fails(&in, "a given ps without a port");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_flags_only),
        cmocka_unit_test(test_tf_config_only),
        cmocka_unit_test(test_flags_override_tf_config),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_negative_flag_index),
        cmocka_unit_test(test_parse_addr),
        cmocka_unit_test(test_job_names_and_self),
        cmocka_unit_test(test_no_port_names_the_entry),
        cmocka_unit_test(test_default_ps),
    };
    return cmocka_run_group_tests_name("cluster", tests, NULL, NULL);
}
