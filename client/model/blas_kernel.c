/* blas_kernel.c - choosing OpenBLAS's kernel set from what the CPU can run.
 *
 * OpenBLAS (DYNAMIC_ARCH) picks its kernels from the CPU's model when the
 * library loads; a model it does not know (a cloud VM reporting a generic
 * "Intel(R) Xeon(R) Processor") gets Prescott, SSE3, several times slower
 * than the AVX-512 or AVX2 kernels the CPU runs. It reads OPENBLAS_CORETYPE at
 * load time, before main, so a better choice takes a re-exec with it set.
 * Each kernel in use is checked by a small sgemm against a C product first:
 * some builds compute wrong results on some processors. See blas_kernel.h. */
#include "model/blas_kernel.h"

#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
/* Under valgrind: its core preloads vgpreload_core-<arch>.so into every
 * program it runs (LD_PRELOAD), which needs no header of valgrind's at build
 * time (the container images build without the valgrind package). */
static int under_valgrind(void)
{
    const char *pre = getenv("LD_PRELOAD");
    return pre && strstr(pre, "vgpreload_core") != NULL;
}

#define MAX_TRIES 8
#define NAME_LEN 32

/* The reason for the start-up line; process-wide, like the kernel itself. */
static char reason[768] = "not checked (blas_kernel_choose was not called)";

static const struct {
    const char *name;
    int cls;
} core_classes[] = {
    {"SkylakeX", 3},    {"CooperLake", 3},  {"SapphireRapids", 3}, {"Haswell", 2},
    {"Zen", 2},         {"Sandybridge", 1}, {"Bulldozer", 1},      {"Piledriver", 1},
    {"Steamroller", 1}, {"Excavator", 1},
};

int blas_kernel_class(const char *core)
{
    for (size_t i = 0; core && i < sizeof(core_classes) / sizeof(core_classes[0]); i++)
        if (strcasecmp(core, core_classes[i].name) == 0)
            return core_classes[i].cls;
    return 0;
}

void blas_cpu_detect(blas_cpu *cpu)
{
    cpu->cls = 0;
    snprintf(cpu->desc, sizeof(cpu->desc), "no x86 cpuid");
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d, b7 = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) {
        snprintf(cpu->desc, sizeof(cpu->desc), "cpuid leaf 1 missing");
        return;
    }
    int fma = (c >> 12) & 1, avx = (c >> 28) & 1, osxsave = (c >> 27) & 1;
    uint64_t xcr0 = 0;
    if (osxsave) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((uint64_t)hi << 32) | lo;
    }
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b7, c, d);
    }
    int avx2 = (b7 >> 5) & 1;
    int avx512 = ((b7 >> 16) & 1) && ((b7 >> 17) & 1) && ((b7 >> 30) & 1) && ((b7 >> 31) & 1);
    int ymm_on = (xcr0 & 0x6) == 0x6;     /* XCR0 bits 1, 2: SSE, AVX state */
    int zmm_on = (xcr0 & 0xe6) == 0xe6;   /* and 5, 6, 7: opmask, ZMM_Hi256, Hi16_ZMM */
    const unsigned long long x = (unsigned long long)xcr0;
    if (avx512 && ymm_on && zmm_on)
        cpu->cls = 3;
    else if (avx2 && fma && avx && ymm_on)
        cpu->cls = 2;
    else if (avx && ymm_on)
        cpu->cls = 1;
    if (cpu->cls == 3)
        snprintf(cpu->desc, sizeof(cpu->desc), "AVX-512F/BW/DQ/VL, ZMM state on");
    else if (cpu->cls == 2 && avx512)
        snprintf(cpu->desc, sizeof(cpu->desc), "AVX2+FMA; AVX-512 in cpuid, but the OS does not save ZMM state "
                                               "(XCR0 %#llx)", x);
    else if (cpu->cls == 2)
        snprintf(cpu->desc, sizeof(cpu->desc), "AVX2+FMA, no AVX-512");
    else if (cpu->cls == 1)
        snprintf(cpu->desc, sizeof(cpu->desc), "AVX, no AVX2+FMA");
    else if (avx)
        snprintf(cpu->desc, sizeof(cpu->desc), "AVX in cpuid, but the OS does not save YMM state (XCR0 %#llx)", x);
    else
        snprintf(cpu->desc, sizeof(cpu->desc), "no AVX");
#endif
}

static int add_name(const char **out, int n, int max, const char *name)
{
    for (int i = 0; i < n; i++)
        if (strcasecmp(out[i], name) == 0)
            return n;
    if (n < max)
        out[n++] = name;
    return n;
}

int blas_kernel_candidates(int cpu_cls, const char *own, const char **out, int max)
{
    int n = 0;
    if (own && *own && blas_kernel_class(own) >= cpu_cls)
        n = add_name(out, n, max, own);
    if (cpu_cls >= 3)
        n = add_name(out, n, max, "SkylakeX");
    if (cpu_cls >= 2)
        n = add_name(out, n, max, "Haswell");
    if (own && *own)
        n = add_name(out, n, max, own);
    return n;
}

/* op(A) is M x K, op(B) K x N, row-major as the backend stores them. */
static double check_gemm(int ta, int tb, int M, int N, int K, int spoil, uint64_t *seed)
{
    float *A = malloc(sizeof(float) * (size_t)M * K), *B = malloc(sizeof(float) * (size_t)K * N);
    float *C = malloc(sizeof(float) * (size_t)M * N);
    double worst = -1;
    if (!A || !B || !C)
        goto out;
    for (int i = 0; i < M * K; i++) {
        *seed = *seed * 6364136223846793005ULL + 1442695040888963407ULL;
        A[i] = (float)((double)(*seed >> 40) / (double)(1 << 23) - 1.0); /* [-1, 1) */
    }
    for (int i = 0; i < K * N; i++) {
        *seed = *seed * 6364136223846793005ULL + 1442695040888963407ULL;
        B[i] = (float)((double)(*seed >> 40) / (double)(1 << 23) - 1.0);
    }
    for (int i = 0; i < M * N; i++)
        C[i] = 1e30f; /* beta 0: whatever C held must not show */
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K,
                1.0f, A, ta ? M : K, B, tb ? K : N, 0.0f, C, N);
    if (spoil)
        C[(M / 2) * N + N / 2] += 1.0f + fabsf(C[(M / 2) * N + N / 2]);
    worst = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0, mag = 1e-30;
            for (int k = 0; k < K; k++) {
                double a = ta ? A[(size_t)k * M + i] : A[(size_t)i * K + k];
                double b = tb ? B[(size_t)j * K + k] : B[(size_t)k * N + j];
                s += a * b;
                mag += fabs(a * b);
            }
            double e = fabs((double)C[(size_t)i * N + j] - s) / mag;
            if (!(e <= worst)) /* NaN counts as the worst */
                worst = isnan(e) ? INFINITY : e;
        }
out:
    free(A);
    free(B);
    free(C);
    return worst;
}

double blas_kernel_selftest(int spoil)
{
    /* 67 x 16 x 133: OpenBLAS's small-matrix path (N 16, MNK < 1e6);
     * 100 x 72 x 260: its packed, blocked path; odd sizes leave edges */
    static const int sizes[2][3] = {{67, 16, 133}, {100, 72, 260}};
    static const int forms[3][2] = {{0, 0}, {1, 0}, {0, 1}};
    uint64_t seed = 20;
    double worst = 0;
    for (int s = 0; s < 2; s++)
        for (int f = 0; f < 3; f++) {
            double e = check_gemm(forms[f][0], forms[f][1], sizes[s][0], sizes[s][1], sizes[s][2],
                                  spoil && s == 1 && f == 0, &seed);
            if (e < 0)
                return -1;
            if (e > worst)
                worst = e;
        }
    return worst;
}

const char *blas_kernel_name(void)
{
    return openblas_get_corename();
}

const char *blas_kernel_reason(void)
{
    return reason;
}

/* Listed in the test hook? */
static int hooked(const char *core)
{
    const char *list = getenv(BLAS_KERNEL_FAIL_HOOK);
    size_t n = strlen(core);
    for (const char *p = list; p && *p;) {
        size_t len = strcspn(p, ",");
        if (len == n && strncasecmp(p, core, n) == 0)
            return 1;
        p += len + (p[len] == ',');
    }
    return 0;
}

/* The self-test of the kernel now loaded: its error, -1 out of memory. */
static double test_loaded(void)
{
    return blas_kernel_selftest(hooked(openblas_get_corename()));
}

typedef struct tried {
    char name[NAME_LEN];
    double err; /* < 0: not tested (the current one) */
} tried;

typedef struct marker {
    char own[NAME_LEN];
    tried t[MAX_TRIES];
    int n; /* t[n - 1] is the current one */
} marker;

static int name_ok(const char *s, size_t len)
{
    if (len == 0 || len >= NAME_LEN)
        return 0;
    for (size_t i = 0; i < len; i++)
        if (!(s[i] == '_' || (s[i] >= '0' && s[i] <= '9') || ((s[i] | 32) >= 'a' && (s[i] | 32) <= 'z')))
            return 0;
    return 1;
}

/* "OWN|NAME:ERR,...,CURRENT" into m; 0, or -1 when malformed. */
static int marker_parse(const char *s, marker *m)
{
    memset(m, 0, sizeof(*m));
    const char *bar = s ? strchr(s, '|') : NULL;
    if (!bar || !name_ok(s, (size_t)(bar - s)))
        return -1;
    memcpy(m->own, s, (size_t)(bar - s));
    for (const char *p = bar + 1; *p;) {
        size_t len = strcspn(p, ",");
        size_t nl = strcspn(p, ":,");
        if (m->n == MAX_TRIES || !name_ok(p, nl))
            return -1;
        memcpy(m->t[m->n].name, p, nl);
        m->t[m->n].err = -1;
        if (nl < len) {
            char num[32];
            size_t el = len - nl - 1;
            if (el == 0 || el >= sizeof(num))
                return -1;
            memcpy(num, p + nl + 1, el);
            num[el] = '\0';
            char *end;
            m->t[m->n].err = strtod(num, &end);
            if (*end || !(m->t[m->n].err >= 0))
                return -1;
        }
        m->n++;
        p += len + (p[len] == ',');
    }
    /* every entry but the last failed; the last is the current one */
    for (int i = 0; i < m->n; i++)
        if ((i < m->n - 1) != (m->t[i].err >= 0))
            return -1;
    return m->n ? 0 : -1;
}

static void marker_format(const marker *m, char *buf, size_t len)
{
    size_t used = (size_t)snprintf(buf, len, "%s|", m->own);
    for (int i = 0; i < m->n && used < len; i++) {
        if (m->t[i].err >= 0)
            used += (size_t)snprintf(buf + used, len - used, "%s%s:%.1e", i ? "," : "", m->t[i].name,
                                     m->t[i].err);
        else
            used += (size_t)snprintf(buf + used, len - used, "%s%s", i ? "," : "", m->t[i].name);
    }
}

static int was_tried(const marker *m, const char *name)
{
    for (int i = 0; i < m->n; i++)
        if (strcasecmp(m->t[i].name, name) == 0)
            return 1;
    return 0;
}

static void append(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void append(const char *fmt, ...)
{
    size_t used = strlen(reason);
    va_list ap;
    va_start(ap, fmt);
    if (used < sizeof(reason))
        vsnprintf(reason + used, sizeof(reason) - used, fmt, ap);
    va_end(ap);
}

static const char *prog_name(char **argv)
{
    const char *p = argv && argv[0] ? strrchr(argv[0], '/') : NULL;
    return p ? p + 1 : argv && argv[0] ? argv[0] : "restps";
}

/* The user's OPENBLAS_CORETYPE: used as it is; the line says how it went. */
static int choose_user(const char *prog, const char *env, const blas_cpu *cpu)
{
    const char *now = openblas_get_corename();
    if (blas_kernel_class(now) > cpu->cls)
        fprintf(stderr, "%s: blas: OPENBLAS_CORETYPE=%s asks for kernels this cpu or its OS cannot run "
                        "(%s): expect an illegal instruction\n",
                prog, env, cpu->desc);
    fflush(stderr);
    double e = test_loaded();
    if (*env)
        snprintf(reason, sizeof(reason), "kernel: OPENBLAS_CORETYPE=%s set by the user", env);
    else
        snprintf(reason, sizeof(reason), "kernel: OPENBLAS_CORETYPE set empty by the user");
    if (strcasecmp(env, now) != 0)
        append(" (OpenBLAS has no kernel of that name and took %s)", now);
    if (e >= 0 && e <= BLAS_KERNEL_TOL) {
        append("; sgemm self-test passed");
    } else {
        append("; sgemm self-test FAILED (off by %.1e): used anyway, the user's choice wins", e);
        fprintf(stderr, "%s: blas: OpenBLAS %s (OPENBLAS_CORETYPE=%s) failed the sgemm self-test (off by "
                        "%.1e): using it anyway, as set; unset OPENBLAS_CORETYPE to let restps choose\n",
                prog, now, env, e);
    }
    return 0;
}

int blas_kernel_choose(char **argv, char *err, size_t errlen)
{
    const char *prog = prog_name(argv);
    blas_cpu cpu;
    blas_cpu_detect(&cpu);
    const char *env = getenv("OPENBLAS_CORETYPE"), *now = openblas_get_corename();
    marker m;
    int ours = env && marker_parse(getenv(BLAS_KERNEL_MARKER), &m) == 0 &&
               strcasecmp(env, m.t[m.n - 1].name) == 0;
    if (env && !ours)
        return choose_user(prog, env, &cpu);
    const int dynamic = strstr(openblas_get_config(), "DYNAMIC_ARCH") != NULL;
    const int valgrind = under_valgrind();
    const char *cands[MAX_TRIES];
    int nc = 1;
    cands[0] = now; /* without a re-exec the kernel loaded is the only candidate */
    if (!ours) {
        memset(&m, 0, sizeof(m));
        snprintf(m.own, sizeof(m.own), "%s", now);
    }
    if (dynamic && !valgrind)
        nc = blas_kernel_candidates(cpu.cls, m.own, cands, MAX_TRIES);
    if (!ours) { /* the first image: start with the best candidate */
        snprintf(m.t[0].name, NAME_LEN, "%s", cands[0]);
        m.t[0].err = -1;
        m.n = 1;
    }
    /* the current candidate (the last in m) is the kernel loaded: in the
     * image restps re-executed for it, whatever OpenBLAS made of the name */
    int loaded = ours || strcasecmp(m.t[0].name, now) == 0;
    char why_not[160] = "";
    for (;;) {
        tried *cur = &m.t[m.n - 1];
        if (loaded) {
            double e = test_loaded();
            if (e < 0)
                return snprintf(err, errlen, "blas: out of memory for the sgemm self-test"), -1;
            if (e <= BLAS_KERNEL_TOL)
                break;
            cur->err = e;
            const char *next = NULL;
            for (int i = 0; i < nc && !next; i++)
                if (!was_tried(&m, cands[i]))
                    next = cands[i];
            if (!next || m.n == MAX_TRIES || why_not[0]) {
                size_t used = (size_t)snprintf(err, errlen, "blas: no OpenBLAS kernel passed the sgemm self-test (");
                for (int i = 0; i < m.n && used < errlen; i++)
                    used += (size_t)snprintf(err + used, errlen - used, "%s%s off by %.1e", i ? ", " : "",
                                             m.t[i].name, m.t[i].err);
                if (used < errlen)
                    snprintf(err + used, errlen - used, "%s%s); set OPENBLAS_CORETYPE to use one anyway",
                             why_not[0] ? "; " : "", why_not);
                return -1;
            }
            cur = &m.t[m.n++];
            snprintf(cur->name, NAME_LEN, "%s", next);
            cur->err = -1;
        }
        /* the current candidate is not loaded: a fresh image with it */
        char buf[512];
        marker_format(&m, buf, sizeof(buf));
        if (setenv("OPENBLAS_CORETYPE", cur->name, 1) == 0 && setenv(BLAS_KERNEL_MARKER, buf, 1) == 0) {
            fflush(stdout);
            fflush(stderr);
            execv("/proc/self/exe", argv);
        }
        snprintf(why_not, sizeof(why_not), "re-executing with OPENBLAS_CORETYPE=%s failed: %s", cur->name,
                 strerror(errno));
        m.n--;
        if (m.n > 0) { /* the kernel loaded failed already: nothing left to try */
            loaded = 1;
            m.t[m.n - 1].err = -1;
            if (ours)
                setenv("OPENBLAS_CORETYPE", m.t[m.n - 1].name, 1);
            continue; /* tests it again, fails, and reports */
        }
        /* the first image: go on with the kernel loaded, once it passes */
        unsetenv("OPENBLAS_CORETYPE");
        unsetenv(BLAS_KERNEL_MARKER);
        snprintf(m.t[0].name, NAME_LEN, "%s", now);
        m.t[0].err = -1;
        m.n = 1;
        loaded = 1;
    }
    /* passed: say which and why */
    if (strcasecmp(now, m.own) != 0)
        snprintf(reason, sizeof(reason), "kernel: restps's choice from cpuid (%s), not OpenBLAS's %s",
                 cpu.desc, m.own);
    else if (m.n > 1)
        snprintf(reason, sizeof(reason), "kernel: OpenBLAS's own choice, restps's from cpuid (%s) having failed",
                 cpu.desc);
    else
        snprintf(reason, sizeof(reason), "kernel: OpenBLAS's own choice%s (cpuid: %s)",
                 blas_kernel_class(now) >= cpu.cls ? ", the best the cpu runs" : "", cpu.desc);
    if (!dynamic)
        append("; this OpenBLAS has one kernel set (no DYNAMIC_ARCH)");
    else if (valgrind)
        append("; under valgrind, which has no AVX-512: not re-executed");
    if (why_not[0])
        append("; %s", why_not);
    if (strcasecmp(m.t[m.n - 1].name, now) != 0)
        append("; asked OpenBLAS for %s", m.t[m.n - 1].name);
    for (int i = 0; i < m.n - 1; i++)
        append("; %s refused: its sgemm self-test was off by %.1e", m.t[i].name, m.t[i].err);
    append("; sgemm self-test passed");
    return 0;
}
