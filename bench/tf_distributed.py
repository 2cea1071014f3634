"""bench/tf_distributed.py - TensorFlow's distributed MNIST example, the program
the seed article describes, written for the bench from that description with
TensorFlow 2's compat.v1 API (graph mode): tf.train.ClusterSpec from
--ps_hosts/--worker_hosts, tf.train.Server per task, the ps joins, each worker
builds the model under replica_device_setter (variables on the ps, ops on the
worker), tf.train.Supervisor prepares the session (the chief initializes or
restores from --logdir), and with --issync=1 SyncReplicasOptimizer aggregates
one gradient from every worker per step.

The model and training are restps's workerd defaults, so that the two train
the same thing: 784-100-10 (ReLU hidden layer, softmax cross-entropy, mean
over the batch), truncated-normal weights with stddev 1/sqrt(fan_in), zero
biases, Adam 0.01 (TensorFlow's betas and epsilon), batch 100 per worker,
Fashion-MNIST read from the same IDX files, the first 5,000 training images
held out as validation; each epoch one shuffle from --seed, the workers taking
turns along it. Training ends when global_step reaches --train_steps; the
chief then prints the test accuracy.

Lines the bench reads (stdout, flushed): "tf-worker I: first update at global
step S", "tf-worker I: global step S" every --log_every local steps, "tf-worker
I: finished at global step S", "tf-worker I: test accuracy A". In sync mode a
step that waits longer than --step_timeout_secs says so ("no update in N s")
and watches global_step until it moves (without pushing another gradient), or
ends when it reached --train_steps meanwhile (the other worker left after the
last update). Any other error ends the process with its
message on stderr (exit 1), as the example does; nothing here retries."""
import gzip
import os
import struct
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

v1 = tf.compat.v1
flags = v1.flags
flags.DEFINE_string("job_name", None, "job name: worker or ps")
flags.DEFINE_integer("task_index", None, "index of the task within its job")
flags.DEFINE_string("ps_hosts", "localhost:2222", "comma-separated host:port of the ps tasks")
flags.DEFINE_string("worker_hosts", "localhost:2223,localhost:2224", "comma-separated host:port of the workers")
flags.DEFINE_integer("issync", 0, "1: synchronous (SyncReplicasOptimizer), 0: asynchronous")
flags.DEFINE_string("data_dir", "/usr/share/datasets/fashion-mnist", "folder of the MNIST-format IDX files")
flags.DEFINE_integer("hidden_units", 100, "hidden layer size")
flags.DEFINE_integer("batch_size", 100, "examples per step on each worker")
flags.DEFINE_integer("train_steps", 10000, "train until global_step reaches this")
flags.DEFINE_float("learning_rate", 0.01, "Adam's learning rate")
flags.DEFINE_integer("seed", 1, "seed of the initialization and the data order")
flags.DEFINE_integer("threads", 1, "intra- and inter-op threads of each process")
flags.DEFINE_string("logdir", "", "Supervisor's logdir (checkpoints); empty: none")
flags.DEFINE_integer("save_model_secs", 600, "Supervisor: seconds between checkpoints")
flags.DEFINE_integer("step_timeout_secs", 10, "sync: a step that takes longer is reported and tried again (0: wait forever)")
flags.DEFINE_integer("log_every", 100, "print the global step every this many local steps (0: never)")
flags.DEFINE_integer("report_staleness", 0, "async: measure each update's staleness (the updates applied "
                     "between this step's read of global_step and its own) and print the histogram at the end, "
                     "as psd's /v1/status counts it: 1 global_step read before the forward pass reads the "
                     "variables (an upper bound), 2 after it read the first layer's weights (a lower bound)")
FLAGS = flags.FLAGS
PIXELS = 784


def read_idx(path):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        b = f.read()
    magic, = struct.unpack(">I", b[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, b[4:4 + 4 * ndim])
    return np.frombuffer(b, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def idx(name):
    for p in (os.path.join(FLAGS.data_dir, name), os.path.join(FLAGS.data_dir, name + ".gz")):
        if os.path.exists(p):
            return read_idx(p)
    raise FileNotFoundError(os.path.join(FLAGS.data_dir, name))


def load():
    x = idx("train-images-idx3-ubyte").reshape(-1, PIXELS).astype(np.float32) * np.float32(1.0 / 255.0)
    y = idx("train-labels-idx1-ubyte").astype(np.int64)
    xt = idx("t10k-images-idx3-ubyte").reshape(-1, PIXELS).astype(np.float32) * np.float32(1.0 / 255.0)
    yt = idx("t10k-labels-idx1-ubyte").astype(np.int64)
    return x[5000:], y[5000:], xt, yt


class Batches:
    """Worker i of n takes batches i, i+n, ... of each epoch's shuffle."""

    def __init__(self, n, i, size, seed, n_workers):
        self.n, self.i, self.size, self.nw = n, i, size, n_workers
        self.rng = np.random.default_rng(seed)
        self.order, self.k = self.rng.permutation(n), i

    def next(self):
        if (self.k + 1) * self.size > self.n:
            self.order, self.k = self.rng.permutation(self.n), self.i
        b = self.order[self.k * self.size:(self.k + 1) * self.size]
        self.k += self.nw
        return b


def main(_):
    ps_hosts = FLAGS.ps_hosts.split(",")
    worker_hosts = FLAGS.worker_hosts.split(",")
    cluster = v1.train.ClusterSpec({"ps": ps_hosts, "worker": worker_hosts})
    config = v1.ConfigProto(intra_op_parallelism_threads=FLAGS.threads,
                            inter_op_parallelism_threads=FLAGS.threads)
    if FLAGS.job_name == "worker":
        # this worker talks to the ps tasks and itself, not to the other workers
        config.device_filters.extend(["/job:ps", f"/job:worker/task:{FLAGS.task_index}"])
    server = v1.train.Server(cluster, job_name=FLAGS.job_name, task_index=FLAGS.task_index, config=config)
    print(f"tf-{FLAGS.job_name} {FLAGS.task_index}: TensorFlow {tf.__version__}, {FLAGS.threads} intra/inter-op "
          f"thread(s), oneDNN {os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default (on)')}, server {server.target}",
          flush=True)
    if FLAGS.job_name == "ps":
        server.join()
        return
    name = f"tf-worker {FLAGS.task_index}"
    n_workers = len(worker_hosts)
    is_chief = FLAGS.task_index == 0
    xtr, ytr, xte, yte = load()
    batches = Batches(len(ytr), FLAGS.task_index, FLAGS.batch_size, FLAGS.seed, n_workers)
    v1.set_random_seed(FLAGS.seed)

    with v1.device(v1.train.replica_device_setter(worker_device=f"/job:worker/task:{FLAGS.task_index}",
                                                  cluster=cluster)):
        global_step = v1.train.get_or_create_global_step()
        H = FLAGS.hidden_units
        hid_w = v1.Variable(v1.truncated_normal([PIXELS, H], stddev=1.0 / np.sqrt(PIXELS)), name="hid_w")
        hid_b = v1.Variable(v1.zeros([H]), name="hid_b")
        sm_w = v1.Variable(v1.truncated_normal([H, 10], stddev=1.0 / np.sqrt(H)), name="sm_w")
        sm_b = v1.Variable(v1.zeros([10]), name="sm_b")
        x = v1.placeholder(tf.float32, [None, PIXELS])
        y_ = v1.placeholder(tf.int64, [None])
        measure = FLAGS.report_staleness and not FLAGS.issync
        if FLAGS.report_staleness == 2 and measure:
            # the step read after the first layer's weights: a lower bound
            w_read = tf.identity(hid_w)
            with tf.control_dependencies([w_read]):
                read_step = tf.identity(global_step.read_value())
            with tf.control_dependencies([read_step]):
                hid = tf.nn.relu(v1.nn.xw_plus_b(x, w_read, hid_b))
        else:
            read_step = tf.identity(global_step.read_value()) if measure else None
            with tf.control_dependencies([read_step] if measure else None):
                hid = tf.nn.relu(v1.nn.xw_plus_b(x, tf.identity(hid_w), hid_b))
        logits = v1.nn.xw_plus_b(hid, sm_w, sm_b)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y_, logits=logits))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y_), tf.int32))
        opt = v1.train.AdamOptimizer(FLAGS.learning_rate)
        if FLAGS.issync:
            opt = v1.train.SyncReplicasOptimizer(opt, replicas_to_aggregate=n_workers,
                                                 total_num_replicas=n_workers, name="mnist_sync_replicas")
        if measure:
            # minimize's own sequence (apply, then the increment), with the
            # increment's value fetched: this update's global step
            apply = opt.apply_gradients(opt.compute_gradients(loss))
            with tf.control_dependencies([apply]):
                train_op = v1.assign_add(global_step, 1)
        else:
            train_op = opt.minimize(loss, global_step=global_step)
        if FLAGS.issync:
            local_init_op = opt.chief_init_op if is_chief else opt.local_step_init_op
            ready_for_local_init_op = opt.ready_for_local_init_op
            chief_queue_runner = opt.get_chief_queue_runner()
            sync_init_op = opt.get_init_tokens_op()
        init_op = v1.global_variables_initializer()

    kw = {}
    if FLAGS.issync:
        kw = dict(local_init_op=local_init_op, ready_for_local_init_op=ready_for_local_init_op)
    sv = v1.train.Supervisor(is_chief=is_chief, logdir=FLAGS.logdir or None, init_op=init_op,
                             recovery_wait_secs=1, global_step=global_step,
                             save_model_secs=FLAGS.save_model_secs if FLAGS.logdir else 0,
                             summary_op=None, **kw)
    sess = sv.prepare_or_wait_for_session(server.target, config=config)
    if FLAGS.issync and is_chief:
        sess.run(sync_init_op)
        sv.start_queue_runners(sess, [chief_queue_runner])
    print(f"{name}: session ready at global step {sess.run(global_step)}", flush=True)

    opts = None
    if FLAGS.issync and FLAGS.step_timeout_secs > 0:
        opts = v1.RunOptions(timeout_in_ms=FLAGS.step_timeout_secs * 1000)
    local, step, first = 0, 0, True
    stale = []
    while step < FLAGS.train_steps:
        b = batches.next()
        try:
            if measure:
                step, read = sess.run([train_op, read_step], feed_dict={x: xtr[b], y_: ytr[b]})
                stale.append(int(step) - 1 - int(read))
            else:
                _, step = sess.run([train_op, global_step], feed_dict={x: xtr[b], y_: ytr[b]}, options=opts)
        except tf.errors.DeadlineExceededError:
            # The step waits for gradients that do not come. Running train_op
            # again would push a second gradient of this worker into the
            # accumulator and make the step with it; the example's blocking
            # run waits instead, and so does this: it watches global_step.
            # (At the very end the other worker may have left after the last
            # update: then global_step has reached --train_steps.)
            waited, base = FLAGS.step_timeout_secs, sess.run(global_step)
            while True:
                step = sess.run(global_step)
                if step > base or step >= FLAGS.train_steps:
                    break
                print(f"{name}: no update in {waited} s, global step {step}", flush=True)
                time.sleep(FLAGS.step_timeout_secs)
                waited += FLAGS.step_timeout_secs
            continue
        local += 1
        if first and step >= 1:
            print(f"{name}: first update at global step {step}", flush=True)
            first = False
        if FLAGS.log_every and local % FLAGS.log_every == 0:
            print(f"{name}: global step {step}", flush=True)
    print(f"{name}: finished at global step {step} after {local} local steps", flush=True)
    if measure and stale:
        h = np.bincount(np.minimum(np.array(stale), 8), minlength=9)
        print(f"{name}: staleness mean {np.mean(stale):.3f} max {max(stale)} histogram 0..7,8+ "
              f"{' '.join(str(int(c)) for c in h)}", flush=True)
    if is_chief:
        c = sess.run(correct, feed_dict={x: xte, y_: yte})
        print(f"{name}: test accuracy {c / len(yte):.4f}", flush=True)
    # Supervisor.stop() would wait for the sync queue runner, which can block on
    # a token no other worker will ever send: leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    v1.disable_eager_execution()
    v1.app.run(main)
