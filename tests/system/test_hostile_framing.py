"""Request framing (issue 23, RFC 9112 section 6.3, RFC 9110 section 5.5):
a request whose body framing is ambiguous (Content-Length and
Transfer-Encoding both), a folded header line, or a raw NUL or other control
byte in a header value or the request line is refused with 400 before any
handler runs, and the connection is closed, so a request hidden in the body
never runs; a request target too long for psd (over 8 KiB, or 256 query arguments or
more) is answered with 414 at once."""
import socket
import time

import numpy as np
import pytest

from conftest import http
from syshelp import assert_error, assert_unchanged, connect, put_var, read_response, snapshot, st_grads

HIDDEN = (b"PUT /v1/vars/smug HTTP/1.1\r\nHost: x\r\nX-Shape: 1\r\nX-Dtype: float32\r\n"
          b"Content-Length: 4\r\n\r\n\x00\x00\x80?")


def answers(port, raw, timeout=5):
    """Every (status, body) psd sends for raw, and whether it then closed."""
    s = connect(port)
    s.sendall(raw)
    out = []
    closed = False
    try:
        while True:
            try:
                st, _, body = read_response(s, timeout=timeout)
            except ConnectionError:
                closed = True
                break
            out.append((st, body))
    except socket.timeout:
        closed = False
    except ConnectionResetError:
        closed = True
    finally:
        s.close()
    return out, closed


def assert_refused_and_closed(psd, raw, status=400):
    got, closed = answers(psd.port, raw)
    assert [st for st, _ in got] == [status], got
    assert b'"error"' in got[0][1], got
    assert closed, "the connection was left open after the refusal"
    st, _, _ = http("GET", psd.url + "/v1/vars/smug")
    assert st == 404, "the request hidden in the body ran"


@pytest.mark.parametrize("path", ["/v1/grads", "/v1/vars/w"])
def test_content_length_with_transfer_encoding_is_refused_and_closes(psd, path):
    method = "POST" if path == "/v1/grads" else "GET"
    body = b"0\r\n\r\n" + HIDDEN
    raw = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
           f"Transfer-Encoding: chunked\r\n\r\n").encode() + body
    assert_refused_and_closed(psd, raw)


def test_folded_content_length_is_refused(psd):
    body = b"0\r\n\r\n" + HIDDEN
    raw = (b"POST /v1/grads HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n " + str(len(body)).encode() +
           b"\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert_refused_and_closed(psd, raw)


@pytest.mark.parametrize("header", [b"X-Shape: 1\x00,5", b"X-Dtype: float32\x00x",
                                    b"Content-Length: 4\x00 9", b"X-Junk: a\x01b",
                                    b"X-Junk: a\x7fb"])
def test_control_byte_in_a_header_value_is_refused(psd, header):
    lines = [b"PUT /v1/vars/smug HTTP/1.1", b"Host: x", b"X-Shape: 1", b"X-Dtype: float32",
             b"Content-Length: 4"]
    name = header.split(b":", 1)[0]
    lines = [ln for ln in lines if ln.split(b":", 1)[0] != name] + [header]
    raw = b"\r\n".join(lines) + b"\r\n\r\n\x00\x00\x80?"
    assert_refused_and_closed(psd, raw)


def test_nul_in_the_request_line_is_refused(psd):
    st, _, _ = http("PUT", psd.url + "/v1/vars/w", body=b"\x00\x00\x80?",
                    headers={"X-Shape": "1", "X-Dtype": "float32"})
    assert st == 201
    got, closed = answers(psd.port, b"GET /v1/vars/w\x00x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [st for st, _ in got] == [400], got
    assert closed


@pytest.mark.parametrize("target", [b"/v1/vars?" + b"offset=1&" * 2000,  # 18 KB, 2,000 arguments
                                    b"/v1/vars?" + b"a&" * 300,  # 600 bytes, 300 arguments
                                    b"/v1/vars/" + b"w" * 9000],  # no query, 9 KB
                         ids=["2000-arguments", "300-arguments", "9KB-path"])
def test_long_query_is_answered_at_once(psd, target):
    """libmicrohttpd 0.9.75 parsed the 2,000 arguments into the connection's
    128 KiB pool before any callback, then could not build its own 431: the
    client waited for the idle timeout. psd's URI callback marks such a
    target before the query is parsed, and the request is refused with 414."""
    raw = b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    s = connect(psd.port)
    t0 = time.time()
    s.sendall(raw)
    st, hd, body = read_response(s, timeout=2)
    s.close()
    assert time.time() - t0 < 2
    assert_error(st, hd, body, 414, "request target" if b"?" not in target else "")
    st, _, _ = http("GET", psd.url + "/v1/vars?" + "&".join(f"a{i}=1" for i in range(200)))
    assert st == 200  # 200 arguments are fine


# Values that overflow or change meaning (issue 23): every integer of a push's
# metadata is range-checked before any arithmetic, and a refusal names it.
@pytest.mark.parametrize("key,value", [("clock", "9223372036854775807"),
                                       ("worker", "4294967296"),
                                       ("worker", "4096"),
                                       ("step", "9223372036854775807"),
                                       ("batch_size", "9223372036854775807")])
def test_push_metadata_integer_out_of_range_is_refused(psd, key, value):
    put_var(psd.url, "w", np.zeros((3, 4), np.float32))
    before = snapshot(psd.url)
    meta = {"worker": "0", "step": "0", "clock": "0", "batch_size": "1"}
    meta[key] = value
    body = st_grads([("w", np.ones((3, 4), np.float32))], meta)
    st, hd, resp = http("POST", psd.url + "/v1/grads", body)
    assert_error(st, hd, resp, 400, key)
    assert_unchanged(psd, before)


@pytest.mark.parametrize("key", ["min_step", "min_clock", "clock"])
def test_pull_query_integer_out_of_range_is_refused(psd, key):
    put_var(psd.url, "w", np.zeros((3, 4), np.float32))
    before = snapshot(psd.url)
    st, hd, resp = http("GET", f"{psd.url}/v1/params?worker=0&{key}=9223372036854775807&timeout_ms=0")
    assert_error(st, hd, resp, 400, key)
    assert_unchanged(psd, before)


# A NUL just before a separator (issue 37): libmicrohttpd cuts the head in
# place, writing a NUL over each separator, so a NUL the client sent right
# before a space, the query's '?', a CRLF or the end of the head read as a
# string's end; the check skipped every NUL and answered 200.
NUL_HEADS = {
    "path-before-space": b"GET /v1/vars/w\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    "path-before-query": b"GET /v1/vars/w\x00?format=json HTTP/1.1\r\nHost: x\r\n\r\n",
    "query-before-space": b"GET /v1/vars/w?format=json\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    "version-before-crlf": b"GET /v1/vars/w HTTP/1.1\x00\r\nHost: x\r\n\r\n",
    "value-before-crlf": b"GET /v1/vars/w HTTP/1.1\r\nHost: x\x00\r\n\r\n",
    "value-end-of-head": b"GET /v1/vars/w HTTP/1.1\r\nHost: x\r\nX-A: b\x00\r\n\r\n",
    "empty-value": b"GET /v1/vars/w HTTP/1.1\r\nHost: x\r\nX-A:\x00\r\n\r\n",
    "method-before-space": b"GET\x00 /v1/vars/w HTTP/1.1\r\nHost: x\r\n\r\n",
    "escaped-path": b"GET /v1/vars/%77\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
}

# what they must not be confused with: the same heads without the NUL
FINE_HEADS = {
    "empty-query": b"GET /v1/vars/w? HTTP/1.1\r\nHost: x\r\n\r\n",
    "query": b"GET /v1/vars/w?offset=0&x=&y&&count=1& HTTP/1.1\r\nHost: x\r\n\r\n",
    "escapes": b"GET /v1/vars/%77?offs%65t=%30&c%6funt=1 HTTP/1.1\r\nHost: x\r\n\r\n",
    "empty-value": b"GET /v1/vars/w HTTP/1.1\r\nHost: x\r\nX-A:\r\nX-B: \t\r\n\r\n",
    "spaces": b"GET /v1/vars/w HTTP/1.1\r\nHost:   x  \r\n\r\n",
}


@pytest.fixture
def psd_w(psd):
    st, _, _ = http("PUT", psd.url + "/v1/vars/w", body=b"\x00\x00\x80?",
                    headers={"X-Shape": "1", "X-Dtype": "float32"})
    assert st == 201
    return psd


@pytest.mark.parametrize("raw", NUL_HEADS.values(), ids=NUL_HEADS.keys())
def test_nul_before_a_separator_is_refused_and_closes(psd_w, raw):
    got, closed = answers(psd_w.port, raw, timeout=3)
    assert [st for st, _ in got] == [400], got
    assert closed, "the connection was left open after the refusal"


@pytest.mark.parametrize("raw", FINE_HEADS.values(), ids=FINE_HEADS.keys())
def test_heads_like_them_without_a_nul_are_served(psd_w, raw):
    s = connect(psd_w.port)
    s.sendall(raw)
    st, _, body = read_response(s, timeout=3)
    s.close()
    assert st == 200, body
