"""openapi/openapi.yaml against the real psd.

- the spec is valid OpenAPI (openapi-spec-validator, plus every schema checked
  against the JSON Schema meta-schema and for unknown keywords), and a broken
  copy is refused;
- every route, in every outcome that can be produced on demand (successes and
  each kind of error, with and without a bearer token), is recorded against
  live psd processes and every exchange is checked against the spec by
  tests/helpers/openapi_check.py (jsonschema); every documented (operation, status) pair
  must have been seen, and deliberately wrong copies of the exchanges must be
  caught;
- `psd --routes` and the spec list the same paths and methods, and the write
  routes are the ones whose security requires the bearer token.

Checkpoints downloaded from GET /v1/checkpoint are read back with
tests/support/ckpt_check.py (an independent reader of the format).

Needs the test suite's PyPI environment, build/venv (`make deps`:
tests/support/requirements.txt); skips without it.
"""
import copy
import http.client
import json
import math
import os
import struct
import subprocess
import threading
import time
import urllib.parse

import pytest
import yaml

import ckpt_check
from conftest import HELPERS, ROOT, binary

SPEC = os.path.join(ROOT, "openapi", "openapi.yaml")
CHECKER = os.path.join(HELPERS, "openapi_check.py")
VENV_PYTHON = os.path.join(ROOT, "build", "venv", "bin", "python")
TOKEN = "s3cret-Token_42"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# Statuses the spec documents that no request can produce on demand (out of
# memory, a response that cannot be built).
NOT_PRODUCIBLE = {"500", "503"}


def venv_python():
    if not os.access(VENV_PYTHON, os.X_OK):
        pytest.skip(f"{VENV_PYTHON} is missing (the PyPI packages of the tests): run make deps")
    return VENV_PYTHON


def run_checker(*args):
    return subprocess.run([venv_python(), CHECKER] + list(args), cwd=HELPERS,
                          capture_output=True, text=True, timeout=120)


def load_spec():
    with open(SPEC) as f:
        return yaml.safe_load(f)


def f32(*values):
    return struct.pack("<%df" % len(values), *values)


def safetensors(tensors, metadata=None):
    """tensors: {name: (dtype, shape, raw bytes)} -> one safetensors body."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def read_safetensors(body):
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8:8 + n])
    data = body[8 + n:]
    meta = header.pop("__metadata__", {})
    out = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        out[name] = (t["dtype"], t["shape"], struct.unpack("<%df" % ((e - b) // 4), data[b:e]))
    return meta, out


def placement_map(variables, policy="bytes"):
    """A placement map as workerd's chief sends it, for one ps task:
    variables is [(name, shape)], none partitioned."""
    def numel(shape):
        return math.prod(shape)
    return {"policy": policy, "partition_bytes": 4194304, "ps_tasks": 1,
            "bytes_per_ps": [sum(4 * numel(sh) for _, sh in variables)],
            "variables": [{"name": n, "shape": sh,
                           "parts": [{"name": n, "ps": 0, "rows": [0, sh[0]]}]}
                          for n, sh in variables]}


def error_of(body):
    return json.loads(body)["error"]


class Recorder:
    """Sends requests with http.client and records each exchange."""

    def __init__(self):
        self.exchanges = []
        self.events = None  # the blocks of the last event stream read

    def __call__(self, psd, method, path, query=None, body=None, headers=None, token=None,
                 expect=None, chunked=False, headers_only=False):
        url = urllib.parse.quote(path, safe="/%") + (
            "?" + urllib.parse.urlencode(query) if query else "")
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = token if " " in token else "Bearer " + token
        conn = http.client.HTTPConnection("127.0.0.1", psd.port, timeout=10)
        try:
            if headers_only:
                # Content-Length declared, body not sent: the answer must come
                # before the body is read (as with Expect: 100-continue).
                conn.putrequest(method, url, skip_accept_encoding=True)
                for k, v in hdrs.items():
                    conn.putheader(k, v)
                conn.endheaders()
            elif chunked:
                conn.request(method, url, body=iter(body), headers=hdrs, encode_chunked=True)
            else:
                conn.request(method, url, body=body, headers=hdrs)
            resp = conn.getresponse()
            events = None
            if method == "GET" and resp.status == 200 and \
                    (resp.getheader("content-type") or "").startswith("text/event-stream"):
                data, events = read_first_event(resp)  # the stream does not end: stop there
            else:
                data = resp.read()
        finally:
            conn.close()
        rh = {}
        for k, v in resp.getheaders():
            k = k.lower()
            rh[k] = rh[k] + ", " + v if k in rh else v
        ct = rh.get("content-type")
        ex = {"method": method, "path": path, "query": dict(query or {}), "status": resp.status,
              "headers": rh, "content_type": ct, "body": None, "body_length": len(data)}
        if ct and ct.split(";")[0].strip() == "application/json" and data:
            try:
                ex["body"] = json.loads(data)
            except ValueError as e:
                ex["body_error"] = str(e)
        self.exchanges.append(ex)
        if events is not None:
            ex["events"] = self.events = events
            # The checker validates JSON bodies only: the first event's data
            # goes to it as the body of a GET /v1/status answer, since the
            # spec documents it as that same Status schema
            # (test_event_data_is_status checks the spec says so).
            self.exchanges.append({
                "method": "GET", "path": "/v1/status", "query": {}, "status": 200,
                "headers": rh, "content_type": "application/json",
                "body": json.loads(events[-1]["data"]), "body_length": len(events[-1]["data"]),
                "from": f"the first event of GET {path}"})
        if expect is not None:
            assert resp.status == expect, (
                f"{method} {url}: expected {expect}, got {resp.status}: {data[:300]!r}")
        return resp.status, rh, data


def read_first_event(resp):
    """Read a text/event-stream answer up to the end of its first event (the
    blank line after a `data:` line), by lines, within the connection's
    timeout. Returns (the bytes read, the blocks read as
    [{field: value}], the last being the event)."""
    raw, blocks, block = b"", [], {}
    while True:
        line = resp.readline()
        if not line:
            raise AssertionError(f"the event stream ended before its first event: {raw!r}")
        raw += line
        assert line.endswith(b"\n"), line
        text = line.decode("utf-8").rstrip("\n")
        if text == "":
            if block:
                blocks.append(block)
                if "data" in block:
                    return raw, blocks
            block = {}
        elif not text.startswith(":"):
            k, _, v = text.partition(":")
            block[k] = v[1:] if v.startswith(" ") else v


WEB = {"/": ("index.html", "text/html"), "/app.js": ("app.js", "text/javascript"),
       "/style.css": ("style.css", "text/css")}


def cksum_etag(path):
    """The ETag psd gives a file of web/: POSIX cksum's CRC in hex and the size."""
    crc, size, _ = subprocess.run(["cksum", path], capture_output=True, text=True,
                                  check=True).stdout.split()
    return '"%08x-%s"' % (int(crc), size)


def exercise_web(rec, p, token=None):
    """The page's three files: the bytes of web/, their ETag, 304 on a match."""
    for path, (name, ctype) in WEB.items():
        f = os.path.join(ROOT, "web", name)
        with open(f, "rb") as fh:
            want = fh.read()
        _, h, b = rec(p, "GET", path, token=token, expect=200)
        assert b == want, f"{path} is not web/{name}: rebuild psd"
        assert h["content-type"] == ctype + "; charset=utf-8", h
        assert (h["etag"], h["cache-control"]) == (cksum_etag(f), "no-cache"), h
        etag = h["etag"]
        _, h, b = rec(p, "GET", path, headers={"If-None-Match": etag}, token=token, expect=304)
        assert b == b"" and (h["etag"], h["cache-control"]) == (etag, "no-cache"), h
        rec(p, "GET", path, headers={"If-None-Match": '"00000000-1"'}, token=token, expect=200)
        _, h, _ = rec(p, "HEAD", path, token=token, expect=200)
        assert h["etag"] == etag and h["content-length"] == str(len(want)), h
        rec(p, "HEAD", path, headers={"If-None-Match": etag}, token=token, expect=304)


def exercise_events(rec, p, token=None):
    """GET /v1/events up to its first event (the stream does not end), and HEAD."""
    _, h, _ = rec(p, "GET", "/v1/events", token=token, expect=200)
    assert h["cache-control"] == "no-store", h
    events = rec.events
    assert events[0] == {"retry": "1000"}, events
    ev = events[-1]
    status = json.loads(ev["data"])
    assert (ev["event"], ev["id"]) == ("status", str(status["global_step"])), ev
    _, _, b = rec(p, "GET", "/v1/status", token=token, expect=200)
    assert json.loads(b)["global_step"] == status["global_step"]
    _, h, b = rec(p, "HEAD", "/v1/events", token=token, expect=200)
    assert h["content-type"].startswith("text/event-stream") and b == b"", h
    return status


# The __metadata__ keys of a checkpoint (the spec's Checkpoint schema).
CHECKPOINT_META = {"format", "format_version", "global_step", "task", "ps_tasks", "saved_at",
                   "config", "variables", "placement", "state", "crc32c", "meta_crc32c"}


def exercise_checkpoint(rec, p, token=None, read_token=None):
    """POST /v1/checkpoint, then GET and HEAD the file it wrote, read back with
    ckpt_check (which checks both checksums). Returns (the POST's answer,
    the metadata, the tensors)."""
    _, _, b = rec(p, "POST", "/v1/checkpoint", token=token, expect=200)
    saved = json.loads(b)
    step, name = saved["global_step"], saved["file"]
    assert name == f"model.ckpt-{step}.safetensors", saved
    assert saved["path"].endswith("/ps-0/" + name), saved
    _, h, body = rec(p, "GET", "/v1/checkpoint", token=read_token, expect=200)
    assert (h["content-type"], h["x-global-step"], h["x-checkpoint"],
            h["content-disposition"]) == ("application/octet-stream", str(step), name,
                                          f'attachment; filename="{name}"'), h
    with open(saved["path"], "rb") as f:
        assert f.read() == body, "GET /v1/checkpoint is not the file POST wrote"
    with open("downloaded.safetensors", "wb") as f:
        f.write(body)
    meta, tensors = ckpt_check.read("downloaded.safetensors")
    assert set(meta) == CHECKPOINT_META, sorted(meta)
    assert (meta["format"], meta["format_version"], meta["global_step"], meta["task"],
            meta["ps_tasks"]) == ("restps-checkpoint", "1", str(step), "ps:0", "1"), meta
    placed, variables = json.loads(meta["placement"]), json.loads(meta["variables"])
    assert set(placed) == {"ps_task", "ps_tasks", "variables", "map"}, placed
    assert (placed["ps_task"], placed["ps_tasks"]) == (0, 1), placed
    assert set(placed["variables"]) == set(variables), (placed, variables)
    for name, info in variables.items():
        assert set(info) == {"version", "updates", "slots", "shape"}, (name, info)
        assert info["shape"] == list(tensors[name].shape), (name, info)
    _, h, b = rec(p, "HEAD", "/v1/checkpoint", token=read_token, expect=200)
    assert (h["x-global-step"], h["content-length"], b) == (str(step), str(len(body)), b""), h
    _, _, b = rec(p, "GET", "/v1/status", token=read_token, expect=200)
    ck = json.loads(b)["checkpoint"]
    assert (ck["last"]["file"], ck["last"]["global_step"]) == (saved["path"], step), ck
    assert ck["saves"] >= 1 and ck["last_error"] is None, ck
    return saved, meta, tensors


def exercise_open(rec, p):
    """Every route on a psd without a token, --max_body_bytes=4096."""
    # health
    rec(p, "GET", "/healthz", expect=200)
    rec(p, "HEAD", "/healthz", expect=200)
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    s = json.loads(b)
    assert s["last_loss"] is None and s["eval"] is None and s["ready"] is False
    assert (s["mode"], s["optimizer"]) == ("async", "sgd")
    rec(p, "HEAD", "/v1/status", expect=200)
    # the sync step before any configuration: async, one worker, nothing pending
    _, h, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert h["cache-control"] == "no-store", h
    assert (sy["mode"], sy["global_step"], sy["workers"], sy["replicas_to_aggregate"],
            sy["live_workers"], sy["needed"], sy["have"], sy["waiting_for"], sy["dead"],
            sy["left"], sy["lease_secs"], sy["waiting_secs"]) == \
        ("async", 0, 1, 1, 0, 1, [], [], [], [], 10, 0), sy
    assert s["waiting_for"] == [], s
    assert without_clocks(s["sync"]) == without_clocks(sy), (s["sync"], sy)
    rec(p, "HEAD", "/v1/sync", expect=200)
    rec(p, "GET", "/metrics", expect=200)
    rec(p, "HEAD", "/metrics", expect=200)
    _, _, b = rec(p, "GET", "/v1/history", expect=200)
    assert json.loads(b) == {"global_step": 0, "points": [], "eval": []}
    rec(p, "HEAD", "/v1/history", expect=200)
    exercise_events(rec, p)
    exercise_web(rec, p)
    _, _, b = rec(p, "GET", "/v1/vars", expect=200)
    assert json.loads(b)["vars"] == []
    rec(p, "HEAD", "/v1/vars", expect=200)
    # no checkpoint yet (and none comes by itself: nothing changed)
    assert s["checkpoint"]["last"] is None and s["checkpoint"]["saves"] == 0, s
    rec(p, "GET", "/v1/checkpoint", expect=404)
    rec(p, "HEAD", "/v1/checkpoint", expect=404)
    # no placement map yet
    _, _, b = rec(p, "GET", "/v1/placement", expect=404)
    assert error_of(b) == "no placement yet: the chief sends it", b
    rec(p, "HEAD", "/v1/placement", expect=404)

    # PUT: created, replaced, create-only, names with '/', a scalar, chunked
    w = f32(1, 2, 3, 4, 5, 6)
    rec(p, "PUT", "/v1/vars/w", body=w, headers={"X-Shape": "2,3"}, expect=201)
    rec(p, "PUT", "/v1/vars/w", body=w, headers={"X-Shape": "2, 3", "X-Dtype": "float32"},
        expect=200)
    rec(p, "PUT", "/v1/vars/w", body=w, headers={"X-Shape": "2,3", "If-None-Match": "*"},
        expect=412)
    rec(p, "PUT", "/v1/vars/layer1/b.0", body=f32(0.5, -0.5, 1e-30),
        headers={"X-Shape": "3", "If-None-Match": "*",
                 "Content-Type": "application/octet-stream"}, expect=201)
    rec(p, "PUT", "/v1/vars/s", body=f32(7), headers={"X-Shape": ""}, expect=201)
    rec(p, "PUT", "/v1/vars/ch", body=[f32(1, 2), f32(3, 4)], chunked=True,
        headers={"X-Shape": "4"}, expect=201)
    rec(p, "PUT", "/v1/vars/nf", body=f32(math.nan, math.inf, 1.5, -math.inf),
        headers={"X-Shape": "2,2"}, expect=201)
    rec(p, "PUT", "/v1/vars/allnan", body=f32(math.nan, math.nan), headers={"X-Shape": "2"},
        expect=201)
    # PUT refusals
    rec(p, "PUT", "/v1/vars/x", body=w, expect=400)  # no X-Shape
    rec(p, "PUT", "/v1/vars/x", body=w, headers={"X-Shape": "2,a"}, expect=400)
    rec(p, "PUT", "/v1/vars/x", body=w, headers={"X-Shape": "0,6"}, expect=400)
    rec(p, "PUT", "/v1/vars/x", body=w, headers={"X-Shape": "1,1,1,1,1,1,1,1,6"}, expect=400)
    rec(p, "PUT", "/v1/vars/x", body=w, headers={"X-Shape": "6", "X-Dtype": "float64"},
        expect=400)
    rec(p, "PUT", "/v1/vars/x", body=w, headers={"X-Shape": "5"}, expect=400)  # length
    rec(p, "PUT", "/v1/vars/x", body=[f32(1)], chunked=True, headers={"X-Shape": "2"},
        expect=400)  # chunked body shorter than the shape
    rec(p, "PUT", "/v1/vars/a..b", body=w, headers={"X-Shape": "6"}, expect=400)
    rec(p, "PUT", "/v1/vars/", body=w, headers={"X-Shape": "6"}, expect=400)
    rec(p, "PUT", "/v1/vars/" + "n" * 129, body=w, headers={"X-Shape": "6"}, expect=400)
    rec(p, "PUT", "/v1/vars/stats", body=w, headers={"X-Shape": "6"}, expect=400)
    rec(p, "PUT", "/v1/vars/a//b", body=w, headers={"X-Shape": "6"}, expect=400)
    rec(p, "PUT", "/v1/vars/a b", body=w, headers={"X-Shape": "6"}, expect=400)
    rec(p, "PUT", "/v1/vars/big", headers={"X-Shape": "2000", "Content-Length": "8000"},
        headers_only=True, expect=413)  # from Content-Length
    rec(p, "PUT", "/v1/vars/big", headers={"X-Shape": "2000", "Transfer-Encoding": "chunked"},
        headers_only=True, expect=413)  # from the shape

    # GET one variable: raw, JSON, slices, ETag, HEAD
    st, h, b = rec(p, "GET", "/v1/vars/w", expect=200)
    assert b == w and h["x-shape"] == "2,3" and h["x-version"] == "2"
    etag = h["etag"]
    _, _, b = rec(p, "GET", "/v1/vars/w", query={"format": "json"}, expect=200)
    assert json.loads(b)["values"] == [1, 2, 3, 4, 5, 6]
    rec(p, "GET", "/v1/vars/w", headers={"Accept": "application/json"}, expect=200)
    rec(p, "GET", "/v1/vars/w", query={"format": "raw"}, headers={"Accept": "application/json"},
        expect=200)
    rec(p, "GET", "/v1/vars/w", query={"format": "binary"}, expect=200)
    _, h, b = rec(p, "GET", "/v1/vars/w", query={"offset": "1", "count": "2"}, expect=200)
    assert b == f32(2, 3) and h["x-shape"] == "2"
    _, _, b = rec(p, "GET", "/v1/vars/w", query={"offset": "4", "format": "json"}, expect=200)
    assert json.loads(b)["values"] == [5, 6] and json.loads(b)["count"] == 2
    rec(p, "GET", "/v1/vars/w", query={"count": "3", "format": "json"}, expect=200)
    _, _, b = rec(p, "GET", "/v1/vars/w", query={"offset": "6"}, expect=200)
    assert b == b""
    rec(p, "GET", "/v1/vars/layer1/b.0", query={"format": "json"}, expect=200)
    rec(p, "GET", "/v1/vars/s", expect=200)
    _, _, b = rec(p, "GET", "/v1/vars/s", query={"format": "json"}, expect=200)
    assert json.loads(b)["shape"] == []
    _, _, b = rec(p, "GET", "/v1/vars/nf", query={"format": "json"}, expect=200)
    assert json.loads(b)["values"] == [None, None, 1.5, None]
    rec(p, "GET", "/v1/vars/w", headers={"If-None-Match": etag}, expect=304)
    rec(p, "GET", "/v1/vars/w", headers={"If-None-Match": '"other", ' + etag}, expect=304)
    rec(p, "GET", "/v1/vars/w", headers={"If-None-Match": "*"}, expect=304)
    rec(p, "GET", "/v1/vars/w", headers={"If-None-Match": '"stale"'}, expect=200)
    rec(p, "GET", "/v1/vars/w", query={"format": "json"}, headers={"If-None-Match": etag},
        expect=200)  # another representation, another ETag
    rec(p, "GET", "/v1/vars/w", query={"format": "xml"}, expect=400)
    rec(p, "GET", "/v1/vars/w", query={"offset": "7"}, expect=400)
    rec(p, "GET", "/v1/vars/w", query={"offset": "2", "count": "5"}, expect=400)
    rec(p, "GET", "/v1/vars/w", query={"offset": "-1"}, expect=400)
    rec(p, "GET", "/v1/vars/w", query={"count": "two"}, expect=400)
    rec(p, "GET", "/v1/vars/missing", expect=404)
    rec(p, "GET", "/v1/vars/a..b", expect=400)
    rec(p, "HEAD", "/v1/vars/w", expect=200)
    rec(p, "HEAD", "/v1/vars/w", headers={"If-None-Match": etag}, expect=304)
    rec(p, "HEAD", "/v1/vars/w", query={"format": "json", "offset": "1"}, expect=200)
    rec(p, "HEAD", "/v1/vars/missing", expect=404)
    rec(p, "HEAD", "/v1/vars/x/", expect=400)

    # stats
    _, _, b = rec(p, "GET", "/v1/vars/w/stats", expect=200)
    assert json.loads(b)["mean"] == 3.5
    _, _, b = rec(p, "GET", "/v1/vars/nf/stats", expect=200)
    s = json.loads(b)
    assert (s["nan_count"], s["inf_count"], s["min"], s["max"]) == (1, 2, 1.5, 1.5)
    _, _, b = rec(p, "GET", "/v1/vars/allnan/stats", expect=200)
    assert json.loads(b)["min"] is None
    rec(p, "GET", "/v1/vars/layer1/b.0/stats", expect=200)
    rec(p, "GET", "/v1/vars/missing/stats", expect=404)
    rec(p, "GET", "/v1/vars/a..b/stats", expect=400)
    rec(p, "HEAD", "/v1/vars/w/stats", expect=200)
    rec(p, "HEAD", "/v1/vars/missing/stats", expect=404)
    rec(p, "HEAD", "/v1/vars/.../stats", expect=400)

    # one variable's gradient
    g = f32(1, 1, 1, 1, 1, 1)
    _, _, b = rec(p, "POST", "/v1/vars/w/grad", body=g, expect=200)
    assert json.loads(b) == {"global_step": 1, "version": 3}
    rec(p, "POST", "/v1/vars/w/grad", body=g, headers={"X-Shape": "2,3"}, expect=200)
    rec(p, "POST", "/v1/vars/w/grad", body=[g[:8], g[8:]], chunked=True, expect=200)
    rec(p, "POST", "/v1/vars/w/grad", body=g, headers={"X-Shape": "3,2"}, expect=400)
    rec(p, "POST", "/v1/vars/w/grad", body=g, headers={"X-Shape": "x"}, expect=400)
    rec(p, "POST", "/v1/vars/w/grad", body=g[:20], expect=400)
    rec(p, "POST", "/v1/vars/w/grad", body=[g[:20]], chunked=True, expect=400)
    rec(p, "POST", "/v1/vars/w/grad", body=f32(1, 1, math.nan, 1, 1, 1), expect=400)
    rec(p, "POST", "/v1/vars/missing/grad", body=g, expect=404)
    rec(p, "POST", "/v1/vars/a..b/grad", body=g, expect=400)
    rec(p, "POST", "/v1/vars/w/grad", headers={"Content-Length": "8000"}, headers_only=True,
        expect=413)

    # bulk: params and grads
    st, h, b = rec(p, "GET", "/v1/params", expect=200)
    meta, tensors = read_safetensors(b)
    assert meta["global_step"] == h["x-global-step"] == "3"
    assert tensors["w"][1] == [2, 3] and tensors["s"][1] == []
    rec(p, "HEAD", "/v1/params", expect=200)
    _, h304, b304 = rec(p, "GET", "/v1/params", headers={"If-None-Match": h["etag"]}, expect=304)
    assert b304 == b"" and h304["etag"] == h["etag"]
    push = safetensors({"w": ("F32", [2, 3], g), "layer1/b.0": ("F32", [3], f32(1, 2, 3))},
                       {"worker": "0", "step": "3", "batch_size": "32", "loss": "0.75"})
    _, _, b = rec(p, "POST", "/v1/grads", body=push, expect=200)
    assert json.loads(b) == {"global_step": 4, "duplicate": False, "outcome": "applied"}
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    assert json.loads(b)["last_loss"] == 0.75 and json.loads(b)["global_step"] == 4
    rec(p, "POST", "/v1/grads", body=push, headers={"X-Push-Id": "w0:step-3.a_1"}, expect=200)
    _, _, b = rec(p, "POST", "/v1/grads", body=push, headers={"X-Push-Id": "w0:step-3.a_1"},
                  expect=200)
    assert json.loads(b)["duplicate"] is True and json.loads(b)["outcome"] == "duplicate"
    rec(p, "POST", "/v1/grads", body=[push[:40], push[40:]], chunked=True, expect=200)
    rec(p, "POST", "/v1/grads", body=safetensors({"s": ("F32", [], f32(1))}), expect=200)
    rec(p, "POST", "/v1/grads", body=push, headers={"X-Push-Id": "bad id"}, expect=400)
    rec(p, "POST", "/v1/grads", body=push, headers={"X-Push-Id": "x" * 65}, expect=400)
    rec(p, "POST", "/v1/grads", body=b"\x01\x02", expect=400)
    rec(p, "POST", "/v1/grads", body=struct.pack("<Q", 8) + b"{nojson}", expect=400)
    rec(p, "POST", "/v1/grads", body=struct.pack("<Q", 999) + b"{}      ", expect=400)
    rec(p, "POST", "/v1/grads", body=safetensors({}), expect=400)
    rec(p, "POST", "/v1/grads", body=safetensors({"nope": ("F32", [1], f32(1))}), expect=400)
    rec(p, "POST", "/v1/grads", body=safetensors({"w": ("F32", [3, 2], g)}), expect=400)
    rec(p, "POST", "/v1/grads", body=safetensors({"w": ("F8_E4M3", [2, 3], b"\0" * 6)}), expect=400)
    rec(p, "POST", "/v1/grads",
        body=safetensors({"w": ("F32", [2, 3], f32(1, 1, 1, math.inf, 1, 1))}), expect=400)
    rec(p, "POST", "/v1/grads", body=safetensors({"w": ("F32", [2, 3], g)}, {"worker": "-1"}),
        expect=400)
    rec(p, "POST", "/v1/grads", body=safetensors({"w": ("F32", [2, 3], g)}, {"step": "3x"}),
        expect=400)
    rec(p, "POST", "/v1/grads", body=safetensors({"w": ("F32", [2, 3], g)}, {"loss": "nan"}),
        expect=400)
    rec(p, "POST", "/v1/grads", headers={"Content-Length": "5000"}, headers_only=True,
        expect=413)
    rec(p, "GET", "/v1/vars", expect=200)

    # a checkpoint of the shard now: the variables, no optimizer state (sgd)
    _, _, params = rec(p, "GET", "/v1/params", expect=200)
    pmeta, ptensors = read_safetensors(params)
    saved, meta, tensors = exercise_checkpoint(rec, p)
    assert saved["global_step"] == int(pmeta["global_step"]) and set(tensors) == set(ptensors)
    assert list(tensors["w"].ravel()) == list(ptensors["w"][2]) and meta["config"] == "null"
    assert json.loads(meta["placement"])["map"] is None, meta  # the chief sent none
    assert json.loads(meta["variables"])["s"]["shape"] == [], meta
    # saved again although nothing changed; a body is ignored
    _, _, b = rec(p, "POST", "/v1/checkpoint", body=b"ignored", expect=200)
    assert json.loads(b)["file"] == saved["file"]
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    assert json.loads(b)["checkpoint"]["saves"] == 2

    # the history: a point per step since the first push with a loss
    _, _, b = rec(p, "GET", "/v1/history", expect=200)
    hist = json.loads(b)
    steps = [pt[0] for pt in hist["points"]]
    assert steps and steps[0] == 4 and steps[-1] == hist["global_step"], hist
    assert steps == sorted(set(steps)) and hist["eval"] == [], hist
    assert all(pt[1] == 0.75 and abs(pt[2] - time.time()) < 60 for pt in hist["points"]), hist
    _, _, b = rec(p, "GET", "/v1/history", query={"since": str(steps[0])}, expect=200)
    assert json.loads(b)["points"] == hist["points"][1:]
    _, _, b = rec(p, "GET", "/v1/history", query={"since": str(steps[-1])}, expect=200)
    assert json.loads(b)["points"] == []
    rec(p, "HEAD", "/v1/history", query={"since": "0"}, expect=200)
    for since in ("x", "-1", "", "1.5", "99999999999999999999"):
        rec(p, "GET", "/v1/history", query={"since": since}, expect=400)
    rec(p, "HEAD", "/v1/history", query={"since": "x"}, expect=400)
    status = exercise_events(rec, p)
    assert status["last_loss"] == 0.75 and status["workers"], status

    # long polls on /v1/params, and their bad arguments
    _, h, _ = rec(p, "GET", "/v1/params", expect=200)
    step = int(h["x-global-step"])
    rec(p, "GET", "/v1/params", query={"min_step": "0"}, expect=200)
    rec(p, "GET", "/v1/params", query={"min_step": str(step), "timeout_ms": "300000"},
        expect=200)  # already there: at once
    _, h, _ = rec(p, "GET", "/v1/params", query={"min_step": str(step + 5), "timeout_ms": "0"},
                  expect=200)
    assert h["x-global-step"] == str(step)
    t0 = time.monotonic()
    _, h, _ = rec(p, "HEAD", "/v1/params", query={"min_step": str(step + 1),
                                                   "timeout_ms": "200"}, expect=200)
    assert h["x-global-step"] == str(step) and time.monotonic() - t0 >= 0.19
    # async: worker changes nothing (the long poll waits for its timeout)
    t0 = time.monotonic()
    _, h, _ = rec(p, "GET", "/v1/params", query={"min_step": str(step + 1),
                                                  "timeout_ms": "200", "worker": "0"},
                  expect=200)
    assert h["x-global-step"] == str(step) and time.monotonic() - t0 >= 0.19
    rec(p, "GET", "/v1/params", query={"worker": "4095"}, expect=200)
    for q in ({"min_step": "-1"}, {"min_step": "x"}, {"min_step": ""}, {"timeout_ms": "300001"},
              {"timeout_ms": "-5"}, {"timeout_ms": "1.5"}, {"worker": "4096"}, {"worker": "-1"},
              {"worker": "x"}, {"worker": ""}, {"worker": "0.5"}):
        rec(p, "GET", "/v1/params", query=q, expect=400)
    rec(p, "HEAD", "/v1/params", query={"min_step": "1e3"}, expect=400)
    rec(p, "HEAD", "/v1/params", query={"worker": "99999"}, expect=400)

    # the training routes before the chief: not ready, no configuration
    rec(p, "GET", "/readyz", expect=503)
    rec(p, "HEAD", "/readyz", expect=503)
    assert json.loads(rec(p, "GET", "/v1/status", expect=200)[2])["evaluator_seen"] is False
    rec(p, "GET", "/readyz", query={"evaluator": "1"}, expect=503)   # an evaluator's poll: noted
    assert json.loads(rec(p, "GET", "/v1/status", expect=200)[2])["evaluator_seen"] is True
    rec(p, "GET", "/readyz", query=[("evaluator", "1"), ("evaluator", "0")], expect=400)
    rec(p, "GET", "/v1/config", expect=404)
    rec(p, "HEAD", "/v1/config", expect=404)
    for bad in ({"optimizer": "adadelta"}, {"optimizer": 1}, {"learning_rate": 0},
                {"learning_rate": "0.1"}, {"momentum": 1}, {"beta1": -0.5}, {"beta2": 1.0},
                {"epsilon": 0}, {"sync": "yes"}, {"workers": 0}, {"workers": 4097},
                {"workers": 1.5}, {"workers": 2, "replicas_to_aggregate": 3},
                {"replicas_to_aggregate": 0}, {"nesterov": True}, [1, 2]):
        rec(p, "PUT", "/v1/config", body=json.dumps(bad).encode(), expect=400)
    rec(p, "PUT", "/v1/config", body=b"{not json", expect=400)
    rec(p, "PUT", "/v1/config", body=b'{"sync":true,"sync":false}', expect=400)
    rec(p, "PUT", "/v1/config", headers={"Content-Length": "5000"}, headers_only=True,
        expect=413)
    # pushes happened, but nobody configured training yet: the chief may
    _, _, b = rec(p, "PUT", "/v1/config", body=b"{}", expect=200)
    assert json.loads(b) == {"optimizer": "sgd", "learning_rate": json.loads(b)["learning_rate"],
                             "sync": False, "replicas_to_aggregate": 1, "workers": 1}
    rec(p, "GET", "/readyz", expect=200)
    rec(p, "POST", "/v1/eval", headers={"Content-Length": "5000"}, headers_only=True,
        expect=413)
    rec(p, "POST", "/v1/done", headers={"Content-Length": "5000"}, headers_only=True,
        expect=413)
    rec(p, "POST", "/v1/heartbeat", headers={"Content-Length": "5000"}, headers_only=True,
        expect=413)
    rec(p, "PUT", "/v1/placement", headers={"Content-Length": "5000"}, headers_only=True,
        expect=413)

    # paths no route has, and methods a path does not answer
    for path in ("/index.html", "/nope", "/v1", "/v1/", "/v1/var/w", "/healthz/",
                 "/v1/params/x", "/app.js/", "/web/style.css", "/v1/events/x",
                 "/v1/checkpoint/x", "/v1/checkpoints", "/v1/sync/x", "/v1/heartbeats",
                 "/v1/placement/x", "/v1/placements"):
        rec(p, "GET", path, expect=404)
    rec(p, "POST", "/v1/nope", body=b"x", expect=404)
    rec(p, "HEAD", "/nope", expect=404)
    for method, path in (("POST", "/healthz"), ("DELETE", "/v1/vars/w"), ("PUT", "/v1/vars"),
                         ("GET", "/v1/grads"), ("HEAD", "/v1/grads"), ("PATCH", "/v1/params"),
                         ("POST", "/v1/vars/w/stats"), ("GET", "/v1/vars/w/grad"),
                         ("OPTIONS", "/v1/status"), ("DELETE", "/v1/vars/a..b"),
                         ("POST", "/readyz"), ("DELETE", "/v1/config"), ("POST", "/v1/config"),
                         ("GET", "/v1/eval"), ("PUT", "/v1/done"), ("GET", "/v1/shutdown"),
                         ("HEAD", "/v1/shutdown"), ("POST", "/"), ("PUT", "/app.js"),
                         ("DELETE", "/style.css"), ("POST", "/v1/events"),
                         ("DELETE", "/v1/history"), ("POST", "/metrics"),
                         ("DELETE", "/v1/checkpoint"), ("PUT", "/v1/checkpoint"),
                         ("POST", "/v1/sync"), ("GET", "/v1/heartbeat"),
                         ("HEAD", "/v1/heartbeat"), ("PUT", "/v1/heartbeat"),
                         ("POST", "/v1/placement"), ("DELETE", "/v1/placement")):
        rec(p, method, path, expect=405)


# The map exercise_training's chief sends: w [2] and b [1] on the one ps task.
TRAINING_MAP = placement_map([("w", [2]), ("b", [1])])
# What that ps task holds: GET /v1/placement's this_ps.
TRAINING_THIS_PS = {"task": 0, "variables": 2, "bytes": 12}


def exercise_placement(rec, p):
    """PUT and GET /v1/placement on a shard holding w [2] and b [1]: 404
    before the chief sent a map; bad bodies (400) and a map for another
    number of ps tasks (409) change nothing; a map is kept as sent (other
    keys too), replaced by the next, and answered with this_ps."""
    _, h, b = rec(p, "GET", "/v1/placement", expect=404)
    assert error_of(b) == "no placement yet: the chief sends it" and \
        h["cache-control"] == "no-store", (h, b)
    shape_error = "placement must be an object with policy, ps_tasks and variables"
    m = TRAINING_MAP
    for bad in ({}, {"policy": "bytes", "ps_tasks": 1}, {"ps_tasks": 1, "variables": []},
                {"policy": "bytes", "variables": []}, dict(m, policy=1), dict(m, policy=None),
                dict(m, ps_tasks="1"), dict(m, ps_tasks=1.0), dict(m, ps_tasks=True),
                dict(m, variables={}), dict(m, variables="w")):
        _, _, out = rec(p, "PUT", "/v1/placement", body=json.dumps(bad).encode(), expect=400)
        assert error_of(out) == shape_error, (bad, out)
    # (jansson reads an object or an array only: a bare scalar is "not JSON")
    for bad in (b"{not json", b"", b'{"policy": "bytes", "policy": "x"}', b'"bytes"', b"1"):
        _, _, out = rec(p, "PUT", "/v1/placement", body=bad, expect=400)
        assert error_of(out).startswith("body is not JSON: "), (bad, out)
    for bad in (b"[1]", b"[]"):
        _, _, out = rec(p, "PUT", "/v1/placement", body=bad, expect=400)
        assert error_of(out) == "body must be a JSON object", (bad, out)
    for n in (2, 0, -1):
        _, _, out = rec(p, "PUT", "/v1/placement", body=json.dumps(dict(m, ps_tasks=n)).encode(),
                        expect=409)
        assert error_of(out) == f"placement is for {n} ps tasks, this cluster has 1", out
    rec(p, "GET", "/v1/placement", expect=404)  # nothing was kept
    rec(p, "HEAD", "/v1/placement", expect=404)
    # a map is kept as sent, with keys psd does not know; answered as GET answers
    other = dict(placement_map([("w", [2]), ("b", [1])], "round_robin"), note="x")
    _, h, b = rec(p, "PUT", "/v1/placement", body=json.dumps(other).encode(),
                  headers={"Content-Type": "application/json"}, expect=200)
    assert json.loads(b) == dict(other, this_ps=TRAINING_THIS_PS) and \
        h["cache-control"] == "no-store", (h, b)
    _, _, b = rec(p, "GET", "/v1/placement", expect=200)
    assert json.loads(b) == dict(other, this_ps=TRAINING_THIS_PS), b
    # the next replaces it; this_ps is psd's, whatever the chief sent
    _, _, b = rec(p, "PUT", "/v1/placement", expect=200,
                  body=json.dumps(dict(m, this_ps={"task": 7})).encode())
    assert json.loads(b) == dict(m, this_ps=TRAINING_THIS_PS), b
    _, _, b = rec(p, "PUT", "/v1/placement", body=json.dumps(m).encode(), expect=200)
    assert json.loads(b) == dict(m, this_ps=TRAINING_THIS_PS), b
    _, h, b = rec(p, "GET", "/v1/placement", expect=200)
    assert json.loads(b) == dict(m, this_ps=TRAINING_THIS_PS) and \
        h["cache-control"] == "no-store", (h, b)
    _, h, b = rec(p, "HEAD", "/v1/placement", expect=200)
    assert b == b"" and h["content-type"] == "application/json", h
    # refusals leave the map alone
    rec(p, "PUT", "/v1/placement", body=json.dumps(dict(m, ps_tasks=3)).encode(), expect=409)
    rec(p, "PUT", "/v1/placement", body=b"{}", expect=400)
    _, _, b = rec(p, "GET", "/v1/placement", expect=200)
    assert json.loads(b) == dict(m, this_ps=TRAINING_THIS_PS), b


def long_poll_in_thread(rec, p, query):
    """Start GET /v1/params with query in a thread; returns join() -> (status, headers, secs)."""
    out = {}

    def run():
        t0 = time.monotonic()
        st, h, _ = rec(p, "GET", "/v1/params", query=query)
        out["r"] = (st, h, time.monotonic() - t0)

    th = threading.Thread(target=run)
    th.start()

    def join():
        th.join(15)
        assert not th.is_alive(), "the long poll was never answered"
        return out["r"]
    return join


def wait_for_waiting_pulls(p, n):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=5)
        conn.request("GET", "/v1/status")
        s = json.loads(conn.getresponse().read())
        conn.close()
        if s["waiting_pulls"] == n:
            return s
        time.sleep(0.01)
    raise AssertionError(f"waiting_pulls never reached {n}")


def exercise_training(rec, p):
    """The training routes on a psd of its own: configuration, sync pushes in
    each outcome, long polls answered by a step and by their timeout, the
    evaluator, done, and shutdown at the end (which stops this psd)."""
    rec(p, "GET", "/readyz", expect=503)
    rec(p, "GET", "/v1/config", expect=404)
    rec(p, "PUT", "/v1/vars/w", body=f32(1, 2), headers={"X-Shape": "2"}, expect=201)
    rec(p, "PUT", "/v1/vars/b", body=f32(0.5), headers={"X-Shape": "1"}, expect=201)
    exercise_placement(rec, p)
    # every optimizer's configuration, while training has not started
    _, _, b = rec(p, "PUT", "/v1/config", body=b'{"optimizer":"adam","learning_rate":0.5}',
                  expect=200)
    assert json.loads(b) == {"optimizer": "adam", "learning_rate": 0.5, "sync": False,
                             "replicas_to_aggregate": 1, "workers": 1, "beta1": 0.8999999762,
                             "beta2": 0.9990000129, "epsilon": 9.999999939e-9}
    rec(p, "GET", "/v1/config", expect=200)
    cfg = {"optimizer": "momentum", "learning_rate": 0.5, "momentum": 0.5, "sync": True,
           "workers": 2, "replicas_to_aggregate": 2}
    _, _, b = rec(p, "PUT", "/v1/config", body=json.dumps(cfg).encode(), expect=200)
    assert json.loads(b) == cfg
    _, _, b = rec(p, "GET", "/v1/config", expect=200)
    assert json.loads(b) == cfg
    rec(p, "HEAD", "/v1/config", expect=200)
    _, _, b = rec(p, "GET", "/readyz", expect=200)
    assert json.loads(b) == {"status": "ready"}
    rec(p, "HEAD", "/readyz", expect=200)
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    s = json.loads(b)
    assert (s["ready"], s["mode"], s["optimizer"], s["waiting_for"], s["replicas_to_aggregate"]) \
        == (True, "sync", "momentum", [0, 1], 2)

    # sync: one-variable gradients are refused, pushes need worker and step
    rec(p, "POST", "/v1/vars/w/grad", body=f32(1, 1), expect=409)
    g = safetensors({"w": ("F32", [2], f32(1, 1))})
    rec(p, "POST", "/v1/grads", body=g, expect=400)
    rec(p, "POST", "/v1/grads",
        body=safetensors({"w": ("F32", [2], f32(1, 1))}, {"worker": "0", "step": "1"}),
        expect=409)  # a step the shard has not reached

    def push(worker, step, *w):
        return rec(p, "POST", "/v1/grads", body=safetensors(
            {"w": ("F32", [2], f32(*w))}, {"worker": str(worker), "step": str(step)}))

    st, _, b = push(0, 0, 2, 4)
    assert st == 200 and json.loads(b) == {"global_step": 0, "duplicate": False,
                                           "outcome": "pending"}
    st, _, b = push(0, 0, 2, 4)
    assert st == 200 and json.loads(b) == {"global_step": 0, "duplicate": True,
                                           "outcome": "duplicate"}
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    assert json.loads(b)["pending_gradients"] == 1
    # a long poll for step 1, answered by the push that completes step 0
    join = long_poll_in_thread(rec, p, {"min_step": "1", "timeout_ms": "10000"})
    wait_for_waiting_pulls(p, 1)
    rec(p, "GET", "/v1/status", expect=200)  # recorded with waiting_pulls 1
    st, _, b = push(1, 0, 4, 8)
    assert st == 200 and json.loads(b) == {"global_step": 1, "duplicate": False,
                                           "outcome": "applied"}
    st, h, secs = join()
    assert st == 200 and h["x-global-step"] == "1" and secs < 5
    _, _, b = rec(p, "GET", "/v1/vars/w", query={"format": "json"}, expect=200)
    # momentum: a = 0*0.5 + mean(g) = [3, 6]; w -= 0.5 * a
    assert json.loads(b)["values"] == [1 - 1.5, 2 - 3]
    st, _, b = push(0, 0, 1, 1)
    assert st == 200 and json.loads(b) == {"global_step": 1, "duplicate": False,
                                           "outcome": "stale"}
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    s = json.loads(b)
    assert (s["stale_dropped"], s["pending_gradients"], s["waiting_pulls"]) == (1, 0, 0)
    # a long poll answered by its timeout, with the step it has
    t0 = time.monotonic()
    _, h, _ = rec(p, "GET", "/v1/params", query={"min_step": "2", "timeout_ms": "300"},
                  expect=200)
    assert h["x-global-step"] == "1" and 0.29 <= time.monotonic() - t0 < 3

    # training started: another configuration is refused, the same one is fine
    rec(p, "PUT", "/v1/config", body=json.dumps(dict(cfg, learning_rate=0.25)).encode(),
        expect=409)
    rec(p, "PUT", "/v1/config", body=json.dumps(cfg).encode(), expect=200)

    # a checkpoint holds the configuration and the optimizer's state
    saved, meta, tensors = exercise_checkpoint(rec, p)
    config = json.loads(meta["config"])
    assert saved["global_step"] == 1 and {k: config[k] for k in cfg} == cfg, meta
    assert json.loads(meta["variables"])["w"]["slots"] == ["momentum"], meta
    assert json.loads(meta["variables"])["w"]["shape"] == [2], meta
    assert json.loads(meta["placement"]) == {"ps_task": 0, "ps_tasks": 1, "variables": ["b", "w"],
                                             "map": TRAINING_MAP}, meta
    assert list(tensors["w:momentum"].ravel()) == [3, 6], tensors

    # the evaluator
    _, _, b = rec(p, "POST", "/v1/eval", body=json.dumps(
        {"loss": 0.5, "accuracy": 0.75, "global_step": 1, "examples": 10000}).encode(),
        expect=200)
    assert json.loads(b) == {"status": "recorded"}
    rec(p, "POST", "/v1/eval", body=b'{"loss":0.25,"accuracy":1}', expect=200)
    for bad in ({"loss": -1, "accuracy": 0.5}, {"loss": 1, "accuracy": 1.5}, {"loss": 1},
                {"accuracy": 0.5}, {"loss": "1", "accuracy": 0.5},
                {"loss": 1, "accuracy": 0.5, "global_step": -1}, [0.5]):
        rec(p, "POST", "/v1/eval", body=json.dumps(bad).encode(), expect=400)
    rec(p, "POST", "/v1/eval", body=b"", expect=400)
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    assert json.loads(b)["eval"] == {"global_step": 0, "loss": 0.25, "accuracy": 1,
                                     "examples": 0}
    # the history keeps the report for step 1; the one for step 0 is older
    _, _, b = rec(p, "GET", "/v1/history", expect=200)
    hist = json.loads(b)
    assert [e[:3] for e in hist["eval"]] == [[1, 0.5, 0.75]] and hist["points"] == [], hist
    exercise_events(rec, p)

    # workers finishing: each index counted once
    for worker, want in ((0, 1), (0, 1), (1, 2)):
        _, _, b = rec(p, "POST", "/v1/done", body=json.dumps({"worker": worker}).encode(),
                      expect=200)
        assert json.loads(b) == {"workers_done": want}
    for bad in ({"worker": -1}, {"worker": "0"}, {"worker": 4096}, {"worker": 0.5}, {}, [0]):
        rec(p, "POST", "/v1/done", body=json.dumps(bad).encode(), expect=400)
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    assert json.loads(b)["workers_done"] == 2

    # the end: a long poll still waiting is answered, psd exits 0
    join = long_poll_in_thread(rec, p, {"min_step": "9", "timeout_ms": "60000"})
    wait_for_waiting_pulls(p, 1)
    _, _, b = rec(p, "POST", "/v1/shutdown", expect=202)
    assert json.loads(b) == {"status": "stopping"}
    st, h, _ = join()
    assert st == 200 and h["x-global-step"] == "1"
    assert p.proc.wait(timeout=10) == 0


def without_clocks(sync):
    """A /v1/sync object without the fields that move with the clock."""
    return {k: v for k, v in sync.items() if k not in ("step_secs", "waiting_secs")}


def get_sync(p):
    """GET /v1/sync, not recorded (for polling)."""
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=5)
    try:
        conn.request("GET", "/v1/sync")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def exercise_sync(rec, p):
    """GET /v1/sync and POST /v1/heartbeat through a sync step with two
    workers: one pushes, the other leaves (POST /v1/done) and the step
    completes without it; a heartbeat brings it back."""
    _, _, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert (sy["mode"], sy["workers"], sy["have"], sy["waiting_for"]) == \
        ("async", 1, [], []), sy
    rec(p, "PUT", "/v1/vars/w", body=f32(1, 2), headers={"X-Shape": "2"}, expect=201)
    _, _, b = rec(p, "PUT", "/v1/config", body=b'{"sync":true,"workers":2}', expect=200)
    assert json.loads(b)["replicas_to_aggregate"] == 2
    # configured: both workers have a lease, the step waits for both
    _, _, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert without_clocks(sy) == {
        "mode": "sync", "global_step": 0, "workers": 2, "replicas_to_aggregate": 2,
        "live_workers": 2, "needed": 2, "have": [], "waiting_for": [0, 1], "dead": [],
        "left": [], "lease_secs": 10}, sy
    assert sy["step_secs"] >= 0 and sy["waiting_secs"] == 0, sy
    rec(p, "HEAD", "/v1/sync", expect=200)

    # heartbeats: {"worker": index}, other keys ignored; anything else is 400
    _, h, b = rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 1}', expect=200)
    assert json.loads(b) == {"global_step": 0, "lease_secs": 10} and \
        h["cache-control"] == "no-store", (h, b)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 0, "step": 0}',
        headers={"Content-Type": "application/json"}, expect=200)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 4095}', expect=200)  # not of the run
    for bad in (b'{"worker": -1}', b'{"worker": 4096}', b'{"worker": 0.5}', b'{"worker": 1.0}',
                b'{"worker": "1"}', b'{"worker": true}', b'{"worker": null}', b"{}",
                b'{"step": 0}', b"[0]", b"0", b"", b"{not json", b'{"worker": 1',
                b'{"worker": 0, "worker": 1}'):
        _, _, out = rec(p, "POST", "/v1/heartbeat", body=bad, expect=400)
        assert json.loads(out) == {"error": 'body must be {"worker": index}'}, (bad, out)
    assert without_clocks(get_sync(p)) == without_clocks(sy), "a heartbeat changed the step"
    # a heartbeat's step spans: GET /v1/timeline gives them back on psd's clock; a bad one is 400
    _, _, b = rec(p, "GET", "/v1/timeline", expect=200)
    assert json.loads(b)["workers"] == [], b
    spans = [["pull", 0, -9.5, -8.0], ["wait", 0, -8.0, -3.0, "the step's gradients"], ["compute", 0, -3.0, -1.0]]
    rec(p, "POST", "/v1/heartbeat", body=json.dumps({"worker": 1, "timeline": spans}).encode(), expect=200)
    _, _, b = rec(p, "GET", "/v1/timeline", query={"secs": "60"}, expect=200)
    tl = json.loads(b)
    assert [w["worker"] for w in tl["workers"]] == [1] and tl["secs"] == 60, tl
    assert [(s["kind"], s.get("for")) for s in tl["workers"][0]["spans"]] == \
        [("pull", None), ("wait", "the step's gradients"), ("compute", None)], tl
    rec(p, "HEAD", "/v1/timeline", expect=200)
    rec(p, "GET", "/v1/timeline", query={"secs": "0"}, expect=400)
    rec(p, "HEAD", "/v1/timeline", query={"secs": "601"}, expect=400)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 1, "timeline": [["nap", 0, -2, -1]]}', expect=400)
    # a task id held by one process (instance): another is 409, the holder's last beat frees it
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 7, "instance": "pid-1@a/0"}', expect=200)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 7, "instance": "pid-2@b/0"}', expect=409)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 7, "instance": "a b"}', expect=400)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 7, "instance": "pid-1@a/0", "leaving": true}', expect=200)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 7, "instance": "pid-2@b/0", "leaving": true}', expect=200)

    # worker 0 pushed: the step has its gradient and waits for worker 1
    _, _, b = rec(p, "POST", "/v1/grads", body=safetensors(
        {"w": ("F32", [2], f32(2, 4))}, {"worker": "0", "step": "0"}), expect=200)
    assert json.loads(b)["outcome"] == "pending"
    _, _, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert (sy["global_step"], sy["live_workers"], sy["needed"], sy["have"], sy["waiting_for"],
            sy["dead"], sy["left"]) == (0, 2, 2, [0], [1], [], []), sy
    assert 0 <= sy["waiting_secs"] <= sy["step_secs"], sy
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    s = json.loads(b)
    assert without_clocks(s["sync"]) == without_clocks(sy), (s["sync"], sy)
    assert s["waiting_for"] == [1] and s["pending_gradients"] == 1, s

    # worker 1 leaves: the step completes without it, worker 0's long poll is answered
    join = long_poll_in_thread(rec, p, {"min_step": "1", "timeout_ms": "10000", "worker": "0"})
    wait_for_waiting_pulls(p, 1)
    t0 = time.monotonic()
    _, _, b = rec(p, "POST", "/v1/done", body=b'{"worker": 1}', expect=200)
    assert json.loads(b) == {"workers_done": 1}
    while get_sync(p)["global_step"] != 1 and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert time.monotonic() - t0 < 0.3, "the step did not complete when worker 1 left"
    st, h, _ = join()
    assert st == 200 and h["x-global-step"] == "1", (st, h)
    _, _, b = rec(p, "GET", "/v1/vars/w", query={"format": "json"}, expect=200)
    # sgd (learning_rate 0.01) with worker 0's gradient alone
    assert json.loads(b)["values"] == pytest.approx([1 - 0.01 * 2, 2 - 0.01 * 4], abs=1e-6), b
    _, _, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert (sy["global_step"], sy["live_workers"], sy["needed"], sy["have"], sy["waiting_for"],
            sy["dead"], sy["left"], sy["waiting_secs"]) == (1, 1, 1, [], [0], [], [1], 0), sy
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    s = json.loads(b)
    assert s["sync"]["left"] == [1] and s["workers_done"] == 1, s

    # its next request makes it count again
    _, _, b = rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 1}', expect=200)
    assert json.loads(b) == {"global_step": 1, "lease_secs": 10}
    _, _, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert (sy["live_workers"], sy["needed"], sy["waiting_for"], sy["left"]) == \
        (2, 2, [0, 1], []), sy


def exercise_leases(rec, p):
    """--worker_lease_secs=1: a worker not heard from for a second is dead and
    no longer holds up a step; a long poll naming it makes it live again."""
    rec(p, "PUT", "/v1/vars/w", body=f32(1, 2), headers={"X-Shape": "2"}, expect=201)
    rec(p, "PUT", "/v1/config", body=b'{"sync":true,"workers":2}', expect=200)
    _, _, b = rec(p, "POST", "/v1/heartbeat", body=b'{"worker": 0}', expect=200)
    assert json.loads(b) == {"global_step": 0, "lease_secs": 1}
    # worker 0 keeps its lease with heartbeats (not recorded); worker 1's runs out
    deadline = time.monotonic() + 5
    while get_sync(p)["dead"] != [1]:
        assert time.monotonic() < deadline, get_sync(p)
        conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=5)
        conn.request("POST", "/v1/heartbeat", body=b'{"worker": 0}')
        assert conn.getresponse().status == 200
        conn.close()
        time.sleep(0.1)
    _, _, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert (sy["lease_secs"], sy["live_workers"], sy["needed"], sy["waiting_for"], sy["dead"]) \
        == (1, 1, 1, [0], [1]), sy
    # one live worker: its push is the whole step
    _, _, b = rec(p, "POST", "/v1/grads", body=safetensors(
        {"w": ("F32", [2], f32(1, 1))}, {"worker": "0", "step": "0"}), expect=200)
    assert json.loads(b) == {"global_step": 1, "duplicate": False, "outcome": "applied"}
    # nobody heard from: both dead, a step would need one gradient
    while get_sync(p)["dead"] != [0, 1]:
        assert time.monotonic() < deadline + 5, get_sync(p)
        time.sleep(0.05)
    _, _, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert (sy["global_step"], sy["live_workers"], sy["needed"], sy["waiting_for"],
            sy["dead"]) == (1, 0, 1, [], [0, 1]), sy
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    s = json.loads(b)
    # the step waits for no one: dead workers are not in waiting_for
    assert s["sync"]["dead"] == [0, 1] and s["waiting_for"] == s["sync"]["waiting_for"] == [], s
    # a long poll that names worker 1 renews its lease
    rec(p, "GET", "/v1/params", query={"timeout_ms": "0", "worker": "1"}, expect=200)
    _, _, b = rec(p, "GET", "/v1/sync", expect=200)
    sy = json.loads(b)
    assert (sy["live_workers"], sy["waiting_for"], sy["dead"]) == (1, [1], [0]), sy


STALENESS_LE = ["0", "1", "2", "3", "7", "15", "31", "63", "+Inf"]


def staleness_of(rec, p):
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    return json.loads(b)["staleness"]


def exercise_staleness(rec, p):
    """Async staleness on a psd of its own: the bounds in the configuration,
    the histogram of applied updates, pushes dropped past max_staleness,
    and the stale-synchronous clocks (pushes' `clock`, long polls with
    min_clock and clock)."""
    st = staleness_of(rec, p)
    assert st == {"count": 0, "mean": 0, "max": 0, "max_staleness": -1, "bound": -1,
                  "buckets": [{"le": le, "count": 0} for le in STALENESS_LE],
                  "clocks": {"0": {"started": 0, "done": 0}}}, st
    rec(p, "PUT", "/v1/vars/w", body=f32(1, 2), headers={"X-Shape": "2"}, expect=201)
    for key in ("max_staleness", "staleness"):
        for bad in (-2, 1000001, 1.5, "1", True, [1]):
            _, _, out = rec(p, "PUT", "/v1/config", body=json.dumps({key: bad}).encode(),
                            expect=400)
            assert error_of(out) == f"{key} must be an integer from 0 to 1000000 " \
                "(or -1 or null: no limit)", (key, bad, out)
    # -1 and null: no bound, left out of the answer
    base = {"optimizer": "sgd", "learning_rate": 0.009999999776, "sync": False,
            "workers": 2, "replicas_to_aggregate": 2}
    _, _, b = rec(p, "PUT", "/v1/config", expect=200,
                  body=b'{"workers": 2, "max_staleness": -1, "staleness": null}')
    assert json.loads(b) == base, b
    _, _, b = rec(p, "PUT", "/v1/config", expect=200,
                  body=b'{"workers": 2, "max_staleness": 2, "staleness": 1}')
    assert json.loads(b) == dict(base, max_staleness=2, staleness=1), b
    _, _, b = rec(p, "GET", "/v1/config", expect=200)
    assert json.loads(b) == dict(base, max_staleness=2, staleness=1), b
    st = staleness_of(rec, p)
    assert (st["max_staleness"], st["bound"], st["clocks"]) == \
        (2, 1, {"0": {"started": 0, "done": 0}, "1": {"started": 0, "done": 0}}), st

    def push(**meta):
        _, _, out = rec(p, "POST", "/v1/grads", expect=200, body=safetensors(
            {"w": ("F32", [2], f32(1, 1))}, {k: str(v) for k, v in meta.items()}))
        return json.loads(out)

    # staleness = global_step when applied - step: 0, 1, 2, then 3 > 2 is dropped
    assert push(worker=0, step=0, clock=0) == \
        {"global_step": 1, "duplicate": False, "outcome": "applied"}
    assert push(worker=1, step=0, clock=0)["outcome"] == "applied"
    assert push(worker=1, step=0, clock=1)["outcome"] == "applied"
    assert push(worker=1, step=0, clock=2) == \
        {"global_step": 3, "duplicate": False, "outcome": "stale"}
    assert push(worker=1, step=9)["outcome"] == "applied"  # ahead of the shard: 0
    assert push(worker=0)["outcome"] == "applied"  # no step: not counted
    for key in ("worker", "step", "batch_size", "clock"):
        for bad in ("-1", "x", "", "1.5"):
            _, _, out = rec(p, "POST", "/v1/grads", expect=400, body=safetensors(
                {"w": ("F32", [2], f32(1, 1))}, {key: bad}))
            assert error_of(out) == "metadata worker, step, batch_size and clock must be " \
                "non-negative integers", (key, bad, out)
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    s = json.loads(b)
    st = s["staleness"]
    assert (st["count"], st["mean"], st["max"]) == (4, 0.75, 2), st
    assert [bk["count"] for bk in st["buckets"]] == [2, 1, 1, 0, 0, 0, 0, 0, 0], st
    assert [bk["le"] for bk in st["buckets"]] == STALENESS_LE, st
    # the dropped push completed its iteration too (its gradient was dropped)
    assert st["clocks"] == {"0": {"started": 0, "done": 1}, "1": {"started": 0, "done": 3}}, st
    assert (s["stale_dropped"], s["global_step"]) == (1, 5), s
    assert [w["stale_dropped"] for w in s["workers"]] == [0, 1], s

    # min_clock: worker 0 (done 1) is the slowest
    rec(p, "GET", "/v1/params", query={"min_clock": "1", "timeout_ms": "10000"}, expect=200)
    t0 = time.monotonic()
    _, h, _ = rec(p, "GET", "/v1/params", query={"min_clock": "2", "timeout_ms": "300",
                                                  "worker": "1", "clock": "2"}, expect=200)
    assert h["x-global-step"] == "5" and 0.29 <= time.monotonic() - t0 < 3
    st = staleness_of(rec, p)
    assert st["clocks"]["1"] == {"started": 2, "done": 3}, st
    rec(p, "HEAD", "/v1/params", query={"min_clock": "5", "timeout_ms": "0", "worker": "0",
                                        "clock": "1"}, expect=200)
    rec(p, "GET", "/v1/params", query={"clock": "7"}, expect=200)  # without worker: ignored
    st = staleness_of(rec, p)
    assert st["clocks"] == {"0": {"started": 1, "done": 1}, "1": {"started": 2, "done": 3}}, st
    # a long poll for clock 2, answered when worker 0 completes its iteration 1
    join = long_poll_in_thread(rec, p, {"min_clock": "2", "timeout_ms": "10000", "worker": "1",
                                        "clock": "3"})
    time.sleep(0.2)
    assert push(worker=0, step=5, clock=1)["outcome"] == "applied"
    status, h, secs = join()
    assert status == 200 and h["x-global-step"] == "6" and secs < 5, (status, h, secs)
    st = staleness_of(rec, p)
    assert st["clocks"] == {"0": {"started": 1, "done": 2}, "1": {"started": 3, "done": 3}}, st
    for q in ({"min_clock": "-1"}, {"min_clock": "x"}, {"min_clock": ""}, {"clock": "1.5"},
              {"clock": "-2", "worker": "0"}, {"min_clock": "99999999999999999999"}):
        _, _, out = rec(p, "GET", "/v1/params", query=q, expect=400)
        assert error_of(out) == "min_clock and clock must be non-negative integers", (q, out)
    rec(p, "HEAD", "/v1/params", query={"clock": "x"}, expect=400)
    exercise_events(rec, p)


def exercise_restart(rec, p):
    """A psd started on exercise_training's --logdir: it restored the
    checkpoint written at the stop (step 1, sync, two workers), but not the
    gradients pending then. A worker's long poll for the next step with
    `worker` is answered at once while the shard holds no gradient of its."""
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    s = json.loads(b)
    ck = s["checkpoint"]
    assert (s["global_step"], s["mode"], s["ready"], s["pending_gradients"]) == \
        (1, "sync", True, 0), s
    assert ck["restored_from"]["global_step"] == 1 and ck["saves"] == 0, ck
    assert ck["last"]["file"] == ck["restored_from"]["file"], ck
    # the chief's placement map came back with it
    _, _, b = rec(p, "GET", "/v1/placement", expect=200)
    assert json.loads(b) == dict(TRAINING_MAP, this_ps=TRAINING_THIS_PS), b
    _, h, _ = rec(p, "GET", "/v1/checkpoint", expect=200)
    assert h["x-global-step"] == "1" and ck["last"]["file"].endswith("/" + h["x-checkpoint"])
    t0 = time.monotonic()
    _, h, _ = rec(p, "GET", "/v1/params", query={"min_step": "2", "timeout_ms": "10000",
                                                  "worker": "0"}, expect=200)
    assert h["x-global-step"] == "1" and time.monotonic() - t0 < 5
    _, _, b = rec(p, "POST", "/v1/grads", body=safetensors(
        {"w": ("F32", [2], f32(1, 1))}, {"worker": "0", "step": "1"}), expect=200)
    assert json.loads(b)["outcome"] == "pending"
    # worker 0's gradient is there again: its poll waits (here, for its timeout)
    t0 = time.monotonic()
    _, h, _ = rec(p, "GET", "/v1/params", query={"min_step": "2", "timeout_ms": "300",
                                                  "worker": "0"}, expect=200)
    assert h["x-global-step"] == "1" and 0.29 <= time.monotonic() - t0 < 3
    # worker 1's is not
    t0 = time.monotonic()
    _, h, _ = rec(p, "HEAD", "/v1/params", query={"min_step": "2", "timeout_ms": "10000",
                                                   "worker": "1"}, expect=200)
    assert h["x-global-step"] == "1" and time.monotonic() - t0 < 5


def exercise_no_checkpoints(rec, p):
    """--logdir= (empty): no checkpoints; GET says 404, POST 409."""
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    assert json.loads(b)["checkpoint"] is None
    rec(p, "GET", "/v1/checkpoint", expect=404)
    rec(p, "HEAD", "/v1/checkpoint", expect=404)
    rec(p, "POST", "/v1/checkpoint", expect=409)
    _, _, b = rec(p, "GET", "/metrics", expect=200)
    assert b"restps_checkpoint" not in b


def exercise_checkpoint_failure(rec, p):
    """A --logdir that cannot be created (a file is in its place): the save
    fails with 500, is counted, and psd serves on."""
    _, _, b = rec(p, "POST", "/v1/checkpoint", expect=500)
    error = json.loads(b)["error"]
    assert error.endswith("(the previous checkpoint is intact)"), error
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    ck = json.loads(b)["checkpoint"]
    assert (ck["saves"], ck["failures"], ck["consecutive_failures"], ck["last"]) == \
        (0, 1, 1, None), ck
    assert error == f"checkpoint failed: {ck['last_error']['message']} " \
        "(the previous checkpoint is intact)", ck
    rec(p, "GET", "/v1/checkpoint", expect=404)
    _, _, b = rec(p, "GET", "/metrics", expect=200)
    assert b"\nrestps_checkpoint_failures_total 1\n" in b and \
        b"restps_checkpoint_age_seconds" not in b, b


def exercise_wire(rec, p):
    """16-bit bodies and the push that returns the parameters (issue 33)."""
    rec(p, "PUT", "/v1/vars/w", body=f32(1, 2, 3, 4, 5, 6), headers={"X-Shape": "2,3"}, expect=201)
    _, _, b = rec(p, "GET", "/v1/params", query={"dtype": "bf16"}, expect=200)
    assert read_safetensors(b)[1]["w"][0] == "BF16"
    rec(p, "GET", "/v1/params", query={"dtype": "fp16"}, expect=200)
    rec(p, "GET", "/v1/params", query={"dtype": "int8"}, expect=400)
    one16 = struct.pack("<6H", *([0x3C00] * 6))
    rec(p, "POST", "/v1/grads", body=safetensors({"w": ("F16", [2, 3], one16)}, {"loss_scale": "2"}), expect=200)
    rec(p, "POST", "/v1/grads", body=safetensors({"w": ("BF16", [2, 3], struct.pack("<6H", *([0x7F80] * 6)))}),
        expect=400)
    rec(p, "POST", "/v1/grads", body=safetensors({"w": ("F16", [2, 3], one16)}, {"loss_scale": "3"}), expect=400)
    _, h, b = rec(p, "POST", "/v1/grads", query={"return": "params"},
                  body=safetensors({"w": ("F32", [2, 3], f32(0, 0, 0, 0, 0, 0))}), expect=200)
    assert h["x-push-outcome"] == "applied" and read_safetensors(b)[0]["outcome"] == "applied"
    rec(p, "POST", "/v1/grads", query={"return": "params", "dtype": "bf16", "min_step": "0", "timeout_ms": "0"},
        body=safetensors({"w": ("F32", [2, 3], f32(0, 0, 0, 0, 0, 0))}), expect=200)
    rec(p, "POST", "/v1/grads", query={"return": "vars"},
        body=safetensors({"w": ("F32", [2, 3], f32(0, 0, 0, 0, 0, 0))}), expect=400)
    rec(p, "PUT", "/v1/vars/big", body=f32(1e5), headers={"X-Shape": "1"}, expect=201)
    rec(p, "GET", "/v1/params", query={"dtype": "fp16"}, expect=409)


def exercise_sparse(rec, p):
    """Row-sparse variables (issue 34), on a psd with --max_body_bytes=4096."""
    decl = json.dumps({"rows": 0, "dim": 2, "init": "uniform", "seed": 3}).encode()
    rec(p, "PUT", "/v1/vars/emb/sparse", body=decl, expect=201)
    rec(p, "PUT", "/v1/vars/emb/sparse", body=decl, expect=200)
    rec(p, "PUT", "/v1/vars/emb/sparse", body=b'{"rows":0,"dim":3}', expect=409)
    rec(p, "PUT", "/v1/vars/dense", body=f32(1, 2), headers={"X-Shape": "2"}, expect=201)
    rec(p, "PUT", "/v1/vars/dense/sparse", body=b'{"rows":0,"dim":2}', expect=409)
    rec(p, "PUT", "/v1/vars/emb", body=f32(1, 2), headers={"X-Shape": "2"}, expect=409)  # a sparse one's name
    rec(p, "PUT", "/v1/vars/z/sparse", body=b'{"rows":0}', expect=400)
    rec(p, "PUT", "/v1/vars/z/sparse", body=b'{"rows":0,"dim":2,"init":"normal"}', expect=400)
    rec(p, "PUT", "/v1/vars/z/sparse", body=b"[]", expect=400)
    rec(p, "PUT", "/v1/vars/z/sparse", headers={"Content-Length": "8000"}, headers_only=True, expect=413)
    rec(p, "GET", "/v1/vars/emb/rows", query={"ids": "3,17,99"}, expect=200)
    _, h, b = rec(p, "GET", "/v1/vars/emb/rows", query={"ids": "3,17,99", "format": "json"}, expect=200)
    assert json.loads(b)["ids"] == [3, 17, 99]
    rec(p, "GET", "/v1/vars/emb/rows", query={"ids": "1", "format": "raw"}, expect=200)
    rec(p, "GET", "/v1/vars/emb/rows", query={"ids": "1,x"}, expect=400)
    rec(p, "GET", "/v1/vars/emb/rows", expect=400)
    rec(p, "GET", "/v1/vars/emb/rows", query={"ids": "1", "format": "xml"}, expect=400)
    rec(p, "GET", "/v1/vars/missing/rows", query={"ids": "1"}, expect=404)
    rec(p, "HEAD", "/v1/vars/emb/rows", query={"ids": "1"}, expect=200)
    rec(p, "HEAD", "/v1/vars/emb/rows", query={"ids": "-1"}, expect=400)
    rec(p, "HEAD", "/v1/vars/missing/rows", query={"ids": "1"}, expect=404)
    ids = struct.pack("<3q", 3, 17, 3)
    rec(p, "POST", "/v1/vars/emb/rows", body=safetensors({"ids": ("I64", [3], ids)}), expect=200)
    rec(p, "POST", "/v1/vars/emb/rows", body=safetensors({"ids": ("F32", [2], f32(1, 2))}), expect=400)
    rec(p, "POST", "/v1/vars/missing/rows", body=safetensors({"ids": ("I64", [3], ids)}), expect=404)
    rec(p, "POST", "/v1/vars/emb/rows", headers={"Content-Length": "8000"}, headers_only=True, expect=413)
    grad = safetensors({"ids": ("I64", [3], ids), "values": ("F32", [3, 2], f32(1, 2, 3, 4, 5, 6))})
    _, _, b = rec(p, "POST", "/v1/vars/emb/rows/grad", body=grad, expect=200)
    assert json.loads(b)["global_step"] == 1
    rec(p, "POST", "/v1/vars/emb/rows/grad",
        body=safetensors({"ids": ("I64", [3], ids), "values": ("F32", [3, 1], f32(1, 2, 3))}), expect=400)
    rec(p, "POST", "/v1/vars/missing/rows/grad", body=grad, expect=404)
    rec(p, "POST", "/v1/vars/emb/rows/grad", headers={"Content-Length": "8000"}, headers_only=True,
        expect=413)
    push = safetensors({"emb:ids": ("I64", [3], ids), "emb:values": ("F32", [3, 2], f32(1, 2, 3, 4, 5, 6))})
    rec(p, "POST", "/v1/grads", body=push, expect=200)
    _, _, b = rec(p, "GET", "/v1/status", expect=200)
    assert json.loads(b)["sparse"]["emb"]["held_rows"] == 2
    rec(p, "PUT", "/v1/config", body=b'{"sync":true}', expect=200)
    rec(p, "POST", "/v1/vars/emb/rows/grad", body=grad, expect=409)


def exercise_token(rec, p):
    """--auth_token_file: writes need the token, reads do not."""
    w = f32(1, 2)
    rec(p, "PUT", "/v1/vars/w", body=w, headers={"X-Shape": "2"}, expect=401)
    rec(p, "PUT", "/v1/vars/w", body=w, headers={"X-Shape": "2"}, token="wrong", expect=401)
    rec(p, "PUT", "/v1/vars/w", body=w, headers={"X-Shape": "2"}, token=TOKEN + "x", expect=401)
    rec(p, "PUT", "/v1/vars/w", body=w, headers={"X-Shape": "2"}, token="Basic " + TOKEN,
        expect=401)
    rec(p, "PUT", "/v1/vars/a..b", body=w, headers={"X-Shape": "2"}, expect=401)  # token first
    rec(p, "PUT", "/v1/vars/w", body=w, headers={"X-Shape": "2"}, token=TOKEN, expect=201)
    rec(p, "PUT", "/v1/vars/a..b", body=w, headers={"X-Shape": "2"}, token=TOKEN, expect=400)
    rec(p, "POST", "/v1/vars/w/grad", body=w, expect=401)
    rec(p, "POST", "/v1/vars/w/grad", body=w, token=TOKEN, expect=200)
    push = safetensors({"w": ("F32", [2], w)}, {"worker": "1"})
    rec(p, "POST", "/v1/grads", body=push, expect=401)
    rec(p, "POST", "/v1/grads", body=push, token="nope", expect=401)
    rec(p, "POST", "/v1/grads", body=push, token=TOKEN, expect=200)
    rec(p, "PUT", "/v1/vars/e/sparse", body=b'{"rows":0,"dim":1}', expect=401)
    rec(p, "PUT", "/v1/vars/e/sparse", body=b'{"rows":0,"dim":1}', token=TOKEN, expect=201)
    rec(p, "POST", "/v1/vars/e/rows/grad", body=b"", expect=401)
    rec(p, "GET", "/v1/vars/e/rows", query={"ids": "1"}, expect=200)
    rec(p, "GET", "/readyz", expect=503)
    for method, path, body in (("PUT", "/v1/config", b"{}"),
                               ("POST", "/v1/eval", b'{"loss":1,"accuracy":0.5}'),
                               ("POST", "/v1/done", b'{"worker":0}'),
                               ("POST", "/v1/heartbeat", b'{"worker":0}'),
                               ("PUT", "/v1/placement",
                                json.dumps(placement_map([("w", [2])])).encode()),
                               ("POST", "/v1/checkpoint", None),
                               ("POST", "/v1/shutdown", None)):
        rec(p, method, path, body=body, expect=401)
        rec(p, method, path, body=body, token="wrong", expect=401)
        if method != "POST" or path != "/v1/shutdown":
            rec(p, method, path, body=body, token=TOKEN, expect=200)
    for path in ("/healthz", "/readyz", "/v1/status", "/v1/vars", "/v1/vars/w",
                 "/v1/vars/w/stats", "/v1/params", "/v1/config", "/", "/app.js", "/style.css",
                 "/metrics", "/v1/history", "/v1/events", "/v1/checkpoint", "/v1/sync",
                 "/v1/placement"):
        rec(p, "GET", path, expect=200)
    rec(p, "DELETE", "/v1/vars/w", expect=405)  # the method check comes before the token
    rec(p, "GET", "/nope", expect=404)
    rec(p, "POST", "/v1/shutdown", token=TOKEN, expect=202)
    assert p.proc.wait(timeout=10) == 0


def exercise_auth_reads(rec, p):
    """--auth_token_file --auth_reads: every route but /healthz needs the token."""
    rec(p, "GET", "/v1/checkpoint", token=TOKEN, expect=404)  # nothing changed: none
    rec(p, "PUT", "/v1/vars/w", body=f32(3), headers={"X-Shape": "1"}, token=TOKEN, expect=201)
    rec(p, "GET", "/healthz", expect=200)
    rec(p, "HEAD", "/healthz", expect=200)
    rec(p, "GET", "/readyz", expect=503)  # open: not ready, rather than 401
    rec(p, "HEAD", "/readyz", expect=503)
    for path in ("/v1/status", "/v1/vars", "/v1/vars/w", "/v1/vars/w/stats", "/v1/params",
                 "/v1/vars/missing", "/v1/vars/a..b", "/v1/config", "/metrics", "/v1/history",
                 "/v1/events", "/", "/app.js", "/style.css", "/v1/checkpoint", "/v1/sync",
                 "/v1/placement", "/v1/timeline"):
        rec(p, "GET", path, expect=401)
        rec(p, "HEAD", path, expect=401)
    rec(p, "GET", "/v1/params", query={"min_step": "-1"}, expect=401)  # the token first
    rec(p, "GET", "/v1/params", query={"worker": "x"}, expect=401)
    rec(p, "GET", "/v1/history", query={"since": "x"}, expect=401)
    rec(p, "HEAD", "/v1/history", query={"since": "x"}, expect=401)
    rec(p, "GET", "/", headers={"If-None-Match": cksum_etag(os.path.join(ROOT, "web",
                                                                          "index.html"))},
        expect=401)
    rec(p, "GET", "/v1/config", token=TOKEN, expect=404)
    rec(p, "GET", "/v1/placement", token=TOKEN, expect=404)
    rec(p, "HEAD", "/v1/placement", token=TOKEN, expect=404)
    placement = json.dumps(placement_map([("w", [1])])).encode()
    rec(p, "PUT", "/v1/placement", body=placement, expect=401)
    rec(p, "PUT", "/v1/placement", body=placement, token=TOKEN, expect=200)
    rec(p, "PUT", "/v1/config", body=b'{"optimizer":"adam"}', token=TOKEN, expect=200)
    rec(p, "GET", "/readyz", expect=200)
    for path in ("/v1/status", "/v1/vars", "/v1/vars/w", "/v1/vars/w/stats", "/v1/params",
                 "/v1/config", "/metrics", "/v1/history", "/v1/sync", "/v1/placement"):
        rec(p, "GET", path, token=TOKEN, expect=200)
        rec(p, "HEAD", path, token=TOKEN, expect=200)
    rec(p, "GET", "/v1/history", query={"since": "x"}, token=TOKEN, expect=400)
    rec(p, "HEAD", "/v1/history", query={"since": "x"}, token=TOKEN, expect=400)
    rec(p, "GET", "/v1/events", token="bad", expect=401)
    exercise_events(rec, p, token=TOKEN)
    exercise_web(rec, p, token=TOKEN)
    rec(p, "GET", "/v1/vars/w", token="bad", expect=401)
    rec(p, "GET", "/v1/vars/missing", token=TOKEN, expect=404)
    rec(p, "GET", "/v1/vars/e/rows", query={"ids": "1"}, expect=401)
    rec(p, "HEAD", "/v1/vars/e/rows", query={"ids": "1"}, expect=401)
    rec(p, "POST", "/v1/vars/e/rows", body=b"", expect=401)
    rec(p, "POST", "/v1/checkpoint", expect=401)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker":0}', expect=401)
    rec(p, "POST", "/v1/heartbeat", body=b'{"worker":0}', token=TOKEN, expect=200)
    exercise_checkpoint(rec, p, token=TOKEN, read_token=TOKEN)
    rec(p, "GET", "/v1/checkpoint", token="bad", expect=401)


def documented_pairs(spec):
    pairs = set()
    for path, item in spec["paths"].items():
        for m in HTTP_METHODS:
            if m in item:
                for st in item[m]["responses"]:
                    pairs.add((f"{m.upper()} {path}", str(st)))
    return pairs


# Wrong copies of recorded exchanges, each of which the checker must refuse.
def mutations(exchanges):
    def first(pred):
        for ex in exchanges:
            if pred(ex):
                return copy.deepcopy(ex)
        raise AssertionError("no recorded exchange to mutate")

    def is_(method, path, status, ct=None):
        return lambda ex: (ex["method"] == method and ex["path"] == path and
                           ex["status"] == status and
                           (ct is None or (ex["content_type"] or "").startswith(ct)))

    out = []
    ex = first(is_("GET", "/v1/status", 200))
    del ex["body"]["global_step"]
    out.append(("status without global_step", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["task"]["type"] = "worker"
    out.append(("status with task type worker", ex))
    ex = first(is_("GET", "/v1/vars/w", 200, "application/json"))
    ex["body"]["bogus"] = 1
    out.append(("var JSON with an extra field", ex))
    ex = first(is_("GET", "/v1/vars/w", 200, "application/json"))
    ex["body"]["values"][0] = "1"
    out.append(("var JSON with a string value", ex))
    ex = first(is_("GET", "/v1/vars/w", 200, "application/octet-stream"))
    del ex["headers"]["x-version"]
    out.append(("raw var without X-Version", ex))
    ex = first(is_("GET", "/v1/vars/w", 200, "application/octet-stream"))
    ex["headers"]["etag"] = "W/weak"
    out.append(("raw var with a bad ETag", ex))
    ex = first(is_("GET", "/v1/vars/w", 304))
    ex["body_length"] = 5
    out.append(("304 with a body", ex))
    ex = first(is_("GET", "/v1/vars/w", 200, "application/octet-stream"))
    ex["content_type"] = "text/plain"
    out.append(("raw var as text/plain", ex))
    ex = first(is_("PUT", "/v1/vars/w", 201))
    ex["status"] = 202
    out.append(("PUT answered 202", ex))
    ex = first(is_("PUT", "/v1/vars/w", 201))
    ex["body"]["created"] = "yes"
    out.append(("PUT result with a string created", ex))
    ex = first(lambda e: e["status"] == 400 and e["method"] == "GET")
    ex["body"] = {"message": "x"}
    out.append(("error without error", ex))
    ex = first(lambda e: e["status"] == 400 and e["method"] == "GET")
    ex["content_type"] = "text/html"
    ex["body"] = None
    out.append(("HTML error", ex))
    ex = first(lambda e: e["status"] == 401 and e["method"] == "PUT")
    del ex["headers"]["www-authenticate"]
    out.append(("401 without WWW-Authenticate", ex))
    ex = first(lambda e: e["status"] == 405)
    ex["headers"]["allow"] = "GET"
    out.append(("405 with the wrong Allow", ex))
    ex = first(lambda e: e["status"] == 405)
    del ex["headers"]["allow"]
    out.append(("405 without Allow", ex))
    ex = first(is_("GET", "/nope", 404))
    ex["status"] = 200
    out.append(("unknown path answered 200", ex))
    ex = first(is_("GET", "/v1/vars/w/stats", 200))
    ex["status"] = 412
    out.append(("stats answered 412", ex))
    ex = first(is_("GET", "/v1/vars/w/stats", 200))
    ex["body"]["l2_norm"] = None
    out.append(("stats with a null l2_norm", ex))
    ex = first(is_("GET", "/v1/params", 200))
    del ex["headers"]["x-global-step"]
    out.append(("params without X-Global-Step", ex))
    ex = first(is_("POST", "/v1/grads", 200))
    ex["body"]["duplicate"] = 0
    out.append(("grads result with a number duplicate", ex))
    ex = first(lambda e: is_("GET", "/v1/vars", 200)(e) and e["body"]["vars"])
    ex["body"]["vars"][0]["name"] = "a..b"
    out.append(("var list with a bad name", ex))
    ex = first(is_("GET", "/v1/vars/w", 200))
    ex["query"] = {"fmt": "json"}
    out.append(("undocumented query parameter", ex))
    ex = first(is_("HEAD", "/v1/vars/w", 200))
    ex["body_length"] = 24
    out.append(("HEAD with a body", ex))
    ex = first(is_("GET", "/healthz", 200))
    ex["body_error"] = "Unexpected token"
    ex["body"] = None
    out.append(("unparsable JSON", ex))
    ex = first(is_("GET", "/v1/status", 200))
    del ex["body"]["ready"]
    out.append(("status without ready", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["mode"] = "semi-sync"
    out.append(("status with an unknown mode", ex))
    ex = first(lambda e: is_("GET", "/v1/status", 200)(e) and e["body"]["eval"] is not None)
    ex["body"]["eval"]["when"] = 1
    out.append(("status eval with an extra field", ex))
    ex = first(lambda e: is_("GET", "/v1/status", 200)(e) and e["body"]["eval"] is not None)
    ex["body"]["eval"]["accuracy"] = 1.5
    out.append(("status eval with accuracy over 1", ex))
    ex = first(lambda e: is_("GET", "/v1/status", 200)(e) and e["body"]["workers"])
    del ex["body"]["workers"][0]["last_seen_secs_ago"]
    out.append(("status worker without last_seen_secs_ago", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["workers"] = 2
    out.append(("status workers as a count", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["waiting_for"] = ["0"]
    out.append(("status waiting_for with a string", ex))
    ex = first(is_("GET", "/metrics", 200))
    ex["content_type"] = "application/json"
    out.append(("metrics as JSON", ex))
    ex = first(is_("GET", "/", 200))
    ex["content_type"] = "text/plain; charset=utf-8"
    out.append(("page as text/plain", ex))
    ex = first(is_("GET", "/app.js", 200))
    del ex["headers"]["etag"]
    out.append(("script without ETag", ex))
    ex = first(is_("GET", "/style.css", 200))
    ex["headers"]["etag"] = '"2a03d11f"'
    out.append(("style sheet with an ETag without its size", ex))
    ex = first(is_("GET", "/style.css", 200))
    ex["headers"]["cache-control"] = "max-age=3600"
    out.append(("style sheet cached for an hour", ex))
    ex = first(is_("GET", "/", 304))
    ex["body_length"] = 4011
    out.append(("page 304 with a body", ex))
    ex = first(is_("HEAD", "/app.js", 304))
    del ex["headers"]["etag"]
    out.append(("script HEAD 304 without ETag", ex))
    ex = first(lambda e: is_("GET", "/v1/history", 200)(e) and e["body"]["points"])
    ex["body"]["points"][0] = ex["body"]["points"][0][:2]
    out.append(("history point without its time", ex))
    ex = first(lambda e: is_("GET", "/v1/history", 200)(e) and e["body"]["eval"])
    ex["body"]["eval"][0][2] = 1.5
    out.append(("history eval with accuracy over 1", ex))
    ex = first(is_("GET", "/v1/history", 200))
    del ex["body"]["eval"]
    out.append(("history without eval", ex))
    ex = first(is_("GET", "/v1/history", 200))
    ex["query"] = {"from": "3"}
    out.append(("history with an undocumented parameter", ex))
    ex = first(is_("GET", "/v1/events", 200))
    ex["content_type"] = "application/json"
    out.append(("events as JSON", ex))
    ex = first(lambda e: e.get("from") and e["body"]["shards"])
    del ex["body"]["shards"]
    out.append(("event data without shards", ex))
    ex = first(lambda e: e.get("from") and e["body"]["shards"])
    ex["body"]["shards"][0]["up"] = "yes"
    out.append(("event data with a shard up 'yes'", ex))
    ex = first(lambda e: e.get("from"))
    ex["body"]["steps_per_sec"] = -1
    out.append(("event data with negative steps_per_sec", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["examples_per_sec"] = "0"
    out.append(("status with a string examples_per_sec", ex))
    ex = first(is_("POST", "/v1/grads", 200))
    ex["body"]["outcome"] = "ignored"
    out.append(("grads result with an unknown outcome", ex))
    ex = first(is_("POST", "/v1/grads", 200))
    del ex["body"]["outcome"]
    out.append(("grads result without outcome", ex))
    ex = first(lambda e: is_("GET", "/v1/config", 200)(e) and e["body"]["optimizer"] == "adam")
    ex["body"]["momentum"] = 0.9
    out.append(("adam configuration with a momentum", ex))
    ex = first(lambda e: is_("GET", "/v1/config", 200)(e) and e["body"]["optimizer"] == "adam")
    del ex["body"]["beta2"]
    out.append(("adam configuration without beta2", ex))
    ex = first(lambda e: is_("PUT", "/v1/config", 200)(e) and e["body"]["optimizer"] == "sgd")
    ex["body"]["beta1"] = 0.9
    out.append(("sgd configuration with a beta1", ex))
    ex = first(is_("PUT", "/v1/config", 200))
    ex["body"]["learning_rate"] = 0
    out.append(("configuration with learning_rate 0", ex))
    ex = first(is_("GET", "/readyz", 200))
    ex["body"] = {"status": "ok"}
    out.append(("readyz saying ok", ex))
    ex = first(is_("GET", "/readyz", 503))
    ex["status"] = 500
    out.append(("readyz answered 500", ex))
    ex = first(is_("POST", "/v1/shutdown", 202))
    ex["status"] = 200
    out.append(("shutdown answered 200", ex))
    ex = first(is_("POST", "/v1/done", 200))
    ex["body"]["workers_done"] = "1"
    out.append(("done result with a string count", ex))
    ex = first(is_("POST", "/v1/eval", 200))
    ex["body"] = {"status": "stopping"}
    out.append(("eval answered stopping", ex))
    ex = first(lambda e: is_("GET", "/v1/params", 200)(e) and "min_step" in e["query"])
    ex["query"] = {"min_steps": ex["query"]["min_step"]}
    out.append(("misspelt long-poll parameter", ex))
    ex = first(lambda e: is_("GET", "/v1/params", 200)(e) and "worker" in e["query"])
    ex["query"]["workers"] = ex["query"].pop("worker")
    out.append(("misspelt worker parameter", ex))
    ex = first(is_("GET", "/v1/checkpoint", 200))
    del ex["headers"]["x-global-step"]
    out.append(("checkpoint without X-Global-Step", ex))
    ex = first(is_("GET", "/v1/checkpoint", 200))
    ex["headers"]["x-checkpoint"] = "model.ckpt-1.bin"
    out.append(("checkpoint with another file name", ex))
    ex = first(is_("HEAD", "/v1/checkpoint", 200))
    ex["headers"]["content-disposition"] = "inline"
    out.append(("checkpoint shown inline", ex))
    ex = first(is_("GET", "/v1/checkpoint", 200))
    ex["content_type"] = "application/json"
    out.append(("checkpoint as JSON", ex))
    ex = first(is_("GET", "/v1/checkpoint", 404))
    ex["status"] = 409
    out.append(("checkpoint download answered 409", ex))
    ex = first(is_("POST", "/v1/checkpoint", 200))
    ex["body"]["global_step"] = str(ex["body"]["global_step"])
    out.append(("saved checkpoint with a string global_step", ex))
    ex = first(is_("POST", "/v1/checkpoint", 200))
    del ex["body"]["path"]
    out.append(("saved checkpoint without its path", ex))
    ex = first(is_("POST", "/v1/checkpoint", 500))
    ex["status"] = 502  # (503 is documented: psd is stopping)
    out.append(("failed save answered 502", ex))
    ex = first(lambda e: is_("GET", "/v1/status", 200)(e) and e["body"]["checkpoint"])
    del ex["body"]["checkpoint"]["saves"]
    out.append(("status checkpoint without saves", ex))
    ex = first(lambda e: is_("GET", "/v1/status", 200)(e) and e["body"]["checkpoint"] and
               e["body"]["checkpoint"]["last"])
    ex["body"]["checkpoint"]["last"]["global_step"] = -1
    out.append(("status checkpoint with a negative step", ex))
    ex = first(lambda e: is_("GET", "/v1/status", 200)(e) and e["body"]["checkpoint"] and
               e["body"]["checkpoint"]["last_error"])
    ex["body"]["checkpoint"]["last_error"] = "disk full"
    out.append(("status checkpoint error as a string", ex))
    ex = first(is_("GET", "/v1/status", 200))
    del ex["body"]["checkpoint"]
    out.append(("status without checkpoint", ex))
    ex = first(is_("GET", "/v1/status", 200))
    del ex["body"]["sync"]
    out.append(("status without sync", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["sync"]["needed"] = 0
    out.append(("status sync needing no gradient", ex))
    ex = first(lambda e: is_("GET", "/v1/sync", 200)(e) and e["body"]["have"])
    ex["body"]["have"][0] = str(ex["body"]["have"][0])
    out.append(("sync with a string worker in have", ex))
    ex = first(lambda e: is_("GET", "/v1/sync", 200)(e) and e["body"]["waiting_for"])
    ex["body"]["waiting_for"].append(ex["body"]["waiting_for"][0])
    out.append(("sync waiting twice for a worker", ex))
    ex = first(lambda e: is_("GET", "/v1/sync", 200)(e) and e["body"]["mode"] == "async")
    ex["body"]["waiting_for"] = [0]
    out.append(("async sync state waiting for a worker", ex))
    ex = first(lambda e: is_("GET", "/v1/sync", 200)(e) and e["body"]["mode"] == "async")
    ex["body"]["dead"] = [0]
    out.append(("async sync state with a dead worker", ex))
    ex = first(lambda e: is_("GET", "/v1/status", 200)(e) and e["body"]["sync"]["mode"] == "async")
    ex["body"]["sync"]["left"] = [0]
    out.append(("async status sync with a worker that left", ex))
    ex = first(is_("GET", "/v1/sync", 200))
    del ex["body"]["dead"]
    out.append(("sync without dead", ex))
    ex = first(is_("GET", "/v1/sync", 200))
    ex["body"]["lease_secs"] = 0
    out.append(("sync with a lease of 0 s", ex))
    ex = first(is_("GET", "/v1/sync", 200))
    ex["body"]["mode"] = "elastic"
    out.append(("sync with an unknown mode", ex))
    ex = first(is_("HEAD", "/v1/sync", 200))
    del ex["headers"]["cache-control"]
    out.append(("sync HEAD without Cache-Control", ex))
    ex = first(is_("POST", "/v1/heartbeat", 200))
    del ex["body"]["lease_secs"]
    out.append(("heartbeat result without lease_secs", ex))
    ex = first(is_("POST", "/v1/heartbeat", 200))
    ex["body"]["global_step"] = -1
    out.append(("heartbeat result with a negative step", ex))
    ex = first(is_("POST", "/v1/heartbeat", 400))
    ex["status"] = 422
    out.append(("heartbeat answered 422", ex))
    ex = first(is_("GET", "/v1/placement", 200))
    del ex["body"]["this_ps"]
    out.append(("placement without this_ps", ex))
    ex = first(is_("GET", "/v1/placement", 200))
    ex["body"]["this_ps"]["bytes"] = -1
    out.append(("placement this_ps with negative bytes", ex))
    ex = first(is_("GET", "/v1/placement", 200))
    ex["body"]["this_ps"]["ps"] = 0
    out.append(("placement this_ps with an extra field", ex))
    ex = first(is_("GET", "/v1/placement", 200))
    ex["body"]["ps_tasks"] = "1"
    out.append(("placement with a string ps_tasks", ex))
    ex = first(is_("GET", "/v1/placement", 200))
    del ex["body"]["variables"]
    out.append(("placement without variables", ex))
    ex = first(is_("GET", "/v1/placement", 404))
    ex["status"] = 200
    out.append(("no placement answered 200", ex))
    ex = first(is_("PUT", "/v1/placement", 200))
    ex["status"] = 201
    out.append(("placement PUT answered 201", ex))
    ex = first(is_("PUT", "/v1/placement", 409))
    ex["status"] = 422
    out.append(("placement for other ps tasks answered 422", ex))
    ex = first(is_("HEAD", "/v1/placement", 200))
    del ex["headers"]["cache-control"]
    out.append(("placement HEAD without Cache-Control", ex))
    ex = first(is_("GET", "/v1/status", 200))
    del ex["body"]["staleness"]
    out.append(("status without staleness", ex))
    ex = first(is_("GET", "/v1/status", 200))
    del ex["body"]["staleness"]["clocks"]
    out.append(("staleness without clocks", ex))
    ex = first(lambda e: is_("GET", "/v1/status", 200)(e) and e["body"]["staleness"]["count"])
    bk = ex["body"]["staleness"]["buckets"]
    bk[0], bk[1] = bk[1], bk[0]
    out.append(("staleness buckets out of order", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["staleness"]["buckets"].pop()
    out.append(("staleness without its +Inf bucket", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["staleness"]["buckets"][8]["le"] = "Inf"
    out.append(("staleness bucket le 'Inf'", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["staleness"]["mean"] = -0.5
    out.append(("staleness with a negative mean", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["staleness"]["bound"] = None
    out.append(("staleness bound null", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["staleness"]["max_staleness"] = -2
    out.append(("staleness max_staleness -2", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["staleness"]["clocks"] = {"w0": {"started": 0, "done": 0}}
    out.append(("staleness clock of worker 'w0'", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["staleness"]["clocks"]["0"]["done"] = "1"
    out.append(("staleness clock with a string done", ex))
    ex = first(is_("GET", "/v1/status", 200))
    del ex["body"]["staleness"]["clocks"]["0"]["started"]
    out.append(("staleness clock without started", ex))
    ex = first(is_("GET", "/v1/status", 200))
    ex["body"]["staleness"]["clocks"] = {}
    out.append(("staleness without any clock", ex))
    ex = first(lambda e: is_("GET", "/v1/config", 200)(e) and "staleness" in e["body"])
    ex["body"]["staleness"] = -1
    out.append(("configuration with staleness -1", ex))
    ex = first(lambda e: is_("PUT", "/v1/config", 200)(e) and "max_staleness" in e["body"])
    ex["body"]["max_staleness"] = None
    out.append(("configuration with max_staleness null", ex))
    ex = first(lambda e: is_("GET", "/v1/params", 200)(e) and "min_clock" in e["query"])
    ex["query"]["minclock"] = ex["query"].pop("min_clock")
    out.append(("misspelt min_clock parameter", ex))
    ex = first(lambda e: is_("HEAD", "/v1/params", 200)(e) and "clock" in e["query"])
    ex["query"]["clocks"] = ex["query"].pop("clock")
    out.append(("misspelt clock parameter", ex))
    return out


def test_spec_is_valid_openapi(tmp_path):
    r = run_checker("spec", SPEC)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "is valid OpenAPI 3.1" in r.stderr
    # ... and the check can fail: a misspelt keyword, a dangling $ref, a stray field
    with open(SPEC) as f:
        text = f.read()
    broken = {
        "misspelt": text.replace("required: [error]", "requried: [error]", 1),
        "dangling": text.replace('schemas/Health"', 'schemas/Healthy"', 1),
        "stray": text.replace("paths:\n", "paths:\n  nopath:\n    get: {}\n", 1),
    }
    for name, t in broken.items():
        assert t != text, name
        bad = tmp_path / f"{name}.yaml"
        bad.write_text(t)
        r = run_checker("spec", str(bad))
        assert r.returncode == 1, f"{name}: the broken spec was accepted\n{r.stdout}{r.stderr}"
        assert "spec:" in r.stdout, name


def test_live_responses_match_spec(start_psd, tmp_path):
    venv_python()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    rec = Recorder()
    exercise_open(rec, start_psd("--max_body_bytes=4096"))
    logdir = tmp_path / "training-logs"
    exercise_training(rec, start_psd(f"--logdir={logdir}"))
    exercise_restart(rec, start_psd(f"--logdir={logdir}"))
    exercise_no_checkpoints(rec, start_psd("--logdir="))
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("")
    exercise_checkpoint_failure(rec, start_psd(f"--logdir={not_a_folder}"))
    exercise_sync(rec, start_psd("--logdir="))
    exercise_leases(rec, start_psd("--logdir=", "--worker_lease_secs=1"))
    exercise_staleness(rec, start_psd("--logdir="))
    exercise_sparse(rec, start_psd("--logdir=", "--max_body_bytes=4096"))
    exercise_wire(rec, start_psd("--logdir="))
    exercise_token(rec, start_psd(f"--auth_token_file={token_file}"))
    exercise_auth_reads(rec, start_psd(f"--auth_token_file={token_file}", "--auth_reads"))

    recorded = tmp_path / "exchanges.json"
    recorded.write_text(json.dumps(rec.exchanges, indent=1))
    coverage = tmp_path / "coverage.json"
    r = run_checker("responses", SPEC, str(recorded), "--coverage", str(coverage))
    assert r.returncode == 0, f"responses that break the spec:\n{r.stdout}{r.stderr}"
    assert f"{len(rec.exchanges)} exchanges, 0 failures" in r.stderr

    # every documented (operation, status) was produced, but for out of memory
    seen = {(op, str(st)) for op, sts in json.loads(coverage.read_text()).items() for st in sts}
    missing = sorted(pair for pair in documented_pairs(load_spec()) - seen
                     if pair[1] not in NOT_PRODUCIBLE)
    assert not missing, f"documented but never exercised: {missing}"
    assert ("* unrouted", "404") in seen and ("* /v1/vars/{name}", "405") in seen

    # the checker catches wrong responses: each mutation must fail on its own
    muts = mutations(rec.exchanges)
    bad = tmp_path / "wrong.json"
    bad.write_text(json.dumps([ex for _, ex in muts], indent=1))
    r = run_checker("responses", SPEC, str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    for i, (what, _) in enumerate(muts):
        assert f"FAIL [{i}] " in r.stdout, f"not caught: {what}\n{r.stdout}"


def test_event_data_is_status():
    """The live test validates each stream's first event's data as the body of
    a GET /v1/status answer: right only while the spec says the data is that
    schema."""
    with open(SPEC) as f:
        raw = yaml.safe_load(f)
    events = raw["paths"]["/v1/events"]["get"]["responses"]["200"]["content"]
    status = raw["paths"]["/v1/status"]["get"]["responses"]["200"]["content"]
    assert list(events) == ["text/event-stream"]
    assert events["text/event-stream"]["x-event-data"] == \
        status["application/json"]["schema"] == {"$ref": "#/components/schemas/Status"}


def test_route_table_matches_spec():
    out = subprocess.run([binary("psd"), "--routes"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    table = {}
    for line in out.stdout.splitlines():
        method, path, *flags = line.split()
        assert set(flags) <= {"write", "open"}, line
        table[(method, path)] = set(flags)
    assert len(table) >= 9, out.stdout

    spec = load_spec()
    ops = {(m.upper(), path): op for path, item in spec["paths"].items()
           for m, op in item.items() if m in HTTP_METHODS}
    table_paths = {p for _, p in table}
    assert set(spec["paths"]) == table_paths, (
        f"only in the spec: {sorted(set(spec['paths']) - table_paths)}; "
        f"only in psd: {sorted(table_paths - set(spec['paths']))}")
    # every route is in the spec, and every spec operation is a route (HEAD
    # exactly where GET is: psd answers HEAD on every GET route)
    assert set(table) <= set(ops), f"routes missing from the spec: {sorted(set(table) - set(ops))}"
    extra = {k for k in ops if k not in table and not (k[0] == "HEAD" and ("GET", k[1]) in table)}
    assert not extra, f"spec operations psd does not route: {sorted(extra)}"
    heads = {p for m, p in table if m == "GET"}
    assert {p for m, p in ops if m == "HEAD"} == heads, "HEAD must be documented on every GET path"

    # the write routes that take no body (so no Content-Length check, no 413)
    no_body = {("POST", "/v1/shutdown"), ("POST", "/v1/checkpoint")}
    bearer_only = [{"bearer": []}]
    optional = [{}, {"bearer": []}]
    for (method, path), op in ops.items():
        flags = table.get((method, path)) or table[("GET", path)]
        security = op.get("security", spec.get("security"))
        if "write" in flags:
            want = bearer_only
        elif "open" in flags:
            want = []
        else:
            want = optional
        assert security == want, f"{method} {path} ({' '.join(flags) or 'read'}): security {security}"
        if "open" not in flags:
            assert "401" in op["responses"], f"{method} {path} can answer 401"
        if "write" in flags and (method, path) in no_body:
            assert "requestBody" not in op and "413" not in op["responses"], f"{method} {path}"
        elif "write" in flags:
            assert "requestBody" in op and "413" in op["responses"], f"{method} {path}"


STAGE_SPEC = os.path.join(ROOT, "openapi", "pipeline_stage.yaml")


def test_stage_spec_is_valid_openapi():
    r = run_checker("spec", STAGE_SPEC)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "is valid OpenAPI 3.1" in r.stderr


def test_a_pipeline_stages_answers_match_its_spec(tmp_path):
    """Two workerd stages (mlp:32,16, training until stopped): the page, the
    health, both stages' /v1/status (the chief's with every stage, then with
    the killed one's error), /v1/pipeline, refused messages (400, 409, 413),
    an unrouted path and a method a path does not answer, each checked
    against openapi/pipeline_stage.yaml."""
    import socket
    import types
    venv_python()
    data = "/usr/share/datasets/fashion-mnist"
    if not os.path.isdir(data):
        pytest.skip(f"{data} is missing: make deps installs dataset-fashion-mnist")
    ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
        s.close()
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = {}
    try:
        for i in (1, 0):
            procs[i] = subprocess.Popen(
                [binary("workerd"), f"--worker_hosts={hosts}", f"--task_index={i}", "--pipeline_stages=2",
                 "--micro_batches=2", f"--data_dir={data}", "--model=mlp:32,16", "--train_steps=1000000000",
                 "--batch_size=32", "--log_every=0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        chief, last = types.SimpleNamespace(port=ports[0]), types.SimpleNamespace(port=ports[1])
        rec = Recorder()
        deadline = time.monotonic() + 60
        while True:  # both serve, and the last stage has a loss
            try:
                st, _, body = rec(last, "GET", "/v1/status")
                if st == 200 and json.loads(body)["last_loss"] is not None:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), "no stage trains"
            rec.exchanges.clear()
            time.sleep(0.1)
        for path in ("/", "/app.js", "/style.css", "/healthz", "/v1/status", "/v1/pipeline", "/v1/history"):
            for method in ("GET", "HEAD"):
                rec(chief, method, path, expect=200)
        rec(last, "GET", "/v1/pipeline", expect=200)
        rec(chief, "GET", "/v1/history", query={"since": 1}, expect=200)
        rec(chief, "GET", "/v1/history", query={"since": "x"}, expect=400)
        q = {"step": 0, "mb": 0, "dir": "act", "from": 0, "plan": 1, "example0": 0}
        rec(last, "POST", "/v1/pipeline/msg", query={"step": 0}, body=b"", expect=400)
        rec(last, "POST", "/v1/pipeline/msg", query=q, body=bytes(8), expect=409)  # another plan
        plan = json.loads(rec(last, "GET", "/v1/pipeline")[2])["plan"]
        crc = crc32c_of(plan.encode())
        rec(last, "POST", "/v1/pipeline/msg", query=dict(q, plan=crc), headers={"Content-Length": str(1 << 30)},
            headers_only=True, expect=413)
        rec(last, "GET", "/v1/nothing", expect=404)
        rec(last, "DELETE", "/v1/pipeline", expect=405)
        procs[1].kill()
        procs[1].wait()
        st = json.loads(rec(chief, "GET", "/v1/status", expect=200)[2])
        assert "error" in st["pipeline"][1], st
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    recorded = tmp_path / "stage-exchanges.json"
    recorded.write_text(json.dumps(rec.exchanges, indent=1))
    r = run_checker("responses", STAGE_SPEC, str(recorded))
    assert r.returncode == 0, f"answers that break the stage spec:\n{r.stdout}{r.stderr}"
    assert f"{len(rec.exchanges)} exchanges, 0 failures" in r.stderr
    # and the check can fail: the chief's status without its mode
    bad = [dict(ex, body=dict(ex["body"], mode="ring")) for ex in rec.exchanges
           if ex["path"] == "/v1/status" and ex["method"] == "GET"]
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(bad))
    r = run_checker("responses", STAGE_SPEC, str(wrong))
    assert r.returncode == 1 and r.stdout.count("FAIL") == len(bad), r.stdout


def crc32c_of(data):
    """CRC-32C (Castagnoli, reflected), bit by bit: what the plan id is."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF
