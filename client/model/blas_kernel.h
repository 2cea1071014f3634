/* blas_kernel.h - which OpenBLAS kernel set (OPENBLAS_CORETYPE) the CPU
 * backend computes with: chosen from what the CPU and its OS can run (cpuid,
 * XGETBV), not from the CPU's model name, and checked by a small sgemm against
 * a plain C product before it is used. Every binary that computes calls
 * blas_kernel_choose first thing in main. */
#ifndef RESTPS_BLAS_KERNEL_H
#define RESTPS_BLAS_KERNEL_H

#include <stddef.h>

/* The environment variable restps sets beside OPENBLAS_CORETYPE when it
 * re-executes a program: "OWN|TRIED,...,CURRENT", OWN the kernel OpenBLAS
 * picked by itself, each failed one as NAME:ERROR, CURRENT the one
 * OPENBLAS_CORETYPE now names. It marks the value as restps's (not the
 * user's) and lists what was tried, so the chain never loops. */
#define BLAS_KERNEL_MARKER "RESTPS_BLAS_KERNEL"
/* Test hook: a comma-separated list of OpenBLAS kernel names whose sgemm
 * self-test is made to fail (its product is spoiled before the comparison). */
#define BLAS_KERNEL_FAIL_HOOK "RESTPS_BLAS_SELFTEST_FAIL"
/* The self-test's limit on |sgemm - exact| / sum_k |a_ik b_kj|, per element;
 * float32 rounding over K <= 260 terms stays below 2e-5. */
#define BLAS_KERNEL_TOL 1e-4

/* The ISA class a kernel set needs, or a CPU offers: 3 AVX-512 (F/BW/DQ/VL
 * with opmask and ZMM state saved by the OS), 2 AVX2+FMA (YMM state saved),
 * 1 AVX, 0 SSE or unknown. */
int blas_kernel_class(const char *core);

/* What this CPU and OS offer (cpuid leaves 1 and 7, XCR0): the class, and a
 * few words for the start-up line ("AVX-512F/BW/DQ/VL, ZMM state on"). */
typedef struct blas_cpu {
    int cls;
    char desc[160];
} blas_cpu;
void blas_cpu_detect(blas_cpu *cpu);

/* The kernels to try, best first, on a CPU of class cpu_cls where OpenBLAS
 * picked own by itself: own first when it is of the CPU's class already (it
 * knows the model: Zen, CooperLake, ...), then SkylakeX (class 3), Haswell
 * (class 2 or more), and own last. Distinct names; returns how many (<= max). */
int blas_kernel_candidates(int cpu_cls, const char *own, const char **out, int max);

/* The self-test: cblas_sgemm of the three forms the backend calls (A.B,
 * A^T.B, A.B^T; beta 0 over a C full of garbage), at two sizes (one that
 * OpenBLAS's small-matrix kernels take, one for its blocked path), against a
 * double-precision C product. Returns the worst normalized error (see
 * BLAS_KERNEL_TOL); spoil != 0 corrupts one element first (the test hook).
 * A negative value: out of memory. */
double blas_kernel_selftest(int spoil);

/* Choose the kernel (see README, "CPU workers"): an OPENBLAS_CORETYPE in the
 * environment that restps did not set (even an empty one) is the user's and
 * is used as it is, self-test or not. Otherwise the candidates are tried in
 * turn: one OpenBLAS did not load is set in OPENBLAS_CORETYPE and the program
 * re-executes itself (execv of /proc/self/exe with this argv: same PID, same
 * arguments; never under valgrind, whose CPU has no AVX-512), once per
 * candidate at most. A kernel that fails the self-test is not used. Call it
 * first thing in main, before anything is printed. 0 when the kernel in use
 * passed its self-test or is the user's; -1 when every candidate failed, with
 * err saying so. */
int blas_kernel_choose(char **argv, char *err, size_t errlen);

/* The kernel in use (openblas_get_corename) and, after blas_kernel_choose,
 * why: one clause for the start-up line. */
const char *blas_kernel_name(void);
const char *blas_kernel_reason(void);

#endif
