#!/bin/bash
# tests/gpu/emu/run.sh - the CUDA backend (client/model/model_cuda.cu) on a host
# emulation of the CUDA runtime and cuBLAS, on a machine without a GPU: the
# kernels run as loops over their threads (unlaunch.py), cuBLAS is OpenBLAS
# in column-major order (fake_cuda.cc), then tests/gpu/cuda_vs_cpu compares it
# with the CPU backend as it does on a device. It checks the backend's host
# side (ranges, copies, staging, pairing, workspace), the kernels' index
# arithmetic (TF padding, strides, argmax, col2im) and the cuBLAS operands;
# not the stream ordering, the launch limits or anything of a real device
# (tests/gpu/check.sh does, on one). About a minute on 2 cores.
#   tests/gpu/emu/run.sh [--seed=N]   exit status: cuda_vs_cpu's
# Environment: EMU_BUILD (default build/gpu-emu).
set -eu -o pipefail
cd "$(dirname "$0")/../../.."
B=${EMU_BUILD:-build/gpu-emu}
E=tests/gpu/emu
mkdir -p "$B/emu"
# the CPU side (the model library and common/) as make builds it, without CUDA
make -s CUDA=0 BUILD="$B" BIN="$B/bin" "$B/bin/model_dump" > "$B/emu/make.log" 2>&1 ||
    { cat "$B/emu/make.log"; exit 1; }
python3 "$E/unlaunch.py" client/model/model_cuda.cu "$B/emu/model_cuda_emu.cc"
CXXW="-Wall -Wextra -Werror -Wno-unused-function -Wno-unused-parameter"
g++ -O1 -g -shared -fPIC -I"$E" -Wl,-soname,libcublas.so.13 -o "$B/emu/libcublas.so.13" "$E/fake_cuda.cc" -lopenblas
g++ -O2 -g -std=c++17 $CXXW -I"$E" -Iclient -Icommon -DRESTPS_CUDA_LIBDIR="\"$PWD/$B/emu\"" \
    -c -o "$B/emu/model_cuda_emu.o" "$B/emu/model_cuda_emu.cc"
cc -O2 -g -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -I"$E" -Iclient -Icommon \
    -c -o "$B/emu/cuda_vs_cpu.o" tests/gpu/cuda_vs_cpu.c
objs=("$B"/client/model/model.o "$B"/client/model/model_spec.o "$B"/client/model/model_cpu.o "$B"/client/model/blas_kernel.o \
      "$B"/client/model/embed_bag.o "$B"/common/*.o)
cc -o "$B/emu/cuda_vs_cpu" "$B/emu/cuda_vs_cpu.o" "$B/emu/model_cuda_emu.o" "${objs[@]}" \
    "$B/emu/libcublas.so.13" -Wl,-rpath,"$PWD/$B/emu" -lopenblas -ljansson -lm -lstdc++ -ldl
echo "tests/gpu/emu/run.sh: cuda_vs_cpu on the host emulation (not a GPU)"
exec "$B/emu/cuda_vs_cpu" "$@"
