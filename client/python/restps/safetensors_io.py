"""safetensors bodies with numpy and the standard library: an 8-byte
little-endian header length, a JSON header (``dtype``, ``shape``,
``data_offsets`` per tensor, ``__metadata__`` a string map), the data.
The bulk pull's and push's body, restps's checkpoints and exported models
are all this format; Python's ``safetensors`` package reads what
:func:`encode` writes and :func:`decode` reads what it writes."""
import json
import struct
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from .errors import ProtocolError

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
          "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
NAMES = {np.dtype(v).str: k for k, v in DTYPES.items()}
HEADER_MAX = 100 << 20


def encode(tensors: Mapping[str, np.ndarray], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """One safetensors body of tensors (in the order given; C-contiguous
    little-endian copies are made where needed) with metadata (strings)."""
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    parts, at = [], 0
    for name, arr in tensors.items():
        a = np.asarray(arr)
        name_dt = NAMES.get(a.dtype.newbyteorder("<").str if a.dtype.byteorder == ">" else a.dtype.str)
        if name_dt is None:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
        raw = np.ascontiguousarray(a, dtype=np.dtype(DTYPES[name_dt])).tobytes()
        header[name] = {"dtype": name_dt, "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        parts.append(raw)
        at += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)   # the data 8-byte aligned, as restps writes it
    return struct.pack("<Q", len(head)) + head + b"".join(parts)


def decode(body: bytes, copy: bool = True) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """(tensors, metadata) of a safetensors body, every offset checked.
    copy=False gives read-only views into body."""
    if len(body) < 8:
        raise ProtocolError(f"safetensors body of {len(body)} bytes: shorter than its 8-byte prefix")
    (hl,) = struct.unpack_from("<Q", body)
    if hl > min(HEADER_MAX, len(body) - 8):
        raise ProtocolError(f"safetensors header length {hl} does not fit a body of {len(body)} bytes")
    try:
        header = json.loads(bytes(body[8:8 + hl]).decode("utf-8"))
    except ValueError as e:
        raise ProtocolError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data = memoryview(body)[8 + hl:]
    out: Dict[str, np.ndarray] = {}
    for name, d in header.items():
        try:
            dt = np.dtype(DTYPES[d["dtype"]])
            shape = tuple(int(s) for s in d["shape"])
            begin, end = (int(x) for x in d["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"safetensors tensor {name!r}: bad entry {d!r}") from None
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not 0 <= begin <= end <= len(data) or end - begin != n * dt.itemsize:
            raise ProtocolError(f"safetensors tensor {name!r}: offsets [{begin}, {end}) do not hold "
                                f"{d['dtype']} {list(shape)}")
        arr = np.frombuffer(data[begin:end], dtype=dt).reshape(shape)
        out[name] = arr.astype(dt.newbyteorder("="), copy=True) if copy else arr
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ProtocolError("safetensors __metadata__ is not a map of strings")
    return out, meta
