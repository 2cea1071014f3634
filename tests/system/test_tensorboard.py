"""TensorBoard event files written by ps 0 (server/summaries.c,
common/tfevents.c), read back with TensorBoard's own code, not ours.

tests/helpers/read_tfevents.py runs under build/venv/bin/python (`make deps`:
tensorboard from PyPI; the suite's pytest-3 has none): TensorBoard's
EventMultiplexer finds the runs below --logdir as `tensorboard --logdir`
does, its EventAccumulator gives every scalar, and TensorBoard's TFRecord
reader checks both CRCs of every record (the accumulator would stop at a bad
record without a word). The values are checked against what the test pushed
and against GET /v1/history and /v1/status taken before psd stopped; a
training run against the evaluator's own printed results.
"""
import json
import os
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

from conftest import BIN, HELPERS, ROOT, binary, http
from procs import finish as procs_finish, free_port, kill_all
from syshelp import st_grads

PY = os.path.join(ROOT, "build", "venv", "bin", "python")
READER = os.path.join(HELPERS, "read_tfevents.py")
DATA = "/usr/share/datasets/fashion-mnist"
needs_tensorboard = pytest.mark.skipif(
    not os.path.exists(PY), reason=f"{PY} is missing: run make deps (tensorboard from PyPI)")
needs_data = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")
TRAIN_TAGS = {"loss", "global_step/sec", "examples/sec", "learning_rate", "staleness"}
STEPS = 100 if "asan" in BIN else 300  # the sanitizer build trains ~5x slower


def finish(procs):
    """Wait for the workerd processes; their outputs, each checked for exit 0
    and no sanitizer report."""
    outs = []
    try:
        for q in procs:
            rc, out = procs_finish(q, 120)
            outs.append(out)
            assert rc == 0, outs[-1][-3000:]
    finally:
        kill_all(procs)
    return outs


def f32(x):
    return float(np.float32(x))


def read_logdir(logdir):
    r = subprocess.run([PY, READER, str(logdir)], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return json.loads(r.stdout)


def get_json(p, path):
    st, _, body = http("GET", p.url + path)
    assert st == 200, body
    return json.loads(body)


def check_files(doc, runs):
    """One file per run, every record read to the end, CRCs good."""
    assert sorted(os.path.dirname(f) for f in doc["files"]) == sorted(runs), doc["files"]
    for path, f in doc["files"].items():
        assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\.[^/]+\.\d+", os.path.basename(path)), path
        assert f["error"] is None, f
        assert f["first"] == "brain.Event:2", f


def check_against_history(doc, hist):
    """Steps, values and times of "loss" and the eval run equal /v1/history's."""
    runs = doc["runs"]
    assert set(runs) == {"train", "eval"}, runs.keys()
    loss = runs["train"]["loss"]
    assert [s for s, _, _ in loss] == [p[0] for p in hist["points"]]
    assert [v for _, v, _ in loss] == [f32(p[1]) for p in hist["points"]]
    assert all(abs(t - p[2]) < 0.002 for (_, _, t), p in zip(loss, hist["points"]))
    ev = runs["eval"]
    assert set(ev) == {"loss", "accuracy"}, ev.keys()
    assert [(s, v) for s, v, _ in ev["loss"]] == [(e[0], f32(e[1])) for e in hist["eval"]]
    assert [(s, v) for s, v, _ in ev["accuracy"]] == [(e[0], f32(e[2])) for e in hist["eval"]]
    assert all(abs(t - e[3]) < 0.002 for (_, _, t), e in zip(ev["loss"], hist["eval"]))


# ---------------------------------------------------------------- HTTP only

def push_run(p, losses, evals):
    """Losses and evaluator reports chosen here, over plain HTTP."""
    st, _, body = http("PUT", p.url + "/v1/vars/w", np.zeros(1, np.float32).tobytes(), {"X-Shape": "1"})
    assert st == 201, body
    for loss in losses:
        body = st_grads([("w", np.ones(1, np.float32))], {"loss": repr(float(loss))})
        st, _, b = http("POST", p.url + "/v1/grads", body)
        assert st == 200, b
        step = json.loads(b)["global_step"]
        if step in evals:
            rep = {"global_step": step, "loss": evals[step][0], "accuracy": evals[step][1]}
            st, _, b = http("POST", p.url + "/v1/eval", json.dumps(rep).encode())
            assert st == 200, b


@needs_tensorboard
def test_event_files_hold_the_pushed_losses_and_reports(start_psd, tmp_path):
    logdir = tmp_path / "logs"
    p = start_psd(f"--logdir={logdir}", "--learning_rate=0.125")
    losses = [2.5 / (i + 1) + 0.001 * i for i in range(40)]
    evals = {10: (1.25, 0.5), 25: (0.75, 0.625), 40: (0.5, 0.875)}
    push_run(p, losses, evals)
    hist = get_json(p, "/v1/history")
    assert p.stop() == 0  # SIGTERM: what is queued is written
    doc = read_logdir(logdir)
    check_files(doc, ["train", "eval"])
    check_against_history(doc, hist)
    # and against what the test pushed, not only what psd says it kept
    train = doc["runs"]["train"]
    assert [(s, v) for s, v, _ in train["loss"]] == [(i + 1, f32(x)) for i, x in enumerate(losses)]
    assert [s for s, _, _ in doc["runs"]["eval"]["accuracy"]] == sorted(evals)
    assert [v for _, v, _ in doc["runs"]["eval"]["accuracy"]] == [f32(evals[s][1]) for s in sorted(evals)]
    # the rates: once a second while the step moves, and at the stop; no
    # staleness (these pushes name no step)
    assert set(train) == {"loss", "global_step/sec", "examples/sec", "learning_rate"}, train.keys()
    steps = [s for s, _, _ in train["learning_rate"]]
    assert steps == sorted(set(steps)) and steps[-1] == 40, steps
    assert all(v == f32(0.125) for _, v, _ in train["learning_rate"])  # --learning_rate, no chief
    assert all(0 < v <= 40 for _, v, _ in train["global_step/sec"])


@needs_tensorboard
def test_a_corrupted_byte_fails_the_check(start_psd, tmp_path):
    """The checks above can fail: one flipped byte in the middle of the loss
    file. TensorBoard's accumulator then stops there without a word, so the
    loss series comes back short; the record reader names the CRC."""
    logdir = tmp_path / "logs"
    p = start_psd(f"--logdir={logdir}")
    push_run(p, [1.0 / (i + 1) for i in range(30)], {30: (0.5, 0.5)})
    hist = get_json(p, "/v1/history")
    assert p.stop() == 0
    check_against_history(read_logdir(logdir), hist)  # intact: passes
    (path,) = [os.path.join(logdir, "train", n) for n in os.listdir(logdir / "train")]
    b = bytearray(open(path, "rb").read())
    b[len(b) // 2] ^= 0x01
    open(path, "wb").write(bytes(b))
    doc = read_logdir(logdir)
    f = [v for k, v in doc["files"].items() if k.startswith("train/events")][0]
    assert f["error"] and "crc32" in f["error"], f
    assert len(doc["runs"]["train"]["loss"]) < 30
    with pytest.raises(AssertionError):
        check_against_history(doc, hist)
    with pytest.raises(AssertionError):
        check_files(doc, ["train", "eval"])


def test_no_event_files_without_logdir_or_on_other_ps_tasks(start_psd, tmp_path):
    # --logdir= (empty): nothing on disk at all; ps 1: checkpoints only
    p0 = start_psd("--logdir=")
    ports = [free_port(), free_port()]
    hosts = ",".join(f"127.0.0.1:{q}" for q in ports)
    logdir = tmp_path / "ps1logs"
    p1 = start_psd(f"--logdir={logdir}", "--task_index=1", f"--ps_hosts={hosts}", port0=False)
    for p in (p0, p1):
        push_run(p, [0.5, 0.25, 0.125], {3: (0.2, 0.9)})
        assert p.stop() == 0
    found = [os.path.join(r, n) for r, _, ns in os.walk(tmp_path) for n in ns if "tfevents" in n]
    assert found == []
    assert os.listdir(logdir) == ["ps-1"]  # no train/, no eval/
    assert any(n.startswith("model.ckpt-3") for n in os.listdir(logdir / "ps-1"))


# ---------------------------------------------------------------- training

@needs_tensorboard
@needs_data
def test_training_run_shows_in_tensorboard(start_psd, tmp_path):
    """Two async workers and an evaluator, a small model, 300 steps (100
    under the sanitizers)."""
    logdir = tmp_path / "logs"
    p = start_psd(f"--logdir={logdir}")
    workers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    common = [f"--ps_hosts=127.0.0.1:{p.port}", f"--worker_hosts={workers}", f"--data_dir={DATA}",
              "--hidden_units=16", "--batch_size=32", f"--train_steps={STEPS}", "--log_every=0",
              "--optimizer=sgd", "--learning_rate=0.05", "--keep_ps"]
    procs = [subprocess.Popen([binary("workerd"), "--job_name=evaluator", "--task_index=0",
                               "--eval_secs=0.2"] + common, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)]
    procs += [subprocess.Popen([binary("workerd"), "--job_name=worker", f"--task_index={i}"] + common,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in (1, 0)]
    outs = finish(procs)
    hist = get_json(p, "/v1/history")
    status = get_json(p, "/v1/status")
    assert status["global_step"] >= STEPS and status["mode"] == "async"
    assert p.stop() == 0
    doc = read_logdir(logdir)
    check_files(doc, ["train", "eval"])
    check_against_history(doc, hist)
    train, ev = doc["runs"]["train"], doc["runs"]["eval"]
    assert set(train) == TRAIN_TAGS, train.keys()
    # a point per step the history kept: two async workers' pushes can be
    # recorded out of step order, and the history (so the file) keeps a
    # step only when it is past the last one it has
    steps = [s for s, _, _ in train["loss"]]
    assert steps == sorted(set(steps)) and steps[0] >= 1 and steps[-1] == status["global_step"]
    assert len(steps) >= status["global_step"] // 2, len(steps)
    # the evaluator's own lines (4 decimals) against the eval run
    printed = {int(m[0]): (float(m[1]), float(m[2])) for m in
               re.findall(r"global step (\d+): test loss ([\d.]+), test accuracy ([\d.]+)", outs[0])}
    assert printed and sorted(printed) == [s for s, _, _ in ev["loss"]]
    for (s, loss, _), (_, acc, _) in zip(ev["loss"], ev["accuracy"]):
        assert abs(loss - printed[s][0]) <= 5e-5 and abs(acc - printed[s][1]) <= 5e-5
    # the rates: sampled while the step moved, steps increasing, ending at the end
    for tag in TRAIN_TAGS - {"loss"}:
        steps = [s for s, _, _ in train[tag]]
        assert steps == sorted(set(steps)) and steps[-1] == status["global_step"], (tag, steps)
    assert all(v == f32(0.05) for _, v, _ in train["learning_rate"])  # the chief's configuration
    assert train["staleness"][-1][1] == pytest.approx(status["staleness"]["mean"], rel=1e-6)
    assert all(v > 0 for _, v, _ in train["global_step/sec"])
    assert train["examples/sec"][-1][1] > 0


@needs_tensorboard
@needs_data
def test_ring_chief_writes_event_files(tmp_path):
    """A ring of two, no ps: the chief's --logdir holds its run; its loss
    points are the mean losses it prints with --log_every=1."""
    logdir = tmp_path / "ring"
    ring = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    common = ["--allreduce=ring", f"--worker_hosts={ring}", f"--data_dir={DATA}", "--hidden_units=16",
              "--batch_size=32", "--train_steps=60", "--log_every=1", "--optimizer=sgd",
              "--learning_rate=0.05"]
    procs = [subprocess.Popen([binary("workerd"), "--task_index=1", f"--logdir={tmp_path / 'other'}"] + common,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
             subprocess.Popen([binary("workerd"), "--task_index=0", f"--logdir={logdir}"] + common,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
    outs = finish(procs)
    printed = {int(s): float(v) for s, v in
               re.findall(r"\(global step (\d+)\) loss ([\d.]+)", outs[1])}
    assert sorted(printed) == list(range(1, 61)), outs[1][-2000:]
    doc = read_logdir(tmp_path)  # as tensorboard --logdir=<tmp_path> sees it
    assert list(doc["runs"]) == ["ring/train"]  # the other task writes none
    check_files(doc, ["ring/train"])
    run = doc["runs"]["ring/train"]
    assert set(run) == {"loss", "global_step/sec", "examples/sec", "learning_rate"}, run.keys()
    assert [s for s, _, _ in run["loss"]] == list(range(1, 61))
    for s, v, _ in run["loss"]:
        assert abs(v - printed[s]) <= 5e-5, (s, v, printed[s])
    assert all(v == f32(0.05) for _, v, _ in run["learning_rate"])
    for tag in ("global_step/sec", "examples/sec", "learning_rate"):
        steps = [s for s, _, _ in run[tag]]
        assert steps == sorted(set(steps)) and steps[-1] == 60, (tag, steps)
    # examples/sec: both tasks' batches, global_step/sec x 2 x 32
    for (_, sps, _), (_, eps, _) in zip(run["global_step/sec"], run["examples/sec"]):
        assert sps > 0 and eps == pytest.approx(sps * 64, rel=1e-6)
