"""Every distributed mode with a CNN (issue 19): a small one,
conv:3x3x8,pool:2,dense:32,dense:10 (with a dropout in the sync comparisons),
few steps and small batches, on the real Fashion-MNIST data.

- sync: 2 workers x batch 50 == 1 worker x batch 100 (sgd, max abs <= 1e-5),
  dropout included, so its mask follows the example, not the row; two sync
  runs with one seed export bit-identical files (another seed does not);
- async with an SSP bound (--staleness) learns, backup workers (--replicas_to_aggregate below the
  workers), 2 ps tasks with a tensor larger than --partition_bytes split by
  rows (sync: the same model as with 1 ps, bit for bit), ring all-reduce (the
  same model as ps sync), the evaluator, a psd checkpoint (its metadata names
  the model; the independent reader validates it) and the restore from it;
- --local: bit for bit what one async worker against psd exports; the exported
  file's metadata (model, input_shape) rebuild the model in numpy
  (tests/helpers/cnn_ref.py), whose test accuracy on the exported parameters
  is workerd's, as --evaluate_model=FILE's is.
"""
import gzip
import json
import os
import re
import signal
import struct
import subprocess

import numpy as np
import pytest

import ckpt_check
import cnn_ref  # tests/helpers (conftest.py puts it on sys.path)
from conftest import BIN, SANITIZER_MARKS, binary, http
from test_recovery import jobs, parse_safetensors  # noqa: F401 (fixture)
from test_ring import check_hashes, finish, procs, ring_job  # noqa: F401 (fixture)
from test_train import DATA, accuracy_of, cluster, load_model, run  # noqa: F401 (fixture)

ASAN = "asan" in BIN
SMALL = "conv:3x3x8,pool:2,dense:32,dense:10"
SMALL_DROP = "conv:3x3x8,pool:2,dense:32,dropout:0.25,dense:10"
NAMES = {"conv0_w", "conv0_b", "fc0_w", "fc0_b", "sm_w", "sm_b"}
pytestmark = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")


N_TRAIN, N_TEST = 7000, 1000    # the first 5,000 training images are the validation set


def read_idx(name):
    with gzip.open(os.path.join(DATA, name + ".gz")) as f:
        return f.read()


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """The first 7,000 training and 1,000 test images of Fashion-MNIST as raw
    IDX files: the final evaluation (validation + test) of every run is most
    of a short CNN run's time on the full 15,000."""
    d = tmp_path_factory.mktemp("fashion-small")
    for kind, n in (("train", N_TRAIN), ("t10k", N_TEST)):
        img, lab = read_idx(f"{kind}-images-idx3-ubyte"), read_idx(f"{kind}-labels-idx1-ubyte")
        assert struct.unpack(">IIII", img[:16])[:2] == (0x803, len(lab) - 8)
        (d / f"{kind}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) +
                                                     img[16:16 + 784 * n])
        (d / f"{kind}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + lab[8:8 + n])
    return f"--data_dir={d}"


def check_meta(meta, spec=SMALL):
    """The file names its model and input shape; they rebuild the same layout."""
    assert "model" in meta and "input_shape" in meta, meta
    assert meta["input_shape"].replace(" ", "") in ("28,28,1", "[28,28,1]"), meta["input_shape"]
    assert cnn_ref.Model(meta["model"]).layout == cnn_ref.Model(spec).layout, meta["model"]


def moved(m, m0=None):
    """The model trained: the biases left their initialization (zero or m0's)."""
    return max(float(np.abs(m[k] - (m0[k] if m0 else 0)).max()) for k in ("conv0_b", "fc0_b", "sm_b")) > 1e-3


def test_sync_2x50_equals_1x100_with_dropout_and_one_seed_gives_one_file(cluster, tmp_path, small_data):
    common = [small_data, f"--model={SMALL_DROP}", "--sync=1", "--optimizer=sgd", "--learning_rate=0.1",
              f"--train_steps={10 if ASAN else 20}", "--seed=7", "--log_every=0"]
    one, _ = run(cluster, 1, common + ["--batch_size=100"], tmp_path, "one")
    a, _ = run(cluster, 2, common + ["--batch_size=50"], tmp_path, "a")
    b, _ = run(cluster, 2, common + ["--batch_size=50"], tmp_path, "b")
    assert open(a, "rb").read() == open(b, "rb").read()
    m1, meta1 = load_model(one)
    ma, meta_a = load_model(a)
    assert set(m1) == set(ma) == NAMES
    assert meta1["global_step"] == meta_a["global_step"] == str(10 if ASAN else 20)
    check_meta(meta1, SMALL_DROP)
    diff = max(float(np.abs(m1[k] - ma[k]).max()) for k in m1)
    print(f"{SMALL_DROP}: sync 1 x 100 vs 2 x 50, sgd: max abs diff {diff:.2e}")
    assert diff <= 1e-5, diff
    assert moved(m1)


def test_async_with_a_staleness_bound_learns(cluster, tmp_path, small_data):
    steps = 40 if ASAN else 120
    args = [small_data, f"--model={SMALL}", "--sync=0", "--staleness=1", "--optimizer=adam",
            "--learning_rate=0.003", "--batch_size=50", f"--train_steps={steps}", "--log_every=0", "--seed=5"]
    c = cluster(2)
    path = str(tmp_path / "ssp.safetensors")
    c.worker(1, *args, "--step_delay_ms=5")
    c.worker(0, *args, f"--export={path}")
    outs = c.finish()
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    m, meta = load_model(path)
    assert set(m) == NAMES and int(meta["global_step"]) >= steps
    check_meta(meta)
    acc = accuracy_of(outs[1][1])
    print(f"{SMALL}: async, --staleness=1, 2 workers, {steps} steps of 50: test accuracy {acc:.4f}")
    assert acc >= (0.4 if ASAN else 0.6)  # chance is 0.10


def test_backup_workers(cluster, tmp_path, small_data):
    """3 sync workers, 2 gradients make a step; the slow one's come late."""
    # The slow worker must push while the fast two still train. Each non-chief
    # polls for the chief's initialization every --recovery_wait_secs (1 s by
    # default): the slow one once joined after the fast two had made all
    # their steps, so nothing came late. Polling every 20 ms, and the fast two
    # taking at least 10 ms a step for 30 steps, leaves the slow one (100 ms a
    # step) about 200 ms to spare for its first push.
    steps = 30
    args = [small_data, f"--model={SMALL}", "--sync=1", "--replicas_to_aggregate=2", "--optimizer=sgd",
            "--learning_rate=0.05", "--batch_size=20", f"--train_steps={steps}", "--log_every=0", "--keep_ps",
            "--recovery_wait_secs=0.02"]
    c = cluster(3)
    path = str(tmp_path / "backup.safetensors")
    c.worker(2, *args, "--step_delay_ms=100")
    c.worker(1, *args, "--step_delay_ms=10")
    c.worker(0, *args, "--step_delay_ms=10", f"--export={path}")
    for rc, out in c.finish():
        assert rc == 0, out[-3000:]
    m, meta = load_model(path)
    assert set(m) == NAMES and meta["global_step"] == str(steps) and moved(m)
    st, _, body = http("GET", f"{c.psd.url}/v1/status")
    assert st == 200 and json.loads(body)["stale_dropped"] > 0


def one_worker_job(jobs, name, n_ps, small_data, extra=()):
    args = [small_data, f"--model={SMALL}", "--sync=1", "--optimizer=adam", "--learning_rate=0.01",
            "--batch_size=50", "--train_steps=15", "--seed=11", "--log_every=0",
            "--partition_bytes=65536"] + list(extra)
    job = jobs(name, 1, args, n_ps=n_ps)
    for t in range(n_ps):
        job.start_psd(task=t)
    outs = job.finish([job.worker(0)])
    assert outs[0][0] == 0, outs[0][1][-3000:]
    return job


def test_two_ps_split_the_dense_kernel_by_rows_and_train_the_same_model(jobs, small_data):
    # fc0_w is 1568 x 32 floats (200,704 bytes): over --partition_bytes=65536,
    # so it is split by rows over the 2 ps; every other tensor is smaller
    job = one_worker_job(jobs, "two", 2, small_data, ["--keep_ps"])
    held = []
    for url in (job.url, f"http://127.0.0.1:{job.ports[1]}"):
        st, _, body = http("GET", url + "/v1/params")
        assert st == 200, body
        held.append(parse_safetensors(body)[0])
    parts = {k: v for t in held for k, v in t.items() if k.startswith("fc0_w")}
    assert sorted(parts) == ["fc0_w/part_0", "fc0_w/part_1"], sorted(parts)
    assert all(sum(k.startswith("fc0_w") for k in t) == 1 for t in held)  # one part on each ps
    assert sum(p.shape[0] for p in parts.values()) == 1568 and all(p.shape[1] == 32 for p in parts.values())
    assert set(held[0]) | set(held[1]) == (NAMES - {"fc0_w"}) | set(parts)
    exported, meta = load_model(job.export)
    check_meta(meta)
    joined = np.concatenate([parts["fc0_w/part_0"], parts["fc0_w/part_1"]])
    assert joined.tobytes() == exported["fc0_w"].tobytes()   # the rows in order, part 0 first
    for p in (job.psd, job.others[1]):
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    one = one_worker_job(jobs, "one", 1, small_data)
    assert open(one.export, "rb").read() == open(job.export, "rb").read()


def test_ring_allreduce_trains_what_ps_sync_trains(cluster, procs, tmp_path, small_data):
    common = [small_data, f"--model={SMALL_DROP}", "--optimizer=sgd", "--learning_rate=0.1",
              "--train_steps=10", "--seed=7", "--batch_size=30", "--log_every=0"]
    ps_model, _ = run(cluster, 2, common + ["--sync=1"], tmp_path, "ps")
    _, ring_model, ps = ring_job(procs, 2, common + ["--log_param_hash"], tmp_path, "ring")
    outs = [finish(p) for p in ps]
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    check_hashes(outs, 1, 10)
    ma, _ = load_model(ps_model)
    mb, meta = load_model(ring_model)
    check_meta(meta, SMALL_DROP)
    diff = max(float(np.abs(ma[k] - mb[k]).max()) for k in ma)
    print(f"{SMALL_DROP}: ring vs ps sync, 2 workers, sgd: max abs diff {diff:.2e}")
    assert set(mb) == NAMES and diff <= 1e-5
    _, meta_c = load_model(str(tmp_path / "ring-logs" / "model.ckpt-10.safetensors"))
    check_meta(meta_c, SMALL_DROP)


def test_the_evaluator_reports_the_cnns_accuracy(cluster, tmp_path, small_data):
    c = cluster(1)
    c.worker(0, small_data, f"--model={SMALL}", "--train_steps=40", "--eval_secs=0.2", job="evaluator")
    c.worker(0, small_data, f"--model={SMALL}", "--train_steps=40", "--batch_size=50", "--log_every=0",
             "--keep_ps", "--optimizer=adam", "--learning_rate=0.003")
    outs = c.finish()
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    assert "evaluator 0: global step" in outs[0][1]
    st, _, body = http("GET", f"{c.psd.url}/v1/status")
    j = json.loads(body)
    assert j["eval"] is not None and j["eval"]["examples"] == N_TEST, j
    assert 0.3 <= j["eval"]["accuracy"] <= 1, j["eval"]   # chance is 0.10


def test_psd_checkpoint_names_the_model_and_training_resumes_from_it(jobs, small_data):
    args = [small_data, f"--model={SMALL}", "--sync=1", "--optimizer=adam", "--learning_rate=0.01",
            "--batch_size=25", "--seed=2", "--log_every=0"]
    job = jobs("ckpt", 1, args)
    job.start_psd()
    outs = job.finish([job.worker(0, "--train_steps=12")])
    assert outs[0][0] == 0, outs[0][1][-3000:]
    assert job.psd.wait(timeout=30) == 0           # stopped by the chief, its last checkpoint written
    no_sanitizer(job.psd_stderr())
    files = sorted(job.checkpoints(), key=lambda f: int(re.search(r"ckpt-(\d+)\.", f).group(1)))
    assert files, "psd wrote no checkpoint"
    meta, tensors = ckpt_check.read(files[-1])      # the newest; the independent reader validates it
    assert meta["global_step"] == "12"
    assert NAMES <= set(tensors) and {"conv0_w:adam_m", "conv0_w:adam_v"} <= set(tensors)
    first = load_model(job.export)[0]
    for k in NAMES:
        assert tensors[k].tobytes() == first[k].tobytes(), k
    # a new psd on the same logdir restores step 12; the worker goes on to 24
    job.start_psd()
    assert job.step() == 12
    outs = job.finish([job.worker(0, "--train_steps=24")])
    assert outs[0][0] == 0, outs[0][1][-3000:]
    m, meta_e = load_model(job.export)
    assert meta_e["global_step"] == "24" and moved(m, first)
    check_meta(meta)                                 # the checkpoint names its model (issue 19)


def no_sanitizer(text):
    for mark in SANITIZER_MARKS:
        assert mark not in text, text[-4000:]


def load_idx_test(data_flag):
    d = data_flag.split("=", 1)[1]
    raw = open(os.path.join(d, "t10k-images-idx3-ubyte"), "rb").read()
    magic, n, h, w = struct.unpack(">IIII", raw[:16])
    assert magic == 0x803 and (h, w) == (28, 28)
    x = np.frombuffer(raw[16:], np.uint8).reshape(n, 28, 28, 1).astype(np.float32) / 255
    raw = open(os.path.join(d, "t10k-labels-idx1-ubyte"), "rb").read()
    return x, np.frombuffer(raw[8:], np.uint8)



def test_local_equals_one_async_worker_and_numpy_reads_the_exported_file(cluster, tmp_path, small_data):
    steps = 40 if ASAN else 100
    args = [small_data, f"--model={SMALL_DROP}", "--optimizer=adam", "--learning_rate=0.003",
            "--batch_size=50", f"--train_steps={steps}", "--log_every=0", "--seed=9"]
    local = str(tmp_path / "local.safetensors")
    r = subprocess.run([binary("workerd"), "--local", f"--export={local}"] + args,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    no_sanitizer(r.stderr)
    acc = accuracy_of(r.stdout + r.stderr)
    dist, outs = run(cluster, 1, args + ["--sync=0"], tmp_path, "dist")
    assert open(dist, "rb").read() == open(local, "rb").read()
    assert accuracy_of(outs[0][1]) == acc

    m, meta = load_model(local)
    check_meta(meta, SMALL_DROP)
    assert meta["global_step"] == str(steps)
    shape = tuple(int(v) for v in meta["input_shape"].strip("[]").split(","))
    model = cnn_ref.Model(meta["model"], input_shape=shape)
    x, labels = load_idx_test(small_data)
    logits, _ = model.forward(m, x, train=False)       # no dropout at evaluation
    np_acc = float((logits.argmax(1) == labels).mean())
    print(f"{SMALL_DROP} --local {steps} steps: workerd's test accuracy {acc:.4f}, numpy's on the file {np_acc:.4f}")
    assert abs(np_acc - acc) <= 1.5 / N_TEST, (np_acc, acc)   # float32 vs float64: one argmax flip at most
    assert acc >= (0.4 if ASAN else 0.6)

    r = subprocess.run([binary("workerd"), f"--evaluate_model={local}", small_data],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    no_sanitizer(r.stderr)
    got = re.findall(r"test accuracy ([0-9.]+)", r.stdout + r.stderr)
    assert got and float(got[-1]) == acc, r.stdout[-2000:] + r.stderr[-2000:]
