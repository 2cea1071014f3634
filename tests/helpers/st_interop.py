"""Python's safetensors (PyPI, build/venv) on the files restps writes, and
files for restps written by it: the PyPI side of tests/system/test_safetensors_py.py.

    st_interop.py read FILE...        -> JSON on stdout: per file
        {"metadata": {...}, "tensors": {name: {"dtype", "shape", "hex"}}}
        read with safetensors.safe_open (framework numpy); every tensor is
        also read with safetensors.numpy.load and must be the same
    st_interop.py write OUT SPEC      SPEC (JSON): {"metadata": {...} | null,
        "tensors": {name: {"dtype": "F32"|"F16"|"BF16", "shape": [...],
        "values": [...]}}}: written with safetensors.numpy.save_file (F32,
        F16) or safetensors.serialize_file (BF16, which numpy lacks)
    st_interop.py resave IN OUT [DTYPE]  IN read with safetensors.numpy.load_file
        and its metadata with safe_open, written again with save_file (as
        DTYPE, e.g. F16, when given)
Exit status 1 with a message on stderr when something disagrees.
"""
import json
import sys

import numpy as np
import safetensors
import safetensors.numpy

NP = {"F32": np.float32, "F16": np.float16}


def read(path):
    out = {"metadata": None, "tensors": {}}
    with open(path, "rb") as f:
        whole = safetensors.numpy.load(f.read())
    with safetensors.safe_open(path, framework="numpy") as f:
        out["metadata"] = f.metadata()
        for name in f.keys():
            a = f.get_tensor(name)
            dtype = f.get_slice(name).get_dtype()
            if name not in whole or whole[name].dtype != a.dtype or \
                    whole[name].tobytes() != a.tobytes():
                sys.exit(f"{path}: safe_open and numpy.load disagree on {name!r}")
            out["tensors"][name] = {"dtype": dtype, "shape": list(a.shape),
                                    "hex": a.astype(a.dtype.newbyteorder("<")).tobytes().hex()}
    if set(whole) != set(out["tensors"]):
        sys.exit(f"{path}: safe_open and numpy.load list other tensors")
    return out


def bf16(values):
    """float32 -> bfloat16 bits, round to nearest even (values are finite)."""
    u = np.asarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def write(out, spec):
    ts = spec["tensors"]
    meta = spec.get("metadata")
    if any(t["dtype"] == "BF16" for t in ts.values()):
        keep, specs = [], {}
        for name, t in ts.items():
            if t["dtype"] == "BF16":
                a = bf16(t["values"]).reshape(t["shape"])
                dt = "bfloat16"
            else:
                a = np.asarray(t["values"], dtype=NP[t["dtype"]]).reshape(t["shape"])
                dt = {"F32": "float32", "F16": "float16"}[t["dtype"]]
            a = np.ascontiguousarray(a)
            keep.append(a)
            specs[name] = safetensors.TensorSpec(dtype=dt, shape=list(a.shape),
                                                 data_ptr=a.ctypes.data, data_len=a.nbytes)
        safetensors.serialize_file(specs, out, metadata=meta)
    else:
        arrays = {n: np.asarray(t["values"], dtype=NP[t["dtype"]]).reshape(t["shape"])
                  for n, t in ts.items()}
        safetensors.numpy.save_file(arrays, out, metadata=meta)


def resave(src, dst, dtype=None):
    arrays = safetensors.numpy.load_file(src)
    with safetensors.safe_open(src, framework="numpy") as f:
        meta = f.metadata()
    if dtype:
        arrays = {n: a.astype(NP[dtype]) for n, a in arrays.items()}
    safetensors.numpy.save_file(arrays, dst, metadata=meta)


def main(argv):
    if argv[:1] == ["read"] and len(argv) > 1:
        json.dump({p: read(p) for p in argv[1:]}, sys.stdout)
    elif argv[:1] == ["write"] and len(argv) == 3:
        write(argv[1], json.loads(argv[2]))
    elif argv[:1] == ["resave"] and len(argv) in (3, 4):
        resave(*argv[1:])
    else:
        sys.exit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
