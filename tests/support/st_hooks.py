"""schemathesis hooks for the run against a live psd (tests/system/test_schemathesis.py,
make fuzz): loaded with SCHEMATHESIS_HOOKS=st_hooks (PYTHONPATH=tests/support).

- refused_changes_nothing (a check): every request psd refuses (a 4xx answer)
  must leave the shard exactly as it was. Before each request that could
  change something (any PUT or POST, and GET/HEAD /v1/params, whose `clock`
  and `worker` move a worker's clock) the hook reads everything the shard
  shows (the variable list with versions, every value through one bulk pull,
  the configuration, the placement map and /v1/status but its clocks and
  counters: the training state, the sync step, the workers' iteration
  clocks, the eval report); after a refusal it reads it again and the two
  must be equal. The run uses one worker (-w 1), so nothing else changes the
  shard in between: the comparison is sound, and an accepted write is never
  compared.
- the long polls stay short: `timeout_ms` (GET/HEAD /v1/params, POST
  /v1/grads?return=params) is capped at RESTPS_ST_POLL_MS (default 200), and
  set to it where a wait (min_step, min_clock) comes without one, so a poll
  for a step that never comes ends well inside --request-timeout; the code
  that waits still runs.

RESTPS_ST_URL is the psd's base URL, RESTPS_ST_TOKEN its bearer token (both
set by whoever starts schemathesis).
"""
import json
import os
import http.client
import urllib.parse

import schemathesis

URL = os.environ.get("RESTPS_ST_URL", "")
TOKEN = os.environ.get("RESTPS_ST_TOKEN", "")
POLL_MS = int(os.environ.get("RESTPS_ST_POLL_MS", "200"))
# /v1/status fields that move by themselves or count requests, not state
VOLATILE = {"uptime_secs", "requests_served", "waiting_pulls", "checkpoint", "shards",
            "examples_per_sec", "steps_per_sec", "live_workers"}

_before = {}


_conn = None


def _get(path):
    """(status, body) of a GET with the token, on one kept-alive connection."""
    global _conn
    for attempt in (0, 1):
        if _conn is None:
            u = urllib.parse.urlsplit(URL)
            _conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        try:
            _conn.request("GET", path, headers={"Authorization": "Bearer " + TOKEN})
            r = _conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException):
            _conn.close()
            _conn = None
            if attempt:
                raise


def _json(path):
    st, body = _get(path)
    return st, json.loads(body) if body[:1] in (b"{", b"[") else body


def snapshot():
    """Everything the shard shows that a request could change."""
    out = {"vars": _json("/v1/vars"),      # names, shapes, versions, global_step
           "params": _get("/v1/params")}   # every value
    for p in ("/v1/config", "/v1/placement"):
        out[p] = _json(p)
    st, status = _json("/v1/status")       # the training state, the sync step, the clocks
    if isinstance(status, dict):
        for k in VOLATILE:
            status.pop(k, None)
        for k in ("step_secs", "waiting_secs"):
            status.get("sync", {}).pop(k, None)
        for w in status.get("workers", []):
            w.pop("last_seen_secs_ago", None)
    out["status"] = (st, status)
    return out


def _may_change(case):
    return case.method.upper() not in ("GET", "HEAD") or case.path == "/v1/params"


def _short_polls(query):
    if isinstance(query, dict) and "timeout_ms" not in query and ("min_step" in query or "min_clock" in query):
        query["timeout_ms"] = POLL_MS  # the default is 30 s (a long poll, or a push with return=params)
    if not isinstance(query, dict) or "timeout_ms" not in query:
        return
    t = query["timeout_ms"]
    try:
        if int(t) > POLL_MS:
            query["timeout_ms"] = POLL_MS if isinstance(t, int) else str(POLL_MS)
    except (TypeError, ValueError):
        pass  # not a number: psd refuses it at once


@schemathesis.hook
def before_call(ctx, case, kwargs):
    # every phase's cases pass here (map_query does not see the coverage phase's)
    _short_polls(case.query)
    _short_polls(kwargs.get("params"))
    if _may_change(case):
        _before[id(case)] = snapshot()


def _diff(a, b):
    return [k for k in a if a[k] != b.get(k)]


@schemathesis.check
def refused_changes_nothing(ctx, response, case):
    before = _before.pop(id(case), None)
    if before is None or not 400 <= response.status_code < 500:
        return None
    after = snapshot()
    if after != before:
        raise AssertionError(
            f"{case.method} {case.formatted_path} was refused with {response.status_code} "
            f"but changed the shard: {_diff(before, after)} differ")
    return None
