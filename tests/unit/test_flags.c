/* test_flags.c - common/flags.c: --name=value / --name value, every type,
 * errors, --help, and the help text. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flags.h"

typedef struct vals {
    const char *name;
    int count;
    uint64_t max_bytes;
    float rate;
    int verbose;
} vals;

#define NFLAGS 5

static void table(flag *f, vals *v)
{
    v->name = "default";
    v->count = 7;
    v->max_bytes = 1024;
    v->rate = 0.25f;
    v->verbose = 0;
    flag t[NFLAGS] = {
        {"job_name", FLAG_STRING, &v->name, "the job (default \"default\")", 0},
        {"count", FLAG_INT, &v->count, "how many (default 7)", 0},
        {"max_bytes", FLAG_U64, &v->max_bytes, "largest body (default 1024)", 0},
        {"rate", FLAG_FLOAT, &v->rate, "learning rate (default 0.25)", 0},
        {"verbose", FLAG_BOOL, &v->verbose, "say more (default false)", 0},
    };
    memcpy(f, t, sizeof(t));
}

/* Parse a NULL-terminated argument list (argv[0] added). */
static int parse(flag *f, char *err, size_t errlen, ...)
{
    char *argv[32] = {"prog"};
    int argc = 1;
    va_list ap;
    va_start(ap, errlen);
    for (char *a; (a = va_arg(ap, char *)) != NULL;)
        argv[argc++] = a;
    va_end(ap);
    err[0] = '\0';
    return flags_parse(f, NFLAGS, argc, argv, err, errlen);
}

static void test_equals_form(void **state)
{
    (void)state;
    flag f[NFLAGS];
    vals v;
    char err[256];
    table(f, &v);
    assert_int_equal(parse(f, err, sizeof(err), "--job_name=ps", "--count=-42",
                           "--max_bytes=18446744073709551615", "--rate=0.5", "--verbose=true",
                           NULL),
                     0);
    assert_string_equal(v.name, "ps");
    assert_int_equal(v.count, -42);
    assert_true(v.max_bytes == UINT64_MAX);
    assert_true(v.rate == 0.5f);
    assert_int_equal(v.verbose, 1);
    for (int i = 0; i < NFLAGS; i++)
        assert_int_equal(f[i].given, 1);
    /* a value may itself hold '=' and be empty for a string */
    table(f, &v);
    assert_int_equal(parse(f, err, sizeof(err), "--job_name=a=b", NULL), 0);
    assert_string_equal(v.name, "a=b");
    assert_int_equal(parse(f, err, sizeof(err), "--job_name=", NULL), 0);
    assert_string_equal(v.name, "");
}

static void test_space_form(void **state)
{
    (void)state;
    flag f[NFLAGS];
    vals v;
    char err[256];
    table(f, &v);
    assert_int_equal(parse(f, err, sizeof(err), "--job_name", "worker", "--count", "3",
                           "--max_bytes", "0", "--rate", "-1.5e-3", NULL),
                     0);
    assert_string_equal(v.name, "worker");
    assert_int_equal(v.count, 3);
    assert_true(v.max_bytes == 0);
    assert_true(v.rate == -1.5e-3f);
    assert_int_equal(f[4].given, 0); /* verbose not given */
    assert_int_equal(v.verbose, 0);
    /* the later of two wins */
    table(f, &v);
    assert_int_equal(parse(f, err, sizeof(err), "--count=1", "--count", "2", NULL), 0);
    assert_int_equal(v.count, 2);
    /* nothing given: defaults untouched */
    table(f, &v);
    assert_int_equal(parse(f, err, sizeof(err), NULL), 0);
    assert_string_equal(v.name, "default");
    assert_int_equal(v.count, 7);
    assert_true(v.max_bytes == 1024);
    assert_true(v.rate == 0.25f);
    for (int i = 0; i < NFLAGS; i++)
        assert_int_equal(f[i].given, 0);
}

static void test_bool_forms(void **state)
{
    (void)state;
    flag f[NFLAGS];
    vals v;
    char err[256];
    const struct {
        const char *arg;
        int want;
    } ok[] = {
        {"--verbose", 1},       {"--verbose=true", 1}, {"--verbose=1", 1},
        {"--verbose=yes", 1},   {"--verbose=false", 0}, {"--verbose=0", 0},
        {"--verbose=no", 0},
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        table(f, &v);
        v.verbose = !ok[i].want; /* start from the opposite */
        if (parse(f, err, sizeof(err), (char *)ok[i].arg, NULL) != 0)
            fail_msg("%s: %s", ok[i].arg, err);
        assert_int_equal(v.verbose, ok[i].want);
        assert_int_equal(f[4].given, 1);
    }
    const char *bad[] = {"--verbose=maybe", "--verbose=", "--verbose=TRUE2", "--verbose=2"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        table(f, &v);
        assert_int_equal(parse(f, err, sizeof(err), (char *)bad[i], NULL), -1);
        assert_true(err[0] != '\0');
    }
    /* a bare bool does not take the next argument: "false" is a stray argument */
    table(f, &v);
    assert_int_equal(parse(f, err, sizeof(err), "--verbose", "false", NULL), -1);
    /* a bare bool followed by another flag */
    table(f, &v);
    assert_int_equal(parse(f, err, sizeof(err), "--verbose", "--count=5", NULL), 0);
    assert_int_equal(v.verbose, 1);
    assert_int_equal(v.count, 5);
}

/* Reports the caller's line (cmocka's _fail) for the XML report. */
static void expect_error_at(const char *file, int line, const char *what, ...)
{
    flag f[NFLAGS];
    vals v;
    char err[256] = "";
    table(f, &v);
    char *argv[32] = {"prog"};
    int argc = 1;
    va_list ap;
    va_start(ap, what);
    for (char *a; (a = va_arg(ap, char *)) != NULL;)
        argv[argc++] = a;
    va_end(ap);
    int rc = flags_parse(f, NFLAGS, argc, argv, err, sizeof(err));
    if (rc != -1 || err[0] == '\0') {
        print_error("%s: got %d, want -1 with a reason\n", what, rc);
        _fail(file, line);
    }
}
#define expect_error(...) expect_error_at(__FILE__, __LINE__, __VA_ARGS__)

static void test_errors(void **state)
{
    (void)state;
    /* bad ints */
    expect_error("int not a number", "--count=abc", NULL);
    expect_error("int empty", "--count=", NULL);
    expect_error("int trailing", "--count=12x", NULL);
    expect_error("int float", "--count=1.5", NULL);
    expect_error("int over", "--count=2147483648", NULL);
    expect_error("int way over", "--count=99999999999999999999", NULL);
    expect_error("int space form", "--count", "x", NULL);
    /* bad u64 */
    expect_error("u64 negative", "--max_bytes=-1", NULL);
    expect_error("u64 overflow", "--max_bytes=18446744073709551616", NULL);
    expect_error("u64 empty", "--max_bytes=", NULL);
    expect_error("u64 trailing", "--max_bytes=10k", NULL);
    /* bad floats */
    expect_error("float text", "--rate=fast", NULL);
    expect_error("float empty", "--rate=", NULL);
    expect_error("float inf", "--rate=inf", NULL);
    expect_error("float nan", "--rate=nan", NULL);
    expect_error("float overflow", "--rate=1e39", NULL);
    expect_error("float trailing", "--rate=0.5x", NULL);
    /* a missing value */
    expect_error("missing value", "--count", NULL);
    expect_error("missing value after others", "--rate=1", "--job_name", NULL);
    /* unknown flags */
    expect_error("unknown", "--nope", NULL);
    expect_error("unknown with value", "--nope=1", NULL);
    expect_error("prefix of a name", "--coun=1", NULL);
    expect_error("name plus suffix", "--counts=1", NULL);
    expect_error("case", "--COUNT=1", NULL);
    expect_error("bare --", "--", NULL);
    expect_error("single dash", "-count=1", NULL);
    /* stray arguments */
    expect_error("stray", "positional", NULL);
    expect_error("stray after flags", "--count=1", "extra", NULL);
    expect_error("stray dash", "-", NULL);
}

static void test_help(void **state)
{
    (void)state;
    flag f[NFLAGS];
    vals v;
    char err[256];
    table(f, &v);
    assert_int_equal(parse(f, err, sizeof(err), "--help", NULL), 1);
    assert_int_equal(parse(f, err, sizeof(err), "-h", NULL), 1);
    assert_int_equal(parse(f, err, sizeof(err), "--count=3", "--help", NULL), 1);
    /* --help wins even before a bad flag */
    assert_int_equal(parse(f, err, sizeof(err), "--help", "--nope", NULL), 1);
}

static void test_help_text(void **state)
{
    (void)state;
    flag f[NFLAGS];
    vals v;
    table(f, &v);
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    assert_non_null(mem);
    flags_help(mem, "usage: prog [flags]", f, NFLAGS);
    fclose(mem);
    assert_non_null(text);
    assert_true(strncmp(text, "usage: prog [flags]\n", 20) == 0);
    /* every flag is on a line of its own, with its help */
    const char *want_left[NFLAGS] = {"--job_name=S", "--count=N", "--max_bytes=N", "--rate=X",
                                     "--verbose"};
    for (int i = 0; i < NFLAGS; i++) {
        int found = 0;
        for (char *line = text; line && *line;) {
            char *nl = strchr(line, '\n');
            size_t ll = nl ? (size_t)(nl - line) : strlen(line);
            char buf[256];
            snprintf(buf, sizeof(buf), "%.*s", (int)ll, line);
            const char *p = buf + strspn(buf, " ");
            size_t wl = strlen(want_left[i]);
            if (strncmp(p, want_left[i], wl) == 0 && p[wl] == ' ' && strstr(p, f[i].help))
                found = 1;
            line = nl ? nl + 1 : NULL;
        }
        if (!found)
            fail_msg("help text lacks a line for %s:\n%s", want_left[i], text);
    }
    free(text);
}

static void test_get(void **state)
{
    (void)state;
    flag f[NFLAGS];
    vals v;
    table(f, &v);
    assert_ptr_equal(flags_get(f, NFLAGS, "rate"), &f[3]);
    assert_ptr_equal(flags_get(f, NFLAGS, "job_name"), &f[0]);
    assert_null(flags_get(f, NFLAGS, "rat"));
    assert_null(flags_get(f, NFLAGS, "nope"));
}

/* issue 37: an unknown flag's message carries one hint, with the nearest
 * known flag when one is close (workerd --trian_steps=5) */
static void parse_prog_at(const char *file, int line, const char *prog, const char *arg, const char *want)
{
    flag f[NFLAGS];
    vals v;
    char err[256] = "";
    table(f, &v);
    char *argv[] = {"prog", (char *)arg};
    int rc = prog ? flags_parse_prog(prog, f, NFLAGS, 2, argv, err, sizeof(err))
                  : flags_parse(f, NFLAGS, 2, argv, err, sizeof(err));
    if (rc != -1 || strcmp(err, want) != 0) {
        print_error("%s %s: got %d '%s', want -1 '%s'\n", prog ? prog : "(flags_parse)", arg, rc, err, want);
        _fail(file, line);
    }
}
#define parse_prog(...) parse_prog_at(__FILE__, __LINE__, __VA_ARGS__)

static void test_unknown_flag_suggests(void **state)
{
    (void)state;
    /* a swap, a letter missing, one too many, one wrong, a dash, case, two edits */
    parse_prog("workerd", "--job_nmae=ps", "unknown flag '--job_nmae' (did you mean --job_name? see workerd --help)");
    parse_prog("workerd", "--coun=1", "unknown flag '--coun' (did you mean --count? see workerd --help)");
    parse_prog("workerd", "--counts=1", "unknown flag '--counts' (did you mean --count? see workerd --help)");
    parse_prog("psd", "--rote=1", "unknown flag '--rote' (did you mean --rate? see psd --help)");
    parse_prog("psd", "--max-bytes=1", "unknown flag '--max-bytes' (did you mean --max_bytes? see psd --help)");
    parse_prog("psd", "--COUNT=1", "unknown flag '--COUNT' (did you mean --count? see psd --help)");
    parse_prog("psd", "--verbsoe", "unknown flag '--verbsoe' (did you mean --verbose? see psd --help)");
    parse_prog("psd", "--mx_byte=1", "unknown flag '--mx_byte' (did you mean --max_bytes? see psd --help)");
    /* nothing close: the hint alone, once */
    parse_prog("workerd", "--nope=1", "unknown flag '--nope' (see workerd --help)");
    parse_prog("workerd", "--job=ps", "unknown flag '--job' (see workerd --help)");
    parse_prog("workerd", "--xy", "unknown flag '--xy' (see workerd --help)");
    parse_prog("workerd", "--", "unknown flag '--' (see workerd --help)");
    parse_prog("workerd", "--max_bytes_of_the_body=1", "unknown flag '--max_bytes_of_the_body' (see workerd --help)");
    /* the other errors end with the hint too, once */
    parse_prog("psd", "--count=x", "--count: bad value 'x' (see psd --help)");
    parse_prog("psd", "--count", "--count needs a value (see psd --help)");
    /* flags_parse, without a program's name */
    parse_prog(NULL, "--trian=1", "unknown flag '--trian' (see --help)");
    parse_prog(NULL, "--rat=1", "unknown flag '--rat' (did you mean --rate? see --help)");
    parse_prog(NULL, "--count=x", "--count: bad value 'x'");

    flag f[NFLAGS];
    vals v;
    table(f, &v);
    assert_ptr_equal(flags_nearest(f, NFLAGS, "rat", 3), &f[3]);
    assert_ptr_equal(flags_nearest(f, NFLAGS, "rate=9", 4), &f[3]); /* only len bytes count */
    assert_ptr_equal(flags_nearest(f, NFLAGS, "job_name", 8), &f[0]);
    assert_null(flags_nearest(f, NFLAGS, "", 0));
    assert_null(flags_nearest(f, NFLAGS, "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz", 72));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equals_form),
        cmocka_unit_test(test_space_form),
        cmocka_unit_test(test_bool_forms),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_help),
        cmocka_unit_test(test_help_text),
        cmocka_unit_test(test_get),
        cmocka_unit_test(test_unknown_flag_suggests),
    };
    return cmocka_run_group_tests_name("flags", tests, NULL, NULL);
}
