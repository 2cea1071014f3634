"""--moving_average_decay (issue 19), tf.train.ExponentialMovingAverage on the
ps: after each update of a variable, shadow -= (1 - D) * (shadow - w), with a
constant D (TF's default num_updates=None: no min(D, (1 + n) / (10 + n))),
the shadow starting from the variable's value when EMA starts. Checked
against a numpy reference built from the variable values pulled after each
push; the read paths (GET /v1/params and /v1/vars/<name> with
moving_average=1), the refusals, the checkpoint round trip (tensors
"<name>:ExponentialMovingAverage") and workerd's export, which holds the
averages."""
import json
import os
import struct
import subprocess

import numpy as np
import pytest

import ckpt_check
from conftest import binary, http
from syshelp import put_var
from test_train import DATA, cluster, load_model, needs_data  # noqa: F401 (fixture)

F32 = np.float32
W0 = (np.arange(12, dtype=F32).reshape(3, 4) - 5) / 4
B0 = np.array([0.5, -1.0, 2.0, 0.0, -0.25], F32)
CFG = {"optimizer": "adam", "learning_rate": 0.05, "moving_average_decay": 0.75}


def parse_st(body):
    (n,) = struct.unpack("<Q", body[:8])
    h = json.loads(body[8:8 + n])
    meta = h.pop("__metadata__", {})
    d = body[8 + n:]
    return {k: np.frombuffer(d[v["data_offsets"][0]:v["data_offsets"][1]], "<f4").reshape(v["shape"])
            for k, v in h.items()}, meta


def params(p, avg):
    st, _, body = http("GET", p.url + "/v1/params" + ("?moving_average=1" if avg else ""))
    assert st == 200, body
    return parse_st(body)


def configure(p, cfg, want=200):
    st, _, body = http("PUT", p.url + "/v1/config", json.dumps(cfg).encode())
    assert st == want, (cfg, st, body)
    return json.loads(body)


def grad(p, name, g):
    st, _, body = http("POST", f"{p.url}/v1/vars/{name}/grad", np.asarray(g, "<f4").tobytes())
    assert st == 200, body


class Ema:
    """The numpy reference: TF's assign_moving_average in float32, from the
    values psd reports after each update."""

    def __init__(self, values, decay, num_updates=False):
        self.s = {k: np.array(v, F32) for k, v in values.items()}
        self.d, self.num_updates, self.n = decay, num_updates, 0

    def update(self, name, w):
        self.n += 1
        d = F32(self.d)
        if self.num_updates:  # what TF does with num_updates=global_step: not psd's choice
            d = min(d, F32((1 + self.n) / (10 + self.n)))
        self.s[name] = (self.s[name] - (F32(1) - d) * (self.s[name] - np.asarray(w, F32))).astype(F32)


def train(p, steps, refs, rng):
    for _ in range(steps):
        for name, shape in (("w", (3, 4)), ("b", (5,))):
            grad(p, name, rng.standard_normal(shape).astype(F32))
            w = params(p, False)[0][name]
            for r in refs:
                r.update(name, w)


def start(start_psd, *args):
    p = start_psd(*args)
    put_var(p.url, "w", W0)
    put_var(p.url, "b", B0)
    return p


def test_averages_match_numpy(start_psd):
    p = start(start_psd)
    echoed = configure(p, CFG)
    assert echoed["moving_average_decay"] == pytest.approx(0.75)
    # before any update the average is the variable
    avg, meta = params(p, True)
    assert meta["moving_average"] == "1"
    np.testing.assert_array_equal(avg["w"], W0)
    ref = Ema({"w": W0, "b": B0}, 0.75)
    other = Ema({"w": W0, "b": B0}, 0.75, num_updates=True)
    train(p, 6, [ref, other], np.random.default_rng(3))
    avg, _ = params(p, True)
    var, _ = params(p, False)
    for k in ("w", "b"):
        np.testing.assert_allclose(avg[k], ref.s[k], rtol=1e-6, atol=1e-7)
        # the comparison can fail: the variable and TF's num_updates form differ
        assert np.max(np.abs(avg[k] - var[k])) > 1e-3
        assert np.max(np.abs(avg[k] - other.s[k])) > 1e-3
    st, _, body = http("GET", p.url + "/v1/vars/w?moving_average=1")
    assert st == 200
    np.testing.assert_array_equal(np.frombuffer(body, "<f4").reshape(3, 4), avg["w"])
    st, _, body = http("GET", p.url + "/v1/vars/w?moving_average=1&format=json")
    assert st == 200
    np.testing.assert_allclose(np.array(json.loads(body)["values"], F32).reshape(3, 4), avg["w"])


def test_off_or_bad_query_is_400(start_psd):
    p = start(start_psd)
    configure(p, {"optimizer": "sgd", "learning_rate": 0.1})
    for path in ("/v1/params?moving_average=1", "/v1/vars/w?moving_average=1"):
        st, _, body = http("GET", p.url + path)
        assert st == 400 and b"moving_average_decay" in body, (path, st, body)
    for path in ("/v1/params?moving_average=2", "/v1/vars/w?moving_average=x"):
        st, _, body = http("GET", p.url + path)
        assert st == 400 and b"moving_average" in body, (path, st, body)
    st, _, _ = http("GET", p.url + "/v1/params?moving_average=0")
    assert st == 200


@pytest.mark.parametrize("bad", [1, 1.5, -0.1, 0.99999999999, 1e-50, "0.9", True])
def test_decay_out_of_range_is_400(start_psd, bad):
    p = start(start_psd)
    st, _, body = http("PUT", p.url + "/v1/config",
                       json.dumps({"optimizer": "sgd", "moving_average_decay": bad}).encode())
    assert st == 400 and b"moving_average_decay" in body, (bad, st, body)
    st, _, _ = http("GET", p.url + "/v1/config")
    assert st == 404  # nothing configured


@pytest.mark.parametrize("bad", ["1", "0.999999999", "-0.5", "nan", "inf", "x"])
def test_workerd_refuses_bad_decay(bad):
    r = subprocess.run([binary("workerd"), "--job_name=worker", "--task_index=0",
                        "--ps_hosts=127.0.0.1:1", "--worker_hosts=127.0.0.1:2",
                        f"--moving_average_decay={bad}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "moving_average_decay" in r.stderr, (bad, r.returncode, r.stderr)
    r = subprocess.run([binary("workerd"), "--local", "--moving_average_decay=0.9"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "moving_average_decay" in r.stderr and "local" in r.stderr


def test_checkpoint_keeps_the_averages(start_psd, tmp_path):
    logdir = str(tmp_path / "logs")
    p = start(start_psd, f"--logdir={logdir}")
    configure(p, CFG)
    ref = Ema({"w": W0, "b": B0}, 0.75)
    rng = np.random.default_rng(5)
    train(p, 3, [ref], rng)
    st, _, body = http("POST", p.url + "/v1/checkpoint")
    assert st == 200, body
    meta, t = ckpt_check.read(os.path.join(logdir, "ps-0", json.loads(body)["file"]))
    assert {"w:ExponentialMovingAverage", "b:ExponentialMovingAverage"} <= set(t)
    np.testing.assert_allclose(t["w:ExponentialMovingAverage"].reshape(3, 4), ref.s["w"], rtol=1e-6,
                               atol=1e-7)
    assert json.loads(meta["config"])["moving_average_decay"] == pytest.approx(0.75)
    assert p.stop() == 0
    q = start_psd(f"--logdir={logdir}")
    avg, _ = params(q, True)
    for k in ("w", "b"):
        np.testing.assert_allclose(avg[k], ref.s[k], rtol=1e-6, atol=1e-7)
    configure(q, CFG)  # the restarted chief's same configuration
    train(q, 2, [ref], rng)  # and the averages go on from where they were
    avg, _ = params(q, True)
    for k in ("w", "b"):
        np.testing.assert_allclose(avg[k], ref.s[k], rtol=1e-6, atol=1e-7)


@needs_data
def test_export_and_evaluator_use_the_averages(cluster, tmp_path):  # noqa: F811
    c = cluster(1)
    path = str(tmp_path / "m.safetensors")
    args = ["--sync=1", "--model=mlp:16", "--optimizer=adam", "--learning_rate=0.01",
            "--train_steps=20", "--log_every=0", "--moving_average_decay=0.9"]
    c.worker(0, "--train_steps=20", "--eval_secs=0.2", "--model=mlp:16", "--moving_average_decay=0.9",
             job="evaluator")
    c.worker(0, *args, "--keep_ps", f"--export={path}")
    outs = c.finish(timeout=300)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    assert "evaluating the moving averages" in outs[0][1], outs[0][1][-2000:]
    model, meta = load_model(path)
    assert float(meta["moving_average_decay"]) == pytest.approx(0.9)
    assert meta["global_step"] == "20"
    avg, _ = params(c.psd, True)
    var, _ = params(c.psd, False)
    assert set(model) == set(avg)
    for k in model:
        np.testing.assert_array_equal(model[k], avg[k])
    assert max(np.max(np.abs(model[k] - var[k])) for k in model) > 1e-4
