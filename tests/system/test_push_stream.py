"""A push applied as its body arrives (server/push_stream.c, issue 33 part 4):
async sgd pushes go through the optimizer piece by piece, straight from
libmicrohttpd's buffers into unpublished next versions, and are published
only once the whole body came and every value was finite. These tests send
the body over a raw socket in pieces (TCP_NODELAY, a pause between them) so
that the pieces psd reads end where the test chooses: inside an element at
every offset, the last piece holding a NaN, a body cut mid-tensor, another
push or a PUT of the same variable landing between two pieces. Values are
compared with numpy's float32 arithmetic (w - lr * g, then the next push on
top), and restps_pushes_streamed_total shows the streamed path was taken."""
import json
import struct
import time

import numpy as np
import pytest

from conftest import http
from syshelp import (assert_unchanged, connect, get_raw, put_var, read_response, request_head, snapshot,
                     st_body, st_grads)

F32 = np.float32
LR = 0.25


def counter(p, name):
    st, _, body = http("GET", p.url + "/metrics")
    assert st == 200
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def value(p, name):
    return np.frombuffer(get_raw(p.url, name), "<f4")


def ramp(n, seed):
    return np.random.default_rng(seed).standard_normal(n).astype(F32)


def send_in_pieces(p, body, cuts, headers=(), pause=0.02, close_at=None):
    """POST /v1/grads with body sent as body[0:c1], body[c1:c2], ...; each
    piece on its own (a pause between). close_at: stop after that many bytes
    and close (a body cut short). The response (status, headers, body)."""
    s = connect(p.port)
    try:
        s.sendall(request_head("POST", "/v1/grads", headers, content_length=len(body)))
        at = 0
        for c in list(cuts) + [len(body)]:
            if close_at is not None and c > close_at:
                c = close_at
            if c > at:
                time.sleep(pause)
                s.sendall(body[at:c])
                at = c
            if close_at is not None and at >= close_at:
                return None
        return read_response(s)
    finally:
        s.close()


def f16_body(name, arr, dtype, meta):
    """One 16-bit tensor (dtype BF16 or F16) as a safetensors body."""
    a = np.ascontiguousarray(arr, dtype="<f4")
    if dtype == "F16":
        raw = a.astype("<f2").tobytes()
    else:  # round to nearest even, as wire_f32_to_bf16
        u = a.view("<u4").astype(np.uint64)
        raw = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")).tobytes()
    header = {"__metadata__": meta, name: {"dtype": dtype, "shape": [a.size], "data_offsets": [0, len(raw)]}}
    return st_body(header, raw)


def widened(raw16, dtype, scale):
    if dtype == "F16":
        return (np.frombuffer(raw16, "<f2").astype(F32) * F32(1.0 / scale)).astype(F32)
    return (np.frombuffer(raw16, "<u2").astype("<u4") << 16).view("<f4") * F32(1.0 / scale)


def data_start(body):
    return 8 + struct.unpack("<Q", body[:8])[0]


def test_pieces_split_inside_elements_at_every_offset(start_psd):
    """Pieces ending 1, 2 and 3 bytes into a float32 (and 1 into a 16-bit
    value), across a tensor boundary too: the next values are numpy's."""
    p = start_psd(f"--learning_rate={LR}", "--logdir=")
    n = 600000  # 2.4 MB in float32, 1.2 MB in 16 bits: streamed (PUSH_STREAM_MIN_BYTES)
    w, b = ramp(n, 1), ramp(7, 2)
    put_var(p.url, "w", w)
    put_var(p.url, "b", b)
    streamed = counter(p, "restps_pushes_streamed_total")
    for rnd in range(3):
        gb, gw = ramp(7, 10 + rnd), ramp(n, 20 + rnd)
        body = st_grads([("b", gb), ("w", gw)], meta={"worker": "0"})
        d0 = data_start(body)
        # inside the header, inside b's 3rd float, across b -> w, then w at +1, +2, +3 of an element
        cuts = [5, d0 + 9, d0 + 26, d0 + 28 + 4001, d0 + 28 + 8002, d0 + 28 + 12003]
        st, _, out = send_in_pieces(p, body, cuts)
        assert st == 200, out
        w = w - F32(LR) * gw
        b = b - F32(LR) * gb
        assert np.array_equal(value(p, "w"), w) and np.array_equal(value(p, "b"), b)
    assert counter(p, "restps_pushes_streamed_total") == streamed + 3
    for dtype, scale in (("BF16", 1), ("F16", 256)):
        g = ramp(n, 40) * F32(0.01 * scale)
        body = f16_body("w", g, dtype, {"worker": "0", "loss_scale": str(scale)} if scale > 1 else {"worker": "0"})
        d0 = data_start(body)
        st, _, out = send_in_pieces(p, body, [d0 + 1, d0 + 3001, d0 + 6000, d0 + 9999])
        assert st == 200, out
        w = w - F32(LR) * widened(body[d0:], dtype, scale)
        assert np.array_equal(value(p, "w"), w), dtype
    assert counter(p, "restps_pushes_streamed_total") == streamed + 5


@pytest.mark.parametrize("bad,word", [(np.nan, "NaN"), (np.inf, "Inf")])
def test_nonfinite_in_the_last_piece_changes_nothing(start_psd, bad, word):
    p = start_psd(f"--learning_rate={LR}", "--logdir=")
    n = 600000  # 2.4 MB: many pieces of libmicrohttpd's buffer
    put_var(p.url, "w", ramp(n, 1))
    put_var(p.url, "b", ramp(3, 2))
    g = ramp(n, 3)
    g[-1] = bad
    body = st_grads([("b", ramp(3, 4)), ("w", g)], meta={"worker": "0", "step": "0", "loss": "2"})
    before = snapshot(p.url)
    st, hd, out = send_in_pieces(p, body, range(4096, len(body) - 2, 65536))
    assert st == 400, out
    msg = json.loads(out)["error"]
    assert word in msg and "'w'" in msg and f"element {n - 1}" in msg, msg
    assert_unchanged(p, before)
    # BF16 with an Inf in its last element: refused too
    body = f16_body("w", ramp(n, 5), "BF16", {"worker": "0"})
    body = body[:-2] + b"\x80\x7f"  # +Inf in bfloat16
    st, _, out = send_in_pieces(p, body, [len(body) - 1])
    assert st == 400 and "Inf" in json.loads(out)["error"] and "(as float32)" in json.loads(out)["error"], out
    assert_unchanged(p, before)
    # the positive control: the stream that follows is applied
    assert counter(p, "restps_pushes_streamed_total") == 0
    g[-1] = 0.5
    st, _, out = send_in_pieces(p, st_grads([("w", g)]), [100000])
    assert st == 200, out
    assert np.array_equal(value(p, "w"), ramp(n, 1) - F32(LR) * g)
    assert counter(p, "restps_pushes_streamed_total") == 1


def test_body_cut_mid_tensor_changes_nothing(start_psd):
    # a short idle timeout: libmicrohttpd 0.9.75 at times misses the end of
    # a connection cut mid-body until it times out (the buffered path too)
    p = start_psd(f"--learning_rate={LR}", "--logdir=", "--connection_timeout=2")
    n = 300000
    w = ramp(n, 1)
    put_var(p.url, "w", w)
    body = st_grads([("w", ramp(n, 2))], meta={"worker": "0"})
    before = snapshot(p.url)
    for cut in (data_start(body) + 2, len(body) // 2 + 1, len(body) - 1):
        assert send_in_pieces(p, body, [100, cut - 1], close_at=cut) is None
        time.sleep(0.05)
        assert_unchanged(p, before)
    assert counter(p, "restps_pushes_streamed_total") == 0
    # once the cut connections are gone, the store streams again
    deadline = time.monotonic() + 10
    while True:
        g = ramp(n, 3)
        st, _, out = send_in_pieces(p, st_grads([("w", g)]), [5000])
        assert st == 200, out
        w = w - F32(LR) * g
        assert np.array_equal(value(p, "w"), w)
        if counter(p, "restps_pushes_streamed_total") == 1:
            break
        assert time.monotonic() < deadline, "a cut stream still holds the store"
        time.sleep(0.5)


def start_stream(p, body, first, headers=()):
    s = connect(p.port)
    s.sendall(request_head("POST", "/v1/grads", headers, content_length=len(body)))
    s.sendall(body[:first])
    time.sleep(0.1)
    return s


def test_pushes_meanwhile_are_applied_again_on_top(start_psd):
    """B pushes w while A streams (POST /v1/grads), then D (POST
    /v1/vars/w/grad), and C pushes another variable: each is applied at once
    (a pull sees it), and A's commit gives A's update first, then B's and D's
    on top, with the floats of numpy's w - lr * g one after the other."""
    p = start_psd(f"--learning_rate={LR}", "--logdir=")
    n = 300000
    w0, b0 = ramp(n, 1), ramp(4, 2)
    put_var(p.url, "w", w0)
    put_var(p.url, "b", b0)
    ga, gb, gc, gd = ramp(n, 3), ramp(n, 4), ramp(4, 5), ramp(n, 6)
    body = st_grads([("w", ga)], meta={"worker": "0"})
    s = start_stream(p, body, len(body) // 2)
    try:
        st, _, out = http("POST", p.url + "/v1/grads", st_grads([("w", gb)], meta={"worker": "1"}))
        assert st == 200 and json.loads(out)["global_step"] == 1, out
        assert np.array_equal(value(p, "w"), w0 - F32(LR) * gb)  # B is visible at once
        st, _, out = http("POST", p.url + "/v1/grads", st_grads([("b", gc)]))  # another variable: no replay
        assert st == 200, out
        st, _, out = http("POST", p.url + "/v1/vars/w/grad", gd.tobytes())
        assert st == 200, out
        assert np.array_equal(value(p, "w"), (w0 - F32(LR) * gb) - F32(LR) * gd)
        s.sendall(body[len(body) // 2:])
        st, _, out = read_response(s)
    finally:
        s.close()
    assert st == 200 and json.loads(out)["global_step"] == 4, out
    assert np.array_equal(value(p, "w"), ((w0 - F32(LR) * ga) - F32(LR) * gb) - F32(LR) * gd)
    assert np.array_equal(value(p, "b"), b0 - F32(LR) * gc)
    assert counter(p, "restps_push_replays_total") == 2
    assert counter(p, "restps_pushes_streamed_total") == 1


def test_a_put_meanwhile_refuses_the_stream(start_psd):
    p = start_psd(f"--learning_rate={LR}", "--logdir=")
    n = 300000
    put_var(p.url, "w", ramp(n, 1))
    body = st_grads([("w", ramp(n, 2))], meta={"worker": "0"})
    s = start_stream(p, body, 1000)
    try:
        w = ramp(n, 3)
        put_var(p.url, "w", w)
        before = snapshot(p.url)
        s.sendall(body[1000:])
        st, _, out = read_response(s)
    finally:
        s.close()
    assert st == 503 and "changed while it arrived" in json.loads(out)["error"], out
    assert_unchanged(p, before)
    assert np.array_equal(value(p, "w"), w)


def test_the_same_push_id_meanwhile_is_a_duplicate(start_psd):
    p = start_psd(f"--learning_rate={LR}", "--logdir=")
    n = 300000
    w = ramp(n, 1)
    put_var(p.url, "w", w)
    g = ramp(n, 2)
    body = st_grads([("w", g)], meta={"worker": "0"})
    s = start_stream(p, body, 500, headers=("X-Push-Id: w0-s0",))
    try:  # its retry, read whole (the store streams one push at a time), lands first
        st, _, out = http("POST", p.url + "/v1/grads", body, headers={"X-Push-Id": "w0-s0"})
        assert st == 200 and json.loads(out)["outcome"] == "applied", out
        s.sendall(body[500:])
        st, _, out = read_response(s)
    finally:
        s.close()
    assert st == 200 and json.loads(out)["outcome"] == "duplicate", out
    assert np.array_equal(value(p, "w"), w - F32(LR) * g)  # once


def test_weight_decay_and_a_schedule_give_optim_apply_floats(start_psd):
    """A streamed push with decoupled weight decay and an exponential
    schedule: numpy's (w - lr_t * wd * w) - lr_t * g at every global step,
    bit for bit; with clipping or momentum the push is read whole (not
    streamed) and applied as before."""
    p = start_psd("--logdir=")
    n = 300000
    w = ramp(n, 1)
    put_var(p.url, "w", w)
    cfg = {"optimizer": "sgd", "learning_rate": 0.2, "weight_decay": 0.25, "lr_schedule": "exponential",
           "decay_steps": 2, "decay_rate": 0.5}
    st, _, out = http("PUT", p.url + "/v1/config", json.dumps(cfg).encode())
    assert st == 200, out
    for step in range(3):
        g = ramp(n, 10 + step)
        st, _, out = send_in_pieces(p, st_grads([("w", g)]), [7777, 500001])
        assert st == 200, out
        lr = F32(float(F32(0.2)) * float(F32(0.5)) ** (step / 2))
        w = (w - lr * F32(0.25) * w) - lr * g
        assert np.array_equal(value(p, "w"), w), step
    assert counter(p, "restps_pushes_streamed_total") == 3
    for cfg in ({"optimizer": "sgd", "clip_norm": 1.0}, {"optimizer": "momentum"}):
        q = start_psd("--logdir=")
        put_var(q.url, "w", ramp(n, 1))
        st, _, out = http("PUT", q.url + "/v1/config", json.dumps(cfg).encode())
        assert st == 200, out
        st, _, out = send_in_pieces(q, st_grads([("w", ramp(n, 20))]), [7777])
        assert st == 200, out
        assert counter(q, "restps_pushes_streamed_total") == 0, cfg
