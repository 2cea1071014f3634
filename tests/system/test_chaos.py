"""Allocation failures on the request path, in the style of jansson's
test_chaos.c: for a push, a pull, a variable create, a one-variable gradient,
a heartbeat (a JSON body) and a status request, make the Nth allocation fail for every N from 1 until
the request makes fewer than N allocations. Every allocation of the process
counts while the request is in flight (psd's, libmicrohttpd's, jansson's,
glibc's), through an LD_PRELOAD shim (failmalloc.c, built here).

For every N: psd answers 2xx (the request worked despite the failure), 5xx
(a JSON error), or closes the connection without an answer (when the
failure hit the building of the answer itself); it never crashes, never
blames the client (4xx), and the store is not corrupted: the value read back
afterwards is exactly the old one or exactly the new one (the new one after
a 2xx), and the global step moved with it."""
import json
import mmap
import os
import socket
import struct
import subprocess
import time

import numpy as np
import pytest

from conftest import BIN, HELPERS, http
from syshelp import connect, get_raw, put_var, request_head, st_grads

ASAN = "asan" in BIN
pytestmark = pytest.mark.skipif(ASAN, reason="AddressSanitizer owns malloc: the LD_PRELOAD "
                                             "failure shim runs on the optimized build")
LR = 0.5
W = (np.arange(12, dtype=np.float32) * 0.25 - 1.0).reshape(3, 4)
MAX_N = 3000  # far above what one request allocates (a few dozen to a few hundred)


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    d = tmp_path_factory.mktemp("failmalloc")
    so = str(d / "failmalloc.so")
    out = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o", so,
                          os.path.join(HELPERS, "failmalloc.c")], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return so


class Ctl:
    """The shared control block (see failmalloc.c)."""

    def __init__(self, path):
        with open(path, "wb") as f:
            f.write(b"\0" * 32)
        self.f = open(path, "r+b")
        self.m = mmap.mmap(self.f.fileno(), 32)

    def arm(self, n):
        struct.pack_into("<iiqq", self.m, 0, 0, n, 0, 0)
        struct.pack_into("<i", self.m, 0, 1)

    def disarm(self):
        struct.pack_into("<i", self.m, 0, 0)
        _, _, count, failed = struct.unpack_from("<iiqq", self.m, 0)
        return count, failed


@pytest.fixture
def chaos_psd(start_psd, shim, tmp_path):
    ctl_path = str(tmp_path / "failmalloc.ctl")
    ctl = Ctl(ctl_path)
    p = start_psd(f"--learning_rate={LR}", "--logdir=",
                  env={"LD_PRELOAD": shim, "FAILMALLOC_CTL": ctl_path})
    put_var(p.url, "w", W)
    put_var(p.url, "b", np.ones(4, np.float32))
    # positive control: the shim is loaded and counts
    ctl.arm(10 ** 9)
    st, _, _ = http("GET", p.url + "/v1/status")
    count, failed = ctl.disarm()
    assert st == 200 and count > 0 and failed == 0, (st, count, failed)
    return p, ctl


def exchange(p, raw):
    """Send one request (Connection: close) and read to EOF: (status or None
    when psd closed without an answer, body)."""
    s = connect(p.port, timeout=10)
    try:
        s.sendall(raw)
    except (BrokenPipeError, ConnectionResetError):
        pass
    data = b""
    try:
        while True:
            c = s.recv(65536)
            if not c:
                break
            data += c
    except ConnectionResetError:
        pass
    finally:
        s.close()
    if b"\r\n\r\n" not in data:
        return None, data
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), body


def state(p):
    st, _, body = http("GET", p.url + "/v1/status")
    assert st == 200, body
    return json.loads(body)["global_step"], get_raw(p.url, "w")


def sweep(p, ctl, make, check):
    """For N = 1, 2, ...: arm, run make(N) -> raw request, disarm, check.
    Returns (largest N that failed an allocation, outcome counts)."""
    seen = {"2xx": 0, "5xx": 0, "closed": 0}
    for n in range(1, MAX_N):
        raw = make(n)
        before = state(p)
        ctl.arm(n)
        st, body = exchange(p, raw)
        time.sleep(0.002)  # what psd does after closing (the completion callback)
        count, failed = ctl.disarm()
        assert p.alive(), f"psd died with allocation {n} failing:\n" + p.read_stderr()[-3000:]
        if st is not None:
            assert 200 <= st < 300 or 500 <= st < 600, \
                f"allocation {n} failing gave {st}: {body[:300]!r}"
        seen["closed" if st is None else "2xx" if st < 300 else "5xx"] += 1
        check(n, before, st, body)
        if count < n:  # the request made fewer than n allocations: done
            assert failed == 0 and st is not None and 200 <= st < 300, (n, count, st, body[:300])
            return n - 1, seen
    raise AssertionError(f"a request still allocated more than {MAX_N} times")


def report(name, last, seen):
    print(f"chaos {name}: N = 1..{last} each failed once: {seen['2xx']} answered 2xx, "
          f"{seen['5xx']} 5xx, {seen['closed']} closed without an answer")
    assert last >= 5, "the request allocated almost nothing: is the shim working?"


CLOSE = ["Connection: close"]


def test_chaos_push(chaos_psd):
    p, ctl = chaos_psd
    g = np.full((3, 4), 0.5, np.float32)
    body = st_grads([("w", g)], meta={"loss": "1.25"})
    raw = request_head("POST", "/v1/grads", CLOSE, content_length=len(body)) + body

    def check(n, before, st, out):
        step, w = state(p)
        old = before[1]
        new = (np.frombuffer(old, np.float32) - np.float32(LR) * g.reshape(-1)).astype(np.float32).tobytes()
        assert (step, w) in ((before[0], old), (before[0] + 1, new)), f"N={n}: a torn update"
        if st is not None and st < 300:
            assert (step, w) == (before[0] + 1, new), f"N={n}: 2xx but not applied"

    last, seen = sweep(p, ctl, lambda n: raw, check)
    report("push (POST /v1/grads)", last, seen)


def test_chaos_one_variable_grad(chaos_psd):
    p, ctl = chaos_psd
    g = np.full(12, 0.25, np.float32)
    raw = request_head("POST", "/v1/vars/w/grad", CLOSE, content_length=48) + g.tobytes()

    def check(n, before, st, out):
        step, w = state(p)
        old = before[1]
        new = (np.frombuffer(old, np.float32) - np.float32(LR) * g).astype(np.float32).tobytes()
        assert (step, w) in ((before[0], old), (before[0] + 1, new)), f"N={n}: a torn update"
        if st is not None and st < 300:
            assert (step, w) == (before[0] + 1, new)

    last, seen = sweep(p, ctl, lambda n: raw, check)
    report("gradient (POST /v1/vars/w/grad)", last, seen)


def test_chaos_pull(chaos_psd):
    p, ctl = chaos_psd
    st, _, ref = http("GET", p.url + "/v1/params")
    assert st == 200
    raw = request_head("GET", "/v1/params", CLOSE)

    def check(n, before, st, out):
        if st is not None and st < 300:
            assert out == ref, f"N={n}: a 2xx pull with the wrong bytes"
        assert state(p) == before

    last, seen = sweep(p, ctl, lambda n: raw, check)
    report("pull (GET /v1/params)", last, seen)


def test_chaos_create(chaos_psd):
    p, ctl = chaos_psd
    v = np.arange(24, dtype=np.float32) * 0.5
    made = []

    def make(n):
        made.append(f"new{n}")
        return request_head("PUT", f"/v1/vars/new{n}", CLOSE + ["X-Shape: 4,6"],
                            content_length=v.nbytes) + v.tobytes()

    def check(n, before, st, out):
        s, _, body = http("GET", f"{p.url}/v1/vars/new{n}")
        assert s in (200, 404), (n, s, body)
        if s == 200:
            assert body == v.tobytes(), f"N={n}: created with the wrong bytes"
        if st is not None and st < 300:
            assert st == 201 and s == 200, (n, st, s)
        assert state(p) == before

    last, seen = sweep(p, ctl, make, check)
    report("create (PUT /v1/vars/{name})", last, seen)
    # the listing holds exactly the variables that read back
    st, _, body = http("GET", p.url + "/v1/vars")
    names = {x["name"] for x in json.loads(body)["vars"]}
    assert names <= {"w", "b"} | set(made) and {"w", "b", made[-1]} <= names


def test_chaos_heartbeat(chaos_psd):
    """A JSON body (jansson parses it): a failed allocation must not come
    back as 400 "not JSON"."""
    p, ctl = chaos_psd
    body = b'{"worker": 0}'
    raw = request_head("POST", "/v1/heartbeat", CLOSE + ["Content-Type: application/json"],
                       content_length=len(body)) + body

    def check(n, before, st, out):
        assert state(p) == before

    last, seen = sweep(p, ctl, lambda n: raw, check)
    report("heartbeat (POST /v1/heartbeat)", last, seen)


def keys_of(doc, at=""):
    """Every member path of a JSON document (arrays: their first element's)."""
    out = set()
    if isinstance(doc, dict):
        for k, v in doc.items():
            out |= {at + "/" + k} | keys_of(v, at + "/" + k)
    elif isinstance(doc, list) and doc:
        out |= keys_of(doc[0], at + "[]")
    return out


def test_chaos_status(chaos_psd):
    """A 2xx status holds every member a status holds without failures (a
    json_object_set that failed would leave one out)."""
    p, ctl = chaos_psd
    raw = request_head("GET", "/v1/status", CLOSE)
    st, _, ref = http("GET", p.url + "/v1/status")
    want = keys_of(json.loads(ref)) - {"/checkpoint"}

    def check(n, before, st, out):
        if st is not None and st < 300:
            try:
                doc = json.loads(out)
            except ValueError:
                raise AssertionError(f"N={n}: a 2xx status that is not JSON: {out!r}")
            assert doc["variables"] == 2 and doc["global_step"] == before[0], doc
            missing = want - keys_of(doc)
            assert not missing, f"N={n}: a 2xx status without {sorted(missing)}"
        elif st is not None:
            assert "error" in json.loads(out), out[:300]
        assert state(p) == before

    last, seen = sweep(p, ctl, lambda n: raw, check)
    report("status (GET /v1/status)", last, seen)
