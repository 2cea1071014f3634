"""The evaluator task at the end of a job (issue 37): it evaluates the final
model as soon as the global step reaches --train_steps, however long its
--eval_secs, and the chief waits for that report before it stops the ps
tasks. Before, the evaluator slept its whole --eval_secs after each
evaluation: with the CNN demo's 120 s its only report was of global step 1,
and the ps was gone before it woke up."""
import os
import re
import subprocess
import time

import pytest

from conftest import binary, http
from procs import communicate, free_port, kill_all

DATA = "/usr/share/datasets/fashion-mnist"
needs_data = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")
STEPS = 1000


@needs_data
def test_the_evaluator_reports_the_final_step_before_the_ps_stops(start_psd):
    psd = start_psd()
    flags = [f"--ps_hosts=127.0.0.1:{psd.port}", f"--worker_hosts=127.0.0.1:{free_port()}", f"--data_dir={DATA}",
             "--hidden_units=32", "--batch_size=32", f"--train_steps={STEPS}", "--log_every=0",
             "--recovery_wait_secs=0.2"]
    procs = []
    try:
        ev = subprocess.Popen([binary("workerd"), "--job_name=evaluator", "--task_index=0", "--eval_secs=600"]
                              + flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(ev)
        # the chief starts once the evaluator has loaded its data and asks ps 0 whether it is
        # ready (a 503 on /readyz in psd's metrics), so that it evaluates while the job runs
        deadline = time.monotonic() + 60
        while 'route="/readyz",method="GET",code="503"' not in http("GET", psd.url + "/metrics")[2].decode():
            assert ev.poll() is None and time.monotonic() < deadline, "the evaluator does not ask ps 0"
            time.sleep(0.1)
        # 2 ms a step: the job lasts past the evaluator's first evaluation on a fast or a loaded machine
        chief = subprocess.Popen([binary("workerd"), "--job_name=worker", "--task_index=0", "--step_delay_ms=2"]
                                 + flags,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(chief)
        t0 = time.monotonic()
        # an --eval_secs of 600 s: before, the evaluator slept through the end
        rc_ev, out_ev = communicate(ev, 60, "the evaluator did not end with the job")
        ev_secs = time.monotonic() - t0
        rc, out = communicate(chief, 60, "the chief did not finish")
    finally:
        kill_all(procs)
    assert rc == 0, out[-3000:]
    assert rc_ev == 0, out_ev[-3000:]
    reports = re.findall(r"evaluator 0: global step (\d+): test loss ([0-9.]+), test accuracy ([0-9.]+)", out_ev)
    assert reports, out_ev[-3000:]
    # it did evaluate while training ran (else this test could not fail)
    if int(reports[0][0]) >= STEPS:
        pytest.skip(f"the job ended before the evaluator's first evaluation (machine too fast?): {reports}")
    assert int(reports[-1][0]) == STEPS, out_ev[-3000:]
    assert "eval report" not in out_ev, out_ev[-3000:]   # its report reached ps 0 before the ps stopped
    done = re.search(rf"training done at global step {STEPS}: .*test loss ([0-9.]+), test accuracy ([0-9.]+)", out)
    assert done, out[-3000:]
    # the same parameters, the same test set: the chief's own figure
    assert reports[-1][2] == done.group(2), (reports[-1], done.group(0))
    assert ev_secs < 50, ev_secs
    assert psd.proc.wait(timeout=30) == 0   # stopped by the chief, after the report
