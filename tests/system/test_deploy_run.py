"""The image's entrypoint and the Slurm script, run for real without a
container engine or Slurm (issue 8): the TF_CONFIG the entrypoint builds from a
StatefulSet pod's name or an Indexed Job pod's hostname and
JOB_COMPLETION_INDEX, or leaves alone when Kubeflow set one; psd and a chief
started through it on 127.0.0.1 (it execs them: the PID is theirs), and its
HEALTHCHECK; the Slurm script's role mapping with a fake scontrol, and a whole
1-ps/1-worker job through it with a fake srun that starts its tasks here."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import BIN, SANITIZER_MARKS, http
from deployhelp import ENTRYPOINT, SBATCH, bin_path, dry_run_argv, run_entrypoint
from procs import free_port

DATA = "/usr/share/datasets/fashion-mnist"
needs_data = pytest.mark.skipif(not os.path.isdir(DATA),
                                reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist")


def no_sanitizer_report(out):
    for mark in SANITIZER_MARKS:
        assert mark not in out, out[-6000:]


def tf_config(env):
    r = run_entrypoint(["tf-config"], env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ------------------------------------------------------------ the entrypoint

K8S_ENV = {"RESTPS_PS_REPLICAS": "2", "RESTPS_WORKER_REPLICAS": "3"}
PS = ["restps-ps-0.restps-ps:2222", "restps-ps-1.restps-ps:2222"]
WORKERS = [f"restps-worker-{i}.restps-worker:2222" for i in range(3)]


@pytest.mark.parametrize("pod,job,index", [("restps-ps-0", "ps", 0), ("restps-ps-1", "ps", 1),
                                           ("restps-worker-2", "worker", 2),
                                           ("restps-evaluator-0", "evaluator", 0)])
def test_entrypoint_builds_tf_config_from_the_pod_name(pod, job, index):
    tf = tf_config(dict(K8S_ENV, HOSTNAME=pod))
    assert tf == {"cluster": {"ps": PS, "worker": WORKERS}, "task": {"type": job, "index": index}}


@pytest.mark.parametrize("env,index", [
    # what Kubernetes gives an Indexed Job's pod: hostname <job>-<index>, JOB_COMPLETION_INDEX
    ({"HOSTNAME": "restps-worker-0", "JOB_COMPLETION_INDEX": "0"}, 0),
    ({"HOSTNAME": "restps-worker-1", "JOB_COMPLETION_INDEX": "1"}, 1),
    # the pod's name (metadata.name) adds a random suffix; the index still comes through
    ({"HOSTNAME": "restps-worker-2", "JOB_COMPLETION_INDEX": "2",
      "RESTPS_POD_NAME": "restps-worker-2-x7k2p"}, 2),
])
def test_entrypoint_builds_tf_config_for_an_indexed_job_pod(env, index):
    tf = tf_config(dict(K8S_ENV, **env))
    assert tf == {"cluster": {"ps": PS, "worker": WORKERS}, "task": {"type": "worker", "index": index}}
    # and given only flags, the job in the name picks workerd
    r = run_entrypoint(["--log_every=10"], dict(K8S_ENV, RESTPS_DRY_RUN="1", **env))
    assert dry_run_argv(r.stdout) == ["workerd", "--log_every=10"], r.stderr


def test_entrypoint_settings_name_domain_port_and_no_workers():
    tf = tf_config({"RESTPS_PS_REPLICAS": "1", "RESTPS_POD_NAME": "mnist-ps-0", "HOSTNAME": "x",
                    "RESTPS_NAME": "mnist", "RESTPS_PORT": "8470",
                    "RESTPS_DOMAIN": ".ml.svc.cluster.local"})
    assert tf == {"cluster": {"ps": ["mnist-ps-0.mnist-ps.ml.svc.cluster.local:8470"]},
                  "task": {"type": "ps", "index": 0}}


def test_entrypoint_leaves_kubeflows_tf_config_alone():
    mine = '{"cluster":{"ps":["a:1"]},"task":{"type":"ps","index":0},"environment":"cloud"}'
    r = run_entrypoint(["workerd", "--sync=1"],
                       dict(K8S_ENV, HOSTNAME="restps-ps-1", TF_CONFIG=mine, RESTPS_DRY_RUN="1"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "TF_CONFIG=" + mine
    assert dry_run_argv(r.stdout) == ["workerd", "--sync=1"]
    # and without RESTPS_PS_REPLICAS nothing is made up: the flags say it all
    r = run_entrypoint(["psd", "--port=0"], {"HOSTNAME": "restps-ps-0", "RESTPS_DRY_RUN": "1"})
    assert r.stdout.splitlines()[0] == "TF_CONFIG=" and dry_run_argv(r.stdout) == ["psd", "--port=0"]


def test_entrypoint_picks_the_program_by_the_job_when_given_only_flags():
    for pod, prog in (("restps-ps-1", "psd"), ("restps-worker-0", "workerd")):
        r = run_entrypoint(["--log_every=10"], dict(K8S_ENV, HOSTNAME=pod, RESTPS_DRY_RUN="1"))
        assert dry_run_argv(r.stdout) == [prog, "--log_every=10"], r.stderr
    r = run_entrypoint(["--log_every=10"], {"HOSTNAME": "restps-ps-0"})
    assert r.returncode == 2 and "give the program before the flags" in r.stderr
    # anything else runs as it is (a shell for a look inside)
    r = run_entrypoint(["sh", "-c", "echo $TF_CONFIG"], dict(K8S_ENV, HOSTNAME="restps-ps-0"))
    assert json.loads(r.stdout)["task"] == {"type": "ps", "index": 0}


@pytest.mark.parametrize("env,words", [
    ({"HOSTNAME": "web-5f6d7"}, "is not restps-<job>-<ordinal>"),
    ({"HOSTNAME": "restps-ps-2"}, "index 2 out of range: job 'ps' has 2 tasks"),
    ({"HOSTNAME": "restps-worker-3"}, "index 3 out of range: job 'worker' has 3 tasks"),
    ({"HOSTNAME": "restps-chef-0"}, "unknown job 'chef'"),
    ({"HOSTNAME": "restps-ps-0", "RESTPS_PS_REPLICAS": "two"}, "RESTPS_PS_REPLICAS 'two'"),
    ({"HOSTNAME": "restps-ps-0", "RESTPS_PS_REPLICAS": "0"}, "RESTPS_PS_REPLICAS '0'"),
    ({"HOSTNAME": "restps-ps-0", "RESTPS_PORT": "70000"}, "RESTPS_PORT '70000' is not a port"),
    ({"HOSTNAME": "restps-ps-01"}, "is not restps-<job>-<ordinal>"),  # TF_CONFIG's index is JSON
    # an Indexed Job's pod name without its index, and index and hostname that disagree
    ({"HOSTNAME": "restps-worker-1-x7k2p"}, "is not restps-<job>-<ordinal>"),
    ({"HOSTNAME": "restps-worker-1", "JOB_COMPLETION_INDEX": "2"}, "is not restps-<job>-2"),
    ({"HOSTNAME": "restps-worker-11", "JOB_COMPLETION_INDEX": "1"}, "is not restps-<job>-1"),
    ({"HOSTNAME": "restps-1", "JOB_COMPLETION_INDEX": "1"}, "is not restps-<job>-1"),
    ({"HOSTNAME": "restps-worker-1", "JOB_COMPLETION_INDEX": "x"}, "JOB_COMPLETION_INDEX 'x'"),
    ({"HOSTNAME": "restps-worker-1", "JOB_COMPLETION_INDEX": ""}, "JOB_COMPLETION_INDEX ''"),
    ({"HOSTNAME": "restps-worker-3", "JOB_COMPLETION_INDEX": "3"},
     "index 3 out of range: job 'worker' has 3 tasks"),
])
def test_entrypoint_refuses_what_it_cannot_map(env, words):
    r = run_entrypoint(["psd"], dict(K8S_ENV, **env))
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("restps-entrypoint: ")


class Started:
    """A process started through the entrypoint, stopped by PID at the end."""

    def __init__(self, args, env):
        e = {"PATH": bin_path(), "HOME": os.getcwd()}
        e.update({k: v for k, v in os.environ.items() if k.endswith("SAN_OPTIONS")})
        e.update(env)
        self.proc = subprocess.Popen(["sh", ENTRYPOINT] + args, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=e, text=True)

    def listening(self):
        """psd's "listening on URL" line, past the log lines before it."""
        lines = []
        for line in self.proc.stdout:
            if line.startswith("psd: listening on "):
                return line.split("listening on ", 1)[1].strip()
            lines.append(line)
            if len(lines) > 50:
                break
        raise AssertionError("psd did not start:\n" + "".join(lines))

    def comm(self):
        with open(f"/proc/{self.proc.pid}/comm") as f:
            return f.read().strip()

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return self.proc.returncode, out


@pytest.fixture
def started():
    procs = []

    def start(args, env):
        p = Started(args, env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def test_entrypoint_runs_psd_from_a_statefulset_pod_and_its_healthcheck(started, tmp_path):
    port = free_port()
    # the pod's own TF_CONFIG (ps 1, at restps-ps-1.restps-ps); --bind keeps it on loopback here
    ps = started(["psd", "--bind=127.0.0.1", f"--logdir={tmp_path}"],
                 {"RESTPS_PS_REPLICAS": "2", "RESTPS_WORKER_REPLICAS": "1",
                  "RESTPS_PORT": str(port), "HOSTNAME": "restps-ps-1"})
    assert ps.listening() == f"http://127.0.0.1:{port}"
    assert ps.comm() == "psd"  # exec'd: psd itself gets the pod's SIGTERM
    assert http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200
    st = json.loads(http("GET", f"http://127.0.0.1:{port}/v1/status")[2])
    assert st["task"] == {"type": "ps", "index": 1}

    def health(**env):
        return run_entrypoint(["healthcheck"], env).returncode

    assert health(RESTPS_HEALTH_PID=str(ps.proc.pid), RESTPS_PORT=str(port)) == 0
    assert health(RESTPS_HEALTH_PID=str(ps.proc.pid), RESTPS_PORT=str(free_port())) != 0
    assert health(RESTPS_HEALTH_PID=str(os.getpid())) == 0  # not psd: a worker, healthy while it runs
    assert health(RESTPS_HEALTH_PID="999999999") == 1  # no such process
    rc, out = ps.stop()
    assert rc == 0, out
    no_sanitizer_report(out)
    assert os.path.isdir(tmp_path / "ps-1")  # its checkpoint folder, --logdir as given


@needs_data
def test_entrypoint_runs_a_tfjob_chief_and_ps_with_the_operators_tf_config(started, tmp_path):
    """TF_CONFIG as Kubeflow's operator writes it (a chief, "environment"),
    given to both tasks: the chief trains a few steps, then stops the ps."""
    port, chief = free_port(), free_port()
    cluster = {"chief": [f"127.0.0.1:{chief}"], "ps": [f"127.0.0.1:{port}"]}

    def tf(job):
        return json.dumps({"cluster": cluster, "task": {"type": job, "index": 0},
                           "environment": "cloud"})

    ps = started(["psd", f"--logdir={tmp_path}"], {"TF_CONFIG": tf("ps")})
    assert ps.listening() == f"http://127.0.0.1:{port}"
    w = started(["workerd", f"--data_dir={DATA}", "--train_steps=20", "--log_every=0",
                 "--hidden_units=16"], {"TF_CONFIG": tf("chief"), "RESTPS_PS_REPLICAS": "3"})
    out, _ = w.proc.communicate(timeout=180)
    assert w.proc.returncode == 0, out
    assert "training done" in out and "asked the ps tasks to stop" in out, out
    assert ps.proc.wait(timeout=30) == 0
    no_sanitizer_report(out + ps.proc.stdout.read())


# ------------------------------------------------------------ the Slurm script

def sbatch(args, env, path=f"/usr/bin{os.pathsep}/bin", timeout=30):
    e = {"PATH": str(path)}
    e.update(env)
    return subprocess.run(["/bin/bash", SBATCH] + list(args), capture_output=True, text=True,
                          env=e, timeout=timeout)


@pytest.fixture
def fake_scontrol(tmp_path):
    d = tmp_path / "scontrol-bin"
    d.mkdir()
    (d / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[1-4]" ] || '
                                '{ echo "fake scontrol: $*" >&2; exit 1; }\n'
                                'printf "node%s\\n" 1 2 3 4\n')
    (d / "scontrol").chmod(0o755)
    return d


def test_sbatch_maps_tasks_to_roles(fake_scontrol):
    env = {"RESTPS_SLURM_TASK": "1", "RESTPS_DRY_RUN": "1", "SLURM_JOB_NODELIST": "node[1-4]",
           "SLURM_NTASKS": "4", "RESTPS_N_PS": "2", "SLURM_SUBMIT_DIR": "/home/me/restps",
           "SLURM_JOB_ID": "77", "RESTPS_PSD_ARGS": "--save_checkpoint_secs=30 --keep_checkpoints=2",
           "TF_CONFIG": '{"cluster":{}}'}
    cluster = ["--ps_hosts=node1:2222,node2:2222", "--worker_hosts=node3:2222,node4:2222"]
    logdir = "/home/me/restps/logs/slurm-77"
    want = {
        0: ["/home/me/restps/bin/psd", "--job_name=ps", "--task_index=0", *cluster,
            f"--logdir={logdir}", "--save_checkpoint_secs=30", "--keep_checkpoints=2"],
        1: ["/home/me/restps/bin/psd", "--job_name=ps", "--task_index=1", *cluster,
            f"--logdir={logdir}", "--save_checkpoint_secs=30", "--keep_checkpoints=2"],
        2: ["/home/me/restps/bin/workerd", "--job_name=worker", "--task_index=0", *cluster,
            f"--export={logdir}/model.safetensors", "--sync=1", "--train_steps=500"],
        3: ["/home/me/restps/bin/workerd", "--job_name=worker", "--task_index=1", *cluster,
            "--sync=1", "--train_steps=500"],
    }
    for procid, argv in want.items():
        r = sbatch(["--sync=1", "--train_steps=500"], dict(env, SLURM_PROCID=str(procid)),
                   path=fake_scontrol)
        assert r.returncode == 0, r.stderr
        assert dry_run_argv(r.stdout) == argv


def test_sbatch_without_scontrol_takes_a_comma_list_and_says_what_is_wrong(tmp_path):
    # a task's dry run needs no command but scontrol: an empty PATH has none
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = {"RESTPS_SLURM_TASK": "1", "RESTPS_DRY_RUN": "1", "SLURM_PROCID": "1",
           "RESTPS_PORT": "8470", "RESTPS_BIN_DIR": "/opt/restps"}
    r = sbatch([], dict(env, SLURM_JOB_NODELIST="a,b,c"), path=empty)
    assert dry_run_argv(r.stdout) == ["/opt/restps/workerd", "--job_name=worker", "--task_index=0",
                                      "--ps_hosts=a:8470", "--worker_hosts=b:8470,c:8470",
                                      "--export=./logs/slurm-0/model.safetensors"], r.stderr
    for extra, words in [({"SLURM_JOB_NODELIST": "node[1-3]"}, "scontrol is needed"),
                         ({"SLURM_JOB_NODELIST": "a,b", "SLURM_NTASKS": "4"}, "2 nodes for 4 tasks"),
                         ({"SLURM_JOB_NODELIST": "a,b", "RESTPS_N_PS": "2"}, "at least 1 ps and 1 worker"),
                         ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set")]:
        r = sbatch([], dict(env, **extra), path=empty)
        assert r.returncode == 2 and words in r.stderr, (extra, r.stderr)
    r = sbatch([], {})  # the batch step outside a job
    assert r.returncode == 2 and "submit it with sbatch" in r.stderr


FAKE_SRUN = r'''#!PYTHON
"""srun, as far as restps.sbatch uses it: starts --ntasks copies of the
command here, each with its SLURM_PROCID; --kill-on-bad-exit=1 stops the
others when one fails; --label prefixes each line with the task number."""
import os, subprocess, sys, threading, time
args, n, label = sys.argv[1:], None, False
while args and args[0].startswith("-"):
    a = args.pop(0)
    if a.startswith("--ntasks="):
        n = int(a.split("=", 1)[1])
    elif a == "--label":
        label = True
    elif a not in ("--kill-on-bad-exit=1", "--ntasks-per-node=1"):
        sys.exit("fake srun: unexpected option " + a)
procs = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID="0"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
         for i in range(n)]
def copy(i, p):
    for line in p.stdout:
        sys.stdout.write((f"{i}: " if label else "") + line)
        sys.stdout.flush()
threads = [threading.Thread(target=copy, args=(i, p)) for i, p in enumerate(procs)]
for t in threads:
    t.start()
while any(p.poll() is None for p in procs):
    if any(p.poll() not in (None, 0) for p in procs):
        for p in procs:
            if p.poll() is None:
                p.terminate()
    time.sleep(0.1)
for t in threads:
    t.join()
sys.exit(max(p.returncode for p in procs))
'''


@needs_data
def test_sbatch_runs_a_one_ps_one_worker_job_here(tmp_path):
    """The whole script, batch step included, with a fake srun that runs the
    two tasks on this machine: ps on 127.0.0.1, the worker (the chief) on
    127.0.0.2 (a distinct cluster address; workerd listens on nothing)."""
    d = tmp_path / "srun-bin"
    d.mkdir()
    (d / "srun").write_text(FAKE_SRUN.replace("PYTHON", sys.executable, 1))
    (d / "srun").chmod(0o755)
    port = free_port()
    env = {"SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
           "SLURM_SUBMIT_DIR": str(tmp_path), "RESTPS_BIN_DIR": os.path.abspath(BIN),
           "RESTPS_PORT": str(port), "HOME": str(tmp_path)}
    env.update({k: v for k, v in os.environ.items() if k.endswith("SAN_OPTIONS")})
    p = subprocess.Popen(["/bin/bash", SBATCH, f"--data_dir={DATA}", "--train_steps=30",
                          "--hidden_units=16", "--sync=1", "--log_every=0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(env, PATH=f"{d}:/usr/bin:/bin"), start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the session this test started: srun and its tasks
        out, _ = p.communicate()
        pytest.fail(f"the job did not end in 240 s:\n{out[-4000:]}")
    assert p.returncode == 0, out[-4000:]
    no_sanitizer_report(out)
    assert f"0: psd: listening on http://127.0.0.1:{port}" in out, out
    assert "1: worker 0: training done at global step 30" in out, out
    logdir = tmp_path / "logs" / "slurm-7"
    assert (logdir / "model.safetensors").stat().st_size > 1000
    assert any(f.endswith(".safetensors") for f in os.listdir(logdir / "ps-0")), os.listdir(logdir / "ps-0")
