/* cuda_runtime_api.h - the host emulation's runtime (cuda_runtime.h) */
#include "cuda_runtime.h"
