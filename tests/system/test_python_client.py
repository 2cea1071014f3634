"""The Python package client/python (import restps, issue 35) against live
psd processes: what it pulls is what curl and the raw route give, a push
does what numpy says SGD does, push ids make a retry harmless, the long poll
waits and wakes, ETags, typed errors carrying psd's JSON error, the bearer
token, HTTPS with a CA, libps's retries (a ps that comes up late is waited
for; a dead one is a NetworkError after the backoff), Cluster.from_tf_config
over two ps tasks with a variable split in parts (joined on a pull, cut on a
push, against the chief's export), the safetensors bodies against PyPI's
safetensors, and `pip install ./client/python` into a fresh venv."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import ROOT, binary, http
from procs import free_port
from test_tls import TOKEN, pki  # noqa: F401 (fixture)

sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import restps  # noqa: E402

VENV_PY = os.path.join(ROOT, "build", "venv", "bin", "python")
DATA = "/usr/share/datasets/fashion-mnist"
SGD = {"optimizer": "sgd", "learning_rate": 0.5}
rng = np.random.default_rng(35)


def seeded(p, names=("a", "b"), shapes=((3, 4), (5,)), cfg=SGD, token=None):
    """psd p configured with cfg and holding random variables; {name: value}."""
    c = restps.Client(p.host_port, token)
    vals = {}
    for n, s in zip(names, shapes):
        vals[n] = rng.standard_normal(s).astype(np.float32)
        assert c.put(n, vals[n]) is True
    c.configure(cfg)
    return c, vals


def test_pull_gives_what_psd_holds_and_push_applies_sgd(start_psd):
    p = start_psd()
    c, vals = seeded(p)
    got = c.pull()
    assert set(got) == {"a", "b"} and got.global_step == 0
    for n, v in vals.items():
        assert got[n].dtype == np.float32 and np.array_equal(got[n], v)
        st, hd, body = http("GET", p.url + f"/v1/vars/{n}")     # the raw route, one by one
        assert st == 200 and np.array_equal(np.frombuffer(body, "<f4").reshape(v.shape), v)
    assert set(c.pull(["b"])) == {"b"}
    with pytest.raises(KeyError):
        c.pull(["nope"])
    g = {"a": rng.standard_normal((3, 4)).astype(np.float32)}
    res = c.push(g, push_id="once", loss=1.5)
    assert res["outcome"] == "applied" and res["global_step"] == 1
    after = c.pull()
    want = vals["a"] - np.float32(0.5) * g["a"]
    assert np.allclose(after["a"], want, rtol=0, atol=1e-6) and np.array_equal(after["b"], vals["b"])
    # the same id again: a duplicate, nothing applied
    res = c.push(g, push_id="once")
    assert res["outcome"] == "duplicate" and res["duplicate"] is True
    assert np.array_equal(c.pull()["a"], after["a"])
    st = c.status()
    assert st["global_step"] == 1 and st["last_loss"] == 1.5
    assert [v["name"] for v in c.vars()["vars"]] == ["a", "b"]


def test_typed_errors_carry_psds_message_and_change_nothing(start_psd):
    p = start_psd()
    c, vals = seeded(p)
    with pytest.raises(restps.BadRequest) as e:
        c.push({"a": np.zeros((4, 3), np.float32)})
    assert e.value.status == 400 and "a" in e.value.message and e.value.body == {"error": e.value.message}
    assert str(e.value).startswith(f"{p.host_port}: POST /v1/grads: HTTP 400: ")
    with pytest.raises(restps.HTTPError) as e:
        c.push({"zz": np.zeros(2, np.float32)})
    assert e.value.status in (400, 404, 409) and "zz" in e.value.message
    with pytest.raises(restps.NotFound) as e:
        c.get_var("nope")
    assert "nope" in e.value.message
    with pytest.raises(restps.PreconditionFailed):
        c.put("a", vals["a"], create_only=True)
    assert c.pull().global_step == 0 and np.array_equal(c.pull()["a"], vals["a"])


def test_long_poll_waits_for_the_step_and_wakes_on_a_push(start_psd):
    p = start_psd()
    c, vals = seeded(p)
    t0 = time.monotonic()
    got = c.pull(min_step=1, timeout_ms=300)      # nobody pushes: answered at the timeout, step 0
    waited = time.monotonic() - t0
    assert got.global_step == 0 and 0.25 <= waited < 5, waited
    pusher = restps.Client(p.host_port)
    th = threading.Timer(0.3, lambda: pusher.push({"b": np.ones(5, np.float32)}))
    t0 = time.monotonic()      # the push comes 0.3 s after this, whenever the pull is sent
    th.start()
    got = c.pull(min_step=1, timeout_ms=20000)
    waited = time.monotonic() - t0
    th.join()
    assert got.global_step == 1 and 0.3 <= waited < 10, waited
    assert np.allclose(got["b"], vals["b"] - 0.5, atol=1e-6)


def test_etag_gives_304_until_the_variable_changes(start_psd):
    p = start_psd()
    c, vals = seeded(p)
    v = c.get_var("a")
    assert np.array_equal(v, vals["a"]) and c.last_etag
    etag = c.last_etag
    assert c.get_var("a", etag=etag) is None           # 304: still current
    c.push({"a": np.ones((3, 4), np.float32)})
    v2 = c.get_var("a", etag=etag)
    assert v2 is not None and c.last_etag != etag and np.allclose(v2, vals["a"] - 0.5, atol=1e-6)


def test_bearer_token_and_https_with_a_ca(start_psd, pki):  # noqa: F811
    from test_tls import start_tls_psd
    port = free_port()
    p = start_tls_psd(start_psd, pki, port)
    host = f"127.0.0.1:{port}"
    ca = f"{pki}/ca.pem"
    good = restps.Client(host, TOKEN, ca_file=ca)
    good.put("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    good.configure(SGD)
    # no token: the write is refused with 401 and psd's message, nothing changed
    with pytest.raises(restps.Unauthorized) as e:
        restps.Client(host, ca_file=ca).push({"w": np.ones((2, 3), np.float32)})
    assert e.value.status == 401 and e.value.message
    # a CA that did not sign psd's certificate: a TLSError, not retried
    t0 = time.monotonic()
    with pytest.raises(restps.TLSError):
        restps.Client(host, TOKEN, ca_file=f"{pki}/other.pem").pull()
    assert time.monotonic() - t0 < 5
    assert good.push({"w": np.ones((2, 3), np.float32)})["outcome"] == "applied"
    assert np.allclose(good.pull()["w"], np.arange(6).reshape(2, 3) - 0.5)
    assert restps.Client("https://" + host, TOKEN, ca_file=ca).pull().global_step == 1


def test_retries_wait_for_a_ps_that_comes_up_and_give_up_on_a_dead_one(start_psd):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(restps.NetworkError) as e:
        restps.Client(f"127.0.0.1:{port}", retries=3, backoff=0.1).status()
    took = time.monotonic() - t0
    assert f"127.0.0.1:{port}" in str(e.value)
    assert 0.35 <= took < 5, took          # waits of [0.05, 0.1] + [0.1, 0.2] + [0.2, 0.4]: 0.35 s at least
    # a ps that starts during the retry budget is waited for
    out = {}
    c = restps.Client(f"127.0.0.1:{port}", retries=0, backoff=0.05, backoff_max=0.2, retry_secs=20)
    th = threading.Thread(target=lambda: out.setdefault("status", c.status()))
    th.start()
    time.sleep(0.5)
    start_psd(f"--ps_hosts=127.0.0.1:{port}", port0=False)
    th.join(30)
    assert out["status"]["global_step"] == 0


def test_cluster_from_tf_config_joins_and_cuts_partitioned_variables(start_psd, tmp_path):
    """Two ps tasks, hid_w (784 x 16 floats, 50 KB) split by rows over both:
    the Cluster's pull is the chief's export; a push of ones moves every
    element of every part by the learning rate."""
    if not os.path.isdir(DATA):
        pytest.skip(f"{DATA} is missing: make deps installs dataset-fashion-mnist")
    hosts = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    for i in range(2):
        start_psd(f"--ps_hosts={','.join(hosts)}", f"--task_index={i}", port0=False)
    export = str(tmp_path / "m.safetensors")
    r = subprocess.run([binary("workerd"), f"--ps_hosts={','.join(hosts)}", "--worker_hosts=127.0.0.1:1",
                        "--model=mlp:16", "--partition_bytes=20000", "--train_steps=5", "--optimizer=sgd",
                        "--learning_rate=0.25", "--keep_ps", f"--export={export}", "--log_every=0",
                        f"--data_dir={DATA}", "--device=cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    tf = {"cluster": {"ps": hosts, "worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}}
    os.environ["TF_CONFIG"] = json.dumps(tf)
    try:
        cl = restps.Cluster.from_tf_config()
    finally:
        del os.environ["TF_CONFIG"]
    assert cl.trainer == 1 and cl.n_trainers == 2 and cl.ps_hosts == hosts
    names = [(v["ps"], v["name"]) for v in cl.vars()["vars"]]
    assert (0, "hid_w/part_0") in names and (1, "hid_w/part_1") in names, names
    got = cl.pull()
    model, _ = restps.decode_safetensors(open(export, "rb").read())
    assert set(got) == set(model) == {"hid_w", "hid_b", "sm_w", "sm_b"}
    for k in model:
        assert np.array_equal(got[k], model[k]), k
    assert got.global_step == 5 and len(got.steps) == 2
    res = cl.push({k: np.ones_like(v) for k, v in got.items()}, step=got.global_step, worker=1)
    assert all(r_["outcome"] == "applied" for r_ in res if r_), res
    after = cl.pull()
    for k in model:
        assert np.allclose(after[k], model[k] - np.float32(0.25), atol=1e-6), k
    cl.close()


def test_bodies_are_what_pypi_safetensors_reads_and_writes(tmp_path):
    if not os.access(VENV_PY, os.X_OK):
        pytest.skip(f"{VENV_PY} is missing: run make deps (PyPI safetensors into build/venv)")
    t = {"x": rng.standard_normal((2, 3)).astype(np.float32), "i": np.arange(4, dtype=np.int64),
         "u": np.arange(3, dtype=np.uint8)}
    (tmp_path / "ours.st").write_bytes(restps.encode_safetensors(t, {"step": "7"}))
    prog = ("import sys, numpy as np; from safetensors.numpy import load_file, save_file; from safetensors import safe_open\n"
            "d = load_file(sys.argv[1]); m = safe_open(sys.argv[1], 'np').metadata()\n"
            "save_file({k + '2': v * 2 for k, v in d.items()}, sys.argv[2], metadata={'from': 'pypi'})\n"
            "print(sorted((k, str(v.dtype), list(v.shape)) for k, v in d.items()), m)")
    r = subprocess.run([VENV_PY, "-c", prog, str(tmp_path / "ours.st"), str(tmp_path / "theirs.st")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[('i', 'int64', [4]), ('u', 'uint8', [3]), ('x', 'float32', [2, 3])] {'step': '7'}"
    back, meta = restps.decode_safetensors((tmp_path / "theirs.st").read_bytes())
    assert meta == {"from": "pypi"}
    for k, v in t.items():
        assert back[k + "2"].dtype == v.dtype and np.array_equal(back[k + "2"], v * 2)
    for bad in (b"", b"\xff" * 8 + b"{}", b"\x03\x00\x00\x00\x00\x00\x00\x00{}",
                b"\x20\x00\x00\x00\x00\x00\x00\x00" + b'{"x":{"dtype":"F32","shape":[9],"data_offsets":[0,36]}}'):
        with pytest.raises(restps.ProtocolError):
            restps.decode_safetensors(bad)


def test_pip_installs_the_package_into_a_fresh_venv(tmp_path):
    """`pip install ./client/python` (here offline: Debian's setuptools and
    numpy seen through --system-site-packages, no build isolation)."""
    venv = tmp_path / "v"
    r = subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "client", "python"), src, ignore=shutil.ignore_patterns("*.egg-info", "build"))
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--no-build-isolation", str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import restps, os; print(restps.__version__, os.path.dirname(restps.__file__))"],
                       capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    version, where = r.stdout.split()
    assert version == "0.1.0" and where.startswith(str(venv)), r.stdout


def test_the_package_type_checks_with_mypy(tmp_path):
    """mypy (PyPI, build/venv) on restps with client/python/pyproject.toml's
    settings (strict, numpy arrays without type arguments)."""
    if not os.access(VENV_PY, os.X_OK):
        pytest.skip(f"{VENV_PY} is missing: run make deps (PyPI mypy into build/venv)")
    pkg = os.path.join(ROOT, "client", "python")
    r = subprocess.run([VENV_PY, "-m", "mypy", "--config-file", os.path.join(pkg, "pyproject.toml"),
                        "--cache-dir", str(tmp_path / "cache"), os.path.join(pkg, "restps")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Success" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
