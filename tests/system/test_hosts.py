"""Each task its own host (issue 32): psd and workerd run unchanged in network
namespaces made by deploy/netns/hosts.sh, one host a task, each with its own
address and a 1 Gbit/s NIC (tbf both ways), the cluster given by the hosts'
addresses, every task on port 2222 as on a real cluster. Sync training, the
ring and a 2-stage pipeline across hosts give the very model the same job gives
on loopback (same seed, same batches); async training over two ps hosts counts
every push once; HTTPS between hosts verifies certificates that name the
hosts' addresses. Skipped, with the reason, where namespaces cannot be made.
The network faults are in test_hosts_faults.py."""
import json
import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

import hostbed
from conftest import BIN, binary
from procs import finish, free_port

ASAN = "asan" in BIN
PORT = 2222
pytestmark = [
    pytest.mark.skipif(ASAN, reason="runs on the normal build only: a job on the hosts and the same job on "
                                    "loopback for each test (over the make test budget under ASan); the "
                                    "training, ring and pipeline paths run under ASan on loopback"),
]


@pytest.fixture
def bed_of(tmp_path):
    why = hostbed.refused()
    if why:
        pytest.skip(why)
    beds = []

    def make(n, **kw):
        b = hostbed.HostBed(n, tmp_path, **kw).__enter__()
        beds.append(b)
        return b
    yield make
    for b in beds:
        b.__exit__(None, None, None)


def tensors(path):
    """{name: array} of a safetensors file (read here, not by restps)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
        data = f.read()
    head.pop("__metadata__", None)
    return {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]], dtype=np.float32)
            for k, v in head.items()}


def same_model(a, b):
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb) and ta
    for k in ta:
        assert np.array_equal(ta[k], tb[k]), k


def loopback_job(tmp_path, nps, nworkers, args, name, ps_args=(), roles="ps"):
    """The same job on 127.0.0.1 with free ports: the chief's export path."""
    ps_hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(nps))
    wk_hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(nworkers))
    export = tmp_path / f"{name}.safetensors"
    cluster = ([f"--ps_hosts={ps_hosts}"] if nps else []) + [f"--worker_hosts={wk_hosts}"]
    procs = []
    try:
        for i in range(nps):
            procs.append(subprocess.Popen([binary("psd"), "--job_name=ps", f"--task_index={i}", *cluster,
                                           f"--logdir={tmp_path}/{name}-ps{i}", *ps_args],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        workers = []
        for i in reversed(range(nworkers)):
            extra = [f"--export={export}"] if i == 0 else []
            workers.append(subprocess.Popen([binary("workerd"), "--job_name=worker", f"--task_index={i}",
                                             *cluster, f"--logdir={tmp_path}/{name}-w{i}", *args, *extra],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        procs += workers
        for p in workers:
            rc, out = finish(p, timeout=180)
            assert rc == 0, out[-3000:]
        for p in procs[:nps]:
            rc, out = finish(p, timeout=60)
            assert rc == 0, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return export


def hosts_job(bed, nps, nworkers, args, name, ps_args=(), scheme_args=()):
    """The job on the hosts: ps i on host i, worker i on host nps+i. The chief's export path."""
    ps_hosts = ",".join(f"{bed.addr(i)}:{PORT}" for i in range(nps))
    wk_hosts = ",".join(f"{bed.addr(nps + i)}:{PORT}" for i in range(nworkers))
    cluster = ([f"--ps_hosts={ps_hosts}"] if nps else []) + [f"--worker_hosts={wk_hosts}"]
    export = bed.tmp / f"{name}.safetensors"
    for i in range(nps):
        bed.start(f"{name}-ps{i}", i, [binary("psd"), "--job_name=ps", f"--task_index={i}", *cluster,
                                       f"--logdir={bed.tmp}/{name}-ps{i}", *ps_args])
    for i in reversed(range(nworkers)):
        extra = [f"--export={export}"] if i == 0 else []
        bed.start(f"{name}-w{i}", nps + i, [binary("workerd"), "--job_name=worker", f"--task_index={i}",
                                            *cluster, f"--logdir={bed.tmp}/{name}-w{i}", *args, *scheme_args,
                                            *extra])
    for i in range(nworkers):
        assert bed.wait(f"{name}-w{i}", 180) == 0, bed.log(f"{name}-w{i}")[-3000:]
    for i in range(nps):
        assert bed.wait(f"{name}-ps{i}", 60) == 0, bed.log(f"{name}-ps{i}")[-3000:]
    bed.no_sanitizer_reports()
    return export


TRAIN = ["--hidden_units=32", "--batch_size=50", "--seed=7", "--log_every=0"]


def test_sync_across_hosts_gives_the_model_the_same_job_gives_on_loopback(bed_of, tmp_path):
    bed = bed_of(3)
    args = TRAIN + ["--sync=1", "--train_steps=150"]
    on_hosts = hosts_job(bed, 1, 2, args, "sync")
    chief = bed.log("sync-w0")
    assert "training done at global step 150" in chief, chief[-2000:]
    # the ps served the workers at their own addresses
    assert f"listening on {bed.addr(0)}:{PORT}" in bed.log("sync-ps0") or \
        f"{bed.addr(0)}:{PORT}" in bed.log("sync-ps0"), bed.log("sync-ps0")[-2000:]
    same_model(on_hosts, loopback_job(tmp_path, 1, 2, args, "sync-lo"))


def test_async_across_two_ps_hosts_counts_every_push_once(bed_of):
    bed = bed_of(4)
    steps = 400
    ps_hosts = f"{bed.addr(0)}:{PORT},{bed.addr(1)}:{PORT}"
    wk_hosts = f"{bed.addr(2)}:{PORT},{bed.addr(3)}:{PORT}"
    cluster = [f"--ps_hosts={ps_hosts}", f"--worker_hosts={wk_hosts}"]
    for i in range(2):
        bed.start(f"ps{i}", i, [binary("psd"), "--job_name=ps", f"--task_index={i}", *cluster,
                                f"--logdir={bed.tmp}/ps{i}"])
    for i in (1, 0):
        bed.start(f"w{i}", 2 + i, [binary("workerd"), "--job_name=worker", f"--task_index={i}", *cluster,
                                   *TRAIN, f"--train_steps={steps}", "--step_delay_ms=5"])
    url = f"http://{bed.addr(0)}:{PORT}/v1/status"

    def both_pushing():
        s = bed.get(2, url)
        return s if s and sum(1 for w in s["workers"] if w["pushes"] >= 20) == 2 else None
    st = bed.wait_for(both_pushing, 120, "both workers to push across the hosts")
    # async: every push is one step on each shard; the two workers' pushes add up to the step
    pushes = sum(w["pushes"] for w in st["workers"])
    assert st["mode"] == "async" and abs(pushes - st["global_step"]) <= 2, st
    for i in (0, 1):
        assert bed.wait(f"w{i}", 180) == 0, bed.log(f"w{i}")[-3000:]
    for i in (0, 1):
        assert bed.wait(f"ps{i}", 60) == 0, bed.log(f"ps{i}")[-3000:]
    chief = bed.log("w0")
    # async: both workers' last pushes may land past the bound, by one each at most
    done = re.search(r"training done at global step (\d+)", chief)
    assert done and steps <= int(done.group(1)) <= steps + 2, chief[-2000:]
    acc = float(chief.split("test accuracy ")[1].split()[0])
    assert acc >= 0.7, chief[-2000:]
    bed.no_sanitizer_reports()


def test_the_ring_across_hosts_gives_the_model_it_gives_on_loopback(bed_of, tmp_path):
    bed = bed_of(3)
    args = TRAIN + ["--allreduce=ring", "--train_steps=40", "--optimizer=momentum", "--learning_rate=0.05",
                    "--ring_piece_bytes=65536"]
    on_hosts = hosts_job(bed, 0, 3, args, "ring")
    assert "training done at global step 40" in bed.log("ring-w0"), bed.log("ring-w0")[-2000:]
    same_model(on_hosts, loopback_job(tmp_path, 0, 3, args, "ring-lo"))


def test_a_two_stage_pipeline_across_hosts_gives_the_model_it_gives_on_loopback(bed_of, tmp_path):
    bed = bed_of(2)
    args = ["--pipeline_stages=2", "--micro_batches=4", "--model=mlp:64,32", "--batch_size=32", "--seed=3",
            "--train_steps=40", "--log_every=0", "--optimizer=adam", "--learning_rate=0.01"]
    on_hosts = hosts_job(bed, 0, 2, args, "pipe")
    same_model(on_hosts, loopback_job(tmp_path, 0, 2, args, "pipe-lo"))


def openssl(*args, cwd):
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not shutil.which("openssl"), reason="openssl is missing: make deps installs it")
def test_https_between_hosts_verifies_certificates_naming_their_addresses(bed_of, tmp_path):
    bed = bed_of(3)
    d = tmp_path / "pki"
    d.mkdir()
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days",
            "2", "-subj", "/CN=restps hosts test CA", cwd=d)
    # the ps's certificate names its host's address (and its name), nothing else
    ps_addr = bed.addr(0)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "ps.key", "-out", "ps.csr", "-subj", "/CN=host0",
            cwd=d)
    (d / "ext.cnf").write_text(f"subjectAltName=IP:{ps_addr},DNS:host0\n")
    openssl("x509", "-req", "-in", "ps.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "ps.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    (d / "token").write_text("hosts-test-token\n")
    os.chmod(d / "token", 0o600)
    tls = [f"--tls_ca={d}/ca.pem", f"--auth_token_file={d}/token"]
    args = TRAIN + ["--sync=1", "--train_steps=60"] + tls
    ps_args = [f"--tls_cert={d}/ps.pem", f"--tls_key={d}/ps.key", f"--auth_token_file={d}/token"]
    hosts_job(bed, 1, 2, args, "tls", ps_args=ps_args)
    assert "training done at global step 60" in bed.log("tls-w0"), bed.log("tls-w0")[-2000:]

    # from another host, curl verifies the certificate by the address it dials
    bed.start("ps-again", 0, [binary("psd"), "--job_name=ps", "--task_index=0", f"--ps_hosts={ps_addr}:{PORT}",
                              f"--logdir={tmp_path}/again", *ps_args])
    url = f"https://{ps_addr}:{PORT}/healthz"
    bed.wait_for(lambda: bed.curl(1, url, "--cacert", f"{d}/ca.pem")[0] == 0, 30, "the ps to serve HTTPS again")
    bed.stop_all()

    # a ps whose certificate names another host's address: curl (exit 60) and a worker refuse it
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "wrong.key", "-out", "wrong.csr", "-subj",
            "/CN=host1", cwd=d)
    (d / "ext2.cnf").write_text(f"subjectAltName=IP:{bed.addr(1)},DNS:host1\n")
    openssl("x509", "-req", "-in", "wrong.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "wrong.pem", "-days", "2", "-extfile", "ext2.cnf", cwd=d)
    bed.start("ps-wrong", 0, [binary("psd"), "--job_name=ps", "--task_index=0", f"--ps_hosts={ps_addr}:{PORT}",
                              f"--logdir={tmp_path}/wrong", f"--tls_cert={d}/wrong.pem",
                              f"--tls_key={d}/wrong.key", f"--auth_token_file={d}/token"])
    bed.wait_for(lambda: "listening" in bed.log("ps-wrong"), 30, "the ps with the wrong certificate to start")
    rc, _ = bed.curl(1, url, "--cacert", f"{d}/ca.pem")
    assert rc == 60, rc  # the peer's certificate does not name this address
    bed.start("w-wrong", 2, [binary("workerd"), "--job_name=worker", "--task_index=0",
                             f"--ps_hosts={ps_addr}:{PORT}", f"--worker_hosts={bed.addr(2)}:{PORT}",
                             *TRAIN, "--train_steps=5", "--ps_retry_secs=2", *tls])
    rc = bed.wait("w-wrong", 90)
    out = bed.log("w-wrong")
    assert rc != 0 and "certificate" in out.lower(), out[-2000:]


def test_hosts_sh_refuses_bad_input_and_an_interrupted_up_leaves_nothing():
    if hostbed.refused():
        pytest.skip(hostbed.refused())
    tag = f"ti{os.getpid() % 100000}"

    def run(*args):
        return subprocess.run([hostbed.HOSTS_SH, f"--name={tag}", *args], capture_output=True, text=True)

    def left():
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return [n for n in names if n.startswith(tag + "-")] + \
            [n for n in os.listdir("/etc/netns") if n.startswith(tag + "-")] if os.path.isdir("/etc/netns") else []
    for args, words in [(["up", "2", "--rate=fast"], "rate 'fast'"), (["up", "0"], "N from 1 to"),
                        (["up", "x"], "N hosts, a number"), (["cut", "host0"], "no host 'host0'"),
                        (["frob"], "unknown command 'frob'"), (["up", "2", "--bogus"], "unknown option --bogus")]:
        r = run(*args)
        assert r.returncode != 0 and words in r.stderr, (args, r.stderr)
        assert not left(), left()
    p = subprocess.Popen([hostbed.HOSTS_SH, f"--name={tag}", "up", "200"], stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not left() and time.time() - t0 < 20:
            time.sleep(0.02)
        p.terminate()
        _, err = p.communicate(timeout=60)
    finally:
        run("down")
    assert p.returncode != 0 and "removing what it made" in err, err
    assert not left(), left()
