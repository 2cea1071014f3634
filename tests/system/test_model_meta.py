"""The model's name across processes and files (issue 19): workerd's --model
spec errors, the placement map's model and input_shape (psd checks them: they
go into every checkpoint's __metadata__), a worker started with another
--model than the chief's, and --evaluate_model on an exported file (and on
one without the metadata)."""
import json
import re
import struct
import subprocess

import pytest

from conftest import binary, http
from test_train import DATA, cluster  # noqa: F401 (fixture)


def test_bad_model_spec_is_one_line_naming_it():
    for spec, part in (("conv:0x3x3,dense:10", "conv:0x3x3"), ("dense:16,pool:2,dense:10", "pool:2"),
                       ("dense:7", "dense:7"), ("mlp:10,,", 'hidden layer ""'), ("mlp:10,", "trailing comma")):
        r = subprocess.run([binary("workerd"), "--local", f"--model={spec}"], capture_output=True, timeout=30)
        err = r.stderr.decode().strip().splitlines()
        assert r.returncode == 2 and len(err) == 1 and part in err[0] and "--model" in err[0], (spec, err)
    r = subprocess.run([binary("workerd"), "--local", "--model=mlp:10", "--hidden_units=10"],
                       capture_output=True, timeout=30)
    assert r.returncode == 2 and b"--hidden_units" in r.stderr
    r = subprocess.run([binary("workerd"), "--help"], capture_output=True, timeout=30)
    assert b"--model" in r.stdout and b"cnn" in r.stdout


def placement(**extra):
    return json.dumps(dict({"policy": "bytes", "ps_tasks": 1, "variables": []}, **extra)).encode()


def test_placement_model_fields_are_checked(psd):
    url = f"http://127.0.0.1:{psd.port}/v1/placement"
    for bad in ({"model": "mlp:100 x"}, {"model": "m" * 512}, {"model": 5}, {"model": ""},
                {"input_shape": "28,28,1\n"}, {"input_shape": "1" * 64}, {"model": "mlp:\u00e9"}):
        st, _, body = http("PUT", url, placement(**bad))
        key = next(iter(bad))
        assert st == 400 and key.encode() in body, (bad, st, body)
    st, _, _ = http("GET", url)
    assert st == 404, "a refused map was kept"
    good = {"model": "m" * 511, "input_shape": "28,28,1"}
    st, _, body = http("PUT", url, placement(**good))
    assert st == 200, body
    got = json.loads(http("GET", url)[2])
    assert got["model"] == good["model"] and got["input_shape"] == "28,28,1"


def test_worker_with_another_model_stops(cluster):  # noqa: F811
    c = cluster(2)
    w = c.worker(1, "--model=mlp:30", "--sync=0", "--train_steps=100000", "--recovery_wait_secs=0.2")
    chief = c.worker(0, "--model=mlp:20", "--sync=0", "--train_steps=100000", "--log_every=0")
    out, _ = w.communicate(timeout=120)
    out = out.decode()
    chief.kill()
    chief.wait()
    assert w.returncode == 2, out[-2000:]
    assert "--model=mlp:20" in out and "--model=mlp:30" in out, out[-2000:]


def st_file(path, tensors, meta):
    header, off, data = {}, 0, b""
    for name, (shape, values) in tensors.items():
        b = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
        off += len(b)
        data += b
    if meta is not None:
        header["__metadata__"] = meta
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_evaluate_model_from_the_file_alone(tmp_path):
    path = tmp_path / "m.safetensors"
    r = subprocess.run([binary("workerd"), "--local", "--model=mlp:", "--train_steps=60", "--log_every=0",
                        f"--data_dir={DATA}", f"--export={path}", "--device=cpu"],
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    trained = re.search(r"test loss ([0-9.]+), test accuracy ([0-9.]+)", r.stdout.decode())
    assert trained, r.stdout.decode()[-2000:]
    # the evaluation rebuilds mlp: from the metadata: another --model does not matter
    r = subprocess.run([binary("workerd"), f"--evaluate_model={path}", "--model=cnn", f"--data_dir={DATA}",
                        "--device=cpu"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    got = re.search(r"model mlp:, global step 60\): test loss ([0-9.]+), test accuracy ([0-9.]+)",
                    r.stdout.decode())
    assert got and got.groups() == trained.groups(), (r.stdout.decode(), trained.groups())
    # without model and input_shape: a clear error, exit 2
    old = tmp_path / "old.safetensors"
    st_file(old, {"sm_w": ([784, 10], [0.0] * 7840), "sm_b": ([10], [0.0] * 10)}, {"global_step": "1"})
    r = subprocess.run([binary("workerd"), f"--evaluate_model={old}", f"--data_dir={DATA}"],
                       capture_output=True, timeout=120)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "no model and input_shape" in err[0], err
    # metadata naming a model the tensors do not fit
    st_file(old, {"sm_w": ([784, 10], [0.0] * 7840), "sm_b": ([10], [0.0] * 10)},
            {"model": "mlp:5", "input_shape": "28,28,1"})
    r = subprocess.run([binary("workerd"), f"--evaluate_model={old}", f"--data_dir={DATA}"],
                       capture_output=True, timeout=120)
    assert r.returncode == 2 and b"hid_w" in r.stderr, r.stderr
    r = subprocess.run([binary("workerd"), f"--evaluate_model={tmp_path}/missing", f"--data_dir={DATA}"],
                       capture_output=True, timeout=60)
    assert r.returncode == 2 and b"missing" in r.stderr
