"""Auth (issue 23): with --auth_token_file, only a request that carries the
token may act for a worker. Without --auth_reads a tokenless
GET /v1/params?worker=N is a read: it no longer renews worker N's lease nor
moves its clocks (a reader polling every 0.3 s kept a dead worker alive and
held a sync step), while the same pull with the token still does. The
scheme is case-insensitive (RFC 9110 section 11.1: "bearer" works), spaces
after the token are whitespace around the field value (section 5.5) and are
ignored; one space follows the scheme, as before (test_auth.py refuses two);
any other difference is refused.

Each expectation is read from psd's own answers (/v1/sync's live and dead
workers, /v1/status's clocks), against what a worker that holds the token
gets."""
import json
import threading
import time

import numpy as np
import pytest

from conftest import http
from syshelp import connect, read_response, st_grads

TOKEN = "s3cret-token_0123"
AUTH = {"Authorization": "Bearer " + TOKEN}
LEASE = 2


@pytest.fixture
def token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    return str(f)


def sync_psd(start_psd, token_file, workers=2):
    p = start_psd(f"--auth_token_file={token_file}", f"--worker_lease_secs={LEASE}", "--logdir=")
    st, _, body = http("PUT", p.url + "/v1/vars/w", np.zeros(4, np.float32).tobytes(),
                       {"X-Shape": "4", **AUTH})
    assert st == 201, body
    cfg = {"optimizer": "sgd", "learning_rate": 0.5, "sync": True, "workers": workers,
           "replicas_to_aggregate": workers}
    st, _, body = http("PUT", p.url + "/v1/config", json.dumps(cfg).encode(), AUTH)
    assert st == 200, body
    return p


def sync_state(p):
    st, _, body = http("GET", p.url + "/v1/sync")
    assert st == 200, body
    return json.loads(body)


def clocks(p):
    st, _, body = http("GET", p.url + "/v1/status")
    assert st == 200, body
    return json.loads(body)["staleness"]["clocks"]


def heartbeat(p, worker):
    st, _, body = http("POST", p.url + "/v1/heartbeat", json.dumps({"worker": worker}).encode(), AUTH)
    assert st == 200, body


def push(p, worker, step, headers=AUTH):
    body = st_grads([("w", np.ones(4, np.float32))], {"worker": str(worker), "step": str(step)})
    return http("POST", p.url + "/v1/grads", body, headers)


def test_tokenless_pull_does_not_renew_a_lease(start_psd, token_file):
    p = sync_psd(start_psd, token_file)
    heartbeat(p, 1)
    assert 1 not in sync_state(p)["dead"]
    deadline = time.time() + LEASE + 1.5
    while time.time() < deadline:  # a reader polling as worker 1, without the token
        st, _, _ = http("GET", p.url + "/v1/params?worker=1&timeout_ms=0")
        assert st == 200
        time.sleep(0.3)
    s = sync_state(p)
    assert 1 in s["dead"] and s["live_workers"] == 0, s
    # the same pull with the token is the worker itself: it renews
    st, _, _ = http("GET", p.url + "/v1/params?worker=1&timeout_ms=0", headers=AUTH)
    assert st == 200
    s = sync_state(p)
    assert 1 not in s["dead"] and s["live_workers"] == 1, s


def test_tokenless_pull_does_not_move_a_clock(start_psd, token_file):
    p = sync_psd(start_psd, token_file)
    before = clocks(p)["1"]
    st, _, _ = http("GET", p.url + "/v1/params?worker=1&clock=7&timeout_ms=0")
    assert st == 200
    assert clocks(p)["1"] == before
    st, _, _ = http("GET", p.url + "/v1/params?worker=1&clock=7&timeout_ms=0",
                    headers={"Authorization": "Bearer wrong"})
    assert st == 200 and clocks(p)["1"] == before
    st, _, _ = http("GET", p.url + "/v1/params?worker=1&clock=7&timeout_ms=0", headers=AUTH)
    assert st == 200
    assert clocks(p)["1"] == {"started": 7, "done": 7}


def test_refused_push_does_not_renew_a_lease(start_psd, token_file):
    p = sync_psd(start_psd, token_file)
    heartbeat(p, 1)
    time.sleep(LEASE + 0.5)
    assert 1 in sync_state(p)["dead"]
    # without the token (401), with a wrong one, with a NaN (400 before the store)
    st, _, _ = push(p, 1, 0, headers={})
    assert st == 401
    st, _, _ = push(p, 1, 0, headers={"Authorization": "Bearer nope"})
    assert st == 401
    nan = st_grads([("w", np.full(4, np.nan, np.float32))], {"worker": "1", "step": "0"})
    st, _, _ = http("POST", p.url + "/v1/grads", nan, AUTH)
    assert st == 400
    assert 1 in sync_state(p)["dead"]


def test_a_polling_reader_does_not_hold_the_sync_step(start_psd, token_file):
    """Worker 1 dies; worker 0's push completes the step once worker 1's
    lease (2 s) runs out, even while an anonymous reader polls as worker 1."""
    p = sync_psd(start_psd, token_file)
    heartbeat(p, 0)
    heartbeat(p, 1)  # worker 1 is alive, then goes silent
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            http("GET", p.url + "/v1/params?worker=1&timeout_ms=0")
            stop.wait(0.3)

    t = threading.Thread(target=reader)
    t.start()
    try:
        t0 = time.time()
        st, _, body = push(p, 0, 0)
        assert st == 200 and json.loads(body)["outcome"] == "pending", body
        # worker 0 waits for the step as a worker does (its long poll renews its own lease)
        st, hd, _ = http("GET", p.url + "/v1/params?worker=0&min_step=1&timeout_ms=8000",
                         headers=AUTH, timeout=15)
        took = time.time() - t0
    finally:
        stop.set()
        t.join()
    assert st == 200 and hd["x-global-step"] == "1", (st, hd)
    assert took < LEASE + 2.5, f"the step took {took:.1f} s with a reader polling as worker 1"


@pytest.mark.parametrize("value", ["bearer " + TOKEN, "BEARER " + TOKEN, "bEaReR " + TOKEN,
                                   "Bearer " + TOKEN + "  ", "Bearer " + TOKEN + "\t"])
def test_bearer_scheme_any_case_and_surrounding_spaces_work(start_psd, token_file, value):
    p = start_psd(f"--auth_token_file={token_file}", "--logdir=")
    # a raw request, so the header goes out exactly as written
    s = connect(p.port)
    s.sendall(b"PUT /v1/vars/w HTTP/1.1\r\nHost: x\r\nX-Shape: 1\r\nContent-Length: 4\r\n"
              b"Authorization: " + value.encode() + b"\r\n\r\n\x00\x00\x80?")
    st, _, body = read_response(s)
    s.close()
    assert st == 201, body


@pytest.mark.parametrize("value", ["Bearer" + TOKEN, "Bearer " + TOKEN + "x", "Bearer x" + TOKEN,
                                   "Bearer " + TOKEN[:-1], "Basic " + TOKEN, "Bearer\t" + TOKEN,
                                   TOKEN, "Bearer " + TOKEN.upper(), "Bearer  " + TOKEN,
                                   "Bearer " + TOKEN + " x"])
def test_other_authorization_values_are_refused(start_psd, token_file, value):
    p = start_psd(f"--auth_token_file={token_file}", "--logdir=")
    s = connect(p.port)
    s.sendall(b"PUT /v1/vars/w HTTP/1.1\r\nHost: x\r\nX-Shape: 1\r\nContent-Length: 4\r\n"
              b"Authorization: " + value.encode() + b"\r\n\r\n\x00\x00\x80?")
    st, hd, _ = read_response(s)
    s.close()
    assert st == 401 and hd.get("www-authenticate") == "Bearer"
    st, _, _ = http("GET", p.url + "/v1/vars/w")
    assert st == 404
