"""The trained model as ONNX (issue 35): workerd --export_onnx=FILE and
--convert_model=FILE --export_onnx=OUT, checked with the ONNX project's own
tools (PyPI onnx and onnxruntime in build/venv, tests/helpers/onnx_check.py):

- onnx.checker.check_model(full_check=True) passes, opset 13, input
  "input" [batch, 28, 28, 1] (NHWC, as restps takes its data);
- onnxruntime's logits on the test set have the argmax of restps's own
  (workerd --evaluate_model --evaluate_logits) on every example, and are
  within 1e-5 of them relative to each example's largest logit, and its
  probabilities are the softmax of its logits;
for mlp:100, the demo's MLP (mlp:256,128), the TensorFlow tutorial's CNN
and a small CNN with valid padding, strides and a dropout, each trained a
few steps with --local; the conversion of the safetensors export writes
the same bytes as the export at the end of training; with
--moving_average_decay the ONNX file holds the averages the safetensors
export holds (a 1 ps + 1 worker run)."""
import json
import os
import struct
import subprocess

import pytest

from conftest import HELPERS, ROOT, binary

PY = os.path.join(ROOT, "build", "venv", "bin", "python")
CHECK = os.path.join(HELPERS, "onnx_check.py")
DATA = "/usr/share/datasets/fashion-mnist"
N_TRAIN, N_TEST = 5600, 1000   # the first 5,000 training images are the validation set
MODELS = {
    "mlp:100": ["--model=mlp:100"],
    "demo mlp": ["--hidden_units=256,128"],
    "tutorial cnn": ["--model=cnn"],
    "valid cnn": ["--model=conv:5x5x6:valid,pool:2:valid,conv:3x3x8/2:valid,pool:3/2,dense:24,dropout:0.2,dense:10"],
}
pytestmark = [
    pytest.mark.skipif(not os.path.isdir(DATA), reason=f"{DATA} is missing: make deps installs dataset-fashion-mnist"),
]


@pytest.fixture(autouse=True)
def _venv():
    if not os.access(PY, os.X_OK):
        pytest.skip(f"{PY} is missing: run make deps (PyPI onnx and onnxruntime into build/venv)")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """The first 5,600 training and 1,000 test images as raw IDX files (the
    runs' final evaluation is most of their time on the full sets)."""
    import gzip
    d = tmp_path_factory.mktemp("fashion-onnx")
    for kind, n in (("train", N_TRAIN), ("t10k", N_TEST)):
        img = gzip.open(os.path.join(DATA, f"{kind}-images-idx3-ubyte.gz")).read()
        lab = gzip.open(os.path.join(DATA, f"{kind}-labels-idx1-ubyte.gz")).read()
        (d / f"{kind}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + img[16:16 + 784 * n])
        (d / f"{kind}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + lab[8:8 + n])
    return str(d)


def workerd(*args, timeout=180):
    r = subprocess.run([binary("workerd"), "--device=cpu"] + list(args), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Sanitizer" not in r.stderr and "runtime error:" not in r.stderr, r.stderr[-3000:]
    return r.stdout + r.stderr


def onnx_check(model, logits, data):
    r = subprocess.run([PY, CHECK, model, logits, data], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def check_against_restps(onnx_path, export_path, data, tmp_path):
    """onnx_check's figures for onnx_path against workerd's own logits of export_path."""
    logits = str(tmp_path / "logits.safetensors")
    workerd(f"--evaluate_model={export_path}", f"--evaluate_logits={logits}", f"--data_dir={data}")
    got = onnx_check(onnx_path, logits, data)
    print(onnx_path, {k: got[k] for k in ("n", "argmax_equal", "accuracy", "max_rel", "max_abs", "prob_err")})
    assert got["n"] == N_TEST
    assert got["argmax_equal"] == N_TEST, got
    assert got["max_rel"] <= 1e-5, got
    assert got["prob_err"] <= 1e-6, got
    assert got["opset"] == [["", 13]] and got["ir_version"] == 7, got
    assert got["inputs"] == [["input", ["batch", 28, 28, 1]]], got
    return got


@pytest.mark.parametrize("name", list(MODELS))
def test_onnx_export_runs_in_onnxruntime_as_restps(name, small_data, tmp_path):
    onnx_path, export = str(tmp_path / "m.onnx"), str(tmp_path / "m.safetensors")
    out = workerd("--local", "--train_steps=4", "--batch_size=20", "--learning_rate=0.001", f"--data_dir={small_data}",
                  f"--export={export}", f"--export_onnx={onnx_path}", *MODELS[name])
    assert "as ONNX (opset 13)" in out, out[-2000:]
    got = check_against_restps(onnx_path, export, small_data, tmp_path)
    assert got["metadata"]["global_step"] == "4"
    ops = set(got["ops"])
    assert {"Gemm", "Softmax"} <= ops
    if "cnn" in name:
        assert {"Conv", "MaxPool", "Transpose", "Relu", "Identity"} <= ops, ops   # Identity: the dropout
    # the conversion of the export: the same model, byte for byte
    conv = str(tmp_path / "converted.onnx")
    workerd(f"--convert_model={export}", f"--export_onnx={conv}")
    assert open(conv, "rb").read() == open(onnx_path, "rb").read()
    if name == "mlp:100":   # --evaluate_model converts too, when --export_onnx is beside it
        ev = str(tmp_path / "evaluated.onnx")
        workerd(f"--evaluate_model={export}", f"--export_onnx={ev}", f"--data_dir={small_data}")
        assert open(ev, "rb").read() == open(onnx_path, "rb").read()


def test_onnx_export_alone_without_the_safetensors_export(small_data, tmp_path):
    """--export_onnx needs no --export beside it."""
    onnx_path = str(tmp_path / "only.onnx")
    workerd("--local", "--train_steps=2", "--batch_size=10", f"--data_dir={small_data}", "--model=mlp:8",
            f"--export_onnx={onnx_path}")
    assert os.path.getsize(onnx_path) > 784 * 8 * 4
    assert not list(tmp_path.glob("*.safetensors"))


def test_convert_model_refuses_what_it_cannot_convert(tmp_path):
    r = subprocess.run([binary("workerd"), f"--convert_model={tmp_path}/none.safetensors"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "needs --export_onnx" in r.stderr, r.stderr
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a model at all")
    r = subprocess.run([binary("workerd"), f"--convert_model={bad}", f"--export_onnx={tmp_path}/o.onnx"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--convert_model=" in r.stderr and "not a safetensors file" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "o.onnx")


def test_onnx_export_holds_the_moving_averages(start_psd, small_data, tmp_path):
    """With --moving_average_decay the chief's ONNX file is the averages, as
    its safetensors export (the test of the export itself is elsewhere):
    onnxruntime on it gives restps's logits of the export."""
    ps = start_psd()
    onnx_path, export = str(tmp_path / "ema.onnx"), str(tmp_path / "ema.safetensors")
    workerd(f"--ps_hosts={ps.host_port}", "--worker_hosts=localhost:1", "--job_name=worker", "--task_index=0",
            "--model=mlp:16", "--train_steps=20", "--batch_size=20", "--moving_average_decay=0.9",
            f"--data_dir={small_data}", f"--export={export}", f"--export_onnx={onnx_path}")
    got = check_against_restps(onnx_path, export, small_data, tmp_path)
    assert got["metadata"]["moving_average_decay"] == "0.899999976", got["metadata"]
