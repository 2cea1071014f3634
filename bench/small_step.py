"""bench/small_step.py - `make bench`: the training step of 1 worker + 1 ps
(async, sgd) against `workerd --local` (issue 20 section 3), for the
example's model (784-100-10, batch 100) and the big one (784-1024-1024-10,
batch 256), with the limit the loopback allows, measured in the same run.

The limit: a distributed step moves the gradients to the ps and the
parameters back, 2 x 4 x n_params bytes (plus a few hundred bytes of
headers), which at the loopback bandwidth measured here (bench/loopback.py)
takes 2B/bw; without any overlap the best a step can be is the local step
plus that, so the ratio limit is t_local / (t_local + 2B/bw). Both sides
compute with the kernel workerd chooses (no OPENBLAS_CORETYPE is set; the
kernel each run reports is printed). The runs alternate, local then
distributed, `--reps` times; the best of each side is compared and the
spread (min-max) printed, with the load average (the machine is shared).
Every process is started here on free 127.0.0.1 ports and stopped by PID.
Prints figures and PASS/BELOW against the targets; never fails on a figure.

    /usr/bin/python3 bench/small_step.py [--bin=bin] [--reps=3]
"""
import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port  # noqa: E402
import loopback  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"
MODELS = [  # label, hidden, batch, steps, target ratio
    ("784-100-10 batch 100", "100", 100, 3000, 0.6),
    ("784-1024-1024-10 batch 256", "1024,1024", 256, 60, 0.95),
]


def n_params(hidden):
    dims = [784] + [int(h) for h in hidden.split(",")] + [10]
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def args_for(hidden, batch, steps):
    return [f"--data_dir={DATA}", f"--hidden_units={hidden}", f"--batch_size={batch}", "--optimizer=sgd",
            "--learning_rate=0.01", f"--train_steps={steps}", "--log_every=0", "--threads=1"]


def rate_and_kernel(out, what):
    rates = re.findall(r"([0-9.]+) steps/s", out)
    if not rates:
        raise RuntimeError(f"{what}: no steps/s in its output:\n{out[-2000:]}")
    k = re.search(r"cpu backend \(OpenBLAS ([A-Za-z0-9_]+)", out)
    return float(rates[-1]), k.group(1) if k else "?"


def env():
    e = dict(os.environ)
    e.pop("OPENBLAS_CORETYPE", None)
    return e


def run_local(bindir, hidden, batch, steps):
    r = subprocess.run([f"{bindir}/workerd", "--local"] + args_for(hidden, batch, steps), capture_output=True,
                       text=True, timeout=900, env=env())
    if r.returncode != 0:
        raise RuntimeError(f"workerd --local exited {r.returncode}:\n{(r.stdout + r.stderr)[-2000:]}")
    return rate_and_kernel(r.stdout + r.stderr, "workerd --local")


def run_dist(bindir, hidden, batch, steps):
    psd = subprocess.Popen([f"{bindir}/psd", "--port=0", "--bind=127.0.0.1", "--logdir="], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        line = psd.stdout.readline()
        m = re.search(r"listening on http://(\S+)", line)
        if not m:
            raise RuntimeError(f"psd did not start: {line!r}")
        w = subprocess.run([f"{bindir}/workerd", f"--ps_hosts={m.group(1)}",
                            f"--worker_hosts=127.0.0.1:{free_port()}", "--sync=0"] + args_for(hidden, batch, steps),
                           capture_output=True, text=True, timeout=900, env=env())
        out = w.stdout + w.stderr
        if w.returncode != 0:
            raise RuntimeError(f"workerd exited {w.returncode}:\n{out[-2000:]}")
        fin = [ln for ln in out.splitlines() if "finished after" in ln or "cpu backend" in ln]
        return rate_and_kernel("\n".join(fin), "workerd")
    finally:
        if psd.poll() is None:
            psd.terminate()
            try:
                psd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                psd.kill()
                psd.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("RESTPS_BIN_DIR", "bin"))
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    for f in ("workerd", "psd"):
        if not os.access(f"{a.bin}/{f}", os.X_OK):
            print(f"small_step: {a.bin}/{f} is missing (make all)", file=sys.stderr)
            return 1
    if not os.path.isdir(DATA):
        print(f"small_step: {DATA} is missing (make deps)", file=sys.stderr)
        return 1
    print("== the small model's step: 1 worker + 1 ps (async, sgd, 1 thread) vs workerd --local "
          f"(best of {a.reps}, alternating; load {os.getloadavg()[0]:.2f})")
    bw = loopback.bandwidth(128, 3)
    print(f"loopback TCP bandwidth measured now: {bw / 1e9:.2f} GB/s (bench/loopback.py, best of 3)")
    for label, hidden, batch, steps, target in MODELS:
        loc, dist, kl, kd = [], [], "?", "?"
        for _ in range(a.reps):
            r, kl = run_local(a.bin, hidden, batch, steps)
            loc.append(r)
            r, kd = run_dist(a.bin, hidden, batch, steps)
            dist.append(r)
        lb, db = max(loc), max(dist)
        t_local = 1 / lb
        wire = 2 * 4 * n_params(hidden)
        limit = t_local / (t_local + wire / bw)
        ratio = db / lb
        print(f"{label:28s} local {lb:8.1f} steps/s ({min(loc):.1f}-{lb:.1f}, {kl})   "
              f"1 worker + 1 ps {db:8.1f} steps/s ({min(dist):.1f}-{db:.1f}, {kd})")
        print(f"{'':28s} ratio {ratio:.2f}x local   no-overlap limit at {bw / 1e9:.2f} GB/s "
              f"{limit:.2f}x ({wire / 1e3:.0f} KB a step: {wire / bw * 1e6:.0f} us on the wire)   "
              f"target >= {target:.2f}x: {'PASS' if ratio >= target else 'BELOW'}   load {os.getloadavg()[0]:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
