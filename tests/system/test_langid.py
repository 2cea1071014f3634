"""workerd --data=langid (issue 34): language identification of Debian's
word lists with an embedding bag over hashed character n-grams, the table a
sparse variable.

- --local against an independent numpy implementation of the same data
  selection, hashing, model and training (tests/helpers/langid_ref.py):
  test accuracy within 0.5 points, and above the numpy bag-of-n-grams
  logistic regression baseline; the bytes a step moves are the rows it
  touches (printed beside the whole table's: >= 100x fewer with 2^21 rows);
- sync, 2 workers over 2 ps tasks == --local with twice the batch (rtol
  1e-5; sgd), async over 2 ps tasks trains;
- the modes that cannot hold a sparse variable refuse it, saying why.

Needs the word lists (make deps: wamerican, wngerman, ...); skips without."""
import json
import os
import re
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import HELPERS, binary, http
from procs import finish, free_port, kill_all

DICT = "/usr/share/dict"
LISTS = ["american-english", "ngerman", "french", "spanish", "italian", "dutch", "portuguese", "swedish",
         "bokmaal", "danish", "polish"]
WORDS = "3000"  # per language: 27354 train, 3070 test words


@pytest.fixture(autouse=True)
def _word_lists():
    missing = [n for n in LISTS if not os.path.exists(os.path.join(DICT, n))]
    if missing:
        pytest.skip(f"the word lists {missing} are missing from {DICT}: run make deps")


def workerd(*args, timeout=120):
    r = subprocess.run([binary("workerd"), "--data=langid", f"--langid_words={WORDS}", "--device=cpu",
                        "--log_every=0"] + list(args), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def accuracy(out):
    m = re.search(r"test loss [0-9.]+ accuracy ([0-9.]+) \((\d+) words\)", out)
    assert m, out
    return float(m.group(1)), int(m.group(2))


def read_st(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    out = {}
    for k, v in head.items():
        if k != "__metadata__":
            b, e = v["data_offsets"]
            out[k] = np.frombuffer(raw[8 + n + b:8 + n + e],
                                   {"F32": "<f4", "I64": "<i8"}[v["dtype"]]).reshape(v["shape"])
    return out, head.get("__metadata__", {})


def test_local_matches_numpy_and_beats_the_logistic_regression_baseline(tmp_path):
    steps, batch, lr = 1000, 100, 0.01
    out = workerd("--local", f"--train_steps={steps}", f"--batch_size={batch}", f"--learning_rate={lr}",
                  "--export=" + str(tmp_path / "m.safetensors"))
    acc, n_test = accuracy(out)
    ref = subprocess.run([sys.executable if sys.executable else "python3", os.path.join(HELPERS, "langid_ref.py"),
                          DICT, WORDS, str(1 << 21), "16", str(steps), str(batch), str(lr), "1"],
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    r = json.loads(ref.stdout)
    assert r["test"] == n_test, (r, out)
    assert abs(acc - r["accuracy"]) <= 0.005, (acc, r)
    assert acc > r["baseline_accuracy"], (acc, r)
    assert acc > 0.8, out
    # bytes per step: the rows touched, >= 100x fewer than the 2^21-row table
    m = re.search(r"rows touched per step ([0-9.]+) of 2097152: (\d+) bytes per step each way against (\d+) dense "
                  r"\((\d+)x fewer\)", out)
    assert m, out
    rows, sparse_b, dense_b = float(m.group(1)), int(m.group(2)), int(m.group(3))
    assert dense_b == (1 << 21) * 16 * 4 + (16 * 11 + 11) * 4
    assert abs(sparse_b - (rows * 16 * 4 + (16 * 11 + 11) * 4)) <= 0.05 * 16 * 4 + 1  # rows printed to 0.1
    assert dense_b / sparse_b >= 100
    # the export: the dense layer and the rows held
    t, meta = read_st(tmp_path / "m.safetensors")
    assert meta["data"] == "langid" and meta["model"] == "embed:2097152x16,mean,dense:11"
    assert t["sm_w"].shape == (16, 11) and t["emb:values"].shape == (len(t["emb:ids"]), 16)
    assert len(set(t["emb:ids"].tolist())) == len(t["emb:ids"]) > 1000


def cluster(tmp_path, mode, steps, batch, extra=(), look=None):
    """2 psd, 2 workers (worker 0 the chief, exporting): the chief's stdout.
    The chief stops the ps tasks at the end, or, with look, look(ps urls) runs
    first (--keep_ps) and the test stops them; every process is waited for or
    killed by PID."""
    ps = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    wk = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    psd = [subprocess.Popen([binary("psd"), "--ps_hosts=" + ",".join(ps), f"--task_index={i}", "--logdir="],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    common = [binary("workerd"), "--data=langid", f"--langid_words={WORDS}", "--device=cpu", "--log_every=0",
              "--ps_hosts=" + ",".join(ps), "--worker_hosts=" + ",".join(wk), "--job_name=worker",
              f"--train_steps={steps}", f"--batch_size={batch}"] + (["--sync"] if mode == "sync" else []) + list(extra)
    w1 = subprocess.Popen(common + ["--task_index=1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ok = False
    try:
        chief = subprocess.run(common + ["--task_index=0", "--export=" + str(tmp_path / f"{mode}.safetensors")]
                               + (["--keep_ps"] if look else []), capture_output=True, text=True, timeout=120)
        assert chief.returncode == 0, chief.stdout + chief.stderr
        rc, out1 = finish(w1, 60)
        assert rc == 0, out1
        if look:
            urls = ["http://" + h for h in ps]
            look(urls)
            for u in urls:
                assert http("POST", u + "/v1/shutdown")[0] == 202
        for p in psd:
            assert finish(p, 30)[0] == 0
        ok = True
        return chief.stdout
    finally:
        if not ok:
            kill_all(psd + [w1])


def test_sync_two_workers_equal_local_with_twice_the_batch(tmp_path):
    steps, sgd = 150, ["--optimizer=sgd", "--learning_rate=2"]
    out = cluster(tmp_path, "sync", steps, 50, sgd)
    assert "the embedding table emb [2097152, 16] on 2 ps tasks" in out, out
    workerd("--local", f"--train_steps={steps}", "--batch_size=100", "--export=" + str(tmp_path / "local.safetensors"),
            *sgd)
    a, _ = read_st(tmp_path / "sync.safetensors")
    b, _ = read_st(tmp_path / "local.safetensors")
    for k in ("sm_w", "sm_b"):
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-8)
    # the rows --local holds, against the same ids read from the ps tasks
    at = {int(i): j for j, i in enumerate(a["emb:ids"])}
    rows = a["emb:values"][[at[int(i)] for i in b["emb:ids"]]]
    np.testing.assert_allclose(rows, b["emb:values"], rtol=1e-5, atol=1e-8)
    assert not np.array_equal(b["emb:values"][:1], np.zeros((1, 16), np.float32))


def test_async_over_two_ps_trains(tmp_path):
    seen = {}

    def look(urls):
        st, _, body = http("GET", urls[0] + "/v1/placement")
        assert st == 200, body
        seen["placement"] = json.loads(body)
        for i, u in enumerate(urls):
            st, _, body = http("GET", u + "/v1/status")
            seen[i] = json.loads(body)["sparse"]["emb"]

    out = cluster(tmp_path, "async", 800, 100, look=look)
    # the table's sharding in the placement map, each ps holding its ids' rows only
    assert seen["placement"]["sparse"] == [{"name": "emb", "rows": 1 << 21, "dim": 16,
                                            "sharding": "id mod ps_tasks", "ps_tasks": 2}]
    for i in range(2):
        assert (seen[i]["shard"], seen[i]["shards"]) == (i, 2) and seen[i]["held_rows"] > 1000, seen[i]
        assert seen[i]["bytes"] == seen[i]["held_rows"] * 16 * 4 * 3  # adam: the rows and 2 slots
    acc, _ = accuracy(out)
    assert acc > 0.7, out
    m = re.search(r"\((\d+)x fewer\)", out)
    assert m and int(m.group(1)) >= 100, out


@pytest.mark.parametrize("flag,word", [("--allreduce=ring", "--allreduce=ring"),
                                       ("--pipeline_stages=2", "--pipeline_stages")])
def test_modes_without_the_ps_refuse_a_sparse_variable(flag, word):
    ps, wk = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    r = subprocess.run([binary("workerd"), "--data=langid", flag, "--ps_hosts=" + ps, "--worker_hosts=" + wk,
                        "--job_name=worker", "--task_index=0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert word in r.stderr and "sparse variable" in r.stderr, r.stderr


def test_a_langid_model_is_refused_by_what_reads_fashion_mnist_models_and_by_export_onnx(tmp_path):
    """--export_onnx was ignored with --data=langid (exit 0, no file), and
    --evaluate_model on a langid export said it had no model in its
    metadata (exported by an older workerd?): both now say what the file is."""
    out = tmp_path / "l.safetensors"
    workerd("--local", "--train_steps=5", f"--export={out}")
    for flag in ([f"--evaluate_model={out}"], [f"--convert_model={out}", f"--export_onnx={tmp_path / 'x.onnx'}"]):
        r = subprocess.run([binary("workerd"), "--device=cpu"] + flag, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "a --data=langid model (embed:" in r.stderr and "older workerd" not in r.stderr, r.stderr
    t0 = time.time()
    r = subprocess.run([binary("workerd"), "--data=langid", "--local", "--train_steps=5", "--device=cpu",
                        f"--export_onnx={tmp_path / 'l.onnx'}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--export_onnx" in r.stderr and "no ONNX export" in r.stderr, r.stdout + r.stderr
    assert "training locally" not in r.stdout and time.time() - t0 < 20  # refused before it trains
    assert not (tmp_path / "l.onnx").exists() and not (tmp_path / "x.onnx").exists()
