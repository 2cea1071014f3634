"""psd's command line: --help lists every flag of the source's flag table; bad
cluster input and bad flags stop it with exit 2 and one line on stderr naming
the problem; TF_CONFIG alone places it; flags win over TF_CONFIG; --port=0
prints where it listens; SIGTERM and SIGINT stop it with exit 0.

And what a new user of psd and workerd hits first (issue 37): a misspelt flag
names the nearest one, with one hint; a --model that is no spec lists the
forms, one over the limit is refused instead of cut; an address without a
port is refused (flags and TF_CONFIG); a workerd waiting for the default ps
says that it is the default; the ring (and a pipeline without the ps) have no
default ps, so localhost:2222 may be a worker's own address."""
import errno
import json
import os
import re
import selectors
import signal
import socket
import struct
import subprocess
import time

import pytest

from conftest import ROOT, SANITIZER_MARKS, binary, http
from procs import free_port


def run(args, env=None, timeout=15):
    """psd that must exit by itself. One that starts listening instead (or hangs)
    is killed by PID at once and the test fails."""
    e = dict(os.environ)
    e.pop("TF_CONFIG", None)
    e.update(env or {})
    proc = subprocess.Popen([binary("psd"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=e)
    out = b""
    deadline = time.time() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.time() < deadline:
            if sel.select(timeout=0.05):
                chunk = os.read(proc.stdout.fileno(), 4096)
                out += chunk
                if not chunk or b"listening" in out:
                    break
    if b"listening" in out or proc.poll() is None and time.time() >= deadline:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"psd {args} env {env} kept running instead of exiting: "
                             f"{out.decode(errors='replace')!r}")
    rest, err = proc.communicate(timeout=timeout)
    return proc.returncode, (out + rest).decode(errors="replace"), err.decode(errors="replace")


# ---------------------------------------------------------------------- help

def source_flags():
    with open(os.path.join(ROOT, "server", "psd.c")) as f:
        src = f.read()
    names = re.findall(r'\{\s*"([A-Za-z0-9_]+)"\s*,\s*FLAG_[A-Z0-9]+', src)
    assert len(names) >= 10, names  # the regex still finds the table
    return names


@pytest.mark.parametrize("arg", ["--help", "-h"])
def test_help_lists_every_flag(arg):
    rc, out, err = run([arg])
    assert rc == 0, err
    assert out.startswith("usage: psd"), out[:200]
    listed = set(re.findall(r"^\s+--([A-Za-z0-9_]+)", out, re.M))
    missing = [n for n in source_flags() if n not in listed]
    assert not missing, f"--help does not list {missing}"
    assert listed <= set(source_flags()), f"--help lists unknown flags {listed - set(source_flags())}"


# ----------------------------------------------------- refusals: exit 2, 1 line

def assert_refused(result, *words):
    rc, out, err = result
    assert rc == 2, (rc, out, err)
    assert "listening" not in out, out
    lines = err.rstrip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("psd: "), \
        f"want one 'psd: ...' line on stderr, got {err!r}"
    for w in words:
        assert w.lower() in lines[0].lower(), f"{lines[0]!r} does not mention {w!r}"


CLUSTER_CASES = {
    "unknown_job": (["--job_name=foo"], None, ["foo"]),
    "unknown_job_empty": (["--job_name="], None, ["job"]),
    "index_out_of_range": (["--task_index=1"], None, ["index", "1"]),
    "index_out_of_range_list": (["--ps_hosts=localhost:5001,localhost:5002", "--task_index=2"],
                                None, ["index", "2"]),
    "negative_index": (["--task_index=-1"], None, ["index"]),
    "negative_index_5": (["--task_index=-5"], None, ["index"]),
    "host_port_letters": (["--ps_hosts=localhost:abc"], None, ["localhost:abc"]),
    "host_port_zero": (["--ps_hosts=localhost:0"], None, ["localhost:0"]),
    "host_port_too_big": (["--ps_hosts=localhost:70000"], None, ["localhost:70000"]),
    "host_port_negative": (["--ps_hosts=localhost:-1"], None, ["localhost:-1"]),
    "host_port_empty_port": (["--ps_hosts=localhost:"], None, ["localhost:"]),
    "host_port_empty_host": (["--ps_hosts=:2222"], None, [":2222"]),
    "host_port_two_colons": (["--ps_hosts=a:1:2"], None, ["a:1:2"]),
    "host_port_space": (["--ps_hosts=local host:1"], None, ["local host:1"]),
    "host_port_ipv6_open": (["--ps_hosts=[::1:2222"], None, ["[::1:2222"]),
    "host_port_ipv6_junk": (["--ps_hosts=[zz]:1"], None, ["[zz]:1"]),
    "host_port_empty_entry": (["--ps_hosts=localhost:5001,,localhost:5002"], None, ["address"]),
    "host_port_worker_list": (["--worker_hosts=w1:1,w2:x"], None, ["w2:x"]),
    "host_port_chief": (["--chief_hosts=chief:99999"], None, ["chief:99999"]),
    "two_chiefs": (["--chief_hosts=c1:1,c2:2"], None, ["chief"]),
    "address_twice": (["--ps_hosts=localhost:5001,localhost:5001"], None, ["localhost:5001"]),
    "worker_job": (["--job_name=worker", "--worker_hosts=localhost:5003"], None, ["worker"]),
    "chief_job": (["--job_name=chief", "--chief_hosts=localhost:5004"], None, ["chief"]),
    "evaluator_job": (["--job_name=evaluator"], None, ["evaluator"]),
    "tf_config_bad_json": ([], '{"cluster": {"ps": ["localhost:5001"]', ["TF_CONFIG"]),
    "tf_config_not_json": ([], "ps=localhost:5001", ["TF_CONFIG"]),
    "tf_config_array": ([], '["ps"]', ["TF_CONFIG"]),
    "tf_config_cluster_not_object": ([], '{"cluster": ["localhost:1"]}', ["TF_CONFIG", "cluster"]),
    "tf_config_job_not_list": ([], '{"cluster": {"ps": "localhost:5001"}}', ["TF_CONFIG", "ps"]),
    "tf_config_addr_not_string": ([], '{"cluster": {"ps": [5001]}}', ["TF_CONFIG", "ps"]),
    "tf_config_bad_addr": ([], '{"cluster": {"ps": ["localhost:x"]}}', ["localhost:x"]),
    "tf_config_unknown_job": ([], '{"cluster": {"ps": ["localhost:5001"], "master": ["m:1"]}}',
                              ["master"]),
    "tf_config_index_string": ([], '{"cluster": {"ps": ["localhost:5001"]}, '
                                   '"task": {"type": "ps", "index": "0"}}', ["index"]),
    "tf_config_index_negative": ([], '{"cluster": {"ps": ["localhost:5001"]}, '
                                     '"task": {"type": "ps", "index": -1}}', ["index"]),
    "tf_config_index_out_of_range": ([], '{"cluster": {"ps": ["localhost:5001"]}, '
                                         '"task": {"type": "ps", "index": 3}}', ["index"]),
    "tf_config_task_type_missing": ([], '{"cluster": {"worker": ["localhost:5001"]}, '
                                        '"task": {"type": "ps", "index": 0}}', ["ps"]),
    "tf_config_task_type_unknown": ([], '{"cluster": {"ps": ["localhost:5001"]}, '
                                        '"task": {"type": "boss", "index": 0}}', ["boss"]),
    "tf_config_worker_task": ([], '{"cluster": {"ps": ["localhost:5001"], '
                                  '"worker": ["localhost:5002"]}, '
                                  '"task": {"type": "worker", "index": 0}}', ["worker"]),
    "tf_config_duplicate_key": ([], '{"cluster": {"ps": ["localhost:5001"]}, '
                                    '"cluster": {"ps": ["localhost:5002"]}}', ["TF_CONFIG"]),
    # issue 37: host:port, as docs/training.md says, from the flags as from TF_CONFIG
    "host_port_no_port": (["--ps_hosts=h1"], None, ["--ps_hosts", "'h1'", "no port", "host:port"]),
    "host_port_no_port_worker": (["--worker_hosts=localhost:5001,w2"], None, ["'w2'", "no port"]),
    "tf_config_no_port": ([], '{"cluster": {"ps": ["h1"]}, "task": {"type": "ps", "index": 0}}',
                          ["cluster.ps[0]", "'h1'", "no port", "host:port"]),
    "tf_config_no_port_ipv6": ([], '{"cluster": {"ps": ["[::1]"]}}', ["cluster.ps[0]", "[::1]", "no port"]),
}


@pytest.mark.parametrize("case", sorted(CLUSTER_CASES))
def test_bad_cluster_input(case):
    args, tf, words = CLUSTER_CASES[case]
    # --port=0: a psd that wrongly accepts the input cannot collide with anything
    assert_refused(run(["--port=0", *args], env={"TF_CONFIG": tf} if tf else None), *words)


FLAG_CASES = {
    "unknown_flag": (["--nope=1"], ["--nope"]),
    "unknown_flag_no_value": (["--verbose"], ["--verbose"]),
    "single_dash": (["-port=0"], ["-port=0"]),
    "stray_argument": (["extra"], ["extra"]),
    "missing_value": (["--port"], ["--port"]),
    "port_letters": (["--port=abc"], ["--port", "abc"]),
    "port_empty": (["--port="], ["--port"]),
    "port_too_big": (["--port=70000"], ["--port", "70000"]),
    "port_negative": (["--port=-7"], ["--port"]),
    "port_overflow": (["--port=99999999999999999999"], ["--port"]),
    "learning_rate_word": (["--learning_rate=fast"], ["--learning_rate", "fast"]),
    "learning_rate_negative": (["--learning_rate=-0.1"], ["--learning_rate"]),
    "learning_rate_zero": (["--learning_rate=0"], ["--learning_rate"]),
    "learning_rate_nan": (["--learning_rate=nan"], ["--learning_rate"]),
    "learning_rate_inf": (["--learning_rate=inf"], ["--learning_rate"]),
    "max_body_negative": (["--max_body_bytes=-5"], ["--max_body_bytes"]),
    "max_body_zero": (["--max_body_bytes=0"], ["--max_body_bytes"]),
    "max_body_float": (["--max_body_bytes=1.5"], ["--max_body_bytes"]),
    "max_body_overflow": (["--max_body_bytes=99999999999999999999999"], ["--max_body_bytes"]),
    "http_threads_too_many": (["--http_threads=1000"], ["--http_threads"]),
    "http_threads_negative": (["--http_threads=-1"], ["--http_threads"]),
    "http_threads_zero": (["--http_threads=0"], ["--http_threads=0", "thread per connection", "no longer supported"]),
    "connection_timeout_zero": (["--connection_timeout=0"], ["--connection_timeout"]),
    "max_connections_zero": (["--max_connections=0"], ["--max_connections"]),
    "bool_bad_value": (["--auth_reads=maybe"], ["--auth_reads", "maybe"]),
    "buffer_pool_word": (["--buffer_pool_mib=lots"], ["--buffer_pool_mib"]),
    "task_index_word": (["--task_index=one"], ["--task_index"]),
}


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_bad_flag(case):
    args, words = FLAG_CASES[case]
    extra = [] if any(a.startswith("--port") for a in args) else ["--port=0"]
    assert_refused(run([*extra, *args]), *words)


# --------------------------------------------------------- where it listens

def status(url):
    st, _, body = http("GET", url + "/v1/status")
    assert st == 200, body
    return json.loads(body)


def listens_on(port):
    st, _, body = http("GET", f"http://127.0.0.1:{port}/healthz")
    return st == 200 and json.loads(body) == {"status": "ok"}


def test_tf_config_alone_places_psd(start_psd):
    port, other = free_port(), free_port()
    tf = {"cluster": {"ps": [f"localhost:{port}"], "worker": [f"localhost:{other}"]},
          "task": {"type": "ps", "index": 0}}
    p = start_psd(env={"TF_CONFIG": json.dumps(tf)}, port0=False)
    assert p.port == port and p.url == f"http://127.0.0.1:{port}"
    assert listens_on(port)
    assert status(p.url)["task"] == {"type": "ps", "index": 0}


def test_tf_config_second_ps(start_psd):
    a, b = free_port(), free_port()
    tf = {"cluster": {"ps": [f"localhost:{a}", f"127.0.0.1:{b}"]},
          "task": {"type": "ps", "index": 1}}
    p = start_psd(env={"TF_CONFIG": json.dumps(tf)}, port0=False)
    assert p.port == b and listens_on(b)
    assert status(p.url)["task"] == {"type": "ps", "index": 1}


def test_flags_override_tf_config_hosts(start_psd):
    tf_port, flag_port = free_port(), free_port()
    tf = {"cluster": {"ps": [f"localhost:{tf_port}"]}, "task": {"type": "ps", "index": 0}}
    p = start_psd(f"--ps_hosts=localhost:{flag_port}", env={"TF_CONFIG": json.dumps(tf)},
                  port0=False)
    assert p.port == flag_port and listens_on(flag_port)


def test_flags_override_tf_config_index(start_psd):
    a, b = free_port(), free_port()
    tf = {"cluster": {"ps": [f"localhost:{a}", f"localhost:{b}"]},
          "task": {"type": "ps", "index": 0}}
    p = start_psd("--task_index=1", env={"TF_CONFIG": json.dumps(tf)}, port0=False)
    assert p.port == b and status(p.url)["task"] == {"type": "ps", "index": 1}


def test_port_flag_overrides_tf_config(start_psd):
    tf_port, port = free_port(), free_port()
    tf = {"cluster": {"ps": [f"localhost:{tf_port}"]}, "task": {"type": "ps", "index": 0}}
    p = start_psd(f"--port={port}", env={"TF_CONFIG": json.dumps(tf)}, port0=False)
    assert p.port == port and listens_on(port)


def test_job_name_flag_overrides_tf_config():
    a, w = free_port(), free_port()
    tf = {"cluster": {"ps": [f"localhost:{a}"], "worker": [f"localhost:{w}"]},
          "task": {"type": "ps", "index": 0}}
    assert_refused(run(["--job_name=worker"], env={"TF_CONFIG": json.dumps(tf)}), "worker")


def test_port0_prints_the_line():
    e = dict(os.environ)
    e.pop("TF_CONFIG", None)
    proc = subprocess.Popen([binary("psd"), "--port=0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=e)
    try:
        line = proc.stdout.readline().decode()
        m = re.fullmatch(r"psd: listening on http://127\.0\.0\.1:(\d+)\n", line)
        assert m, repr(line)
        port = int(m.group(1))
        assert 0 < port < 65536 and listens_on(port)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=20)
    assert proc.returncode == 0


# ------------------------------------------------------------------- signals

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "open_connection"])
def test_signal_exits_0(sig, busy):
    e = dict(os.environ)
    e.pop("TF_CONFIG", None)
    proc = subprocess.Popen([binary("psd"), "--port=0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=e)
    conn = None
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("psd: listening on "), line
        url = line.split("listening on ", 1)[1].strip()
        st, _, _ = http("PUT", url + "/v1/vars/w", b"\0" * 8, {"X-Shape": "2"})
        assert st == 201
        if busy:  # a keep-alive connection left open, and one half-sent request
            conn = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            conn.sendall(b"PUT /v1/vars/x HTTP/1.1\r\nHost: h\r\nX-Shape: 2\r\n"
                         b"Content-Length: 8\r\n\r\n\0\0")
            time.sleep(0.05)
        t0 = time.time()
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=20)
        assert time.time() - t0 < 15
    finally:
        if conn:
            conn.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")
    for mark in ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer"):
        assert mark not in err.decode(errors="replace")


def test_a_task_on_another_loopback_address_listens_there(start_psd):
    """--ps_hosts=127.0.0.2:P: psd binds 127.0.0.2 (a socket on 127.0.0.1 does
    not answer for it), and not 127.0.0.1."""
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    port = s.getsockname()[1]
    s.close()
    p = start_psd(f"--ps_hosts=127.0.0.2:{port}", port0=False)
    assert p.url == f"http://127.0.0.2:{port}", p.url
    st, _, body = http("GET", f"http://127.0.0.2:{port}/healthz")
    assert st == 200, body
    c = socket.socket()
    try:
        with pytest.raises(OSError):
            c.connect(("127.0.0.1", port))
    finally:
        c.close()


# ------------------------------------------- a new user's first mistakes (issue 37)

def clean_env():
    e = dict(os.environ)
    e.pop("TF_CONFIG", None)
    return e


def run_workerd(args, timeout=30):
    """workerd that must exit by itself: (exit status, stdout, stderr)."""
    r = subprocess.run([binary("workerd"), *args], capture_output=True, env=clean_env(), timeout=timeout)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


def one_line(err, prog):
    lines = err.rstrip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith(prog + ": "), f"want one '{prog}: ...' line, got {err!r}"
    return lines[0]


@pytest.mark.parametrize("prog,arg,want", [
    ("workerd", "--trian_steps=5",
     "workerd: unknown flag '--trian_steps' (did you mean --train_steps? see workerd --help)"),
    ("workerd", "--batchsize=5", "workerd: unknown flag '--batchsize' (did you mean --batch_size? see workerd --help)"),
    ("workerd", "--nope=1", "workerd: unknown flag '--nope' (see workerd --help)"),
    ("psd", "--prot=0", "psd: unknown flag '--prot' (did you mean --port? see psd --help)"),
    ("psd", "--logdri=x", "psd: unknown flag '--logdri' (did you mean --logdir? see psd --help)"),
    ("psd", "--nope=1", "psd: unknown flag '--nope' (see psd --help)"),
], ids=["workerd_near", "workerd_near_2", "workerd_far", "psd_near", "psd_near_2", "psd_far"])
def test_unknown_flag_names_the_nearest_once(prog, arg, want):
    if prog == "psd":
        rc, out, err = run(["--port=0", arg])
    else:
        rc, out, err = run_workerd([arg])
    assert rc == 2, (rc, out, err)
    assert one_line(err, prog) == want


def test_a_bad_value_has_one_hint():
    rc, _, err = run_workerd(["--train_steps=five"])
    assert rc == 2 and one_line(err, "workerd") == "workerd: --train_steps: bad value 'five' (see workerd --help)"


@pytest.mark.parametrize("spec", ["cnnn", "mlp100", "CNN"])
def test_model_that_is_no_spec_lists_the_forms(spec):
    rc, out, err = run_workerd([f"--model={spec}"])
    assert rc == 2, (rc, out, err)
    line = one_line(err, "workerd")
    assert f'"{spec}"' in line and "--model" in line, line
    for form in ("mlp:H1,H2,...", "cnn", "conv:KHxKWxC", "pool:K", "dense:N", "dropout:R", "dense:10"):
        assert form in line, f"{line!r} does not list {form!r}"


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """5,100 training images (the validation set takes 5,000) and 20 test
    images of a pattern as raw IDX files: a run that gets as far as the data
    needs no more."""
    d = tmp_path_factory.mktemp("tiny-idx")
    for kind, n in (("train", 5100), ("t10k", 20)):
        (d / f"{kind}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) +
                                                       (bytes(range(0, 256, 3)) * (784 * n // 86 + 1))[:784 * n])
        (d / f"{kind}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + bytes(i % 10 for i in range(n)))
    return str(d)


def long_mlp(total):
    """mlp:16,32 in `total` bytes (leading zeros); cut to 511 bytes it reads mlp:16."""
    head = "mlp:" + "0" * 505 + "16"
    assert len(head) == 511
    return head + "," + "0" * (total - len(head) - 3) + "32"


def test_model_over_the_limit_is_refused_not_cut(tiny_data, tmp_path):
    spec = long_mlp(600)
    assert len(spec) == 600
    rc, out, err = run_workerd(["--local", f"--model={spec}", f"--data_dir={tiny_data}", "--train_steps=1",
                                "--batch_size=10", "--log_every=0"])
    assert rc == 2, f"a 600-byte --model ran (cut to another model?): {rc} {out[-500:]} {err}"
    line = one_line(err, "workerd")
    assert "--model" in line and "600 bytes" in line and "at most 511" in line, line
    # the limit itself is allowed: 511 bytes train mlp:16 (the export says which model)
    export = tmp_path / "m.safetensors"
    rc, out, err = run_workerd(["--local", f"--model={spec[:511]}", f"--data_dir={tiny_data}", "--train_steps=1",
                                "--batch_size=10", "--log_every=0", f"--export={export}"], timeout=60)
    assert rc == 0, (out[-1000:], err)
    raw = export.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["__metadata__"]["model"] == "mlp:16", header["__metadata__"]


def read_until(proc, marker, timeout):
    """proc's stdout until a line with marker (returned), EOF or timeout (AssertionError)."""
    out = b""
    deadline = time.time() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.time() < deadline:
            if sel.select(timeout=0.05):
                chunk = os.read(proc.stdout.fileno(), 4096)
                out += chunk
                for line in out.decode(errors="replace").splitlines(True):
                    if marker in line and line.endswith("\n"):
                        return line
                if not chunk:
                    break
    raise AssertionError(f"no line with {marker!r} in {timeout} s (exit {proc.poll()}): "
                         f"{out.decode(errors='replace')[-2000:]!r}")


def stop(proc):
    """SIGKILL by PID; its stderr, checked for sanitizer reports."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=20)
    for mark in SANITIZER_MARKS:
        assert mark not in (out + err).decode(errors="replace")
    return err.decode(errors="replace")


@pytest.fixture
def port_2222_refused():
    """Nobody answers on localhost:2222 while the test runs: the port held by
    sockets bound there that never listen (a connection is refused)."""
    held = []
    try:
        for fam, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                s = socket.socket(fam, socket.SOCK_STREAM)
            except OSError:
                continue  # no IPv6 here
            held.append(s)
            try:
                s.bind((addr, 2222))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    pytest.skip(f"{addr}:2222 is in use here: the default ps's address cannot be held")
                # no ::1 here: nothing can answer there either
        yield
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("given", [False, True], ids=["default", "given"])
def test_waiting_for_the_default_ps_says_so(tiny_data, port_2222_refused, given):
    args = [f"--worker_hosts=localhost:{free_port()}", f"--data_dir={tiny_data}", "--batch_size=10",
            "--recovery_wait_secs=0.1", "--timeout_ms=500"]
    if given:
        args.append("--ps_hosts=localhost:2222")  # the same address, asked for
    p = subprocess.Popen([binary("workerd"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=clean_env())
    try:
        line = read_until(p, "waiting for", 30)
    finally:
        stop(p)
    assert "waiting for the ps tasks" in line and "ps 0 (localhost:2222)" in line, line
    default = "ps 0 at localhost:2222 (the default: no --ps_hosts or TF_CONFIG given)"
    assert (default in line) == (not given), line


@pytest.mark.parametrize("mode", [["--allreduce=ring"], ["--pipeline_stages=2", "--micro_batches=2", "--model=mlp:8"]],
                         ids=["ring", "pipeline_local"])
def test_no_default_ps_without_the_ps(tiny_data, tmp_path, mode):
    """docs/ring.md and docs/pipeline.md: the ps flags are ignored there, so
    localhost:2222 (the default ps's) may be worker 0's address. Worker 1 starts
    (its start line) and waits for worker 0; it is killed then."""
    me = free_port()
    p = subprocess.Popen([binary("workerd"), *mode, "--task_index=1", f"--worker_hosts=localhost:2222,localhost:{me}",
                          f"--data_dir={tiny_data}", "--batch_size=10", f"--logdir={tmp_path}", "--train_steps=2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    err = ""
    try:
        line = read_until(p, "serving the ring on" if "--allreduce=ring" in mode else "pipeline stage 1 of 2", 30)
    except AssertionError:
        err = stop(p)
        raise AssertionError(f"worker 1 did not start: {err!r}")
    err = stop(p)
    assert "worker 1" in line, line
    assert "given twice" not in err, err
