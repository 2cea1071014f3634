"""A dense variable's gradient by element ids, and workerd --topk_ratio (issue
33's top-k sparsification with error feedback).

psd: "NAME:ids" (I64 or I32 [n], ids of NAME's flattened elements) and
"NAME:values" (F32 or BF16 [n]) in a push stand for the dense gradient with
those values there and zeros elsewhere; the reference is that dense gradient
built here by numpy and pushed to a second psd: both must hold the same bytes
after every push, async and sync, with adam's slots. A bad pair is refused
whole. workerd: the push's bytes on the wire (psd's /metrics) against the dense
run's, and the model it trains against the dense one's accuracy. The pick
itself (the k largest, the residual kept) is checked against a sort in
tests/unit/test_topk.c."""
import json
import subprocess

import numpy as np
import pytest

from conftest import binary, http
from syshelp import assert_error, assert_unchanged, put_var, snapshot
from test_train import DATA, accuracy_of, cluster, needs_data  # noqa: F401
from test_wire import ASAN, bf16_bits, bf16_ref, body16, value

F32 = np.float32
SHAPE = (37, 29)


def dense_of(ids, vals, numel):
    g = np.zeros(numel, F32)
    g[np.asarray(ids, np.int64)] = vals
    return g


def pair(name, ids, vals, id_dt="I64", val_dt="F32"):
    ids = np.asarray(ids, "<i8" if id_dt == "I64" else "<i4")
    raw = bf16_bits(vals).tobytes() if val_dt == "BF16" else np.asarray(vals, "<f4").tobytes()
    return [(f"{name}:ids", id_dt, ids.tobytes(), [len(ids)]), (f"{name}:values", val_dt, raw, [len(ids)])]


def two_psd(start_psd, sync):
    cfg = {"optimizer": "adam", "learning_rate": 0.01}
    if sync:
        cfg.update({"sync": True, "workers": 2})
    a, b = start_psd("--logdir="), start_psd("--logdir=")
    rng = np.random.default_rng(3)
    w0, b0 = rng.standard_normal(SHAPE).astype(F32), rng.standard_normal(SHAPE[1]).astype(F32)
    for p in (a, b):
        put_var(p.url, "w", w0)
        put_var(p.url, "b", b0)
        assert http("PUT", p.url + "/v1/config", json.dumps(cfg).encode())[0] == 200
    return a, b, w0


@pytest.mark.parametrize("sync", [False, True])
def test_a_push_by_ids_equals_the_dense_push_of_its_gradient(start_psd, sync):
    a, b, w0 = two_psd(start_psd, sync)
    numel = SHAPE[0] * SHAPE[1]
    rng = np.random.default_rng(4)
    named = set()
    for step in range(4):
        for worker in range(2 if sync else 1):
            k = int(rng.integers(1, 60))
            ids = rng.choice(numel, k, replace=False)  # any order
            vals = rng.standard_normal(k).astype(F32)
            named.update(int(i) for i in ids)
            bg = rng.standard_normal(SHAPE[1]).astype(F32)
            id_dt, val_dt = ("I64", "F32") if (step + worker) % 2 == 0 else ("I32", "BF16")
            if val_dt == "BF16":
                vals = bf16_ref(vals)  # exactly what the BF16 values widen to
            meta = {"worker": str(worker), "step": str(step)}
            sparse = body16(pair("w", ids, vals, id_dt, val_dt) + [("b", "F32", bg.tobytes(), [SHAPE[1]])], meta)
            dense = body16([("w", "F32", dense_of(ids, vals, numel).tobytes(), list(SHAPE)),
                            ("b", "F32", bg.tobytes(), [SHAPE[1]])], meta)
            st, _, out = http("POST", a.url + "/v1/grads", sparse)
            assert st == 200, out
            st, _, out = http("POST", b.url + "/v1/grads", dense)
            assert st == 200, out
        for name in ("w", "b"):
            assert value(a, name).tobytes() == value(b, name).tobytes(), (step, name)
    st, _, out = http("GET", a.url + "/v1/status")
    assert json.loads(out)["global_step"] == 4
    # not pushes that did nothing: every element named moved, the others
    # stayed (adam's slots of an element never named stay 0)
    moved = value(a, "w") != w0.ravel()
    assert moved[sorted(named)].all() and moved.sum() == len(named), (moved.sum(), len(named))


def test_a_bad_pair_changes_nothing(start_psd):
    p = start_psd("--logdir=")
    put_var(p.url, "w", np.ones(SHAPE, F32))
    put_var(p.url, "b", np.ones(SHAPE[1], F32))
    numel = SHAPE[0] * SHAPE[1]
    before = snapshot(p.url)
    ok_b = ("b", "F32", np.ones(SHAPE[1], F32).tobytes(), [SHAPE[1]])
    nan = np.array([1, np.nan], F32)
    cases = [
        (pair("w", [0, numel], [1, 1]), ["w:ids", f"{numel}", "outside"]),
        (pair("w", [-1, 3], [1, 1]), ["w:ids", "-1", "outside"]),
        (pair("w", [5, 5], [1, 1]), ["w:ids", "twice"]),
        (pair("w", [5, 6], nan), ["NaN", "'w'", "element 6"]),
        (pair("w", [5, 6], nan, "I32", "BF16"), ["NaN", "'w'", "element 6"]),
        (pair("w", [5, 6], [1, 1])[:1], ["w:ids", "w:values"]),  # one half alone
        (pair("w", [5, 6], [1, 1])[1:], ["w:values", "w:ids"]),
        (pair("w", [5, 6], [1, 1]) + [("w", "F32", np.ones(numel, F32).tobytes(), list(SHAPE))], ["twice"]),
        ([("w:ids", "I64", np.array([1, 2], "<i8").tobytes(), [2]),
          ("w:values", "F32", np.ones(3, F32).tobytes(), [3])], ["same n"]),
        ([("w:ids", "I64", np.array([1, 2], "<i8").tobytes(), [2]),
          ("w:values", "F32", np.ones(2, F32).tobytes(), [2, 1])], ["shape [n]"]),
        ([("w:ids", "F32", np.ones(2, F32).tobytes(), [2]),
          ("w:values", "F32", np.ones(2, F32).tobytes(), [2])], ["I64 or I32"]),
        ([("w:ids", "I64", np.array([1, 2], "<i8").tobytes(), [2]),
          ("w:values", "F16", np.ones(2, np.float16).tobytes(), [2])], ["F32 or BF16"]),
    ]
    for tensors, words in cases:
        body = body16(tensors + [ok_b], {"worker": "0", "step": "0"})
        assert_error(*http("POST", p.url + "/v1/grads", body), 400, *words)
        assert_unchanged(p, before)


def push_bytes(p):
    st, _, m = http("GET", p.url + "/metrics")
    assert st == 200
    n = 0.0
    for line in m.decode().splitlines():
        if line.startswith("restps_received_bytes_total{") and 'route="/v1/grads"' in line:
            n += float(line.rsplit(" ", 1)[1])
    return n


@needs_data
def test_topk_trains_as_well_with_a_25th_of_the_push_bytes(cluster, tmp_path):
    # under ASan a short run: the worker's pick and bodies run there, the
    # accuracy is compared on the optimized build
    steps = 40 if ASAN else 400
    args = ["--sync=1", "--optimizer=sgd", "--learning_rate=0.05", "--batch_size=50", f"--train_steps={steps}",
            "--log_every=0", "--seed=11", "--threads=1", "--keep_ps"]
    acc, sent = {}, {}
    for r, wire in (("0", "fp32"), ("0.01", "fp32"), ("0.01", "bf16"), ("0.01", "fp16")):
        c = cluster(2)
        for i in (1, 0):
            c.worker(i, *args, f"--topk_ratio={r}", f"--wire_dtype={wire}")
        outs = c.finish()
        for rc, out in outs:
            assert rc == 0, out[-3000:]
        acc[r, wire] = accuracy_of([o for _, o in outs if "test accuracy" in o][0])
        sent[r, wire] = push_bytes(c.psd)
    print("accuracy", acc, "push bytes", sent)
    dense = ("0", "fp32")
    # 784-100-10: hid_w (78,400) and sm_w (1,000) go as 1% of ids and values
    # (4 bytes each: 8 of 100 floats' 400 bytes), the biases whole
    assert sent["0.01", "fp32"] < 0.04 * sent[dense], sent
    # bf16 values: 6 bytes a pick; fp16's values go as F32 (unscaled)
    assert sent["0.01", "bf16"] < 0.8 * sent["0.01", "fp32"], sent
    assert sent["0.01", "fp16"] < 0.04 * sent[dense], sent
    if ASAN:
        return
    assert acc[dense] > 0.75, acc
    for k in acc:
        assert abs(acc[k] - acc[dense]) <= 0.02, (k, acc)


def test_topk_ratio_flag_is_checked_and_documented():
    for bad in ("1", "-0.1", "1.5"):
        r = subprocess.run([binary("workerd"), f"--topk_ratio={bad}"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "--topk_ratio must be 0 (off) or above 0 and below 1" in r.stderr, (bad, r.stderr)
    for extra in (["--local"], ["--allreduce=ring", "--worker_hosts=127.0.0.1:1"]):
        r = subprocess.run([binary("workerd"), "--topk_ratio=0.01", f"--data_dir={DATA}"] + extra,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "--topk_ratio is for training with the ps" in r.stderr, r.stderr
    h = subprocess.run([binary("workerd"), "--help"], capture_output=True, text=True, timeout=30)
    assert "--topk_ratio" in h.stdout + h.stderr and "error feedback" in h.stdout + h.stderr
