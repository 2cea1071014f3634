"""bench/gloo_allreduce.py - `make bench`: restps's ring all-reduce
(bin/ring_allreduce, client/ring.c over HTTP) against PyTorch's gloo
all_reduce (torch.distributed, TCP), 2 processes on loopback, for the
example's gradients (79,511 floats, 318 KB) and 64 MiB (issue 20, "Peers").

gloo: each rank times every all_reduce after 3 warm-up ones (a barrier
before each), rank 0's median is printed. restps: ring_allreduce times the
same number of all-reduces after the same 3 untimed ones (--warmup=3: the
first two touch the receive slots of both step parities, 66,000 page faults
at 64 MiB) and the slower rank's median is taken. Each side runs --runs
times, alternating, and the median of those medians is printed. The limit is the loopback: a 2-task
all-reduce of M bytes moves M bytes each way at once, so it cannot take less
than M / bw at the bandwidth bench/loopback.py measures in the same run.
Neither side calls BLAS (the sum is a loop over floats). Targets: 318 KB
median <= 0.5x gloo's; 64 MiB within 2x of its bytes' time at that
bandwidth (issue 20), and within 1.6x (issue 33, part 4; printed beside it:
on loopback the "wire" is the cores' own copying, which the two tasks share,
so the figure that holds the ring to a link is bench/hosts.py's, on the test
bed). Every process is started here on free 127.0.0.1 ports and stopped
by PID; never fails on a figure.

    /usr/bin/python3 bench/gloo_allreduce.py [--bin=bin] [--runs=5]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import free_port  # noqa: E402
import loopback  # noqa: E402

PY = "/usr/bin/python3"
SMALL = 784 * 100 + 100 + 100 * 10 + 10 + 1  # the example's gradients + the loss, floats
BIG = 16 << 20  # 64 MiB of floats
started = []


def gloo_member(rank, port, floats, reps):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.full((floats,), float(rank + 1))
    times = []
    for i in range(reps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    print(f"gloo: rank {rank}: median {statistics.median(times):.6f} s over {len(times)}", flush=True)


def start(argv, env=None):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    started.append(p)
    return p


def finish_all(ps):
    try:
        outs = [p.communicate(timeout=600)[0] for p in ps]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
            p.wait()
        started.clear()
    for p, out in zip(ps, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{p.args[:3]} exited {p.returncode}:\n{out[-2000:]}")
    return outs


def gloo(floats, reps):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = finish_all([start([PY, __file__, "--member", str(r), str(port), str(floats), str(reps)], env)
                       for r in range(2)])
    return float(re.search(r"median ([0-9.]+) s", outs[0]).group(1))


WARMUP = 3  # as gloo_member's


def ring(bindir, floats, reps):
    hosts = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    outs = finish_all([start([f"{bindir}/ring_allreduce", f"--worker_hosts={hosts}", f"--task_index={r}",
                              f"--floats={floats}", f"--steps={WARMUP + reps}", f"--warmup={WARMUP}"])
                       for r in range(2)])
    return max(float(re.search(r"\(median ([0-9.]+) s over", o).group(1)) for o in outs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("RESTPS_BIN_DIR", "bin"))
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    try:
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            raise ImportError("no gloo in this build")
    except ImportError as e:
        print(f"gloo_allreduce: skipped: PyTorch with gloo is not installed ({e}; sh scripts/deps.sh python3-torch)")
        return 0
    if not os.access(f"{a.bin}/ring_allreduce", os.X_OK):
        print(f"gloo_allreduce: {a.bin}/ring_allreduce is missing (make bench-bins)", file=sys.stderr)
        return 1
    bw = loopback.bandwidth(128, 3)
    print(f"== all-reduce over 2 processes: restps ring (HTTP) vs PyTorch gloo (TCP); no BLAS on either side; "
          f"loopback {bw / 1e9:.2f} GB/s measured now; load {os.getloadavg()[0]:.2f}")
    print(f"{'buffer':>8} {'ring':>10} {'gloo':>10} {'ring/gloo':>10} {'bytes/bw':>10} {'ring/limit':>11}  target")
    for label, floats, reps in (("318 KB", SMALL, 50), ("64 MiB", BIG, 8)):
        rt, gt = [], []
        for _ in range(a.runs):  # alternating
            rt.append(ring(a.bin, floats, reps))
            gt.append(gloo(floats, reps))
        r, g = statistics.median(rt), statistics.median(gt)
        limit = floats * 4 / bw
        if label == "318 KB":
            target = f"ring/gloo <= 0.5: {'PASS' if r / g <= 0.5 else 'BELOW'}"
        else:
            target = (f"ring/limit <= 2: {'PASS' if r / limit <= 2 else 'BELOW'}; "
                      f"<= 1.6: {'PASS' if r / limit <= 1.6 else 'BELOW'}")
        print(f"{label:>8} {r * 1e3:>8.2f}ms {g * 1e3:>8.2f}ms {r / g:>10.2f} {limit * 1e3:>8.2f}ms {r / limit:>11.2f}  "
              f"{target}  (ring {min(rt) * 1e3:.2f}-{max(rt) * 1e3:.2f}, gloo {min(gt) * 1e3:.2f}-{max(gt) * 1e3:.2f} ms "
              f"over {a.runs} runs; load {os.getloadavg()[0]:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--member":
        gloo_member(*(int(v) for v in sys.argv[2:6]))
        sys.exit(0)
    sys.exit(main())
