"""bench/pipeline.py - `make bench`: model parallelism (workerd
--pipeline_stages) on loopback, 2 stages of mlp:1024,523 (784x1024 and
1024x523 dense layers: the balanced split puts one on each stage, 3.2 MFLOP
per example each as computed: the first layer computes no input gradient,
4 x 784 x 1024, the second 6 x 1024 x 523):

1. the bubble: each stage's measured idle fraction in the steady state
   (steps 2 on: 1 - compute time / wall time, from its last line) with gpipe
   and M = 1, 2, 4, 8 micro-batches, against the fill-drain bound
   (K-1)/(M+K-1) of equal stages;
2. throughput: 2 stages with M = 8 against one process (--local) with the
   same global batch, steps/s, in the same run; and 1f1b against gpipe;
3. activation transfer: the bytes and seconds per message the stages'
   sends took (libcurl POSTs to the neighbour) against GET /v1/vars/NAME of
   a psd variable of the same bytes (the ps pull route; Python http.client
   on a kept-alive connection, median of 50).

4. the CNN (--model=cnn) as the issue asks: 2 stages at M = 8, gpipe and
   1f1b, against --local with the same batch, in alternating rounds (best of
   PIPELINE_ROUNDS, default 3), with the load average beside it, and the
   bound the split itself sets: the whole step's computed FLOPs over the
   larger stage's (the plan's costs, GET /v1/pipeline's flops_per_example);
5. 1f1b's peak activation memory against gpipe's: each CNN stage's peak
   resident set (VmHWM of /proc/PID/status, read every 5 ms) at M = 8 with
   each schedule (the parameters are the same, so the difference is the
   micro-batches' activations in flight: gpipe holds M, 1f1b at most K - s).
6. a model where compute dominates, as the issue allows for the 1.5x:
   mlp:2048,1536,256,2048,2048 at batch 4096 (M = 8: micro-batches of 512),
   whose balanced split (27.7 | 28.4 MFLOP per example as computed) cuts at
   the 256-wide layer, so a message is 512 KB against about 14 GFLOP of a
   stage's compute per micro-batch; 2 stages against --local,
   alternating rounds (PIPELINE_WIDE_ROUNDS, default 5): the best of each,
   and the median and range of the ratio taken round by round.

Every process is started here on free 127.0.0.1 ports and stopped by PID.
Prints figures, never fails on one. RESTPS_BIN_DIR picks the build (bin/).
On this 2-core machine the two stages have a core each only when nothing
else runs: the figures are ratios on this machine, not claims about a cluster.
"""
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchlib import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
DATA = os.environ.get("PIPELINE_DATA", "/usr/share/datasets/fashion-mnist")
MODEL = "mlp:1024,523"
BATCH = 256
STEPS = int(os.environ.get("PIPELINE_STEPS", "12"))
STEADY = re.compile(r"stage (\d+) steady state \(steps 2-\d+\): ([0-9.]+) steps/s, ([0-9.]+) s, busy ([0-9.]+) s, "
                    r"waiting ([0-9.]+) s, idle fraction ([0-9.]+); received (\d+) messages; sends ([0-9.]+) s")
SENT = re.compile(r"stage (\d+) finished .* (\d+) bytes sent")


def train_args(model, steps, batch):
    return [f"--data_dir={DATA}", f"--model={model}", "--optimizer=sgd", "--learning_rate=0.01",
            f"--train_steps={steps}", f"--batch_size={batch}", "--log_every=0", "--threads=1"]


def common():
    return train_args(MODEL, STEPS, BATCH)


def hwm(pid):
    """VmHWM of pid in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                if ln.startswith("VmHWM:"):
                    return int(ln.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pipeline(m, sched, args=None, peaks=None):
    """2 stages; each one's steady-state figures. peaks: a dict that gets
    each stage's peak resident set (task i is stage i)."""
    hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    procs, files = [], []
    try:
        for i in (1, 0):
            argv = [os.path.join(BIN, "workerd"), f"--worker_hosts={hosts}", f"--task_index={i}",
                    "--pipeline_stages=2", f"--micro_batches={m}", f"--pipeline_schedule={sched}"] + (args or common())
            f = tempfile.TemporaryFile()
            files.append(f)
            procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT))
        peak = [0, 0]
        deadline = time.monotonic() + 600
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if peaks is not None:  # 2 reads of /proc every 5 ms: only when the peaks are wanted
                for k, p in enumerate(procs):
                    peak[k] = max(peak[k], hwm(p.pid))
            time.sleep(0.005 if peaks is not None else 0.1)
        if peaks is not None:
            peaks[1], peaks[0] = peak
        outs = []
        for f in files:
            f.seek(0)
            outs.append(f.read().decode())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    stages = {}
    for out in outs:
        mt, ms = STEADY.search(out), SENT.search(out)
        if not mt or not ms:
            print("  a stage failed:", out[-1500:])
            return None
        s = int(mt.group(1))
        stages[s] = {"sps": float(mt.group(2)), "idle": float(mt.group(6)), "msgs": int(mt.group(7)),
                     "send_secs": float(mt.group(8)), "bytes": int(ms.group(2))}
    return stages


def local_sps(args=None):
    out = subprocess.run([os.path.join(BIN, "workerd"), "--local"] + (args or common()), capture_output=True,
                         timeout=600).stdout.decode()
    m = re.search(r"(\d+) steps in ([0-9.]+) s", out)
    return int(m.group(1)) / float(m.group(2)) if m else None


def ps_pull_secs(nbytes):
    """Median seconds of GET /v1/vars/act (nbytes of float32) from a psd."""
    p = subprocess.Popen([os.path.join(BIN, "psd"), "--port=0", "--logdir="], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    try:
        line = p.stdout.readline().decode()
        port = int(line.rsplit(":", 1)[1])
        n = nbytes // 4
        body = bytes(nbytes)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/vars/act?shape={n}", data=body, method="PUT",
                                     headers={"Content-Type": "application/octet-stream", "X-Shape": str(n)})
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30).read()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            c.request("GET", "/v1/vars/act")
            r = c.getresponse()
            data = r.read()
            times.append(time.perf_counter() - t0)
            assert r.status == 200 and len(data) == nbytes, (r.status, len(data))
        return statistics.median(times)
    except Exception as e:  # a figure, never a failure
        print(f"  the psd pull failed: {e}")
        return None
    finally:
        p.terminate()
        p.wait()


def main():
    if not os.path.isdir(DATA):
        print(f"bench/pipeline.py: {DATA} is missing: skipped")
        return 0
    print(f"pipeline: 2 stages of {MODEL}, batch {BATCH}, {STEPS} steps, sgd, 1 OpenBLAS thread each")
    print("1. the bubble (gpipe): each stage's idle fraction against (K-1)/(M+K-1)")
    runs = {}
    for m in (1, 2, 4, 8):
        st = pipeline(m, "gpipe")
        if not st:
            continue
        runs[m] = st
        bound = 1 / (m + 1)
        print(f"  M={m}: bound {bound:.3f}; stage 0 idle {st[0]['idle']:.3f} ({st[0]['idle'] / bound:.2f}x), "
              f"stage 1 idle {st[1]['idle']:.3f} ({st[1]['idle'] / bound:.2f}x); {st[0]['sps']:.2f} steps/s")
    print("2. throughput at M = 8 against one process with the same batch")
    loc = local_sps()
    f1 = pipeline(8, "1f1b")
    if loc and 8 in runs:
        g = runs[8][0]["sps"]
        print(f"  --local {loc:.2f} steps/s; 2 stages gpipe {g:.2f} steps/s ({g / loc:.2f}x)"
              + (f", 1f1b {f1[0]['sps']:.2f} steps/s ({f1[0]['sps'] / loc:.2f}x)" if f1 else ""))
    print("3. activation transfer against a ps pull of the same bytes")
    if 8 in runs:
        st = runs[8]
        per_msg = st[0]["bytes"] // max(1, STEPS * 8 + 0)  # stage 0 sends M activations a step, then its 0 params
        send = st[0]["send_secs"] / (STEPS * 8)
        ps = ps_pull_secs(per_msg)
        print(f"  stage 0 -> 1: {per_msg} bytes per message, {send * 1e3:.3f} ms per send (libcurl POST)"
              + (f"; psd GET /v1/vars of {per_msg} bytes {ps * 1e3:.3f} ms ({send / ps:.2f}x)" if ps else ""))
    cnn()
    compute_bound()
    return 0


def load():
    return os.getloadavg()[0]


def local_steady_sps(args, batch):
    """--local's steps/s over steps 2 on (the stages' steady state leaves step 1 out too:
    OpenBLAS sets up its buffers there), from its per-step lines."""
    out = subprocess.run([os.path.join(BIN, "workerd"), "--local"] + [a for a in args if not a.startswith("--log_every")] + ["--log_every=1"], capture_output=True,
                         timeout=600).stdout.decode()
    eps = [float(x) for x in re.findall(r"step \d+ loss [0-9.]+ examples/s ([0-9.]+)", out)][1:]
    return len(eps) / sum(batch / e for e in eps) if eps and all(eps) else None


def split_bound(model):
    """The plan's computed FLOPs per example of each stage (stage 0's /v1/pipeline)."""
    hosts = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    p = subprocess.Popen([os.path.join(BIN, "workerd"), f"--worker_hosts={','.join(hosts)}", "--task_index=0",
                          "--pipeline_stages=2", f"--data_dir={DATA}", f"--model={model}",
                          "--pipeline_timeout_secs=5", "--log_every=0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                        f"http://{hosts[0]}/v1/pipeline", timeout=2) as r:
                    j = json.loads(r.read())
                return [st["flops_per_example"] for st in j["split"]], j["stage_layers"]
            except OSError:
                time.sleep(0.1)
        return None, None
    finally:
        p.kill()
        p.wait()


def rounds_against_local(args, batch, rounds, want_peaks=True):
    """--local, then 2 stages at M = 8 with each schedule, in alternating
    rounds; prints the best steps/s of each and their ratio, and the ratio
    round by round (each schedule against the --local run just before it:
    pairing keeps it meaningful when the machine's speed drifts between
    rounds), its median and range; returns each schedule's peak resident
    set per stage (want_peaks: else not read, so the stages share the 2
    cores with nothing of the bench's)."""
    best = {"local": 0.0, "gpipe": 0.0, "1f1b": 0.0}
    ratios = {"gpipe": [], "1f1b": []}
    peaks = {"gpipe": [0, 0], "1f1b": [0, 0]}
    loads = []
    for _ in range(rounds):
        loads.append(load())
        loc = local_steady_sps(args, batch) or 0
        best["local"] = max(best["local"], loc)
        for sched in ("gpipe", "1f1b"):
            pk = {} if want_peaks else None
            st = pipeline(8, sched, args, pk)
            if st:
                best[sched] = max(best[sched], st[0]["sps"])
                peaks[sched] = [max(peaks[sched][k], (pk or {}).get(k, 0)) for k in range(2)]
                if loc:
                    ratios[sched].append(st[0]["sps"] / loc)
        loads.append(load())
    loc = best["local"]
    if loc:
        print(f"  --local {loc:.3f} steps/s (steps 2 on); gpipe {best['gpipe']:.3f} ({best['gpipe'] / loc:.2f}x), "
              f"1f1b {best['1f1b']:.3f} ({best['1f1b'] / loc:.2f}x) steps/s (steady state, best of each); "
              f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
        if all(ratios.values()):
            print("  round by round, against that round's --local: " + ", ".join(
                f"{k} median {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f}, {len(v)} rounds: "
                + " ".join(f"{x:.2f}" for x in v) + ")" for k, v in ratios.items()))
    return peaks


def cnn():
    rounds = int(os.environ.get("PIPELINE_ROUNDS", "3"))
    steps = int(os.environ.get("PIPELINE_CNN_STEPS", "6"))
    batch = int(os.environ.get("PIPELINE_CNN_BATCH", "256"))
    print(f"4. the CNN, 2 stages at M = 8 (batch {batch}, {steps} steps) against --local, "
          f"best of {rounds} alternating rounds")
    costs, split = split_bound("cnn")
    if costs:
        print(f"  the split {split}: computed FLOPs per example {costs[0]} | {costs[1]}: at most "
              f"{sum(costs) / max(costs):.2f}x --local however well the stages overlap")
    peaks = rounds_against_local(train_args("cnn", steps, batch), batch, rounds)
    print("5. peak resident set per CNN stage at M = 8 (the activations in flight: gpipe M, 1f1b K - s)")
    for k in range(2):
        g, f = peaks["gpipe"][k], peaks["1f1b"][k]
        if g and f:
            print(f"  stage {k}: gpipe {g / 1e6:.1f} MB, 1f1b {f / 1e6:.1f} MB "
                  f"(1f1b {(g - f) / 1e6:.1f} MB less, {f / g:.2f}x)")


def compute_bound():
    rounds = int(os.environ.get("PIPELINE_WIDE_ROUNDS", "5"))
    steps = int(os.environ.get("PIPELINE_WIDE_STEPS", "5"))
    model, batch = "mlp:2048,1536,256,2048,2048", int(os.environ.get("PIPELINE_WIDE_BATCH", "4096"))
    print(f"6. {model}, 2 stages at M = 8 (batch {batch}, {steps} steps) against --local, "
          f"best of {rounds} alternating rounds")
    costs, split = split_bound(model)
    if costs:
        print(f"  the split {split}: computed FLOPs per example {costs[0]} | {costs[1]}: at most "
              f"{sum(costs) / max(costs):.2f}x --local, {sum(costs) / max(costs) * 8 / 9:.2f}x with the "
              f"fill-drain bubble of M = 8")
    rounds_against_local(train_args(model, steps, batch), batch, rounds, want_peaks=False)


if __name__ == "__main__":
    sys.exit(main())
