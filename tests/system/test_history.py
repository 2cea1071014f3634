"""GET /v1/history, GET /v1/events (Server-Sent Events) and ps 0's view of the
other shards, against real psd processes.

Independent of the server's code: the losses are chosen by the test and pushed
over HTTP, so every history point is checked against what was pushed; the
event stream is read from a raw socket and decoded here (HTTP/1.1 chunked
framing, then the line format of the HTML standard's Server-Sent Events); CPU
time comes from /proc/PID/stat and memory from /proc/PID/status.

The keepalive test waits the full 15 s the contract names (both threading
modes at once), so this file takes about half a minute.
"""
import http.client as httpc
import json
import math
import os
import socket
import threading
import time

import numpy as np
import pytest

from conftest import BIN, http
from procs import free_port
from syshelp import st_grads

RECENT, LONG_SLOTS = 2048, 2048  # common/history.h
MAX_POINTS = RECENT + LONG_SLOTS


# ---------------------------------------------------------------- helpers

class Client:
    """One keep-alive HTTP/1.1 connection (fast loops of requests)."""

    def __init__(self, port, headers=None):
        self.conn = httpc.HTTPConnection("127.0.0.1", port, timeout=10)
        self.headers = headers or {}

    def req(self, method, path, body=None, headers=None):
        h = dict(self.headers)
        h.update(headers or {})
        self.conn.request(method, path, body=body, headers=h)
        r = self.conn.getresponse()
        return r.status, r.read()

    def json(self, method, path, body=None, headers=None, want=200):
        st, b = self.req(method, path, body, headers)
        assert st == want, (method, path, st, b[:300])
        return json.loads(b)

    def push(self, loss):
        """One bulk push with this loss; returns the new global_step."""
        body = st_grads([("w", np.ones(1, np.float32))], {"loss": repr(float(loss))})
        return self.json("POST", "/v1/grads", body)["global_step"]

    def close(self):
        self.conn.close()


def setup_var(p):
    c = Client(p.port)
    st, b = c.req("PUT", "/v1/vars/w", np.zeros(1, np.float32).tobytes(), {"X-Shape": "1"})
    assert st == 201, b
    return c


def history(p, since=None, headers=None):
    q = "" if since is None else f"?since={since}"
    st, hd, body = http("GET", p.url + "/v1/history" + q, headers=headers)
    assert st == 200, body
    assert hd["content-type"].startswith("application/json")
    doc = json.loads(body)
    assert set(doc) == {"global_step", "points", "eval"}, doc.keys()
    return doc


def status(p, headers=None):
    st, _, body = http("GET", p.url + "/v1/status", headers=headers)
    assert st == 200, body
    return json.loads(body)


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Stream:
    """A GET /v1/events read from a raw socket: HTTP/1.1 chunked framing and
    the SSE line format decoded here. blocks() yields each block (the lines
    up to a blank line) as a list of (field, value); a comment is (":", text)."""

    def __init__(self, port, headers=(), path="/v1/events"):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Accept: text/event-stream"]
        lines += list(headers)
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed before the response head: {buf!r}")
            buf += chunk
        head, self.raw = buf.split(b"\r\n\r\n", 1)
        hl = head.decode("latin-1").split("\r\n")
        self.status = int(hl[0].split()[1])
        self.headers = {}
        for line in hl[1:]:
            k, v = line.split(":", 1)
            self.headers[k.strip().lower()] = v.strip()
        self.chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        self.text = ""      # decoded body not yet cut into lines
        self.ended = False  # the last chunk (or the close) came
        self.pending = []   # the block being read
        self._decode()

    def _decode(self):
        if not self.chunked:
            self.text += self.raw.decode()
            self.raw = b""
            return
        while b"\r\n" in self.raw:
            size_line, rest = self.raw.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                self.ended = True
                self.raw = b""
                return
            if len(rest) < size + 2:
                return
            assert rest[size:size + 2] == b"\r\n", "bad chunk framing"
            self.text += rest[:size].decode()
            self.raw = rest[size + 2:]

    def block(self, timeout):
        """The next block, or None when none came within timeout; EOFError at the end."""
        deadline = time.monotonic() + timeout
        while True:
            while "\n" in self.text:
                line, self.text = self.text.split("\n", 1)
                line = line.rstrip("\r")
                if line == "":
                    if self.pending:
                        b, self.pending = self.pending, []
                        return b
                    continue
                if line.startswith(":"):
                    self.pending.append((":", line[1:].strip()))
                else:
                    k, _, v = line.partition(":")
                    self.pending.append((k, v[1:] if v.startswith(" ") else v))
            if self.ended:
                raise EOFError("the stream ended")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                return None
            if not chunk:
                self.ended = True
            self.raw += chunk
            self._decode()

    def event(self, timeout):
        """The next status event as (id, data dict), skipping comments and retry
        lines; None on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            b = self.block(max(0.0, deadline - time.monotonic()))
            if b is None:
                return None
            fields = dict((k, v) for k, v in b if k != ":")
            if "data" in fields:
                assert fields.get("event") == "status", b
                return int(fields["id"]), json.loads(fields["data"])

    def close(self):
        self.sock.close()


def open_stream(p, headers=()):
    s = Stream(p.port, headers)
    assert s.status == 200, s.headers
    assert s.headers["content-type"].startswith("text/event-stream"), s.headers
    assert "no-store" in s.headers.get("cache-control", "") or \
        "no-cache" in s.headers.get("cache-control", ""), s.headers
    return s


# ---------------------------------------------------------------- history

def test_history_follows_pushes_and_since(start_psd):
    p = start_psd()
    c = setup_var(p)
    assert history(p) == {"global_step": 0, "points": [], "eval": []}
    # steps without any loss yet: no point, but global_step moves
    g = np.ones(1, np.float32).tobytes()
    for _ in range(2):
        assert c.req("POST", "/v1/vars/w/grad", g)[0] == 200
    assert history(p) == {"global_step": 2, "points": [], "eval": []}
    t0 = time.time()
    want = {}
    for i in range(40):
        loss = 2.0 / (1 + i) + 0.001 * i
        want[c.push(loss)] = loss
    # a one-variable gradient carries no loss: its step keeps the last one
    assert c.req("POST", "/v1/vars/w/grad", g)[0] == 200
    want[43] = want[42]
    t1 = time.time()
    doc = history(p)
    assert doc["global_step"] == 43 == status(p)["global_step"]
    pts = doc["points"]
    assert [q[0] for q in pts] == list(range(3, 44))
    for step, loss, t in pts:
        assert math.isclose(loss, want[step], rel_tol=1e-9), (step, loss, want[step])
        assert t0 - 1 <= t <= t1 + 1, (t0, t, t1)
    assert [q[2] for q in pts] == sorted(q[2] for q in pts)
    # since: only later steps
    for since in (0, 3, 20, 42):
        assert history(p, since)["points"] == [q for q in pts if q[0] > since]
    assert history(p, 43)["points"] == [] and history(p, 10**12)["points"] == []
    # HEAD: the same headers, no body
    st, hd, body = http("HEAD", p.url + "/v1/history?since=5")
    assert st == 200 and body == b"" and hd["content-type"].startswith("application/json")
    c.close()


@pytest.mark.parametrize("since", ["x", "-1", "", "1.5", "1e3", "99999999999999999999", " 1"])
def test_history_bad_since(psd, since):
    from urllib.parse import quote
    st, hd, body = http("GET", psd.url + "/v1/history?since=" + quote(since))
    assert st == 400, (since, st, body)
    assert "since" in json.loads(body)["error"]


def test_history_eval_points(start_psd):
    p = start_psd()
    c = setup_var(p)
    for i in range(5):
        c.push(1.0)

    def report(step, loss, acc):
        body = json.dumps({"global_step": step, "loss": loss, "accuracy": acc}).encode()
        assert c.req("POST", "/v1/eval", body, {"Content-Type": "application/json"})[0] == 200

    report(2, 0.9, 0.5)
    report(4, 0.7, 0.6)
    report(4, 0.65, 0.62)  # the same step again: replaces
    report(3, 0.1, 0.9)    # older than the last report: not kept
    report(5, 0.6, 0.7)
    ev = history(p)["eval"]
    assert [e[:3] for e in ev] == [[2, 0.9, 0.5], [4, 0.65, 0.62], [5, 0.6, 0.7]]
    assert all(abs(e[3] - time.time()) < 30 for e in ev)
    assert [e[0] for e in history(p, 4)["eval"]] == [5]
    c.close()


def test_history_decimation_keeps_first_last_and_order(start_psd):
    """More pushes than the ring and the long history hold: the answer stays
    bounded, every point is one that was pushed, in order, the first and the
    last are there, the recent ones are whole and the older ones evenly
    thinned."""
    p = start_psd()
    c = setup_var(p)
    n = 3 * MAX_POINTS // 2 + 77  # the long history is thinned twice or more
    want = {}
    for i in range(n):
        loss = 1.0 + ((i * 7919) % 1000) / 1000.0  # each step's loss is distinct enough
        want[c.push(loss)] = loss
    c.close()
    doc = history(p)
    pts = doc["points"]
    steps = [q[0] for q in pts]
    assert doc["global_step"] == n
    assert len(pts) <= MAX_POINTS
    assert steps == sorted(set(steps)), "points out of order or repeated"
    assert steps[0] == 1 and steps[-1] == n
    for step, loss, _ in pts:
        assert math.isclose(loss, want[step], rel_tol=1e-9), (step, loss, want[step])
    # the most recent RECENT steps are all there
    assert steps[-RECENT:] == list(range(n - RECENT + 1, n + 1))
    old = steps[:-RECENT]
    gaps = {b - a for a, b in zip(old, old[1:])}
    assert len(gaps) == 1, f"older points not evenly thinned: gaps {sorted(gaps)[:10]}"
    stride = gaps.pop()
    assert stride >= 2
    assert steps[-RECENT] - old[-1] <= stride, "a hole between the old and the recent points"
    # since inside the thinned part
    mid = old[len(old) // 2]
    assert [q[0] for q in history(p, mid)["points"]] == [s for s in steps if s > mid]


def test_million_step_synthetic_history_stays_fast_and_small(start_psd):
    n = 1_000_000
    big = start_psd(env={"RESTPS_TEST_SYNTHETIC_HISTORY": str(n)})
    small = start_psd(env={"RESTPS_TEST_SYNTHETIC_HISTORY": "1000"})
    c = Client(big.port)
    times = []
    for _ in range(6):
        t = time.monotonic()
        st, body = c.req("GET", "/v1/history")
        times.append(time.monotonic() - t)
        assert st == 200
    doc = json.loads(body)
    assert max(times[1:]) < 0.2, f"/v1/history took {times}"
    pts = doc["points"]
    assert doc["global_step"] == n
    assert 3000 <= len(pts) <= MAX_POINTS
    steps = [q[0] for q in pts]
    assert steps[0] == 1 and steps[-1] == n and steps == sorted(set(steps))
    losses = [q[1] for q in pts]
    assert all(0.2 < x < 2.5 for x in losses)
    assert np.mean(losses[:50]) > 2 * np.mean(losses[-50:]), "the synthetic loss should decay"
    ts = [q[2] for q in pts]
    assert ts == sorted(ts) and abs(ts[-1] - time.time()) < 60
    assert 40 <= len(doc["eval"]) <= 60
    t = time.monotonic()
    recent = c.json("GET", f"/v1/history?since={n - 1000}")["points"]
    assert time.monotonic() - t < 0.2
    assert [q[0] for q in recent] == list(range(n - 999, n + 1))
    s = c.json("GET", "/v1/status")
    assert s["global_step"] == n
    # the run goes on from the synthetic history
    st, _ = c.req("PUT", "/v1/vars/w", np.zeros(1, np.float32).tobytes(), {"X-Shape": "1"})
    assert st == 201
    assert c.push(0.125) == n + 1
    assert history(big, n)["points"][0][:2] == [n + 1, 0.125]
    c.close()
    # memory does not grow with the history's length
    history(small)
    big_kib, small_kib = rss_kib(big.proc.pid), rss_kib(small.proc.pid)
    assert big_kib - small_kib < 8 * 1024, (big_kib, small_kib)


def test_steps_per_sec(start_psd):
    p = start_psd()
    c = setup_var(p)
    assert status(p)["steps_per_sec"] == 0
    t0 = time.monotonic()
    k = 0
    while time.monotonic() - t0 < 2.0:
        c.push(1.0)
        k += 1
        time.sleep(0.005)
    elapsed = time.monotonic() - t0
    sps = status(p)["steps_per_sec"]
    assert 0.6 * k / elapsed <= sps <= 1.4 * k / elapsed, (sps, k, elapsed)
    c.close()
    # no steps for longer than the window: back to 0
    time.sleep(5.5)
    assert status(p)["steps_per_sec"] == 0


# ---------------------------------------------------------------- events

MODES = [pytest.param(["--http_threads=2"], id="epoll-pool"),
         pytest.param(["--http_threads=1"], id="epoll-one")]


@pytest.mark.parametrize("mode", MODES)
def test_events_first_at_once_then_on_change(start_psd, mode):
    p = start_psd(*mode)
    c = setup_var(p)
    c.push(0.5)
    t = time.monotonic()
    s = open_stream(p)
    first = s.block(5)
    assert first == [("retry", "1000")], first
    ev = s.event(5)
    assert ev is not None and time.monotonic() - t < 1.0, "no first event at once"
    eid, data = ev
    want = status(p)
    assert eid == data["global_step"] == want["global_step"] == 1
    for k in ("task", "variables", "bytes", "last_loss", "mode", "shards"):
        assert data[k] == want[k], k
    assert "steps_per_sec" in data and "workers" in data
    # nothing changes: no event
    assert s.event(0.5) is None
    # a push: an event at once
    t = time.monotonic()
    c.push(0.25)
    ev = s.event(5)
    assert ev is not None and time.monotonic() - t < 1.0
    assert ev[0] == 2 and ev[1]["last_loss"] == 0.25
    # the evaluator's report: an event too (same step)
    body = json.dumps({"global_step": 2, "loss": 0.3, "accuracy": 0.75}).encode()
    assert c.req("POST", "/v1/eval", body)[0] == 200
    ev = s.event(5)
    assert ev is not None and ev[0] == 2 and ev[1]["eval"]["accuracy"] == 0.75
    s.close()
    c.close()


@pytest.mark.parametrize("mode", MODES)
def test_events_reconnect_with_last_event_id(start_psd, mode):
    p = start_psd(*mode)
    c = setup_var(p)
    c.push(1.0)
    s = open_stream(p)
    eid, _ = s.event(5)
    s.close()
    c.push(1.0)
    c.push(1.0)
    # missed steps: the current status at once
    s = open_stream(p, [f"Last-Event-ID: {eid}"])
    ev = s.event(2)
    assert ev is not None and ev[0] == eid + 2
    s.close()
    # seen already: nothing until the next change, then that change
    s = open_stream(p, [f"Last-Event-ID: {eid + 2}"])
    assert s.block(2) == [("retry", "1000")]
    assert s.event(0.7) is None
    c.push(1.0)
    ev = s.event(2)
    assert ev is not None and ev[0] == eid + 3
    s.close()
    # an id that is not a step: as a fresh client
    s = open_stream(p, ["Last-Event-ID: garbage"])
    ev = s.event(2)
    assert ev is not None and ev[0] == eid + 3
    s.close()
    c.close()


@pytest.mark.parametrize("mode", MODES)
def test_events_at_most_ten_a_second(start_psd, mode):
    p = start_psd(*mode)
    setup_var(p).close()
    s = open_stream(p)
    assert s.event(5) is not None
    stop = threading.Event()
    pushed = []

    def pusher():
        c = Client(p.port)
        while not stop.is_set():
            c.push(1.0)
            pushed.append(1)
        c.close()

    th = threading.Thread(target=pusher)
    th.start()
    got = []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 3.0:
            ev = s.event(max(0.0, 3.0 - (time.monotonic() - t0)))
            if ev:
                got.append((time.monotonic(), ev[0]))
    finally:
        stop.set()
        th.join(10)
    assert len(pushed) > 100, "the push loop did not run fast enough to test the limit"
    assert 10 <= len(got) <= 33, f"{len(got)} events in 3 s for {len(pushed)} pushes"
    ids = [i for _, i in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    gaps = sorted(b - a for (a, _), (b, _) in zip(got, got[1:]))
    assert gaps[len(gaps) // 2] >= 0.09, f"median gap {gaps[len(gaps) // 2]:.3f} s"
    # the last step is delivered once the pushes stop
    final = status(p)["global_step"]
    deadline = time.monotonic() + 3
    last = ids[-1]
    while last != final and time.monotonic() < deadline:
        ev = s.event(0.5)
        if ev:
            last = ev[0]
    assert last == final
    s.close()


@pytest.mark.parametrize("mode", MODES)
def test_events_many_clients_do_not_hold_http_threads(start_psd, mode):
    p = start_psd(*mode)
    c = setup_var(p)
    streams = [open_stream(p) for _ in range(24)]
    for s in streams:
        assert s.event(5) is not None
    # every HTTP thread would be taken if a stream held one: requests still go through
    for _ in range(5):
        t = time.monotonic()
        st, _, _ = http("GET", p.url + "/healthz", timeout=5)
        assert st == 200 and time.monotonic() - t < 1.0
    step = c.push(1.0)
    for s in streams:
        ev = s.event(5)
        assert ev is not None and ev[0] == step
    for s in streams:
        s.close()
    c.close()


@pytest.mark.skipif("asan" in BIN, reason="a 15 s wait for the keepalive and a CPU-time figure: "
                    "the optimized build measures them; the SSE paths run under ASan in the other "
                    "event tests (make test time)")
def test_events_idle_cpu_and_keepalive(start_psd):
    """A pool and one epoll thread at once: an idle psd with a stream open
    burns no CPU, and a `: keepalive` comment comes 15 s after the last write."""
    ps = [start_psd("--http_threads=2"), start_psd("--http_threads=1")]
    streams = []
    for p in ps:
        s = open_stream(p)
        assert s.event(5) is not None
        streams.append(s)
    time.sleep(0.5)
    tick = os.sysconf("SC_CLK_TCK")
    before = [cpu_ticks(p.proc.pid) for p in ps]
    t0 = time.monotonic()
    time.sleep(2.0)
    used = [(cpu_ticks(p.proc.pid) - b) / tick for p, b in zip(ps, before)]
    assert all(u <= 0.04 for u in used), f"idle psd used {used} s of CPU in 2 s"
    for s in streams:
        b = s.block(17 - (time.monotonic() - t0))
        assert b == [(":", "keepalive")], b
        waited = time.monotonic() - t0 + 0.5
        assert 13 <= waited <= 17.5, waited
    # the whole idle time, keepalives included
    used = [(cpu_ticks(p.proc.pid) - b) / tick for p, b in zip(ps, before)]
    assert all(u <= 0.15 for u in used), f"idle psd used {used} s of CPU in 15 s"
    for s in streams:
        s.close()


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_with_streams_open(start_psd, mode):
    p = start_psd(*mode)
    streams = [open_stream(p) for _ in range(4)]
    for s in streams:
        assert s.event(5) is not None
    t = time.monotonic()
    rc = p.stop()
    assert rc == 0 and time.monotonic() - t < 3.0, (rc, time.monotonic() - t)
    for s in streams:
        with pytest.raises(EOFError):
            while True:
                if s.block(5) is None:
                    raise AssertionError("the stream neither ended nor closed")
        s.close()


def test_events_head(psd):
    st, hd, body = http("HEAD", psd.url + "/v1/events")
    assert st == 200 and body == b""
    assert hd["content-type"].startswith("text/event-stream")


# ---------------------------------------------------------------- shards

def test_ps0_shows_every_shard(start_psd, tmp_path):
    token = "shard-Token_1"
    tf = tmp_path / "token"
    tf.write_text(token + "\n")
    ports = [free_port(), free_port()]
    hosts = f"--ps_hosts=127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    common = [hosts, f"--auth_token_file={tf}", "--auth_reads"]
    ps1 = start_psd(*common, "--task_index=1", port0=False)
    ps0 = start_psd(*common, "--task_index=0", port0=False)
    auth = {"Authorization": "Bearer " + token}
    c1 = Client(ps1.port, auth)
    for name, n in (("a", 10), ("b/c", 3)):
        st, b = c1.req("PUT", f"/v1/vars/{name}", np.zeros(n, np.float32).tobytes(),
                       {"X-Shape": str(n)})
        assert st == 201, b
    for _ in range(3):
        assert c1.req("POST", "/v1/vars/a/grad", np.ones(10, np.float32).tobytes())[0] == 200
    c1.close()
    s1 = status(ps1, auth)
    assert s1["shards"] == [{"task": 1, "address": f"127.0.0.1:{ports[1]}", "up": True,
                             "global_step": 3, "variables": 2, "bytes": 52}]
    want1 = {"task": 1, "address": f"127.0.0.1:{ports[1]}", "up": True,
             "global_step": s1["global_step"], "variables": s1["variables"],
             "bytes": s1["bytes"]}
    deadline = time.monotonic() + 6
    while True:
        sh = status(ps0, auth)["shards"]
        if sh[1] == want1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sh[1] == want1, sh
    assert sh[0] == {"task": 0, "address": f"127.0.0.1:{ports[0]}", "up": True,
                     "global_step": 0, "variables": 0, "bytes": 0}
    # the same list reaches the page through /v1/events
    s = Stream(ps0.port, ["Authorization: Bearer " + token])
    assert s.status == 200
    assert s.event(5)[1]["shards"][1] == want1
    s.close()
    # ps 1 stops: ps 0 says it is down, and still answers at once
    assert ps1.stop() == 0
    deadline = time.monotonic() + 6
    while True:
        t = time.monotonic()
        sh = status(ps0, auth)["shards"]
        assert time.monotonic() - t < 1.0
        if not sh[1]["up"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sh[1]["up"] is False and sh[1]["task"] == 1, sh
    assert sh[0]["up"] is True
    # stopping ps 0 with its fetcher running is prompt and clean
    t = time.monotonic()
    assert ps0.stop() == 0 and time.monotonic() - t < 3.0
