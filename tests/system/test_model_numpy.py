"""The layer library (issue 19) against an independent numpy implementation.

tests/helpers/cnn_ref.py is the reference: the model contract written plainly
in float64 numpy (conv as a loop over kernel offsets, pooling over window
offsets keeping the first maximum, the dropout hash in uint64). Here:

(a) the reference checked against itself: every layer's backward against
    central finite differences (float64, tiny shapes), conv and pool forward
    against a brute-force loop over output positions, TensorFlow's padding
    rule, the spec grammar and names, and the dropout hash against splitmix64's
    published outputs;
(b) the C library through $RESTPS_BIN_DIR/model_dump against it: loss, logits
    and every gradient for several specs, dropout on, and mlp:100 against the
    old mlp_dump bit for bit while that tool exists.

The tolerance of (b), per element as in test_mlp_numpy.py:
|c - ref| <= 1e-4 * max(|c|, |ref|, 1e-2 * max|ref| of the tensor). float32
sums of n terms carry a relative error of ~sqrt(n) * 6e-8 of sum|terms| (n up
to 25*32 = 800 per conv output and 2*14*14 = 392 per conv1 weight gradient
at batch 2, 3136 per dense output): a few 1e-6 relative to the tensor's
scale, so 1e-4 (1e-6 of the scale near zero) leaves a margin of ~10 while a
wrong stride, padding side, tie rule or dropout unit is off by O(1). A float32
forward can fall on the other side of a ReLU or pool kink than float64 when
the input is within its rounding error of it, which changes a gradient
element entirely; each case therefore draws its inputs again (deterministic
seeds) until the reference's kink margin (cnn_ref.kink_margin) is >= 2e-6 of
the layer's largest |input|: a float32 sum of K products with random signs is
off by ~6e-8 * sqrt(K) of its spread, ~4e-7 of the largest value for conv1's
K = 800 and ~8e-7 for fc0's 3136, so a unit at the margin is 2.5 to 5 such
errors from its kink (a tighter margin leaves the full CNN, 75,000 ReLUs at
batch 2, without a draw that keeps it).
"""
import math
import os
import subprocess

import numpy as np
import pytest

import cnn_ref as ref  # tests/helpers (conftest.py puts it on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BIN = os.path.join(ROOT, os.environ.get("RESTPS_BIN_DIR", "bin"))
MODEL_DUMP = os.path.join(BIN, "model_dump")
MLP_DUMP = os.path.join(BIN, "mlp_dump")

REL_TOL = 1e-4
FLOOR = 1e-2
MARGIN = 2e-6


# =================================================================== (a) the reference itself

def fd_check(f, args, grads, eps=1e-6, tol=1e-7):
    """Central differences of the scalar f(*args) in every element of every
    array in args against grads (same order); float64."""
    for k, (a, g) in enumerate(zip(args, grads)):
        assert g.shape == a.shape, (k, g.shape, a.shape)
        num = np.zeros_like(a)
        it = np.nditer(a, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            old = a[i]
            a[i] = old + eps
            fp = f(*args)
            a[i] = old - eps
            fm = f(*args)
            a[i] = old
            num[i] = (fp - fm) / (2 * eps)
        err = np.abs(num - g).max()
        assert err <= tol * max(1.0, np.abs(g).max()), f"argument {k}: max |fd - analytic| {err:.3g}"


CONV_CASES = [
    # H, W, Cin, KH, KW, Cout, stride, padding
    (5, 5, 2, 3, 3, 3, 1, "same"),
    (6, 5, 1, 3, 2, 2, 2, "same"),     # stride 2, asymmetric padding, non-square kernel
    (7, 7, 2, 3, 3, 2, 2, "valid"),
    (5, 6, 2, 4, 4, 2, 3, "same"),     # pad_total 3/... split 1 before, 2 after
    (4, 4, 1, 5, 5, 1, 1, "same"),     # kernel larger than the input under same
    (6, 6, 3, 1, 1, 2, 2, "valid"),
]


def brute_conv(x, w, b, stride, padding):
    """Every output by its own sum over the kernel, indices from TF's rule."""
    n, h, wd, cin = x.shape
    kh, kw, _, cout = w.shape
    oh, pt, _ = ref.out_size(h, kh, stride, padding)
    ow, pl, _ = ref.out_size(wd, kw, stride, padding)
    y = np.zeros((n, oh, ow, cout))
    for bi in range(n):
        for r in range(oh):
            for c in range(ow):
                for co in range(cout):
                    s = b[co]
                    for i in range(kh):
                        for j in range(kw):
                            rr, cc = r * stride - pt + i, c * stride - pl + j
                            if 0 <= rr < h and 0 <= cc < wd:
                                s += float(x[bi, rr, cc, :] @ w[i, j, :, co])
                    y[bi, r, c, co] = s
    return y


def brute_pool(x, k, stride, padding):
    """(y, the input position each output's gradient goes to)."""
    n, h, wd, ch = x.shape
    oh, pt, _ = ref.out_size(h, k, stride, padding)
    ow, pl, _ = ref.out_size(wd, k, stride, padding)
    y = np.zeros((n, oh, ow, ch))
    dx = np.zeros_like(x)
    for bi in range(n):
        for r in range(oh):
            for c in range(ow):
                for cc in range(ch):
                    best, at = -math.inf, None
                    for i in range(k):
                        for j in range(k):
                            rr, col = r * stride - pt + i, c * stride - pl + j
                            if 0 <= rr < h and 0 <= col < wd and x[bi, rr, col, cc] > best:
                                best, at = x[bi, rr, col, cc], (bi, rr, col, cc)
                    y[bi, r, c, cc] = best
                    dx[at] += 1.0 * (1 + bi + r + 2 * c + 3 * cc)   # a distinct dy per output
    return y, dx


def test_tensorflow_padding_rule():
    # (in, k, s, padding) -> (out, before, after), TensorFlow's documented rule
    want = {(28, 5, 1, "same"): (28, 2, 2), (28, 2, 2, "same"): (14, 0, 0),
            (5, 2, 2, "same"): (3, 0, 1), (6, 3, 2, "same"): (3, 0, 1),
            (10, 3, 2, "same"): (5, 0, 1), (28, 4, 3, "same"): (10, 1, 2),
            (4, 5, 1, "same"): (4, 2, 2), (7, 3, 2, "valid"): (3, 0, 0),
            (14, 3, 2, "valid"): (6, 0, 0), (6, 3, 2, "valid"): (2, 0, 0),
            (5, 5, 1, "valid"): (1, 0, 0)}
    for args, out in want.items():
        assert ref.out_size(*args) == out, args
    with pytest.raises(ref.SpecError, match="larger"):
        ref.out_size(4, 5, 1, "valid")


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv_forward_is_the_definition(case):
    h, w, cin, kh, kw, cout, s, pad = case
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, h, w, cin))
    W = rng.normal(size=(kh, kw, cin, cout))
    b = rng.normal(size=cout)
    oh, pt, pb = ref.out_size(h, kh, s, pad)
    ow, pl, pr = ref.out_size(w, kw, s, pad)
    y = ref.conv2d_forward(x, W, b, s, (pt, pb, pl, pr))
    assert y.shape == (2, oh, ow, cout)
    np.testing.assert_allclose(y, brute_conv(x, W, b, s, pad), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv_backward_finite_differences(case):
    h, w, cin, kh, kw, cout, s, pad = case
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, h, w, cin))
    W = rng.normal(size=(kh, kw, cin, cout))
    b = rng.normal(size=cout)
    pads = ref.out_size(h, kh, s, pad)[1:] + ref.out_size(w, kw, s, pad)[1:]
    R = rng.normal(size=ref.conv2d_forward(x, W, b, s, pads).shape)
    dx, dW, db = ref.conv2d_backward(R, x, W, s, pads)
    fd_check(lambda x, W, b: float((ref.conv2d_forward(x, W, b, s, pads) * R).sum()), [x, W, b], [dx, dW, db])


POOL_CASES = [  # H, W, C, k, stride, padding
    (4, 4, 2, 2, 2, "same"), (5, 5, 2, 2, 2, "same"), (5, 6, 1, 3, 2, "same"),
    (6, 6, 2, 3, 2, "valid"), (7, 5, 1, 3, 1, "same"), (5, 5, 1, 2, 3, "valid"),
    (3, 3, 1, 4, 4, "same")]


@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_pool_forward_backward_is_the_definition(case):
    h, w, c, k, s, pad = case
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, h, w, c))
    pads = ref.out_size(h, k, s, pad)[1:] + ref.out_size(w, k, s, pad)[1:]
    y, arg = ref.maxpool_forward(x, k, s, pads)
    by, bdx = brute_pool(x, k, s, pad)
    np.testing.assert_array_equal(y, by)
    n, oh, ow, ch = y.shape
    dy = np.fromfunction(lambda bi, r, cc, ci: 1.0 * (1 + bi + r + 2 * cc + 3 * ci), y.shape)
    np.testing.assert_array_equal(ref.maxpool_backward(dy, arg, x.shape, k, s, pads), bdx)
    fd_check(lambda x: float((ref.maxpool_forward(x, k, s, pads)[0] * dy).sum()), [x],
             [ref.maxpool_backward(dy, arg, x.shape, k, s, pads)])


def test_pool_padding_ignored_and_first_max_wins():
    # all negative: a zero-padded pool would return 0 at the border
    x = -np.arange(1.0, 26.0).reshape(1, 5, 5, 1)
    y, arg = ref.maxpool_forward(x, 2, 2, (0, 1, 0, 1))
    assert y[0, 2, 2, 0] == -25.0 and (y < 0).all()
    # ties: the gradient goes to the first maximum in row-major window order
    x = np.zeros((1, 2, 2, 1))
    y, arg = ref.maxpool_forward(x, 2, 2, (0, 0, 0, 0))
    dx = ref.maxpool_backward(np.ones_like(y), arg, x.shape, 2, 2, (0, 0, 0, 0))
    assert dx[0, :, :, 0].tolist() == [[1.0, 0.0], [0.0, 0.0]]
    x = np.array([[1.0, 3.0], [3.0, 3.0]]).reshape(1, 2, 2, 1)
    y, arg = ref.maxpool_forward(x, 2, 2, (0, 0, 0, 0))
    dx = ref.maxpool_backward(np.ones_like(y), arg, x.shape, 2, 2, (0, 0, 0, 0))
    assert dx[0, :, :, 0].tolist() == [[0.0, 1.0], [0.0, 0.0]]


def test_dense_relu_flatten_softmax_finite_differences():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 2, 2, 2))
    W = rng.normal(size=(8, 5))
    b = rng.normal(size=5)
    labels = np.array([0, 4, 2])

    def f(x, W, b):
        h = ref.relu_forward(ref.dense_forward(ref.flatten_forward(x), W, b))
        return float(ref.softmax_xent(h, labels)[0])

    z = ref.dense_forward(ref.flatten_forward(x), W, b)
    assert (z < 0).any() and (z > 0).any()
    h = ref.relu_forward(z)
    loss, dh = ref.softmax_xent(h, labels)
    dz = ref.relu_backward(dh, h)
    dflat, dW, db = ref.dense_backward(dz, ref.flatten_forward(x), W)
    dx = ref.flatten_backward(dflat, x.shape)
    fd_check(f, [x, W, b], [dx, dW, db])
    # flatten is the row-major order of [H, W, C]
    assert ref.flatten_forward(x)[1, 5] == x[1, 1, 0, 1]
    # the loss is the mean of -log softmax[label]
    p = np.exp(h) / np.exp(h).sum(1, keepdims=True)
    assert abs(loss - (-np.log(p[np.arange(3), labels]).mean())) < 1e-12


def test_dropout_hash_is_splitmix64():
    # splitmix64's published outputs for seed 0 and 1234567: the contract's
    # first hash with t = 0, 1, 2 is exactly the generator's sequence
    assert ref.mix64_int(0 + ref.GOLDEN) == 0xE220A8397B1DCDAF
    assert [ref.mix64_int(1234567 + ref.GOLDEN * k) for k in (1, 2, 3)] == \
        [6457827717110365317, 3203168211198807973, 9817491932198370423]
    # numpy's uint64 version equals the Python-int one on random values
    rng = np.random.default_rng(5)
    v = rng.integers(0, 2 ** 63, size=200, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    assert [int(z) for z in ref.mix64(v)] == [ref.mix64_int(int(z)) for z in v]
    # the whole r, by hand with Python ints, for a few units
    s, t, li = 0xFFFFFFFFFFFFFFF0, 41, 1
    examples = [0, 7, 12345678901]
    r = ref.dropout_r(s, t, examples, li, 300)
    for row, e in enumerate(examples):
        for u in (0, 1, 299):
            h = ref.mix64_int(s + ref.GOLDEN * (t + 1))
            h = ref.mix64_int(h ^ e)
            h = ref.mix64_int(h ^ ((li << 32) | u))
            assert r[row, u] == (h >> 40) * 2.0 ** -24


def test_dropout_mask_properties():
    keep, scale = ref.dropout_mask(0.4, 3, 10, np.arange(100, 300, dtype=np.uint64), 0, (200, 7, 7, 8))
    assert scale == float(np.float32(1) / np.float32(0.6))
    assert abs(keep.mean() - 0.6) < 0.01
    # an example's mask depends on its index only, not on its row in the batch
    k2, _ = ref.dropout_mask(0.4, 3, 10, np.arange(150, 160, dtype=np.uint64), 0, (10, 7, 7, 8))
    assert (k2 == keep[50:60]).all()
    # and changes with the step, the seed and the dropout layer's ordinal
    for args in ((0.4, 3, 11, 0), (0.4, 4, 10, 0), (0.4, 3, 10, 1)):
        k3, _ = ref.dropout_mask(args[0], args[1], args[2], np.arange(150, 160, dtype=np.uint64), args[3],
                                 (10, 7, 7, 8))
        assert (k3 != k2).mean() > 0.3
    y = ref.dropout_forward(np.ones((10, 7, 7, 8)), k2, scale)
    assert set(np.unique(y)) == {0.0, scale}
    x = np.random.default_rng(6).normal(size=(1, 2, 7, 8))
    keep = k2[:1, :2]
    R = np.random.default_rng(7).normal(size=x.shape)
    fd_check(lambda x: float((ref.dropout_forward(x, keep, scale) * R).sum()), [x],
             [ref.dropout_backward(R, keep, scale)])


SMALL_SPECS = [
    "conv:3x3x2,pool:2,dense:5,dense:10",
    "conv:3x2x2/2,conv:2x2x3:valid,pool:3/2,dropout:0.3,dense:10",
    "pool:2/3,dense:6,dropout:0.5,dense:4,dropout:0.25,dense:10",
    "mlp:6,5",
]


@pytest.mark.parametrize("spec", SMALL_SPECS)
def test_whole_model_finite_differences(spec):
    """Every parameter's gradient, the dropout masks on, a small input."""
    m = ref.Model(spec, input_shape=(7, 6, 1))
    rng = np.random.default_rng(7)
    p = {k: v.astype(np.float64) for k, v in m.init_params(rng).items()}
    x = rng.random((3, 7, 6, 1))
    labels = np.array([1, 9, 4])
    kw = dict(seed=11, step=5, example0=1000)
    margins = []
    m.forward(p, x, True, margins=margins, **kw)
    assert min(mg for _, _, mg in margins) > 1e-4, margins
    loss, logits, grads = m.loss_and_grads(p, x, labels, **kw)
    names = [n for n, _ in m.layout]

    def f(*arrays):
        q = dict(zip(names, arrays))
        lg, _ = m.forward(q, x, True, **kw)
        return float(ref.softmax_xent(lg, labels)[0])

    fd_check(f, [p[n] for n in names], [grads[n] for n in names], eps=1e-6, tol=1e-6)


def test_spec_grammar_and_names():
    cnn = ref.Model("cnn")
    assert cnn.layout == [("conv0_w", (5, 5, 1, 32)), ("conv0_b", (32,)), ("conv1_w", (5, 5, 32, 64)),
                          ("conv1_b", (64,)), ("fc0_w", (3136, 1024)), ("fc0_b", (1024,)),
                          ("sm_w", (1024, 10)), ("sm_b", (10,))]
    assert cnn.n_params() == 3274634                     # the tutorial's count
    assert ref.Model(ref.CNN).layout == cnn.layout
    assert [n for n, _ in ref.Model("mlp:100").layout] == ["hid_w", "hid_b", "sm_w", "sm_b"]
    assert ref.Model("mlp:100").layout[0] == ("hid_w", (784, 100))
    assert [n for n, _ in ref.Model("mlp:256,128").layout] == \
        ["hid0_w", "hid0_b", "hid1_w", "hid1_b", "sm_w", "sm_b"]
    assert ref.Model("mlp:").layout == [("sm_w", (784, 10)), ("sm_b", (10,))]
    assert [n for n, _ in ref.Model("dense:32,dense:10").layout] == ["fc0_w", "fc0_b", "sm_w", "sm_b"]
    m = ref.Model("conv:5x5x16/2:valid,pool:3/2:same,dense:10")
    assert [L["out_shape"] for L in m.layers] == [(12, 12, 16), (12, 12, 16), (6, 6, 16), (576,), (10,)]
    for bad, word in [("conv:3x3", "conv:3x3"), ("conv:0x3x4,dense:10", "conv:0x3x4"),
                      ("pool:2", "pool:2"), ("dense:32", "dense:32"), ("dense:10,dense:11", "dense:11"),
                      ("dropout:1,dense:10", "dropout:1"), ("conv:29x29x1:valid,dense:10", "conv:29x29x1"),
                      ("conv:3x3x4:full,dense:10", "full"), ("mlp:10,0", "mlp:10,0"), ("", "empty"),
                      ("lstm:4,dense:10", "lstm:4"), ("dense:-3,dense:10", "dense:-3")]:
        with pytest.raises(ref.SpecError, match=word.replace("+", r"\+")):
            ref.Model(bad)


# =================================================================== (b) model_dump

def need_model_dump():
    if not os.access(MODEL_DUMP, os.X_OK):
        pytest.fail(f"{MODEL_DUMP} is missing: it is built by unit-bins "
                    f"(make BUILD=... BIN={os.path.dirname(MODEL_DUMP)} all unit-bins)")


def run_model_dump(tmp_path, spec, params, x, labels, meta, name="case"):
    need_model_dump()
    src, dst = tmp_path / f"{name}.in.safetensors", tmp_path / f"{name}.out.safetensors"
    tensors = dict(params)
    tensors["x"] = x
    tensors["labels"] = labels.astype(np.float32)
    ref.st_write(src, tensors, {k: str(v) for k, v in meta.items()})
    r = subprocess.run([MODEL_DUMP, spec, str(src), str(dst)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, f"model_dump {spec}: exit {r.returncode}\n{r.stderr}"
    assert "runtime error:" not in r.stderr and "Sanitizer" not in r.stderr, r.stderr
    _, out = ref.st_read(dst)
    return out, r.stderr


def draw_case(m, batch, seed, meta, x_of=None, tries=20):
    """Random params, inputs and labels whose float64 forward keeps every
    ReLU input and pool runner-up at least MARGIN of the layer's scale away
    from its kink (see the module docstring)."""
    for k in range(tries):
        rng = np.random.default_rng([seed, k])
        params = m.init_params(rng)
        x = (x_of(rng) if x_of else rng.random((batch,) + m.input_shape)).astype(np.float32)
        labels = rng.integers(0, 10, size=batch)
        margins = []
        m.forward(params, x, True, margins=margins, **meta)
        if min((mg for _, _, mg in margins), default=math.inf) >= MARGIN:
            return params, x, labels
    raise AssertionError(f"no draw of {m.spec} in {tries} kept its kink margin >= {MARGIN}")


def max_rel(c, r):
    floor = FLOOR * np.abs(r).max() if np.abs(r).max() > 0 else 1e-30
    return float((np.abs(c - r) / np.maximum(np.maximum(np.abs(c), np.abs(r)), floor)).max())


def compare(spec, out, m, loss, logits, grads):
    worst = []
    assert set(out) == {"loss", "logits"} | {f"grad.{n}" for n, _ in m.layout}, sorted(out)
    assert out["loss"].shape == (1,)
    assert abs(float(out["loss"][0]) - loss) <= 1e-5 * max(1.0, abs(loss)), (float(out["loss"][0]), loss)
    assert out["logits"].shape == logits.shape
    e = max_rel(out["logits"], logits)
    assert e <= REL_TOL, f"{spec}: logits max rel err {e:.3g}"
    worst.append((e, "logits"))
    for n, shape in m.layout:
        g = out[f"grad.{n}"]
        assert g.shape == tuple(shape), (n, g.shape, shape)
        e = max_rel(g, grads[n])
        worst.append((e, n))
        assert e <= REL_TOL, (f"{spec}: grad.{n} max rel err {e:.3g} at "
                              f"{np.unravel_index(np.argmax(np.abs(g - grads[n])), shape)}")
    return max(worst)


DUMP_CASES = [
    # spec, batch, dropout metadata
    ("mlp:100", 8, {}),
    ("mlp:256,128", 5, {}),
    ("mlp:", 3, {}),
    ("conv:3x3x4,pool:2,conv:3x3x8/2:valid,pool:3/2:valid,dense:16,dropout:0.5,dense:10", 4,
     dict(seed=12345, step=17, example0=600)),
    ("conv:4x4x3/3,pool:3/2,conv:5x3x2,dropout:0.3,dense:10", 3,       # asymmetric same padding
     dict(seed=7, step=0, example0=59998)),                          # dropout on NHWC activations
    ("dense:32,dropout:0.5,dense:16,dropout:0.25,dense:10", 6,        # two dropouts: li 0 and 1
     dict(seed=2 ** 62 + 5, step=123456, example0=3)),
    ("cnn", 2, dict(seed=42, step=3, example0=9)),
]


@pytest.mark.parametrize("spec,batch,meta", DUMP_CASES, ids=[c[0] for c in DUMP_CASES])
def test_model_dump_matches_numpy(tmp_path, spec, batch, meta):
    need_model_dump()
    m = ref.Model(spec)
    params, x, labels = draw_case(m, batch, len(spec) * 7 + batch, meta)
    out, err = run_model_dump(tmp_path, spec, params, x, labels, meta)
    loss, logits, grads = m.loss_and_grads(params, x, labels, **meta)
    worst = compare(spec, out, m, loss, logits, grads)
    if any(L["kind"] == "dropout" for L in m.layers):
        # the masks matter here: another step's masks give gradients the comparison refuses
        other = dict(meta, step=meta["step"] + 1)
        _, _, g2 = m.loss_and_grads(params, x, labels, **other)
        assert max(max_rel(out[f"grad.{n}"], g2[n]) for n, _ in m.layout) > 100 * REL_TOL
    print(f"{spec} batch {batch}: loss {loss:.6f}, worst rel err {worst[0]:.2g} ({worst[1]})")


def test_model_dump_pool_ties_go_to_the_first_max(tmp_path):
    """Quantized pixels (k/255, many zeros) through a 3x3 conv whose only
    nonzero tap is the centre, plus a positive bias: the conv output ties
    exactly wherever the pixels do, and the off-centre taps' gradients depend
    on which tied position each pool window sends its gradient to."""
    need_model_dump()
    spec = "conv:3x3x2,pool:2,dense:10"
    m = ref.Model(spec)
    rng = np.random.default_rng(8)
    params = m.init_params(rng)
    w = np.zeros((3, 3, 1, 2), np.float32)
    w[1, 1, 0] = [0.5, 0.75]
    params["conv0_w"] = w
    params["conv0_b"] = np.array([0.25, 0.125], np.float32)
    x = (rng.integers(0, 4, size=(3, 28, 28, 1)) * 60 / 255).astype(np.float32)
    labels = rng.integers(0, 10, size=3)
    out, _ = run_model_dump(tmp_path, spec, params, x, labels, {})
    loss, logits, grads = m.loss_and_grads(params, x, labels)
    compare(spec, out, m, loss, logits, grads)
    # the last-max rule would give another gradient for the off-centre taps
    first_max = ref.maxpool_forward
    try:
        ref.maxpool_forward = lambda *a: first_max(*a, last=True)
        last = m.loss_and_grads(params, x, labels)[2]["conv0_w"]
    finally:
        ref.maxpool_forward = first_max
    assert max_rel(out["grad.conv0_w"], last) > 100 * REL_TOL


def test_model_dump_mlp100_equals_mlp_dump(tmp_path):
    """mlp:100 through the layer library gives the floats the old MLP code gave."""
    need_model_dump()
    if not os.access(MLP_DUMP, os.X_OK):
        pytest.skip(f"{MLP_DUMP} is gone (the old MLP path was removed), nothing to compare with")
    rng = np.random.default_rng(9)
    m = ref.Model("mlp:100")
    params = m.init_params(rng)
    x = rng.random((100, 28, 28, 1), dtype=np.float32)
    labels = rng.integers(0, 10, size=100)
    out, _ = run_model_dump(tmp_path, "mlp:100", params, x, labels, {})
    (tmp_path / "spec").write_text("n_in=784 hidden=100 n_out=10 batch=100\n")
    flat = np.concatenate([params[n].ravel() for n, _ in m.layout]).astype("<f4")
    flat.tofile(tmp_path / "p")
    x.astype("<f4").tofile(tmp_path / "x")
    labels.astype(np.uint8).tofile(tmp_path / "l")
    r = subprocess.run([MLP_DUMP, f"--spec={tmp_path / 'spec'}", f"--params={tmp_path / 'p'}",
                        f"--x={tmp_path / 'x'}", f"--labels={tmp_path / 'l'}",
                        f"--loss_out={tmp_path / 'loss'}", f"--grads_out={tmp_path / 'g'}"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    old_loss = np.fromfile(tmp_path / "loss", dtype="<f4")
    old = np.fromfile(tmp_path / "g", dtype="<f4")
    new = np.concatenate([out[f"grad.{n}"].ravel() for n, _ in m.layout])
    assert out["loss"].tobytes() == old_loss.tobytes()
    assert new.tobytes() == old.tobytes(), f"max abs diff {np.abs(new - old).max():.3g}"


@pytest.mark.parametrize("spec,word", [("conv:3x3,dense:10", "conv:3x3"), ("pool:2", "pool:2"),
                                       ("dense:10,dense:11", "dense:11"), ("lstm:4,dense:10", "lstm:4"),
                                       ("dropout:1.5,dense:10", "dropout:1.5")])
def test_model_dump_refuses_a_bad_spec(tmp_path, spec, word):
    need_model_dump()
    m = ref.Model("mlp:")
    rng = np.random.default_rng(10)
    src = tmp_path / "in.safetensors"
    t = m.init_params(rng)
    t["x"] = np.zeros((1, 28, 28, 1), np.float32)
    t["labels"] = np.zeros(1, np.float32)
    ref.st_write(src, t)
    r = subprocess.run([MODEL_DUMP, spec, str(src), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_model_dump_refuses_a_bad_file(tmp_path):
    need_model_dump()
    m = ref.Model("mlp:")
    t = m.init_params(np.random.default_rng(11))
    t["x"] = np.zeros((2, 28, 28, 1), np.float32)
    t["labels"] = np.zeros(2, np.float32)
    cases = {"missing": {k: v for k, v in t.items() if k != "sm_b"},
             "shape": dict(t, sm_w=np.zeros((10, 784), np.float32)),
             "labels": dict(t, labels=np.array([0, 10], np.float32))}
    for what, tensors in cases.items():
        src = tmp_path / f"{what}.safetensors"
        ref.st_write(src, tensors)
        r = subprocess.run([MODEL_DUMP, "mlp:", str(src), str(tmp_path / "out")], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (what, r)
    (tmp_path / "junk").write_bytes(b"\xff" * 20)
    r = subprocess.run([MODEL_DUMP, "mlp:", str(tmp_path / "junk"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
