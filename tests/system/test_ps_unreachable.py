"""A ps that stops answering while workers train (issue 37, part 3): each
worker says at once, and every few seconds, which ps is unreachable since
when and how long it goes on retrying (--ps_retry_secs), then ends with one
line that says it gave up and what to do, exit status 1; a ps that comes back
within the budget is said to answer again and training goes on."""
import re
import signal
import subprocess
import threading
import time

from conftest import binary
from procs import free_port, kill_all


class Lines(threading.Thread):
    """A process's output lines as they come, each with its time."""

    def __init__(self, p):
        super().__init__(daemon=True)
        self.p, self.lines = p, []
        self.start()

    def run(self):
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line.decode(errors="replace").rstrip()))

    def text(self):
        return "\n".join(s for _, s in self.lines)


def job(tmp_path, retry_secs):
    ps, wk = free_port(), free_port()
    cluster = [f"--ps_hosts=127.0.0.1:{ps}", f"--worker_hosts=127.0.0.1:{wk}"]
    psd = [binary("psd"), "--job_name=ps", "--task_index=0", *cluster, f"--logdir={tmp_path}/ps"]
    p = subprocess.Popen(psd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    w = subprocess.Popen([binary("workerd"), "--task_index=0", *cluster, "--hidden_units=16", "--log_every=0",
                          "--train_steps=1000000", f"--ps_retry_secs={retry_secs}", "--step_delay_ms=2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return ps, psd, p, w, Lines(w)


def wait_for(cond, secs, what, out):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < secs, f"{what}: not within {secs} s\n{out.text()[-2000:]}"
        time.sleep(0.05)


def test_a_stopped_ps_is_said_at_once_and_the_worker_gives_up_in_one_clear_line(tmp_path):
    port, _, p, w, out = job(tmp_path, 6)
    try:
        wait_for(lambda: "training async" in out.text(), 30, "training to start", out)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        t_stop = time.monotonic()
        rc = w.wait(timeout=30)
        out.join(timeout=5)
    finally:
        kill_all([p, w])
    said = [(t - t_stop, s) for t, s in out.lines if "unreachable since" in s]
    assert said, out.text()[-2000:]
    assert said[0][0] < 2, said  # at once, not after the budget
    assert re.search(rf"worker 0: ps 0 \(127\.0\.0\.1:{port}\) unreachable since \d\d:\d\d:\d\d \(.*\); "
                     r"retrying for \d+ s more \(--ps_retry_secs\)", said[0][1]), said[0][1]
    last = out.lines[-1][1]
    assert rc == 1 and "gave up after retrying for 6 s (--ps_retry_secs)" in last and "start it again" in last, \
        out.text()[-2000:]


def test_a_ps_back_within_the_budget_is_said_to_answer_again(tmp_path):
    port, psd, p, w, out = job(tmp_path, 60)
    procs = [p, w]
    try:
        wait_for(lambda: "training async" in out.text(), 30, "training to start", out)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        wait_for(lambda: "unreachable since" in out.text(), 10, "the worker to say the ps is unreachable", out)
        p2 = subprocess.Popen(psd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # restores its checkpoint
        procs.append(p2)
        wait_for(lambda: re.search(rf"ps 0 \(127\.0\.0\.1:{port}\) answers again after \d+ s", out.text()), 30,
                 "the worker to say the ps answers again", out)
        assert w.poll() is None, out.text()[-2000:]
    finally:
        kill_all(procs)
