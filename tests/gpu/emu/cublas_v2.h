/* cublas_v2.h - the few cuBLAS names model_cuda.cu and gpu_bench.c use, for
 * the host emulation (tests/gpu/emu/run.sh; fake_cuda.cc computes them). */
#pragma once
#include "cuda_runtime.h"
#define CUBLAS_VER_MAJOR 13
typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_INITIALIZED = 1, CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_ARCH_MISMATCH = 8, CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13, CUBLAS_STATUS_INTERNAL_ERROR = 14, CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16 } cublasStatus_t;
typedef void *cublasHandle_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TF32_TENSOR_OP_MATH = 3 } cublasMath_t;
#ifdef __cplusplus
extern "C" {
#endif
cublasStatus_t cublasCreate_v2(cublasHandle_t *h);
cublasStatus_t cublasDestroy_v2(cublasHandle_t h);
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m);
cublasStatus_t cublasSgemm_v2(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
  const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta, float *C, int ldc);
cublasStatus_t cublasSgemv_v2(cublasHandle_t h, cublasOperation_t t, int m, int n, const float *alpha,
  const float *A, int lda, const float *x, int incx, const float *beta, float *y, int incy);
#define cublasCreate cublasCreate_v2
#define cublasDestroy cublasDestroy_v2
#define cublasSgemm cublasSgemm_v2
#ifdef __cplusplus
}
#endif
