/* fake_cuda.cc - the host emulation of the CUDA runtime and cuBLAS
 * (tests/gpu/emu/run.sh): built as libcublas.so.13, so that model_cuda.cu's
 * dlopen finds it, and linked into the test. Device memory from cudaMalloc
 * starts as 0xff bytes (NaN floats), so a read of memory nothing wrote shows;
 * sgemm and sgemv are OpenBLAS's in column-major order, after cuBLAS's checks
 * of the leading dimensions. */
#include "cuda_runtime.h"
#include "cublas_v2.h"
#include <cblas.h>
#include <stdio.h>
#include <math.h>
dim3 blockIdx, threadIdx, blockDim, gridDim;
extern "C" {
static int dummy;
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return 0; }
cudaError_t cudaSetDevice(int) { return 0; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) { strcpy(p->name, "host emulation (tests/gpu/emu), not a GPU"); p->major = 9; p->minor = 0; return 0; }
cudaError_t cudaMemGetInfo(size_t *f, size_t *t) { *f = 1ull << 34; *t = 1ull << 35; return 0; }
cudaError_t cudaMalloc(void **p, size_t n) { *p = malloc(n); memset(*p, 0xff, n); return *p ? 0 : 2; }
cudaError_t cudaFree(void *p) { free(p); return 0; }
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned) { *p = malloc(n); memset(*p, 0xa5, n); return *p ? 0 : 2; }
cudaError_t cudaFreeHost(void *p) { free(p); return 0; }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, int, cudaStream_t) { memmove(d, s, n); return 0; }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t) { memset(d, v, n); return 0; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { *s = &dummy; return 0; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return 0; }
cudaError_t cudaStreamDestroy(cudaStream_t) { return 0; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) { *e = &dummy; return 0; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return 0; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return 0; }
cudaError_t cudaEventDestroy(cudaEvent_t) { return 0; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) { return 0; }
cudaError_t cudaGetLastError(void) { return 0; }
cudaError_t cudaMemset(void *d, int v, size_t n) { memset(d, v, n); return 0; }
cudaError_t cudaDeviceSynchronize(void) { return 0; }
const char *cudaGetErrorString(cudaError_t e) { return e ? "fake error" : "no error"; }
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *) { a->type = cudaMemoryTypeHost; return 0; }
/* cuBLAS on cblas, column-major */
cublasStatus_t cublasCreate_v2(cublasHandle_t *h) { *h = &dummy; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasDestroy_v2(cublasHandle_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream_v2(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSgemm_v2(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
  const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta, float *C, int ldc)
{
    /* cuBLAS's rules on the leading dimensions */
    if (m < 0 || n < 0 || k < 0 || lda < (ta == CUBLAS_OP_N ? (m > 1 ? m : 1) : (k > 1 ? k : 1)) ||
        ldb < (tb == CUBLAS_OP_N ? (k > 1 ? k : 1) : (n > 1 ? n : 1)) || ldc < (m > 1 ? m : 1)) {
        fprintf(stderr, "fake cublasSgemm: invalid value m %d n %d k %d lda %d ldb %d ldc %d\n", m, n, k, lda, ldb, ldc);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (*beta == 0.0f) for (int j = 0; j < n; j++) for (int i = 0; i < m; i++) C[i + (size_t)j * ldc] = 0.0f; /* cuBLAS: C not read */
    cblas_sgemm(CblasColMajor, ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSgemv_v2(cublasHandle_t, cublasOperation_t t, int m, int n, const float *alpha,
  const float *A, int lda, const float *x, int incx, const float *beta, float *y, int incy)
{
    if (lda < (m > 1 ? m : 1)) { fprintf(stderr, "fake cublasSgemv: lda %d < m %d\n", lda, m); return CUBLAS_STATUS_INVALID_VALUE; }
    if (*beta == 0.0f) for (int i = 0; i < (t == CUBLAS_OP_N ? m : n); i++) y[(size_t)i * incy] = 0.0f;
    cblas_sgemv(CblasColMajor, t == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, m, n, *alpha, A, lda, x, incx, *beta, y, incy);
    return CUBLAS_STATUS_SUCCESS;
}
}
