"""The ring's endpoint gets psd's defences (issue 23: the endpoint layer is
shared, so the ring's and the pipeline's endpoints are defended as psd is):

- a request target over 8 KiB or with 256+ query arguments is refused with
  414 at once (common/endpoint.c endpoint_uri_guard), before libmicrohttpd
  parses the query into the connection's memory; the previous ring endpoint
  parsed the 2,000 arguments and answered as for any request (405 here);
- idle connections (connect, send nothing) cannot lock a neighbour out:
  the ring endpoint keeps at most 256 connections (a thread each) and, near
  that, each new one shuts down the one that has waited longest for its
  request head (common/conntrack.c, as psd); behind 1,200 idle connections
  the previous ring endpoint reset a normal client's connection.

A ring member whose neighbour never comes serves while it waits
(bin/ring_allreduce --timeout_secs), as tests/system/test_ring.py uses it."""
import time

import pytest

from conftest import binary, http
from syshelp import assert_error, connect, read_response
from test_hostile_exhaustion import flood, normal_client_time, want_fds
from test_ring import hosts, procs  # noqa: F401 (fixture)


def waiting_member(procs, floats=10, piece_bytes=8):  # noqa: F811
    h = hosts(2)
    port = int(h.split(",")[0].rsplit(":", 1)[1])
    procs.start([binary("ring_allreduce"), f"--worker_hosts={h}", "--task_index=0", f"--floats={floats}",
                 f"--piece_bytes={piece_bytes}", "--timeout_secs=60"])
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if http("GET", base + "/healthz", timeout=1)[0] == 200:
                return port, base
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the ring member never served /healthz")


def test_ring_endpoint_answers_a_long_query_at_once(procs):  # noqa: F811
    port, base = waiting_member(procs)
    for target in (b"/v1/ring/chunk?" + b"offset=1&" * 2000, b"/healthz/" + b"w" * 9000):
        s = connect(port)
        t0 = time.time()
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        st, hd, body = read_response(s, timeout=3)
        s.close()
        assert time.time() - t0 < 3
        assert_error(st, hd, body, 414, "")
    assert http("GET", base + "/healthz")[0] == 200


def test_ring_endpoint_idle_flood_does_not_lock_a_neighbour_out(procs):  # noqa: F811
    n = want_fds(1200)
    if n < 1100:
        pytest.skip(f"this process may hold only {n + 200} descriptors (hard limit)")
    port, base = waiting_member(procs)
    held = []
    try:
        held = flood(port, n, half_sent=False)
        time.sleep(1.0)
        took, what = normal_client_time(base)
        assert took is not None and took < 1.0, (
            f"a normal client waited {took} s with {len(held)} idle connections held open: {what}")
        assert what[0] == 200
        print(f"{len(held)} idle connections held: a client answered in {took * 1000:.0f} ms")
    finally:
        for s in held:
            try:
                s.close()
            except OSError:
                pass
    # the member still serves once they are gone
    assert http("GET", base + "/healthz", timeout=2)[0] == 200


def test_ring_endpoint_cuts_a_body_that_trickles(procs):  # noqa: F811
    # issue 37: the ring's endpoint (and a pipeline stage's) had no floor under a body's rate (psd
    # has 1 KiB/s): a piece's body sent a byte a second held its connection, a slot of 256, for as
    # long as the sender liked (each byte reset the idle timeout); now, past 10 s, a body must
    # average 1 KiB/s there too, and the connection is closed
    import socket
    port, base = waiting_member(procs, floats=10000, piece_bytes=4096)
    # a piece the member expects (worker 1's first 4 KiB), its body a byte a second
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.sendall(b"POST /v1/ring/chunk?step=0&k=0&offset=0&from=1&n=2&floats=10000 HTTP/1.1\r\nHost: x\r\n"
              b"Content-Length: 4096\r\n\r\n")
    t0, closed = time.time(), None
    try:
        while time.time() - t0 < 25 and closed is None:
            try:
                s.send(b"\0")
                s.settimeout(1.0)
                if s.recv(1) == b"":
                    closed = time.time() - t0
            except socket.timeout:
                pass
            except OSError:
                closed = time.time() - t0
    finally:
        s.close()
    assert closed is not None and 9 <= closed <= 20, f"a body trickling a byte a second: closed after {closed} s"
    print(f"a trickling body was cut after {closed:.1f} s")
    assert http("GET", base + "/healthz", timeout=2)[0] == 200
