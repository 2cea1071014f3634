"""The ring all-reduce beside the backward pass (workerd --overlap with
--allreduce=ring, issue 33 part 1: PyTorch DDP's gradient buckets).

- bin/ring_allreduce with bucket edges (--edges: inside chunks, next to
  their ends, one float from the buffer's ends) sums to numpy's sum and to
  the very bytes of the same all-reduce without buckets, on 2 and 3 workers;
- a ring job with --overlap (every layer its own bucket) holds the same
  parameters after every step as the same job without it (the param hash of
  every step on every task), and says it runs in buckets;
- a task with --overlap and one without refuse each other's pieces at once,
  naming the flag (a piece's `edges`), and a bad `edges` argument is a 400.
"""
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import BIN, binary, http
from procs import finish
from test_ring import Procs, check_hashes, hosts, ring_job, ring_sum, wait_healthz
from test_train import DATA, load_model, needs_data


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.stop()


def sums(procs, tmp_path, xs, name, extra):
    """test_ring's ring_sum, every rank with extra: the results as arrays, the outputs."""
    _, res = ring_sum(procs, tmp_path, name, xs, [extra] * len(xs))
    for rc, out, _ in res:
        assert rc == 0, out
    return [np.frombuffer(b, "<f4") for _, _, b in res], [(rc, out) for rc, out, _ in res]


@pytest.mark.parametrize("n", [2, 3])
def test_buckets_sum_to_the_same_bytes_as_the_whole_buffer(n, procs, tmp_path):
    rng = np.random.default_rng(40 + n)
    floats = 100_003
    xs = [rng.standard_normal(floats).astype("<f4") for _ in range(n)]
    plain, _ = sums(procs, tmp_path, xs, "plain", [])
    # edges one float in, in the middle of pieces, next to chunk ends, one float before the end
    edges = [1, 4_999, 33_334, 33_335, 50_001, 99_000, floats - 1]
    got, outs = sums(procs, tmp_path, xs, "buck", ["--edges=" + ",".join(map(str, edges))])
    want = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for g in got + plain:
        assert g.tobytes() == plain[0].tobytes(), "buckets changed a sum, or workers disagree"
    assert float(np.abs(plain[0] - want).max()) <= 1e-5 * n
    assert not np.array_equal(plain[0], xs[0])  # it summed
    for rc, out in outs:  # the same bytes on the wire: 2(N-1)/N of the buffer
        m = re.search(r"([\d.]+) bytes sent each \(2\(N-1\)/N x bytes = ([\d.]+)\)", out)
        assert m and abs(float(m.group(1)) - float(m.group(2))) <= 8 * (n - 1), out


def test_bad_edges_are_refused(procs):
    h = hosts(2)
    for bad in ("0", "5,5", "7,3", "10", "x", "3,-1"):
        p = procs.start([binary("ring_allreduce"), f"--worker_hosts={h}", "--task_index=0", "--floats=10",
                         f"--edges={bad}", "--timeout_secs=5"])
        rc, out = finish(p)
        assert rc in (1, 2) and "edge" in out, (bad, rc, out)


@needs_data
def test_overlap_holds_the_same_parameters_after_every_step(procs, tmp_path):
    # mlp:64,32: three layers with parameters, each its own bucket; pieces of 4 KB break inside them
    args = ["--model=mlp:64,32", "--optimizer=adam", "--learning_rate=0.01", "--train_steps=15", "--seed=5",
            "--batch_size=32", "--log_every=0", "--log_param_hash", "--ring_piece_bytes=4096"]
    runs = {}
    for name, extra in (("plain", []), ("overlap", ["--overlap", "--overlap_min_bytes=0"])):
        _, _, ps = ring_job(procs, 3, args + extra, tmp_path, name)
        outs = [finish(p) for p in ps]
        for rc, out in outs:
            assert rc == 0, out[-3000:]
        check_hashes(outs, 1, 15)
        runs[name] = outs
    for out in (o for _, o in runs["overlap"]):
        assert "--overlap: the all-reduce in 3 buckets beside the backward pass" in out, out[-2000:]
    for out in (o for _, o in runs["plain"]):
        assert "buckets" not in out, out[-2000:]
    same = [dict(re.findall(r"global step (\d+) params crc32c ([0-9a-f]{8})", o)) for _, o in runs["plain"]]
    ov = [dict(re.findall(r"global step (\d+) params crc32c ([0-9a-f]{8})", o)) for _, o in runs["overlap"]]
    assert ov == same


@needs_data
def test_overlap_on_one_task_only_is_refused_at_once_naming_the_flag(procs, tmp_path):
    args = ["--model=mlp:64,32", "--optimizer=sgd", "--train_steps=50", "--batch_size=32", "--log_every=0",
            "--ring_timeout_secs=60"]
    h = hosts(2)
    ps = [procs.start([binary("workerd"), "--allreduce=ring", f"--worker_hosts={h}", f"--task_index={i}",
                       f"--data_dir={DATA}", f"--logdir={tmp_path}/l{i}"] + args
                      + (["--overlap", "--overlap_min_bytes=0"] if i == 0 else []))
          for i in range(2)]
    # the task whose piece is refused stops at once, naming the flags; the other waits for its neighbour
    # (as for a neighbour started with another --model), and is stopped here
    deadline = time.monotonic() + 30
    while all(p.poll() is None for p in ps):
        assert time.monotonic() < deadline, "no task stopped"
        time.sleep(0.1)
    first = next(p for p in ps if p.poll() is not None)
    rc, out = finish(first)
    assert rc == 1 and "--overlap" in out and "409" in out and "ring broken" in out, out[-2000:]


def test_the_ring_endpoint_checks_a_pieces_edges(procs):
    h = hosts(2)
    port = int(h.split(",")[0].rsplit(":", 1)[1])
    procs.start([binary("ring_allreduce"), f"--worker_hosts={h}", "--task_index=0", "--floats=10",
                 "--piece_bytes=8", "--timeout_secs=30", "--edges=3"])
    base = f"http://127.0.0.1:{port}"
    wait_healthz(base)
    body = np.arange(2, dtype="<f4").tobytes()
    q = "step=0&k=0&offset=0&from=1&n=2&floats=10"
    for extra, status, words in (("", 409, "--overlap"), ("&edges=1", 409, "--overlap"),
                                 ("&edges=4294967296", 400, "edges"), ("&edges=abc", 400, "edges")):
        st, _, out = http("POST", base + "/v1/ring/chunk?" + q + extra, body)
        assert st == status and words in out.decode(), (extra, st, out)


@needs_data
@pytest.mark.skipif("asan" in BIN, reason="a diverging job of 2 tasks; the sanitizer build runs the bucketed "
                                          "all-reduce in the tests above")
def test_a_diverging_task_with_overlap_stops_loudly_and_exports_nothing(procs, tmp_path):
    args = ["--optimizer=sgd", "--batch_size=20", "--seed=3", "--log_every=0", "--model=mlp:16,8",
            "--learning_rate=1e30", "--train_steps=40", "--ring_timeout_secs=5", "--overlap",
            "--overlap_min_bytes=0"]
    _, export, ps = ring_job(procs, 2, args, tmp_path, "div")
    for rc, out in [finish(p) for p in ps]:
        assert rc == 1, out[-3000:]
        assert "in 3 buckets" in out, out[-3000:]
        # its own gradient (checked before its bucket went), or its neighbour's piece (refused: 400)
        assert re.search(r"(is non-finite|holds a NaN|holds an Inf|summed a non-finite).*stopping", out), out[-3000:]
    assert not os.path.exists(export), "a diverged model was exported"


@needs_data
def test_a_stop_mid_run_checkpoints_a_whole_step(procs, tmp_path):
    """With --overlap a step's last buckets are applied during the next
    forward pass: a SIGTERM in between must still checkpoint a whole step,
    the model a run without --overlap has at that step."""
    args = ["--model=mlp:64,32", "--optimizer=adam", "--learning_rate=0.01", "--seed=9", "--batch_size=32",
            "--log_every=0", "--log_param_hash"]
    h = hosts(2)
    logs = [open(tmp_path / f"t{i}.log", "wb") for i in range(2)]
    ps = []
    for i in range(2):  # output into files (the test reads the chief's while it runs)
        p = subprocess.Popen([binary("workerd"), "--allreduce=ring", f"--worker_hosts={h}", f"--task_index={i}",
                              f"--data_dir={DATA}", f"--logdir={tmp_path}/ov-logs-{i}", "--train_steps=100000",
                              "--step_delay_ms=20", "--overlap", "--overlap_min_bytes=0"] + args,
                             stdout=logs[i], stderr=subprocess.STDOUT)
        procs.procs.append(p)  # stopped by PID at teardown
        ps.append(p)
    deadline = time.monotonic() + 60
    while b"global step 8 params" not in (tmp_path / "t0.log").read_bytes():
        assert time.monotonic() < deadline and all(p.poll() is None for p in ps), (tmp_path / "t0.log").read_text()
        time.sleep(0.05)
    for p in ps:
        p.send_signal(signal.SIGTERM)
    for p in ps:
        assert p.wait(timeout=60) == 0
    out = (tmp_path / "t0.log").read_text()
    m = re.search(r"wrote checkpoint (\S+) \(global step (\d+)\)", out)
    assert m and "stopped by a signal" in out, out[-3000:]
    ckpt, step = m.group(1), int(m.group(2))
    # the run without --overlap to that step
    _, path, plain = ring_job(procs, 2, args + [f"--train_steps={step}"], tmp_path, "plain")
    for rc, o in [finish(p) for p in plain]:
        assert rc == 0, o[-3000:]
    want, _ = load_model(path)
    got, meta = load_model(ckpt)
    assert meta["global_step"] == str(step)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
