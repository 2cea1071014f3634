"""The chief's wait at the end names the tasks it waits for (issue 37, part
3): a listed worker that never starts is named with its address, and psd's
/v1/status says which workers said they finished (workers_finished)."""
import json
import re
import subprocess
import time

from conftest import binary, http
from procs import finish, free_port, kill_all


def test_the_chief_names_the_worker_it_waits_for_and_the_status_lists_who_finished(tmp_path):
    ps, w0, w1, w2 = (free_port() for _ in range(4))
    cluster = [f"--ps_hosts=127.0.0.1:{ps}", f"--worker_hosts=127.0.0.1:{w0},127.0.0.1:{w1},127.0.0.1:{w2}"]
    train = ["--hidden_units=16", "--train_steps=100", "--log_every=0"]
    procs = [subprocess.Popen([binary("psd"), "--job_name=ps", "--task_index=0", *cluster, "--logdir="],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        procs.append(subprocess.Popen([binary("workerd"), "--task_index=1", *cluster, *train],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        chief = subprocess.Popen([binary("workerd"), "--task_index=0", *cluster, *train],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(chief)
        rc, out = finish(procs[1], timeout=60)
        assert rc == 0, out[-2000:]
        # worker 2 never starts: the chief, done, says whom it waits for (after 5 s)
        t0, line = time.time(), ""
        while time.time() - t0 < 30 and "waiting for" not in line:
            line = chief.stdout.readline()
        assert re.search(rf"worker 0: waiting for 1 other task to finish: worker 2 \(127\.0\.0\.1:{w2}\)$",
                         line.strip()), line
        st, _, body = http("GET", f"http://127.0.0.1:{ps}/v1/status")
        st = json.loads(body)
        assert st["workers_finished"] == [0, 1] and st["workers_done"] == 2, st
    finally:
        kill_all(procs)
