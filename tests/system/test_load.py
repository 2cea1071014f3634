"""Load beside training: wrk (Debian's) with 64 connections pulling
/v1/params and /v1/status (bench/load.lua) while 2 workers train async on
Fashion-MNIST. No request fails (no non-2xx answer, no socket error), the
training still converges (test accuracy far above chance), and psd's
resident memory after the run is within 5% of what it was after a warm-up
round of the same load. The step rate with and without the load is printed
(bench/load.sh reports it for `make bench`)."""
import json
import os
import re
import shutil
import subprocess
import time

import pytest

from conftest import BIN, ROOT, http
from test_train import accuracy_of, cluster, needs_data  # noqa: F401 (cluster: the fixture)

ASAN = "asan" in BIN
LUA = os.path.join(ROOT, "bench", "load.lua")
STEPS = 5000  # with --step_delay_ms=5 below: at most ~400 steps/s, so the load ends well before

pytestmark = [
    needs_data,
    pytest.mark.skipif(ASAN, reason="a load and throughput test, not about memory safety: "
                                    "the optimized build runs it"),
    pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is missing: make deps installs it"),
]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def global_step(url):
    st, _, body = http("GET", url + "/v1/status")
    assert st == 200, body
    return json.loads(body)["global_step"]


def wrk(url, secs, conns=64):
    """Run wrk; (requests, non-2xx answers, socket errors, summary text)."""
    out = subprocess.run(["wrk", "-t2", f"-c{conns}", f"-d{secs}s", "-s", LUA, url + "/"],
                         capture_output=True, timeout=secs + 30)
    text = out.stdout.decode()
    assert out.returncode == 0, text + out.stderr.decode()
    m = re.search(r"(\d+) requests in", text)
    assert m, text
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return (int(m.group(1)), int(bad.group(1)) if bad else 0,
            sum(int(x) for x in sock.groups()) if sock else 0, text)


def test_wrk_beside_two_training_workers(cluster):
    c = cluster(2)
    args = ["--sync=0", "--hidden_units=100", "--batch_size=100", f"--train_steps={STEPS}",
            "--log_every=0", "--keep_ps", "--step_delay_ms=5"]
    c.worker(1, *args)
    c.worker(0, *args)
    url, pid = c.psd.url, c.psd.proc.pid
    deadline = time.time() + 60
    while global_step(url) < 200:
        assert time.time() < deadline, "training did not start"
        assert all(p.poll() is None for p in c.procs), "a worker exited early"
        time.sleep(0.1)
    warm = wrk(url, 1)
    rss0 = rss_kib(pid)
    s0, t0 = global_step(url), time.time()
    time.sleep(1.5)
    s1, t1 = global_step(url), time.time()
    reqs, bad, sock, text = wrk(url, 3)
    s2, t2 = global_step(url), time.time()
    assert s2 < STEPS, "training ended before the load did: raise STEPS"
    outs = c.finish(timeout=300)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    acc = accuracy_of(outs[1][1])
    time.sleep(0.2)
    rss1 = rss_kib(pid)
    quiet, loaded = (s1 - s0) / (t1 - t0), (s2 - s1) / (t2 - t1)
    print(f"load: wrk 64 connections, {reqs} requests in 3 s ({reqs / 3:.0f}/s), {bad} non-2xx, "
          f"{sock} socket errors (warm-up: {warm[0]} requests, {warm[1] + warm[2]} errors); "
          f"step rate {quiet:.0f}/s without load, {loaded:.0f}/s with it; psd RSS {rss0} KiB "
          f"after the warm-up, {rss1} KiB after the run; test accuracy {acc:.4f}")
    assert bad == 0 and sock == 0 and warm[1] == 0 and warm[2] == 0, text
    assert reqs > 1000, text
    assert acc >= 0.7, outs[1][1][-2000:]  # chance is 0.10
    assert rss1 <= rss0 * 1.05, (rss0, rss1)
    assert loaded > 0, "no training step completed under load"
