"""Python's own safetensors (PyPI, build/venv) and restps, both ways.

Python reads what restps writes: a bulk pull (GET /v1/params), a checkpoint
(GET /v1/checkpoint) and a model exported by workerd, read with
safetensors.safe_open and safetensors.numpy.load (tests/helpers/st_interop.py),
give the names, dtypes, shapes and values that psd serves one by one (GET
/v1/vars/NAME, raw float32: another route and another format), and the
`__metadata__` that the header parsed here by hand holds, exactly.

restps reads what Python writes: gradients saved by safetensors.numpy with
metadata are applied by POST /v1/grads (F32) or refused with 400 naming the
tensor and its dtype (F16, BF16: the contract takes F32 only), changing
nothing; a checkpoint written again by Python's save_file is restored by psd,
and one converted to F16 is passed over with the reason in the log.
"""
import json
import os
import struct
import subprocess

import numpy as np
import pytest

import ckpt_check
import syshelp
from conftest import HELPERS, ROOT, binary, http

PY = os.path.join(ROOT, "build", "venv", "bin", "python")
INTEROP = os.path.join(HELPERS, "st_interop.py")
DATA = "/usr/share/datasets/fashion-mnist"
rng = np.random.default_rng(24)


@pytest.fixture(autouse=True)
def _venv():
    if not os.access(PY, os.X_OK):
        pytest.skip(f"{PY} is missing: run make deps (PyPI packages into build/venv)")


def interop(*args):
    r = subprocess.run([PY, INTEROP] + [str(a) for a in args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout) if args[0] == "read" else None


def header_of(raw):
    """The header parsed by hand: (tensors' entries, __metadata__ or None)."""
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    return h, h.pop("__metadata__", None)


def raw_var(url, name):
    st, hd, body = http("GET", f"{url}/v1/vars/{name}")
    assert st == 200 and hd["x-dtype"] == "float32", (st, hd)
    shape = [] if hd["x-shape"] == "scalar" else [int(d) for d in hd["x-shape"].split(",")]
    return shape, body


def assert_same_as_psd(url, py, names):
    """py (one file of st_interop read) holds exactly psd's values of names."""
    assert set(py["tensors"]) == set(names), (sorted(py["tensors"]), names)
    for name in names:
        t = py["tensors"][name]
        shape, body = raw_var(url, name)
        assert (t["dtype"], t["shape"]) == ("F32", shape), (name, t["dtype"], t["shape"], shape)
        assert bytes.fromhex(t["hex"]) == body, f"{name}: values differ"


def put(url, name, a):
    shape = ",".join(map(str, a.shape)) or "scalar"
    st, _, b = http("PUT", f"{url}/v1/vars/{name}", a.astype("<f4").tobytes(), {"X-Shape": shape})
    assert st == 201, b


def variables(url):
    names = {"layer1/w": rng.standard_normal((3, 4)), "layer1/b": rng.standard_normal(4),
             "scale": np.array(2.5)}
    for n, a in names.items():
        put(url, n, a)
    return names


def test_python_reads_a_bulk_pull_and_a_checkpoint(psd, tmp_path):
    names = variables(psd.url)
    st, _, b = http("POST", psd.url + "/v1/grads",
                    syshelp.st_grads([("layer1/b", np.ones(4))], {"loss": "0.5", "worker": "0"}))
    assert st == 200 and json.loads(b)["outcome"] == "applied", b
    st, hd, pulled = http("GET", psd.url + "/v1/params")
    assert st == 200 and hd["x-global-step"] == "1"
    st, _, b = http("POST", psd.url + "/v1/checkpoint")
    assert st == 200, b
    st, _, ckpt = http("GET", psd.url + "/v1/checkpoint")
    assert st == 200
    (tmp_path / "params.safetensors").write_bytes(pulled)
    (tmp_path / "ckpt.safetensors").write_bytes(ckpt)
    got = interop("read", tmp_path / "params.safetensors", tmp_path / "ckpt.safetensors")
    py_pull, py_ckpt = got[str(tmp_path / "params.safetensors")], got[str(tmp_path / "ckpt.safetensors")]

    assert_same_as_psd(psd.url, py_pull, names)
    assert py_pull["metadata"] == header_of(pulled)[1] == {"global_step": "1", "task": "ps:0"}

    meta, tensors = ckpt_check.read(str(tmp_path / "ckpt.safetensors"))  # checksums too
    assert py_ckpt["metadata"] == meta == header_of(ckpt)[1]
    assert meta["global_step"] == "1" and len(meta) >= 10, meta
    assert set(py_ckpt["tensors"]) == set(tensors) == set(names)  # sgd: no slots
    assert_same_as_psd(psd.url, py_ckpt, names)


@pytest.mark.skipif(not os.path.isdir(DATA), reason=f"{DATA} is missing: make deps installs "
                    "dataset-fashion-mnist (workerd trains on it)")
def test_python_reads_an_exported_model(psd, tmp_path):
    out = tmp_path / "model.safetensors"
    r = subprocess.run([binary("workerd"), f"--ps_hosts={psd.host_port}", "--worker_hosts=localhost:1",
                        "--keep_ps", "--train_steps=3", "--hidden_units=16", "--optimizer=adam",
                        "--log_every=0", f"--data_dir={DATA}", f"--export={out}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    py = interop("read", out)[str(out)]
    names = [v["name"] for v in json.loads(http("GET", psd.url + "/v1/vars")[2])["vars"]]
    assert sorted(names) == ["hid_b", "hid_w", "sm_b", "sm_w"], names
    assert_same_as_psd(psd.url, py, names)  # the chief exports what the ps holds at the end
    meta = header_of(out.read_bytes())[1]
    assert py["metadata"] == meta and meta["global_step"] == "3", (py["metadata"], meta)


def grads_spec(dtype, values, meta):
    return json.dumps({"metadata": meta, "tensors": {
        "layer1/b": {"dtype": dtype, "shape": [4], "values": values}}})


def test_psd_applies_f32_bf16_and_f16_gradients_python_wrote(psd, tmp_path):
    # 16-bit bodies on the wire (issue 33): psd widens BF16 and F16 to float32 and applies them as
    # it applies F32; the values here are exact in all three, so each push moves the weights alike
    names = variables(psd.url)
    g = [0.5, -1.0, 2.0, 0.25]
    for step, dtype in enumerate(("F32", "BF16", "F16")):
        meta = {"worker": "0", "step": str(step), "loss": "1.25", "batch_size": "8"}
        f = tmp_path / f"{dtype}.safetensors"
        interop("write", f, grads_spec(dtype, g, meta))
        h, m = header_of(f.read_bytes())
        assert h["layer1/b"]["dtype"] == dtype and m == meta, (h, m)  # Python wrote that dtype
        _, w0 = raw_var(psd.url, "layer1/b")
        st, _, b = http("POST", psd.url + "/v1/grads", f.read_bytes())
        assert st == 200 and json.loads(b) == {"global_step": step + 1, "duplicate": False,
                                               "outcome": "applied"}, (dtype, b)
        _, w1 = raw_var(psd.url, "layer1/b")
        # plain SGD at psd's default learning rate, in float32 as psd computes it
        want = np.frombuffer(w0, "<f4") - np.float32(0.01) * np.array(g, "<f4")
        np.testing.assert_allclose(np.frombuffer(w1, "<f4"), want, rtol=1e-6, atol=1e-7)
    st, _, b = http("GET", psd.url + "/v1/status")
    assert json.loads(b)["last_loss"] == 1.25
    assert raw_var(psd.url, "scale")[1] == np.float32(names["scale"]).tobytes()  # untouched


def test_psd_restores_a_checkpoint_python_wrote_and_passes_over_f16(start_psd, tmp_path):
    a = start_psd(f"--logdir={tmp_path / 'a'}")
    names = variables(a.url)
    st, _, b = http("PUT", a.url + "/v1/config", b'{"optimizer": "momentum"}')
    assert st == 200, b
    st, _, b = http("POST", a.url + "/v1/grads", syshelp.st_grads([("layer1/b", np.ones(4))]))
    assert st == 200, b
    st, _, b = http("POST", a.url + "/v1/checkpoint")
    assert st == 200, b
    src = tmp_path / "a" / "ps-0" / json.loads(b)["file"].rsplit("/", 1)[-1]
    want = {n: raw_var(a.url, n) for n in names}
    for d in ("py", "f16"):
        os.makedirs(tmp_path / d / "ps-0")
    py_file = tmp_path / "py" / "ps-0" / src.name
    interop("resave", src, py_file)
    assert py_file.read_bytes() != src.read_bytes()  # Python's own layout (order, padding)
    interop("resave", src, tmp_path / "f16" / "ps-0" / src.name, "F16")

    b_ = start_psd(f"--logdir={tmp_path / 'py'}")
    st, _, body = http("GET", b_.url + "/v1/status")
    ck = json.loads(body)["checkpoint"]
    assert ck["restored_from"] and ck["restored_from"]["file"].endswith(src.name), ck
    assert {n: raw_var(b_.url, n) for n in names} == want
    st, _, body = http("GET", b_.url + "/v1/config")
    assert json.loads(body)["optimizer"] == "momentum"

    c = start_psd(f"--logdir={tmp_path / 'f16'}")
    st, _, body = http("GET", c.url + "/v1/vars")
    assert json.loads(body)["vars"] == []
    err = c.read_stderr()
    assert "has dtype F16, checkpoints hold F32" in err, err
    assert os.path.exists(str(tmp_path / "f16" / "ps-0" / src.name) + ".invalid")
