"""A PyTorch training worker for a restps job, beside workerd's C workers.

It trains the example's model (--model=mlp:H1,H2,..., default mlp:100: dense
layers + ReLU, then dense 10; the variables workerd names hid_w hid_b sm_w
sm_b, or hid0_w ... for more than one hidden layer) with torch's own
autograd, pulling the parameters from the ps tasks and pushing its gradients
through the restps package, in the job's mode (sync or async: the chief's
configuration decides, as for workerd). Its batches are the ones a workerd
of the same --task_index would take (restps.data: the same split, the same
epoch order from --seed), so in a sync job it computes what that workerd
would have, and the ps's model is the one an all-C job reaches, within
float32 round-off.

    python3 client/python/examples/torch_worker.py --job_name=worker --task_index=1 \\
        --ps_hosts=localhost:2222 --worker_hosts=localhost:2223,localhost:2224 --train_steps=1000

or with TF_CONFIG set as for workerd. Needs torch (Debian: python3-torch)
and numpy; the restps package from this folder's parent (pip install
./client/python, or PYTHONPATH=client/python)."""
import argparse
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import restps  # noqa: E402  (the package beside this folder when it is not installed)
from restps import data  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job_name", default="worker")
    p.add_argument("--task_index", type=int, default=0)
    p.add_argument("--ps_hosts", default=None)
    p.add_argument("--worker_hosts", default=None)
    p.add_argument("--chief_hosts", default=None)
    p.add_argument("--model", default="mlp:100")
    p.add_argument("--batch_size", type=int, default=100)
    p.add_argument("--train_steps", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data_dir", default=data.DEFAULT_DATA)
    p.add_argument("--auth_token_file", default=None, help="file holding the ps tasks' bearer token")
    p.add_argument("--tls_ca", default=None, help="HTTPS to the ps tasks, trusting this CA file")
    p.add_argument("--log_every", type=int, default=100)
    return p.parse_args(argv)


def cluster_of(a, token):
    """The ps tasks and this task's trainer index, from the flags or TF_CONFIG (flags win)."""
    kw = {"tls": bool(a.tls_ca), "ca_file": a.tls_ca, "retry_secs": 30.0}
    if a.ps_hosts:
        workers = a.worker_hosts.split(",") if a.worker_hosts else []
        chief = a.chief_hosts.split(",") if a.chief_hosts else []
        return restps.Cluster(a.ps_hosts.split(","), token, task_type=a.job_name, task_index=a.task_index,
                              n_chief=len(chief), n_workers=len(workers), **kw)
    return restps.Cluster.from_tf_config(token=token, **kw)


def mlp_names(spec):
    """[(w, b)] of the dense layers of mlp:H1,H2,... in workerd's names."""
    if not spec.startswith("mlp:"):
        raise SystemExit(f"torch_worker: --model={spec}: only mlp:H1,H2,... here")
    hidden = [int(h) for h in spec[4:].split(",") if h]
    if len(hidden) == 1:
        return [("hid_w", "hid_b"), ("sm_w", "sm_b")]
    return [(f"hid{i}_w", f"hid{i}_b") for i in range(len(hidden))] + [("sm_w", "sm_b")]


def loss_and_grads(layers, params, x, y):
    """The mean softmax cross-entropy of the MLP on x [B, 784] and its
    gradients, by torch's autograd, as float32 numpy arrays."""
    t = {k: torch.from_numpy(v).requires_grad_(True) for k, v in params.items()}
    h = torch.from_numpy(x)
    for i, (w, b) in enumerate(layers):
        h = h @ t[w] + t[b]
        if i < len(layers) - 1:
            h = torch.relu(h)
    loss = torch.nn.functional.cross_entropy(h, torch.from_numpy(y.astype(np.int64)))
    loss.backward()
    return float(loss), {k: v.grad.numpy() for k, v in t.items()}


def wait_ready(cl):
    while True:
        try:
            if cl.ready():
                return
        except restps.NetworkError:
            pass
        time.sleep(0.2)


def heartbeats(a, token, worker, stop):
    """The lease on every ps while this worker computes (a sync step waits only for live workers)."""
    hb = cluster_of(a, token)
    while not stop.wait(1.0):
        try:
            hb.heartbeat(worker)
        except restps.RestpsError:
            pass
    hb.close()


def main(argv=None):
    a = parse_args(argv)
    token = open(a.auth_token_file).read().strip() if a.auth_token_file else None
    torch.manual_seed(a.seed)
    cl = cluster_of(a, token)
    worker = cl.trainer
    if worker is None:
        raise SystemExit("torch_worker: this task is not a training task (--job_name=worker or chief)")
    layers = mlp_names(a.model)
    names = [n for wb in layers for n in wb]
    ds = data.load(a.data_dir)
    x_train, y_train = ds["train"]
    x_train = x_train.reshape(len(x_train), -1)
    batches = data.Batches(len(x_train), a.seed, worker, cl.n_trainers, a.batch_size)

    print(f"torch worker {worker}: {len(x_train)} training examples loaded; waiting for the chief", flush=True)
    wait_ready(cl)
    cfg = cl.clients[0].config()
    sync = bool(cfg.get("sync"))
    print(f"torch worker {worker}: training {'sync' if sync else 'async'}, {cfg.get('optimizer')}, "
          f"{cl.n_trainers} tasks, batch {a.batch_size}, until global step {a.train_steps}; torch {torch.__version__}",
          flush=True)
    stop = threading.Event()
    hb = threading.Thread(target=heartbeats, args=(a, token, worker, stop), daemon=True)
    if sync:
        hb.start()
    want = None      # sync: the step after the one last pushed, per ps
    k, local, t0 = None, 0, time.monotonic()
    try:
        while True:
            try:
                params = cl.pull(names, min_step=want, worker=worker if sync else None)
            except restps.NetworkError:
                if local and cl.steps[0] + cl.n_trainers >= a.train_steps:
                    break     # the chief stopped the ps at the end
                raise
            step = params.global_step
            if step >= a.train_steps:
                break
            # sync: batch number = the global step (what a C worker of this index takes);
            # async: this task's own count, started where the others are
            if k is None or sync:
                k = step if sync else step // cl.n_trainers
            idx, _ = batches.indices(k)
            k += 1
            loss, grads = loss_and_grads(layers, params, x_train[idx], y_train[idx])
            try:
                res = cl.push(grads, worker=worker, loss=loss, batch_size=a.batch_size)
            except restps.Conflict:
                want = None   # a ps is behind the step we computed from (it restarted): pull again
                continue
            except restps.NetworkError:
                if cl.steps[0] + cl.n_trainers >= a.train_steps:
                    break
                raise
            if sync:
                want = [s + 1 for s in cl.steps]
            local += 1
            if a.log_every and local % a.log_every == 0:
                print(f"torch worker {worker}: local step {local}, global step {res[0]['global_step']}, "
                      f"loss {loss:.4f}, {local / (time.monotonic() - t0):.1f} steps/s", flush=True)
    finally:
        stop.set()
    try:
        cl.done(worker)
    except restps.RestpsError:
        pass          # the ps tasks already stopped
    print(f"torch worker {worker}: done after {local} local steps", flush=True)
    cl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
