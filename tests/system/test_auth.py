"""--auth_token_file: every write route of the table `psd --routes` prints
refuses a missing or wrong token with 401 + WWW-Authenticate and changes
nothing; the right token works. Reads are open unless --auth_reads, which
closes every route not marked open (/healthz and /readyz stay open; the page,
/metrics, /v1/history and /v1/events close too). A bad token file stops psd
with exit 2.

GET /v1/events never ends: it is read over a raw socket up to its first
event, then closed."""
import base64
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import binary, http
from syshelp import (assert_error, connect, curl_req, first_event, read_response, st_body,
                     request_head, snapshot, st_grads)

TOKEN = "s3cr3t-Token_0123456789abcdef"
W = np.arange(12, dtype=np.float32).reshape(3, 4)
# what the seeded psd is configured with (as a chief would), then what the
# PUT /v1/config recipe changes it to (allowed: training has not started)
CONFIG = {"optimizer": "sgd", "learning_rate": 0.5}
NEW_CONFIG = {"optimizer": "momentum", "learning_rate": 0.25, "momentum": 0.5, "sync": True,
              "workers": 2, "replicas_to_aggregate": 2}
EVAL = {"loss": 0.75, "accuracy": 0.5, "global_step": 3, "examples": 100}
# the placement map the seeded psd holds (as a chief sends it: w on the one ps
# task), then the one the PUT /v1/placement recipe replaces it with
PLACEMENT = {"policy": "bytes", "partition_bytes": 4194304, "ps_tasks": 1, "bytes_per_ps": [48],
             "variables": [{"name": "w", "shape": [3, 4],
                            "parts": [{"name": "w", "ps": 0, "rows": [0, 3]}]}]}
NEW_PLACEMENT = dict(PLACEMENT, policy="round_robin", partition_bytes=16)
# what GET /v1/placement adds: the seeded psd holds w (3x4 float32)
THIS_PS = {"task": 0, "variables": 1, "bytes": 48}
# the change POST /v1/shutdown makes: psd exits 0 (checked by stopped())
STOPS = "stops"


def route_table():
    out = subprocess.run([binary("psd"), "--routes"], capture_output=True, timeout=20)
    assert out.returncode == 0, out.stderr
    routes = []
    for line in out.stdout.decode().splitlines():
        parts = line.split()
        assert len(parts) >= 2 and set(parts[2:]) <= {"write", "open"}, line
        routes.append((parts[0], parts[1], "write" in parts[2:], "open" in parts[2:]))
    assert routes, "psd --routes printed nothing"
    return routes


ROUTES = route_table()
WRITES = [r for r in ROUTES if r[2]]
READS = [r for r in ROUTES if not r[2]]
# reads that take a body, so POST (the worker's pull of a sparse table's rows by ids)
READ_POSTS = {(m, p) for m, p, w, _ in ROUTES if not w and m != "GET"}
SPARSE = {"rows": 16, "dim": 2}  # the seeded table "e"


def test_route_table_has_the_contract():
    """The table holds at least the routes of the contract, with these flags."""
    want = {("GET", "/healthz", False, True), ("PUT", "/v1/vars/{name}", True, False),
            ("POST", "/v1/vars/{name}/grad", True, False), ("POST", "/v1/grads", True, False),
            ("GET", "/v1/vars/{name}", False, False), ("GET", "/v1/status", False, False),
            ("GET", "/v1/vars", False, False), ("GET", "/v1/params", False, False),
            ("GET", "/v1/vars/{name}/stats", False, False), ("GET", "/readyz", False, True),
            ("GET", "/v1/config", False, False), ("PUT", "/v1/config", True, False),
            ("POST", "/v1/eval", True, False), ("POST", "/v1/done", True, False),
            ("POST", "/v1/shutdown", True, False), ("GET", "/", False, False),
            ("GET", "/app.js", False, False), ("GET", "/style.css", False, False),
            ("GET", "/metrics", False, False), ("GET", "/v1/history", False, False),
            ("GET", "/v1/events", False, False), ("GET", "/v1/checkpoint", False, False),
            ("POST", "/v1/checkpoint", True, False), ("GET", "/v1/sync", False, False),
            ("POST", "/v1/heartbeat", True, False), ("GET", "/v1/placement", False, False),
            ("PUT", "/v1/placement", True, False)}
    assert want <= set(ROUTES)


def st_body_of(tensors):
    """(name, numpy dtype, array) tensors -> a safetensors body."""
    header, data = {}, b""
    for name, dt, arr in tensors:
        a = np.ascontiguousarray(arr, dtype=dt)
        header[name] = {"dtype": {"<i8": "I64", "<f4": "F32"}[dt], "shape": list(a.shape),
                        "data_offsets": [len(data), len(data) + a.nbytes]}
        data += a.tobytes()
    return st_body(header, data)


def recipe(method, path):
    """A valid request for a route of the table: (path, headers, body, want status,
    how the state must differ afterwards: a function of (before, after))."""
    p = path.replace("{name}", "w")
    if (method, path) == ("PUT", "/v1/vars/{name}/sparse"):
        return "/v1/vars/f/sparse", ["Content-Type: application/json"], b'{"rows": 8, "dim": 3}', 201, \
            lambda b, a: "f" not in b["sparse"] and a["sparse"]["f"]["dim"] == 3 and same_but(b, a, "sparse")
    if (method, path) == ("POST", "/v1/vars/{name}/rows/grad"):
        body = st_body_of([("ids", "<i8", np.array([3])), ("values", "<f4", np.ones((1, 2)))])
        return "/v1/vars/e/rows/grad", [], body, 200, \
            lambda b, a: a["sparse"]["e"]["held_rows"] == b["sparse"]["e"]["held_rows"] + 1 and \
            a["sparse"]["e"]["updates"] == b["sparse"]["e"]["updates"] + 1
    if (method, path) == ("POST", "/v1/vars/{name}/rows"):
        return "/v1/vars/e/rows", [], st_body_of([("ids", "<i8", np.array([1, 2]))]), 200, lambda b, a: a == b
    if (method, path) == ("GET", "/v1/vars/{name}/rows"):
        return "/v1/vars/e/rows?ids=1,2", [], None, 200, lambda b, a: a == b
    if (method, path) == ("PUT", "/v1/vars/{name}"):
        new = np.full((3, 4), 2.0, np.float32)
        return p, ["X-Shape: 3,4"], new.tobytes(), 200, \
            lambda b, a: a["vars"]["w"][3] == new.tobytes() and a["vars"]["w"][1] == b["vars"]["w"][1] + 1
    if (method, path) == ("POST", "/v1/vars/{name}/grad"):
        g = np.ones(12, np.float32)
        return p, [], g.tobytes(), 200, \
            lambda b, a: a["global_step"] == b["global_step"] + 1 and \
            a["vars"]["w"][3] == (W.reshape(-1) - np.float32(0.5) * g).astype(np.float32).tobytes()
    if (method, path) == ("POST", "/v1/grads"):
        g = np.ones((3, 4), np.float32)
        return p, [], st_grads([("w", g)], meta={"loss": "1.5"}), 200, \
            lambda b, a: a["global_step"] == b["global_step"] + 1 and a["last_loss"] == 1.5 and \
            a["vars"]["w"][3] == (W - np.float32(0.5) * g).astype(np.float32).tobytes()
    if (method, path) == ("PUT", "/v1/config"):
        return p, ["Content-Type: application/json"], json.dumps(NEW_CONFIG).encode(), 200, \
            lambda b, a: b["config"] != NEW_CONFIG and a["config"] == NEW_CONFIG and \
            (a["mode"], a["optimizer"], a["learning_rate"]) == ("sync", "momentum", 0.25) and \
            same_but(b, a, "config", "mode", "optimizer", "learning_rate", "waiting_for",
                     "replicas_to_aggregate")
    if (method, path) == ("POST", "/v1/eval"):
        return p, [], json.dumps(EVAL).encode(), 200, \
            lambda b, a: b["eval"] is None and a["eval"] == EVAL and same_but(b, a, "eval")
    if (method, path) == ("POST", "/v1/done"):
        return p, [], b'{"worker": 1}', 200, \
            lambda b, a: a["workers_done"] == b["workers_done"] + 1 and \
            same_but(b, a, "workers_done")
    if (method, path) == ("POST", "/v1/heartbeat"):
        # renews worker 0's lease: nothing of the state a snapshot holds changes
        return p, ["Content-Type: application/json"], b'{"worker": 0}', 200, \
            lambda b, a: a == b
    if (method, path) == ("PUT", "/v1/placement"):
        # the map is replaced; nothing else of the state changes
        return p, ["Content-Type: application/json"], json.dumps(NEW_PLACEMENT).encode(), 200, \
            lambda b, a: b["placement"] == PLACEMENT and a["placement"] == NEW_PLACEMENT and \
            same_but(b, a, "placement")
    if (method, path) == ("POST", "/v1/shutdown"):
        return p, [], None, 202, STOPS
    if (method, path) == ("POST", "/v1/checkpoint"):
        # a save changes nothing of the state; the new file is served at once
        return p, [], None, 200, lambda b, a: a == b and a["checkpoint_step"] == a["global_step"]
    if method == "GET" and path in READ_TYPES:
        return p, [], None, 200, lambda b, a: a == b
    raise AssertionError(f"no request recipe for route {method} {path}: add one to test_auth.py")


# The GET routes with a recipe: a read changes nothing. What each answers
# (content type, and what the body must hold; before: the state's snapshot).
READ_TYPES = {
    "/healthz": "application/json", "/readyz": "application/json",
    "/v1/status": "application/json", "/v1/vars": "application/json",
    "/v1/vars/{name}": "application/octet-stream", "/v1/vars/{name}/stats": "application/json",
    "/v1/params": "application/octet-stream", "/v1/config": "application/json",
    "/": "text/html", "/app.js": "text/javascript", "/style.css": "text/css",
    "/metrics": "text/plain", "/v1/history": "application/json",
    "/v1/events": "text/event-stream", "/v1/checkpoint": "application/octet-stream",
    "/v1/sync": "application/json", "/v1/placement": "application/json",
    "/v1/timeline": "application/json", "/v1/vars/{name}/rows": "application/octet-stream",
}


def assert_read(path, headers, body, before):
    """A GET answered 200 with what the route serves."""
    want = READ_TYPES[path]
    assert headers.get("content-type", "").split(";")[0] == want, (path, headers)
    if path == "/":
        assert body.lower().startswith(b"<!doctype html"), body[:100]
    elif path == "/metrics":
        assert b"\nrestps_global_step %d\n" % before["status_step"] in body, body[:500]
    elif path == "/v1/history":
        assert json.loads(body)["global_step"] == before["status_step"], body
    elif path == "/v1/sync":
        sync = json.loads(body)
        assert (sync["global_step"], sync["mode"]) == (before["status_step"], before["mode"]), body
    elif path == "/v1/placement":
        assert json.loads(body) == dict(before["placement"], this_ps=THIS_PS), body
    elif path == "/v1/timeline":
        assert set(json.loads(body)) == {"now", "secs", "workers"}, body
    elif path == "/v1/events":
        fields = [ln.partition(":")[::2] for ln in body.decode().split("\n") if ln]
        data = [v.strip() for k, v in fields if k == "data"]
        assert len(data) == 1, body
        assert json.loads(data[0])["global_step"] == before["status_step"], body
        assert ("id", " %d" % before["status_step"]) in fields, body


def send(p, method, path, hdrs, body):
    """curl_req, but GET /v1/events (a stream that never ends) goes over a raw
    socket that stops at its first event."""
    if (method, path) == ("GET", "/v1/events"):
        # curl's "Name;" sends the header with an empty value
        raw = [h[:-1] + ":" if h.endswith(";") else h for h in hdrs]
        return first_event(p.port, path, raw)
    return curl_req(method, p.url + path, hdrs, body)


def same_but(before, after, *keys):
    """Nothing but keys differs between two snapshots."""
    return {k: v for k, v in before.items() if k not in keys} == \
        {k: v for k, v in after.items() if k not in keys}


def assert_changed(p, before, changed):
    """A write with the right token did what it should (psd stopped, for shutdown)."""
    if changed == STOPS:
        assert p.proc.wait(timeout=10) == 0, p.read_stderr()[-3000:]
        return
    assert p.alive(), p.read_stderr()[-3000:]
    after = snapshot_auth(p)
    assert changed(before, after), (before, after)


@pytest.fixture
def token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")  # a trailing newline is not part of the token
    return str(f)


def seeded(start_psd, token_file, *extra):
    p = start_psd(f"--auth_token_file={token_file}", "--learning_rate=0.5", *extra)
    st, _, body = http("PUT", p.url + "/v1/vars/w", W.tobytes(),
                       {"X-Shape": "3,4", "Authorization": "Bearer " + TOKEN})
    assert st == 201, body
    st, _, body = http("PUT", p.url + "/v1/config", json.dumps(CONFIG).encode(),
                       {"Authorization": "Bearer " + TOKEN})
    assert st == 200, body
    st, _, body = http("PUT", p.url + "/v1/placement", json.dumps(PLACEMENT).encode(),
                       {"Authorization": "Bearer " + TOKEN})
    assert st == 200, body  # so GET /v1/placement has a map to answer with
    st, _, body = http("PUT", p.url + "/v1/vars/e/sparse", json.dumps(SPARSE).encode(),
                       {"Authorization": "Bearer " + TOKEN})
    assert st == 201, body  # so the sparse routes have a table
    st, _, body = http("POST", p.url + "/v1/checkpoint", None, {"Authorization": "Bearer " + TOKEN})
    assert st == 200, body  # so GET /v1/checkpoint has a file to serve
    before = snapshot_auth(p)
    assert before["ready"] and before["config"]["optimizer"] == "sgd"
    assert before["placement"] == PLACEMENT
    return p, before


def snapshot_auth(p):
    """snapshot() for a server that may need the token for reads too, with the
    step of the newest checkpoint and the placement map (as the chief sent
    it, without this_ps; None before one)."""
    h = {"Authorization": "Bearer " + TOKEN}
    snap = snapshot(p.url, h)
    st, _, body = http("GET", p.url + "/v1/status", headers=h)
    last = json.loads(body)["checkpoint"]["last"]
    snap["checkpoint_step"] = last["global_step"] if last else None
    st, _, body = http("GET", p.url + "/v1/placement", headers=h)
    assert st in (200, 404), (st, body)
    placement = json.loads(body) if st == 200 else None
    if placement is not None:
        assert placement.pop("this_ps") == {"task": 0, "variables": snap["variables"],
                                            "bytes": snap["bytes"]}, placement
    snap["placement"] = placement
    return snap


BAD_AUTH = {
    "none": None,
    "wrong_same_length": "Bearer " + "x" * len(TOKEN),
    "wrong_last_char": "Bearer " + TOKEN[:-1] + ("g" if TOKEN[-1] != "g" else "h"),
    "shorter": "Bearer " + TOKEN[:-1],
    "longer": "Bearer " + TOKEN + "0",
    "prefix_only": "Bearer " + TOKEN[:4],
    "doubled": "Bearer " + TOKEN + TOKEN,
    "empty_bearer": "Bearer ",
    "scheme_only": "Bearer",
    "no_scheme": TOKEN,
    "basic": "Basic " + base64.b64encode(b"user:" + TOKEN.encode()).decode(),
    "basic_raw_token": "Basic " + TOKEN,
    "two_spaces": "Bearer  " + TOKEN,
    "empty_header": "",
}


def assert_401(r):
    status, headers, body = r
    assert_error(status, headers, body, 401, "token")
    assert headers.get("www-authenticate", "").lower().startswith("bearer"), headers


@pytest.mark.parametrize("auth", sorted(BAD_AUTH))
@pytest.mark.parametrize("route", WRITES, ids=lambda r: f"{r[0]} {r[1]}")
def test_write_without_the_right_token_is_401(start_psd, token_file, route, auth):
    p, before = seeded(start_psd, token_file)
    path, hdrs, body, _, _ = recipe(route[0], route[1])
    value = BAD_AUTH[auth]
    if value is None:
        h = hdrs
    elif value == "":
        h = hdrs + ["Authorization;"]  # curl: send the header with an empty value
    else:
        h = hdrs + [f"Authorization: {value}"]
    assert_401(curl_req(route[0], p.url + path, h, body))
    assert_unchanged_auth(p, before)


def assert_unchanged_auth(p, before):
    assert p.alive()
    st, _, body = http("GET", p.url + "/healthz")
    assert st == 200 and json.loads(body) == {"status": "ok"}
    assert snapshot_auth(p) == before, "a refused write changed the state"


@pytest.mark.parametrize("route", WRITES, ids=lambda r: f"{r[0]} {r[1]}")
def test_write_with_the_right_token_works(start_psd, token_file, route):
    p, before = seeded(start_psd, token_file)
    path, hdrs, body, want, changed = recipe(route[0], route[1])
    st, _, out = curl_req(route[0], p.url + path, hdrs + [f"Authorization: Bearer {TOKEN}"],
                          body)
    assert st == want, out
    assert_changed(p, before, changed)


@pytest.mark.parametrize("route", WRITES, ids=lambda r: f"{r[0]} {r[1]}")
def test_401_comes_before_the_body(start_psd, token_file, route):
    """Without a token the refusal comes from the headers alone."""
    p, before = seeded(start_psd, token_file)
    path, hdrs, body, _, _ = recipe(route[0], route[1])
    with connect(p.port, timeout=5) as s:
        s.sendall(request_head(route[0], path, hdrs, content_length=len(body or b"")))
        assert_401(read_response(s, timeout=5))
    assert_unchanged_auth(p, before)


def test_token_checked_before_name_and_existence(start_psd, token_file):
    """No one learns whether a variable exists, or what names are valid, without it."""
    p, before = seeded(start_psd, token_file)
    for path in ("/v1/vars/nope/grad", "/v1/vars/a..b/grad"):
        assert_401(curl_req("POST", p.url + path, [], b"\0" * 48))
    assert_401(curl_req("PUT", p.url + "/v1/vars/a..b", ["X-Shape: 3,4"], b"\0" * 48))
    assert_unchanged_auth(p, before)


@pytest.mark.parametrize("route", READS, ids=lambda r: f"{r[0]} {r[1]}")
def test_reads_open_without_auth_reads(start_psd, token_file, route):
    p, before = seeded(start_psd, token_file)
    path, hdrs, body, want, _ = recipe(route[0], route[1])
    st, hd, out = send(p, route[0], path, hdrs, body)
    assert st == want, out
    assert_read(route[1], hd, out, before)
    if route[0] == "GET":  # (a read POST has no HEAD: that is its GET sibling's)
        st, hd, out = http("HEAD", p.url + path)
        assert st == want and out == b"", (st, out)
        assert hd.get("content-type", "").split(";")[0] == READ_TYPES[route[1]], hd
    assert_unchanged_auth(p, before)


@pytest.mark.parametrize("auth", ["none", "wrong_same_length", "shorter", "basic",
                                  "empty_header"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
def test_auth_reads_closes_every_route_not_open(start_psd, token_file, route, auth):
    p, before = seeded(start_psd, token_file, "--auth_reads")
    method, tpath, _, is_open = route
    path, hdrs, body, want, _ = recipe(method, tpath)
    value = BAD_AUTH[auth]
    h = list(hdrs)
    if value == "":
        h.append("Authorization;")
    elif value is not None:
        h.append(f"Authorization: {value}")
    r = send(p, method, path, h, body)
    if is_open:
        assert r[0] == want, r
    else:
        assert_401(r)
        if method == "GET":
            st, hd, _ = http("HEAD", p.url + path,
                             headers={"Authorization": value} if value else None)
            assert st == 401 and "www-authenticate" in hd
    assert_unchanged_auth(p, before)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]} {r[1]}")
def test_auth_reads_right_token_works(start_psd, token_file, route):
    p, before = seeded(start_psd, token_file, "--auth_reads")
    path, hdrs, body, want, changed = recipe(route[0], route[1])
    st, hd, out = send(p, route[0], path, hdrs + [f"Authorization: Bearer {TOKEN}"], body)
    assert st == want, out
    if route[0] == "GET":
        assert_read(route[1], hd, out, before)
    assert_changed(p, before, changed)


@pytest.mark.parametrize("auth_reads", [False, True])
def test_readyz_is_open(start_psd, token_file, auth_reads):
    """Before the chief configured training, /readyz says 503 (not 401) to anyone;
    after, 200 - with or without --auth_reads, with no token or a wrong one."""
    p = start_psd(f"--auth_token_file={token_file}", *(["--auth_reads"] if auth_reads else []))
    for h in ([], ["Authorization: Bearer wrong"]):
        assert_error(*curl_req("GET", p.url + "/readyz", h), 503, "chief")
    r = curl_req("PUT", p.url + "/v1/config", [], b"{}")  # the configuration needs the token
    assert_401(r)
    assert_error(*curl_req("GET", p.url + "/readyz"), 503)
    st, _, out = curl_req("PUT", p.url + "/v1/config", [f"Authorization: Bearer {TOKEN}"], b"{}")
    assert st == 200, out
    for h in ([], ["Authorization: Bearer wrong"]):
        st, hd, out = curl_req("GET", p.url + "/readyz", h)
        assert st == 200 and json.loads(out) == {"status": "ready"}, out
        st, _, _ = curl_req("HEAD", p.url + "/readyz", h, extra=["-I"])
        assert st == 200


def test_no_token_file_means_open_writes(start_psd):
    p = start_psd()
    st, _, body = http("PUT", p.url + "/v1/vars/w", W.tobytes(), {"X-Shape": "3,4"})
    assert st == 201, body


# ------------------------------------------------------------ bad token files

def run_psd(*args, timeout=20):
    e = dict(os.environ)
    e.pop("TF_CONFIG", None)
    proc = subprocess.Popen([binary("psd"), "--port=0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=e)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"psd {args} kept running instead of exiting 2")
    return proc.returncode, out.decode(), err.decode()


def assert_refused(rc, out, err, *words):
    assert rc == 2, (rc, out, err)
    assert "listening" not in out
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0], f"want one line on stderr, got {err!r}"
    for w in words:
        assert w in lines[0], f"{lines[0]!r} does not mention {w!r}"


def test_missing_token_file(tmp_path):
    path = str(tmp_path / "no-such-token")
    assert_refused(*run_psd(f"--auth_token_file={path}"), path)


@pytest.mark.parametrize("content", [b"", b"\n", b"  \n\t\n"])
def test_empty_token_file(tmp_path, content):
    f = tmp_path / "token"
    f.write_bytes(content)
    assert_refused(*run_psd(f"--auth_token_file={f}"), str(f), "empty")


def test_token_file_is_a_directory(tmp_path):
    assert_refused(*run_psd(f"--auth_token_file={tmp_path}"), str(tmp_path))


def test_token_with_inner_space(tmp_path):
    f = tmp_path / "token"
    f.write_text("two words\n")
    assert_refused(*run_psd(f"--auth_token_file={f}"), str(f))


def test_auth_reads_without_token_file():
    assert_refused(*run_psd("--auth_reads"), "--auth_token_file")


# ------------------------------------------- the contract's table, every method

def openapi_routes():
    """(METHOD, path) of every operation openapi/openapi.yaml describes."""
    import yaml
    from conftest import ROOT
    with open(os.path.join(ROOT, "openapi", "openapi.yaml")) as f:
        doc = yaml.safe_load(f)
    methods = {"get", "head", "put", "post", "delete", "patch", "options", "trace"}
    return {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops if m in methods}


def test_every_write_of_the_contract_is_a_write_route():
    """Every PUT/POST/DELETE/PATCH operation of the contract is in psd's
    table marked write (so the 401 tests above walk it); no GET is."""
    table = {(m, p): w for m, p, w, _ in ROUTES}
    contract = openapi_routes()
    writes = {r for r in contract if r[0] in ("PUT", "POST", "DELETE", "PATCH")} - READ_POSTS
    assert writes, "the contract lists no write operation"
    for r in writes:
        assert table.get(r) is True, f"{r} is in openapi.yaml but not a write route of psd --routes"
    for r in contract - writes:
        if r[0] == "GET":
            assert table.get(r) is False, f"{r}: a read of the contract, but the table says {table.get(r)}"


@pytest.mark.parametrize("auth", ["none", "wrong_same_length"])
def test_no_method_writes_without_the_token(start_psd, token_file, auth):
    """Every path of the contract and of the table, with every writing method
    (PUT, POST, DELETE, PATCH), a body and no token or a wrong one: 401 for a
    write route, 405 for a method the path does not have; psd still runs
    (POST /v1/shutdown among them) and holds exactly what it held. With the
    right token, DELETE and PATCH are still 405: no hidden write method."""
    p, before = seeded(start_psd, token_file)
    writes = {(m, path) for m, path, w, _ in WRITES}
    paths = sorted({path for _, path in openapi_routes()} | {r[1] for r in ROUTES})
    value = BAD_AUTH[auth]
    auth_h = {"Authorization": value} if value else {}
    tried = 0
    for path in paths:
        concrete = path.replace("{name}", "w")
        for m in ("PUT", "POST", "DELETE", "PATCH"):
            st, hd, body = http(m, p.url + concrete, b'{"worker": 0, "optimizer": "sgd"}',
                                dict(auth_h, **{"Content-Type": "application/json"}))
            if (m, path) in writes:
                assert_401((st, hd, body))
            elif (m, path) in READ_POSTS:
                assert st not in (401, 405) and st < 500, (m, path, st, body)  # a read, this body refused
            else:
                assert st == 405, (m, path, st, body)
            tried += 1
    assert tried >= 4 * len(paths)
    assert_unchanged_auth(p, before)
    for path in paths:
        for m in ("DELETE", "PATCH"):
            st, _, body = http(m, p.url + path.replace("{name}", "w"),
                               headers={"Authorization": f"Bearer {TOKEN}"})
            assert st == 405, (m, path, st, body)
    assert_unchanged_auth(p, before)
