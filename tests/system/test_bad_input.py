"""Bad input against a real psd: every refusal has its exact status and a JSON
{"error": "..."} that names the problem, and afterwards the server still
answers and its variables (bytes, versions), global_step and last_loss are
exactly what they were."""
import json
import socket
import struct
import time

import numpy as np
import pytest

from conftest import http
from syshelp import (assert_error, assert_unchanged, chunked, connect, curl_req, get_raw,
                     put_var, raw_request, read_response, request_head, snapshot, st_body,
                     st_grads)

LR = 0.5
W = (np.arange(12, dtype=np.float32) * 0.25 - 1.0).reshape(3, 4)
B = np.array([1.0, -2.0, 3.5, 0.125], dtype=np.float32)
NESTED = "nested/layer.0/k-1_x"
N = np.array([7.0, 8.0], dtype=np.float32)


@pytest.fixture
def srv(start_psd):
    """psd with w [3,4], b [4], a nested name, one applied push (step 1, a loss)."""
    p = start_psd(f"--learning_rate={LR}")
    put_var(p.url, "w", W)
    put_var(p.url, "b", B)
    put_var(p.url, NESTED, N)
    body = st_grads([("b", np.ones(4, np.float32))], meta={"worker": "0", "step": "0",
                                                              "loss": "2.5"})
    st, _, out = http("POST", p.url + "/v1/grads", body)
    assert st == 200 and json.loads(out)["global_step"] == 1, out
    before = snapshot(p.url)
    assert before["global_step"] == 1 and before["last_loss"] == 2.5
    assert set(before["vars"]) == {"w", "b", NESTED}
    return p, before


def check(p, before, resp, want_status, *words):
    msg = assert_error(*resp, want_status, *words)
    assert_unchanged(p, before)
    return msg


# ------------------------------------------------------------- unknown var 404

@pytest.mark.parametrize("method,suffix,data", [
    ("GET", "", None),
    ("GET", "?format=json", None),
    ("GET", "/stats", None),
    ("POST", "/grad", b"\0" * 8),
])
def test_unknown_variable_404(srv, method, suffix, data):
    p, before = srv
    r = curl_req(method, f"{p.url}/v1/vars/nope{suffix}", data=data)
    check(p, before, r, 404, "nope")


def test_unknown_variable_head_404(srv):
    p, before = srv
    st, hd, body = http("HEAD", p.url + "/v1/vars/nope")
    assert st == 404 and body == b""
    assert_unchanged(p, before)


def test_unknown_path_404(srv):
    p, before = srv
    check(p, before, curl_req("GET", p.url + "/v2/nothing"), 404, "/v2/nothing")


# ----------------------------------------------------------- PUT body vs shape

@pytest.mark.parametrize("name", ["w", "fresh"])
@pytest.mark.parametrize("nbytes", [0, 4, 47, 49, 96])
def test_put_body_length_mismatch(srv, name, nbytes):
    p, before = srv
    r = curl_req("PUT", f"{p.url}/v1/vars/{name}", ["X-Shape: 3,4"], b"\x01" * nbytes)
    check(p, before, r, 400, "bytes", "3,4")


@pytest.mark.parametrize("nbytes", [44, 52])
def test_put_chunked_body_length_mismatch(srv, nbytes):
    """Without Content-Length the length is only known at the end: still 400."""
    p, before = srv
    r = curl_req("PUT", f"{p.url}/v1/vars/w", ["X-Shape: 3,4", "Transfer-Encoding: chunked"],
                 b"\x01" * nbytes)
    check(p, before, r, 400, "bod")


def test_put_bad_dtype(srv):
    p, before = srv
    r = curl_req("PUT", f"{p.url}/v1/vars/w", ["X-Shape: 3,4", "X-Dtype: float64"], b"\0" * 96)
    check(p, before, r, 400, "float64")


# --------------------------------------------------------------- grad mismatch

@pytest.mark.parametrize("xshape", ["4,3", "12", "3,4,1", "1,3,4", "2,4"])
def test_grad_shape_mismatch(srv, xshape):
    p, before = srv
    r = curl_req("POST", f"{p.url}/v1/vars/w/grad", [f"X-Shape: {xshape}"], b"\0" * 48)
    check(p, before, r, 400, xshape, "3,4")


@pytest.mark.parametrize("nbytes", [0, 4, 44, 47, 52, 96])
def test_grad_body_length_mismatch(srv, nbytes):
    p, before = srv
    r = curl_req("POST", f"{p.url}/v1/vars/w/grad", [], b"\0" * nbytes)
    check(p, before, r, 400, "w", "bytes")


@pytest.mark.parametrize("nbytes", [44, 52])
def test_grad_chunked_length_mismatch(srv, nbytes):
    p, before = srv
    r = curl_req("POST", f"{p.url}/v1/vars/w/grad", ["Transfer-Encoding: chunked"],
                 b"\0" * nbytes)
    check(p, before, r, 400)


# -------------------------------------------------------------- bad X-Shape

BAD_SHAPES = {
    "negative": "-3,4",
    "negative_second": "3,-4",
    "zero": "0,4",
    "zero_second": "3,0",
    "dim_over_max": "1099511627777",
    "product_overflow": "1048576,1048577",
    "product_overflow_int64": "4294967296,4294967296",
    "int64_overflow": "99999999999999999999999",
    "non_numeric": "abc",
    "hex": "0x10",
    "float": "3.5,4",
    "x_separator": "3x4",
    "space_separator": "3 4",
    "empty_dim": "3,,4",
    "leading_comma": ",3,4",
    "trailing_comma": "3,4,",
    "plus_sign": "+3,4",
    "too_many_dims": "1,1,1,1,1,1,1,1,1",
}


@pytest.mark.parametrize("case", sorted(BAD_SHAPES))
def test_put_bad_x_shape(srv, case):
    p, before = srv
    xs = BAD_SHAPES[case]
    r = curl_req("PUT", f"{p.url}/v1/vars/w", [f"X-Shape: {xs}"], b"\0" * 48)
    check(p, before, r, 400, "shape")


@pytest.mark.parametrize("case", sorted(BAD_SHAPES))
def test_grad_bad_x_shape(srv, case):
    p, before = srv
    r = curl_req("POST", f"{p.url}/v1/vars/w/grad", [f"X-Shape: {BAD_SHAPES[case]}"],
                 b"\0" * 48)
    check(p, before, r, 400, "shape")


def test_put_missing_x_shape(srv):
    p, before = srv
    check(p, before, curl_req("PUT", f"{p.url}/v1/vars/w", [], b"\0" * 48), 400, "X-Shape")


def test_put_shape_over_body_limit_413(srv):
    """A well-formed shape whose bytes exceed --max_body_bytes (1 GiB): 413, not 400."""
    p, before = srv
    r = curl_req("PUT", f"{p.url}/v1/vars/w", ["X-Shape: 1048576,1048576"], b"\0" * 48)
    check(p, before, r, 413, "max_body_bytes")


def test_put_non_utf8_x_shape(srv):
    """A byte that is not UTF-8 in X-Shape is still a 400 with a JSON error."""
    p, before = srv
    r = curl_req("PUT", f"{p.url}/v1/vars/w", [b"X-Shape: 3,\xff"], b"\0" * 48)
    check(p, before, r, 400, "shape")


def test_put_non_utf8_x_dtype(srv):
    p, before = srv
    r = curl_req("PUT", f"{p.url}/v1/vars/w", ["X-Shape: 3,4", b"X-Dtype: float\xff"],
                 b"\0" * 48)
    check(p, before, r, 400, "dtype")


# ------------------------------------------------------ bad safetensors pushes

def F32(shape, begin):
    n = int(np.prod(shape)) * 4
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, begin + n]}


ZEROS48 = b"\0" * 48
GOOD_HEADER = {"w": F32([3, 4], 0)}


def _bad_bodies():
    good = st_body(GOOD_HEADER, ZEROS48)
    hdr_len = struct.unpack("<Q", good[:8])[0]
    dup = b'{"w":' + json.dumps(F32([3, 4], 0)).encode() + b',"w":' + \
        json.dumps(F32([3, 4], 48)).encode() + b'}'
    return {
        # (body, words the error must contain)
        "empty_body": (b"", ["prefix"]),
        "shorter_than_prefix": (b"\x05\0\0\0", ["prefix"]),
        "header_len_past_body": (st_body(GOOD_HEADER, ZEROS48, header_len=10_000), ["header"]),
        "header_len_one_past": (struct.pack("<Q", hdr_len + 49) + good[8:], ["header"]),
        "header_len_huge": (st_body(GOOD_HEADER, ZEROS48, header_len=2 ** 63 + 5), ["header"]),
        "header_len_zero": (st_body(GOOD_HEADER, ZEROS48, header_len=0), ["header"]),
        "header_truncated_json": (st_body(b'{"w":{"dtype":"F32","sha', ZEROS48), ["JSON"]),
        "header_not_json": (st_body(b"hello world!", ZEROS48), ["JSON"]),
        "header_array": (st_body(b"[1,2,3]", b""), ["object"]),
        "header_string": (st_body(b'"w"', b""), ["object"]),
        "header_number": (st_body(b"12", b""), ["object"]),
        "header_null": (st_body(b"null", b""), ["object"]),
        "entry_not_object": (st_body({"w": 5}, b""), ["w"]),
        "entry_missing_offsets": (st_body({"w": {"dtype": "F32", "shape": [3, 4]}}, ZEROS48),
                                  ["w", "data_offsets"]),
        "entry_offsets_three": (st_body({"w": {"dtype": "F32", "shape": [3, 4],
                                               "data_offsets": [0, 48, 96]}}, ZEROS48),
                                ["w", "data_offsets"]),
        "entry_offsets_negative": (st_body({"w": {"dtype": "F32", "shape": [3, 4],
                                                  "data_offsets": [-48, 0]}}, ZEROS48),
                                   ["w"]),
        "entry_offsets_strings": (st_body({"w": {"dtype": "F32", "shape": [3, 4],
                                                 "data_offsets": ["0", "48"]}}, ZEROS48),
                                  ["w"]),
        "shape_negative_dim": (st_body({"w": {"dtype": "F32", "shape": [-3, 4],
                                              "data_offsets": [0, 48]}}, ZEROS48), ["w"]),
        "shape_float_dim": (st_body({"w": {"dtype": "F32", "shape": [3.0, 4],
                                           "data_offsets": [0, 48]}}, ZEROS48), ["w"]),
        "shape_too_many_dims": (st_body({"w": {"dtype": "F32", "shape": [1] * 9 + [12],
                                               "data_offsets": [0, 48]}}, ZEROS48), ["w"]),
        "shape_overflow": (st_body({"w": {"dtype": "F32", "shape": [2 ** 32, 2 ** 32, 16],
                                          "data_offsets": [0, 48]}}, ZEROS48), ["w"]),
        "offsets_past_data": (st_body({"w": {"dtype": "F32", "shape": [3, 4],
                                             "data_offsets": [0, 400]}}, ZEROS48),
                              ["w", "range"]),
        "offsets_begin_after_end": (st_body({"w": {"dtype": "F32", "shape": [3, 4],
                                                   "data_offsets": [48, 0]}}, ZEROS48),
                                    ["w", "range"]),
        "offsets_huge": (st_body({"w": {"dtype": "F32", "shape": [3, 4],
                                        "data_offsets": [2 ** 62, 2 ** 62 + 48]}}, ZEROS48),
                         ["w"]),
        "offsets_size_not_shape": (st_body({"w": {"dtype": "F32", "shape": [3, 4],
                                                  "data_offsets": [0, 44]}}, b"\0" * 44),
                                   ["w"]),
        "offsets_overlap": (st_body({"w": F32([3, 4], 0), "b": F32([4], 40)}, b"\0" * 64),
                            ["overlap"]),
        "offsets_same_range": (st_body({"b": F32([4], 0), NESTED: {"dtype": "F32", "shape": [4],
                                                                  "data_offsets": [0, 16]}},
                                       b"\0" * 32), ["overlap"]),
        "offsets_hole": (st_body({"w": F32([3, 4], 0), "b": F32([4], 52)}, b"\0" * 68),
                         ["hole"]),
        "trailing_data": (st_body(GOOD_HEADER, ZEROS48 + b"\0" * 8), ["48", "56"]),
        "truncated_data": (st_body(GOOD_HEADER, ZEROS48[:20]), ["w"]),
        "data_missing": (st_body(GOOD_HEADER, b""), ["w"]),
        "unknown_dtype": (st_body({"w": {"dtype": "F33", "shape": [3, 4],
                                         "data_offsets": [0, 48]}}, ZEROS48), ["F33"]),
        "dtype_not_string": (st_body({"w": {"dtype": 32, "shape": [3, 4],
                                            "data_offsets": [0, 48]}}, ZEROS48), ["w"]),
        "duplicate_names": (st_body(dup + b" " * (-len(dup) % 8), b"\0" * 96), ["duplicate"]),
        "no_tensors": (st_body({}, b""), ["gradient"]),
        "only_metadata": (st_body({"__metadata__": {"worker": "1"}}, b""), ["gradient"]),
        "metadata_not_object": (st_body({"__metadata__": ["worker", "1"], **GOOD_HEADER},
                                        ZEROS48), ["__metadata__"]),
        "metadata_value_not_string": (st_body({"__metadata__": {"worker": 1}, **GOOD_HEADER},
                                              ZEROS48), ["worker"]),
        "unknown_variable": (st_grads([("nope", np.zeros(3, np.float32))]), ["nope"]),
        "unknown_variable_after_known": (st_grads([("w", np.ones((3, 4), np.float32)),
                                                   ("zzz/nope", np.zeros(3, np.float32))]),
                                         ["zzz/nope"]),
        "invalid_name": (st_grads([("../etc", np.zeros(3, np.float32))]), ["../etc"]),
        "wrong_shape_transposed": (st_grads([("w", np.ones((4, 3), np.float32))]),
                                   ["w", "4,3", "3,4"]),
        "wrong_shape_flat": (st_grads([("w", np.ones(12, np.float32))]), ["w", "12"]),
        "wrong_shape_after_good": (st_grads([("b", np.ones(4, np.float32)),
                                             ("w", np.ones((2, 6), np.float32))]), ["w", "2,6"]),
        "scalar_for_vector": (st_grads([("b", np.float32(1.0).reshape(()))]), ["b"]),
        "dtype_f64": (st_body({"w": {"dtype": "F64", "shape": [3, 4], "data_offsets": [0, 96]}},
                              np.ones(12).astype("<f8").tobytes()), ["w", "F64"]),
        "dtype_f8": (st_body({"w": {"dtype": "F8_E4M3", "shape": [3, 4], "data_offsets": [0, 12]}},
                             b"\0" * 12), ["w", "F8_E4M3"]),  # (F16 and BF16 are taken: test_wire)
        "dtype_i32_after_f32": (st_body({"b": F32([4], 0),
                                         "w": {"dtype": "I32", "shape": [3, 4],
                                               "data_offsets": [16, 64]}}, b"\0" * 64),
                                ["w", "I32"]),
    }


BAD_BODIES = _bad_bodies()


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_grads_bad_safetensors(srv, case):
    p, before = srv
    body, words = BAD_BODIES[case]
    r = curl_req("POST", p.url + "/v1/grads", ["Content-Type: application/octet-stream"], body)
    check(p, before, r, 400, *words)


BAD_META = {
    "worker_word": ("worker", "abc"),
    "worker_float": ("worker", "1.5"),
    "worker_negative": ("worker", "-1"),
    "worker_empty": ("worker", ""),
    "worker_overflow": ("worker", "99999999999999999999999"),
    "worker_trailing": ("worker", "3x"),
    "step_negative": ("step", "-3"),
    "step_word": ("step", "seven"),
    "batch_size_negative": ("batch_size", "-32"),
    "batch_size_float": ("batch_size", "32.5"),
    "loss_nan": ("loss", "nan"),
    "loss_inf": ("loss", "inf"),
    "loss_neg_inf": ("loss", "-Infinity"),
    "loss_overflow": ("loss", "1e999"),
    "loss_word": ("loss", "low"),
    "loss_empty": ("loss", ""),
    "loss_trailing": ("loss", "0.5abc"),
}


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_grads_bad_metadata(srv, case):
    p, before = srv
    key, val = BAD_META[case]
    meta = {"worker": "1", "step": "5", "batch_size": "32", "loss": "0.75"}
    meta[key] = val
    body = st_grads([("w", np.ones((3, 4), np.float32))], meta=meta)
    r = curl_req("POST", p.url + "/v1/grads", [], body)
    check(p, before, r, 400, key)


def test_grads_loss_non_utf8_truncation(srv):
    """A long bad loss value whose echo would be cut inside a UTF-8 character."""
    p, before = srv
    body = st_grads([("w", np.ones((3, 4), np.float32))], meta={"loss": "x" * 31 + "\u00e9" * 8})
    r = curl_req("POST", p.url + "/v1/grads", [], body)
    check(p, before, r, 400, "loss")


def test_grads_header_not_utf8(srv):
    p, before = srv
    h = b'{"w\xff":' + json.dumps(F32([3, 4], 0)).encode() + b"}"
    r = curl_req("POST", p.url + "/v1/grads", [], st_body(h + b" " * (-len(h) % 8), ZEROS48))
    check(p, before, r, 400)


# ------------------------------------------------------------------ bad names

BAD_NAMES = {
    "space": "a%20b",
    "colon": "a:b",
    "star": "a*b",
    "percent_literal": "a%25b",
    "unicode": "caf%C3%A9",
    "non_utf8_byte": "a%FFb",
    "nul_byte": "w%00zz",
    "dotdot": "a..b",
    "dotdot_segment": "a/../b",
    "dotdot_start": "../w",
    "dotdot_only": "..",
    "empty_segment": "a//b",
    "trailing_slash": "w/",
    "empty": "",
    "leading_slash": "/w",
    "reserved_stats": "stats",
    "reserved_grad": "grad",
    "reserved_nested_stats": "layer/stats",
    "len_129": "n" * 129,
    "len_300": "n" * 300,
}


# /v1/vars/layer/stats is the stats route of "layer", so the nested reserved
# name is only reachable through the stats and grad routes.
NAME_CASES = [(c, r) for c in sorted(BAD_NAMES) for r in ("get", "put", "stats", "grad")
              if not (c == "reserved_nested_stats" and r in ("get", "put"))]


@pytest.mark.parametrize("case,route", NAME_CASES)
def test_bad_name(srv, case, route):
    p, before = srv
    name = BAD_NAMES[case]
    url = f"{p.url}/v1/vars/{name}" + {"get": "", "put": "", "stats": "/stats",
                                        "grad": "/grad"}[route]
    if route == "put":
        r = curl_req("PUT", url, ["X-Shape: 3,4"], ZEROS48)
    elif route == "grad":
        r = curl_req("POST", url, [], ZEROS48)
    else:
        r = curl_req("GET", url)
    check(p, before, r, 400, "reserved" if case.startswith("reserved") else "name")
    # nothing was created under a truncated or normalised name
    assert set(snapshot(p.url)["vars"]) == {"w", "b", NESTED}


def test_name_128_is_accepted(srv):
    """The positive control for the 129-character case."""
    p, _ = srv
    name = "n" * 128
    st, _, body = http("PUT", f"{p.url}/v1/vars/{name}", b"\0" * 8, {"X-Shape": "2"})
    assert st == 201, body
    assert get_raw(p.url, name) == b"\0" * 8
    st, _, body = http("GET", f"{p.url}/v1/vars/{name}/stats")
    assert st == 200 and json.loads(body)["name"] == name


def test_name_129_in_bulk_push(srv):
    p, before = srv
    r = curl_req("POST", p.url + "/v1/grads", [], st_grads([("n" * 129, np.zeros(2, np.float32))]))
    check(p, before, r, 400)


# ---------------------------------------------------------------------- 413

@pytest.fixture
def small(start_psd):
    p = start_psd("--max_body_bytes=1024", f"--learning_rate={LR}")
    put_var(p.url, "w", W)
    put_var(p.url, "b", B)
    return p, snapshot(p.url)


@pytest.mark.parametrize("method,path,extra", [
    ("POST", "/v1/grads", []),
    ("PUT", "/v1/vars/w", ["X-Shape: 2500000"]),
    ("PUT", "/v1/vars/fresh", ["X-Shape: 2500000"]),
    ("POST", "/v1/vars/w/grad", []),
])
def test_body_over_limit_refused_before_sending(small, method, path, extra):
    """Headers only, Content-Length 10 MB: the 413 must arrive without the body."""
    p, before = small
    with connect(p.port, timeout=5) as s:
        s.sendall(request_head(method, path, extra, content_length=10_000_000))
        t0 = time.time()
        r = read_response(s, timeout=5)  # not a byte of the body was sent
        assert time.time() - t0 < 4
    assert_error(*r, 413, "1024")
    assert_unchanged(p, before)


def test_body_over_limit_with_expect_continue(small):
    """curl sends Expect: 100-continue; the 413 comes instead of 100 Continue."""
    p, before = small
    with connect(p.port, timeout=5) as s:
        s.sendall(request_head("POST", "/v1/grads", ["Expect: 100-continue"],
                               content_length=10_000_000))
        r = read_response(s, timeout=5)
    assert_error(*r, 413, "1024")
    assert_unchanged(p, before)


def test_body_over_limit_curl(small):
    p, before = small
    r = curl_req("POST", p.url + "/v1/grads", [], b"\0" * 4096)
    check(p, before, r, 413, "1024")


def test_chunked_body_over_limit(small):
    """No Content-Length: the limit still holds while the body is read."""
    p, before = small
    with connect(p.port, timeout=5) as s:
        s.sendall(request_head("POST", "/v1/grads", ["Transfer-Encoding: chunked"]))
        try:
            s.sendall(chunked(b"\0" * 4096))
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = read_response(s, timeout=5)
    assert_error(*r, 413, "1024")
    assert_unchanged(p, before)


def test_put_shape_over_limit_chunked(small):
    p, before = small
    r = curl_req("PUT", p.url + "/v1/vars/w", ["X-Shape: 100,100", "Transfer-Encoding: chunked"],
                 b"\0" * 40000)
    check(p, before, r, 413, "1024")


def test_body_at_limit_is_accepted(small):
    """Positive control: exactly --max_body_bytes (256 floats) is fine."""
    p, _ = small
    st, _, body = http("PUT", p.url + "/v1/vars/big", b"\0" * 1024, {"X-Shape": "256"})
    assert st == 201, body


# --------------------------------------------------------------- NaN and Inf

@pytest.mark.parametrize("bad,word", [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
def test_grad_non_finite(srv, bad, word):
    p, before = srv
    g = np.zeros((3, 4), np.float32)
    g[1, 2] = bad
    r = curl_req("POST", f"{p.url}/v1/vars/w/grad", [], g.tobytes())
    msg = check(p, before, r, 400, word, "w")
    assert "6" in msg  # the flat index of [1, 2]


def test_grad_signalling_nan(srv):
    p, before = srv
    g = np.zeros(12, np.float32).view(np.uint32)
    g[11] = 0x7F800001  # a signalling NaN
    r = curl_req("POST", f"{p.url}/v1/vars/w/grad", [], g.tobytes())
    check(p, before, r, 400, "NaN")


@pytest.mark.parametrize("bad,word", [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
def test_grads_non_finite(srv, bad, word):
    """The finite gradient for b before the bad one for w is not applied either."""
    p, before = srv
    g = np.zeros((3, 4), np.float32)
    g[2, 3] = bad
    body = st_grads([("b", np.ones(4, np.float32)), ("w", g)], meta={"loss": "1.0"})
    r = curl_req("POST", p.url + "/v1/grads", [], body)
    check(p, before, r, 400, word, "w")


def test_grads_nan_after_other_dtype(srv):
    """A NaN in an F32 tensor that follows a 2-byte tensor (data not 4-aligned)."""
    p, before = srv
    g = np.zeros(4, np.float32)
    g[0] = np.nan
    hdr = {"h": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [2, 18]}}
    r = curl_req("POST", p.url + "/v1/grads", [], st_body(hdr, b"\0\0" + g.tobytes()))
    check(p, before, r, 400)


# ---------------------------------------------------------------- wrong method

@pytest.mark.parametrize("method,path,allow", [
    ("DELETE", "/v1/vars/w", {"GET", "HEAD", "PUT"}),
    ("POST", "/v1/vars/w", {"GET", "HEAD", "PUT"}),
    ("PATCH", "/v1/vars/w", {"GET", "HEAD", "PUT"}),
    ("POST", "/healthz", {"GET", "HEAD"}),
    ("PUT", "/v1/status", {"GET", "HEAD"}),
    ("POST", "/v1/vars", {"GET", "HEAD"}),
    ("GET", "/v1/grads", {"POST"}),
    ("PUT", "/v1/grads", {"POST"}),
    ("GET", "/v1/vars/w/grad", {"POST"}),
    ("PUT", "/v1/vars/w/stats", {"GET", "HEAD"}),
    ("DELETE", "/v1/params", {"GET", "HEAD"}),
    ("POST", "/v1/params", {"GET", "HEAD"}),
])
def test_wrong_method_405(srv, method, path, allow):
    p, before = srv
    data = ZEROS48 if method in ("POST", "PUT", "PATCH") else None
    hdrs = ["X-Shape: 3,4"] if method in ("POST", "PUT", "PATCH") else []
    r = curl_req(method, p.url + path, hdrs, data)
    check(p, before, r, 405, method)
    got = {m.strip() for m in r[1].get("allow", "").split(",") if m.strip()}
    assert got == allow, f"Allow: {r[1].get('allow')!r}"


# -------------------------------------------------------------- query values

@pytest.mark.parametrize("query,word", [
    ("offset=-1", "offset"),
    ("offset=abc", "offset"),
    ("offset=", "offset"),
    ("offset=1.5", "offset"),
    ("offset=0x2", "offset"),
    ("offset=%2B2", "offset"),
    ("offset=99999999999999999999", "offset"),
    ("offset=13", "offset"),
    ("count=-5", "count"),
    ("count=abc", "count"),
    ("count=", "count"),
    ("count=13", "count"),
    ("offset=10&count=3", "count"),
    ("offset=12&count=1", "count"),
    ("count=99999999999999999999", "count"),
    ("format=xml", "format"),
    ("format=", "format"),
    ("format=JSON%00", "format"),
    ("format=json&offset=-1", "offset"),
    ("format=json&count=13", "count"),
])
def test_bad_query(srv, query, word):
    p, before = srv
    r = curl_req("GET", f"{p.url}/v1/vars/w?{query}")
    check(p, before, r, 400, word)


def test_query_edges_are_accepted(srv):
    """Positive controls: offset=12 count=0 is an empty slice, offset=11 count=1 the last."""
    p, _ = srv
    st, hd, body = http("GET", p.url + "/v1/vars/w?offset=12&count=0")
    assert st == 200 and body == b"" and hd["x-shape"] == "0"
    st, hd, body = http("GET", p.url + "/v1/vars/w?offset=11&count=1")
    assert st == 200 and body == W.reshape(-1)[11:].tobytes()


# ------------------------------------------------------ half a body, then gone

def _half(p, head, body, how):
    s = connect(p.port, timeout=5)
    s.sendall(head + body[: len(body) // 2])
    time.sleep(0.05)
    if how == "reset":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    elif how == "shutdown":
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        try:
            while s.recv(4096):
                pass
        except (ConnectionError, socket.timeout):
            pass
    s.close()


HALF_CASES = {
    "put_replace": ("PUT", "/v1/vars/w", ["X-Shape: 3,4"],
                    np.full(12, 9.0, np.float32).tobytes()),
    "put_create": ("PUT", "/v1/vars/fresh", ["X-Shape: 3,4"],
                   np.full(12, 9.0, np.float32).tobytes()),
    "grad": ("POST", "/v1/vars/w/grad", [], np.ones(12, np.float32).tobytes()),
    "grads": ("POST", "/v1/grads", [], st_grads([("w", np.ones((3, 4), np.float32)),
                                                 ("b", np.ones(4, np.float32))],
                                                meta={"loss": "0.25"})),
}


@pytest.mark.parametrize("how", ["close", "shutdown", "reset"])
@pytest.mark.parametrize("case", sorted(HALF_CASES))
def test_half_body_then_disconnect(srv, case, how):
    p, before = srv
    method, path, hdrs, body = HALF_CASES[case]
    _half(p, request_head(method, path, hdrs, content_length=len(body)), body, how)
    # the server must notice the close and drop the request
    time.sleep(0.1)
    assert_unchanged(p, before)
    # and the same request, whole, still works afterwards
    st, _, out = raw_request(p.port, request_head(method, path, hdrs + ["Connection: close"],
                                                  content_length=len(body)) + body)
    assert st in (200, 201), out


@pytest.mark.parametrize("case", sorted(HALF_CASES))
def test_half_chunked_body_then_disconnect(srv, case):
    p, before = srv
    method, path, hdrs, body = HALF_CASES[case]
    c = chunked(body, 16)
    s = connect(p.port, timeout=5)
    s.sendall(request_head(method, path, hdrs + ["Transfer-Encoding: chunked"]) + c[: len(c) // 2])
    time.sleep(0.05)
    s.close()
    time.sleep(0.1)
    assert_unchanged(p, before)


# ------------------------------------------------------------------ X-Push-Id

@pytest.mark.parametrize("pid", [
    "has space", "a/b", "a+b", "a,b", "a=b", "caf\u00e9", "x" * 65, "x" * 200, "",
])
def test_push_id_invalid(srv, pid):
    p, before = srv
    body = st_grads([("w", np.ones((3, 4), np.float32))])
    hdr = ("X-Push-Id: " + pid).encode() if pid else "X-Push-Id;"
    r = curl_req("POST", p.url + "/v1/grads", [hdr], body)
    check(p, before, r, 400, "X-Push-Id")


def test_push_id_replay_applied_once(srv):
    p, before = srv
    g = (np.arange(12, dtype=np.float32) - 6).reshape(3, 4)
    gb = np.array([2, 0, -2, 4], np.float32)
    body = st_grads([("w", g), ("b", gb)], meta={"worker": "3", "loss": "0.5"})
    pid = "worker-3:step.7_" + "x" * 48  # 64 characters, every allowed kind
    assert len(pid) == 64
    w0 = np.frombuffer(before["vars"]["w"][3], "<f4").reshape(3, 4)
    b0 = np.frombuffer(before["vars"]["b"][3], "<f4")
    want_w = (w0 - np.float32(LR) * g).astype(np.float32)
    want_b = (b0 - np.float32(LR) * gb).astype(np.float32)

    st, _, out = http("POST", p.url + "/v1/grads", body, {"X-Push-Id": pid})
    assert st == 200, out
    assert json.loads(out) == {"global_step": 2, "duplicate": False, "outcome": "applied"}
    once = snapshot(p.url)

    def state_is_once():
        s = snapshot(p.url)
        assert np.frombuffer(s["vars"]["w"][3], "<f4").tobytes() == want_w.tobytes()
        assert np.frombuffer(s["vars"]["b"][3], "<f4").tobytes() == want_b.tobytes()
        assert s["vars"]["w"][1] == before["vars"]["w"][1] + 1
        assert s["vars"]["b"][1] == before["vars"]["b"][1] + 1
        assert s["global_step"] == 2 and s["last_loss"] == 0.5
        assert s == once

    state_is_once()
    for _ in range(2):  # replays: same answer, nothing applied
        st, _, out = http("POST", p.url + "/v1/grads", body, {"X-Push-Id": pid})
        assert st == 200, out
        assert json.loads(out) == {"global_step": 2, "duplicate": True, "outcome": "duplicate"}
        state_is_once()
    # with curl too, and a different loss in the replay: still not applied
    body2 = st_grads([("w", g), ("b", gb)], meta={"worker": "3", "loss": "9.5"})
    code, _, out = curl_req("POST", p.url + "/v1/grads", [f"X-Push-Id: {pid}"], body2)
    assert code == 200 and json.loads(out) == {"global_step": 2, "duplicate": True,
                                               "outcome": "duplicate"}
    state_is_once()
    # another id is a new push
    st, _, out = http("POST", p.url + "/v1/grads", body, {"X-Push-Id": pid[:-1] + "y"})
    assert st == 200 and json.loads(out) == {"global_step": 3, "duplicate": False,
                                             "outcome": "applied"}
    s = snapshot(p.url)
    assert s["vars"]["w"][3] == (want_w - np.float32(LR) * g).astype(np.float32).tobytes()


def test_push_id_refused_push_is_not_remembered(srv):
    """A push refused for bad input does not burn its id: the retry is applied."""
    p, before = srv
    bad = st_grads([("w", np.ones((4, 3), np.float32))])
    st, _, out = http("POST", p.url + "/v1/grads", bad, {"X-Push-Id": "retry-1"})
    assert st == 400, out
    assert_unchanged(p, before)
    good = st_grads([("w", np.ones((3, 4), np.float32))])
    st, _, out = http("POST", p.url + "/v1/grads", good, {"X-Push-Id": "retry-1"})
    assert st == 200 and json.loads(out) == {"global_step": 2, "duplicate": False,
                                             "outcome": "applied"}


# ------------------------------------------------------- the training routes

@pytest.mark.parametrize("path,body,words", [
    ("/v1/config", b"", ["JSON"]),
    ("/v1/config", b"{", ["JSON"]),
    ("/v1/config", b"[]", ["object"]),
    ("/v1/config", b'{"sync":true,"sync":false}', ["sync"]),  # duplicate key
    ("/v1/config", b'{"optimizer":"adadelta"}', ["optimizer"]),
    ("/v1/config", b'{"optimizer":null}', ["optimizer"]),
    ("/v1/config", b'{"learning_rate":-0.1}', ["learning_rate"]),
    ("/v1/config", b'{"learning_rate":"0.1"}', ["learning_rate"]),
    ("/v1/config", b'{"momentum":1}', ["momentum"]),
    ("/v1/config", b'{"beta1":1}', ["beta1"]),
    ("/v1/config", b'{"beta2":-1e-9}', ["beta2"]),
    ("/v1/config", b'{"epsilon":0}', ["epsilon"]),
    ("/v1/config", b'{"sync":1}', ["sync"]),
    ("/v1/config", b'{"workers":0}', ["workers"]),
    ("/v1/config", b'{"workers":4097}', ["workers"]),
    ("/v1/config", b'{"workers":2.0}', ["workers"]),
    ("/v1/config", b'{"workers":2,"replicas_to_aggregate":3}', ["replicas_to_aggregate"]),
    ("/v1/config", b'{"replicas_to_aggregate":0}', ["replicas_to_aggregate"]),
    ("/v1/config", b'{"learning_rate":0.1,"lr":0.1}', ["unknown", "lr"]),
    ("/v1/eval", b"", ["JSON"]),
    ("/v1/eval", b'{"loss":1}', ["accuracy"]),
    ("/v1/eval", b'{"loss":-1,"accuracy":0.5}', ["loss"]),
    ("/v1/eval", b'{"loss":1,"accuracy":1.01}', ["accuracy"]),
    ("/v1/eval", b'{"loss":1,"accuracy":0.5,"examples":-1}', ["examples"]),
    ("/v1/eval", b'{"loss":"1","accuracy":0.5}', ["loss"]),
    ("/v1/done", b"", ["JSON"]),
    ("/v1/done", b"{}", ["worker"]),
    ("/v1/done", b'{"worker":-1}', ["worker"]),
    ("/v1/done", b'{"worker":"1"}', ["worker"]),
    ("/v1/done", b'{"worker":4096}', ["worker"]),
])
def test_bad_training_body(srv, path, body, words):
    """Refused with the field named; the configuration, the evaluator's report
    and the workers counted done stay what they were."""
    p, before = srv
    method = "PUT" if path == "/v1/config" else "POST"
    r = curl_req(method, p.url + path, ["Content-Type: application/json"], body)
    check(p, before, r, 400, *words)


@pytest.mark.parametrize("query,word", [
    ("min_step=-1", "min_step"),
    ("min_step=", "min_step"),
    ("min_step=1x", "min_step"),
    ("min_step=99999999999999999999", "min_step"),
    ("timeout_ms=300001", "timeout_ms"),
    ("timeout_ms=-1", "timeout_ms"),
    ("timeout_ms=1e3", "timeout_ms"),
    ("min_step=5&timeout_ms=abc", "timeout_ms"),
])
def test_bad_long_poll_query(srv, query, word):
    """Refused at once (no waiting), nothing left parked."""
    p, before = srv
    t0 = time.time()
    r = curl_req("GET", f"{p.url}/v1/params?{query}")
    assert time.time() - t0 < 2
    check(p, before, r, 400, word)


def test_repeated_query_argument(srv):
    """Issue 37: '?min_step=5&min_step=7' took the first (a pull parked for
    step 5, the 7 unseen): a repeated argument is 400 naming it, at once, on
    every route (also a body route, before its body is read); nothing changed."""
    p, before = srv
    for path, word in (("/v1/params?min_step=5&min_step=7", "min_step"),
                       ("/v1/params?timeout_ms=10&min_step=5&TIMEOUT_MS=20", "timeout_ms"),
                       ("/v1/vars/w?format=json&format=raw", "format"),
                       ("/v1/history?since=0&since=1", "since")):
        t0 = time.time()
        r = curl_req("GET", p.url + path)
        assert time.time() - t0 < 2, path
        msg = check(p, before, r, 400, "more than once")
        assert f"'{word}'" in msg.lower(), (path, msg)
    body = st_grads([("b", np.ones(4, np.float32))], meta={"worker": "0", "step": "1"})
    r = curl_req("POST", p.url + "/v1/grads?x=1&x=2", data=body)
    check(p, before, r, 400, "'x' is given more than once")
    # once each: served as before
    st, _, out = http("GET", p.url + "/v1/params?min_step=0&timeout_ms=10")
    assert st == 200, out


def test_server_survives_everything(srv):
    """A burst of mixed bad requests (keep-alive where the server keeps the
    connection, a new one where it closes it): each answered, nothing changed."""
    p, before = srv
    reqs = [
        (request_head("GET", "/v1/vars/nope"), 404),
        (request_head("PUT", "/v1/vars/w", ["X-Shape: 3,,4"], content_length=48) + ZEROS48, 400),
        (request_head("POST", "/v1/vars/w/grad", [], content_length=4) + b"\0" * 4, 400),
        (request_head("DELETE", "/v1/vars/w"), 405),
        (request_head("GET", "/v1/vars/w?offset=-1"), 400),
        (request_head("GET", "/v1/vars/a..b"), 400),
        (request_head("GET", "/healthz"), 200),
    ] * 3
    s = None
    try:
        for req, code in reqs:
            if s is None:
                s = connect(p.port)
            s.sendall(req)
            st, hd, body = read_response(s)
            assert st == code, (req, st, body)
            if hd.get("connection", "").lower() == "close":
                s.close()
                s = None
    finally:
        if s is not None:
            s.close()
    assert_unchanged(p, before)
