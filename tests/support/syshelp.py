"""Helpers shared by test_bad_input.py and test_auth.py: raw-socket HTTP (and
the first event of an event stream), curl
requests with status/headers/body, safetensors bodies built by hand, and a
snapshot of everything a psd holds (to prove a refusal changed nothing).

Everything here is independent of the server's code: safetensors bodies are
built from the format description (8-byte LE header length, JSON header, data),
values are checked with numpy."""
import json
import os
import socket
import struct
import tempfile

import numpy as np

from conftest import curl, http


# ---------------------------------------------------------------- raw sockets

def connect(port, timeout=10):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(sock, timeout=10):
    """(status, headers lower-case dict, body) of one HTTP/1.1 response."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a full response head: {buf!r}")
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, headers, rest[:n]
    while True:  # until close
        chunk = sock.recv(65536)
        if not chunk:
            return status, headers, rest
        rest += chunk


def first_event(port, path, headers=(), timeout=10):
    """GET an event stream (text/event-stream, chunked) over a raw socket and
    stop at the end of its first event (a `data:` line and the blank line
    after it): (status, headers, the decoded body read so far). An answer with
    a Content-Length (an error) is read whole. Never waits for the stream to
    end; raises if the first event does not come within timeout seconds."""
    with connect(port, timeout) as s:
        s.sendall(request_head("GET", path, headers))
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"connection closed before a full response head: {buf!r}")
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        hdrs = {}
        for line in lines[1:]:
            k, v = line.split(":", 1)
            hdrs[k.strip().lower()] = v.strip()
        if hdrs.get("transfer-encoding", "").lower() != "chunked":
            n = int(hdrs["content-length"])
            while len(rest) < n:
                chunk = s.recv(65536)
                if not chunk:
                    break
                rest += chunk
            return status, hdrs, rest[:n]
        body = b""
        while True:
            while b"\r\n" in rest:  # every whole chunk received so far
                size_line, after = rest.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                if len(after) < size + 2:
                    break
                assert after[size:size + 2] == b"\r\n", after[:size + 2]
                if size == 0:
                    raise AssertionError(f"the stream ended before its first event: {body!r}")
                body += after[:size]
                rest = after[size + 2:]
            text = b"\n" + body
            i = text.find(b"\ndata:")
            if i >= 0 and b"\n\n" in text[i:]:
                return status, hdrs, body
            chunk = s.recv(65536)
            if not chunk:
                raise AssertionError(f"the connection closed before the first event: {body!r}")
            rest += chunk


def raw_request(port, data, timeout=10):
    """Send bytes as they are, return the parsed response."""
    with connect(port, timeout) as s:
        s.sendall(data)
        return read_response(s, timeout)


def request_head(method, path, headers=(), content_length=None):
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    for h in headers:
        lines.append(h)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunked(body, size=512):
    out = b""
    for i in range(0, len(body), size):
        part = body[i:i + size]
        out += b"%x\r\n" % len(part) + part + b"\r\n"
    return out + b"0\r\n\r\n"


# ----------------------------------------------------------------------- curl

def curl_req(method, url, headers=(), data=None, extra=()):
    """Real curl: (status, headers of the final response, body bytes). data: bytes."""
    with tempfile.TemporaryDirectory(prefix="restps-curl-") as d:
        hfile, bfile = os.path.join(d, "h"), os.path.join(d, "b")
        args = ["--path-as-is", "-X", method, "-D", hfile, "-o", bfile, "-w", "%{http_code}"]
        for h in headers:
            args += ["-H", h]
        if data is not None:
            dfile = os.path.join(d, "d")
            with open(dfile, "wb") as f:
                f.write(data)
            args += ["--data-binary", "@" + dfile]
        args += list(extra) + [url]
        cp = curl(*args)
        code = int(cp.stdout.decode() or "0")
        assert cp.returncode == 0 and code != 0, (
            f"curl {method} {url} got no HTTP response (curl exit {cp.returncode}): "
            f"{cp.stderr.decode(errors='replace').strip()}")
        with open(hfile, "rb") as f:
            raw = f.read().decode("latin-1")
        # the last response block (after any 100 Continue)
        blocks = [b for b in raw.split("\r\n\r\n") if b.startswith("HTTP/")]
        hdrs = {}
        for line in blocks[-1].split("\r\n")[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                hdrs[k.strip().lower()] = v.strip()
        body = b""
        if os.path.exists(bfile):
            with open(bfile, "rb") as f:
                body = f.read()
        return code, hdrs, body


# ---------------------------------------------------------------- safetensors

def st_body(header, data=b"", header_len=None, pad=True):
    """header: dict (dumped as JSON) or bytes (used as they are)."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad and not isinstance(header, bytes):
        h += b" " * (-len(h) % 8)
    n = len(h) if header_len is None else header_len
    return struct.pack("<Q", n) + h + data


def st_grads(tensors, meta=None):
    """tensors: list of (name, float32 array) -> safetensors body, F32, in order."""
    header, data = {}, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name, arr in tensors:
        a = np.ascontiguousarray(arr, dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [len(data), len(data) + a.nbytes]}
        data += a.tobytes()
    return st_body(header, data)


# ------------------------------------------------------------------ the state

def get_raw(url, name, headers=None):
    st, hd, body = http("GET", f"{url}/v1/vars/{name}", headers=headers)
    assert st == 200, (name, st, body)
    return body


def snapshot(url, headers=None):
    """Everything observable about the stored state (headers: e.g. a token)."""
    st, _, body = http("GET", url + "/v1/vars", headers=headers)
    assert st == 200, body
    listing = json.loads(body)
    st, _, body = http("GET", url + "/v1/status", headers=headers)
    assert st == 200, body
    status = json.loads(body)
    snap = {"global_step": listing["global_step"],
            "status_step": status["global_step"],
            "last_loss": status["last_loss"],
            "variables": status["variables"],
            "bytes": status["bytes"],
            "vars": {}}
    # the training state: configuration, sync bookkeeping, reports
    for k in ("ready", "mode", "optimizer", "learning_rate", "replicas_to_aggregate",
              "stale_dropped", "pending_gradients", "waiting_pulls", "workers_done", "eval",
              "waiting_for"):
        snap[k] = status[k]
    snap["sparse"] = status.get("sparse")  # the row-sparse tables: rows held, updates
    # what the shard knows of each worker, but the clock
    snap["workers"] = [{k: v for k, v in w.items() if k != "last_seen_secs_ago"}
                       for w in status["workers"]]
    st, _, body = http("GET", url + "/v1/config", headers=headers)
    assert st in (200, 404), (st, body)
    snap["config"] = json.loads(body) if st == 200 else None
    for v in listing["vars"]:
        snap["vars"][v["name"]] = (tuple(v["shape"]), v["version"], v["bytes"],
                                   get_raw(url, v["name"], headers))
    return snap


def healthy(url):
    st, _, body = http("GET", url + "/healthz")
    return st == 200 and json.loads(body) == {"status": "ok"}


def assert_unchanged(p, before):
    """The server answers and holds exactly what it held before."""
    assert p.alive(), "psd died:\n" + p.read_stderr()[-3000:]
    assert healthy(p.url), "psd no longer answers /healthz"
    after = snapshot(p.url)
    assert after == before, "a refused request changed the stored state"


def assert_error(status, headers, body, want_status, *words):
    """Exact status, JSON {"error": "..."} naming the problem (each word in it)."""
    assert status == want_status, f"status {status}, want {want_status}; body {body[:300]!r}"
    ctype = headers.get("content-type", "")
    assert ctype.startswith("application/json"), f"content-type {ctype!r}"
    doc = json.loads(body)
    assert isinstance(doc, dict) and list(doc) == ["error"], doc
    msg = doc["error"]
    assert isinstance(msg, str) and len(msg) >= 10, doc
    for w in words:
        assert w.lower() in msg.lower(), f"error {msg!r} does not mention {w!r}"
    return msg


def put_var(url, name, arr):
    a = np.ascontiguousarray(arr, dtype="<f4")
    shape = ",".join(str(d) for d in a.shape)
    st, _, body = http("PUT", f"{url}/v1/vars/{name}", a.tobytes(), {"X-Shape": shape})
    assert st in (200, 201), (st, body)
    return json.loads(body)
