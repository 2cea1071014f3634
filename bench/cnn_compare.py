"""The CNN's training step on the CPU: restps (workerd --local --model=cnn,
one thread, batch 100, sgd) against the same model in PyTorch on the CPU
(bench/cnn_torch.py, one thread, channels-last) in one run, and restps's
conv + dense FLOP rate against OpenBLAS sgemm's measured in the same run.

    /usr/bin/python3 bench/cnn_compare.py [--bin=bin] [--steps=30] [--reps=5] [--warmup=3]

Targets (issue 19): restps / PyTorch >= 1.0; restps's GFLOP/s >= 50% of
sgemm's. The runs alternate, reps times each, and the best of each side is
compared (a 2-core machine shared with other work is noisy); each round's
figures and the load average before and after it are printed as they come.
PyTorch runs with OPENBLAS_CORETYPE set to the kernel restps chose, so both
sides' matrix products use one OpenBLAS kernel (PyTorch's convolutions are
oneDNN's: it says so), and channels-last, its faster layout here (CPU time
per step, one thread, batch 100, at load 5: 161 ms channels-last against
213 ms NCHW).
The FLOPs are tests/helpers/cnn_ref.py's count: per step the forward, the
weight gradients and the input gradients of every layer but the first, 2 per
multiply-add (8.2 GFLOP at batch 100). Both sides time --steps
steps after --warmup untimed ones (3): cnn_torch.py its loop, restps from
workerd's per-step log lines (--log_every=1); workerd's own steps/s over the
whole run (its first steps, where OpenBLAS sets up its buffers, included; the
final evaluation is not in it) is printed beside it.
"""
import argparse
import gzip
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
import cnn_ref  # noqa: E402

PY = "/usr/bin/python3"


def run_restps(workerd, data_dir, steps, batch, warmup):
    """workerd's steps/s over the steps after the first warmup ones (as
    cnn_torch.py times its steps after --warmup untimed ones), from its
    per-step log lines (--log_every=1: each step's examples/s), and workerd's
    own figure over all the steps (the first one included: OpenBLAS's
    buffers are set up in it)."""
    argv = [workerd, "--local", "--model=cnn", f"--data_dir={data_dir}", f"--batch_size={batch}",
            "--optimizer=sgd", "--learning_rate=0.01", f"--train_steps={warmup + steps}", "--log_every=1",
            "--threads=1", "--device=cpu"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    out = r.stdout + r.stderr
    if r.returncode != 0:
        raise SystemExit(f"cnn_compare: {' '.join(argv)} exited {r.returncode}:\n{out[-2000:]}")
    rate = re.findall(r"([0-9.]+) steps/s", out)
    per_step = {int(n): float(r) for n, r in re.findall(r"step ([0-9]+) loss [-0-9.naif]+ examples/s ([0-9.]+)", out)}
    timed = [per_step.get(n) for n in range(warmup + 1, warmup + steps + 1)]
    if not rate or None in timed or min(timed) <= 0:
        raise SystemExit(f"cnn_compare: workerd printed no steps/s, or not one line per step:\n{out[-2000:]}")
    steady = steps / sum(batch / r for r in timed)
    k = re.search(r"cpu backend \(OpenBLAS ([A-Za-z0-9_]+)", out)
    acc = re.search(r"test accuracy ([0-9.]+)", out)
    return steady, float(rate[-1]), (k.group(1) if k else None), (acc.group(1) if acc else "?")


def subset(data_dir, n_train, n_test, out):
    """The first n_train training and n_test test images as raw IDX files in
    out: workerd ends a run with an evaluation of the validation set (the
    first 5,000 training images) and the test set, which for the full CNN
    takes longer than the timed steps; the step time does not depend on it."""
    for kind, n in (("train", n_train), ("t10k", n_test)):
        for part, head, size in (("images-idx3", 16, 784), ("labels-idx1", 8, 1)):
            name = f"{kind}-{part}-ubyte"
            path = os.path.join(data_dir, name)
            raw = gzip.open(path + ".gz").read() if os.path.exists(path + ".gz") else open(path, "rb").read()
            dims = struct.unpack(">" + "I" * (head // 4), raw[:head])
            n = min(n, dims[1])
            with open(os.path.join(out, name), "wb") as f:
                f.write(struct.pack(">" + "I" * (head // 4), dims[0], n, *dims[2:]) + raw[head:head + n * size])
    return out


def run_torch(steps, batch, coretype, warmup):
    env = dict(os.environ)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    r = subprocess.run([PY, os.path.join(HERE, "cnn_torch.py"), "--json", f"--steps={steps}",
                        f"--batch={batch}", f"--warmup={warmup}"], capture_output=True, text=True, timeout=1800, env=env)
    if r.returncode != 0:
        raise SystemExit(f"cnn_compare: bench/cnn_torch.py exited {r.returncode}:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.environ.get("RESTPS_BIN_DIR", "bin"))
    ap.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5,
                    help="alternating rounds (restps, then PyTorch); the best of each side is compared")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps before the timed ones, on both sides")
    ap.add_argument("--full_data", action="store_true",
                    help="evaluate on the whole validation and test sets at the end of each workerd run")
    a = ap.parse_args()
    workerd = os.path.join(ROOT, a.bin, "workerd") if not os.path.isabs(a.bin) else os.path.join(a.bin, "workerd")
    h = subprocess.run([workerd, "--help"], capture_output=True, text=True).stdout
    if "--model" not in h:
        raise SystemExit(f"cnn_compare: {workerd} has no --model flag (the layer library is not built)")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("cnn_compare: python3-torch is not installed (make bench installs it: "
                         "sh scripts/deps.sh python3-torch)")

    tmp = tempfile.TemporaryDirectory(prefix="cnn_compare-")
    data_dir = a.data_dir if a.full_data else subset(a.data_dir, 5000 + (a.warmup + a.steps) * a.batch, 100,
                                                     tmp.name)
    _, step_flops = cnn_ref.Model("cnn").flops(a.batch)
    ours, overall, theirs = [], [], []
    kernel = acc = None
    loads = []
    for i in range(a.reps):
        l0 = os.getloadavg()[0]
        rate, whole, kernel, acc = run_restps(workerd, data_dir, a.steps, a.batch, a.warmup)
        ours.append(rate)
        overall.append(whole)
        theirs.append(run_torch(a.steps, a.batch, kernel, a.warmup))
        loads.append((l0, os.getloadavg()[0]))
        print(f"round {i + 1}: restps {rate:.2f}, pytorch {theirs[-1]['steps_per_s']:.2f} steps/s "
              f"({rate / theirs[-1]['steps_per_s']:.2f}x), load average {l0:.1f} -> {loads[-1][1]:.1f}", flush=True)
    best = max(ours)
    t = max(theirs, key=lambda d: d["steps_per_s"])
    gemm = max(d["numpy_sgemm_gflops"] for d in theirs)
    gflops = best * step_flops / 1e9
    print(f"== the CNN's training step on the CPU, 1 thread, batch {a.batch}, sgd "
          f"({step_flops / 1e9:.2f} GFLOP per step: conv + dense, forward and backward), best of {a.reps}, "
          f"{a.steps} steps timed after {a.warmup} on each side")
    print(f"restps  workerd --local --model=cnn  {best:7.2f} steps/s  {gflops:6.1f} GFLOP/s   "
          f"OpenBLAS {kernel or '?'} (conv as im2col + sgemm); runs {', '.join(f'{r:.2f}' for r in ours)} "
          f"(workerd's own figure, its first {a.warmup} steps included: {', '.join(f'{r:.2f}' for r in overall)}); "
          f"test accuracy after {a.warmup + a.steps} steps {acc}{'' if a.full_data else ' (100 test images)'}")
    runs = ", ".join("%.2f" % d["steps_per_s"] for d in theirs)
    print(f"pytorch {t['torch']} channels-last        {t['steps_per_s']:7.2f} steps/s  {t['gflops']:6.1f} GFLOP/s   "
          f"convolutions {t['conv_kernel']}, matmuls {t['numpy_blas']} "
          f"(libraries {', '.join(t['blas_libs'])}); runs {runs}")
    print(f"numpy sgemm 1024^3, 1 thread         {gemm:6.1f} GFLOP/s   {t['numpy_blas']}")
    ratio = best / t["steps_per_s"]
    print(f"restps / pytorch {ratio:.2f}x (target >= 1.0)   restps / sgemm {100 * gflops / gemm:.0f}% (target >= 50%)   "
          f"load average {min(min(x) for x in loads):.1f}-{max(max(x) for x in loads):.1f} "
          f"({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
