/* cuda_runtime.h - a host-only stand-in for the CUDA runtime (tests/gpu/emu/run.sh):
 * "device" memory is host memory, copies are memmove, streams and events do
 * nothing (every call completes at once), one device. With it, model_cuda.cu
 * (its launches rewritten by unlaunch.py into LAUNCH, which runs every
 * thread of every block in turn) runs on a machine without a GPU: what it
 * checks is the backend's host logic, the kernels' index arithmetic and the
 * cuBLAS operands, not the stream ordering, not the device. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __cplusplus
extern "C" {
#endif
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
enum { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };
enum { cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2, cudaHostAllocDefault = 0 };
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2 };
struct cudaPointerAttributes { enum cudaMemoryType type; };
typedef struct cudaDeviceProp { char name[256]; int major, minor; } cudaDeviceProp;
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d);
cudaError_t cudaMemGetInfo(size_t *f, size_t *t);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned f);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, int kind, cudaStream_t st);
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned f);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned f);
cudaError_t cudaGetLastError(void);
cudaError_t cudaMemset(void *d, int v, size_t n);
cudaError_t cudaDeviceSynchronize(void);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p);
#ifdef __cplusplus
}
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
extern dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __host__
#define __device__
static inline int min(int a, int b) { return a < b ? a : b; }
/* the threads run one after the other: an atomic add is an add */
static inline float atomicAdd(float *a, float v) { float o = *a; *a = o + v; return o; }
#define LAUNCH(kern, G, T, ...) do { dim3 g_ = (G), t_ = (T); gridDim = g_; blockDim = t_;            \
    for (unsigned by = 0; by < g_.y; by++) for (unsigned bx = 0; bx < g_.x; bx++)                      \
        for (unsigned tx = 0; tx < t_.x; tx++) { blockIdx = dim3(bx, by); threadIdx = dim3(tx); kern(__VA_ARGS__); } \
    } while (0)
#endif
