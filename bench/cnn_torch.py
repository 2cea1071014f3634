"""The TensorFlow layers tutorial's CNN (restps's --model=cnn) in PyTorch on
the CPU, one thread, channels-last: SGD step time (forward, backward, update)
at batch 100, and numpy's one-thread sgemm rate in the same run.

    /usr/bin/python3 bench/cnn_torch.py [--steps=N] [--batch=B] [--json]

PyTorch is Debian's python3-torch (make bench installs it). Prints steps/s,
the step's conv + dense FLOP rate (tests/helpers/cnn_ref.py's count), the
backends torch reports (oneDNN for the convolutions, the BLAS library its
matmuls load) and numpy's sgemm GFLOP/s with the OpenBLAS kernel it loaded.
"""
import os

for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[v] = "1"   # before numpy or torch load their BLAS

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))
import cnn_ref  # noqa: E402


def loaded_libs(*words):
    """The shared libraries this process has mapped whose name has one of words."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            base = os.path.basename(path)
            if any(w in base for w in words):
                out.add(os.path.realpath(path))
    return sorted(out)


def openblas_core():
    """OpenBLAS's kernel name (openblas_get_corename) from the library numpy loaded."""
    import ctypes
    for path in loaded_libs("openblas", "libblas"):
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_get_corename.restype = ctypes.c_char_p
            return f"OpenBLAS {lib.openblas_get_corename().decode()} ({os.path.basename(path)})"
        except (OSError, AttributeError):
            continue
    return "not OpenBLAS (" + ", ".join(os.path.basename(p) for p in loaded_libs("blas")) + ")"


def sgemm_gflops(n=1024, seconds=1.0):
    """numpy's float32 n x n x n product, one thread: GFLOP/s (best of 3 timed runs)."""
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = np.random.default_rng(1).random((n, n), dtype=np.float32)
    a @ b
    best = 0.0
    for _ in range(3):
        t, k = time.perf_counter(), 0
        while True:
            a @ b
            k += 1
            dt = time.perf_counter() - t
            if dt >= seconds / 3:
                break
        best = max(best, 2.0 * n ** 3 * k / dt / 1e9)
    return best


def torch_cnn(batch, steps, warmup):
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),      # same: pad 2 each side
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(7 * 7 * 64, 1024), nn.ReLU(), nn.Dropout(0.4),
        nn.Linear(1024, 10)).to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.rand(batch, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    with torch.autograd.profiler.profile() as prof:   # which kernels one step runs
        step()
    ops = sorted({e.key for e in prof.key_averages()
                  if any(w in e.key for w in ("conv", "addmm", "mm", "linear"))})
    t = time.perf_counter()
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t
    backend = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "mkldnn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
        "cpu_capability": "?",
        "blas_libs": [os.path.basename(p) for p in loaded_libs("blas", "mkl", "dnnl")],
        "ops": ops,
        "conv_kernel": "oneDNN (aten::mkldnn_convolution)" if "aten::mkldnn_convolution" in ops
        else "aten's im2col + BLAS (slow_conv2d)" if any("slow_conv2d" in o for o in ops) else "?",
    }
    for line in torch.__config__.show().splitlines():
        if "MKL-DNN" in line or "oneDNN" in line:
            backend["onednn"] = line.strip(" -")
        if "CPU capability usage" in line:
            backend["cpu_capability"] = line.split(":", 1)[1].strip()
    return steps / dt, backend


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    a = ap.parse_args()
    gemm = sgemm_gflops()
    kernel = openblas_core()
    rate, backend = torch_cnn(a.batch, a.steps, a.warmup)
    _, step_flops = cnn_ref.Model("cnn").flops(a.batch)
    res = dict(steps_per_s=rate, batch=a.batch, steps=a.steps, step_gflop=step_flops / 1e9,
               gflops=rate * step_flops / 1e9, numpy_sgemm_gflops=gemm, numpy_blas=kernel, **backend)
    if a.json:
        print(json.dumps(res))
        return
    print(f"pytorch {res['torch']} cnn batch {a.batch}, 1 thread, channels-last: "
          f"{rate:.2f} steps/s ({res['gflops']:.1f} GFLOP/s of {res['step_gflop']:.2f} GFLOP/step)")
    print(f"  torch backends: {res.get('onednn', 'no oneDNN')} (mkldnn enabled: {res['mkldnn']}), "
          f"cpu capability {res['cpu_capability']}, BLAS libraries {', '.join(res['blas_libs']) or '?'}")
    print(f"  convolutions: {res['conv_kernel']}; the step's conv and matmul ops: {', '.join(res['ops'])}")
    print(f"numpy sgemm 1024^3, 1 thread: {gemm:.1f} GFLOP/s ({kernel})")


if __name__ == "__main__":
    main()
