"""Crash tests (issue 5): kill -9 the ps at several moments of a sync run,
once inside a checkpoint write; kill -9 a worker and the chief of an async
run; SIGTERM on workerd. Training must finish, the model must match an
uninterrupted run with the same seed (within 1% test accuracy; sync runs
restart on the same batches, so they usually end bit-identical), and every
checkpoint left on disk must validate with the independent reader
(ckpt_check.py). Prints the figures: kill points, checkpoints validated,
accuracy difference, seconds from a ps restart until global_step moves."""
import glob
import json
import os
import signal
import struct
import subprocess
import time

import numpy as np
import pytest

import ckpt_check
from conftest import BIN, SANITIZER_MARKS, binary, http
from procs import free_port, kill_all
from test_train import accuracy_of

DATA = "/usr/share/datasets/fashion-mnist"
ASAN = "asan" in BIN
pytestmark = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")


class Job:
    """ps tasks on fixed ports (so they can be restarted) and workerd tasks;
    every process is stopped by PID at the end. self.psd, self.url, ... are
    ps 0's; start_psd(task=1) etc. for the others."""

    def __init__(self, tmp_path, name, n_workers, args, n_ps=1):
        self.dir = tmp_path / name
        self.dir.mkdir()
        self.logdir = str(self.dir / "logs")
        self.ports = [free_port() for _ in range(n_ps)]
        self.port = self.ports[0]
        self.ps = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.url = f"http://127.0.0.1:{self.port}"
        self.others = {}  # task -> Popen of ps tasks other than 0
        self.workers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n_workers))
        self.args = list(args)
        self.psd = None
        self.psd_runs = 0
        self.procs = {}
        self.export = str(self.dir / "model.safetensors")

    def start_psd(self, env=None, task=0, extra=()):
        e = dict(os.environ)
        e.pop("TF_CONFIG", None)
        e.update(env or {})
        self.psd_runs += 1
        err = str(self.dir / f"psd{task}-{self.psd_runs}.err")
        p = subprocess.Popen([binary("psd"), f"--ps_hosts={self.ps}", f"--task_index={task}",
                              f"--logdir={self.logdir}", "--save_checkpoint_secs=1", *extra],
                             stdout=subprocess.PIPE, stderr=open(err, "w"), env=e)
        line = p.stdout.readline().decode()
        assert line.startswith("psd: listening on "), (line, open(err).read())
        if task == 0:
            self.psd, self.psd_err = p, err
        else:
            self.others[task] = p
            p.err = err
        return p

    def psd_stderr(self):
        return open(self.psd_err, errors="replace").read()

    def kill_psd(self):
        self.psd.kill()
        self.psd.wait()

    def worker(self, index, *extra):
        out = open(self.dir / f"worker{index}-{len(self.procs)}.log", "w+")
        argv = [binary("workerd"), "--job_name=worker", f"--task_index={index}", f"--ps_hosts={self.ps}",
                f"--worker_hosts={self.workers}", f"--data_dir={DATA}"] + self.args + list(extra)
        if index == 0:
            argv.append(f"--export={self.export}")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        p.log = out
        self.procs[(index, len(self.procs))] = p
        return p

    @staticmethod
    def output(p):
        p.log.flush()
        p.log.seek(0)
        return p.log.read()

    def step(self):
        try:
            st, _, body = http("GET", self.url + "/v1/status", timeout=2)
        except OSError:
            return None
        return json.loads(body)["global_step"] if st == 200 else None

    def wait_step(self, at_least, timeout=120):
        t0 = time.time()
        while time.time() - t0 < timeout:
            s = self.step()
            if s is not None and s >= at_least:
                return s
            time.sleep(0.01)
        raise AssertionError(f"global_step did not reach {at_least} in {timeout} s")

    def finish(self, procs, timeout=300):
        outs = []
        for p in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError("workerd did not finish:\n" + self.output(p)[-3000:])
            outs.append((p.returncode, self.output(p)))
        return outs

    def stop_all(self):
        kill_all(list(self.procs.values()) + ([self.psd] if self.psd else []) + list(self.others.values()))

    def checkpoints(self, task=0):
        return sorted(glob.glob(os.path.join(self.logdir, f"ps-{task}", "model.ckpt-*.safetensors")))


@pytest.fixture
def jobs(tmp_path):
    made = []

    def make(name, n_workers, args, n_ps=1):
        j = Job(tmp_path, name, n_workers, args, n_ps)
        made.append(j)
        return j

    yield make
    for j in made:
        j.stop_all()


def no_sanitizer_report(text):
    for mark in SANITIZER_MARKS:
        assert mark not in text, text[-4000:]


def uninterrupted(jobs, args, n_ps=1, name="reference"):
    ref = jobs(name, 2, args, n_ps)
    for t in range(n_ps):
        ref.start_psd(task=t)
    outs = ref.finish([ref.worker(1), ref.worker(0)])
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    assert ref.psd.wait(timeout=30) == 0
    return accuracy_of(outs[1][1]), open(ref.export, "rb").read()


def restart_and_time(job, restored_at_most):
    """Restart psd; seconds until its global_step moves past what it restored."""
    t0 = time.time()
    job.start_psd()
    restored = job.step()
    assert restored is not None and restored <= restored_at_most
    job.wait_step(restored + 1)
    return restored, time.time() - t0


def test_kill_ps_during_sync_training_and_inside_a_checkpoint_write(jobs):
    steps = 3000 if ASAN else 8000
    kills = [steps * 2 // 10, None, steps * 7 // 10]  # None: inside a checkpoint write
    args = ["--sync=1", "--hidden_units=32", "--optimizer=adam", "--learning_rate=0.003",
            "--batch_size=50", f"--train_steps={steps}", "--seed=5", "--log_every=0",
            "--ps_backoff_max_ms=300"]
    # the uninterrupted reference run: on the optimized build (under ASan the
    # kill and restore paths run; the comparison would only double the time)
    ref_acc, ref_model = (None, None) if ASAN else uninterrupted(jobs, args)

    job = jobs("crashed", 2, args)
    job.start_psd()
    procs = [job.worker(1), job.worker(0)]
    restarts, temps_left = [], 0
    for point in kills:
        if point is None:
            # a psd whose writes pause half-way; kill it while one is paused
            job.kill_psd()
            job.start_psd(env={"RESTPS_TEST_SAVE_PAUSE_MS": "4000"})
            folder = os.path.join(job.logdir, "ps-0")
            t0 = time.time()
            while not glob.glob(os.path.join(folder, "*.tmp.*")):
                assert time.time() - t0 < 30, "no checkpoint write started"
                time.sleep(0.01)
            at = job.step()
            job.kill_psd()
            temps_left += len(glob.glob(os.path.join(folder, "*.tmp.*")))
            where = f"inside a checkpoint write (step {at})"
        else:
            at = job.wait_step(point)
            job.kill_psd()
            where = f"step {at}"
        # every checkpoint left on disk validates, whatever the moment
        for f in job.checkpoints():
            ckpt_check.read(f)
        restored, secs = restart_and_time(job, at)
        restarts.append((where, restored, secs))
        if point is None:
            assert "removed 1 temp file" in job.psd_stderr()
    outs = job.finish(procs)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
        no_sanitizer_report(out)
    assert job.psd.wait(timeout=30) == 0  # the chief stopped it at the end
    no_sanitizer_report(job.psd_stderr())
    assert "global step went back" in outs[0][1] + outs[1][1]
    files = job.checkpoints()
    for f in files:
        ckpt_check.read(f)
    assert temps_left == 1 and not glob.glob(os.path.join(job.logdir, "ps-0", "*.tmp.*"))
    acc = accuracy_of(outs[1][1])
    print(f"ps kill points: {[w for w, _, _ in restarts]}")
    for where, restored, secs in restarts:
        print(f"  killed at {where}: restored global step {restored}, "
              f"global_step moved again {secs:.2f} s after the restart began")
    assert acc >= 0.75  # chance is 0.10
    if ASAN:
        return
    same = open(job.export, "rb").read() == ref_model
    print(f"checkpoints validated: {len(files)} at the end (+ after each kill); "
          f"test accuracy {acc:.4f} vs uninterrupted {ref_acc:.4f} "
          f"(difference {abs(acc - ref_acc):.4f}; models bit-identical: {same})")
    assert abs(acc - ref_acc) <= 0.01


def test_kill_one_of_two_ps_tasks_during_sync_training(jobs):
    """Each ps restores its own shard; the other one goes on. The shards then
    stand at different steps (each counts its own): workers push each shard
    its own step, so both go on. The trajectory is not the uninterrupted one
    (one shard went back, the other did not), so the bound is 2%, not 1%."""
    steps = 1500 if ASAN else 5000
    args = ["--sync=1", "--hidden_units=32", "--optimizer=adam", "--learning_rate=0.003",
            "--batch_size=50", f"--train_steps={steps}", "--seed=5", "--log_every=0",
            "--ps_backoff_max_ms=300"]
    ref_acc, ref_model = (None, None) if ASAN else uninterrupted(jobs, args, n_ps=2)
    job = jobs("two-ps", 2, args, n_ps=2)
    job.start_psd(task=0)
    job.start_psd(task=1)
    procs = [job.worker(1), job.worker(0)]
    job.wait_step(steps // 2)
    job.others[1].kill()
    job.others[1].wait()
    for f in job.checkpoints(task=1):
        ckpt_check.read(f)
    job.start_psd(task=1)
    outs = job.finish(procs)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
        no_sanitizer_report(out)
    assert job.psd.wait(timeout=30) == 0 and job.others[1].wait(timeout=30) == 0
    assert "restored" in open(job.others[1].err).read()
    for t in (0, 1):
        for f in job.checkpoints(task=t):
            meta, _ = ckpt_check.read(f)
            assert json.loads(meta["placement"])["ps_tasks"] == 2
    acc = accuracy_of(outs[1][1])
    if ASAN:  # no reference run there (see above); far above chance (0.10)
        print(f"2 ps, ps 1 killed at half-way: test accuracy {acc:.4f}")
        assert acc >= 0.7
        return
    same = open(job.export, "rb").read() == ref_model
    print(f"2 ps, ps 1 killed at half-way: test accuracy {acc:.4f} vs uninterrupted {ref_acc:.4f} "
          f"(bit-identical: {same})")
    assert abs(acc - ref_acc) <= 0.02


def test_kill_a_worker_and_the_chief_in_async_training(jobs):
    steps = 1500 if ASAN else 6000
    args = ["--sync=0", "--hidden_units=32", "--optimizer=adam", "--learning_rate=0.003",
            "--batch_size=50", f"--train_steps={steps}", "--seed=5", "--log_every=0"]
    job = jobs("async", 2, args)
    job.start_psd()
    w1 = job.worker(1)
    chief = job.worker(0)
    # kill -9 worker 1: the chief goes on
    at = job.wait_step(steps // 10)
    w1.kill()
    w1.wait()
    job.wait_step(at + 200)
    # restart it: it rejoins (its pushes show in the shard's worker records)
    w1b = job.worker(1)
    t0 = time.time()
    while True:
        st, _, body = http("GET", job.url + "/v1/status")
        recs = {w["worker"]: w for w in json.loads(body)["workers"]}
        if 1 in recs and recs[1]["pushes"] > 0 and recs[1]["last_seen_secs_ago"] < 1 and \
                time.time() - t0 > 0.5:
            break
        assert time.time() - t0 < 60, "the restarted worker did not rejoin"
        time.sleep(0.05)
    # kill -9 the chief after initialization: worker 1 goes on
    at = job.step()
    chief.kill()
    chief.wait()
    # (a slow rejoin can leave fewer than 200 steps: then worker 1 goes on to the end)
    job.wait_step(min(at + 200, steps))
    # restart the chief: it finds the variables and does not initialize them again
    chief_b = job.worker(0)
    outs = job.finish([w1b, chief_b])
    for rc, out in outs:
        assert rc == 0, out[-3000:]
        no_sanitizer_report(out)
    assert "4 variables existed already" in outs[1][1] and "created 0" in outs[1][1]
    assert "created 4 variables" not in outs[1][1]
    assert job.psd.wait(timeout=30) == 0
    acc = accuracy_of(outs[1][1])
    print(f"async with a worker and the chief killed and restarted: test accuracy {acc:.4f}")
    assert acc >= 0.75


def test_sigterm_on_workerd_finishes_the_step_and_exits_0(jobs):
    job = jobs("term", 1, ["--sync=0", "--hidden_units=32", "--train_steps=1000000", "--log_every=0",
                           "--keep_ps"])
    job.start_psd()
    w = job.worker(0)
    at = job.wait_step(200)
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=30) == 0, job.output(w)[-2000:]
    out = job.output(w)
    assert "stopped by a signal after" in out
    after = job.step()
    assert after >= at
    time.sleep(0.3)
    assert job.step() == after  # nothing pushes any more
    # and psd on SIGTERM saves that step and exits 0
    job.psd.send_signal(signal.SIGTERM)
    assert job.psd.wait(timeout=30) == 0
    newest = job.checkpoints()
    meta, _ = ckpt_check.read(max(newest, key=lambda f: int(f.split("-")[-1].split(".")[0])))
    assert int(meta["global_step"]) == after


def test_sync_model_is_the_same_with_one_two_and_three_ps_tasks(jobs):
    """Aggregation is per variable in worker order, so where a variable lives
    does not change the model; and two runs with the same layout are equal
    (a regression test: a long poll that read the step and the pending
    gradients at two instants let a worker compute from a mix of steps)."""
    args = ["--sync=1", "--hidden_units=32", "--optimizer=adam", "--learning_rate=0.003",
            "--batch_size=50", f"--train_steps={300 if ASAN else 1500}", "--seed=11", "--log_every=0"]
    models = {}
    # under ASan (make test time) the 1- and 3-ps runs only: the memory paths
    # of several shards run there; the rest of the comparison on the optimized build
    runs = ((1, "one"), (3, "three")) if ASAN else ((1, "one"), (2, "two"), (2, "two-again"), (3, "three"))
    for n_ps, name in runs:
        models[name] = uninterrupted(jobs, args, n_ps=n_ps, name=name)[1]
    if not ASAN:
        assert models["two"] == models["two-again"]
        assert models["one"] == models["two"]
    assert models["one"] == models["three"]


def parse_safetensors(b):
    """{name: ndarray}, metadata: the format parsed here by hand."""
    (n,) = struct.unpack("<Q", b[:8])
    h = json.loads(b[8:8 + n])
    meta = h.pop("__metadata__", {})
    d = b[8 + n:]
    return {k: np.frombuffer(d[v["data_offsets"][0]:v["data_offsets"][1]], "<f4").reshape(v["shape"])
            for k, v in h.items()}, meta


def test_export_holds_every_shard_as_a_bulk_pull_reads_it(jobs):
    job = jobs("export", 1, ["--sync=1", "--hidden_units=32,16", "--train_steps=200", "--seed=2",
                             "--log_every=0", "--keep_ps"], n_ps=2)
    job.start_psd(task=0)
    job.start_psd(task=1)
    outs = job.finish([job.worker(0)])
    assert outs[0][0] == 0, outs[0][1][-3000:]
    exported, meta = parse_safetensors(open(job.export, "rb").read())
    assert meta["global_step"] == "200"
    pulled = {}
    for url in (job.url, f"http://127.0.0.1:{job.ports[1]}"):
        st, _, body = http("GET", url + "/v1/params")
        assert st == 200
        t, m = parse_safetensors(body)
        assert m["global_step"] == "200"
        assert not set(t) & set(pulled)  # each variable lives on one shard
        pulled.update(t)
    assert set(exported) == set(pulled) == {"hid0_w", "hid0_b", "hid1_w", "hid1_b", "sm_w", "sm_b"}
    for k in exported:
        assert exported[k].shape == pulled[k].shape and exported[k].tobytes() == pulled[k].tobytes(), k
    for p in (job.psd, job.others[1]):
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0


def test_sigterm_while_the_ps_is_down_stops_the_worker_at_once(jobs):
    job = jobs("term-down", 2, ["--sync=1", "--hidden_units=32", "--train_steps=1000000",
                                "--log_every=0"])
    job.start_psd()
    w = [job.worker(1), job.worker(0)]
    job.wait_step(100)
    job.kill_psd()
    time.sleep(0.5)  # the workers are retrying now (for --ps_retry_secs, 120 s)
    t0 = time.time()
    for p in w:
        p.send_signal(signal.SIGTERM)
    for p in w:
        assert p.wait(timeout=30) == 0, job.output(p)[-2000:]
        assert "stopped by a signal" in job.output(p)
    assert time.time() - t0 < 5
