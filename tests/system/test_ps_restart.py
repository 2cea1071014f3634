"""A ps killed (-9) before its first periodic checkpoint (issue 37): the
chief's checkpoint right after initialization gives the restarted ps the
variables and the configuration at step 0, and the chief puts back the
variables it pulled last at their global step (POST /v1/config with
global_step), so nothing the workers hold is lost. Sync with sgd (no
optimizer slots to lose): the final model is bit for bit an uncut run's,
since the chief's parameters at step s are the uncut run's at step s and the
batch of a sync step is a function of the step. Small model, few steps;
--step_delay_ms makes the kill land mid-run."""
import os
import re

import pytest

from test_recovery import DATA, Job, no_sanitizer_report
from test_train import accuracy_of

pytestmark = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")

STEPS = 80
ARGS = ["--hidden_units=16", "--optimizer=sgd", "--learning_rate=0.05", "--batch_size=20",
        f"--train_steps={STEPS}", "--seed=3", "--log_every=0", "--ps_backoff_max_ms=200",
        "--step_delay_ms=40"]
NO_PERIODIC = ("--save_checkpoint_secs=3600",)  # only the chief's and the final checkpoints


@pytest.fixture
def jobs(tmp_path):
    made = []

    def make(name, args, n_ps=1):
        j = Job(tmp_path, name, 2, args, n_ps)
        made.append(j)
        return j

    yield make
    for j in made:
        j.stop_all()


def run(jobs, name, args, n_ps=1, kill=None):
    """A 2-worker job; kill = the ps task to kill -9 at a third of the run
    (then restarted on the same port and logdir). The tasks' outputs."""
    job = jobs(name, args, n_ps)
    for t in range(n_ps):
        job.start_psd(task=t, extra=NO_PERIODIC)
    procs = [job.worker(1), job.worker(0)]
    if kill is not None:
        at = job.wait_step(STEPS // 3)
        victim = job.psd if kill == 0 else job.others[kill]
        victim.kill()
        victim.wait()
        # before its first periodic checkpoint: only the chief's at step 0
        steps = [int(f.rsplit("-", 1)[1].split(".")[0]) for f in job.checkpoints(task=kill)]
        assert steps == [0], (at, steps)
        job.start_psd(task=kill, extra=NO_PERIODIC)
    outs = job.finish(procs, timeout=120)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
        no_sanitizer_report(out)
    assert job.psd.wait(timeout=30) == 0
    for p in job.others.values():
        assert p.wait(timeout=30) == 0
    return job, outs


def check_put_back(job, outs, task):
    chief, worker = outs[1][1], outs[0][1]
    assert f"ps {task} came back behind the workers" in chief, chief[-3000:]
    assert f"ps {task} has its" in chief and "variables again at global step" in chief, chief[-3000:]
    assert "the optimizer's slots are not put back" in chief
    assert "gradient for unknown variable" not in chief + worker
    err = open(job.psd_err if task == 0 else job.others[task].err, errors="replace").read()
    # async: pushes in flight at the kill, retried, may have moved it from 0
    assert re.search(r"global step set from \d+ to \d+ by the chief", err), err[-2000:]


def test_sync_kill_the_only_ps_before_its_first_checkpoint(jobs):
    args = ARGS + ["--sync=1"]
    run(jobs, "reference", args)
    job, outs = run(jobs, "killed", args, kill=0)
    check_put_back(job, outs, 0)
    ref_model = open(os.path.join(os.path.dirname(job.dir), "reference", "model.safetensors"), "rb").read()
    assert open(job.export, "rb").read() == ref_model


def test_async_kill_the_only_ps_before_its_first_checkpoint(jobs):
    job, outs = run(jobs, "async", ARGS + ["--sync=0"], kill=0)
    check_put_back(job, outs, 0)
    final = [l for l in outs[1][1].splitlines() if "test accuracy" in l]
    assert final, outs[1][1][-2000:]


def test_sync_kill_one_of_two_ps_tasks_before_its_first_checkpoint(jobs):
    """Not bit for bit: when the kill lands after ps 0 applied step s and
    before ps 1 did, ps 1 is put back at step s (the parameters the chief
    pulled) while ps 0 stands at s + 1; the batch follows ps 0's step, so
    ps 1's variables miss batch s's update and stay a step behind. Hence the
    accuracy bound (and bit-identical when the kill lands between steps)."""
    args = ARGS + ["--sync=1"]
    _, ref = run(jobs, "reference2", args, n_ps=2)
    job, outs = run(jobs, "killed2", args, n_ps=2, kill=1)
    check_put_back(job, outs, 1)
    assert abs(accuracy_of(outs[1][1]) - accuracy_of(ref[1][1])) <= 0.03
