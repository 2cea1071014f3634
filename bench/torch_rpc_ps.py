"""bench/torch_rpc_ps.py - `make bench`: a PyTorch torch.distributed.rpc
parameter server against restps (issue 20, "Peers"), 1 ps + 1 and 2
workers, async, the example's model (784-100-10, ReLU, softmax
cross-entropy), batch 100, sgd 0.01, Fashion-MNIST, one thread per process.

The PyTorch side is written here the way that API is meant for it: the ps
(rank 0) holds the model and a torch.optim.SGD; a worker loops
`rpc_sync(ps, get_params)`, forward/backward on its batch,
`rpc_sync(ps, push, grads)`, and the ps applies each push as it comes (async,
under a lock): the same pull / compute / push step as workerd's. Transport:
TensorPipe over TCP ("uv"), as between hosts (its shared-memory transport
only works on one host). Its rate is global steps over the ps's time from the
first push to the last. restps: psd + workerd --sync=0 on the same model,
data and flags, its rate the sum of the workers' steps/s. Both sides run
alternately, --reps times, best of each; torch runs with OPENBLAS_CORETYPE set
to the kernel workerd reports (as bench/cnn_compare.py), and both kernels are
printed. Target: restps >= 2x PyTorch's steps/s. Every process is started
here on free 127.0.0.1 ports and stopped by PID; never fails on a figure.

    /usr/bin/python3 bench/torch_rpc_ps.py [--bin=bin] [--steps=1500] [--reps=2]
"""
import argparse
import gzip
import os
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import free_port  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"
PY = "/usr/bin/python3"
BATCH, LR, HIDDEN = 100, 0.01, 100

# --- the PyTorch parameter server (rank 0) -----------------------------------
_ps = {}


def get_params():
    with _ps["lock"]:
        return [p.detach().clone() for p in _ps["model"].parameters()]


def push(grads):
    with _ps["lock"]:
        for p, g in zip(_ps["model"].parameters(), grads):
            p.grad = g
        _ps["opt"].step()
        _ps["step"] += 1
        now = time.perf_counter()
        if _ps["step"] == 1:
            _ps["t0"] = now
        _ps["t1"] = now
        return _ps["step"]


def make_model(torch):
    return torch.nn.Sequential(torch.nn.Linear(784, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))


def load_images(torch):
    with gzip.open(f"{DATA}/train-images-idx3-ubyte.gz") as f:
        x = f.read()[16:]
    with gzip.open(f"{DATA}/train-labels-idx1-ubyte.gz") as f:
        y = f.read()[8:]
    images = torch.frombuffer(bytearray(x), dtype=torch.uint8).reshape(-1, 784).float() / 255.0
    labels = torch.frombuffer(bytearray(y), dtype=torch.uint8).long()
    return images, labels


def member(rank, world, port, steps):
    import torch
    import torch.distributed.rpc as rpc
    torch.set_num_threads(1)
    torch.manual_seed(1 + rank)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4,
                                           _transports=["uv"], _channels=["basic"])
    if rank == 0:
        _ps.update(model=make_model(torch), lock=threading.Lock(), step=0, t0=0.0, t1=0.0)
        _ps["opt"] = torch.optim.SGD(_ps["model"].parameters(), lr=LR)
        rpc.init_rpc("ps", rank=0, world_size=world, rpc_backend_options=opts)
        rpc.shutdown()  # waits for every worker
        n = _ps["step"]
        rate = (n - 1) / (_ps["t1"] - _ps["t0"]) if n > 1 and _ps["t1"] > _ps["t0"] else 0.0
        blas = re.search(r"BLAS_INFO=(\S+)", torch.__config__.show())
        lib = os.path.realpath("/lib/x86_64-linux-gnu/libblas.so.3")  # what Debian's torch calls
        print(f"torch-ps: {n} pushes applied: {rate:.1f} steps/s; BLAS_INFO={blas.group(1).rstrip(',') if blas else '?'} "
              f"({os.path.basename(os.path.dirname(lib))}/{os.path.basename(lib)}), "
              f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}", flush=True)
        return
    images, labels = load_images(torch)
    model = make_model(torch)
    loss_fn = torch.nn.CrossEntropyLoss()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    g = torch.Generator().manual_seed(rank)
    order = torch.randperm(images.shape[0], generator=g)
    i, step = 0, 0
    while step < steps:
        if i + BATCH > order.numel():
            order, i = torch.randperm(images.shape[0], generator=g), 0
        idx = order[i:i + BATCH]
        i += BATCH
        with torch.no_grad():
            for p, v in zip(model.parameters(), rpc.rpc_sync("ps", get_params)):
                p.copy_(v)
        model.zero_grad(set_to_none=True)
        loss_fn(model(images[idx]), labels[idx]).backward()
        step = rpc.rpc_sync("ps", push, args=([p.grad for p in model.parameters()],))
    rpc.shutdown()


# --- the comparison -----------------------------------------------------------
started = []


def start(argv, env=None):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    started.append(p)
    return p


def stop_all():
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
    started.clear()


def run_torch(workers, steps, coretype):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    port = free_port()
    world = workers + 1
    ps = [start([PY, __file__, "--member", str(r), str(world), str(port), str(steps)], env) for r in range(world)]
    try:
        outs = [p.communicate(timeout=900)[0] for p in ps]
    finally:
        stop_all()
    for p, out in zip(ps, outs):
        if p.returncode != 0:
            raise RuntimeError(f"torch rpc member exited {p.returncode}:\n{out[-2000:]}")
    m = re.search(r"torch-ps: \d+ pushes applied: ([0-9.]+) steps/s; (.*)", outs[0])
    if not m:
        raise RuntimeError(f"torch ps printed no rate:\n{outs[0][-2000:]}")
    return float(m.group(1)), m.group(2)


def run_restps(bindir, workers, steps):
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    psd = start([f"{bindir}/psd", "--port=0", "--bind=127.0.0.1", "--logdir="])
    try:
        m = None
        for line in psd.stdout:  # its log lines, then the address
            m = re.search(r"listening on http://(\S+)", line)
            if m:
                break
        if not m:
            raise RuntimeError("psd did not start")
        hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(workers))
        args = [f"--data_dir={DATA}", f"--hidden_units={HIDDEN}", f"--batch_size={BATCH}", "--optimizer=sgd",
                f"--learning_rate={LR}", f"--train_steps={steps}", "--log_every=0", "--threads=1", "--sync=0",
                f"--ps_hosts={m.group(1)}", f"--worker_hosts={hosts}", "--keep_ps"]
        ws = [start([f"{bindir}/workerd", f"--task_index={i}"] + args, env) for i in range(workers)]
        outs = [w.communicate(timeout=900)[0] for w in ws]
    finally:
        stop_all()
    total, kernel = 0.0, "?"
    for w, out in zip(ws, outs):
        r = re.search(r"finished after \d+ local steps in [0-9.]+ s: ([0-9.]+) steps/s", out)
        if w.returncode != 0 or not r:
            raise RuntimeError(f"workerd exited {w.returncode}:\n{out[-2000:]}")
        total += float(r.group(1))
        k = re.search(r"cpu backend \(OpenBLAS ([A-Za-z0-9_]+)", out)
        kernel = k.group(1) if k else kernel
    return total, kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("RESTPS_BIN_DIR", "bin"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    try:
        import torch.distributed.rpc  # noqa: F401
    except ImportError as e:
        print(f"torch_rpc_ps: skipped: PyTorch with torch.distributed.rpc is not installed ({e}; "
              "sh scripts/deps.sh python3-torch)")
        return 0
    for f in ("workerd", "psd"):
        if not os.access(f"{a.bin}/{f}", os.X_OK):
            print(f"torch_rpc_ps: {a.bin}/{f} is missing (make all)", file=sys.stderr)
            return 1
    print(f"== parameter server peers: restps vs PyTorch torch.distributed.rpc (TensorPipe over TCP), "
          f"784-100-10 batch {BATCH} sgd {LR}, async, {a.steps} global steps (torch {max(200, a.steps // 3)}: "
          f"it is slower), best of {a.reps}, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'setup':>16} {'restps':>16} {'pytorch rpc':>16} {'restps/torch':>13}  kernels")
    for workers in (1, 2):
        rs, ts, kernel, tinfo = [], [], "?", "?"
        for _ in range(a.reps):
            r, kernel = run_restps(a.bin, workers, a.steps)
            rs.append(r)
            t, tinfo = run_torch(workers, max(200, a.steps // 3), kernel if kernel != "?" else None)
            ts.append(t)
        rb, tb = max(rs), max(ts)
        ratio = rb / tb if tb else float("nan")
        print(f"{f'1 ps + {workers} worker' + ('s' if workers > 1 else ''):>16} {rb:>10.1f} st/s {tb:>10.1f} st/s "
              f"{ratio:>12.2f}x  restps OpenBLAS {kernel}; torch {tinfo}   "
              f"(spread restps {min(rs):.0f}-{rb:.0f}, torch {min(ts):.0f}-{tb:.0f}; target >= 2x: "
              f"{'PASS' if ratio >= 2 else 'BELOW'}; load {os.getloadavg()[0]:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--member":
        member(*(int(v) for v in sys.argv[2:6]))
        sys.exit(0)
    try:
        sys.exit(main())
    finally:
        stop_all()
