"""The optimizers and update options of issue 4 on a real psd: adagrad,
rmsprop, Nesterov momentum, per-variable gradient clipping, decoupled weight
decay and the learning-rate schedules, each against a numpy implementation
written here from TensorFlow's formulas (tf.compat.v1.train's optimizers,
tf.clip_by_norm, exponential_decay, cosine_decay), in float32. Also: the
configuration's echo and refusals, sync averaging before clipping, and a
checkpoint round trip that proves the slots come back.

Weight decay is decoupled (Keras' weight_decay, AdamW's form): before each
update w -= lr_t * weight_decay * w, lr_t the scheduled learning rate."""
import json
import math
import os
import socket
import subprocess

import numpy as np
import pytest

import ckpt_check
from conftest import binary, http
from syshelp import assert_error, get_raw, put_var, st_grads

F32 = np.float32
RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------- the numpy reference

def lr_at(cfg, step):
    """The learning rate at global_step `step` (tf.compat.v1.train's decays)."""
    lr = float(F32(cfg.get("learning_rate", 0.01)))
    sched = cfg.get("lr_schedule", "constant")
    if sched == "exponential":
        p = step / cfg["decay_steps"]
        if cfg.get("staircase", False):
            p = math.floor(p)
        return F32(lr * float(F32(cfg["decay_rate"])) ** p)
    if sched == "cosine":
        d = cfg["decay_steps"]
        alpha = float(F32(cfg.get("alpha", 0.0)))
        cos = 0.5 * (1 + math.cos(math.pi * min(step, d) / d))
        return F32(lr * ((1 - alpha) * cos + alpha))
    return F32(lr)


class Ref:
    """One variable under one configuration, as TensorFlow updates it."""

    def __init__(self, w, cfg):
        self.cfg = cfg
        self.kind = cfg.get("optimizer", "sgd")
        self.w = np.array(w, F32)
        self.t = 0
        z = np.zeros_like(self.w)
        if self.kind == "momentum":
            self.slots = {"momentum": z.copy()}
        elif self.kind == "adam":
            self.slots = {"adam_m": z.copy(), "adam_v": z.copy()}
        elif self.kind == "adagrad":
            # AdagradOptimizer: initial_accumulator_value, default 0.1
            self.slots = {"adagrad": np.full_like(self.w, F32(cfg.get("initial_accumulator_value", 0.1)))}
        elif self.kind == "rmsprop":
            # RMSPropOptimizer: the rms slot starts at ones, momentum at zeros
            self.slots = {"rmsprop_ms": np.ones_like(self.w), "rmsprop_mom": z.copy()}
        else:
            self.slots = {}

    def step(self, g, global_step):
        c = self.cfg
        g = np.array(g, F32)
        lr = lr_at(c, global_step)
        clip = c.get("clip_norm", 0)
        if clip > 0:  # tf.clip_by_norm: t * clip_norm / max(l2norm(t), clip_norm)
            norm = np.sqrt(np.sum(g.astype(np.float64) ** 2))
            g = (g.astype(np.float64) * float(F32(clip)) / max(norm, float(F32(clip)))).astype(F32)
        w = self.w - lr * F32(c.get("weight_decay", 0)) * self.w
        self.t += 1
        s = self.slots
        if self.kind == "sgd":
            w = w - lr * g
        elif self.kind == "momentum":
            m = F32(c.get("momentum", 0.9))
            s["momentum"] = m * s["momentum"] + g
            if c.get("nesterov"):
                w = w - lr * (g + m * s["momentum"])
            else:
                w = w - lr * s["momentum"]
        elif self.kind == "adam":
            b1, b2 = F32(c.get("beta1", 0.9)), F32(c.get("beta2", 0.999))
            eps = F32(c.get("epsilon", 1e-8))
            s["adam_m"] = b1 * s["adam_m"] + (1 - b1) * g
            s["adam_v"] = b2 * s["adam_v"] + (1 - b2) * g * g
            lr_t = F32(float(lr) * math.sqrt(1 - float(b2) ** self.t) / (1 - float(b1) ** self.t))
            w = w - lr_t * s["adam_m"] / (np.sqrt(s["adam_v"]) + eps)
        elif self.kind == "adagrad":
            s["adagrad"] = s["adagrad"] + g * g
            w = w - lr * g / np.sqrt(s["adagrad"])
        elif self.kind == "rmsprop":
            rho = F32(c.get("rmsprop_decay", 0.9))
            m = F32(c.get("momentum", 0.0))
            eps = F32(c.get("epsilon", 1e-10))
            s["rmsprop_ms"] = rho * s["rmsprop_ms"] + (1 - rho) * g * g
            s["rmsprop_mom"] = m * s["rmsprop_mom"] + lr * g / np.sqrt(s["rmsprop_ms"] + eps)
            w = w - s["rmsprop_mom"]
        self.w = w.astype(F32)


# ------------------------------------------------------------------ helpers

W0 = (np.arange(12, dtype=F32).reshape(3, 4) - 5) / 4
B0 = np.array([0.5, -1.0, 2.0, 0.0, -0.25], F32)


def configure(p, cfg, want=200):
    st, hd, body = http("PUT", p.url + "/v1/config", json.dumps(cfg).encode())
    assert st == want, (cfg, st, body)
    return json.loads(body)


def get_config(p):
    st, _, body = http("GET", p.url + "/v1/config")
    assert st == 200, body
    return json.loads(body)


def grad(p, name, g):
    st, _, body = http("POST", f"{p.url}/v1/vars/{name}/grad", np.asarray(g, "<f4").tobytes())
    assert st == 200, body
    return json.loads(body)["global_step"]


def value(p, name, shape):
    return np.frombuffer(get_raw(p.url, name), "<f4").reshape(shape)


def grads(k):
    """Gradients of varied size: some far above the clip norms used, some below."""
    rng = np.random.default_rng(1000 + k)
    scale = F32([0.05, 3.0, 0.4, 8.0, 1.0, 0.02][k % 6])
    return ((rng.standard_normal((3, 4)) * scale).astype(F32),
            (rng.standard_normal(5) * scale).astype(F32))


class Run:
    """psd + numpy reference side by side; every push is checked."""

    def __init__(self, p, cfg):
        self.p, self.cfg = p, cfg
        put_var(p.url, "w", W0)
        put_var(p.url, "b", B0)
        configure(p, cfg)
        self.ref = {"w": Ref(W0, cfg), "b": Ref(B0, cfg)}
        self.step = 0
        self.worst = 0.0

    def push(self, name, g):
        got_step = grad(self.p, name, g)
        self.ref[name].step(g, self.step)
        self.step += 1
        assert got_step == self.step
        ref = self.ref[name].w
        got = value(self.p, name, ref.shape)
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{self.cfg} {name} after global_step {self.step}")
        self.worst = max(self.worst, float(np.max(np.abs(got - ref) / (np.abs(ref) + ATOL / RTOL))))

    def run(self, k):
        for i in range(k):
            gw, gb = grads(i)
            self.push("w", gw)
            self.push("b", gb)


# ------------------------------------------------- every optimizer and option

CASES = {
    "sgd": {"optimizer": "sgd", "learning_rate": 0.1},
    "momentum": {"optimizer": "momentum", "learning_rate": 0.05},
    "nesterov": {"optimizer": "momentum", "learning_rate": 0.05, "nesterov": True},
    "nesterov_m0.5": {"optimizer": "momentum", "learning_rate": 0.1, "momentum": 0.5,
                      "nesterov": True},
    "adam": {"optimizer": "adam", "learning_rate": 0.05},
    "adagrad": {"optimizer": "adagrad", "learning_rate": 0.2},
    "adagrad_init0.5": {"optimizer": "adagrad", "learning_rate": 0.2,
                        "initial_accumulator_value": 0.5},
    "rmsprop": {"optimizer": "rmsprop", "learning_rate": 0.01},
    "rmsprop_momentum": {"optimizer": "rmsprop", "learning_rate": 0.01, "momentum": 0.9,
                         "rmsprop_decay": 0.8, "epsilon": 1e-6},
    "sgd_clip": {"optimizer": "sgd", "learning_rate": 0.1, "clip_norm": 1.0},
    "adam_clip": {"optimizer": "adam", "learning_rate": 0.05, "clip_norm": 0.5},
    "rmsprop_clip": {"optimizer": "rmsprop", "learning_rate": 0.01, "clip_norm": 2.0},
    "sgd_wd": {"optimizer": "sgd", "learning_rate": 0.1, "weight_decay": 0.5},
    "momentum_wd": {"optimizer": "momentum", "learning_rate": 0.1, "weight_decay": 0.1},
    "adam_wd": {"optimizer": "adam", "learning_rate": 0.05, "weight_decay": 0.2},
    "adagrad_wd": {"optimizer": "adagrad", "learning_rate": 0.2, "weight_decay": 0.3},
    "sgd_exponential": {"optimizer": "sgd", "learning_rate": 0.2, "lr_schedule": "exponential",
                        "decay_steps": 3, "decay_rate": 0.5},
    "sgd_staircase": {"optimizer": "sgd", "learning_rate": 0.2, "lr_schedule": "exponential",
                      "decay_steps": 3, "decay_rate": 0.5, "staircase": True},
    "sgd_cosine": {"optimizer": "sgd", "learning_rate": 0.2, "lr_schedule": "cosine",
                   "decay_steps": 7},
    "adam_cosine_alpha": {"optimizer": "adam", "learning_rate": 0.05, "lr_schedule": "cosine",
                          "decay_steps": 5, "alpha": 0.25},
    "everything": {"optimizer": "rmsprop", "learning_rate": 0.02, "momentum": 0.5,
                   "clip_norm": 1.5, "weight_decay": 0.05, "lr_schedule": "exponential",
                   "decay_steps": 4, "decay_rate": 0.7, "staircase": True},
    "nesterov_everything": {"optimizer": "momentum", "learning_rate": 0.05, "nesterov": True,
                            "clip_norm": 0.8, "weight_decay": 0.1, "lr_schedule": "cosine",
                            "decay_steps": 6, "alpha": 0.1},
}


@pytest.mark.parametrize("name", list(CASES))
def test_updates_match_tensorflow_formulas(start_psd, name):
    """Six pushes to each of two variables (global_step 0 to 11, past every
    decay_steps used), the variable read back after each and compared with
    numpy at rtol 1e-5."""
    r = Run(start_psd(), CASES[name])
    r.run(6)
    print(f"{name}: 12 updates, worst relative difference {r.worst:.2e}")


def test_the_comparison_can_fail(start_psd):
    """Each reference differs from the others: a server that ignored an option
    would fail (sgd's pushes checked against the numpy of every other case)."""
    p = start_psd()
    r = Run(p, CASES["sgd"])
    r.run(3)
    got = value(p, "w", W0.shape)
    for name, cfg in CASES.items():
        if name == "sgd" or ("sgd" in name and "clip" in name):
            continue  # sgd with clipping above these gradients' norms may coincide
        ref = {"w": Ref(W0, cfg), "b": Ref(B0, cfg)}
        step = 0
        for i in range(3):
            gw, gb = grads(i)
            ref["w"].step(gw, step)
            ref["b"].step(gb, step + 1)
            step += 2
        assert not np.allclose(got, ref["w"].w, rtol=RTOL, atol=ATOL), name


def effective_rates(p, cfg, steps):
    """The learning rate psd used at each global step, measured with sgd and a
    gradient of ones: lr_t = w_before - w_after."""
    put_var(p.url, "x", np.zeros(1, F32))
    configure(p, dict(cfg, optimizer="sgd"))
    rates, w = [], np.zeros(1, F32)
    for _ in range(steps):
        grad(p, "x", np.ones(1, F32))
        nw = value(p, "x", (1,))
        rates.append(float(w[0] - nw[0]))
        w = nw
    return rates


@pytest.mark.parametrize("sched", [
    {"lr_schedule": "constant"},
    {"lr_schedule": "exponential", "decay_steps": 4, "decay_rate": 0.5},
    {"lr_schedule": "exponential", "decay_steps": 4, "decay_rate": 0.5, "staircase": True},
    {"lr_schedule": "cosine", "decay_steps": 8},
    {"lr_schedule": "cosine", "decay_steps": 8, "alpha": 0.2},
], ids=["constant", "exponential", "staircase", "cosine", "cosine_alpha"])
def test_schedule_at_each_global_step(start_psd, sched):
    """The rate at global steps 0..11 is TensorFlow's decay of it at the step
    before the update (cosine stays at alpha * lr past decay_steps)."""
    cfg = dict(sched, learning_rate=0.5)
    rates = effective_rates(start_psd(), cfg, 12)
    want = [float(lr_at(cfg, s)) for s in range(12)]
    np.testing.assert_allclose(rates, want, rtol=1e-5, atol=1e-7)
    print(f"{sched}: rates at steps 0..11: " + " ".join(f"{x:.5f}" for x in rates))
    if sched.get("staircase"):
        assert rates[0] == rates[3] != rates[4] == rates[7]
    if sched["lr_schedule"] == "cosine":
        assert rates[8] == rates[11] == pytest.approx(0.5 * sched.get("alpha", 0), abs=1e-7)


def test_clip_norm_applies_to_each_variable_alone(start_psd):
    """One variable's gradient far above the norm is scaled to it exactly; the
    other, below it, is untouched (not a global norm)."""
    p = start_psd()
    put_var(p.url, "big", np.zeros(4, F32))
    put_var(p.url, "small", np.zeros(2, F32))
    configure(p, {"optimizer": "sgd", "learning_rate": 1.0, "clip_norm": 1.0})
    grad(p, "big", np.array([30, 40, 0, 0], F32))   # norm 50 -> 1
    grad(p, "small", np.array([0.3, 0.4], F32))     # norm 0.5: unchanged
    np.testing.assert_allclose(value(p, "big", (4,)), [-0.6, -0.8, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(value(p, "small", (2,)), [-0.3, -0.4], rtol=1e-6)


def test_weight_decay_is_decoupled_and_scheduled(start_psd):
    """A zero gradient still shrinks w by lr_t * weight_decay * w; with adam
    (whose step is then zero) that is all that changes."""
    p = start_psd()
    put_var(p.url, "w", np.array([1.0, -2.0, 4.0], F32))
    cfg = {"optimizer": "adam", "learning_rate": 0.1, "weight_decay": 0.5,
           "lr_schedule": "exponential", "decay_steps": 1, "decay_rate": 0.5}
    configure(p, cfg)
    w = np.array([1.0, -2.0, 4.0], F32)
    for s in range(3):
        grad(p, "w", np.zeros(3, F32))
        w = w - lr_at(cfg, s) * F32(0.5) * w
        np.testing.assert_allclose(value(p, "w", (3,)), w, rtol=1e-6)
    # 0.1*0.5, then 0.05*0.5, then 0.025*0.5 off: 1 * 0.95 * 0.975 * 0.9875
    assert value(p, "w", (3,))[0] == pytest.approx(0.95 * 0.975 * 0.9875, rel=1e-6)


def push_bulk(p, tensors, worker, step):
    body = st_grads(list(tensors.items()), meta={"worker": str(worker), "step": str(step)})
    st, _, out = http("POST", p.url + "/v1/grads", body)
    assert st == 200, out
    return json.loads(out)


def test_sync_clips_the_averaged_gradient(start_psd):
    """Sync, two workers: the two gradients are averaged, then clipped, then
    adagrad's step; the schedule reads the step before the update."""
    p = start_psd()
    put_var(p.url, "w", W0)
    cfg = {"optimizer": "adagrad", "learning_rate": 0.3, "clip_norm": 0.7, "sync": True,
           "workers": 2, "lr_schedule": "cosine", "decay_steps": 3}
    configure(p, cfg)
    ref = Ref(W0, cfg)
    for s in range(4):
        g0, _ = grads(2 * s)
        g1, _ = grads(2 * s + 1)
        assert push_bulk(p, {"w": g0}, 0, s)["outcome"] == "pending"
        assert push_bulk(p, {"w": g1}, 1, s)["outcome"] == "applied"
        ref.step((g0 + g1) / F32(2), s)
        np.testing.assert_allclose(value(p, "w", W0.shape), ref.w, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------- configuration

def test_config_echo_names_what_is_in_force(start_psd):
    p = start_psd()
    put_var(p.url, "w", W0)
    got = configure(p, {"optimizer": "rmsprop"})
    assert got == {"optimizer": "rmsprop", "learning_rate": pytest.approx(0.01), "sync": False,
                   "replicas_to_aggregate": 1, "workers": 1, "momentum": 0.0,
                   "epsilon": pytest.approx(1e-10), "rmsprop_decay": pytest.approx(0.9)}
    got = configure(p, {"optimizer": "adagrad", "learning_rate": 0.5})
    assert got["initial_accumulator_value"] == pytest.approx(0.1) and "momentum" not in got
    cfg = {"optimizer": "momentum", "learning_rate": 0.5, "momentum": 0.5, "nesterov": True,
           "clip_norm": 2.5, "weight_decay": 0.25, "lr_schedule": "exponential",
           "decay_steps": 100, "decay_rate": 0.5, "staircase": True, "sync": False,
           "workers": 1, "replicas_to_aggregate": 1}
    assert configure(p, cfg) == cfg
    assert get_config(p) == cfg
    cfg = {"optimizer": "sgd", "learning_rate": 0.5, "lr_schedule": "cosine", "decay_steps": 10,
           "alpha": 0.25, "sync": False, "workers": 1, "replicas_to_aggregate": 1}
    assert configure(p, cfg) == cfg
    # settings the optimizer or schedule does not use are not kept (nor echoed)
    got = configure(p, {"optimizer": "adam", "momentum": 0.5, "rmsprop_decay": 0.5,
                        "decay_rate": 0.5, "staircase": True, "clip_norm": 0, "alpha": 0.5})
    assert set(got) == {"optimizer", "learning_rate", "sync", "replicas_to_aggregate", "workers",
                        "beta1", "beta2", "epsilon"}


BAD = [
    ({"optimizer": "adadelta"}, "adagrad"),
    ({"optimizer": "rmsprop", "rmsprop_decay": 1.0}, "rmsprop_decay"),
    ({"optimizer": "rmsprop", "rmsprop_decay": -0.1}, "rmsprop_decay"),
    ({"optimizer": "rmsprop", "momentum": 1}, "momentum"),
    ({"optimizer": "rmsprop", "epsilon": 0}, "epsilon"),
    ({"optimizer": "adagrad", "initial_accumulator_value": 0}, "initial_accumulator_value"),
    ({"optimizer": "adagrad", "initial_accumulator_value": "0.1"}, "initial_accumulator_value"),
    ({"optimizer": "momentum", "nesterov": 1}, "nesterov"),
    ({"optimizer": "adagrad", "nesterov": True}, "nesterov"),
    ({"nesterov": True}, "nesterov"),
    ({"clip_norm": -1}, "clip_norm"),
    ({"clip_norm": 1e39}, "clip_norm"),
    ({"clip_norm": "1"}, "clip_norm"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"weight_decay": None}, "weight_decay"),
    ({"lr_schedule": "linear"}, "lr_schedule"),
    ({"lr_schedule": 1}, "lr_schedule"),
    ({"lr_schedule": "exponential", "decay_steps": 10}, "decay_rate"),
    ({"lr_schedule": "exponential", "decay_rate": 0.5}, "decay_steps"),
    ({"lr_schedule": "cosine"}, "decay_steps"),
    ({"lr_schedule": "cosine", "decay_steps": 0}, "decay_steps"),
    ({"lr_schedule": "cosine", "decay_steps": 2.5}, "decay_steps"),
    ({"lr_schedule": "cosine", "decay_steps": 2 ** 31}, "decay_steps"),
    ({"lr_schedule": "exponential", "decay_steps": 10, "decay_rate": 0}, "decay_rate"),
    ({"lr_schedule": "exponential", "decay_steps": 10, "decay_rate": 0.5, "staircase": "yes"},
     "staircase"),
    ({"lr_schedule": "cosine", "decay_steps": 10, "alpha": 1.5}, "alpha"),
    ({"lr_schedule": "cosine", "decay_steps": 10, "alpha": -0.5}, "alpha"),
    ({"max_staleness": -2}, "max_staleness"),
    ({"staleness": "3"}, "staleness"),
    ({"decay": 0.9}, "decay"),
]


@pytest.mark.parametrize("cfg,word", BAD, ids=[json.dumps(c) for c, _ in BAD])
def test_bad_configuration_is_400_and_changes_nothing(start_psd, cfg, word):
    p = start_psd()
    put_var(p.url, "w", W0)
    configure(p, {"optimizer": "adam"})
    before = get_config(p)
    st, hd, body = http("PUT", p.url + "/v1/config", json.dumps(cfg).encode())
    assert_error(st, hd, body, 400, word)
    assert get_config(p) == before


def test_staleness_keys_are_plumbed(start_psd):
    p = start_psd()
    put_var(p.url, "w", W0)
    got = configure(p, {"max_staleness": 3, "staleness": 0})
    assert got["max_staleness"] == 3 and got["staleness"] == 0
    got = configure(p, {"max_staleness": -1, "staleness": None})
    assert "max_staleness" not in got and "staleness" not in got


# --------------------------------------------------------------- checkpoints

RESTORE = {
    "adagrad": ({"optimizer": "adagrad", "learning_rate": 0.2, "clip_norm": 1.0,
                 "lr_schedule": "exponential", "decay_steps": 2, "decay_rate": 0.8,
                 "staircase": True, "max_staleness": 5}, ["adagrad"]),
    "rmsprop": ({"optimizer": "rmsprop", "learning_rate": 0.01, "momentum": 0.9,
                 "rmsprop_decay": 0.85, "epsilon": 1e-7, "weight_decay": 0.1,
                 "lr_schedule": "cosine", "decay_steps": 20, "alpha": 0.05, "staleness": 2},
                ["rmsprop_ms", "rmsprop_mom"]),
    "nesterov": ({"optimizer": "momentum", "learning_rate": 0.05, "momentum": 0.8,
                  "nesterov": True, "clip_norm": 2.0, "weight_decay": 0.01}, ["momentum"]),
}


@pytest.mark.parametrize("name", list(RESTORE))
def test_checkpoint_round_trip_keeps_slots_and_configuration(start_psd, tmp_path, name):
    cfg, slots = RESTORE[name]
    logdir = str(tmp_path / "logs")
    p = start_psd(f"--logdir={logdir}")
    r = Run(p, cfg)
    r.run(3)
    echoed = get_config(p)
    st, _, body = http("POST", p.url + "/v1/checkpoint")
    assert st == 200, body
    saved = json.loads(body)
    assert saved["global_step"] == 6
    meta, t = ckpt_check.read(os.path.join(logdir, "ps-0", saved["file"]))
    want = {"w", "b"} | {f"{v}:{s}" for v in ("w", "b") for s in slots}
    assert set(t) == want
    for s in slots:  # the slots are TensorFlow's, as numpy has them
        np.testing.assert_allclose(t[f"w:{s}"].reshape(3, 4), r.ref["w"].slots[s], rtol=RTOL,
                                   atol=ATOL)
    config = json.loads(meta["config"])
    for k, v in cfg.items():
        assert config[k] == pytest.approx(v), k
    assert p.stop() == 0
    q = start_psd(f"--logdir={logdir}")
    assert get_config(q) == echoed
    # the chief of the restarted job sends the same configuration: the same
    # store_config bit for bit (another one is refused once training started)
    configure(q, cfg)
    configure(q, dict(cfg, learning_rate=0.5), want=409)
    # one more step matches numpy: the slots, the step count and the schedule came back
    r.p = q
    gw, gb = grads(5)
    r.push("w", gw)
    r.push("b", gb)


# ------------------------------------------------------------------ workerd

DATA = "/usr/share/datasets/fashion-mnist"
needs_data = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")


def workerd(*args, timeout=120):
    return subprocess.run([binary("workerd")] + list(args), capture_output=True, text=True,
                          timeout=timeout)


def test_workerd_help_lists_the_optimizer_flags():
    out = workerd("--help").stdout
    for flag in ("--nesterov", "--clip_norm", "--weight_decay", "--lr_schedule", "--decay_steps",
                 "--decay_rate", "--staircase", "--alpha", "--rmsprop_decay",
                 "--initial_accumulator_value", "--max_staleness", "--staleness"):
        assert "\n  " + flag in out, flag
    assert "sgd, momentum, adam, adagrad or rmsprop" in out


@pytest.mark.parametrize("args,words", [
    (["--optimizer=adadelta"], "--optimizer"),
    (["--optimizer=adam", "--nesterov"], "--nesterov"),
    (["--optimizer=rmsprop", "--rmsprop_decay=1"], "--rmsprop_decay"),
    (["--optimizer=adagrad", "--initial_accumulator_value=0"], "--initial_accumulator_value"),
    (["--clip_norm=-1"], "--clip_norm"),
    (["--weight_decay=-0.5"], "--weight_decay"),
    (["--lr_schedule=linear"], "--lr_schedule"),
    (["--lr_schedule=exponential", "--decay_steps=10"], "--decay_rate"),
    (["--lr_schedule=cosine"], "--decay_steps"),
    (["--lr_schedule=cosine", "--decay_steps=10", "--alpha=1.5"], "--alpha"),
    (["--max_staleness=-2"], "--max_staleness"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_workerd_bad_optimizer_flags_exit_2_with_one_line(args, words):
    r = workerd("--local", *args)
    assert r.returncode == 2, r
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


@needs_data
def test_chief_sends_every_option(start_psd):
    """The chief's PUT /v1/config carries the flags; psd echoes them."""
    p = start_psd()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    wport = s.getsockname()[1]
    s.close()
    r = workerd("--job_name=worker", "--task_index=0", f"--ps_hosts=127.0.0.1:{p.port}",
                f"--worker_hosts=127.0.0.1:{wport}", f"--data_dir={DATA}", "--hidden_units=10",
                "--train_steps=20", "--log_every=0", "--keep_ps", "--optimizer=rmsprop",
                "--learning_rate=0.002", "--rmsprop_decay=0.8", "--clip_norm=5",
                "--weight_decay=0.01", "--lr_schedule=exponential", "--decay_steps=10",
                "--decay_rate=0.5", "--staircase", "--max_staleness=4", "--staleness=2",
                timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = get_config(p)
    assert got == {"optimizer": "rmsprop", "learning_rate": pytest.approx(0.002), "sync": False,
                   "replicas_to_aggregate": 1, "workers": 1, "momentum": 0.0,
                   "epsilon": pytest.approx(1e-10), "rmsprop_decay": pytest.approx(0.8),
                   "clip_norm": 5.0, "weight_decay": pytest.approx(0.01),
                   "lr_schedule": "exponential", "decay_steps": 10, "decay_rate": 0.5,
                   "staircase": True, "max_staleness": 4, "staleness": 2}


@needs_data
@pytest.mark.parametrize("args", [
    ["--optimizer=adagrad", "--learning_rate=0.1"],
    ["--optimizer=rmsprop", "--learning_rate=0.001", "--clip_norm=5", "--weight_decay=0.01",
     "--lr_schedule=cosine", "--decay_steps=300"],
    ["--optimizer=momentum", "--nesterov", "--learning_rate=0.05", "--lr_schedule=exponential",
     "--decay_steps=100", "--decay_rate=0.5", "--staircase"],
], ids=["adagrad", "rmsprop_clip_wd_cosine", "nesterov_staircase"])
def test_local_training_learns(args):
    """--local applies the same rules (per variable): 300 steps learn."""
    r = workerd("--local", f"--data_dir={DATA}", "--train_steps=300", "--log_every=0", *args)
    assert r.returncode == 0, r.stderr
    acc = float(r.stdout.rsplit("test accuracy", 1)[1].split()[0])
    print(f"{args}: test accuracy {acc:.4f} after 300 steps")
    assert acc > 0.7
