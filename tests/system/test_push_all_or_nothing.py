"""POST /v1/grads is all or nothing, also now that an async sgd push is
checked and applied in one pass over its own body (server/store.c
apply_in_body): a NaN or Inf in the last bytes of a large push is refused
with 400 naming the tensor and the element, and the stored state (values,
versions, global_step, last_loss, the workers' records) is exactly what it
was; optimizer slots (momentum, adam) are unchanged too, which the next
accepted push shows against a numpy reference that never saw the refused
one. The accepted pushes are compared with numpy's float32 arithmetic."""
import json
import time

import numpy as np
import pytest

from conftest import http
from syshelp import (assert_error, assert_unchanged, connect, get_raw, healthy, put_var, request_head,
                     snapshot, st_grads)

F32 = np.float32
LR = 0.5
# past the store's split into two threads (2^21 floats) and many 4096-float chunks
BIG = (1 << 21) + 3
MID = 100003


def value(p, name):
    return np.frombuffer(get_raw(p.url, name), "<f4")


def push(p, tensors, meta=None):
    body = st_grads(list(tensors.items()), meta=meta)
    return http("POST", p.url + "/v1/grads", body)


def push_ok(p, tensors, meta=None):
    st, _, out = push(p, tensors, meta)
    assert st == 200, out
    return json.loads(out)


def refused(p, tensors, word, name, element, meta=None):
    before = snapshot(p.url)
    st, hd, out = push(p, tensors, meta)
    msg = assert_error(st, hd, out, 400, word, f"'{name}'")
    assert f"element {element}" in msg, msg
    assert_unchanged(p, before)


def ramp(n, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n).astype(F32)


@pytest.mark.parametrize("bad,word", [(np.nan, "NaN"), (np.inf, "Inf")])
def test_async_sgd_large_push_refused_for_its_last_element(start_psd, bad, word):
    p = start_psd(f"--learning_rate={LR}", "--logdir=")
    w, b = ramp(BIG, 1), ramp(5, 2)
    put_var(p.url, "w", w)
    put_var(p.url, "b", b)
    g1, gb = ramp(BIG, 3), ramp(5, 4)
    out = push_ok(p, {"b": gb, "w": g1}, {"worker": "0", "step": "0", "loss": "1.5"})
    assert out["global_step"] == 1 and out["outcome"] == "applied"
    w = w - F32(LR) * g1
    b = b - F32(LR) * gb
    assert np.array_equal(value(p, "w"), w) and np.array_equal(value(p, "b"), b)
    # the bad element last of all, after a finite tensor that comes first
    g = ramp(BIG, 5)
    g[-1] = bad
    refused(p, {"b": gb, "w": g}, word, "w", BIG - 1, {"worker": "0", "step": "1", "loss": "9"})
    # the last element of the first half (the other thread's half is finite)
    g = ramp(BIG, 6)
    g[BIG // 2 - 1] = bad
    refused(p, {"w": g}, word, "w", BIG // 2 - 1)
    # and the positive control: the same push without it is applied exactly
    g[BIG // 2 - 1] = 0.25
    assert push_ok(p, {"w": g})["global_step"] == 2
    assert np.array_equal(value(p, "w"), w - F32(LR) * g)
    assert np.array_equal(value(p, "b"), b)


def test_variables_pushed_together_then_apart_keep_their_values(start_psd):
    """Each push's next values live in its body: a variable pushed alone later
    must not disturb the one that still shares the older body."""
    p = start_psd(f"--learning_rate={LR}", "--logdir=")
    a, c = ramp(MID, 7), ramp(1000, 8)
    put_var(p.url, "a", a)
    put_var(p.url, "c", c)
    for k, names in enumerate([("a", "c"), ("a",), ("a",), ("c",), ("c", "a")]):
        g = {n: ramp(MID if n == "a" else 1000, 20 + 2 * k + i) for i, n in enumerate(names)}
        push_ok(p, g)
        if "a" in g:
            a = a - F32(LR) * g["a"]
        if "c" in g:
            c = c - F32(LR) * g["c"]
        assert np.array_equal(value(p, "a"), a), names
        assert np.array_equal(value(p, "c"), c), names


def momentum_ref(w, slot, g, lr, m):
    slot = F32(m) * slot + g
    return w - F32(lr) * slot, slot


def adam_ref(w, mv, g, lr, t, b1=0.9, b2=0.999, eps=1e-8):
    m, v = mv
    m = F32(b1) * m + F32(1 - b1) * g
    v = F32(b2) * v + F32(1 - b2) * g * g
    lr_t = F32(lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t))
    return w - lr_t * m / (np.sqrt(v) + F32(eps)), (m, v)


@pytest.mark.parametrize("opt", ["momentum", "adam"])
def test_refused_push_leaves_the_optimizer_slots(start_psd, opt):
    p = start_psd("--logdir=")
    w0 = ramp(MID, 9)
    put_var(p.url, "w", w0)
    st, _, out = http("PUT", p.url + "/v1/config",
                      json.dumps({"optimizer": opt, "learning_rate": 0.1}).encode())
    assert st == 200, out
    w, slots = w0, (np.zeros(MID, F32) if opt == "momentum" else (np.zeros(MID, F32),) * 2)
    for t in (1, 2):
        g = ramp(MID, 30 + t)
        push_ok(p, {"w": g})
        if opt == "momentum":
            w, slots = momentum_ref(w, slots, g, 0.1, 0.9)
        else:
            w, slots = adam_ref(w, slots, g, 0.1, t)
        np.testing.assert_allclose(value(p, "w"), w, rtol=1e-5, atol=1e-6)
        if t == 1:
            bad = ramp(MID, 40)
            bad[-1] = np.nan
            refused(p, {"w": bad}, "NaN", "w", MID - 1)


def test_sync_refused_push_keeps_the_step_and_the_other_gradient(start_psd):
    p = start_psd(f"--learning_rate={LR}", "--logdir=")
    w = ramp(MID, 11)
    put_var(p.url, "w", w)
    st, _, out = http("PUT", p.url + "/v1/config",
                      json.dumps({"sync": True, "workers": 2, "learning_rate": LR}).encode())
    assert st == 200, out
    g0, g1 = ramp(MID, 12), ramp(MID, 13)
    assert push_ok(p, {"w": g0}, {"worker": "0", "step": "0"})["outcome"] == "pending"
    bad = g1.copy()
    bad[-1] = -np.inf
    refused(p, {"w": bad}, "Inf", "w", MID - 1, {"worker": "1", "step": "0"})
    out = push_ok(p, {"w": g1}, {"worker": "1", "step": "0"})
    assert out["outcome"] == "applied" and out["global_step"] == 1
    mean = (g0 + g1) * F32(0.5)
    np.testing.assert_allclose(value(p, "w"), w - F32(LR) * mean, rtol=1e-6, atol=1e-7)


def vm_size_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmSize in /proc/%d/status" % pid)


def unread_bytes(port, client_port):
    """Bytes psd's end of our connection has not read yet (rx_queue of /proc/net/tcp)."""
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, remote = fields[1], fields[2]
                if int(local.rsplit(":", 1)[1], 16) == port and int(remote.rsplit(":", 1)[1], 16) == client_port:
                    return int(fields[4].split(":")[1], 16)
    return None


def test_a_stalled_upload_reserves_a_bounded_multiple_of_what_it_sent(start_psd):
    """A client that announces a body of --max_body_bytes (1 GiB), sends 2 MiB
    and stalls: the body buffer grows with what came (at most 128x), not to the
    announced length at once (common/http_server.c UPLOAD_AHEAD). Read from
    the kernel: psd's address space (VmSize) once psd has read every byte sent."""
    p = start_psd("--logdir=", f"--max_body_bytes={1 << 30}")
    sent = 2 << 20
    before = vm_size_mib(p.proc.pid)
    socks = []
    try:
        for _ in range(4):
            s = connect(p.port)
            s.sendall(request_head("POST", "/v1/grads", ["Content-Type: application/octet-stream"],
                                   content_length=1 << 30))
            s.sendall(b"\0" * sent)
            socks.append(s)
        deadline = time.monotonic() + 20
        for s in socks:
            while unread_bytes(p.port, s.getsockname()[1]) != 0:
                assert time.monotonic() < deadline, "psd did not read the bodies sent"
                time.sleep(0.02)
        time.sleep(0.2)  # the last chunk read is handed to the upload callback
        grown = vm_size_mib(p.proc.pid) - before
        # 4 x 1 GiB before; now 4 x (8x of 2 MiB rounded up to 2 MiB pages) plus slack
        assert grown < 4 * 128 * (sent >> 20) / 2, f"psd reserved {grown:.0f} MiB for 4 x 2 MiB sent"
        assert healthy(p.url)
    finally:
        for s in socks:
            s.close()
    assert healthy(p.url)
