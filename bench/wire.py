"""bench/wire.py - `make bench`: one round trip and half the bytes (issue 33,
parts 2 and 3), each measured against its peer in the same run.

1. One round trip: 1 worker + 1 ps on loopback, async SGD, the example's
   model (784-100-10, batch 100, 1 thread): `--one_round_trip=false` (a push,
   then a pull: 2 requests a step) against the default (the push answers
   with the parameters, POST /v1/grads?return=params: 1 request), alternating,
   best of WIRE_REPS; requests per step from psd's /metrics; the ratio of
   the step rates.
2. Accuracy with 16-bit bodies: the example's sync run (784-100-10, Adam
   0.01, 2 workers x batch 50, WIRE_STEPS steps) with --wire_dtype=fp32,
   bf16 and fp16 for each of WIRE_EXAMPLE_SEEDS (9: fp32's own seeds
   span more than a point, so 3 do not resolve 0.3 points); the mean test accuracy of each and
   its distance from fp32's (target: within 0.3 points); then the CNN
   (--model=cnn, Adam 0.001, WIRE_CNN_STEPS steps; about 50 s a run on 2
   cores; WIRE_CNN=0 leaves it out).
3. Bandwidth: 4 sync workers and 1 ps, each on its own host of the test bed
   (deploy/netns/hosts.sh, 1 Gbit/s NICs, bench/hosts.py's ps_job), a
   transfer-bound model (mlp:1024,1024, batch 16): steps/s with bf16 against
   fp32 (target >= 1.7x), and with --topk_ratio=TOPK_RATIO (fp32 and bf16
   pulls: the pushes carry ids and values, the pulls stay dense). Needs root;
   skipped otherwise, saying so.
4. Top-k with error feedback (--topk_ratio, issue 33's optional part): the
   example's sync run with sgd (784-100-10, 0.05, 2 workers x batch 50,
   TOPK_STEPS steps), dense against --topk_ratio=TOPK_RATIO, for each of
   WIRE_SEEDS: the mean test accuracy of each (DGC and BytePS report within
   a point) and the push bytes (psd's /metrics) of each.

Prints figures beside their targets; exit status non-zero only when a run
broke. Environment: WIRE_REPS (3), WIRE_ROUNDTRIP_STEPS (3000), WIRE_STEPS
(10000), WIRE_SEEDS ("1 2 3"), WIRE_EXAMPLE_SEEDS ("1 2 ... 9"), WIRE_CNN (1), WIRE_CNN_STEPS (550),
WIRE_HOSTS (1), TOPK_RATIO (0.01), TOPK_STEPS (3000), RESTPS_BIN_DIR (bin)."""
import os
import re
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import free_port  # noqa: E402

ROOT = os.path.dirname(HERE)
BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
DATA = "/usr/share/datasets/fashion-mnist"
REPS = int(os.environ.get("WIRE_REPS", "3"))
RT_STEPS = int(os.environ.get("WIRE_ROUNDTRIP_STEPS", "3000"))
STEPS = int(os.environ.get("WIRE_STEPS", "10000"))
SEEDS = [int(s) for s in os.environ.get("WIRE_SEEDS", "1 2 3").split()]
EXAMPLE_SEEDS = [int(s) for s in os.environ.get("WIRE_EXAMPLE_SEEDS", "1 2 3 4 5 6 7 8 9").split()]
CNN = os.environ.get("WIRE_CNN", "1") == "1"
CNN_STEPS = int(os.environ.get("WIRE_CNN_STEPS", "550"))
HOSTS = os.environ.get("WIRE_HOSTS", "1") == "1"
TOPK = os.environ.get("TOPK_RATIO", "0.01")
TOPK_STEPS = int(os.environ.get("TOPK_STEPS", "3000"))


def env():
    e = dict(os.environ)
    e.pop("OPENBLAS_CORETYPE", None)
    return e


class Psd:
    def __init__(self, port, n_workers=1):
        self.port = port
        self.p = subprocess.Popen([f"{BIN}/psd", f"--port={port}", "--bind=127.0.0.1", "--logdir="],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("psd did not start")

    def requests(self, route):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        return sum(int(float(ln.rsplit(" ", 1)[1])) for ln in text.splitlines()
                   if ln.startswith("restps_requests_total{") and f'route="{route}"' in ln)

    def bytes_in(self, route):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith("restps_received_bytes_total{") and f'route="{route}"' in ln)

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def job(n, args, keep_ps=False):
    """A job of n workers on one psd; (outputs, psd) (psd stopped unless keep_ps)."""
    port = free_port()
    ps = Psd(port)
    workers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n))
    try:
        procs = [subprocess.Popen([f"{BIN}/workerd", "--job_name=worker", f"--task_index={i}",
                                   f"--ps_hosts=127.0.0.1:{port}", f"--worker_hosts={workers}", f"--data_dir={DATA}",
                                   "--log_every=0"] + args + (["--keep_ps"] if keep_ps and i == 0 else []),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
                 for i in range(n)]
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"workerd exited {p.returncode}:\n{out[-2000:]}")
            outs.append(out)
        return outs, ps
    finally:
        if not keep_ps:
            ps.stop()


def rate(out):
    m = re.findall(r"([0-9.]+) steps/s", out)
    if not m:
        raise RuntimeError("no steps/s:\n" + out[-2000:])
    return float(m[-1])


def accuracy(outs):
    for out in outs:
        m = re.findall(r"test accuracy ([0-9.]+)", out)
        if m:
            return float(m[-1])
    raise RuntimeError("no test accuracy:\n" + outs[0][-2000:])


def round_trip():
    print(f"== one round trip: 1 worker + 1 ps on loopback, async sgd, 784-100-10 batch 100, {RT_STEPS} steps, "
          f"best of {REPS} (load {os.getloadavg()[0]:.2f})", flush=True)
    args = [f"--train_steps={RT_STEPS}", "--sync=0", "--optimizer=sgd", "--learning_rate=0.01", "--hidden_units=100",
            "--batch_size=100", "--threads=1"]
    best, per_step = {}, {}
    for _ in range(REPS):
        for flag in ("false", "true"):
            outs, ps = job(1, args + [f"--one_round_trip={flag}"], keep_ps=True)
            try:
                per_step[flag] = (ps.requests("/v1/grads") + ps.requests("/v1/params")) / RT_STEPS
            finally:
                ps.stop()
            best[flag] = max(best.get(flag, 0), rate(outs[0]))
    r = best["true"] / best["false"]
    print(f"push, then pull:  {best['false']:8.1f} steps/s, {per_step['false']:.2f} requests a step")
    print(f"one round trip:   {best['true']:8.1f} steps/s, {per_step['true']:.2f} requests a step")
    print(f"ratio {r:.2f}x (the step {1e6 / best['false']:.0f} us -> {1e6 / best['true']:.0f} us); requests a step "
          f"{per_step['false']:.2f} -> {per_step['true']:.2f} (target 2 -> 1: "
          f"{'PASS' if per_step['true'] <= 1.01 else 'BELOW'})", flush=True)


def parity(label, args, seeds):
    print(f"== {label}: sync, 2 workers, test accuracy by --wire_dtype, seeds {seeds} "
          f"(load {os.getloadavg()[0]:.2f})", flush=True)
    acc = {}
    for seed in seeds:
        for dt in ("fp32", "bf16", "fp16"):
            t = time.monotonic()
            outs, _ = job(2, args + [f"--seed={seed}", f"--wire_dtype={dt}"])
            acc.setdefault(dt, []).append(accuracy(outs))
            print(f"seed {seed} {dt}: test accuracy {acc[dt][-1]:.4f} ({time.monotonic() - t:.0f} s)", flush=True)
    mean = {dt: sum(v) / len(v) for dt, v in acc.items()}
    print(f"{label}: fp32's seeds span {min(acc['fp32']):.4f}-{max(acc['fp32']):.4f} "
          f"({(max(acc['fp32']) - min(acc['fp32'])) * 100:.2f} points: the noise the means are compared within)")
    for dt in ("bf16", "fp16"):
        d = (mean[dt] - mean["fp32"]) * 100
        print(f"{label}: {dt} mean {mean[dt]:.4f} vs fp32 {mean['fp32']:.4f}: {d:+.2f} points "
              f"(target within 0.3: {'PASS' if abs(d) <= 0.3 else 'BELOW'})", flush=True)


def bandwidth():
    print("== half the bytes on the test bed: 4 sync workers + 1 ps, each its own host, 1 Gbit/s NICs, "
          "mlp:1024,1024 batch 16 (bench/hosts.py's job)", flush=True)
    if os.geteuid() != 0:
        print("bench/wire.py: the test bed part skipped: network namespaces need root (run make bench as root)")
        return
    import hosts as hb
    hb.hosts("down", check=False)
    hb.hosts("up", str(hb.MAX_PS + 4), f"--rate={hb.RATE}")
    try:
        t = {}
        for dt in ("fp32", "bf16", "fp32+topk", "bf16+topk"):
            wire = dt.split("+")[0]
            extra = (f"--wire_dtype={wire}",) + ((f"--topk_ratio={TOPK}",) if "topk" in dt else ())
            t[dt], _ = hb.ps_job(4, 1, extra=extra)
            print(f"{dt}: {t[dt] * 1e3:.0f} ms a step ({1 / t[dt]:.2f} steps/s)", flush=True)
        r = t["fp32"] / t["bf16"]
        print(f"bf16 {r:.2f}x fp32's steps/s (target >= 1.7x: {'PASS' if r >= 1.7 else 'BELOW'})", flush=True)
        for dt in ("fp32+topk", "bf16+topk"):
            print(f"{dt} (--topk_ratio={TOPK}) {t['fp32'] / t[dt]:.2f}x fp32's steps/s (no target: the pulls stay "
                  f"dense, so at most 2x, bf16 pulls 4x)", flush=True)
    finally:
        hb.hosts("down", check=False)


def topk_parity():
    print(f"== top-k with error feedback: the example's sync run (784-100-10, sgd 0.05, 2 workers x batch 50, "
          f"{TOPK_STEPS} steps), dense vs --topk_ratio={TOPK}, seeds {SEEDS} (load {os.getloadavg()[0]:.2f})",
          flush=True)
    args = [f"--train_steps={TOPK_STEPS}", "--sync=1", "--hidden_units=100", "--batch_size=50", "--threads=1",
            "--optimizer=sgd", "--learning_rate=0.05"]
    acc, sent = {}, {}
    for seed in SEEDS:
        for r in ("0", TOPK):
            outs, ps = job(2, args + [f"--seed={seed}", f"--topk_ratio={r}"], keep_ps=True)
            try:
                sent.setdefault(r, []).append(ps.bytes_in("/v1/grads"))
            finally:
                ps.stop()
            acc.setdefault(r, []).append(accuracy(outs))
            print(f"seed {seed} topk_ratio {r}: test accuracy {acc[r][-1]:.4f}, push bytes {sent[r][-1] / 1e6:.1f} MB",
                  flush=True)
    mean = {r: sum(v) / len(v) for r, v in acc.items()}
    d = (mean[TOPK] - mean["0"]) * 100
    print(f"dense's seeds span {min(acc['0']):.4f}-{max(acc['0']):.4f}; top-k mean {mean[TOPK]:.4f} vs dense "
          f"{mean['0']:.4f}: {d:+.2f} points (within a point: {'PASS' if abs(d) <= 1 else 'BELOW'}) with "
          f"{sum(sent['0']) / sum(sent[TOPK]):.0f}x fewer push bytes", flush=True)


def main():
    for f in ("workerd", "psd"):
        if not os.access(f"{BIN}/{f}", os.X_OK):
            print(f"bench/wire.py: {BIN}/{f} is missing (make all)", file=sys.stderr)
            return 1
    if not os.path.isdir(DATA):
        print(f"bench/wire.py: {DATA} is missing (make deps)", file=sys.stderr)
        return 1
    round_trip()
    parity("the example (784-100-10, adam 0.01)",
           [f"--train_steps={STEPS}", "--sync=1", "--hidden_units=100", "--batch_size=50", "--threads=1"], EXAMPLE_SEEDS)
    if CNN:
        parity("the CNN", [f"--train_steps={CNN_STEPS}", "--sync=1", "--model=cnn", "--batch_size=50",
                           "--learning_rate=0.001", "--threads=1"], SEEDS)
    else:
        print("the CNN's parity: left out (WIRE_CNN=0)")
    topk_parity()
    if HOSTS:
        bandwidth()
    return 0


if __name__ == "__main__":
    sys.exit(main())
