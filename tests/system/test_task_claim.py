"""Two workers with the same --task_index (issue 37, part 3): the second is
refused within seconds, naming the process and address that hold the task
id, and the job is configured once; a worker killed and restarted at once
takes its id back when its old claim lapses; POST /v1/heartbeat refuses a
malformed instance and answers 409 for a held id."""
import json
import os
import re
import signal
import subprocess
import time

from conftest import binary, http
from procs import finish, free_port, kill_all


def cluster_of(ps, w0, w1):
    return [f"--ps_hosts=127.0.0.1:{ps}", f"--worker_hosts=127.0.0.1:{w0},127.0.0.1:{w1}"]


def start_psd(cluster, log):
    return subprocess.Popen([binary("psd"), "--job_name=ps", "--task_index=0", *cluster, "--logdir="],
                            stdout=log, stderr=subprocess.STDOUT)


def wait_step(ps, at_least, secs=30):
    t0 = time.time()
    while time.time() - t0 < secs:
        try:
            st, _, body = http("GET", f"http://127.0.0.1:{ps}/v1/status")
            if st == 200 and json.loads(body)["global_step"] >= at_least:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"global step {at_least} not reached in {secs} s")


def wait_ready(ps, secs=30):
    t0 = time.time()
    while time.time() - t0 < secs:
        try:
            if http("GET", f"http://127.0.0.1:{ps}/readyz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"ps not ready in {secs} s")


def test_a_second_chief_is_refused_naming_the_holder_and_the_job_is_configured_once(tmp_path):
    ps, w0, w1 = (free_port() for _ in range(3))
    cluster = cluster_of(ps, w0, w1)
    train = ["--hidden_units=16", "--train_steps=100", "--log_every=0", "--batch_size=20", "--sync"]
    with open(tmp_path / "psd.log", "w") as plog:
        procs = [start_psd(cluster, plog)]
        try:
            chief = subprocess.Popen([binary("workerd"), "--task_index=0", *cluster, *train],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            procs.append(chief)
            wait_ready(ps)  # configured; the sync step waits for worker 1
            time.sleep(1.2)  # and a heartbeat of the chief's came
            t0 = time.time()
            dup = subprocess.run([binary("workerd"), "--task_index=0", *cluster, *train],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
            took = time.time() - t0
            assert dup.returncode == 2, dup.stdout[-2000:]
            assert took < 10, took
            m = re.search(r"worker 0: refused: .*worker task 0 is held by another process: "
                          r"pid-(\d+)@[^/ ]+/[0-9a-f]{8} from 127\.0\.0\.1:\d+, heard from [0-9.]+ s ago",
                          dup.stdout)
            assert m and int(m.group(1)) == chief.pid, dup.stdout[-2000:]
            assert "--task_index" in dup.stdout
            # the holder goes on undisturbed; the job ends with worker 1
            procs.append(subprocess.Popen([binary("workerd"), "--task_index=1",
                                           *cluster, *train],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            rc, out = finish(chief, timeout=90)
            assert rc == 0, out[-2000:]
            assert "took this task id" not in out
        finally:
            kill_all(procs)
    log = (tmp_path / "psd.log").read_text()
    assert log.count("psd: configured:") == 1, log[-3000:]


def test_a_worker_killed_and_restarted_at_once_takes_its_id_back(tmp_path):
    ps, w0, w1 = (free_port() for _ in range(3))
    cluster = cluster_of(ps, w0, w1)
    train = ["--hidden_units=16", "--train_steps=100000", "--log_every=0", "--batch_size=20", "--sync"]
    with open(tmp_path / "psd.log", "w") as plog:
        procs = [start_psd(cluster, plog)]
        try:
            procs.append(subprocess.Popen([binary("workerd"), "--task_index=0", *cluster, *train],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            first = subprocess.Popen([binary("workerd"), "--task_index=1", *cluster, *train],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(first)
            wait_step(ps, 20)
            time.sleep(1.5)  # a heartbeat of the first one came
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            again = subprocess.Popen([binary("workerd"), "--task_index=1", *cluster, *train],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(again)
            t0, seen = time.time(), ""
            while time.time() - t0 < 20 and "is this process's now" not in seen:
                line = again.stdout.readline()
                if not line:
                    break
                seen += line
            assert "its claim lapses within 3 s: waiting" in seen, seen
            assert "task id 1 is this process's now" in seen, seen
            assert again.poll() is None, seen
            # and it trains: the sync step waits for worker 1, and moves again
            st, _, body = http("GET", f"http://127.0.0.1:{ps}/v1/status")
            wait_step(ps, json.loads(body)["global_step"] + 20)
        finally:
            kill_all(procs)


def test_heartbeat_instances_over_http():
    ps, w0, w1 = (free_port() for _ in range(3))
    p = start_psd(cluster_of(ps, w0, w1), subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{ps}/v1/heartbeat"
        t0 = time.time()
        while True:
            try:
                st, _, _ = http("GET", f"http://127.0.0.1:{ps}/healthz")
                if st == 200:
                    break
            except OSError:
                pass
            assert time.time() - t0 < 10
            time.sleep(0.05)
        hdr = {"Content-Type": "application/json"}
        for bad in ['"a b"', '"a\\"b"', '""', '"' + "x" * 97 + '"', "7", "null"]:
            st, _, body = http("POST", url, f'{{"worker": 3, "instance": {bad}}}'.encode(), hdr)
            assert st == 400 and b"instance" in body, (bad, st, body)
        st, _, _ = http("POST", url, b'{"worker": 3, "instance": "' + b"x" * 96 + b'"}', hdr)
        assert st == 200
        st, _, body = http("POST", url, b'{"worker": 3, "instance": "other"}', hdr)
        assert st == 409 and b"worker task 3 is held by another process: " + b"x" * 96 + b" from 127.0.0.1:" in body, body
        st, _, _ = http("POST", url, b'{"worker": 4, "instance": "other"}', hdr)
        assert st == 200  # another id
        st, _, _ = http("POST", url, b'{"worker": 3}', hdr)
        assert st == 200  # no instance: no claim
        st, _, body = http("POST", url, b'{"worker": 3, "instance": "x", "leaving": 1}', hdr)
        assert st == 400 and b"leaving" in body
        st, _, _ = http("POST", url, b'{"worker": 3, "instance": "other", "leaving": true}', hdr)
        assert st == 200  # not the holder: nothing released
        st, _, _ = http("POST", url, b'{"worker": 3, "instance": "other"}', hdr)
        assert st == 409
        st, _, _ = http("POST", url, b'{"worker": 3, "instance": "' + b"x" * 96 + b'", "leaving": true}', hdr)
        assert st == 200
        st, _, _ = http("POST", url, b'{"worker": 3, "instance": "other"}', hdr)
        assert st == 200  # released by the holder's last beat
    finally:
        kill_all([p])
