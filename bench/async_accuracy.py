#!/usr/bin/python3
"""bench/async_accuracy.py - `make bench`: what asynchrony costs the original
example in accuracy, and why.

The example's settings (784-100-10, truncated-normal init, Adam 0.01, batch
100, 10,000 steps) on Fashion-MNIST, measured three ways for the same seeds:

  1. restps: `workerd --local` (one process, no ps), then 1 ps + 2 async
     workers (the example's cluster). For each async run the ps's staleness
     histogram (/v1/status) is read before it stops.
  2. numpy, written here from the model's definition and TensorFlow's Adam
     rules (it shares no code with restps): the same model trained with the
     gradient taken at the current parameters (delay 0, one worker) or at the
     parameters one update older (delay 1, what an async push computed before
     the other worker's update sees), or a random mix with the measured
     staleness (delay 1 with probability p).

  3. the async cluster again with `--moving_average_decay=D` (the ps keeps
     tf.train.ExponentialMovingAverage shadows; the chief's final evaluation
     reads them), against issue 19's target: mean >= 0.86 over >= 10 seeds,
     no run below 0.85.

It prints one line per run, then a table of mean/min/max test accuracy and how
many runs reach 0.85, and writes the table to bench/out/async_accuracy.md.
Exit status non-zero only when something broke, never for a figure.

  4. TensorFlow's own example (bench/tf_distributed.py, build/bench-venv) on
     the same seeds, 1 ps + 2 async workers, each update's staleness measured
     as psd counts it (the updates applied between the step's read of the
     variables and its own), and numpy's delay-1 arm again at TensorFlow's
     staleness: the two implementations side by side, and whether the
     staleness alone explains the gap.

Environment: ASYNC_SEEDS (default "1 2 ... 10"), ASYNC_STEPS (10000),
ASYNC_NUMPY=0 skips the numpy part, ASYNC_TF=0 TensorFlow's, ASYNC_EMA (the decay of the EMA arm,
default 0.99; 0 skips it), RESTPS_BIN_DIR (default bin).
"""
import gzip
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from benchlib import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
DATA = "/usr/share/datasets/fashion-mnist"
SEEDS = [int(s) for s in os.environ.get("ASYNC_SEEDS", "1 2 3 4 5 6 7 8 9 10").split()]
EMA = float(os.environ.get("ASYNC_EMA", "0.99"))
STEPS = int(os.environ.get("ASYNC_STEPS", "10000"))
EXAMPLE = ["--hidden_units=100", "--optimizer=adam", "--learning_rate=0.01", "--batch_size=100",
           f"--train_steps={STEPS}", "--log_every=0", f"--data_dir={DATA}"]


# ---- restps ----------------------------------------------------------------

def accuracy(out):
    lines = [l for l in out.splitlines() if "test accuracy" in l]
    if not lines:
        raise RuntimeError("no test accuracy in:\n" + out[-2000:])
    return float(lines[-1].rsplit("test accuracy", 1)[1].strip())


def run_local(seed):
    r = subprocess.run([os.path.join(BIN, "workerd"), "--local", f"--seed={seed}"] + EXAMPLE,
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"workerd --local exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return accuracy(r.stdout)


def run_async(seed, n_workers=2, extra=()):
    """1 psd + n async workers; returns (accuracy, mean staleness)."""
    port = free_port()
    psd = subprocess.Popen([os.path.join(BIN, "psd"), f"--ps_hosts=127.0.0.1:{port}", "--logdir="],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = []
    try:
        workers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n_workers))
        common = [f"--ps_hosts=127.0.0.1:{port}", f"--worker_hosts={workers}", "--sync=0",
                  f"--seed={seed}", "--keep_ps"] + EXAMPLE + list(extra)
        logs = [tempfile.TemporaryFile("w+") for _ in range(n_workers)]
        for i in range(n_workers):
            procs.append(subprocess.Popen([os.path.join(BIN, "workerd"), f"--task_index={i}"] + common,
                                          stdout=logs[i], stderr=subprocess.STDOUT, text=True))
        outs = []
        for p, f in zip(procs, logs):
            p.wait(timeout=900)
            f.seek(0)
            outs.append(f.read())
            f.close()
        for p, o in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"workerd exited {p.returncode}:\n{o[-2000:]}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=10) as r:
            st = json.load(r).get("staleness", {})
        return accuracy(outs[0]), float(st.get("mean", float("nan")))
    finally:
        for p in procs + [psd]:
            if p.poll() is None:
                p.kill()
            p.wait()


# ---- TensorFlow, the same example (bench/tf_distributed.py) -------------------

TF_PY = os.path.join(ROOT, "build", "bench-venv", "bin", "python")


def tf_available():
    if os.environ.get("ASYNC_TF", "1") == "0" or not os.access(TF_PY, os.X_OK):
        return False
    r = subprocess.run([TF_PY, "-c", "import tensorflow"], capture_output=True, timeout=120)
    return r.returncode == 0


def run_tf(seed, n_workers=2):
    """TensorFlow's example, 1 ps + n async workers, each update's staleness
    measured (--report_staleness): (accuracy, mean staleness, histogram)."""
    prog = os.path.join(ROOT, "bench", "tf_distributed.py")
    ps = f"127.0.0.1:{free_port()}"
    workers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n_workers))
    common = [f"--ps_hosts={ps}", f"--worker_hosts={workers}", "--issync=0", f"--seed={seed}",
              f"--train_steps={STEPS}", "--log_every=0", "--report_staleness=1", f"--data_dir={DATA}"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    procs = [subprocess.Popen([TF_PY, prog, "--job_name=ps", "--task_index=0"] + common,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)]
    try:
        logs = [tempfile.TemporaryFile("w+") for _ in range(n_workers)]
        ws = [subprocess.Popen([TF_PY, prog, "--job_name=worker", f"--task_index={i}"] + common,
                               stdout=logs[i], stderr=subprocess.STDOUT, text=True, env=env)
              for i in range(n_workers)]
        procs += ws
        outs = []
        for p, f in zip(ws, logs):
            p.wait(timeout=1800)
            f.seek(0)
            outs.append(f.read())
            f.close()
        hist = np.zeros(9)
        for p, o in zip(ws, outs):
            if p.returncode != 0:
                raise RuntimeError(f"tf_distributed.py worker exited {p.returncode}:\n{o[-2000:]}")
            line = [ln for ln in o.splitlines() if "staleness mean" in ln][-1]
            hist += np.array([int(v) for v in line.split("8+", 1)[1].split()])
        mean = float((hist * np.arange(9)).sum() / hist.sum())
        return accuracy(outs[0]), mean, hist
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


# ---- numpy, independent of restps ---------------------------------------------

def read_idx(path):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        b = f.read()
    magic, = struct.unpack(">I", b[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, b[4:4 + 4 * ndim])
    return np.frombuffer(b, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(name):
    for p in (os.path.join(DATA, name), os.path.join(DATA, name + ".gz")):
        if os.path.exists(p):
            return p
    raise FileNotFoundError(os.path.join(DATA, name))


def load():
    xi = read_idx(find("train-images-idx3-ubyte")).reshape(-1, 784).astype(np.float32) / 255
    yi = read_idx(find("train-labels-idx1-ubyte")).astype(np.int64)
    xt = read_idx(find("t10k-images-idx3-ubyte")).reshape(-1, 784).astype(np.float32) / 255
    yt = read_idx(find("t10k-labels-idx1-ubyte")).astype(np.int64)
    # the example's input_data: the first 5,000 training images are validation
    return xi[5000:], yi[5000:], xt, yt


def truncated_normal(rng, shape, std):
    out = rng.standard_normal(shape)
    bad = np.abs(out) > 2
    while bad.any():  # redrawn beyond 2 stddev, as tf.truncated_normal
        out[bad] = rng.standard_normal(bad.sum())
        bad = np.abs(out) > 2
    return (out * std).astype(np.float32)


def grads(w, x, y):
    hw, hb, sw, sb = w
    h = np.maximum(x @ hw + hb, 0)
    z = h @ sw + sb
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    B = len(y)
    dz = p
    dz[np.arange(B), y] -= 1
    dz /= B
    dh = (dz @ sw.T) * (h > 0)
    return [x.T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]


def numpy_train(seed, p_delay, data):
    """The example trained with each gradient taken at the parameters one
    update older with probability p_delay (delay 0: the single-worker case)."""
    xtr, ytr, xte, yte = data
    rng = np.random.default_rng(seed)
    w = [truncated_normal(rng, (784, 100), 1 / 28), np.zeros(100, np.float32),
         truncated_normal(rng, (100, 10), 1 / np.sqrt(100)), np.zeros(10, np.float32)]
    m = [np.zeros_like(a) for a in w]
    v = [np.zeros_like(a) for a in w]
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    prev = [a.copy() for a in w]
    order, at = rng.permutation(len(ytr)), 0
    for t in range(1, STEPS + 1):
        if at + 100 > len(order):
            order, at = rng.permutation(len(ytr)), 0
        idx = order[at:at + 100]
        at += 100
        stale = rng.random() < p_delay
        g = grads(prev if stale else w, xtr[idx], ytr[idx])
        prev = [a.copy() for a in w]
        lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)  # AdamOptimizer's rule
        for k in range(4):
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] * g[k]
            w[k] = (w[k] - lr_t * m[k] / (np.sqrt(v[k]) + eps)).astype(np.float32)
    h = np.maximum(xte @ w[0] + w[1], 0)
    return float(((h @ w[2] + w[3]).argmax(1) == yte).mean())


# ---- the table -----------------------------------------------------------------

def main():
    for f in ("psd", "workerd"):
        if not os.access(os.path.join(BIN, f), os.X_OK):
            print(f"bench-async: {BIN}/{f} is missing (make all)", file=sys.stderr)
            return 1
    if not os.path.isdir(DATA):
        print(f"bench-async: {DATA} is missing (make deps installs dataset-fashion-mnist)", file=sys.stderr)
        return 1
    print(f"== the example's settings ({STEPS} steps), seeds {SEEDS}: what asynchrony costs in accuracy "
          f"(OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')})")
    rows = {}
    stal = []
    for s in SEEDS:
        t = time.time()
        a = run_local(s)
        rows.setdefault("restps --local (1 process)", []).append(a)
        b, st = run_async(s)
        rows.setdefault("restps 1 ps + 2 async workers", []).append(b)
        stal.append(st)
        e = ""
        if EMA > 0:
            c, _ = run_async(s, extra=[f"--moving_average_decay={EMA}"])
            rows.setdefault(f"restps 1 ps + 2 async workers, --moving_average_decay={EMA}", []).append(c)
            e = f"   with EMA {EMA} {c:.4f}"
        print(f"seed {s}: --local {a:.4f}   2 async workers {b:.4f} (mean staleness {st:.2f}){e}   "
              f"{time.time() - t:.0f} s", flush=True)
    p = float(np.mean(stal)) if stal else 0.5
    tf_stal = []
    if tf_available():
        for s in SEEDS:
            t = time.time()
            a, st, h = run_tf(s)
            rows.setdefault("TensorFlow 1 ps + 2 async workers (bench/tf_distributed.py)", []).append(a)
            tf_stal.append(st)
            print(f"seed {s}: TensorFlow 2 async workers {a:.4f} (mean staleness {st:.2f}, updates 0,1,2,..,8+ "
                  f"stale: {' '.join(str(int(v)) for v in h)})   {time.time() - t:.0f} s", flush=True)
    else:
        print("(TensorFlow's arm skipped: build/bench-venv has no tensorflow (make bench-deps) or ASYNC_TF=0)")
    q = float(np.mean(tf_stal)) if tf_stal else None
    if os.environ.get("ASYNC_NUMPY", "1") != "0":
        data = load()
        delays = [0.0, 1.0, p] + ([q] if q is not None else [])
        names = ["numpy, delay 0", "numpy, delay 1", f"numpy, delay 1 w.p. {p:.2f} (restps's staleness)"] + \
            ([f"numpy, delay 1 w.p. {q:.2f} (TensorFlow's staleness)"] if q is not None else [])
        for s in SEEDS:
            t = time.time()
            r = [numpy_train(s, d, data) for d in delays]
            for name, a in zip(names, r):
                rows.setdefault(name, []).append(a)
            print(f"seed {s}: numpy " + "   ".join(f"delay 1 w.p. {d:.2f} {a:.4f}" for d, a in zip(delays, r)) +
                  f"   {time.time() - t:.0f} s", flush=True)
    lines = ["| run | mean | sd | min | max | runs >= 0.85 |", "|---|---|---|---|---|---|"]
    for name, accs in rows.items():
        a = np.array(accs)
        sd = float(a.std(ddof=1)) if len(a) > 1 else float("nan")
        lines.append(f"| {name} | {a.mean():.4f} | {sd:.4f} | {a.min():.4f} | {a.max():.4f} | "
                     f"{int((a >= 0.85).sum())} of {len(a)} |")
    table = "\n".join(lines)
    print(table)
    if q is not None:
        r = np.array(rows["restps 1 ps + 2 async workers"])
        t = np.array(rows["TensorFlow 1 ps + 2 async workers (bench/tf_distributed.py)"])
        print(f"async side by side, seeds {SEEDS}: restps mean {r.mean():.4f} (spread {r.max() - r.min():.4f}), "
              f"TensorFlow {t.mean():.4f} (spread {t.max() - t.min():.4f}); mean staleness of an applied update: "
              f"restps {p:.2f}, TensorFlow {q:.2f}")
    if EMA > 0:
        plain = np.array(rows["restps 1 ps + 2 async workers"])
        ema = np.array(rows[f"restps 1 ps + 2 async workers, --moving_average_decay={EMA}"])
        ok = len(ema) >= 10 and ema.mean() >= 0.86 and ema.min() >= 0.85
        print(f"async without EMA: mean {plain.mean():.4f} min {plain.min():.4f}; "
              f"with --moving_average_decay={EMA}: mean {ema.mean():.4f} min {ema.min():.4f} over {len(ema)} "
              f"seeds: {'meets' if ok else 'misses'} the target (mean >= 0.86 over >= 10 seeds, none below 0.85)")
    print("(the issue's target for the async example: >= 0.85; numpy's rows share no code with restps: "
          "the gap between its delay-0 and delay-1 rows is what a one-update-old gradient costs this model "
          "at Adam 0.01, independent of the implementation)")
    os.makedirs(os.path.join(ROOT, "bench", "out"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "async_accuracy.md"), "w") as f:
        f.write(f"# async accuracy, {time.strftime('%Y-%m-%d')}, seeds {SEEDS}, {STEPS} steps\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
