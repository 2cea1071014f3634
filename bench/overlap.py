"""bench/overlap.py - `make bench`: workerd --overlap (issue 33, part 1), the
step's transfers beside its compute, measured in one run against its peers.

1. Loopback, 1 worker + 1 ps (async, sgd, 1 thread, as bench/small_step.py)
   for the example's model (784-100-10, batch 100) and the big MLP
   (784-1024-1024-10, batch 256): workerd --local, the step without the
   overlap (--overlap=false) and with it, alternating, best of --reps; the
   ratios to --local beside the issue's targets (>= 0.6x and >= 0.85x), and
   the no-overlap limit t_local / (t_local + 2B/bw) at the loopback bandwidth
   measured now (bench/loopback.py).
2. The test bed (deploy/netns/hosts.sh: psd and workerd on hosts of their
   own, each NIC shaped to 1 Gbit/s by tbf), sync, 1 worker + 1 ps, the CNN
   (conv layers first: most of the compute and few bytes; the dense layers
   last: most of the bytes), at the batch whose compute C (workerd --local,
   measured here) is about the transfer T = 2 x 4 x n_params / (0.955 x 125
   MB/s) (0.955: TCP's goodput through tbf, bench/hosts.py). The step with
   and without the overlap, from the chief's per-step lines (steps WARM..),
   against max(T, C) (target <= 1.25x) and T + C. Needs root (network
   namespaces): elsewhere it says so and skips that part.
3. The same bed, --allreduce=ring, 2 tasks on hosts of their own, the CNN:
   the all-reduce in buckets beside the backward pass (--overlap) against
   after it, at the batch whose compute is about the ring's transfer (each
   task sends and receives 4 x n_params at once: T = 4 x n_params / 0.955
   Gbit/s); the same ratios (the backward pass is what can hide it: the
   forward pass needs the summed parameters).

Both sides compute with the kernel workerd chooses (OPENBLAS_CORETYPE is
unset). Every process is started here, on free ports, and stopped by PID.
Prints figures and PASS/BELOW against the targets; never fails on a figure.

    /usr/bin/python3 bench/overlap.py [--bin=bin] [--reps=3]
"""
import argparse
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import BedTask, bed, free_port  # noqa: E402
from benchlib import step_secs as bench_step_secs  # noqa: E402
import loopback  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = "/usr/share/datasets/fashion-mnist"
HOSTS_SH = os.path.join(ROOT, "deploy", "netns", "hosts.sh")
TAG = "restpsovl"
GOODPUT = 0.955 * 1e9 / 8  # bytes/s through a 1 Gbit/s tbf link
WARM, BED_STEPS = 3, 12
LOOPBACK = [  # label, model flags, steps, target ratio to --local
    ("784-100-10 batch 100", ["--hidden_units=100", "--batch_size=100"], 3000, 0.6),
    ("784-1024-1024-10 batch 256", ["--hidden_units=1024,1024", "--batch_size=256"], 60, 0.85),
]
CNN_PARAMS = 5 * 5 * 1 * 32 + 32 + 5 * 5 * 32 * 64 + 64 + 7 * 7 * 64 * 1024 + 1024 + 1024 * 10 + 10


def env():
    e = dict(os.environ)
    e.pop("OPENBLAS_CORETYPE", None)
    return e


def common(steps):
    return [f"--data_dir={DATA}", "--optimizer=sgd", "--learning_rate=0.01", f"--train_steps={steps}",
            "--threads=1", "--seed=3"]


def rate(out, what):
    r = re.findall(r"([0-9.]+) steps/s", out)
    if not r:
        raise RuntimeError(f"{what}: no steps/s in its output:\n{out[-2000:]}")
    return float(r[-1])


def kernel(out):
    k = re.search(r"cpu backend \(OpenBLAS ([A-Za-z0-9_]+)", out)
    return k.group(1) if k else "?"


def run_local(model, steps):
    r = subprocess.run([f"{BIN}/workerd", "--local", "--log_every=0"] + common(steps) + model, capture_output=True,
                       text=True, timeout=900, env=env())
    if r.returncode != 0:
        raise RuntimeError(f"workerd --local exited {r.returncode}:\n{(r.stdout + r.stderr)[-2000:]}")
    return rate(r.stdout, "workerd --local"), kernel(r.stdout + r.stderr)


def run_dist(model, steps, overlap):
    psd = subprocess.Popen([f"{BIN}/psd", "--port=0", "--bind=127.0.0.1", "--logdir="], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        m = re.search(r"listening on http://(\S+)", psd.stdout.readline())
        if not m:
            raise RuntimeError("psd did not start")
        w = subprocess.run([f"{BIN}/workerd", f"--ps_hosts={m.group(1)}", f"--worker_hosts=127.0.0.1:{free_port()}",
                            "--sync=0", "--log_every=0", f"--overlap={overlap}"] + common(steps) + model,
                           capture_output=True, text=True, timeout=900, env=env())
        if w.returncode != 0:
            raise RuntimeError(f"workerd exited {w.returncode}:\n{(w.stdout + w.stderr)[-2000:]}")
        return rate(w.stdout, "workerd"), kernel(w.stdout + w.stderr)
    finally:
        psd.terminate()
        try:
            psd.wait(timeout=10)
        except subprocess.TimeoutExpired:
            psd.kill()
            psd.wait()


def n_params(hidden):
    dims = [784] + [int(h) for h in hidden.split(",")] + [10]
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def loopback_part(reps):
    print(f"== --overlap on loopback: 1 worker + 1 ps (async, sgd, 1 thread) vs workerd --local and vs "
          f"--overlap=false (best of {reps}, alternating; load {os.getloadavg()[0]:.2f})")
    bw = loopback.bandwidth(128, 3)
    print(f"loopback TCP bandwidth measured now: {bw / 1e9:.2f} GB/s (bench/loopback.py, best of 3)")
    for label, model, steps, target in LOOPBACK:
        got = {"local": [], "false": [], "true": []}
        ks = set()
        for rep in range(reps):
            r, k = run_local(model, steps)
            got["local"].append(r)
            ks.add(k)
            for ov in ("false", "true") if rep % 2 == 0 else ("true", "false"):  # neither always second
                r, k = run_dist(model, steps, ov)
                got[ov].append(r)
                ks.add(k)
        best = {k: max(v) for k, v in got.items()}
        t_local = 1 / best["local"]
        wire = 2 * 4 * n_params(model[0].split("=", 1)[1])
        limit = t_local / (t_local + wire / bw)
        on, off = best["true"] / best["local"], best["false"] / best["local"]
        print(f"{label:28s} local {best['local']:8.1f} steps/s   --overlap=false {best['false']:8.1f}   "
              f"--overlap=true {best['true']:8.1f}  ({'/'.join(sorted(ks))}; spreads "
              + ", ".join(f"{k} {min(v):.1f}-{max(v):.1f}" for k, v in got.items()) + ")")
        print(f"{'':28s} ratio to local: overlap {on:.2f}x (target >= {target:.2f}x: "
              f"{'PASS' if on >= target else 'BELOW'}), without {off:.2f}x, no-overlap limit {limit:.2f}x; "
              f"overlap/without {best['true'] / best['false']:.2f}x   load {os.getloadavg()[0]:.2f}", flush=True)


def hosts(*args, check=True):
    return bed(HOSTS_SH, TAG, *args, check=check)


def Task(host, argv):
    return BedTask(HOSTS_SH, TAG, host, argv, env=env())


def step_secs(task):
    return bench_step_secs(task, WARM, BED_STEPS)


def bed_local(batch):
    t = Task(0, [f"{BIN}/workerd", "--local", "--model=cnn", f"--batch_size={batch}", "--log_every=1"]
             + common(BED_STEPS))
    if t.finish(600) != 0:
        raise RuntimeError("workerd --local failed:\n" + t.text()[-2000:])
    return step_secs(t)


def spans(timeline):
    """Mean ms a step of each kind of span in a GET /v1/timeline answer (the
    worker's steps after WARM), e.g. {"compute": 210.0, "push": 105.0, ...}."""
    got, steps = {}, set()
    for w in (timeline or {}).get("workers", []):
        for sp in w.get("spans", []):
            if sp["step"] > WARM:
                got[sp["kind"]] = got.get(sp["kind"], 0.0) + (sp["end"] - sp["start"]) * 1e3
                steps.add(sp["step"])
    return {k: v / len(steps) for k, v in got.items()} if steps else {}


def bed_job(batch, overlap):
    """(seconds a step, the timeline's spans) of a sync job on the bed."""
    port = free_port()
    ps, wk = f"{hosts('addr', 'host0')}:{port}", f"{hosts('addr', 'host1')}:{port}"
    cluster = [f"--ps_hosts={ps}", f"--worker_hosts={wk}"]
    psd = Task(0, [f"{BIN}/psd", "--job_name=ps", "--task_index=0", *cluster, "--logdir="])
    w = Task(1, [f"{BIN}/workerd", "--job_name=worker", "--task_index=0", *cluster, "--model=cnn",
                 f"--batch_size={batch}", "--sync=1", "--log_every=1", f"--overlap={overlap}", "--keep_ps"]
             + common(BED_STEPS))
    try:
        if w.finish(600) != 0:
            raise RuntimeError("the worker failed:\n" + w.text()[-2000:])
        r = subprocess.run([HOSTS_SH, f"--name={TAG}", "exec", "host1", "curl", "-s", "--max-time", "5",
                            f"http://{ps}/v1/timeline"], capture_output=True, text=True)
        try:
            tl = json.loads(r.stdout)
        except ValueError:
            tl = None
        return step_secs(w), spans(tl)
    finally:
        psd.p.terminate()
        psd.finish(20)


def step_line(label, times, c, t_wire, overlap):
    """One arm's best step beside the larger of compute c and transfer t_wire (the target <= 1.25x)."""
    s, big = min(times), max(c, t_wire)
    verdict = f"   target <= 1.25x: {'PASS' if s <= 1.25 * big else 'BELOW'}" if overlap == "true" else ""
    print(f"{label} --overlap={overlap:5s} {s * 1e3:6.0f} ms ({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}): "
          f"{s / big:.2f}x the larger, {s / (c + t_wire):.2f}x the sum{verdict}", flush=True)


def ring_job(batch, overlap):
    """Seconds a step of a 2-task ring job on the bed (the chief's lines)."""
    port = free_port()
    wk = f"--worker_hosts={hosts('addr', 'host0')}:{port},{hosts('addr', 'host1')}:{port}"
    ts = [Task(i, [f"{BIN}/workerd", "--allreduce=ring", wk, f"--task_index={i}", "--model=cnn",
                   f"--batch_size={batch}", "--log_every=1", f"--overlap={overlap}", "--logdir="]
               + common(BED_STEPS)) for i in (1, 0)]
    for t in ts:
        if t.finish(600) != 0:
            raise RuntimeError("a ring task failed:\n" + t.text()[-2000:])
    return step_secs(ts[1])


def ring_part(reps, per_ex):
    t_wire = 4 * CNN_PARAMS / GOODPUT
    batch = max(16, min(1024, int(round(t_wire / per_ex / 16)) * 16))
    got = {"local": [], "false": [], "true": []}
    for rep in range(reps):
        got["local"].append(bed_local(batch))
        for ov in ("false", "true") if rep % 2 == 0 else ("true", "false"):
            got[ov].append(ring_job(batch, ov))
    best = {k: min(v) for k, v in got.items()}
    c = best["local"]
    big = max(c, t_wire)
    print(f"== --overlap with --allreduce=ring on the test bed (1 Gbit/s links), 2 tasks, the CNN at batch {batch}, "
          f"best of {reps}, steps {WARM}..{BED_STEPS}; load {os.getloadavg()[0]:.2f}")
    print(f"compute C (workerd --local) {c * 1e3:.0f} ms, transfer T ({4 * CNN_PARAMS / 1e6:.1f} MB each way at "
          f"once) {t_wire * 1e3:.0f} ms: max {big * 1e3:.0f} ms, sum {(c + t_wire) * 1e3:.0f} ms")
    for ov in ("false", "true"):
        step_line("ring step", got[ov], c, t_wire, ov)


def bed_part(reps, which=("ps", "ring")):
    if os.geteuid() != 0:
        print("== --overlap on the test bed: skipped (network namespaces need root; not root here)")
        return
    hosts("down", check=False)
    hosts("up", "2", "--rate=1gbit")
    try:
        t_wire = 2 * 4 * CNN_PARAMS / GOODPUT
        per_ex = min(bed_local(256) for _ in range(2)) / 256  # the batch whose compute is about the transfer
        batch = max(16, min(1024, int(round(t_wire / per_ex / 16)) * 16))
        if "ps" not in which:
            ring_part(reps, per_ex)
            return
        got = {"local": [], "false": [], "true": []}
        seen = {}
        for rep in range(reps):
            got["local"].append(bed_local(batch))
            for ov in ("false", "true") if rep % 2 == 0 else ("true", "false"):
                secs, sp = bed_job(batch, ov)
                if not got[ov] or secs < min(got[ov]):
                    seen[ov] = sp
                got[ov].append(secs)
        best = {k: min(v) for k, v in got.items()}
        c = best["local"]
        big = max(c, t_wire)
        print(f"== --overlap on the test bed (1 Gbit/s links, tbf), sync, 1 worker + 1 ps, the CNN "
              f"({CNN_PARAMS / 1e6:.2f} M parameters) at batch {batch}, best of {reps}, steps {WARM}..{BED_STEPS}; "
              f"load {os.getloadavg()[0]:.2f}")
        print(f"compute C (workerd --local) {c * 1e3:.0f} ms, transfer T (2 x {4 * CNN_PARAMS / 1e6:.1f} MB at "
              f"{GOODPUT * 8 / 1e9:.3f} Gbit/s) {t_wire * 1e3:.0f} ms: max {big * 1e3:.0f} ms, sum "
              f"{(c + t_wire) * 1e3:.0f} ms")
        for ov in ("false", "true"):
            step_line("step", got[ov], c, t_wire, ov)
            sp = seen.get(ov, {})
            print(f"    its timeline (GET /v1/timeline, ms a step; spans overlap with --overlap): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(sp.items())))
        print("    (with --overlap the compute span starts once the first layer's parameters are in and holds "
              "the waits for the later layers'; without, it is the worker's compute alone)")
        if "ring" in which:
            ring_part(reps, per_ex)
    finally:
        hosts("down", check=False)


def main():
    global BIN
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("RESTPS_BIN_DIR", "bin"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--part", choices=["all", "loopback", "bed", "ring"], default="all")
    a = ap.parse_args()
    BIN = os.path.abspath(a.bin)
    for f in ("workerd", "psd"):
        if not os.access(f"{BIN}/{f}", os.X_OK):
            print(f"overlap: {BIN}/{f} is missing (make all)", file=sys.stderr)
            return 1
    if not os.path.isdir(DATA):
        print(f"overlap: {DATA} is missing (make deps)", file=sys.stderr)
        return 1
    if a.part in ("all", "loopback"):
        loopback_part(a.reps)
    if a.part in ("all", "bed"):
        bed_part(max(1, a.reps - 1))
    if a.part == "ring":
        bed_part(max(1, a.reps - 1), ("ring",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
