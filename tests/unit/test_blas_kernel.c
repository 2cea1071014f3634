/* test_blas_kernel.c - the OpenBLAS kernel choice (client/blas_kernel.c): the
 * sgemm self-test passes on the kernel in use and fails on a spoiled product,
 * the ISA classes of kernel names, the candidate chains for the CPUs this
 * machine is not (an AVX-512 CPU OpenBLAS takes for Prescott, ...), and cpu
 * detection against GCC's own cpuid reading. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "model/blas_kernel.h"

static void test_selftest_passes_on_the_kernel_in_use(void **state)
{
    (void)state;
    double e = blas_kernel_selftest(0);
    print_message("    OpenBLAS %s: self-test error %.2e (limit %.0e)\n", blas_kernel_name(), e, BLAS_KERNEL_TOL);
    assert_true(e >= 0);
    assert_true(e <= BLAS_KERNEL_TOL);
}

static void test_selftest_fails_on_a_spoiled_product(void **state)
{
    (void)state;
    double e = blas_kernel_selftest(1);
    assert_true(e > BLAS_KERNEL_TOL);
    /* one element off by 1 + |c|: far past the limit, not at its edge */
    assert_true(e > 100 * BLAS_KERNEL_TOL);
}

static void test_reason_says_the_kernel_passed(void **state)
{
    (void)state;
    const char *r = blas_kernel_reason();
    print_message("    %s\n", r);
    assert_int_equal(strncmp(r, "kernel: ", 8), 0);
    assert_non_null(strstr(r, "sgemm self-test passed"));
}

static void test_kernel_classes(void **state)
{
    (void)state;
    assert_int_equal(blas_kernel_class("SkylakeX"), 3);
    assert_int_equal(blas_kernel_class("skylakex"), 3);
    assert_int_equal(blas_kernel_class("SapphireRapids"), 3);
    assert_int_equal(blas_kernel_class("Haswell"), 2);
    assert_int_equal(blas_kernel_class("Zen"), 2);
    assert_int_equal(blas_kernel_class("Sandybridge"), 1);
    assert_int_equal(blas_kernel_class("Prescott"), 0);
    assert_int_equal(blas_kernel_class("Nehalem"), 0);
    assert_int_equal(blas_kernel_class(""), 0);
    assert_int_equal(blas_kernel_class(NULL), 0);
}

static void check_chain(int cls, const char *own, const char *want)
{
    const char *got[8];
    int n = blas_kernel_candidates(cls, own, got, 8);
    char buf[256] = "";
    for (int i = 0; i < n; i++)
        snprintf(buf + strlen(buf), sizeof(buf) - strlen(buf), "%s%s", i ? "," : "", got[i]);
    if (strcmp(buf, want) != 0)
        fail_msg("class %d, OpenBLAS's own %s: got %s, want %s", cls, own, buf, want);
}

static void test_candidate_chains(void **state)
{
    (void)state;
    /* the machine: AVX-512, a model OpenBLAS does not know */
    check_chain(3, "Prescott", "SkylakeX,Haswell,Prescott");
    /* OpenBLAS knows the model and its kernels are of the cpu's class: first */
    check_chain(3, "SapphireRapids", "SapphireRapids,SkylakeX,Haswell");
    check_chain(2, "Zen", "Zen,Haswell");
    check_chain(2, "Haswell", "Haswell");
    /* below what the cpu runs: restps's pick first */
    check_chain(3, "Haswell", "SkylakeX,Haswell");
    check_chain(2, "Prescott", "Haswell,Prescott");
    check_chain(2, "Sandybridge", "Haswell,Sandybridge");
    /* no AVX2: OpenBLAS's choice alone */
    check_chain(1, "Sandybridge", "Sandybridge");
    check_chain(0, "Prescott", "Prescott");
    /* truncated to max */
    const char *two[2];
    assert_int_equal(blas_kernel_candidates(3, "Prescott", two, 2), 2);
    assert_string_equal(two[1], "Haswell");
}

static void test_cpu_detect_agrees_with_gcc(void **state)
{
    (void)state;
    blas_cpu cpu;
    blas_cpu_detect(&cpu);
    print_message("    cpu class %d: %s\n", cpu.cls, cpu.desc);
    assert_true(cpu.cls >= 0 && cpu.cls <= 3);
    assert_true(cpu.desc[0] != '\0');
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    assert_int_equal(cpu.cls >= 2, avx2);
    assert_int_equal(cpu.cls == 3, avx512);
#endif
}

int main(int argc, char **argv)
{
    (void)argc;
    char err[512];
    if (blas_kernel_choose(argv, err, sizeof(err)) != 0) {
        fprintf(stderr, "test_blas_kernel: %s\n", err);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_selftest_passes_on_the_kernel_in_use),
        cmocka_unit_test(test_selftest_fails_on_a_spoiled_product),
        cmocka_unit_test(test_reason_says_the_kernel_passed),
        cmocka_unit_test(test_kernel_classes),
        cmocka_unit_test(test_candidate_chains),
        cmocka_unit_test(test_cpu_detect_agrees_with_gcc),
    };
    return cmocka_run_group_tests_name("blas_kernel", tests, NULL, NULL);
}
