"""Check an ONNX file workerd wrote (--export_onnx, --convert_model) with the
ONNX project's own tools, under build/venv/bin/python (PyPI onnx and
onnxruntime; `make deps`):

  onnx_check.py MODEL.onnx LOGITS.safetensors DATA_DIR

- onnx.checker.check_model(full_check=True) (the graph, its types and shapes
  inferred with strict mode);
- onnxruntime runs it on the test set of DATA_DIR (the IDX files, NHWC
  [n, 28, 28, 1] float32 pixels * float32(1/255), as restps reads them);
- its logits against LOGITS (workerd --evaluate_model --evaluate_logits:
  restps's own forward pass on the same images).

Prints one JSON line: n, argmax_equal (examples whose argmax agree),
max_rel (over the examples, max |ort - restps| / max |restps| of the
example's logits: the error relative to the logits' scale), max_abs, prob_err (max |probabilities - softmax(logits)|), opset,
ir_version, metadata. Exits 0 (the caller judges the figures) or 1 with
the reason on stderr."""
import gzip
import json
import os
import struct
import sys

import numpy as np
import onnx
import onnxruntime as ort
from safetensors.numpy import load_file


def read_idx_images(data_dir):
    for name in ("t10k-images-idx3-ubyte", "t10k-images-idx3-ubyte.gz"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            raw = gzip.open(path).read() if name.endswith(".gz") else open(path, "rb").read()
            magic, n, h, w = struct.unpack(">IIII", raw[:16])
            assert magic == 0x803, f"{path}: bad magic {magic:#x}"
            px = np.frombuffer(raw, np.uint8, n * h * w, 16).reshape(n, h, w, 1)
            return px.astype(np.float32) * np.float32(1.0 / 255.0)
    raise FileNotFoundError(f"no t10k-images-idx3-ubyte[.gz] in {data_dir}")


def main(argv):
    model_path, logits_path, data_dir = argv[1:4]
    model = onnx.load(model_path)
    onnx.checker.check_model(model, full_check=True)
    ref = load_file(logits_path)
    want = ref["logits"]
    x = read_idx_images(data_dir)
    if x.shape[0] != want.shape[0]:
        print(f"{data_dir} has {x.shape[0]} test images, {logits_path} {want.shape[0]} logits", file=sys.stderr)
        return 1
    sess = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    got, prob = sess.run(["logits", "probabilities"], {"input": x})
    e = np.exp(got - got.max(axis=1, keepdims=True))
    soft = e / e.sum(axis=1, keepdims=True)
    diff = np.abs(got.astype(np.float64) - want)
    out = {
        "n": int(x.shape[0]),
        "argmax_equal": int((got.argmax(1) == want.argmax(1)).sum()),
        "accuracy": float((got.argmax(1) == ref["labels"]).mean()),
        "max_rel": float((diff.max(axis=1) / np.abs(want).max(axis=1)).max()),
        "max_abs": float(diff.max()),
        "prob_err": float(np.abs(prob - soft).max()),
        "opset": [[o.domain, o.version] for o in model.opset_import],
        "ir_version": model.ir_version,
        "inputs": [[i.name, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]]
                   for i in model.graph.input],
        "ops": sorted({n.op_type for n in model.graph.node}),
        "metadata": {p.key: p.value for p in model.metadata_props},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
