"""Row-sparse variables on psd (issue 34): declared with PUT
/v1/vars/NAME/sparse, read by ids (GET /v1/vars/NAME/rows?ids=, raw float32
in the order asked or JSON; POST with a safetensors body of I64 ids), pushed
by ids ("NAME:ids" I64 [n] and "NAME:values" F32 [n, dim] in POST /v1/grads,
or POST /v1/vars/NAME/rows/grad with "ids" and "values").

Everything is compared with an independent numpy implementation: the
initializer (splitmix64 of seed and id, as sparse_table.h states it),
duplicate ids summed, the lazy optimizers (sgd, adagrad, adam: only the
pushed rows move, per-row slots), the sync mean by id over the replicas, a
dense push restricted to the pushed rows (bit for bit for sgd), LRU eviction
in a dynamic table with ids up to 2^62 (memory bounded by max_rows), bad
input refused with 4xx and nothing changed, and a checkpoint that restores
the rows and slots exactly."""
import json
import os
import shutil
import struct
import time

import numpy as np
import pytest

from conftest import curl, http
from syshelp import assert_error, st_body

F32 = np.float32
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def init_row(seed, scale, idx, dim):
    """sparse_init_row: uniform in [-scale, scale) from splitmix64, in float32."""
    base = (seed + idx * GOLDEN) & MASK
    out = np.empty(dim, F32)
    for j in range(dim):
        x = mix64((base + (j + 1) * GOLDEN) & MASK)
        u = F32(x >> 40) * F32(2.0 ** -24)
        out[j] = F32(scale) * (F32(2.0) * u - F32(1.0))
    return out


def body(tensors, meta=None):
    """tensors: list of (name, dtype, array) -> safetensors bytes."""
    header, data = {}, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name, dtype, arr in tensors:
        a = np.ascontiguousarray(arr, dtype={"F32": "<f4", "I64": "<i8"}[dtype])
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [len(data), len(data) + a.nbytes]}
        data += a.tobytes()
    return st_body(header, data)


def read_st(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        b, e = v["data_offsets"]
        out[k] = np.frombuffer(data[b:e], {"F32": "<f4", "I64": "<i8"}[v["dtype"]]).reshape(v["shape"])
    return out


def declare(p, name, **decl):
    st, _, out = http("PUT", f"{p.url}/v1/vars/{name}/sparse", json.dumps(decl).encode())
    assert st in (200, 201), out
    return json.loads(out)


def rows(p, name, ids, dim):
    q = ",".join(str(int(i)) for i in ids)
    st, hd, out = http("GET", f"{p.url}/v1/vars/{name}/rows?ids={q}")
    assert st == 200, out
    assert hd["x-shape"] == f"{len(ids)},{dim}"
    return np.frombuffer(out, "<f4").reshape(len(ids), dim)


def push(p, tensors, meta=None, want=200):
    st, hd, out = http("POST", p.url + "/v1/grads", body(tensors, meta))
    assert st == want, out
    return st, hd, out


def sparse_grad(name, ids, vals):
    return [(name + ":ids", "I64", np.asarray(ids, np.int64)), (name + ":values", "F32", vals)]


def configure(p, **cfg):
    st, _, out = http("PUT", p.url + "/v1/config", json.dumps(cfg).encode())
    assert st == 200, out


def status_sparse(p, name):
    st, _, out = http("GET", p.url + "/v1/status")
    assert st == 200
    return json.loads(out)["sparse"][name]


def test_rows_read_as_initialized_in_the_order_asked(start_psd):
    p = start_psd("--logdir=")
    d = declare(p, "emb", rows=0, dim=5, init="uniform", init_scale=0.25, seed=12345)
    assert d["created"] and d["max_rows"] == 1 << 20  # --max_rows's default
    ids = [99, 3, 17, 3, (1 << 62) + 5]
    got = rows(p, "emb", ids, 5)
    want = np.stack([init_row(12345, 0.25, i, 5) for i in ids])
    assert np.array_equal(got, want)
    # curl, JSON: the same floats
    r = curl(f"{p.url}/v1/vars/emb/rows?ids=3,17,99&format=json")
    doc = json.loads(r.stdout)
    assert doc["ids"] == [3, 17, 99] and doc["dim"] == 5
    assert np.array_equal(np.array(doc["values"], F32), want[[1, 2, 0]])
    # a lookup creates nothing: memory is taken by pushed rows only
    assert status_sparse(p, "emb")["held_rows"] == 0
    # POST: the worker's pull, ids in a safetensors body
    st, _, out = http("POST", f"{p.url}/v1/vars/emb/rows", body([("ids", "I64", np.array(ids))]))
    assert st == 200, out
    assert np.array_equal(read_st(out)["values"], want)
    # the same declaration again is fine, another is 409
    assert not declare(p, "emb", rows=0, dim=5, init="uniform", init_scale=0.25, seed=12345)["created"]
    st, hd, out = http("PUT", f"{p.url}/v1/vars/emb/sparse", json.dumps({"rows": 0, "dim": 6}).encode())
    assert_error(st, hd, out, 409, "emb")


def test_duplicates_summed_and_sgd_equals_the_dense_push_on_its_rows(start_psd):
    """IndexedSlices semantics; the sparse update is the dense update restricted to the pushed rows, bit for bit."""
    p = start_psd("--logdir=")
    configure(p, optimizer="sgd", learning_rate=0.3)
    R, D = 16, 4
    declare(p, "E", rows=R, dim=D, init="uniform", init_scale=1.0, seed=3)
    dense0 = np.stack([init_row(3, 1.0, i, D) for i in range(R)])
    st, _, out = http("PUT", p.url + "/v1/vars/W", dense0.tobytes(), {"X-Shape": f"{R},{D}"})
    assert st == 201, out
    rng = np.random.default_rng(0)
    ids = np.array([5, 2, 5, 11, 2, 5])
    vals = rng.standard_normal((len(ids), D)).astype(F32)
    dense_g = np.zeros((R, D), F32)
    for i, v in zip(ids, vals):  # in order, in float32: what the server sums
        dense_g[i] += v
    push(p, sparse_grad("E", ids, vals) + [("W", "F32", dense_g)])
    st, _, w = http("GET", p.url + "/v1/vars/W")
    w = np.frombuffer(w, "<f4").reshape(R, D)
    got = rows(p, "E", range(R), D)
    touched = sorted(set(ids.tolist()))
    assert np.array_equal(got[touched], w[touched])  # bit for bit
    untouched = [i for i in range(R) if i not in touched]
    assert np.array_equal(got[untouched], dense0[untouched])
    assert np.array_equal(got[touched], dense0[touched] - F32(0.3) * dense_g[touched])
    assert status_sparse(p, "E")["held_rows"] == 3


def lazy_reference(kind, pushes, init, lr, dim):
    """numpy: the lazy optimizers, TF's update rules per row, t = the table's updates."""
    w = {}
    m, v, acc = {}, {}, {}
    t = 0
    for ids, vals in pushes:
        g = {}
        for i, x in zip(ids, vals):
            g[i] = g.get(i, np.zeros(dim, F32)) + x
        t += 1
        for i, gi in g.items():
            if i not in w:
                w[i] = init(i).copy()
                m[i] = np.zeros(dim, F32)
                v[i] = np.zeros(dim, F32)
                acc[i] = np.full(dim, F32(0.1))
            if kind == "adagrad":
                acc[i] = acc[i] + gi * gi
                w[i] = w[i] - gi * F32(lr) / np.sqrt(acc[i])
            elif kind == "adam":
                b1, b2, eps = F32(0.9), F32(0.999), F32(1e-8)
                lr_t = F32(float(F32(lr)) * np.sqrt(1 - float(b2) ** t) / (1 - float(b1) ** t))
                m[i] = b1 * m[i] + (F32(1) - b1) * gi
                v[i] = b2 * v[i] + (F32(1) - b2) * gi * gi
                w[i] = w[i] - lr_t * m[i] / (np.sqrt(v[i]) + eps)
    return w


@pytest.mark.parametrize("kind", ["adagrad", "adam"])
def test_lazy_optimizers_update_only_pushed_rows(start_psd, kind):
    p = start_psd("--logdir=")
    configure(p, optimizer=kind, learning_rate=0.05)
    D = 3
    declare(p, "E", rows=0, dim=D, init="uniform", init_scale=0.5, seed=9)
    rng = np.random.default_rng(1)
    pushes = []
    for k in range(4):
        ids = rng.integers(0, 6, size=5) * 1000003
        vals = rng.standard_normal((5, D)).astype(F32)
        pushes.append((ids.tolist(), vals))
        out = push(p, sparse_grad("E", ids, vals))[2]
        assert json.loads(out)["global_step"] == k + 1
    ref = lazy_reference(kind, pushes, lambda i: init_row(9, 0.5, i, D), 0.05, D)
    ids = sorted(ref)
    got = rows(p, "E", ids, D)
    want = np.stack([ref[i] for i in ids])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # a row never pushed is its initial value
    assert np.array_equal(rows(p, "E", [7], D)[0], init_row(9, 0.5, 7, D))


def test_bad_input_is_refused_and_changes_nothing(start_psd):
    p = start_psd("--logdir=")
    D = 2
    declare(p, "E", rows=10, dim=D, init="uniform", init_scale=1, seed=1)
    declare(p, "S", rows=0, dim=D, shard=1, shards=3)
    ok = np.ones((2, D), F32)
    push(p, sparse_grad("E", [1, 2], ok))

    def state():
        st, _, out = http("GET", p.url + "/v1/status")
        s = json.loads(out)
        return (s["global_step"], s["sparse"], rows(p, "E", range(10), D).tobytes())

    before = state()
    nan = ok.copy()
    nan[1, 0] = np.nan
    cases = [
        (sparse_grad("E", [1, 10], ok), "out of range"),
        (sparse_grad("E", [-1, 2], ok), "negative"),
        (sparse_grad("E", [1, 2, 3], ok), "must be F32 [3, 2]"),
        (sparse_grad("E", [1, 2], np.ones((2, 3), F32)), "must be F32 [2, 2]"),
        (sparse_grad("E", [1, 2], nan), "NaN"),
        ([("E:ids", "I64", np.array([1, 2]))], "E:values"),
        ([("E:values", "F32", ok)], "E:ids"),
        ([("E:ids", "F32", np.array([1, 2], F32)), ("E:values", "F32", ok)], "I64"),
        (sparse_grad("nope", [1, 2], ok), "unknown sparse variable"),
        (sparse_grad("S", [4, 5], ok), "shard"),  # 5 % 3 == 2: another shard's
        (sparse_grad("E", [1, 2], ok) + [("missing", "F32", ok)], "unknown variable"),
    ]
    for tensors, word in cases:
        st, hd, out = http("POST", p.url + "/v1/grads", body(tensors))
        assert_error(st, hd, out, 400, word)
        assert state() == before, word
    # the one-variable route, and the reads
    st, hd, out = http("POST", p.url + "/v1/vars/E/rows/grad",
                       body([("ids", "I64", np.array([3, 1 << 40])), ("values", "F32", ok)]))
    assert_error(st, hd, out, 400, "out of range")
    for q, word in [("ids=1,x", "not a non-negative"), ("ids=", "ids="), ("ids=1,,2", "not a non-negative"),
                    ("ids=10", "out of range"), ("ids=1&format=xml", "format")]:
        st, hd, out = http("GET", f"{p.url}/v1/vars/E/rows?{q}")
        assert_error(st, hd, out, 400, word)
    st, hd, out = http("GET", f"{p.url}/v1/vars/nope/rows?ids=1")
    assert_error(st, hd, out, 404, "nope")

    for decl, word in [({"rows": 0}, "dim"), ({"rows": -1, "dim": 2}, "rows"), ({"rows": 0, "dim": 2, "x": 1}, "x"),
                       ({"rows": 0, "dim": 2, "init": "normal"}, "init"),
                       ({"rows": 0, "dim": 2, "shard": 3, "shards": 3}, "shard")]:
        st, hd, out = http("PUT", f"{p.url}/v1/vars/Z/sparse", json.dumps(decl).encode())
        assert_error(st, hd, out, 400, word)
    assert state() == before
    # the positive control: the same push with good ids is applied
    push(p, sparse_grad("E", [1, 9], ok))
    assert state() != before


def test_an_answer_past_max_body_bytes_is_refused_before_it_is_built(start_psd):
    p = start_psd("--logdir=", "--max_body_bytes=300000")
    declare(p, "W", rows=0, dim=65536)
    assert rows(p, "W", [7], 65536).shape == (1, 65536)  # 256 KiB: within the limit
    st, hd, out = http("GET", f"{p.url}/v1/vars/W/rows?ids=" + ",".join(["1"] * 400))  # 100 MiB
    assert_error(st, hd, out, 400, "--max_body_bytes")
    st, hd, out = http("POST", f"{p.url}/v1/vars/W/rows", body([("ids", "I64", np.arange(400))]))
    assert_error(st, hd, out, 400, "--max_body_bytes")
    st, hd, out = http("GET", f"{p.url}/v1/vars/W/rows?ids=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17&format=json")
    assert_error(st, hd, out, 400, "JSON")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_dynamic_table_evicts_least_recently_updated_with_ids_up_to_2_62(start_psd):
    p = start_psd("--logdir=", "--max_rows=64")
    configure(p, optimizer="sgd", learning_rate=1.0)
    D = 8
    declare(p, "E", rows=0, dim=D)  # zeros, max_rows from --max_rows
    rng = np.random.default_rng(2)
    rss0 = rss_kib(p.proc.pid)
    order = []
    for k in range(40):  # 40 pushes of 16 fresh ids spread over [0, 2^62]
        ids = rng.integers(0, 1 << 62, size=16, dtype=np.int64)
        ids[0] = (1 << 62) - k  # the top of the range too
        push(p, sparse_grad("E", ids, -np.ones((16, D), F32)))
        order.append(ids)
    s = status_sparse(p, "E")
    assert s["held_rows"] == 64 and s["evicted_rows"] == 40 * 16 - 64
    assert s["bytes"] == 64 * D * 4  # sgd: no slots
    assert rss_kib(p.proc.pid) - rss0 < 16 * 1024  # bounded by rows, not by the id space
    st, _, metrics = http("GET", p.url + "/metrics")
    text = metrics.decode()
    assert 'restps_sparse_rows{var="E"} 64\n' in text and f'restps_sparse_bytes{{var="E"}} {64 * D * 4}\n' in text
    assert f'restps_sparse_evicted_rows_total{{var="E"}} {40 * 16 - 64}\n' in text
    # the last 4 pushes' rows are held (value 1), the first ones were evicted (back to 0)
    recent = np.concatenate(order[-4:])
    assert np.array_equal(rows(p, "E", recent, D), np.ones((64, D), F32))
    assert np.array_equal(rows(p, "E", order[0], D), np.zeros((16, D), F32))
    # a row updated again becomes recent: pushed once more, it survives the next push
    keep = order[-4][:1]
    push(p, sparse_grad("E", keep, -np.ones((1, D), F32)))
    push(p, sparse_grad("E", rng.integers(0, 1 << 62, size=16, dtype=np.int64), -np.ones((16, D), F32)))
    assert np.array_equal(rows(p, "E", keep, D), np.full((1, D), 2, F32))
    # an update touching more rows than max_rows is refused
    st, hd, out = http("POST", p.url + "/v1/grads",
                       body(sparse_grad("E", np.arange(65), np.ones((65, D), F32))))
    assert_error(st, hd, out, 400, "max_rows")


def test_sync_sums_by_id_across_replicas(start_psd):
    """Two workers' rows summed by id, averaged over the step's gradients, applied with the dense step."""
    p = start_psd("--logdir=")
    D = 3
    st, _, out = http("PUT", p.url + "/v1/vars/b", np.zeros(2, F32).tobytes(), {"X-Shape": "2"})
    assert st == 201
    declare(p, "E", rows=100, dim=D)
    configure(p, optimizer="sgd", learning_rate=0.5, sync=True, replicas_to_aggregate=2, workers=2)
    g0 = np.arange(6, dtype=F32).reshape(2, D)
    g1 = np.arange(9, dtype=F32).reshape(3, D) * F32(0.5)
    out = push(p, sparse_grad("E", [4, 7], g0) + [("b", "F32", np.ones(2, F32))],
               {"worker": "0", "step": "0"})[2]
    assert json.loads(out)["outcome"] == "pending"
    assert np.array_equal(rows(p, "E", [4, 7], D), np.zeros((2, D), F32))  # not before the step
    out = push(p, sparse_grad("E", [7, 9, 7], g1) + [("b", "F32", np.ones(2, F32))],
               {"worker": "1", "step": "0"})[2]
    assert json.loads(out)["outcome"] == "applied"
    want = {4: g0[0], 7: g0[1] + g1[0] + g1[2], 9: g1[1]}
    got = rows(p, "E", [4, 7, 9, 5], D)
    for k, i in enumerate([4, 7, 9]):
        assert np.array_equal(got[k], F32(0) - F32(0.5) * (want[i] * F32(0.5))), i
    assert np.array_equal(got[3], np.zeros(D, F32))
    # the one-variable route is for async training
    st, hd, out = http("POST", p.url + "/v1/vars/E/rows/grad",
                       body([("ids", "I64", np.array([1])), ("values", "F32", np.ones((1, D), F32))]))
    assert_error(st, hd, out, 409, "sync")


def test_checkpoint_restores_rows_slots_and_eviction_order(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    p = start_psd("--logdir=" + logdir, "--save_checkpoint_secs=0")
    configure(p, optimizer="adam", learning_rate=0.1)
    D = 4
    declare(p, "E", rows=0, dim=D, max_rows=8, init="uniform", init_scale=0.1, seed=5)
    rng = np.random.default_rng(3)
    for k in range(3):
        push(p, sparse_grad("E", rng.integers(0, 1 << 62, size=4, dtype=np.int64),
                            rng.standard_normal((4, D)).astype(F32)))
    st, _, out = http("POST", p.url + "/v1/checkpoint")
    assert st == 200, out
    s_before = status_sparse(p, "E")
    assert s_before["held_rows"] == 8 and s_before["evicted_rows"] == 4
    saved = str(tmp_path / "saved")
    shutil.copytree(logdir, saved)  # this checkpoint alone (a clean stop saves another)
    nxt = [(rng.integers(0, 1 << 62, size=4, dtype=np.int64), rng.standard_normal((4, D)).astype(F32))
           for _ in range(2)]
    # the uncut run goes on
    ids_all = []
    for ids, vals in nxt:
        push(p, sparse_grad("E", ids, vals))
        ids_all += ids.tolist()
    want = rows(p, "E", ids_all, D)
    want_status = status_sparse(p, "E")
    p.stop()
    # restored from the checkpoint, the same pushes give the same bits
    q = start_psd("--logdir=" + saved, "--save_checkpoint_secs=0")
    assert status_sparse(q, "E") == s_before
    for ids, vals in nxt:
        push(q, sparse_grad("E", ids, vals))
    assert np.array_equal(rows(q, "E", ids_all, D), want)
    assert status_sparse(q, "E") == want_status
