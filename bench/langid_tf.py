"""bench/langid_tf.py (make bench) - workerd --data=langid beside TensorFlow's
own parameter-server training of the same model (issue 34): tf.compat.v1 in
graph mode, an embedding variable of 2^21 x 16 partitioned over 2 ps tasks
(fixed_size_partitioner, replica_device_setter), embedding_lookup_sparse with
the mean combiner, a dense softmax layer, Adagrad; 1 and 2 asynchronous
workers, batch 100 each, the same words, the same n-gram hashing (the numpy
reference's, tests/helpers/langid_ref.py) and the same number of global steps.
It prints each side's global steps per second, its test accuracy, and the
ratio restps / TensorFlow, measured in the same run.

    build/bench-venv/bin/python bench/langid_tf.py [--steps=N] [--words=N]
    (as a TensorFlow task: --job_name=ps|worker --task_index=I ...)

Needs TensorFlow (bench/requirements.txt's tensorflow-cpu, in build/bench-venv)
and the word lists (make deps); says so and exits 0 without them."""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port  # noqa: E402

ROWS, DIM, CLASSES, LR, BATCH = 1 << 21, 16, 11, 10.0, 100  # adagrad: the batch-mean gradient wants a large rate


def data(words):
    """(train ids, train labels, test ids, test labels) as langid_ref builds them."""
    import numpy as np
    import langid_ref as ref
    train, test = ref.select("/usr/share/dict", words)
    tr = [np.array(ref.ngram_ids(w, ROWS), np.int64) for _, w, _ in train]
    te = [np.array(ref.ngram_ids(w, ROWS), np.int64) for _, w, _ in test]
    return tr, np.array([l for _, _, l in train]), te, np.array([l for _, _, l in test])


def sparse_value(bags):
    import numpy as np
    import tensorflow as tf
    idx = np.concatenate([np.stack([np.full(len(b), i), np.arange(len(b))], 1) for i, b in enumerate(bags)])
    vals = np.concatenate(bags)
    return tf.compat.v1.SparseTensorValue(idx.astype(np.int64), vals, [len(bags), max(len(b) for b in bags)])


def tf_task(a):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    ps, wk = a.ps_hosts.split(","), a.worker_hosts.split(",")
    cluster = v1.train.ClusterSpec({"ps": ps, "worker": wk})
    config = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    if a.job_name == "worker":
        config.device_filters.extend(["/job:ps", f"/job:worker/task:{a.task_index}"])
    server = v1.train.Server(cluster, job_name=a.job_name, task_index=a.task_index, config=config)
    if a.job_name == "ps":
        server.join()
        return
    tr, ytr, te, yte = data(a.words)
    chief = a.task_index == 0
    with v1.device(v1.train.replica_device_setter(worker_device=f"/job:worker/task:{a.task_index}", cluster=cluster)):
        gs = v1.train.get_or_create_global_step()
        emb = v1.get_variable("emb", [ROWS, DIM], initializer=v1.random_uniform_initializer(-1.0 / DIM, 1.0 / DIM),
                              partitioner=v1.fixed_size_partitioner(len(ps)))
        sm_w = v1.get_variable("sm_w", [DIM, CLASSES], initializer=v1.zeros_initializer())
        sm_b = v1.get_variable("sm_b", [CLASSES], initializer=v1.zeros_initializer())
        sp = v1.sparse_placeholder(tf.int64)
        y_ = v1.placeholder(tf.int64, [None])
        x = v1.nn.embedding_lookup_sparse(emb, sp, None, combiner="mean")
        logits = v1.nn.xw_plus_b(x, sm_w, sm_b)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y_, logits=logits))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y_), tf.int32))
        train_op = v1.train.AdagradOptimizer(LR, initial_accumulator_value=0.1).minimize(loss, global_step=gs)
        init = v1.global_variables_initializer()
    sv = v1.train.Supervisor(is_chief=chief, logdir=None, init_op=init, recovery_wait_secs=1, global_step=gs,
                             save_model_secs=0, summary_op=None)
    sess = sv.prepare_or_wait_for_session(server.target, config=config)
    rng = np.random.default_rng(a.task_index + 1)
    step, local, t0 = 0, 0, None
    while step < a.steps:
        ex = rng.integers(0, len(tr), BATCH)
        _, step = sess.run([train_op, gs], feed_dict={sp: sparse_value([tr[e] for e in ex]), y_: ytr[ex]})
        if t0 is None:
            t0 = time.time()
        local += 1
    secs = time.time() - t0
    print(f"tf-worker {a.task_index}: {local} steps in {secs:.2f} s", flush=True)
    if chief:
        right = 0
        for i in range(0, len(te), 1000):
            right += sess.run(correct, feed_dict={sp: sparse_value(te[i:i + 1000]), y_: yte[i:i + 1000]})
        print(f"tf-worker 0: test accuracy {right / len(te):.4f}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def run_tf(workers, steps, words):
    ps = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    wk = [f"127.0.0.1:{free_port()}" for _ in range(workers)]
    base = [sys.executable, os.path.abspath(__file__), "--ps_hosts=" + ",".join(ps), "--worker_hosts=" + ",".join(wk),
            f"--steps={steps}", f"--words={words}"]
    pss = [subprocess.Popen(base + ["--job_name=ps", f"--task_index={i}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL) for i in range(2)]
    try:
        t0 = time.time()
        ws = [subprocess.Popen(base + ["--job_name=worker", f"--task_index={i}"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(workers)]
        outs = [w.communicate(timeout=1800) for w in ws]
        for w, (o, e) in zip(ws, outs):
            if w.returncode != 0:
                raise RuntimeError(f"a TensorFlow worker failed:\n{o}\n{e[-3000:]}")
        text = "".join(o for o, _ in outs)
        secs = max(float(m) for m in re.findall(r"steps in ([0-9.]+) s", text))
        acc = float(re.search(r"test accuracy ([0-9.]+)", text).group(1))
        return steps / secs, acc, time.time() - t0
    finally:
        for p in pss:
            p.kill()
            p.wait()


def run_restps(bin_dir, workers, steps, words):
    ps = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    wk = [f"127.0.0.1:{free_port()}" for _ in range(workers)]
    pss = [subprocess.Popen([os.path.join(bin_dir, "psd"), "--ps_hosts=" + ",".join(ps), f"--task_index={i}",
                             "--logdir="], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
    try:
        ws = [subprocess.Popen([os.path.join(bin_dir, "workerd"), "--data=langid", f"--langid_words={words}",
                                "--device=cpu", "--log_every=0", "--ps_hosts=" + ",".join(ps),
                                "--worker_hosts=" + ",".join(wk), "--job_name=worker", f"--task_index={i}",
                                f"--train_steps={steps}", f"--batch_size={BATCH}", "--optimizer=adagrad",
                                f"--learning_rate={LR}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i in range(workers)]
        outs = [w.communicate(timeout=1800) for w in ws]
        for w, (o, e) in zip(ws, outs):
            if w.returncode != 0:
                raise RuntimeError(f"a restps worker failed:\n{o}\n{e[-3000:]}")
        text = "".join(o for o, _ in outs)
        secs = max(float(m) for m in re.findall(r": \d+ steps in ([0-9.]+) s", text))
        acc = float(re.search(r"accuracy ([0-9.]+)", text).group(1))
        return steps / secs, acc
    finally:
        for p in pss:
            if p.poll() is None:
                p.kill()
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--job_name")
    ap.add_argument("--task_index", type=int, default=0)
    ap.add_argument("--ps_hosts")
    ap.add_argument("--worker_hosts")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--words", type=int, default=20000)
    a = ap.parse_args()
    if a.job_name:
        return tf_task(a)
    if importlib.util.find_spec("tensorflow") is None:
        print(f"bench-langid-tf: {sys.executable} has no tensorflow (make bench installs bench/requirements.txt "
              "into build/bench-venv): skipped")
        return 0
    if not os.path.exists("/usr/share/dict/polish"):
        print("bench-langid-tf: the word lists are missing (make deps): skipped")
        return 0
    bin_dir = os.environ.get("RESTPS_BIN_DIR", os.path.join(ROOT, "bin"))
    rows = []
    for w in (1, 2):
        r_sps, r_acc = run_restps(bin_dir, w, a.steps, a.words)
        t_sps, t_acc, _ = run_tf(w, a.steps, a.words)
        rows.append((w, r_sps, r_acc, t_sps, t_acc))
        print(f"bench-langid-tf: {w} worker(s), 2 ps, async, batch {BATCH}, adagrad {LR}, {a.steps} global steps: "
              f"restps {r_sps:.0f} steps/s (test accuracy {r_acc:.4f}), TensorFlow {t_sps:.0f} steps/s "
              f"({t_acc:.4f}): restps/TensorFlow {r_sps / t_sps:.2f}x", flush=True)
    print(json.dumps({"langid_tf": [dict(zip(("workers", "restps_steps_per_s", "restps_accuracy",
                                              "tf_steps_per_s", "tf_accuracy"), r)) for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
