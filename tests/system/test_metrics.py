"""GET /metrics (Prometheus text exposition format 0.0.4) and the per-worker
fields of /v1/status, against real psd processes.

The exposition is read by a strict parser written here from the format's rules
(https://prometheus.io/docs/instrumenting/exposition_formats/): metric and
label name grammar, label-value and HELP escaping, HELP and TYPE at most once
per family and before its samples, each family one group of lines, no
duplicate series, the float syntax; histograms with cumulative buckets ending
in +Inf and _count equal to the +Inf bucket; counters never negative. The
parser is itself tested on broken expositions it must refuse.

The values are then checked against what each test did: requests counted by
route, method and status from the test's own log, bytes in and out from the
bodies it sent and read, pulls and pushes by result, global_step and loss,
the live workers, a long poll's latency bucket. When promtool (fetched by make deps: scripts/promtool.sh) is
present, `promtool check metrics` must accept
the exposition too.
"""
import http.client
import json
import math
import re
import os
import shutil
import subprocess
import threading
import time
from collections import Counter

import numpy as np
import pytest

from syshelp import st_grads

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# ------------------------------------------------------------ the parser

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Go's strconv.ParseFloat as the format uses it, decimal forms only
FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|Inf|inf)|NaN")
TIMESTAMP = re.compile(r"-?[0-9]+")
TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
BLANK = " \t"


class ExpositionError(ValueError):
    pass


class Family:
    def __init__(self, name):
        self.name = name
        self.help = None
        self.type = None
        self.samples = []  # (sample name, labels dict, value)


def _skip_blanks(s, i):
    while i < len(s) and s[i] in BLANK:
        i += 1
    return i


def _token(s, i):
    j = i
    while j < len(s) and s[j] not in BLANK:
        j += 1
    return s[i:j], j


def _unescape_help(s, lineno):
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            if i + 1 >= len(s) or s[i + 1] not in "\\n":
                raise ExpositionError(f"line {lineno}: bad escape in HELP text")
            out.append("\\" if s[i + 1] == "\\" else "\n")
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _parse_labels(s, i, lineno):
    """s[i] == '{'; returns (labels dict, index after '}')."""
    labels = {}
    i += 1
    while True:
        i = _skip_blanks(s, i)
        if i < len(s) and s[i] == "}":
            return labels, i + 1
        m = LABEL_NAME.match(s, i)
        if not m:
            raise ExpositionError(f"line {lineno}: bad label name at column {i + 1}")
        name = m.group(0)
        if name.startswith("__"):
            raise ExpositionError(f"line {lineno}: reserved label name {name}")
        if name in labels:
            raise ExpositionError(f"line {lineno}: label {name} twice")
        i = _skip_blanks(s, m.end())
        if i >= len(s) or s[i] != "=":
            raise ExpositionError(f"line {lineno}: '=' expected after label {name}")
        i = _skip_blanks(s, i + 1)
        if i >= len(s) or s[i] != '"':
            raise ExpositionError(f"line {lineno}: label {name}: value not quoted")
        i += 1
        value = []
        while True:
            if i >= len(s):
                raise ExpositionError(f"line {lineno}: label {name}: unterminated value")
            c = s[i]
            if c == "\\":
                if i + 1 >= len(s) or s[i + 1] not in '\\"n':
                    raise ExpositionError(f"line {lineno}: label {name}: bad escape")
                value.append({"\\": "\\", '"': '"', "n": "\n"}[s[i + 1]])
                i += 2
            elif c == '"':
                i += 1
                break
            else:
                value.append(c)
                i += 1
        labels[name] = "".join(value)
        i = _skip_blanks(s, i)
        if i < len(s) and s[i] == ",":
            i += 1
            continue
        if i < len(s) and s[i] == "}":
            return labels, i + 1
        raise ExpositionError(f"line {lineno}: ',' or '}}' expected after label {name}")


def _float(tok, lineno):
    if not FLOAT.fullmatch(tok):
        raise ExpositionError(f"line {lineno}: bad value {tok!r}")
    return float(tok)


def _family_of(name, families):
    """The family a sample name belongs to (histogram and summary suffixes)."""
    for suffix, kinds in (("_bucket", ("histogram",)), ("_sum", ("histogram", "summary")),
                          ("_count", ("histogram", "summary"))):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if base in families and families[base].type in kinds:
                return base
    return name


def parse_exposition(text):
    """Parse text exposition format 0.0.4 strictly; returns {family name: Family}
    in the order the families appear. Raises ExpositionError."""
    if text and not text.endswith("\n"):
        raise ExpositionError("the last line does not end with a line feed")
    families = {}
    closed = set()
    current = None
    series = set()

    def enter(name, lineno):
        nonlocal current
        if name == current:
            return families[name]
        if name in closed or (name in families and name != current):
            raise ExpositionError(f"line {lineno}: lines of {name} are not one group")
        if current is not None:
            closed.add(current)
        current = name
        return families.setdefault(name, Family(name))

    for lineno, line in enumerate(text.split("\n")[:-1], 1):
        i = _skip_blanks(line, 0)
        if i == len(line):
            continue  # empty lines are ignored
        if line[i] == "#":
            i = _skip_blanks(line, i + 1)
            keyword, j = _token(line, i)
            if keyword not in ("HELP", "TYPE"):
                continue  # a comment
            j = _skip_blanks(line, j)
            name, k = _token(line, j)
            if not METRIC_NAME.fullmatch(name):
                raise ExpositionError(f"line {lineno}: bad metric name {name!r}")
            fam = enter(name, lineno)
            rest = line[_skip_blanks(line, k):]
            if keyword == "HELP":
                if fam.help is not None:
                    raise ExpositionError(f"line {lineno}: second HELP for {name}")
                fam.help = _unescape_help(rest, lineno)
            else:
                if fam.type is not None:
                    raise ExpositionError(f"line {lineno}: second TYPE for {name}")
                if fam.samples:
                    raise ExpositionError(f"line {lineno}: TYPE of {name} after its samples")
                t = rest.rstrip(BLANK)
                if t not in TYPES:
                    raise ExpositionError(f"line {lineno}: unknown type {t!r}")
                fam.type = t
            continue
        m = METRIC_NAME.match(line, i)
        if not m:
            raise ExpositionError(f"line {lineno}: bad metric name")
        name = m.group(0)
        j = m.end()
        labels = {}
        if j < len(line) and line[j] == "{":
            labels, j = _parse_labels(line, j, lineno)
        if j >= len(line) or line[j] not in BLANK:
            raise ExpositionError(f"line {lineno}: a blank must follow the name and labels")
        toks = line[j:].split()
        if not 1 <= len(toks) <= 2:
            raise ExpositionError(f"line {lineno}: want a value and an optional timestamp")
        value = _float(toks[0], lineno)
        if len(toks) == 2 and not TIMESTAMP.fullmatch(toks[1]):
            raise ExpositionError(f"line {lineno}: bad timestamp {toks[1]!r}")
        fam = enter(_family_of(name, families), lineno)
        key = (name, tuple(sorted(labels.items())))
        if key in series:
            raise ExpositionError(f"line {lineno}: duplicate series {name}{labels}")
        series.add(key)
        fam.samples.append((name, labels, value))
    for fam in families.values():
        _check_family(fam)
    return families


def _check_family(fam):
    if fam.type == "counter":
        for name, labels, v in fam.samples:
            if name != fam.name:
                raise ExpositionError(f"counter {fam.name} has a sample named {name}")
            if math.isnan(v) or v < 0:
                raise ExpositionError(f"counter {name}{labels} is {v}")
    if fam.type != "histogram":
        return
    groups = {}
    for name, labels, v in fam.samples:
        suffix = name[len(fam.name):]
        if suffix not in ("_bucket", "_sum", "_count"):
            raise ExpositionError(f"histogram {fam.name} has a sample named {name}")
        if (suffix == "_bucket") != ("le" in labels):
            raise ExpositionError(f"{name}{labels}: le belongs on buckets, and only there")
        rest = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
        g = groups.setdefault(rest, {"buckets": [], "sum": None, "count": None})
        if suffix == "_bucket":
            g["buckets"].append((_float(labels["le"], 0), v))
        else:
            g[suffix[1:]] = v
    for rest, g in groups.items():
        what = f"histogram {fam.name}{dict(rest)}"
        if g["sum"] is None or g["count"] is None:
            raise ExpositionError(f"{what}: _sum or _count missing")
        b = sorted(g["buckets"])
        if not b or b[-1][0] != math.inf:
            raise ExpositionError(f"{what}: no +Inf bucket")
        if len({le for le, _ in b}) != len(b):
            raise ExpositionError(f"{what}: a bucket bound twice")
        for (_, lo), (_, hi) in zip(b, b[1:]):
            if hi < lo:
                raise ExpositionError(f"{what}: buckets are not cumulative")
        if any(v < 0 or math.isnan(v) for _, v in b):
            raise ExpositionError(f"{what}: a negative bucket")
        if g["count"] != b[-1][1]:
            raise ExpositionError(f"{what}: _count {g['count']} != +Inf bucket {b[-1][1]}")


# ------------------------------------------------------------ helpers

class Client:
    """Requests over http.client, each logged as (route, method, status, body
    bytes sent, body bytes received): what psd must have counted."""

    def __init__(self, psd):
        self.psd = psd
        self.log = []

    def __call__(self, method, path, route, body=None, headers=None, expect=None,
                 body_read=True):
        """body_read=False: psd refuses from the headers, before it reads the body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.psd.port, timeout=20)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            hdrs = {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()
        self.log.append((route, method, resp.status, len(body or b"") if body_read else 0,
                         len(data)))
        if expect is not None:
            assert resp.status == expect, (method, path, resp.status, data[:300])
        return resp.status, hdrs, data

    def status(self):
        _, _, b = self("GET", "/v1/status", "/v1/status", expect=200)
        return json.loads(b)

    def scrape(self):
        st, h, b = self("GET", "/metrics", "/metrics", expect=200)
        assert h["content-type"] == CONTENT_TYPE
        text = b.decode("utf-8")
        return text, parse_exposition(text)

    def expected_requests(self, log):
        return dict(Counter((r, m, str(st)) for r, m, st, _, _ in log))

    def scrape_settled(self, timeout=5):
        """A scrape whose restps_requests_total is exactly this client's log
        before it. psd counts a request when it is done with it, a moment
        after the client has read the answer: scrape again until then."""
        deadline = time.monotonic() + timeout
        while True:
            n = len(self.log)
            text, fams = self.scrape()
            got = {(dict(k)["route"], dict(k)["method"], dict(k)["code"]): v
                   for k, v in values(fams, "restps_requests_total").items()}
            if got == self.expected_requests(self.log[:n]) or time.monotonic() > deadline:
                return text, fams, got, self.log[:n]
            time.sleep(0.02)


def values(fams, name):
    """{frozen labels: value} of one family's samples named name."""
    fam = fams[_family_of(name, fams)]
    return {tuple(sorted(l.items())): v for n, l, v in fam.samples if n == name}


def value(fams, name, **labels):
    return values(fams, name)[tuple(sorted(labels.items()))]


def push_body(grads, **meta):
    return st_grads(list(grads.items()), meta={k: str(v) for k, v in meta.items()})


def check_conventions(fams):
    """What this exposition promises beyond the format."""
    for name, fam in fams.items():
        assert name.startswith("restps_"), name
        assert fam.help and fam.type in ("counter", "gauge", "histogram"), name
        assert (fam.type == "counter") == name.endswith("_total"), name
    h = fams["restps_request_duration_seconds"]
    les = {}
    for n, labels, _ in h.samples:
        if n.endswith("_bucket"):
            les.setdefault((labels["route"], labels["method"]), []).append(labels["le"])
    want = ["0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05",
            "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "+Inf"]
    for k, v in les.items():
        assert v == want, (k, v)


def promtool_check(text):
    local = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "build", "tools", "promtool")
    promtool = local if os.access(local, os.X_OK) else shutil.which("promtool")
    if not promtool:
        return "promtool is missing (make deps fetches it into build/tools/ with scripts/promtool.sh)"
    r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True,
                       timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), \
        (r.returncode, r.stdout.decode(), r.stderr.decode())
    # ... and it can fail
    r = subprocess.run([promtool, "check", "metrics"], input=b'restps_x{a=b} 1\n',
                       capture_output=True, timeout=60)
    assert r.returncode != 0
    return None


# ------------------------------------------------------------ the parser's own tests

GOOD = """# A comment
# HELP a_total Escapes: \\\\ and \\n.
# TYPE a_total counter
a_total{x="q\\"\\\\\\n",y="{,}"} 1.5e3 1700000000000

a_total{x="2",} 0
# TYPE g gauge
g NaN
g{k="v"} -Inf
g{k="w"} +Inf
# TYPE h histogram
h_bucket{le="0.5"} 1
h_bucket{le="+Inf"} 3
h_sum 2.5
h_count 3
other_untyped 7
"""


def test_parser_reads_the_format():
    fams = parse_exposition(GOOD)
    assert list(fams) == ["a_total", "g", "h", "other_untyped"]
    assert fams["a_total"].help == "Escapes: \\ and \n."
    assert fams["a_total"].samples[0] == ("a_total", {"x": 'q"\\\n', "y": "{,}"}, 1500.0)
    assert math.isnan(value(fams, "g")) and value(fams, "g", k="w") == math.inf
    assert value(fams, "h_count") == 3 and fams["other_untyped"].type is None


BAD = {
    "no final line feed": "a 1",
    "bad metric name": "1a 1\n",
    "bad label name": 'a{1x="1"} 1\n',
    "reserved label name": 'a{__x="1"} 1\n',
    "label twice": 'a{x="1",x="2"} 1\n',
    "unquoted label value": "a{x=1} 1\n",
    "bad label escape": 'a{x="\\t"} 1\n',
    "unterminated label value": 'a{x="1} 1\n',
    "no value": "a\n",
    "bad value": "a 1,5\n",
    "bad timestamp": "a 1 1.5\n",
    "duplicate series": 'a{x="1"} 1\na{x="1"} 2\n',
    "duplicate series, labels reordered": 'a{x="1",y="2"} 1\na{y="2",x="1"} 2\n',
    "second HELP": "# HELP a x\n# HELP a y\na 1\n",
    "second TYPE": "# TYPE a gauge\n# TYPE a gauge\na 1\n",
    "TYPE after samples": "a 1\n# TYPE a gauge\n",
    "unknown type": "# TYPE a meter\na 1\n",
    "bad HELP escape": "# HELP a \\x\na 1\n",
    "family split": "a 1\nb 1\na{x=\"1\"} 1\n",
    "HELP after another family": "a 1\nb 1\n# HELP a late\n",
    "negative counter": "# TYPE c_total counter\nc_total -1\n",
    "no +Inf bucket": '# TYPE h histogram\nh_bucket{le="1"} 1\nh_sum 1\nh_count 1\n',
    "not cumulative": ('# TYPE h histogram\nh_bucket{le="1"} 2\nh_bucket{le="2"} 1\n'
                       'h_bucket{le="+Inf"} 2\nh_sum 1\nh_count 2\n'),
    "count is not +Inf": ('# TYPE h histogram\nh_bucket{le="+Inf"} 2\nh_sum 1\n'
                          'h_count 3\n'),
    "no _count": '# TYPE h histogram\nh_bucket{le="+Inf"} 2\nh_sum 1\n',
    "bucket without le": '# TYPE h histogram\nh_bucket 2\nh_sum 1\nh_count 2\n',
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_parser_refuses(what):
    with pytest.raises(ExpositionError):
        parse_exposition(BAD[what])


# ------------------------------------------------------------ psd

def test_metrics_after_traffic(start_psd):
    t_start = time.monotonic()
    p = start_psd()
    c = Client(p)
    w = np.arange(6, dtype="<f4")
    b = np.ones(2, dtype="<f4")
    c("PUT", "/v1/vars/w", "/v1/vars/{name}", w.tobytes(), {"X-Shape": "2,3"}, expect=201)
    c("PUT", "/v1/vars/b", "/v1/vars/{name}", b.tobytes(), {"X-Shape": "2"}, expect=201)
    # pulls: ok, not modified, refused; HEAD is not a pull
    _, h, _ = c("GET", "/v1/vars/w", "/v1/vars/{name}", expect=200)
    c("GET", "/v1/vars/w?format=json", "/v1/vars/{name}", expect=200)
    c("GET", "/v1/vars/w", "/v1/vars/{name}", headers={"If-None-Match": h["etag"]}, expect=304)
    c("GET", "/v1/vars/missing", "/v1/vars/{name}", expect=404)
    c("HEAD", "/v1/vars/w", "/v1/vars/{name}", expect=200)
    c("GET", "/v1/params", "/v1/params", expect=200)
    c("GET", "/v1/params?min_step=x", "/v1/params", expect=400)
    # a long poll answered by its deadline: latency over 0.3 s
    t0 = time.monotonic()
    c("HEAD", "/v1/params?min_step=1000&timeout_ms=300", "/v1/params", expect=200)
    long_poll = time.monotonic() - t0
    # pushes from two workers with metadata; a duplicate; refusals; anonymous
    g = {"w": np.full((2, 3), 0.5, "<f4"), "b": np.ones(2, "<f4")}
    _, _, out = c("POST", "/v1/grads", "/v1/grads",
                  push_body(g, worker=0, step=0, batch_size=32, loss=0.5),
                  {"X-Push-Id": "w0-s0"}, expect=200)
    assert json.loads(out)["outcome"] == "applied"
    c("POST", "/v1/grads", "/v1/grads", push_body(g, worker=1, step=1, batch_size=16, loss=0.25),
      expect=200)
    _, _, out = c("POST", "/v1/grads", "/v1/grads",
                  push_body(g, worker=0, step=0, batch_size=32, loss=0.5),
                  {"X-Push-Id": "w0-s0"}, expect=200)
    assert json.loads(out)["outcome"] == "duplicate"
    bad = dict(g, b=np.array([1, math.nan], "<f4"))
    c("POST", "/v1/grads", "/v1/grads", push_body(bad, worker=1, step=2), expect=400)
    c("POST", "/v1/grads", "/v1/grads", st_grads([("b", np.ones(2, "<f4"))]), expect=200)
    c("POST", "/v1/vars/b/grad", "/v1/vars/{name}/grad", np.ones(2, "<f4").tobytes(),
      expect=200)
    c("POST", "/v1/vars/b/grad", "/v1/vars/{name}/grad", np.ones(3, "<f4").tobytes(),
      expect=400, body_read=False)  # the length is wrong for b: refused unread
    # no route: unknown path, wrong method
    c("GET", "/nope", "unmatched", expect=404)
    c("DELETE", "/v1/vars/w", "unmatched", expect=405)
    status = c.status()

    text, fams, got, log = c.scrape_settled()
    check_conventions(fams)

    # requests by route, method and code: exactly the test's own log (the
    # scrape itself ends after its answer is built, so it is not in it)
    want = c.expected_requests(log)
    assert got == want
    # histogram counts per (route, method) agree with the requests
    per_rm = Counter()
    for (r, m, _), n in want.items():
        per_rm[(r, m)] += n
    counts = {(dict(k)["route"], dict(k)["method"]): v
              for k, v in values(fams, "restps_request_duration_seconds_count").items()}
    assert counts == dict(per_rm)
    # the long poll: nothing at or under 0.25 s, its sum about 0.3 s (the
    # deadline is kept in whole milliseconds) and about what the client waited
    # (psd's clock stops when it is done with the request, a little after the
    # client has the answer)
    lp = {"route": "/v1/params", "method": "HEAD"}
    assert value(fams, "restps_request_duration_seconds_bucket", le="0.25", **lp) == 0
    assert value(fams, "restps_request_duration_seconds_bucket", le="+Inf", **lp) == 1
    lp_sum = value(fams, "restps_request_duration_seconds_sum", **lp)
    assert 0.298 <= lp_sum <= long_poll + 0.1, (lp_sum, long_poll)

    # bytes in and out by route, from the bodies sent and read (HEAD: none)
    sent, recv = Counter(), Counter()
    for r, m, _, n_in, n_out in log:
        recv[r] += n_in
        sent[r] += n_out
    got_in = {dict(k)["route"]: v for k, v in values(fams, "restps_received_bytes_total").items()}
    got_out = {dict(k)["route"]: v for k, v in values(fams, "restps_sent_bytes_total").items()}
    assert got_in == dict(recv) and got_out == dict(sent)

    # pulls and pushes by result
    pulls = {dict(k)["result"]: v for k, v in values(fams, "restps_pulls_total").items()}
    assert pulls == {"ok": 3, "not_modified": 1, "refused": 2, "aborted": 0}
    pushes = {dict(k)["result"]: v for k, v in values(fams, "restps_pushes_total").items()}
    assert pushes == {"applied": 4, "pending": 0, "stale": 0, "duplicate": 1, "refused": 2,
                      "aborted": 0}

    # the shard: 4 updates applied, the last loss, sizes; workers 0 and 1
    assert value(fams, "restps_global_step") == 4 == status["global_step"]
    assert value(fams, "restps_loss") == 0.25 == status["last_loss"]
    assert value(fams, "restps_variables") == 2
    assert value(fams, "restps_stored_bytes") == w.nbytes + b.nbytes
    assert value(fams, "restps_stale_gradients_dropped_total") == 0
    assert value(fams, "restps_waiting_pulls") == 0
    assert value(fams, "restps_pending_gradients") == 0
    assert value(fams, "restps_ready") == 0
    assert "restps_eval_loss" not in fams
    assert 0 < value(fams, "restps_uptime_seconds") <= time.monotonic() - t_start
    assert value(fams, "restps_live_workers") == 2 == status["live_workers"]
    # the duplicate is not a push of its own (but it shows worker 0 alive)
    assert values(fams, "restps_worker_pushes_total") == {(("worker", "0"),): 1,
                                                          (("worker", "1"),): 1}
    assert values(fams, "restps_worker_last_step") == {(("worker", "0"),): 0,
                                                       (("worker", "1"),): 1}
    ages = values(fams, "restps_worker_last_push_age_seconds")
    assert set(ages) == {(("worker", "0"),), (("worker", "1"),)}
    assert all(0 <= a <= time.monotonic() - t_start for a in ages.values())
    # 32 + 16 examples (not the duplicate's, not the anonymous push's: no
    # batch_size), within the first second: per second over at least 1 s
    if time.monotonic() - t_start < 4.5:
        assert 48 / 4.5 <= value(fams, "restps_examples_per_second") <= 48

    skip = promtool_check(text)

    # this scrape is counted in the next, with the bytes it sent
    _, fams2, got2, log2 = c.scrape_settled()
    assert got2 == c.expected_requests(log2)
    assert value(fams2, "restps_sent_bytes_total", route="/metrics") == \
        sum(n_out for r, _, _, _, n_out in log2 if r == "/metrics")
    assert log2[-1][4] == len(text.encode())
    if skip:
        pytest.skip(skip + "; everything else passed")


def test_requests_counted_exactly_under_concurrency(start_psd):
    """4 threads x 50 requests on two routes: every one counted, once."""
    p = start_psd("--http_threads=4")
    c = Client(p)
    errors = []

    def run(k):
        try:
            cc = c  # its log is a list: appends from threads are safe
            for i in range(50):
                if (i + k) % 2:
                    cc("GET", "/healthz", "/healthz", expect=200)
                else:
                    cc("GET", "/nope%d" % i, "unmatched", expect=404)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    _, fams, got, log = c.scrape_settled()
    assert got == c.expected_requests(log)
    assert value(fams, "restps_requests_total", route="/healthz", method="GET", code="200") == 100
    assert value(fams, "restps_requests_total", route="unmatched", method="GET", code="404") == 100
    assert value(fams, "restps_request_duration_seconds_count", route="/healthz",
                 method="GET") == 100
    assert value(fams, "restps_metrics_unrecorded_total") == 0


def test_sync_pushes_status_and_metrics(start_psd):
    p = start_psd()
    c = Client(p)
    c("PUT", "/v1/vars/w", "/v1/vars/{name}", np.zeros(2, "<f4").tobytes(), {"X-Shape": "2"},
      expect=201)
    cfg = {"sync": True, "workers": 3, "replicas_to_aggregate": 3}
    c("PUT", "/v1/config", "/v1/config", json.dumps(cfg).encode(), expect=200)
    s = c.status()
    assert (s["mode"], s["waiting_for"], s["workers"], s["live_workers"],
            s["examples_per_sec"]) == ("sync", [0, 1, 2], [], 0, 0)

    def push(worker, step, batch, loss):
        _, _, out = c("POST", "/v1/grads", "/v1/grads",
                      push_body({"w": np.ones(2, "<f4")}, worker=worker, step=step,
                                batch_size=batch, loss=loss), expect=200)
        return json.loads(out)["outcome"]

    t_first = time.monotonic()
    assert push(0, 0, 10, 1.0) == "pending"
    t_first_done = time.monotonic()
    assert push(2, 0, 20, 2.0) == "pending"
    s = c.status()
    assert s["waiting_for"] == [1] and s["pending_gradients"] == 2
    assert s["live_workers"] == 2
    assert [(x["worker"], x["last_step"], x["pushes"], x["stale_dropped"]) for x in s["workers"]] \
        == [(0, 0, 1, 0), (2, 0, 1, 0)]
    assert all(0 <= x["last_seen_secs_ago"] < 10 for x in s["workers"])
    _, fams, got, log = c.scrape_settled()
    assert got == c.expected_requests(log)
    assert value(fams, "restps_pushes_total", result="pending") == 2
    assert value(fams, "restps_pending_gradients") == 2
    assert value(fams, "restps_global_step") == 0 and "restps_loss" not in fams

    assert push(1, 0, 30, 6.0) == "applied"
    s = c.status()
    assert s["global_step"] == 1 and s["waiting_for"] == [0, 1, 2]
    assert push(0, 0, 40, 9.0) == "stale"
    t_before = time.monotonic()
    s = c.status()
    assert s["stale_dropped"] == 1 and s["live_workers"] == 3
    assert [(x["worker"], x["last_step"], x["pushes"], x["stale_dropped"]) for x in s["workers"]] \
        == [(0, 0, 2, 1), (1, 0, 1, 0), (2, 0, 1, 0)]
    _, fams, got, log = c.scrape_settled()
    assert got == c.expected_requests(log)
    t_after = time.monotonic()
    check_conventions(fams)
    pushes = {dict(k)["result"]: v for k, v in values(fams, "restps_pushes_total").items()}
    assert pushes == {"applied": 1, "pending": 2, "stale": 1, "duplicate": 0, "refused": 0,
                      "aborted": 0}
    assert value(fams, "restps_stale_gradients_dropped_total") == 1
    assert value(fams, "restps_worker_stale_gradients_dropped_total", worker="0") == 1
    assert value(fams, "restps_worker_stale_gradients_dropped_total", worker="1") == 0
    assert value(fams, "restps_global_step") == 1 and value(fams, "restps_ready") == 1
    assert value(fams, "restps_loss") == pytest.approx(np.mean([1.0, 2.0, 6.0])) == s["last_loss"]
    assert value(fams, "restps_live_workers") == 3

    # examples per second: 10 + 20 + 30 (the stale push's 40 does not count),
    # over the time since the first push, clamped to [1, 5] s
    def bounds(lo, hi):
        def clamp(x):
            return min(max(x, 1.0), 5.0)
        return 60 / clamp(hi) * 0.999, 60 / clamp(lo) * 1.001
    if t_after - t_first < 4.5:
        lo, hi = bounds(t_before - t_first_done, t_after - t_first)
        assert lo <= s["examples_per_sec"] <= hi
        assert lo <= value(fams, "restps_examples_per_second") <= hi
    skip = promtool_check(c.scrape()[0])
    if skip:
        pytest.skip(skip + "; everything else passed")


def test_eval_gauges(start_psd):
    p = start_psd()
    c = Client(p)
    c("POST", "/v1/eval", "/v1/eval", b'{"loss":0.375,"accuracy":0.8125,"global_step":0}',
      expect=200)
    _, fams = c.scrape()
    assert value(fams, "restps_eval_loss") == 0.375
    assert value(fams, "restps_eval_accuracy") == 0.8125


def test_head_and_token(start_psd, tmp_path):
    """/metrics is a read: open without --auth_reads, 401 without the token with it."""
    tok = tmp_path / "token"
    tok.write_text("metrics-token\n")
    p = start_psd(f"--auth_token_file={tok}", "--auth_reads")
    c = Client(p)
    st, h, _ = c("GET", "/metrics", "/metrics")
    assert st == 401 and h["www-authenticate"].startswith("Bearer")
    st, h, body = c("GET", "/metrics", "/metrics", headers={"Authorization": "Bearer metrics-token"})
    assert st == 200 and h["content-type"] == CONTENT_TYPE
    parse_exposition(body.decode())
    st, h, body = c("HEAD", "/metrics", "/metrics",
                    headers={"Authorization": "Bearer metrics-token"})
    assert st == 200 and body == b"" and h["content-type"] == CONTENT_TYPE
