"""The CPU model backend (client/mlp_cpu.c, through bin/mlp_dump) against an
independent numpy forward/backward in float64, on fresh random inputs.

numpy's side is written here from the formulas of mlp.h: x @ W + b, ReLU,
softmax cross-entropy averaged over the batch, and its analytic gradients.
Every gradient element must agree within a relative error of 1e-4, with a
floor for elements near zero of 1e-2 of the tensor's largest |gradient|: an
element that is a float32 sum of hundreds of terms cancelling to nearly zero
carries an absolute rounding error of ~1e-7 of the tensor's scale whoever
computes it (numpy in float32 shows 1.3e-4 against float64 for 784-256-128-10
with a 1e-3 floor), so the floor is an absolute tolerance of 1e-6 of that scale.

mlp_dump computes with the OpenBLAS kernel workerd would choose (or the one
OPENBLAS_CORETYPE names), and each case prints it. The tolerance does not
depend on the kernel: the worst relative error over these cases, measured with
each forced (AMD EPYC, no AVX-512, so SkylakeX unmeasured): Prescott 1.6e-5,
Sandybridge 2.6e-5, Haswell and Zen 2.1e-5.
"""
import os
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
MLP_DUMP = os.path.join(BIN, "mlp_dump")

REL_TOL = 1e-4
FLOOR = 1e-2  # of the tensor's largest |gradient|
KERNEL = ""   # "OpenBLAS Zen (kernel: ...)", as mlp_dump reports it on stderr

pytestmark = pytest.mark.skipif(
    not os.access(MLP_DUMP, os.X_OK),
    reason=f"{MLP_DUMP} is missing: build it (tests/helpers/mlp_dump.c) first")


def layout(n_in, hidden, n_out):
    """[(name, shape)] in buffer order, from the naming rule in mlp.h."""
    dims = [n_in] + list(hidden) + [n_out]
    out = []
    for l in range(len(dims) - 1):
        if l == len(dims) - 2:
            w, b = "sm_w", "sm_b"
        elif len(hidden) == 1:
            w, b = "hid_w", "hid_b"
        else:
            w, b = f"hid{l}_w", f"hid{l}_b"
        out.append((w, (dims[l], dims[l + 1])))
        out.append((b, (dims[l + 1],)))
    return out


def unpack(flat, lay):
    views, off = [], 0
    for name, shape in lay:
        n = int(np.prod(shape))
        views.append(flat[off:off + n].reshape(shape))
        off += n
    assert off == flat.size
    return views


def numpy_forward_backward(params, x, labels, lay):
    """Mean softmax cross-entropy and its gradient, float64."""
    p = [v.astype(np.float64) for v in unpack(params, lay)]
    Ws, bs = p[0::2], p[1::2]
    a = [x.astype(np.float64)]
    for l, (W, b) in enumerate(zip(Ws, bs)):
        z = a[-1] @ W + b
        a.append(np.maximum(z, 0.0) if l < len(Ws) - 1 else z)
    logits = a[-1]
    B = x.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -logp[np.arange(B), labels].mean()
    dz = np.exp(logp)
    dz[np.arange(B), labels] -= 1.0
    dz /= B
    grads = [None] * len(p)
    for l in range(len(Ws) - 1, -1, -1):
        grads[2 * l] = a[l].T @ dz
        grads[2 * l + 1] = dz.sum(axis=0)
        if l > 0:
            dz = (dz @ Ws[l].T) * (a[l] > 0)
    accuracy = float((logits.argmax(axis=1) == labels).mean())
    return loss, grads, accuracy


def run_dump(tmp_path, n_in, hidden, n_out, params, x, labels):
    spec = tmp_path / "spec"
    spec.write_text(f"n_in={n_in} hidden={','.join(map(str, hidden))} n_out={n_out} "
                    f"batch={x.shape[0]}\n")
    files = {k: tmp_path / k for k in ("params", "x", "labels", "loss", "grads", "eval")}
    params.astype("<f4").tofile(files["params"])
    x.astype("<f4").tofile(files["x"])
    labels.astype(np.uint8).tofile(files["labels"])
    r = subprocess.run([MLP_DUMP, f"--spec={spec}", f"--params={files['params']}",
                        f"--x={files['x']}", f"--labels={files['labels']}",
                        f"--loss_out={files['loss']}", f"--grads_out={files['grads']}",
                        f"--eval_out={files['eval']}"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert "runtime error:" not in r.stderr and "Sanitizer" not in r.stderr, r.stderr
    global KERNEL
    KERNEL = next((l[len("mlp_dump: "):] for l in r.stderr.splitlines() if l.startswith("mlp_dump: OpenBLAS ")),
                  "OpenBLAS (kernel not reported)")
    loss = np.fromfile(files["loss"], dtype="<f4")
    grads = np.fromfile(files["grads"], dtype="<f4")
    ev = np.fromfile(files["eval"], dtype="<f4")
    assert loss.size == 1 and ev.size == 2 and grads.size == params.size
    return float(loss[0]), grads, ev, r.stdout


CASES = [
    # n_in, hidden, n_out, batch
    (7, [5], 3, 5),
    (6, [4, 4], 3, 5),
    (5, [], 4, 5),
    (784, [100], 10, 100),        # the example's model and batch
    (784, [256, 128], 10, 32),
    (33, [17, 9, 12], 6, 1),
]


@pytest.mark.parametrize("n_in,hidden,n_out,batch", CASES,
                         ids=lambda v: str(v).replace(" ", ""))
@pytest.mark.parametrize("seed", [1, 2])
def test_forward_backward_matches_numpy(tmp_path, n_in, hidden, n_out, batch, seed):
    rng = np.random.default_rng(seed * 1000 + n_in + batch)
    lay = layout(n_in, hidden, n_out)
    chunks = []
    for name, shape in lay:
        if len(shape) == 2:   # weights: the init's scale, 1/sqrt(fan_in)
            chunks.append(rng.normal(0, 1 / np.sqrt(shape[0]), size=shape).ravel())
        else:                 # biases nonzero, so they matter
            chunks.append(rng.normal(0, 0.1, size=shape))
    params = np.concatenate(chunks).astype(np.float32)
    x = rng.random((batch, n_in), dtype=np.float32)   # like pixels in [0, 1]
    labels = rng.integers(0, n_out, size=batch).astype(np.uint8)

    loss, grads, ev, stdout = run_dump(tmp_path, n_in, hidden, n_out, params, x, labels)

    # the layout the tool reports is the one mlp.h documents
    off, want_lines = 0, []
    for name, shape in lay:
        want_lines.append(f"tensor {name} {','.join(map(str, shape))} {off}")
        off += int(np.prod(shape))
    assert stdout.split("\n")[:-1] == want_lines

    ref_loss, ref_grads, ref_acc = numpy_forward_backward(params, x, labels, lay)
    assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (loss, ref_loss)
    assert abs(ev[0] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    assert abs(ev[1] - ref_acc) <= 1e-6

    worst = []
    for (name, shape), g, r in zip(lay, unpack(grads, lay), ref_grads):
        floor = FLOOR * np.abs(r).max() if np.abs(r).max() > 0 else 1e-12
        rel = np.abs(g - r) / np.maximum(np.maximum(np.abs(g), np.abs(r)), floor)
        worst.append((float(rel.max()), name))
        assert rel.max() <= REL_TOL, f"{name}: max rel err {rel.max():.3g} at {np.unravel_index(rel.argmax(), shape)}"
    print(f"{n_in}-{hidden}-{n_out} batch {batch}: loss {loss:.6f}, worst {max(worst)}; {KERNEL.split(' (')[0]}")


def test_comparison_can_fail(tmp_path):
    """A mean-vs-sum slip (gradients times the batch) or a dropped ReLU mask
    must show up in the same comparison."""
    rng = np.random.default_rng(7)
    n_in, hidden, n_out, batch = 7, [5], 3, 5
    lay = layout(n_in, hidden, n_out)
    params = rng.normal(0, 0.5, size=sum(int(np.prod(s)) for _, s in lay)).astype(np.float32)
    x = rng.random((batch, n_in), dtype=np.float32)
    labels = rng.integers(0, n_out, size=batch).astype(np.uint8)
    _, grads, _, _ = run_dump(tmp_path, n_in, hidden, n_out, params, x, labels)
    _, ref, _ = numpy_forward_backward(params, x, labels, lay)
    ref = np.concatenate([r.ravel() for r in ref])

    def max_rel(g, r):
        return (np.abs(g - r) / np.maximum(np.maximum(np.abs(g), np.abs(r)),
                                           FLOOR * np.abs(r).max())).max()

    assert max_rel(grads, ref) <= REL_TOL
    assert max_rel(grads * batch, ref) > REL_TOL
    p = [v.astype(np.float64) for v in unpack(params, lay)]
    a1 = x.astype(np.float64) @ p[0] + p[1]          # pre-activation, no ReLU
    assert (a1 < 0).any()                             # so the mask matters here
    logits = a1 @ p[2] + p[3]
    dz = np.exp(logits - logits.max(1, keepdims=True))
    dz /= dz.sum(1, keepdims=True)
    dz[np.arange(batch), labels] -= 1
    dz /= batch
    no_mask_hid_w = x.astype(np.float64).T @ (dz @ p[2].T)
    g_hid_w = unpack(grads, lay)[0]
    assert (np.abs(g_hid_w - no_mask_hid_w) / np.maximum(np.abs(no_mask_hid_w), 1e-3)).max() > REL_TOL


def test_bad_input_is_refused(tmp_path):
    spec = tmp_path / "spec"
    spec.write_text("n_in=3 hidden=2 n_out=2 batch=2\n")
    (tmp_path / "p").write_bytes(b"\0" * 4 * 5)      # 14 floats needed: 3*2+2+2*2+2
    (tmp_path / "x").write_bytes(b"\0" * 4 * 6)
    (tmp_path / "l").write_bytes(b"\0\1")
    r = subprocess.run([MLP_DUMP, f"--spec={spec}", f"--params={tmp_path / 'p'}",
                        f"--x={tmp_path / 'x'}", f"--labels={tmp_path / 'l'}",
                        f"--loss_out={tmp_path / 'o'}", f"--grads_out={tmp_path / 'g'}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "expected exactly 56 bytes" in r.stderr
