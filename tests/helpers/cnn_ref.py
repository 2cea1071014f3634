"""An independent numpy implementation of restps's model contract (issue 19):
the --model spec grammar, parameter names and buffer order, and the forward
and backward of every layer type (conv2d, maxpool, relu, dropout, flatten,
dense, mean softmax cross-entropy), float64 by default.

Written from the contract's definitions, not from the C code: convolution is a
loop over kernel offsets with numpy slicing (no im2col), pooling a loop over
window offsets in row-major order keeping the first maximum, the dropout mask
the contract's splitmix64 hash in numpy uint64 arithmetic. Layouts: NHWC
activations, HWIO conv kernels, [fan_in, fan_out] dense kernels, flatten in
the row-major order of [H, W, C]. Only numpy (Debian's python3-numpy).

    m = Model("conv:3x3x8,pool:2,dense:32,dense:10")
    params = m.init_params(np.random.default_rng(0))      # {name: float32 array}
    loss, logits, grads = m.loss_and_grads(params, x, labels, seed=1, step=3, example0=0)

Also here: a minimal safetensors reader/writer (8-byte LE header length, JSON
header, little-endian data) and FLOP counts for the benchmark.
"""
import json
import math
import re
import struct

import numpy as np

N_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)
CNN = "conv:5x5x32,pool:2,conv:5x5x64,pool:2,dense:1024,dropout:0.4,dense:10"

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


class SpecError(ValueError):
    """A bad spec; the message names the bad part."""


# ------------------------------------------------------------------ the spec

_INT = r"([1-9][0-9]*)"
_CONV = re.compile(r"conv:" + _INT + "x" + _INT + "x" + _INT + r"(?:/" + _INT + r")?(?::(same|valid))?\Z")
_POOL = re.compile(r"pool:" + _INT + r"(?:/" + _INT + r")?(?::(same|valid))?\Z")
_DENSE = re.compile(r"dense:" + _INT + r"\Z")
_DROP = re.compile(r"dropout:([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\Z")
_MLP = re.compile(r"mlp:(" + _INT + r"(?:," + _INT + r")*)?\Z")


def out_size(n, k, s, padding):
    """(out, pad_before, pad_after) along one axis, TensorFlow's rule."""
    if padding == "same":
        out = -(-n // s)
        total = max((out - 1) * s + k - n, 0)
        return out, total // 2, total - total // 2
    if k > n:
        raise SpecError(f"kernel {k} is larger than its input {n} under valid")
    return -(-(n - k + 1) // s), 0, 0


def parse(spec, input_shape=INPUT_SHAPE, n_classes=N_CLASSES):
    """The model's layers: a list of dicts with 'kind' in conv, pool, relu,
    dropout, flatten, dense, and the shapes in and out. Raises SpecError."""
    if spec == "cnn":
        spec = CNN
    items = []   # (kind, args, text)
    mlp = _MLP.match(spec)
    if spec.startswith("mlp:"):
        if not mlp:
            raise SpecError(f"bad mlp spec {spec!r}: want mlp:H1,H2,... with positive sizes")
        hidden = [int(h) for h in spec[4:].split(",")] if spec[4:] else []
        for h in hidden:
            items.append(("dense", (h,), f"dense:{h}"))
        items.append(("dense", (n_classes,), f"dense:{n_classes}"))
    else:
        if not spec:
            raise SpecError("empty model spec")
        for text in spec.split(","):
            if m := _CONV.match(text):
                kh, kw, c, s, pad = m.groups()
                items.append(("conv", (int(kh), int(kw), int(c), int(s or 1), pad or "same"), text))
            elif m := _POOL.match(text):
                k, s, pad = m.groups()
                items.append(("pool", (int(k), int(s or k), pad or "same"), text))
            elif m := _DENSE.match(text):
                items.append(("dense", (int(m.group(1)),), text))
            elif m := _DROP.match(text):
                r = float(m.group(1))
                if not 0 <= r < 1:
                    raise SpecError(f"bad layer {text!r}: the drop rate must be in [0, 1)")
                items.append(("dropout", (r,), text))
            else:
                raise SpecError(f"bad layer {text!r}")
        if items[-1][0] != "dense":
            raise SpecError(f"bad last layer {items[-1][2]!r}: the last layer must be dense:{n_classes}")
        if items[-1][1][0] != n_classes:
            raise SpecError(f"bad last layer {items[-1][2]!r}: the logits layer has {n_classes} units")

    n_dense = sum(1 for k, _, _ in items if k == "dense")
    layers = []
    shape = tuple(input_shape)          # per example: (H, W, C) or (N,)
    conv_i = fc_i = drop_i = dense_seen = 0
    for kind, args, text in items:
        if kind == "conv":
            if len(shape) != 3:
                raise SpecError(f"bad layer {text!r}: conv after a dense layer")
            kh, kw, c, s, pad = args
            try:
                oh, pt, pb = out_size(shape[0], kh, s, pad)
                ow, pl, pr = out_size(shape[1], kw, s, pad)
            except SpecError as e:
                raise SpecError(f"bad layer {text!r}: {e}")
            layers.append(dict(kind="conv", name=f"conv{conv_i}", kh=kh, kw=kw, stride=s,
                               padding=pad, pads=(pt, pb, pl, pr), cin=shape[2], cout=c,
                               in_shape=shape, out_shape=(oh, ow, c)))
            conv_i += 1
            shape = (oh, ow, c)
            layers.append(dict(kind="relu", in_shape=shape, out_shape=shape))
        elif kind == "pool":
            if len(shape) != 3:
                raise SpecError(f"bad layer {text!r}: pool after a dense layer")
            k, s, pad = args
            try:
                oh, pt, pb = out_size(shape[0], k, s, pad)
                ow, pl, pr = out_size(shape[1], k, s, pad)
            except SpecError as e:
                raise SpecError(f"bad layer {text!r}: {e}")
            layers.append(dict(kind="pool", k=k, stride=s, padding=pad, pads=(pt, pb, pl, pr),
                               in_shape=shape, out_shape=(oh, ow, shape[2])))
            shape = (oh, ow, shape[2])
        elif kind == "dropout":
            layers.append(dict(kind="dropout", rate=args[0], index=drop_i,
                               in_shape=shape, out_shape=shape))
            drop_i += 1
        else:  # dense
            if len(shape) == 3:
                n = shape[0] * shape[1] * shape[2]
                layers.append(dict(kind="flatten", in_shape=shape, out_shape=(n,)))
                shape = (n,)
            dense_seen += 1
            last = dense_seen == n_dense
            if last:
                name = "sm"
            elif mlp:
                name = "hid" if n_dense == 2 else f"hid{fc_i}"
                fc_i += 1
            else:
                name = f"fc{fc_i}"
                fc_i += 1
            layers.append(dict(kind="dense", name=name, fan_in=shape[0], fan_out=args[0],
                               in_shape=shape, out_shape=(args[0],)))
            shape = (args[0],)
            if not last:
                layers.append(dict(kind="relu", in_shape=shape, out_shape=shape))
    return layers


def param_layout(layers):
    """[(name, shape)] in buffer order: layer order, each layer W then b."""
    out = []
    for L in layers:
        if L["kind"] == "conv":
            out.append((L["name"] + "_w", (L["kh"], L["kw"], L["cin"], L["cout"])))
            out.append((L["name"] + "_b", (L["cout"],)))
        elif L["kind"] == "dense":
            out.append((L["name"] + "_w", (L["fan_in"], L["fan_out"])))
            out.append((L["name"] + "_b", (L["fan_out"],)))
    return out


# ------------------------------------------------------------------ layers

def _pad_hw(x, pads, value):
    pt, pb, pl, pr = pads
    return np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=value)


def _window(xp, i, j, oh, ow, s):
    """The [B, oh, ow, C] view of padded input rows i, i+s, ... and columns j, j+s, ..."""
    return xp[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s, :]


def conv2d_forward(x, w, b, stride, pads):
    """y[n, oh, ow, co] = b[co] + sum_{i, j, ci} xpad[n, oh*S + i, ow*S + j, ci] * w[i, j, ci, co]."""
    kh, kw, cin, cout = w.shape
    xp = _pad_hw(x, pads, 0.0)
    oh = (xp.shape[1] - kh) // stride + 1
    ow = (xp.shape[2] - kw) // stride + 1
    y = np.zeros((x.shape[0], oh, ow, cout), dtype=np.result_type(x, w))
    for i in range(kh):
        for j in range(kw):
            y += _window(xp, i, j, oh, ow, stride) @ w[i, j]
    return y + b


def conv2d_backward(dy, x, w, stride, pads):
    """(dx, dw, db) of conv2d_forward, the same loop over kernel offsets."""
    kh, kw, cin, cout = w.shape
    xp = _pad_hw(x, pads, 0.0)
    _, oh, ow, _ = dy.shape
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    dyf = dy.reshape(-1, cout)
    for i in range(kh):
        for j in range(kw):
            win = _window(xp, i, j, oh, ow, stride)
            dw[i, j] = win.reshape(-1, cin).T @ dyf
            _window(dxp, i, j, oh, ow, stride)[...] += dy @ w[i, j].T
    pt, pb, pl, pr = pads
    dx = dxp[:, pt:dxp.shape[1] - pb, pl:dxp.shape[2] - pr, :]
    return dx, dw, dy.sum(axis=(0, 1, 2))


def maxpool_forward(x, k, stride, pads, last=False):
    """(y, argmax): the max over each k x k window, padded positions ignored;
    argmax is the window offset i * k + j of the FIRST maximum in row-major
    order (the LAST with last=True: only for a test to show the rule matters)."""
    xp = _pad_hw(x, pads, -np.inf)
    oh = (xp.shape[1] - k) // stride + 1
    ow = (xp.shape[2] - k) // stride + 1
    best = np.full((x.shape[0], oh, ow, x.shape[3]), -np.inf, dtype=x.dtype)
    arg = np.full(best.shape, -1, dtype=np.int64)
    for i in range(k):
        for j in range(k):
            win = _window(xp, i, j, oh, ow, stride)
            better = (win >= best) if last else (win > best)   # strict: a tie keeps the first
            best = np.where(better, win, best)
            arg = np.where(better, i * k + j, arg)
    assert (arg >= 0).all(), "a window of padding only"
    return best, arg


def maxpool_backward(dy, arg, x_shape, k, stride, pads):
    pt, pb, pl, pr = pads
    n, h, w, c = x_shape
    dxp = np.zeros((n, h + pt + pb, w + pl + pr, c), dtype=dy.dtype)
    _, oh, ow, _ = dy.shape
    for i in range(k):
        for j in range(k):
            _window(dxp, i, j, oh, ow, stride)[...] += np.where(arg == i * k + j, dy, 0)
    return dxp[:, pt:pt + h, pl:pl + w, :]


def relu_forward(x):
    return np.maximum(x, 0)


def relu_backward(dy, y):
    return np.where(y > 0, dy, 0)


def dense_forward(x, w, b):
    return x @ w + b


def dense_backward(dy, x, w):
    return dy @ w.T, x.T @ dy, dy.sum(axis=0)


def flatten_forward(x):
    return x.reshape(x.shape[0], -1)


def flatten_backward(dy, x_shape):
    return dy.reshape(x_shape)


def softmax_xent(logits, labels):
    """(mean loss, dlogits) of softmax cross-entropy against integer labels."""
    labels = np.asarray(labels, dtype=np.int64)
    B = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -logp[np.arange(B), labels].mean()
    d = np.exp(logp)
    d[np.arange(B), labels] -= 1
    return loss, d / B


# ------------------------------------------------------------------ dropout

def mix64_int(z):
    """splitmix64's finalizer on a Python int (an independent check of mix64)."""
    z &= M64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return z


def mix64(z):
    """The same on numpy uint64 arrays (wraparound multiplication)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z ^ (z >> np.uint64(30))
        z = z * np.uint64(0xBF58476D1CE4E5B9)
        z = z ^ (z >> np.uint64(27))
        z = z * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z


def dropout_r(seed, step, examples, li, units):
    """r in [0, 1) as float32, shape [len(examples), units], per the contract."""
    h = mix64(np.uint64((seed + GOLDEN * (step + 1)) & M64))
    h = mix64(h ^ np.asarray(examples, dtype=np.uint64))
    u = (np.uint64(li) << np.uint64(32)) | np.arange(units, dtype=np.uint64)
    h = mix64(h[:, None] ^ u[None, :])
    return (h >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def dropout_mask(rate, seed, step, examples, li, shape):
    """(keep, scale): keep[b, ...] is True where unit u of example b is kept,
    scale = 1.0f / (1.0f - R) in float32. The comparison r >= R is made with R
    as a float32 (the C layer's float rate)."""
    units = int(np.prod(shape[1:]))
    r = dropout_r(seed, step, examples, li, units)
    keep = r >= np.float32(rate)
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(rate))
    return keep.reshape(shape), float(scale)


def dropout_forward(x, keep, scale):
    return np.where(keep, x * x.dtype.type(scale), 0).astype(x.dtype)


def dropout_backward(dy, keep, scale):
    return np.where(keep, dy * dy.dtype.type(scale), 0).astype(dy.dtype)


# ------------------------------------------------------------------ the model

def kink_margin(kind, a, L):
    """The smallest distance, relative to max|a|, of a ReLU input from 0, or
    of a pool window's maximum from its runner-up (exact ties, which any
    implementation breaks the same way, and windows of one element excluded).
    A float32 implementation can take the other side of a kink closer than its
    rounding error; a test compares only where this margin is wide."""
    scale = float(np.abs(a).max()) or 1.0
    if kind == "relu":
        return float(np.abs(a).min()) / scale
    k, s = L["k"], L["stride"]
    if k == 1:
        return math.inf
    xp = _pad_hw(a, L["pads"], -np.inf)
    oh, ow = L["out_shape"][:2]
    wins = np.stack([_window(xp, i, j, oh, ow, s) for i in range(k) for j in range(k)])
    wins = np.sort(wins, axis=0)
    gap = wins[-1] - wins[-2]
    gap = gap[(gap > 0) & np.isfinite(gap)]
    return float(gap.min()) / scale if gap.size else math.inf


class Model:
    def __init__(self, spec, input_shape=INPUT_SHAPE, n_classes=N_CLASSES):
        self.spec = spec
        self.input_shape = tuple(input_shape)
        self.layers = parse(spec, input_shape, n_classes)
        self.layout = param_layout(self.layers)

    def n_params(self):
        return sum(int(np.prod(s)) for _, s in self.layout)

    def init_params(self, rng, dtype=np.float32):
        """Random parameters at the usual scale (1/sqrt(fan_in)), biases nonzero."""
        p = {}
        for name, shape in self.layout:
            if name.endswith("_w"):
                fan_in = int(np.prod(shape[:-1]))
                p[name] = rng.normal(0, 1 / math.sqrt(fan_in), size=shape).astype(dtype)
            else:
                p[name] = rng.normal(0, 0.1, size=shape).astype(dtype)
        return p

    def forward(self, params, x, train=False, seed=0, step=0, example0=0, dtype=np.float64,
                margins=None):
        """(logits, cache). x is [B, H, W, C] (or [B, N] for an MLP's input).
        With a list as margins, appends (layer index, kind, margin) for every
        ReLU and pool: how close the step came to a kink, relative to the
        layer's largest |input| (see kink_margin)."""
        a = np.asarray(x, dtype=dtype).reshape((x.shape[0],) + self.input_shape)
        P = {k: np.asarray(v, dtype=dtype) for k, v in params.items()}
        examples = np.uint64(example0) + np.arange(a.shape[0], dtype=np.uint64)
        cache = []
        for li, L in enumerate(self.layers):
            k = L["kind"]
            if margins is not None and k in ("relu", "pool"):
                margins.append((li, k, kink_margin(k, a, L)))
            if k == "conv":
                y = conv2d_forward(a, P[L["name"] + "_w"], P[L["name"] + "_b"], L["stride"], L["pads"])
                cache.append(a)
            elif k == "pool":
                y, arg = maxpool_forward(a, L["k"], L["stride"], L["pads"])
                cache.append((a.shape, arg))
            elif k == "relu":
                y = relu_forward(a)
                cache.append(y)
            elif k == "dropout":
                if train and L["rate"] > 0:
                    keep, scale = dropout_mask(L["rate"], seed, step, examples, L["index"], a.shape)
                    y = dropout_forward(a, keep, scale)
                    cache.append((keep, scale))
                else:
                    y = a
                    cache.append(None)
            elif k == "flatten":
                y = flatten_forward(a)
                cache.append(a.shape)
            else:
                y = dense_forward(a.reshape(a.shape[0], -1), P[L["name"] + "_w"], P[L["name"] + "_b"])
                cache.append(a)
            a = y
        return a, cache

    def backward(self, params, cache, dlogits, dtype=np.float64):
        """{name: gradient}, and the gradient with respect to the input."""
        P = {k: np.asarray(v, dtype=dtype) for k, v in params.items()}
        grads = {}
        d = dlogits
        for L, c in zip(reversed(self.layers), reversed(cache)):
            k = L["kind"]
            if k == "conv":
                d, grads[L["name"] + "_w"], grads[L["name"] + "_b"] = conv2d_backward(
                    d, c, P[L["name"] + "_w"], L["stride"], L["pads"])
            elif k == "pool":
                d = maxpool_backward(d, c[1], c[0], L["k"], L["stride"], L["pads"])
            elif k == "relu":
                d = relu_backward(d, c)
            elif k == "dropout":
                if c is not None:
                    d = dropout_backward(d, *c)
            elif k == "flatten":
                d = flatten_backward(d, c)
            else:
                d, grads[L["name"] + "_w"], grads[L["name"] + "_b"] = dense_backward(
                    d, c.reshape(c.shape[0], -1), P[L["name"] + "_w"])
        return grads, d

    def loss_and_grads(self, params, x, labels, seed=0, step=0, example0=0, dtype=np.float64):
        """A training step's (mean loss, logits, {name: grad}), dropout on."""
        logits, cache = self.forward(params, x, True, seed, step, example0, dtype)
        loss, dl = softmax_xent(logits, labels)
        grads, _ = self.backward(params, cache, dl, dtype)
        return float(loss), logits, grads

    def flops(self, batch):
        """(forward, training step) multiply-add FLOPs (2 per MAC) of the conv
        and dense layers: a step is the forward, the weight gradients and the
        input gradients of every layer but the first (which needs none)."""
        fwd = step = 0
        first = True
        for L in self.layers:
            if L["kind"] == "conv":
                oh, ow, co = L["out_shape"]
                f = 2 * batch * oh * ow * L["kh"] * L["kw"] * L["cin"] * co
            elif L["kind"] == "dense":
                f = 2 * batch * L["fan_in"] * L["fan_out"]
            else:
                continue
            fwd += f
            step += f * (2 if first else 3)
            first = False
        return fwd, step


# ------------------------------------------------------------------ safetensors

def st_write(path, tensors, metadata=None):
    """Write {name: array} as float32 safetensors (names in sorted order)."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        b = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def st_read(path):
    """(metadata dict, {name: float32 array}) of a safetensors file of F32 tensors."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    data = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if t["dtype"] != "F32":
            raise ValueError(f"{path}: tensor {name} is {t['dtype']}, not F32")
        b, e = t["data_offsets"]
        shape = tuple(t["shape"])
        if e - b != 4 * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{path}: tensor {name}: {e - b} bytes for shape {shape}")
        out[name] = np.frombuffer(data[b:e], dtype="<f4").reshape(shape)
    return meta, out
