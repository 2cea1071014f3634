/* model_cuda_stub.c - the CUDA helpers of model.h in a build without CUDA
 * (make CUDA=0, or no nvcc): there is no model_backend_cuda, and every helper
 * says so. */
#include "errmsg.h"
#include "model/model.h"

#define NO_CUDA "this workerd was built without CUDA (make CUDA=0, or no nvcc at build time)"

int model_cuda_built(void)
{
    return 0;
}

const model_backend *model_cuda_backend(void)
{
    return NULL;
}

int model_cuda_device_count(char *err, size_t errlen)
{
    errmsg(err, errlen, NO_CUDA);
    return 0;
}

int model_cuda_use(int gpu, int tf32, char *desc, size_t desclen, char *err, size_t errlen)
{
    (void)gpu;
    (void)tf32;
    if (desc && desclen)
        desc[0] = '\0';
    return errmsg(err, errlen, NO_CUDA);
}
