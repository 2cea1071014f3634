#!/usr/bin/python3
"""A hostile campaign against one psd, beside the fuzzers (issue 23).

It throws a few hundred varied hostile requests at a psd started with a
bearer token (framing, headers, paths, query values, shapes, dtypes,
safetensors bodies, auth, floats, integers, byte mutations of valid
requests, slowloris-style partial sends, racing writes) and checks psd's
invariants after each:

- it still answers (/healthz within 2 s) and has not exited;
- a request it refused (4xx, or no answer) changed nothing: GET /v1/vars,
  every variable's bytes, /v1/config and the step are as before; a request
  built to be invalid is refused (never 2xx), and no client's junk gets a
  5xx;
- no sanitizer report in its stderr; its RSS stays within a bound;
- the races hold: exactly one 201 for If-None-Match: * creators, no torn
  read while a variable is reshaped.

Usage: campaign.py [--bin DIR] [--long] [--seed N]. --long: many more
mutations, rounds and partial sends (make hostile). Exit 0 when every
invariant held, 1 with the findings listed. Only the standard library and
numpy; Debian's /usr/bin/python3 runs it. tests/system/test_hostile_campaign.py
runs the short form in make test."""
import argparse
import json
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

TOKEN = "campaign-token-4242"
AUTH = "Bearer " + TOKEN
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")


# ------------------------------------------------------------------ the psd

class Psd:
    def __init__(self, bin_dir, workdir):
        tok = os.path.join(workdir, "token")
        with open(tok, "w") as f:
            f.write(TOKEN + "\n")
        self.err_path = os.path.join(workdir, "psd.err")
        self.err = open(self.err_path, "w")
        argv = [os.path.join(bin_dir, "psd"), "--port=0", "--logdir=", f"--auth_token_file={tok}",
                "--connection_timeout=3", "--max_body_bytes=16777216"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.err)
        line = self.proc.stdout.readline().decode()
        if not line.startswith("psd: listening on "):
            raise RuntimeError(f"psd did not start: {line!r}")
        self.url = line.split("listening on ", 1)[1].strip()
        self.port = int(self.url.rsplit(":", 1)[1])

    def rss_kib(self):
        return rss_kib(self.proc.pid)

    def stderr(self):
        with open(self.err_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


def rss_kib(pid):
    """A process's resident set in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                if ln.startswith("VmRSS:"):
                    return int(ln.split()[1])
    except OSError:
        pass
    return 0


def http(method, url, body=None, headers=None, timeout=10):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def raw(port, data, timeout=3.0, patience=0.3):
    """Send data on a fresh connection; the first response's status (None
    when psd closed or said nothing) and its head. A request psd waits on
    (a body shorter than announced) gets `patience` seconds, then the write
    side is shut, so psd sees the end at once."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
        except OSError:
            pass
        buf = b""
        t_end = time.time() + timeout
        s.settimeout(patience)
        shut = False
        while b"\r\n\r\n" not in buf and time.time() < t_end:
            try:
                c = s.recv(65536)
            except socket.timeout:
                if shut:
                    break
                try:
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                shut = True
                s.settimeout(max(0.1, t_end - time.time()))
                continue
            except OSError:
                break
            if not c:
                break
            buf += c
        if not buf.startswith(b"HTTP/1."):
            return None, buf[:200]
        try:
            return int(buf.split(b" ", 2)[1]), buf[:400]
        except ValueError:
            return None, buf[:200]
    finally:
        s.close()


def snapshot(p):
    st, _, body = http("GET", p.url + "/v1/vars")
    listing = json.loads(body)
    snap = {"list": listing, "vars": {}}
    for v in listing["vars"]:
        st, _, b = http("GET", f"{p.url}/v1/vars/{v['name']}")
        snap["vars"][v["name"]] = b
    st, _, body = http("GET", p.url + "/v1/config")
    snap["config"] = body if st == 200 else None
    return snap


# ------------------------------------------------------------- the requests

def head(method, path, headers, body=b"", cl=True):
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: x"]
    for h in headers:
        lines.append(h if isinstance(h, bytes) else h.encode())
    if cl and body is not None:
        lines.append(f"Content-Length: {len(body)}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def st_body(header, data=b"", header_len=None):
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(h) if header_len is None else header_len
    return struct.pack("<Q", n) + h + data


def grads(tensors, meta=None, dtype="F32"):
    header, data, off = {}, b"", 0
    for name, arr in tensors:
        b = np.ascontiguousarray(arr, "<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        data += b
        off += len(b)
    if meta is not None:
        header["__metadata__"] = meta
    return st_body(header, data)


W = np.arange(12, dtype=np.float32).reshape(3, 4)
ONE = struct.pack("<f", 1.0)


def invalid_cases(rng):
    """(category, name, raw request): each one must be refused (or left
    unanswered) and change nothing."""
    A = "Authorization: " + AUTH
    put = lambda hdrs, body=ONE, path="/v1/vars/w", cl=True: head("PUT", path, [A] + hdrs, body, cl)
    c = []
    # framing
    hidden = head("PUT", "/v1/vars/smug", [A, "X-Shape: 1"], ONE)
    for path, m in (("/v1/grads", "POST"), ("/v1/vars/w", "PUT"), ("/v1/vars/w", "GET")):
        body = b"0\r\n\r\n" + hidden
        c.append(("framing", f"CL+TE {m} {path}",
                  head(m, path, [A, "X-Shape: 3,4", "Transfer-Encoding: chunked"], body)))
    c.append(("framing", "two Content-Length", put(["X-Shape: 1", "Content-Length: 8"])))
    for v in ("-1", "1e3", "0x4", " 4x", "4 4", "99999999999999999999999", "+4"):
        c.append(("framing", f"Content-Length {v!r}", put(["X-Shape: 1", f"Content-Length: {v}"], cl=False)))
    c.append(("framing", "folded Content-Length",
              b"PUT /v1/vars/w HTTP/1.1\r\nHost: x\r\n" + A.encode() + b"\r\nX-Shape: 1\r\n"
              b"Content-Length:\r\n 4\r\n\r\n" + ONE))
    c.append(("framing", "TE gzip", put(["X-Shape: 1", "Transfer-Encoding: gzip"], cl=False)))
    c.append(("framing", "space before a header's colon", put(["X-Shape: 1", "X-Dtype : float32"])))
    c.append(("framing", "chunk size overflow",
              put(["X-Shape: 1", "Transfer-Encoding: chunked"], b"ffffffffffffffffff\r\n" + ONE, cl=False)))
    c.append(("framing", "chunked longer than the shape",
              put(["X-Shape: 1", "Transfer-Encoding: chunked"], b"8\r\n" + ONE * 2 + b"\r\n0\r\n\r\n", cl=False)))
    for where in (b"X-Shape: 1\x00,5", b"X-Dtype: float32\x00x", b"X-Junk: a\x01b", b"X-Junk: a\x7fb",
                  b"Authorization: " + AUTH.encode() + b"\x00junk", b"X-\x00: 1"):
        c.append(("framing", f"control byte {where[:12]!r}",
                  b"PUT /v1/vars/w HTTP/1.1\r\nHost: x\r\nX-Shape: 1\r\n" + where + b"\r\n" +
                  (b"" if b"Authorization" in where else A.encode() + b"\r\n") +
                  b"Content-Length: 4\r\n\r\n" + ONE))
    c.append(("framing", "NUL in the request line",
              b"PUT /v1/vars/w\x00x HTTP/1.1\r\nHost: x\r\n" + A.encode() + b"\r\nX-Shape: 1\r\nContent-Length: 4\r\n\r\n" + ONE))
    # headers
    c.append(("headers", "3000 headers", put(["X-Shape: 1"] + ["a: b"] * 3000)))
    c.append(("headers", "one 200 KB header", put(["X-Shape: 1", "X-Big: " + "a" * 200000])))
    c.append(("headers", "header without a colon", put(["X-Shape: 1", "NoColonHere"])))
    c.append(("headers", "space before the colon", put(["X-Shape : 1"])))
    c.append(("headers", "non-ASCII shape", put(["X-Shape: \xb3".encode("latin-1").decode("latin-1")])))
    # paths and methods
    for path in ("/v1/vars/../vars/w", "/v1/vars/%2e%2e", "/v1/vars/", "/v1/vars/w%00x",
                 "/v1/vars/" + "n" * 300, "/v1/vars/\xe9", "//v1/vars/w", 
                 "http://x/v1/vars/w", "*", "/v1/vars/w#frag",
                 "/v1/vars?" + "a&" * 3000):
        c.append(("paths", f"PUT {path[:40]}", head("PUT", path, [A, "X-Shape: 1"], ONE)))
    for m in ("PATCH", "DELETE", "OPTIONS", "TRACE", "put", "CONNECT", "PUT\t", "PROPFIND"):
        c.append(("paths", f"method {m!r}", head(m, "/v1/vars/w", [A, "X-Shape: 1"], ONE)))
    for v in (b"HTTP/2.0", b"HTTX/1.1", b"", b"HTTP/1.1 extra"):
        c.append(("paths", f"version {v!r}",
                  b"PUT /v1/vars/w " + v + b"\r\nHost: x\r\n" + A.encode() + b"\r\nX-Shape: 1\r\nContent-Length: 4\r\n\r\n" + ONE))
    # query values on writes and reads that must refuse
    for q in ("offset=-1", "count=-1", "offset=99", "count=13", "offset=1&count=12", "format=xml",
              "offset=99999999999999999999", "count=1e3", "offset=+1", "offset=%201", "format="):
        c.append(("query", f"GET ?{q}", head("GET", f"/v1/vars/w?{q}", [], None)))
    for q in ("min_step=-1", "timeout_ms=300001", "worker=-1", "worker=4096", "worker=1e3", "clock=-5",
              "min_clock=9223372036854775808", "clock=9007199254740993", "timeout_ms=abc", "worker=%2B1"):
        c.append(("query", f"params ?{q}", head("GET", f"/v1/params?{q}&timeout_ms=0", [], None)))
    # shapes and dtypes
    for shp in ("0", "-1", "3,,4", "99999999999", ",".join(["1"] * 100), "3;4", "3,4,", "1.5",
                "4294967297", "65536,65536,65536"):
        c.append(("shapes", f"X-Shape {shp[:20]!r}", put([f"X-Shape: {shp}"])))
    for dt in ("float16", "bfloat16", "F32", "float64", "int32", "", "float32 "):
        c.append(("dtypes", f"X-Dtype {dt!r}", put(["X-Shape: 1", f"X-Dtype: {dt}"])))
    c.append(("shapes", "body shorter than the shape", put(["X-Shape: 2"], ONE)))
    c.append(("shapes", "body longer than the shape", put(["X-Shape: 1"], ONE * 2)))
    c.append(("shapes", "NaN gradient to one variable",
              head("POST", "/v1/vars/w/grad", [A], np.full(12, np.nan, np.float32).tobytes())))
    c.append(("shapes", "gradient of the wrong shape",
              head("POST", "/v1/vars/w/grad", [A, "X-Shape: 4,3"], np.ones(12, np.float32).tobytes())))
    # safetensors bodies
    g = lambda body: head("POST", "/v1/grads", [A], body)
    good = {"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}}
    d48 = np.ones(12, np.float32).tobytes()
    bodies = [
        ("header length huge", st_body(good, d48, header_len=1 << 62)),
        ("header length past the body", st_body(good, d48, header_len=10000)),
        ("header not JSON", st_body(b"{not json", d48)),
        ("header a list", st_body(b"[1,2]", d48)),
        ("offsets past the data", st_body({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 480]}}, d48)),
        ("offsets reversed", st_body({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [48, 0]}}, d48)),
        ("offsets negative", st_body({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [-48, 0]}}, d48)),
        ("overlapping tensors", st_body({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
                                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, d48)),
        ("shape does not match offsets", st_body({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 48]}}, d48)),
        ("shape mismatch with the variable", grads([("w", np.ones((4, 3), np.float32))])),
        ("dtype F16", grads([("w", np.ones((3, 4), np.float32))], dtype="F16")),
        ("dtype junk", grads([("w", np.ones((3, 4), np.float32))], dtype="F32\u0000")),
        ("unknown variable", grads([("nope", np.ones((3, 4), np.float32))])),
        ("NaN gradient", grads([("w", np.full((3, 4), np.nan, np.float32))])),
        ("Inf gradient", grads([("w", np.full((3, 4), np.inf, np.float32))])),
        ("no tensors", st_body({})),
        ("metadata not strings", st_body({**good, "__metadata__": {"worker": 0}}, d48)),
        ("metadata worker 2^32", grads([("w", np.ones((3, 4), np.float32))], {"worker": "4294967296"})),
        ("metadata clock INT64_MAX", grads([("w", np.ones((3, 4), np.float32))], {"worker": "0", "clock": "9223372036854775807"})),
        ("metadata step -1", grads([("w", np.ones((3, 4), np.float32))], {"step": "-1"})),
        ("metadata loss NaN", grads([("w", np.ones((3, 4), np.float32))], {"loss": "nan"})),
        ("metadata loss 1e999", grads([("w", np.ones((3, 4), np.float32))], {"loss": "1e999"})),
        ("X-Push-Id junk", None),
        ("empty body", b""),
        ("7 bytes", b"\x01" * 7),
        ("shape with a negative dim", st_body({"w": {"dtype": "F32", "shape": [-3, -4], "data_offsets": [0, 48]}}, d48)),
        ("shape of 2^62 elements", st_body({"w": {"dtype": "F32", "shape": [1 << 31, 1 << 31], "data_offsets": [0, 48]}}, d48)),
        ("duplicate names", st_body(b'{"w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},'
                                    b'"w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]}}', d48)),
        ("deeply nested header", st_body(b"[" * 5000 + b"]" * 5000, d48)),
    ]
    for name, body in bodies:
        if body is None:
            c.append(("safetensors", name, head("POST", "/v1/grads", [A, "X-Push-Id: a b/c"],
                                                 grads([("w", np.ones((3, 4), np.float32))]))))
        else:
            c.append(("safetensors", name, g(body)))
    # auth: every write without the right token
    for bad in (None, "Bearer", "Bearer ", "Bearer  " + TOKEN, "Basic " + TOKEN, TOKEN, "Bearer " + TOKEN[:-1],
                "Bearer " + TOKEN + "x", "Bearer " + TOKEN.upper(), "Bearer\t" + TOKEN, "Bearer " + TOKEN + " junk"):
        hdr = [] if bad is None else [f"Authorization: {bad}"]
        c.append(("auth", f"PUT with {str(bad)[:24]!r}", head("PUT", "/v1/vars/w", hdr + ["X-Shape: 1"], ONE)))
        c.append(("auth", f"grads with {str(bad)[:24]!r}",
                  head("POST", "/v1/grads", hdr, grads([("w", np.ones((3, 4), np.float32))]))))
        c.append(("auth", f"shutdown with {str(bad)[:24]!r}", head("POST", "/v1/shutdown", hdr, b"")))
        c.append(("auth", f"config with {str(bad)[:24]!r}",
                  head("PUT", "/v1/config", hdr, b'{"optimizer":"sgd","learning_rate":0.1}')))
    # floats in the configuration
    for k, v in (("learning_rate", "1e-50"), ("learning_rate", "1e39"), ("learning_rate", "-0.1"),
                 ("learning_rate", "0"), ("learning_rate", '"NaN"'), ("learning_rate", "1e400"),
                 ("beta1", "0.9999999999"), ("beta2", "0.99999999999"), ("epsilon", "1e-50"),
                 ("beta1", "1"), ("momentum", "-1"), ("epsilon", "0"), ("learning_rate", "null"),
                 ("learning_rate", "true"), ("learning_rate", "[0.1]")):
        opt = "adam" if k in ("beta1", "beta2", "epsilon") else "momentum" if k == "momentum" else "sgd"
        base = {"optimizer": opt, "learning_rate": 0.1}
        text = json.dumps(base)[:-1] + f', "{k}": {v}}}' if k != "learning_rate" else \
            json.dumps({"optimizer": opt})[:-1] + f', "learning_rate": {v}}}'
        c.append(("floats", f"config {k}={v}", head("PUT", "/v1/config", [A], text.encode())))
    for body in (b"{", b"[]", b'{"optimizer":"sgd","learning_rate":0.1,"learning_rate":0.2}',
                 b'{"optimizer":"nope","learning_rate":0.1}', b'{"optimizer":"sgd","learning_rate":0.1,"sync":"yes"}',
                 b'{"optimizer":"sgd","learning_rate":0.1,"workers":-1}',
                 b'{"optimizer":"sgd","learning_rate":0.1,"workers":4294967297}',
                 b'{"optimizer":"sgd","learning_rate":0.1,"replicas_to_aggregate":0}'):
        c.append(("floats", f"config {body[:40]!r}", head("PUT", "/v1/config", [A], body)))
    # integers elsewhere
    for body in (b'{"worker":-1}', b'{"worker":4096}', b'{"worker":9223372036854775808}', b'{"worker":"1"}',
                 b'{"worker":1.5}', b'{}', b'junk'):
        c.append(("integers", f"heartbeat {body!r}", head("POST", "/v1/heartbeat", [A], body)))
    rng.shuffle(c)
    return c


# Invalid requests psd rightly waits on (their body is not all there), so
# no answer is the answer.
WAITS = {"body shorter than the shape", "chunk size overflow", "Content-Length ' 4x'"}


def valid_requests():
    """Valid requests (with the token) whose byte mutations the campaign throws."""
    A = "Authorization: " + AUTH
    return [
        head("PUT", "/v1/vars/w", [A, "X-Shape: 3,4", "X-Dtype: float32"], (W + 1).tobytes()),
        head("POST", "/v1/grads", [A], grads([("w", np.full((3, 4), 0.5, np.float32))], {"worker": "0", "step": "0"})),
        head("POST", "/v1/vars/w/grad", [A, "X-Shape: 3,4"], np.ones(12, np.float32).tobytes()),
        head("GET", "/v1/vars/w?format=json&offset=1&count=3", [], None),
        head("GET", "/v1/params?worker=0&timeout_ms=0", [A], None),
        head("PUT", "/v1/config", [A], b'{"optimizer":"adam","learning_rate":0.01,"beta1":0.9}'),
    ]


def mutate(rng, req):
    b = bytearray(req)
    for _ in range(rng.randint(1, 4)):
        if not b:
            break
        op = rng.randrange(5)
        i = rng.randrange(len(b))
        if op == 0:
            b[i] = rng.randrange(256)
        elif op == 1:
            del b[i:i + rng.randint(1, 8)]
        elif op == 2:
            b[i:i] = bytes(rng.choice([b"\x00", b"\r\n", b" ", b":", b"%", b"9" * 20, b"\xff", b"\r\n\r\n"]))
        elif op == 3:
            b = b[:i]
        else:
            b[i:i] = b[i:i + rng.randint(1, 40)]
    return bytes(b)


# -------------------------------------------------------------- the checks

class Campaign:
    def __init__(self, p, long_form, rss_cap_kib):
        self.p = p
        self.long = long_form
        self.findings = []
        self.slow = []
        self.counts = {}
        self.rss0 = p.rss_kib()
        self.rss_cap = rss_cap_kib
        self.before = snapshot(p)

    def finding(self, cat, name, what):
        self.findings.append(f"[{cat}] {name}: {what}")

    def check_alive(self, cat, name):
        if self.p.proc.poll() is not None:
            self.finding(cat, name, f"psd exited {self.p.proc.returncode}")
            return False
        try:
            st, _, _ = http("GET", self.p.url + "/healthz", timeout=2)
        except OSError as e:
            self.finding(cat, name, f"/healthz unanswered after it: {e!r}")
            return False
        if st != 200:
            self.finding(cat, name, f"/healthz answered {st}")
        err = self.p.stderr()
        for m in SANITIZER_MARKS:
            if m in err:
                self.finding(cat, name, "sanitizer report:\n" + err[err.index(m) - 200:][:3000])
                return False
        rss = self.p.rss_kib()
        if rss - self.rss0 > self.rss_cap:
            self.finding(cat, name, f"RSS {rss} KiB, {rss - self.rss0} KiB over the start")
        return True

    def one(self, cat, name, data, must_refuse):
        self.counts[cat] = self.counts.get(cat, 0) + 1
        t0 = time.time()
        try:
            st, got = raw(self.p.port, data)
        except OSError as e:
            st, got = None, repr(e).encode()
        self.slow.append((time.time() - t0, cat, name, st))
        if must_refuse and st is None and name not in WAITS:
            self.finding(cat, name, f"a complete request left unanswered: {got[:120]!r}")
        if not self.check_alive(cat, name):
            return False
        # 503: out of memory; 505: an HTTP version psd does not speak
        if st is not None and st >= 500 and st not in (503, 505):
            self.finding(cat, name, f"answered {st}: {got[:200]!r}")
        if st is not None and 200 <= st < 300:
            if must_refuse:
                self.finding(cat, name, f"accepted ({st}): {got[:200]!r}")
            self.before = snapshot(self.p)  # a valid request may change the state
            return True
        after = snapshot(self.p)
        if after != self.before:
            self.finding(cat, name, f"refused ({st}) yet the state changed")
            self.before = after
        return True

    def partial_sends(self, n):
        """Slowloris: heads and bodies sent in pieces and abandoned, while a
        normal client is answered at once; then the state is as before."""
        socks = []
        pieces = [b"PUT /v1/vars/w HTTP/1.1\r\n", b"Host: x\r\nAuthorization: " + AUTH.encode() + b"\r\n",
                  b"X-Shape: 3,4\r\nContent-Length: 48\r\n\r\n", b"\x00" * 20]
        for i in range(n):
            s = socket.create_connection(("127.0.0.1", self.p.port), timeout=2)
            s.sendall(b"".join(pieces[:1 + i % len(pieces)]))
            socks.append(s)
        t0 = time.time()
        ok = True
        try:
            st, _, _ = http("GET", self.p.url + "/healthz", timeout=2)
            took = time.time() - t0
            if st != 200 or took > 1:
                self.finding("slowloris", f"{n} partial sends", f"a normal client took {took:.2f} s ({st})")
        except OSError as e:
            self.finding("slowloris", f"{n} partial sends", f"a normal client was not answered: {e!r}")
            ok = False
        for s in socks:
            s.close()
        self.counts["slowloris"] = self.counts.get("slowloris", 0) + n
        time.sleep(0.2)
        if ok and self.check_alive("slowloris", "after"):
            after = snapshot(self.p)
            if after != self.before:
                self.finding("slowloris", "abandoned partial PUTs", "the state changed")
                self.before = after

    def races(self, rounds):
        A = {"Authorization": AUTH}
        for r in range(rounds):
            name = f"race{r}"
            codes = []
            lock = threading.Lock()

            def create():
                st, _, _ = http("PUT", f"{self.p.url}/v1/vars/{name}", np.ones(4, np.float32).tobytes(),
                                {"X-Shape": "4", "If-None-Match": "*", **A})
                with lock:
                    codes.append(st)

            ts = [threading.Thread(target=create) for _ in range(8)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.counts["races"] = self.counts.get("races", 0) + len(ts)
            if sorted(codes) != [201] + [412] * 7:
                self.finding("races", f"If-None-Match: * x8 on {name}", f"statuses {sorted(codes)}")
        # a variable reshaped while readers read: every body matches its X-Shape
        stop = threading.Event()
        torn = []

        def reshape():
            i = 0
            while not stop.is_set():
                n = 1 + (i % 7) * 1000
                http("PUT", self.p.url + "/v1/vars/shifty", np.full(n, float(n), np.float32).tobytes(),
                     {"X-Shape": str(n), **A})
                i += 1

        def read():
            while not stop.is_set():
                st, hd, body = http("GET", self.p.url + "/v1/vars/shifty")
                if st != 200:
                    continue
                n = int(hd["x-shape"])
                a = np.frombuffer(body, np.float32)
                if a.size != n or not np.all(a == float(n)):
                    torn.append((n, a.size))

        http("PUT", self.p.url + "/v1/vars/shifty", ONE, {"X-Shape": "1", **A})
        ts = [threading.Thread(target=reshape)] + [threading.Thread(target=read) for _ in range(2)]
        for t in ts:
            t.start()
        time.sleep(3 if self.long else 1)
        stop.set()
        for t in ts:
            t.join()
        self.counts["races"] = self.counts.get("races", 0) + 1
        if torn:
            self.finding("races", "reads while reshaping", f"{len(torn)} torn reads, e.g. {torn[:3]}")
        self.before = snapshot(self.p)


    def anonymous_reader(self):
        """Without the token a pull is a read: it renews no lease and moves
        no clock (issue 23)."""
        def state():
            _, _, sync = http("GET", self.p.url + "/v1/sync")
            _, _, status = http("GET", self.p.url + "/v1/status")
            return json.loads(sync)["dead"], json.loads(status)["staleness"]["clocks"]
        before = state()
        for q in ("worker=0&timeout_ms=0", "worker=0&clock=7&timeout_ms=0", "worker=0&clock=9&min_clock=0&timeout_ms=0"):
            for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer " + TOKEN[:-1]}):
                self.counts["auth"] = self.counts.get("auth", 0) + 1
                st, _, _ = http("GET", f"{self.p.url}/v1/params?{q}", headers=hdr)
                if st != 200:
                    self.finding("auth", f"anonymous pull {q}", f"answered {st}")
        after = state()
        if after != before:
            self.finding("auth", "anonymous pulls as worker 0", f"changed leases or clocks: {before} -> {after}")

    def vm_kib(self):
        with open(f"/proc/{self.p.proc.pid}/status") as f:
            for ln in f:
                if ln.startswith("VmSize:"):
                    return int(ln.split()[1])
        return 0

    def big_heads(self, n):
        """Heads announcing 16 MiB bodies (--max_body_bytes) that never come:
        no buffer is reserved before the bytes arrive."""
        vm0 = self.vm_kib()
        socks = []
        for i in range(n):
            s = socket.create_connection(("127.0.0.1", self.p.port), timeout=2)
            s.sendall(f"PUT /v1/vars/h{i} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
                      f"X-Shape: 4194304\r\nContent-Length: 16777216\r\n\r\n".encode())
            socks.append(s)
        time.sleep(0.5)
        grew = self.vm_kib() - vm0
        for s in socks:
            s.close()
        self.counts["exhaustion"] = self.counts.get("exhaustion", 0) + n
        if grew > n * 4 * 1024:  # 16 MiB each when reserved up front
            self.finding("exhaustion", f"{n} heads of 16 MiB", f"virtual size grew {grew} KiB before any byte")
        self.check_alive("exhaustion", "big heads")

    def idle_flood(self, n):
        """n connections that send nothing: a normal client is answered at once."""
        socks = []
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.p.port))
            socks.append(s)
        time.sleep(0.5)
        t0 = time.time()
        try:
            st, _, _ = http("GET", self.p.url + "/healthz", timeout=3)
            took = time.time() - t0
            if took > 1:
                self.finding("exhaustion", f"{n} idle connections", f"a normal client took {took:.2f} s")
        except OSError as e:
            self.finding("exhaustion", f"{n} idle connections", f"a normal client was not answered: {e!r}")
        for s in socks:
            s.close()
        self.counts["exhaustion"] = self.counts.get("exhaustion", 0) + n
        time.sleep(0.3)
        self.check_alive("exhaustion", "idle flood")


def room_for(n):
    """Raise the descriptor limit (psd inherits it) to hold n sockets; how many fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 200:
        soft = n + 200 if hard == resource.RLIM_INFINITY else min(n + 200, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return min(n, soft - 200)


def seed_state(p):
    A = {"Authorization": AUTH}
    for name, arr in (("w", W), ("b", np.ones(4, np.float32))):
        st, _, body = http("PUT", f"{p.url}/v1/vars/{name}", arr.tobytes(),
                           {"X-Shape": ",".join(map(str, arr.shape)), **A})
        assert st == 201, body
    st, _, body = http("PUT", p.url + "/v1/config", b'{"optimizer":"sgd","learning_rate":0.5}', A)
    assert st == 200, body


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("RESTPS_BIN_DIR", "bin"))
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--seed", type=int, default=23)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.time()
    asan = "asan" in args.bin
    flood = room_for(2000 if args.long else 1100)
    with tempfile.TemporaryDirectory(prefix="hostile-") as wd:
        p = Psd(args.bin, wd)
        try:
            seed_state(p)
            c = Campaign(p, args.long, rss_cap_kib=(512 if asan else 256) * 1024)
            rounds = 4 if args.long else 1
            for _ in range(rounds):
                for cat, name, data in invalid_cases(rng):
                    if not c.one(cat, name, data, must_refuse=True):
                        raise SystemExit(report(c, p, t0))
            n_mut = 1500 if args.long else 100
            valid = valid_requests()
            for i in range(n_mut):
                base = rng.randrange(len(valid))
                if not c.one("mutations", f"#{i} of valid request {base}", mutate(rng, valid[base]),
                             must_refuse=False):
                    raise SystemExit(report(c, p, t0))
            for n in ((20, 200, 900) if args.long else (30,)):
                c.partial_sends(n)
            c.races(20 if args.long else 3)
            c.anonymous_reader()
            c.big_heads(200 if args.long else 20)
            c.idle_flood(flood)
            c.check_alive("end", "end")
        finally:
            rc = p.stop()
        if rc != 0:
            c.finding("end", "SIGTERM", f"psd exited {rc}")
        err = p.stderr()
        for m in SANITIZER_MARKS:
            if m in err:
                c.finding("end", "exit", "sanitizer report at exit:\n" + err[err.index(m):][:3000])
                break
        return report(c, p, t0)


def report(c, p, t0):
    total = sum(c.counts.values())
    print(f"hostile campaign: {total} requests in {time.time() - t0:.1f} s "
          f"({', '.join(f'{k} {v}' for k, v in sorted(c.counts.items()))}); "
          f"{len(c.findings)} finding(s)")
    for f in c.findings:
        print("  " + f)
    c.slow.sort(reverse=True)
    print("slowest: " + "; ".join(f"{cat} {name[:30]} {t:.2f} s ({st})" for t, cat, name, st in c.slow[:5]))
    return 1 if c.findings else 0


if __name__ == "__main__":
    sys.exit(main())
