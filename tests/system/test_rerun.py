"""A rerun on the last run's --logdir (issue 37): psd restores the last run's
checkpoint. The same job again says it is already done ("already at step 30:
nothing to train") on every task, exits with workerd's status 3 and stops
psd; another job (sync, then async) is refused by the chief in one line that
names the checkpoint's job and what to do, and every task, psd included,
ends; a new --logdir trains as a first run does."""
import os
import time

import pytest

from test_recovery import Job, no_sanitizer_report
from test_train import accuracy_of

DATA = "/usr/share/datasets/fashion-mnist"
NOTHING_TO_TRAIN = 3  # workerd's exit status: the job is already done
ARGS = ["--hidden_units=16", "--batch_size=20", "--seed=3", "--log_every=0"]
pytestmark = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path, "rerun", 2, ARGS)
    yield j
    j.stop_all()


def run(job, mode, bound=60, steps=30):
    """psd and two workers on job's logdir in mode; (rc, output) of worker 1
    and the chief, and psd's exit status, each within bound seconds."""
    job.args = ARGS + [f"--sync={1 if mode == 'sync' else 0}", f"--train_steps={steps}"]
    job.start_psd()
    w1, chief = job.worker(1), job.worker(0)
    t0 = time.time()
    outs = job.finish([w1, chief], timeout=bound)
    left = max(1.0, bound - (time.time() - t0))
    try:
        psd_rc = job.psd.wait(timeout=left)
    except Exception:
        raise AssertionError("psd still runs after the workers ended:\n" + job.psd_stderr()[-2000:])
    for _, out in outs:
        no_sanitizer_report(out)
    no_sanitizer_report(job.psd_stderr())
    return outs, psd_rc


def trained(outs, psd_rc):
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    assert psd_rc == 0
    assert accuracy_of(outs[1][1]) > 0.3


def test_the_same_sync_job_twice_says_it_is_already_done(job):
    trained(*run(job, "sync"))
    outs, psd_rc = run(job, "sync", bound=40)
    for rc, out in outs:
        assert rc == NOTHING_TO_TRAIN, out[-3000:]
        assert "already at step 30: nothing to train" in out, out[-3000:]
        assert "new --logdir" in out, out[-3000:]
        assert "test accuracy" not in out, out[-3000:]  # no old figures as if it had trained
    assert "asked the ps tasks to stop" in outs[1][1]
    assert psd_rc == 0
    assert "(sync, adam, mlp:16)" in job.psd_stderr()  # what it restored


def test_sync_then_async_names_the_checkpoint_and_every_task_ends(job, tmp_path):
    trained(*run(job, "sync"))
    t0 = time.time()
    outs, psd_rc = run(job, "async", bound=30)
    took = time.time() - t0
    (w1_rc, w1_out), (chief_rc, chief_out) = outs
    assert chief_rc == 1, chief_out[-3000:]
    line = [l for l in chief_out.splitlines() if "holds a checkpoint of another job" in l]
    assert len(line) == 1, chief_out[-3000:]
    line = line[0]
    assert "ps-0 holds a checkpoint of another job: step 30, sync, adam, mlp:16" in line, line
    assert "sync true (sent: false)" in line and "new --logdir, or remove" in line, line
    # worker 1 says why it ends, rather than "following" the checkpoint's mode
    assert w1_rc == NOTHING_TO_TRAIN, w1_out[-3000:]
    assert "already at step 30: nothing to train" in w1_out and "sync, adam" in w1_out, w1_out[-3000:]
    assert "the chief chose sync training" not in w1_out
    assert psd_rc == 0
    assert "refused a training configuration" in job.psd_stderr()
    print(f"sync then async on one logdir: every task ended in {took:.1f} s")

    # a new --logdir trains as a first run does
    job.logdir = str(tmp_path / "new-logs")
    trained(*run(job, "async"))


def test_a_longer_job_of_another_mode_ends_every_task_with_the_reason(job):
    """The checkpoint is short of this run's --train_steps: worker 1 follows
    the restored (sync) configuration, saying so, and leaves within seconds
    once the chief refused the job and stopped the ps, saying why."""
    trained(*run(job, "sync"))
    t0 = time.time()
    outs, psd_rc = run(job, "async", bound=30, steps=300)
    (w1_rc, w1_out), (chief_rc, chief_out) = outs
    assert chief_rc == 1 and "holds a checkpoint of another job: step 30, sync" in chief_out, chief_out
    assert w1_rc == 1, w1_out[-3000:]
    assert "ps 0 holds sync training restored from the checkpoint in" in w1_out, w1_out[-3000:]
    assert "(this task's flags say async)" in w1_out
    assert "most likely the chief refused that job" in w1_out, w1_out[-3000:]
    assert psd_rc == 0
    print(f"a longer async job on a sync checkpoint: every task ended in {time.time() - t0:.1f} s")
