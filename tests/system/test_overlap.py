"""workerd --overlap (issue 33, part 1): the pull's tensors land while the
forward pass runs, each layer waiting only for its own, and the push sends
each layer's gradients, last layer first, while the backward pass goes on.
Only when bytes move changes: a sync run ends with the very floats (the
exported bytes) of the same run without it, on one ps and on two with a
variable split over them; async and stale-synchronous runs count every push
once (psd's global step, its /v1/grads requests and the workers' own counts
agree). The reference is the run with --overlap=false, which the rest of the
suite holds to numpy."""
import json
import re
import subprocess
import time

import pytest

from conftest import binary, http
from procs import communicate, free_port, kill_all
from test_train import DATA, load_model, needs_data

# dense layers and a dropout (whose mask is the step's): a model the overlap
# splits into layers, with more than the MiB it needs past the first layer
# (below that workerd leaves it off); small, so that a run takes seconds
MODEL = ["--batch_size=50", "--log_every=0", "--threads=1", "--seed=5"]
DROPOUT = "--model=dense:32,dropout:0.25,dense:512,dense:512,dense:10"
# workerd's last line with --overlap: steps whose parameters streamed in, pushes that streamed out
STREAMED = re.compile(r"--overlap: (\d+) steps' parameters streamed into the forward pass "
                      r"\(a pull, or a push's answer\), (\d+) pushes")


def train(start_psd, n_ps, n_workers, args, export=None):
    """n_ps psd and n_workers workerd (worker 0 the chief, which keeps the ps
    running); the psd objects and the workers' outputs."""
    hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n_ps))
    ps = [start_psd(f"--ps_hosts={hosts}", f"--task_index={t}", port0=False) for t in range(n_ps)]
    workers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(n_workers))
    procs = []
    try:
        for i in reversed(range(n_workers)):
            argv = [binary("workerd"), "--job_name=worker", f"--task_index={i}", f"--ps_hosts={hosts}",
                    f"--worker_hosts={workers}", f"--data_dir={DATA}", "--keep_ps"] + MODEL + list(args)
            if i == 0 and export:
                argv.append(f"--export={export}")
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs = [communicate(p, 60, "workerd did not finish") for p in procs]
    finally:
        kill_all(procs)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    return ps, [o for _, o in outs]


def grads_requests(p):
    _, _, m = http("GET", p.url + "/metrics")
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in m.decode().splitlines()
               if line.startswith("restps_requests_total{") and 'route="/v1/grads"' in line)


def global_step(p):
    _, _, body = http("GET", p.url + "/v1/status")
    return json.loads(body)["global_step"]


def local_steps(outs):
    return sum(int(re.search(r"finished after (\d+) local steps", o).group(1)) for o in outs)


@needs_data
@pytest.mark.parametrize("n_ps", [1, 2])
def test_sync_with_overlap_ends_with_the_same_floats_as_without(start_psd, tmp_path, n_ps):
    # two ps: hid... split by rows over both (--partition_bytes), so a layer's
    # tensors come from two answers
    args = [DROPOUT, "--sync=1", "--optimizer=adam", "--learning_rate=0.01", "--train_steps=20",
            "--partition_bytes=65536"]
    models = {}
    for flag in ("false", "true"):
        path = str(tmp_path / f"m_{flag}.safetensors")
        _, outs = train(start_psd, n_ps, 2, args + [f"--overlap={flag}"], export=path)
        models[flag] = open(path, "rb").read()
        if flag == "true":  # it did stream: all but the first pull, every push
            for o in outs:
                m = STREAMED.search(o)
                assert m and int(m.group(1)) >= local_steps([o]) - 2 and int(m.group(2)) == local_steps([o]), o
    assert models["true"] == models["false"]
    m, meta = load_model(str(tmp_path / "m_true.safetensors"))
    assert meta["global_step"] == "20"
    assert float(abs(m["fc0_b"]).max()) > 1e-4  # it trained: not two initializations compared


@needs_data
def test_overlap_is_left_off_where_the_first_layer_holds_nearly_every_byte(start_psd):
    # the example's model: 98.7 % of its bytes are hid_w's, needed first and written last
    _, outs = train(start_psd, 1, 1, ["--hidden_units=100", "--sync=1", "--train_steps=5", "--overlap=true"])
    assert "which no compute can hide: training without it" in outs[0], outs[0]
    assert "streamed into the forward pass" not in outs[0]


@needs_data
@pytest.mark.parametrize("mode", [["--sync=0"], ["--sync=0", "--one_round_trip=false"], ["--sync=0", "--staleness=1"]],
                         ids=["async", "async-push-then-pull", "ssp"])
def test_async_and_ssp_with_overlap_count_every_push_once(start_psd, mode):
    steps = 40
    # no dropout: an async pull streams only where the mask does not need the step it brings
    ps, outs = train(start_psd, 1, 2, mode + ["--model=mlp:32,512,512", "--optimizer=sgd", "--learning_rate=0.05",
                                              f"--train_steps={steps}", "--overlap=true"])
    for o in outs:
        m = STREAMED.search(o)
        assert m and int(m.group(2)) == local_steps([o]), o
        # the parameters stream too (no dropout): a pull, or the push's answer with them
        assert int(m.group(1)) >= local_steps([o]) - 2, o
    pushes = grads_requests(ps[0])
    assert pushes == local_steps(outs) == global_step(ps[0]), (pushes, local_steps(outs), global_step(ps[0]))
    assert pushes >= steps


@needs_data
def test_sync_with_overlap_goes_on_after_the_ps_restarts_from_an_older_checkpoint(tmp_path):
    # the ps comes back behind the workers (its last checkpoint): the chief puts
    # the variables back, and each worker's next pull takes the step the ps
    # answers with (a streamed pull that asked again for the predicted step
    # stalled test_recovery's run with the overlap on every model: the ps
    # answered with the step before, for which the worker had not pushed)
    steps, kill_at = 2000, 1200
    port = free_port()
    ps = f"127.0.0.1:{port}"
    psd_argv = [binary("psd"), f"--ps_hosts={ps}", "--task_index=0", f"--logdir={tmp_path / 'logs'}",
                "--save_checkpoint_secs=1"]
    workers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    args = ["--sync=1", "--hidden_units=32", "--optimizer=adam", "--learning_rate=0.003", f"--train_steps={steps}",
            "--overlap=true", "--overlap_min_bytes=0", "--ps_backoff_max_ms=300", f"--ps_hosts={ps}",
            f"--worker_hosts={workers}", f"--data_dir={DATA}"] + MODEL
    procs = []

    def start_psd():
        p = subprocess.Popen(psd_argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        procs.append(p)
        assert p.stdout.readline().startswith(b"psd: listening on ")
        return p

    try:
        psd = start_psd()
        ws = [subprocess.Popen([binary("workerd"), "--job_name=worker", f"--task_index={i}"] + args,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in (1, 0)]
        procs += ws
        t0 = time.time()
        while (global_step_at(ps) or 0) < kill_at:
            assert time.time() - t0 < 60 and all(w.poll() is None for w in ws), "training did not reach the kill"
            time.sleep(0.01)
        psd.kill()
        psd.wait()
        start_psd()
        outs = [communicate(w, 25, "workerd did not finish after the ps restarted") for w in ws]
    finally:
        kill_all(procs)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
    chief = outs[1][1]
    assert "came back behind the workers" in chief, chief[-3000:]
    m = STREAMED.search(chief)
    assert m and int(m.group(1)) > steps // 2, chief[-2000:]


def global_step_at(ps):
    try:
        return json.loads(http("GET", f"http://{ps}/v1/status", timeout=2)[2])["global_step"]
    except (OSError, ValueError, KeyError):
        return None
