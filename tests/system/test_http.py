"""psd's happy paths through the real curl and through libps (ps_stress, workerd),
checked against values computed here with numpy and an independent safetensors
parser written from the format's definition."""
import json
import os
import signal
import struct
import subprocess
import time

import numpy as np
import pytest

from conftest import binary, curl, http
from procs import free_port

DATA = "/usr/share/datasets/fashion-mnist"


def put(url, name, arr):
    arr = np.ascontiguousarray(arr, dtype="<f4")
    shape = ",".join(str(d) for d in arr.shape)
    return http("PUT", f"{url}/v1/vars/{name}", arr.tobytes(), {"X-Shape": shape})


def get_raw(url, name):
    st, h, body = http("GET", f"{url}/v1/vars/{name}")
    assert st == 200, body
    shape = tuple(int(x) for x in h["x-shape"].split(",")) if h["x-shape"] else ()
    return np.frombuffer(body, dtype="<f4").reshape(shape), h


def parse_safetensors(buf):
    """Written from the format's definition, not from our C reader."""
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    data = buf[8 + n:]
    meta = header.pop("__metadata__", {})
    out = {}
    for name, t in header.items():
        assert t["dtype"] == "F32"
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(data[b:e], dtype="<f4").reshape(t["shape"])
    return out, meta, 8 + n


def build_safetensors(tensors, meta):
    header = {"__metadata__": meta}
    off = 0
    blobs = []
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def test_put_get_raw_and_json_with_curl(psd, tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((784, 100)).astype("<f4")
    f = tmp_path / "w.bin"
    f.write_bytes(w.tobytes())
    r = curl("-i", "-X", "PUT", "-H", "X-Shape: 784,100", "--data-binary", f"@{f}", f"{psd.url}/v1/vars/hid_w")
    assert r.returncode == 0 and b" 201 " in r.stdout.split(b"\r\n")[0], r.stdout[:300]
    r = curl(f"{psd.url}/v1/vars/hid_w")
    assert r.stdout == w.tobytes()
    r = curl(f"{psd.url}/v1/vars/hid_w?format=json")
    j = json.loads(r.stdout)
    assert j["shape"] == [784, 100] and j["dtype"] == "float32" and j["version"] == 1
    assert np.array_equal(np.array(j["values"], dtype="<f4"), w.ravel())
    r = curl("-H", "Accept: application/json", f"{psd.url}/v1/vars/hid_w?offset=100&count=5")
    j = json.loads(r.stdout)
    assert np.array_equal(np.array(j["values"], dtype="<f4"), w.ravel()[100:105])
    assert j["offset"] == 100 and j["count"] == 5
    r = curl("-D", "-", "-o", "/dev/null", f"{psd.url}/v1/vars/hid_w?offset=7&count=3")
    assert b"X-Shape: 3\r\n" in r.stdout
    st, h, body = http("GET", f"{psd.url}/v1/vars/hid_w?offset=7&count=3")
    assert body == w.ravel()[7:10].tobytes()
    # replace: 200, version 2
    st, h, body = put(psd.url, "hid_w", w * 2)
    assert st == 200 and json.loads(body)["version"] == 2 and json.loads(body)["created"] is False


def test_head_etag_and_304(psd):
    put(psd.url, "b", np.arange(10, dtype="<f4"))
    r = curl("-I", f"{psd.url}/v1/vars/b")
    head = r.stdout.decode()
    assert "HTTP/1.1 200" in head and "X-Shape: 10" in head and "Content-Length: 40" in head
    etag = [l.split(": ", 1)[1].strip() for l in head.split("\r\n") if l.lower().startswith("etag:")][0]
    r = curl("-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", f"If-None-Match: {etag}", f"{psd.url}/v1/vars/b")
    assert r.stdout == b"304"
    # a new version makes the old ETag stale
    http("POST", f"{psd.url}/v1/vars/b/grad", np.ones(10, dtype="<f4").tobytes())
    r = curl("-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", f"If-None-Match: {etag}", f"{psd.url}/v1/vars/b")
    assert r.stdout == b"200"
    # JSON and raw have different ETags
    _, h1, _ = http("GET", f"{psd.url}/v1/vars/b")
    _, h2, _ = http("GET", f"{psd.url}/v1/vars/b?format=json")
    assert h1["etag"] != h2["etag"]


def test_create_only_412(psd):
    a = np.zeros(3, dtype="<f4")
    st, _, _ = http("PUT", f"{psd.url}/v1/vars/x", a.tobytes(), {"X-Shape": "3", "If-None-Match": "*"})
    assert st == 201
    st, _, body = http("PUT", f"{psd.url}/v1/vars/x", (a + 1).tobytes(), {"X-Shape": "3", "If-None-Match": "*"})
    assert st == 412 and "error" in json.loads(body)
    v, _ = get_raw(psd.url, "x")
    assert np.array_equal(v, a)


def test_grad_sgd_matches_numpy(start_psd):
    p = start_psd("--learning_rate=0.1")
    rng = np.random.default_rng(2)
    w = rng.standard_normal((20, 7)).astype("<f4")
    put(p.url, "layer1/w", w)
    expect = w.copy()
    for i in range(3):
        g = rng.standard_normal((20, 7)).astype("<f4")
        st, _, body = http("POST", f"{p.url}/v1/vars/layer1/w/grad", g.tobytes())
        assert st == 200, body
        assert json.loads(body)["global_step"] == i + 1
        expect = (expect - np.float32(0.1) * g).astype("<f4")
    got, h = get_raw(p.url, "layer1/w")
    assert np.allclose(got, expect, rtol=1e-6, atol=1e-7)
    assert h["x-version"] == "4"


def test_stats_against_numpy(psd):
    x = np.array([1.5, -2.0, np.nan, 4.0, np.inf, 0.25], dtype="<f4")
    put(psd.url, "s", x)
    j = json.loads(curl(f"{psd.url}/v1/vars/s/stats").stdout)
    fin = x[np.isfinite(x)].astype(np.float64)
    assert j["nan_count"] == 1 and j["inf_count"] == 1 and j["count"] == 6
    assert j["min"] == fin.min() and j["max"] == fin.max()
    assert abs(j["mean"] - fin.mean()) < 1e-9
    assert abs(j["l2_norm"] - np.sqrt((fin ** 2).sum())) < 1e-6
    # NaN comes out of JSON values as null
    j = json.loads(curl(f"{psd.url}/v1/vars/s?format=json").stdout)
    assert j["values"][2] is None and j["values"][0] == 1.5


def test_bulk_params_and_grads_numpy(start_psd):
    p = start_psd("--learning_rate=0.5")
    rng = np.random.default_rng(3)
    vals = {"hid_w": rng.standard_normal((784, 100)).astype("<f4"),
            "hid_b": np.zeros(100, dtype="<f4"),
            "sm_w": rng.standard_normal((100, 10)).astype("<f4"),
            "sm_b": np.zeros(10, dtype="<f4")}
    for k, v in vals.items():
        assert put(p.url, k, v)[0] == 201
    r = curl("-D", "-", f"{p.url}/v1/params")
    head, _, body = r.stdout.partition(b"\r\n\r\n")
    assert b"X-Global-Step: 0" in head
    got, meta, data_start = parse_safetensors(body)
    assert data_start % 8 == 0
    assert meta["global_step"] == "0"
    assert set(got) == set(vals)
    for k in vals:
        assert np.array_equal(got[k], vals[k])
    # a bulk push of two of the four
    g = {"hid_w": rng.standard_normal((784, 100)).astype("<f4"), "sm_b": np.ones(10, dtype="<f4")}
    body = build_safetensors(g, {"worker": "1", "step": "0", "loss": "2.25", "batch_size": "100"})
    st, _, ans = http("POST", f"{p.url}/v1/grads", body, {"X-Push-Id": "w1-s0"})
    assert st == 200, ans
    assert json.loads(ans) == {"global_step": 1, "duplicate": False, "outcome": "applied"}
    st, _, ans = http("POST", f"{p.url}/v1/grads", body, {"X-Push-Id": "w1-s0"})
    assert st == 200 and json.loads(ans)["duplicate"] is True and json.loads(ans)["global_step"] == 1
    assert json.loads(ans)["outcome"] == "duplicate"
    got, meta, _ = parse_safetensors(http("GET", f"{p.url}/v1/params")[2])
    assert meta["global_step"] == "1"
    assert np.array_equal(got["hid_w"], (vals["hid_w"] - np.float32(0.5) * g["hid_w"]).astype("<f4"))
    assert np.array_equal(got["sm_b"], vals["sm_b"] - np.float32(0.5))
    assert np.array_equal(got["hid_b"], vals["hid_b"]) and np.array_equal(got["sm_w"], vals["sm_w"])
    status = json.loads(http("GET", f"{p.url}/v1/status")[2])
    assert status["last_loss"] == 2.25 and status["global_step"] == 1 and status["variables"] == 4
    assert status["bytes"] == sum(v.nbytes for v in vals.values())


def test_list_and_status(psd):
    put(psd.url, "a", np.zeros((2, 3), dtype="<f4"))
    put(psd.url, "z/b", np.zeros(5, dtype="<f4"))
    j = json.loads(curl(f"{psd.url}/v1/vars").stdout)
    assert j["global_step"] == 0
    assert [(v["name"], v["shape"], v["bytes"]) for v in j["vars"]] == [("a", [2, 3], 24), ("z/b", [5], 20)]
    j = json.loads(curl(f"{psd.url}/healthz").stdout)
    assert j == {"status": "ok"}
    j = json.loads(curl(f"{psd.url}/v1/status").stdout)
    assert j["task"] == {"type": "ps", "index": 0} and j["variables"] == 2 and j["requests_served"] >= 3


def test_concurrent_pushers_and_pullers_see_consistent_versions(start_psd):
    p = start_psd("--learning_rate=0.5")
    r = subprocess.run([binary("ps_stress"), p.host_port, "3", "2", "1", "4"], capture_output=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    res = json.loads(r.stdout)
    assert res["violations"] == 0 and res["errors"] == 0
    assert res["bulk_pushes"] > 10 and res["pulls"] > 10 and res["param_pulls"] > 10
    # and curl agrees with the final count
    j = json.loads(curl(f"{p.url}/v1/vars/stress/a?format=json&count=3").stdout)
    assert j["values"] == [-float(res["bulk_pushes"])] * 3


def load_safetensors(path):
    with open(path, "rb") as f:
        got, meta, _ = parse_safetensors(f.read())
    return got, meta


@pytest.mark.skipif(not os.path.isdir(DATA), reason=f"{DATA} is missing: make deps installs "
                    "dataset-fashion-mnist (workerd trains on it)")
def test_workerd_trains_through_libps(psd, tmp_path):
    """workerd (the chief) creates the variables, configures and trains 5 async
    steps through libps; curl then finds exactly what the same training gives
    in one process without a ps (workerd --local)."""
    args = ["--train_steps=5", "--optimizer=momentum", "--learning_rate=0.05", "--seed=7",
            "--log_every=1", f"--data_dir={DATA}"]
    r = subprocess.run([binary("workerd"), f"--ps_hosts={psd.host_port}",
                        "--worker_hosts=localhost:1", "--keep_ps"] + args,
                       capture_output=True, timeout=120)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()
    assert "created 4 variables" in out and "global step 5" in out, out
    local = tmp_path / "local.safetensors"
    r = subprocess.run([binary("workerd"), "--local", f"--export={local}"] + args,
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    want, meta = load_safetensors(local)
    assert meta["global_step"] == "5"

    j = json.loads(curl(f"{psd.url}/v1/vars").stdout)
    assert j["global_step"] == 5
    assert {v["name"]: (tuple(v["shape"]), v["version"]) for v in j["vars"]} == \
        {k: (v.shape, 6) for k, v in want.items()}  # created, then 5 updates
    for name, w in want.items():
        got = np.frombuffer(curl(f"{psd.url}/v1/vars/{name}").stdout, dtype="<f4")
        assert got.tobytes() == w.tobytes(), name
    s = json.loads(curl(f"{psd.url}/v1/status").stdout)
    assert (s["ready"], s["mode"], s["optimizer"], s["workers_done"]) == \
        (True, "async", "momentum", 1)
    assert json.loads(curl(f"{psd.url}/v1/config").stdout)["momentum"] == pytest.approx(0.9)
    assert psd.alive()  # --keep_ps


@pytest.mark.skipif(not os.path.isdir(DATA), reason=f"{DATA} is missing: make deps installs "
                    "dataset-fashion-mnist (workerd loads it before it connects)")
def test_libps_reports_unreachable_shard():
    """The chief waits for a ps nobody listens on, printing libps's error,
    which names the shard and its address; it keeps waiting until stopped."""
    port = free_port()
    p = subprocess.Popen([binary("workerd"), f"--ps_hosts=127.0.0.1:{port}",
                          "--worker_hosts=localhost:1", "--timeout_ms=500",
                          "--recovery_wait_secs=0.1", f"--data_dir={DATA}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = p.stdout.readline().decode()
        if line.startswith("workerd: using the "):  # the backend it chose comes first
            line = p.stdout.readline().decode()
        assert "waiting for the ps tasks" in line, line
        assert f"ps 0 (127.0.0.1:{port})" in line and "GET /healthz" in line, line
        time.sleep(0.3)
        assert p.poll() is None, "workerd gave up instead of waiting for the ps"
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
        p.communicate(timeout=10)


def test_a_page_closed_during_its_event_stream_leaves_no_raw_libmicrohttpd_line(start_psd):
    # issue 37: each page visit left "Failed to send the chunked response body for the request for
    # `/v1/events'. Error: The connection was forcibly closed by remote peer" in psd's log
    import socket
    p = start_psd()
    w = np.zeros(4, np.float32).tobytes()
    assert http("PUT", p.url + "/v1/vars/w", w, {"X-Shape": "4"})[0] in (200, 201)
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", p.port))
        s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a tab closing
        s.close()
        for _ in range(15):  # steps the stream would send
            assert http("POST", p.url + "/v1/vars/w/grad", w)[0] == 200
            time.sleep(0.03)
    time.sleep(0.5)
    err = p.read_stderr()
    assert "Failed to send" not in err and "forcibly closed" not in err, err[-2000:]


def test_head_of_a_streamed_answer_has_no_body_and_the_connection_goes_on(start_psd):
    # a HEAD of a streamed (chunked) answer (format=json, /v1/events) carried the chunked terminator,
    # which a client on the same kept-alive connection read as its next answer (schemathesis:
    # "Connection aborted"); now the headers alone, and the next request on it is answered
    import socket
    p = start_psd()
    assert http("PUT", p.url + "/v1/vars/w", np.zeros(4, np.float32).tobytes(), {"X-Shape": "4"})[0] in (200, 201)
    for path in (b"/v1/vars/w?format=json&count=0", b"/v1/vars/w?format=json", b"/v1/events"):
        s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
        s.sendall(b"HEAD " + path + b" HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        got, t0 = b"", time.time()
        while got.count(b"HTTP/1.1 ") < 2 or not got.endswith(b"}\n"):
            chunk = s.recv(65536)
            if not chunk or time.time() - t0 > 5:
                break
            got += chunk
        s.close()
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and rest.startswith(b"HTTP/1.1 200"), (path, got[:600])
