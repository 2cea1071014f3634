/* model_device.c - which backend this process computes with: workerd's
 * --device=auto|cpu|cuda, --gpu and --tf32. Process-wide, like the CUDA
 * device itself and the OpenBLAS thread count. */
#include <stdio.h>
#include <string.h>

#include "model/blas_kernel.h"
#include "errmsg.h"
#include "model/model.h"

static const model_backend *chosen = &model_backend_cpu;
static char cuda_desc[256];

int model_device_choose(const char *device, int gpu, int tf32, char *line, size_t linelen,
                      char *err, size_t errlen)
{
    char why[256] = "";
    int want_cuda = strcmp(device, "cuda") == 0, is_auto = strcmp(device, "auto") == 0;
    if (!want_cuda && !is_auto && strcmp(device, "cpu") != 0)
        return errmsg(err, errlen, "--device must be auto, cpu or cuda, got '%s'", device);
    if (gpu < 0)
        return errmsg(err, errlen, "--gpu=%d is negative", gpu);
    chosen = &model_backend_cpu;
    if (!want_cuda && !is_auto) {
        snprintf(line, linelen, "using the cpu backend (--device=cpu)");
        return 0;
    }
    int n = model_cuda_device_count(why, sizeof(why));
    if (n < 1) {
        if (want_cuda)
            return errmsg(err, errlen, "--device=cuda: %s", why);
        snprintf(line, linelen, "using the cpu backend (--device=auto: %s)", why);
        return 0;
    }
    if (model_cuda_use(gpu, tf32, cuda_desc, sizeof(cuda_desc), why, sizeof(why)) != 0) {
        /* a device, but not usable (--gpu out of range, no cuBLAS, ...) */
        if (want_cuda)
            return errmsg(err, errlen, "--device=cuda: %s", why);
        snprintf(line, linelen, "using the cpu backend (--device=auto: a CUDA device is visible, but %s)", why);
        return 0;
    }
    chosen = model_cuda_backend();
    snprintf(line, linelen, "using the cuda backend (--device=%s): %s", device, cuda_desc);
    return 0;
}

const model_backend *model_device_backend(void)
{
    return chosen;
}

const char *model_device_describe(int threads)
{
    static char buf[1152];
    if (chosen == &model_backend_cpu)
        snprintf(buf, sizeof(buf), "cpu backend (OpenBLAS %s, %d thread%s; %s)", model_cpu_blas_core(),
                 threads, threads == 1 ? "" : "s", blas_kernel_reason());
    else
        snprintf(buf, sizeof(buf), "%s backend (%s)", chosen->name, cuda_desc);
    return buf;
}
