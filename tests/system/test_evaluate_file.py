"""workerd --evaluate_model=FILE on files a user hands over (issue 37): the
file's prefix and header are read and checked first (against the file's size
and a header limit), its tensors against the layout its metadata's spec gives
before the model's workspace is made, and only then exactly the data the
model needs; a FIFO is refused, not waited on."""
import json
import os
import resource
import struct
import subprocess
import time

import numpy as np

from conftest import SANITIZER_MARKS, binary
from test_train import DATA

MIB = 1 << 20
RSS_BOUND = 300 * MIB
SPEC = "mlp:5"                                  # hid_w [784,5] hid_b [5] sm_w [5,10] sm_b [10]
SHAPES = {"hid_w": [784, 5], "hid_b": [5], "sm_w": [5, 10], "sm_b": [10]}
META = {"model": SPEC, "input_shape": "28,28,1", "global_step": "7"}


def st_write(path, tensors, meta, dtype="F32"):
    """A safetensors file: tensors {name: (shape, float32 array)} in order."""
    header, off, data = {}, 0, b""
    for name, (shape, values) in tensors.items():
        b = np.asarray(values, dtype="<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(b)]}
        off += len(b)
        data += b
    header["__metadata__"] = meta
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def evaluate(path, timeout=60):
    """(exit status, stdout, stderr, peak RSS in bytes, seconds) of workerd
    --evaluate_model=path. The peak is the child's (wait4's rusage), which
    Linux counts from the spawning process's own peak at the exec: it is at
    least this process's; refused() allows for that."""
    t0 = time.monotonic()
    p = subprocess.Popen([binary("workerd"), f"--evaluate_model={path}", f"--data_dir={DATA}", "--device=cpu"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = t0 + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            break
        if time.monotonic() > deadline:
            p.kill()
            os.wait4(p.pid, 0)
            p.returncode = -9
            raise AssertionError(f"workerd --evaluate_model={path} did not finish in {timeout} s: "
                                 f"{p.stderr.read().decode()[-2000:]}")
        time.sleep(0.01)
    secs = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    out, err = p.stdout.read().decode(), p.stderr.read().decode()
    p.stdout.close()
    p.stderr.close()
    for mark in SANITIZER_MARKS:
        assert mark not in err, err[-6000:]
    return p.returncode, out, err, ru.ru_maxrss * 1024, secs


def refused(path, *parts, timeout=30):
    """workerd refuses path: exit 2, one line naming the file and parts, fast,
    with a bounded peak RSS."""
    rc, out, err, rss, secs = evaluate(path, timeout)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and str(path) in lines[0], (rc, err[-2000:])
    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # only grows: >= at the spawn
    assert rss <= max(RSS_BOUND, mine), f"peak RSS {rss / MIB:.0f} MiB for {path}: {lines}"
    assert secs < timeout / 2, secs
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def test_a_spec_larger_than_the_files_tensors_is_refused_before_the_workspace(tmp_path):
    """150 bytes whose metadata names a model of 110 M parameters: refused on
    its tensors before anything the size of the model is allocated (it was
    2.1 GiB of workspace and buffers first)."""
    path = tmp_path / "big_spec.safetensors"
    st_write(path, {"fc0_w": ([1], [0.0])}, {"model": "dense:140000,dense:10", "input_shape": "28,28,1"})
    assert os.path.getsize(path) < 200
    refused(path, "fc0_w", "[1]", "[784,140000]")
    # the same with no tensors at all, and with the first one right but small
    st_write(path, {}, {"model": "dense:140000,dense:10", "input_shape": "28,28,1"})
    refused(path, "tensor fc0_w is missing")


def test_a_huge_prefix_on_a_sparse_gigabyte_is_refused_before_reading(tmp_path):
    """A 1 GiB sparse file whose prefix says 2^60: the prefix is checked
    against the file's size first (the whole file was read before)."""
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as fp:
        fp.write(struct.pack("<Q", 1 << 60))
    os.truncate(path, 1 << 30)
    refused(path, "not a safetensors file", "header length 1152921504606846976", "1073741824 bytes")
    # a prefix within the file but past what a model file's header takes
    with open(path, "r+b") as fp:
        fp.write(struct.pack("<Q", 64 * MIB))
    refused(path, "a header of 67108864 bytes", "at most 1048576")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    path = tmp_path / "model.fifo"
    os.mkfifo(path)
    refused(path, "not a regular file (a fifo)", timeout=20)
    refused(tmp_path, "not a regular file (a folder)")


def test_the_files_tensors_must_be_exactly_the_models(tmp_path):
    rng = np.random.default_rng(1)
    good = {n: (s, rng.standard_normal(int(np.prod(s))) * 0.1) for n, s in SHAPES.items()}
    path = tmp_path / "m.safetensors"
    st_write(path, good, META)
    rc, out, err, _, _ = evaluate(path)
    assert rc == 0, err[-2000:]
    line = [ln for ln in out.splitlines() if "test accuracy" in ln]
    assert line and f"(model {SPEC}, global step 7)" in line[0] and "on 10000 examples" in line[0], out
    result = line[0].split("): ", 1)[1]

    # a checkpoint's optimizer slots and moving averages beside the variables
    # are passed over: what is evaluated is the variables
    ckpt = dict(good)
    for n, s in SHAPES.items():
        ckpt[f"{n}:adam_m"] = (s, np.full(int(np.prod(s)), 1e30))
        ckpt[f"{n}:ExponentialMovingAverage"] = (s, np.full(int(np.prod(s)), -7.0))
    st_write(path, ckpt, META)
    rc, out, err, _, _ = evaluate(path)
    assert rc == 0 and result in out, (out, err[-2000:])

    # anything else: refused, naming the tensor
    cases = [
        (dict(good, extra=([3], [1.0, 2.0, 3.0])), ("tensor extra is not one of model mlp:5's",)),
        (dict(good, **{"hid_b:adam_m": ([6], [0.0] * 6)}), ("hid_b:adam_m", "shape of hid_b")),
        (dict(good, hid_b=([1, 5], [0.0] * 5)), ("tensor hid_b has shape [1,5]", "[5]")),
        ({n: v for n, v in good.items() if n != "sm_b"}, ("tensor sm_b is missing",)),
    ]
    for tensors, parts in cases:
        st_write(path, tensors, META)
        refused(path, *parts)
    st_write(path, good, META, dtype="I32")
    refused(path, "tensor hid_w is I32")
